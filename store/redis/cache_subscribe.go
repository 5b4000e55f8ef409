package redis

// The hit cache's subscriptions: the invalidation channel, and behind a
// Sentinel the watch of its master switches.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"strings"

	goredis "github.com/redis/go-redis/v9"
)

// subscribe keeps the invalidation subscription, flushing the cache
// whenever it may have missed a message.
func (c *hitCache) subscribe(ctx context.Context) {
	keepSubscribed(ctx, func() *goredis.PubSub {
		c.subMu.Lock()
		switches := c.switches
		c.subMu.Unlock()
		ps := c.s.client.Subscribe(ctx, c.s.channel)
		c.subMu.Lock()
		c.sub = ps
		if c.switches != switches {
			_ = ps.Close() // the master switched while it dialed: perhaps the old one
		}
		c.subMu.Unlock()
		return ps
	}, func(ps *goredis.PubSub) bool {
		worked := listen(ctx, ps, c.opts.PingInterval, func(msg any) bool {
			switch m := msg.(type) {
			case *goredis.Subscription:
				if m.Kind == "subscribe" {
					c.setReady(true)
				}
			case *goredis.Message:
				c.invalidate(m.Payload)
			}
			return true
		})
		c.setReady(false)
		c.subMu.Lock()
		c.sub = nil
		c.subMu.Unlock()
		return worked
	})
}

// switched closes the invalidation subscription, after a sentinel
// announced a new master: subscribe flushes the cache and subscribes
// again, on the new master.
func (c *hitCache) switched() {
	c.subMu.Lock()
	defer c.subMu.Unlock()
	c.switches++
	if c.sub != nil {
		_ = c.sub.Close()
	}
}

// watchSentinel follows one sentinel's +switch-master announcements for
// master, and has the cache resubscribe on each (switched).
//
// The subscription may be on the old master. go-redis's failover client
// leaves it open: it closes the pooled connections only. The old master
// still answers PINGs, and hears nothing the new one publishes until the
// sentinel has made it a replica, seconds later if it can be reached at
// all. Without a flush, the messages published meanwhile would be lost.
// The new subscription goes through the failover client, which asks the
// sentinels for the master.
//
// Each sentinel the URL names is watched, so the last switch heard comes
// after every one of them names the new master. A watch that broke asks
// its sentinel for the master when it is back, so a switch it missed
// resubscribes too.
func (c *hitCache) watchSentinel(ctx context.Context, opts *goredis.Options, master string) {
	sc := goredis.NewSentinelClient(opts)
	defer func() { _ = sc.Close() }()
	last := "" // the master's address this sentinel last named
	keepSubscribed(ctx, func() *goredis.PubSub { return sc.Subscribe(ctx, "+switch-master") }, func(ps *goredis.PubSub) bool {
		return listen(ctx, ps, c.opts.PingInterval, func(msg any) bool {
			switch m := msg.(type) {
			case *goredis.Subscription:
				if m.Kind != "subscribe" {
					return true
				}
				// (Re)subscribed: a switch missed meanwhile shows as
				// another address.
				addr, err := sc.GetMasterAddrByName(ctx, master).Result()
				if err != nil || len(addr) != 2 {
					return false
				}
				if now := net.JoinHostPort(addr[0], addr[1]); now != last {
					if last != "" {
						c.switched()
					}
					last = now
				}
			case *goredis.Message:
				// "<master name> <old ip> <old port> <new ip> <new port>"
				f := strings.Fields(m.Payload)
				if len(f) == 5 && f[0] == master {
					last = net.JoinHostPort(f[3], f[4])
					c.switched()
				}
			}
			return true
		})
	})
}

// invalidate drops the session a message names: a binding key of this
// store's layout. Anything else is counted and ignored.
func (c *hitCache) invalidate(payload string) {
	origin, name, ok := strings.Cut(payload, " ")
	if !ok || origin == "" {
		c.malformed.Add(1)
		return
	}
	key, ok := c.s.sessionOf(name)
	if !ok {
		c.malformed.Add(1)
		return
	}
	if origin == c.s.origin {
		// This store's own change: it dropped (or stored, after a bind)
		// the entry when the script returned.
		return
	}
	c.drop(key)
}

// newOrigin names a store in its invalidation messages.
func newOrigin() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

var tagUnreplacer = strings.NewReplacer("%7B", "{", "%7D", "}", "%25", "%")

// sessionOf is the session key of a binding key name, the inverse of
// bindingKey.
func (s *Store) sessionOf(name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, s.prefix+"{")
	if !ok {
		return "", false
	}
	esc, ok := strings.CutSuffix(rest, "}:b")
	if !ok || esc == "" || strings.ContainsAny(esc, "{}") {
		return "", false
	}
	key := tagUnreplacer.Replace(esc)
	if s.bindingKey(key) != name {
		return "", false // not escaped as bindingKey escapes
	}
	return key, true
}
