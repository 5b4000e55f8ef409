package redis

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/internal/testenv"
)

// urlOptions bounds calls generously: these tests are about reaching the
// servers, not the per-call timeout.
var urlOptions = Options{Timeout: 2 * time.Second}

// TestOpenClusterURL opens a real 3-master cluster through its
// redis+cluster URL and checks that bindings work and spread over the
// masters.
func TestOpenClusterURL(t *testing.T) {
	t.Parallel()
	c := testenv.RedisCluster(t)
	a := c.Addrs()
	// One seed in the host, the others as addr parameters.
	url := "redis+cluster://" + a[0] + "?addr=" + a[1] + "&addr=" + a[2]
	s, err := Open(t.Context(), url, urlOptions)
	if err != nil {
		t.Fatalf("Open(%q): %v", url, err)
	}
	defer s.Close()
	if _, ok := s.client.(*goredis.ClusterClient); !ok {
		t.Fatalf("Open(%q) built a %T, want a *redis.ClusterClient", url, s.client)
	}
	getOrBindTwice(t, s, 60)

	// The bindings are spread over every master.
	ctx := t.Context()
	var mu sync.Mutex
	perMaster := map[string]int{}
	err = c.Client().ForEachMaster(ctx, func(ctx context.Context, m *goredis.Client) error {
		keys, err := m.Keys(ctx, "tether:{*}:b").Result()
		mu.Lock()
		perMaster[m.Options().Addr] = len(keys)
		mu.Unlock()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for addr, n := range perMaster {
		total += n
		if n == 0 {
			t.Errorf("master %s holds no binding: %v", addr, perMaster)
		}
	}
	if len(perMaster) != 3 || total != 60 {
		t.Errorf("bindings per master %v, want 60 over 3 masters", perMaster)
	}
	t.Logf("60 bindings over the masters: %v", perMaster)
}

// TestOpenSentinelURL opens a real master through a real sentinel with a
// redis+sentinel URL, the master's password as its password parameter.
func TestOpenSentinelURL(t *testing.T) {
	t.Parallel()
	const password = "sentinel-" + secret
	sen := testenv.RedisSentinel(t, password)
	url := sen.URL()
	if !strings.Contains(url, "password=") {
		t.Fatalf("sentinel URL %q has no password", url)
	}
	opts := urlOptions
	opts.Cache.Enabled = true
	s, err := Open(t.Context(), url, opts)
	if err != nil {
		t.Fatalf("Open(%q): %v", redact(url), err)
	}
	defer s.Close()
	getOrBindTwice(t, s, 10)
	// Behind a Sentinel hits are cached as on a standalone Redis.
	if mode, why := s.Hits(); mode != HitsCached || why != "" || s.cache == nil || s.Health().Hits != HitsCached {
		t.Errorf("sentinel: hits %q (%q), cache %v; want %q", mode, why, s.cache != nil, HitsCached)
	}

	// The bindings are on the master the sentinel named.
	m := goredis.NewClient(&goredis.Options{Addr: sen.MasterAddr(), Password: password})
	defer m.Close()
	keys, err := m.Keys(t.Context(), "tether:{*}:b").Result()
	if err != nil || len(keys) != 10 {
		t.Errorf("master holds %d bindings (%v), want 10", len(keys), err)
	}

	// The wrong master password fails at Open, and the error hides it.
	wrong := strings.Replace(url, "password="+password, "password=wrong-"+secret, 1)
	if _, err := Open(t.Context(), wrong, urlOptions); err == nil || strings.Contains(err.Error(), secret) {
		t.Errorf("Open with a wrong master password: err = %v, want an error without the password", err)
	}
}

// getOrBindTwice binds n sessions, then gets each again: the second call
// finds the binding the first made.
func getOrBindTwice(t *testing.T, s *Store, n int) {
	t.Helper()
	ctx := t.Context()
	now := time.Now()
	look := func(i int) bindings.Lookup {
		return bindings.Lookup{
			Key:       fmt.Sprintf("session-%d", i),
			Candidate: bindings.Binding{Instance: fmt.Sprintf("gpu-%d", i%4), Version: "v1", Since: now},
			Lifetime:  bindings.Lifetime{Idle: time.Minute},
		}
	}
	for i := range n {
		r, err := s.GetOrBind(ctx, look(i))
		if err != nil || r.Origin != bindings.Created {
			t.Fatalf("session %d: first GetOrBind = %+v, %v; want created", i, r, err)
		}
	}
	for i := range n {
		l := look(i)
		want := l.Candidate.Instance
		l.Candidate.Instance = "elsewhere"
		r, err := s.GetOrBind(ctx, l)
		if err != nil || r.Origin != bindings.Found || r.Binding.Instance != want {
			t.Fatalf("session %d: second GetOrBind = %+v, %v; want found on %s", i, r, err, want)
		}
	}
	sess, ok, err := s.Show(ctx, "session-0", now)
	if err != nil || !ok || sess.Binding.Instance != "gpu-0" {
		t.Errorf("Show(session-0) = %+v, %v, %v; want bound to gpu-0", sess, ok, err)
	}
}
