package store

import (
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/store/memory"
	"github.com/tetherproxy/tether/store/redis"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestOpenEmbedded: "embedded" is the memory store. Its bindings expire on
// the caller's clock (the decider's Since is the wall clock), it is up,
// and Close ends it.
func TestOpenEmbedded(t *testing.T) {
	ctx := t.Context()
	var guard []bool
	s, err := Open(ctx, Embedded, Options{Timeout: time.Second, OnGuard: func(open bool) { guard = append(guard, open) }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	if _, ok := s.(*memory.Store); !ok {
		t.Fatalf("Open(%q) = %T, want *memory.Store", Embedded, s)
	}
	if len(guard) != 1 || guard[0] {
		t.Errorf("OnGuard calls = %v, want one, closed", guard)
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	if h := s.Health(); !h.Up() || h.State != bindings.GuardClosed || h.Failures != 0 || h.Opens != 0 {
		t.Errorf("Health = %+v, want up", h)
	}
	now := time.Now()
	lt := bindings.Lifetime{Idle: 50 * time.Millisecond}
	l := bindings.Lookup{Key: "k", Candidate: bindings.Binding{Instance: "a", Since: now}, Lifetime: lt}
	if res, err := s.GetOrBind(ctx, l); err != nil || res.Origin != bindings.Created {
		t.Fatalf("GetOrBind = %+v, %v; want created", res, err)
	}
	l.Candidate.Since = now.Add(lt.Idle / 2)
	if res, err := s.GetOrBind(ctx, l); err != nil || res.Origin != bindings.Found {
		t.Fatalf("GetOrBind within the idle timeout = %+v, %v; want found", res, err)
	}
	l.Candidate.Since = now.Add(2 * lt.Idle)
	if res, err := s.GetOrBind(ctx, l); err != nil || res.Origin != bindings.Created {
		t.Fatalf("GetOrBind after expiry = %+v, %v; want created", res, err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := s.GetOrBind(ctx, l); !errors.Is(err, memory.ErrClosed) {
		t.Errorf("GetOrBind after Close: %v, want ErrClosed", err)
	}
	if err := s.Ping(ctx); err == nil {
		t.Error("Ping after Close succeeded")
	}
}

// TestOpenRedis: any other URL is a Redis store; a bad one is refused with
// a *redis.URLError that hides the password.
func TestOpenRedis(t *testing.T) {
	r := testenv.RedisServer(t)
	s, err := Open(t.Context(), r.URL(), Options{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, ok := s.(*redis.Store); !ok {
		t.Fatalf("Open(%q) = %T, want *redis.Store", r.URL(), s)
	}
	if err := s.Ping(t.Context()); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	for _, bad := range []string{"", "Embedded", "embedded?addr=h:1", "embedded+cluster://u:hunter2@h:1", "http://u:hunter2@h:1"} {
		s, err := Open(t.Context(), bad, Options{})
		var ue *redis.URLError
		if !errors.As(err, &ue) || s != nil {
			t.Errorf("Open(%q) = %v, %v; want a *redis.URLError", bad, s, err)
			continue
		}
		if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("Open(%q): the error shows the password: %v", bad, err)
		}
	}
}

func TestCheckURL(t *testing.T) {
	if err := CheckURL(Embedded); err != nil {
		t.Errorf("CheckURL(%q) = %v, want nil", Embedded, err)
	}
	if err := CheckURL("redis+cluster://10.0.0.1:7000?addr=10.0.0.2:7000"); err != nil {
		t.Errorf("CheckURL(cluster) = %v, want nil", err)
	}
	for _, bad := range []string{"embedded://u:hunter2@h:1", "rediss+embedded://h:1", "embedded/1", " embedded"} {
		err := CheckURL(bad)
		var ue *redis.URLError
		if !errors.As(err, &ue) {
			t.Errorf("CheckURL(%q) = %v, want a *redis.URLError", bad, err)
		} else if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("CheckURL(%q): the error shows the password: %v", bad, err)
		}
	}
}
