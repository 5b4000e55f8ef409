package redis

// The content share's bus (replicas.ContentBus): the replicas' prefix
// index records, PUBLISHed on the channel <prefix>content, to which every
// replica SUBSCRIBEs. Classic pub/sub works alike on a standalone Redis,
// behind a Sentinel (the failover client's subscription follows the
// master) and on a Cluster, where a PUBLISH on any node reaches the
// subscribers of every node (over the cluster bus: each message costs
// every node, which is fine at the rates of cache-aware placement's
// decisions; sharded pub/sub would keep it to one shard, and is not
// needed yet). Nothing is stored: a replica that is not subscribed when a
// message is published misses it.

import (
	"context"
	"errors"
	"fmt"
	"time"

	goredis "github.com/redis/go-redis/v9"
)

// contentPing is how long a content subscription may stay silent before it
// is pinged; one unanswered ping drops it, and it subscribes again.
const contentPing = 5 * time.Second

// PublishContent sends msg to every replica subscribed to the content
// channel (replicas.ContentBus). It is bounded by ctx and by the store's
// timeout for operations (opContext), and goes through the guard like any
// call.
func (s *Store) PublishContent(ctx context.Context, msg []byte) error {
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	if err := s.client.Publish(ctx, s.contentChannel(), msg).Err(); err != nil {
		return fmt.Errorf("redis publish content: %w", err)
	}
	return nil
}

// SubscribeContent calls on with each message of the content channel until
// ctx ends, subscribing again (after a backoff of 50 ms, doubling to 1 s)
// when the subscription drops or a ping goes unanswered, as the hit
// cache's invalidation subscription does (cache.go).
func (s *Store) SubscribeContent(ctx context.Context, on func(msg []byte)) {
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		ps := s.client.Subscribe(ctx, s.contentChannel())
		// A read in progress does not see ctx end: closing the
		// subscription ends it, so a stop does not wait for the ping.
		unwatch := context.AfterFunc(ctx, func() { _ = ps.Close() })
		worked := s.receiveContent(ctx, ps, on)
		unwatch()
		_ = ps.Close()
		if ctx.Err() != nil {
			return
		}
		if worked {
			backoff = 50 * time.Millisecond
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// receiveContent reads one subscription until it fails, and reports
// whether it had subscribed.
func (s *Store) receiveContent(ctx context.Context, ps *goredis.PubSub, on func([]byte)) (worked bool) {
	pinged := false
	for {
		msg, err := ps.ReceiveTimeout(ctx, contentPing)
		if err != nil {
			var ne interface{ Timeout() bool }
			if ctx.Err() == nil && !pinged && worked && errors.As(err, &ne) && ne.Timeout() {
				pinged = true
				if ps.Ping(ctx) == nil {
					continue
				}
			}
			return worked
		}
		pinged = false
		switch m := msg.(type) {
		case *goredis.Subscription:
			if m.Kind == "subscribe" && m.Channel == s.contentChannel() {
				worked = true
			}
		case *goredis.Message:
			on([]byte(m.Payload))
		}
	}
}

func (s *Store) contentChannel() string { return s.prefix + "content" }
