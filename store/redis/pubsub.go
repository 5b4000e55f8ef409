package redis

import (
	"context"
	"errors"
	"time"

	goredis "github.com/redis/go-redis/v9"
)

// The store's subscriptions are kept alike. They are the hit cache's
// invalidations, a sentinel's master switches and the content channel.
// Each is one subscription after another until the store closes. Each
// subscription is read until it fails, or until a PING sent after a
// silence goes unanswered.

// keepSubscribed runs subscriptions until ctx ends: subscribe opens one,
// read reads it until it fails and reports whether it had worked. After
// each it waits a backoff of 50 ms, doubling to 1 s, back to 50 ms after
// one that worked. A read in progress does not see ctx end: closing the
// subscription ends it, so a stop does not wait for the ping.
func keepSubscribed(ctx context.Context, subscribe func() *goredis.PubSub, read func(*goredis.PubSub) bool) {
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		ps := subscribe()
		unwatch := context.AfterFunc(ctx, func() { _ = ps.Close() })
		worked := read(ps)
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

// listen reads one subscription (of one channel) until it fails, a PING
// sent after ping of silence goes unanswered, or on returns false, handing
// on every message. It reports whether the subscription had worked (its
// subscribe confirmation came).
func listen(ctx context.Context, ps *goredis.PubSub, ping time.Duration, on func(msg any) bool) (worked bool) {
	pinged := false
	for {
		msg, err := ps.ReceiveTimeout(ctx, ping)
		if err != nil {
			if pinged || !worked || !silence(ctx, err) || ps.Ping(ctx) != nil {
				return worked
			}
			pinged = true
			continue
		}
		pinged = false
		if m, ok := msg.(*goredis.Subscription); ok && (m.Kind == "subscribe" || m.Kind == "ssubscribe") {
			worked = true
		}
		if !on(msg) {
			return worked
		}
	}
}

// silence reports whether err is a receive's timeout while ctx is live:
// nothing came, which a PING tells from a dead connection.
func silence(ctx context.Context, err error) bool {
	var ne interface{ Timeout() bool }
	return ctx.Err() == nil && errors.As(err, &ne) && ne.Timeout()
}
