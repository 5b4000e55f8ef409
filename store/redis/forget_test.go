package redis

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/internal/testenv"
)

// forgetBackends runs fn on miniredis, a real redis-server and a real
// 3-master Redis Cluster (where a script touching two slots would fail
// with CROSSSLOT).
func forgetBackends(t *testing.T, fn func(t *testing.T, c goredis.UniversalClient)) {
	t.Run("miniredis", func(t *testing.T) {
		t.Parallel()
		_, c := miniClient(t)
		fn(t, c)
	})
	t.Run("redis-server", func(t *testing.T) {
		t.Parallel()
		fn(t, testenv.RedisServer(t).Client())
	})
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		fn(t, testenv.RedisCluster(t).Client())
	})
}

func TestForget(t *testing.T) {
	forgetBackends(t, func(t *testing.T, c goredis.UniversalClient) {
		ctx := t.Context()
		s := newStoreT(t, c, testOptions)
		now := time.Now()
		bind := func(key, instance string, aliases ...string) {
			t.Helper()
			l := bindings.Lookup{Key: key, Aliases: aliases, Lifetime: bindings.Lifetime{Idle: time.Hour},
				Candidate: bindings.Binding{Instance: instance, Version: "v1", Since: now}}
			if r, err := s.GetOrBind(ctx, l); err != nil || r.Origin != bindings.Created {
				t.Fatalf("GetOrBind(%s) = %+v, %v", key, r, err)
			}
		}
		exists := func(key string) bool {
			t.Helper()
			n, err := c.Exists(ctx, key).Result()
			if err != nil {
				t.Fatal(err)
			}
			return n == 1
		}
		indexed := func(instance, key string) bool {
			t.Helper()
			_, err := c.ZScore(ctx, s.indexKey(instance), key).Result()
			if err != nil && !errors.Is(err, goredis.Nil) {
				t.Fatal(err)
			}
			return err == nil
		}

		// The user's session, found through a token and a device alias; a
		// second session of theirs; another user's session.
		bind("s:user", "a", "t:user", "d:user")
		bind("t:other-token", "b")
		bind("s:someone-else", "a", "t:someone-else")
		for _, k := range []string{s.bindingKey("s:user"), s.linkKey("t:user"), s.linkKey("d:user"), s.bindingKey("t:other-token")} {
			if !exists(k) {
				t.Fatalf("%s missing before Forget", k)
			}
		}
		if !indexed("a", "s:user") || !indexed("b", "t:other-token") {
			t.Fatal("index entries missing before Forget")
		}

		// By an alias only: its link, and the session it leads to.
		n, err := s.Forget(ctx, []string{"t:user", "", "t:user"})
		if err != nil || n != 1 {
			t.Fatalf("Forget(alias) = %d, %v; want 1 binding", n, err)
		}
		if exists(s.bindingKey("s:user")) || exists(s.linkKey("t:user")) || indexed("a", "s:user") {
			t.Fatal("the alias, its session or the session's index entry survived")
		}
		if !exists(s.linkKey("d:user")) {
			t.Fatal("the device link went too: it was not named")
		}

		// Every key the records hold.
		n, err = s.Forget(ctx, []string{"s:user", "t:user", "d:user", "t:other-token"})
		if err != nil || n != 1 {
			t.Fatalf("Forget(all) = %d, %v; want 1 binding", n, err)
		}
		for _, k := range []string{s.linkKey("d:user"), s.bindingKey("t:other-token")} {
			if exists(k) {
				t.Fatalf("%s survived Forget", k)
			}
		}
		if indexed("b", "t:other-token") {
			t.Fatal("index entry survived Forget")
		}
		if !exists(s.bindingKey("s:someone-else")) || !exists(s.linkKey("t:someone-else")) || !indexed("a", "s:someone-else") {
			t.Fatal("another user's session was touched")
		}

		// Twice: nothing left.
		if n, err := s.Forget(ctx, []string{"s:user", "t:user", "d:user", "t:other-token"}); err != nil || n != 0 {
			t.Fatalf("second Forget = %d, %v; want 0", n, err)
		}
		if n, err := s.Forget(ctx, nil); err != nil || n != 0 {
			t.Fatalf("Forget(nil) = %d, %v", n, err)
		}
	})
}

// TestForgetExpiredBinding: an index entry outlives its binding; the
// instances the caller names find it.
func TestForgetExpiredBinding(t *testing.T) {
	forgetBackends(t, func(t *testing.T, c goredis.UniversalClient) {
		ctx := t.Context()
		s := newStoreT(t, c, testOptions)
		l := bindings.Lookup{Key: "s:gone", Lifetime: bindings.Lifetime{Idle: time.Hour},
			Candidate: bindings.Binding{Instance: "c", Since: time.Now()}}
		if _, err := s.GetOrBind(ctx, l); err != nil {
			t.Fatal(err)
		}
		if err := c.Del(ctx, s.bindingKey("s:gone")).Err(); err != nil { // as if it expired
			t.Fatal(err)
		}
		n, err := s.Forget(ctx, []string{"s:gone"}, "c", "", "never-used")
		if err != nil || n != 0 {
			t.Fatalf("Forget = %d, %v; want 0 bindings", n, err)
		}
		if err := c.ZScore(ctx, s.indexKey("c"), "s:gone").Err(); !errors.Is(err, goredis.Nil) {
			t.Fatalf("index entry: %v; want it gone", err)
		}
	})
}

// TestForgetForeignTypes: a key of another type where a binding or link
// belongs is deleted, not an error.
func TestForgetForeignTypes(t *testing.T) {
	ctx := context.Background()
	_, c := miniClient(t)
	s := newStoreT(t, c, testOptions)
	if err := c.Set(ctx, s.bindingKey("k"), "not a hash", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.HSet(ctx, s.linkKey("k"), "not", "a string").Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Forget(ctx, []string{"k"}); err != nil || n != 1 {
		t.Fatalf("Forget = %d, %v; want 1", n, err)
	}
	if n := c.Exists(ctx, s.bindingKey("k"), s.linkKey("k")).Val(); n != 0 {
		t.Fatalf("%d keys left", n)
	}
}

func TestParseForgetReply(t *testing.T) {
	for _, bad := range [][]any{nil, {int64(1), int64(0), "a"}, {"1", int64(0), "a", ""}, {int64(1), int64(0), int64(3), ""}} {
		if _, err := parseForgetReply(bad); err == nil {
			t.Errorf("parseForgetReply(%v) accepted", bad)
		}
	}
}

// TestNewClient: a client for another Redis than the store's, built from
// the same URLs as Open; errors hide the password.
func TestNewClient(t *testing.T) {
	r := testenv.RedisServer(t)
	c, err := NewClient(r.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Ping(t.Context()).Err(); err != nil {
		t.Fatalf("ping through NewClient(%q): %v", r.URL(), err)
	}
	for _, bad := range []string{"embedded", "", "http://x:1", "redis+cluster://user:hunter2@:1"} {
		_, err := NewClient(bad)
		var ue *URLError
		if !errors.As(err, &ue) {
			t.Errorf("NewClient(%q) = %v, want a *URLError", bad, err)
		} else if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("NewClient(%q): error shows the password: %v", bad, err)
		}
	}
}
