package redis

// The content share's bus, replicas.ContentBus. The replicas' prefix index
// records are PUBLISHed on the channel <prefix>content. Every replica
// SUBSCRIBEs to it.
//
// Classic pub/sub works alike on a standalone Redis, behind a Sentinel and
// on a Cluster. Behind a Sentinel, the failover client's subscription
// follows the master. On a Cluster, a PUBLISH on any node reaches the
// subscribers of every node over the cluster bus. So each message costs
// every node. That is fine at the rates of cache-aware placement's
// decisions. Sharded pub/sub would keep it to one shard, and is not needed
// yet.
//
// Nothing is stored. A replica that is not subscribed when a message is
// published misses it.

import (
	"context"
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
// ctx ends. It subscribes again when the subscription drops or a ping goes
// unanswered. It waits a backoff of 50 ms first, doubling to 1 s. The hit
// cache's invalidation subscription does the same (cache.go).
func (s *Store) SubscribeContent(ctx context.Context, on func(msg []byte)) {
	keepSubscribed(ctx, func() *goredis.PubSub { return s.client.Subscribe(ctx, s.contentChannel()) }, func(ps *goredis.PubSub) bool {
		return listen(ctx, ps, contentPing, func(msg any) bool {
			if m, ok := msg.(*goredis.Message); ok {
				on([]byte(m.Payload))
			}
			return true
		})
	})
}

func (s *Store) contentChannel() string { return s.prefix + "content" }
