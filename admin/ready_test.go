package admin

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/bindings"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

// TestReadinessFollowsTheBreaker: /readyz reports the breaker's state; a
// breaker that is not closed, or a failed ping, makes tether degraded,
// still ready.
func TestReadinessFollowsTheBreaker(t *testing.T) {
	tests := []struct {
		name  string
		store fakeStore
		drain bool
		code  int
		want  map[string]string
	}{
		{"up", fakeStore{state: bindings.GuardClosed}, false, 200, map[string]string{"status": "ready", "store": "ok", "breaker": "closed"}},
		{"ping fails", fakeStore{state: bindings.GuardClosed, pingErr: errors.New("timeout")}, false, 200, map[string]string{"status": "degraded", "store": "unreachable", "breaker": "closed"}},
		{"open", fakeStore{state: bindings.GuardOpen, pingErr: redisstore.ErrGuardOpen}, false, 200, map[string]string{"status": "degraded", "store": "unreachable", "breaker": "open"}},
		{"half-open", fakeStore{state: bindings.GuardHalfOpen, pingErr: redisstore.ErrGuardOpen}, false, 200, map[string]string{"status": "degraded", "store": "unreachable", "breaker": "half-open"}},
		{"probe succeeded", fakeStore{state: bindings.GuardOpen, closeOnPing: true}, false, 200, map[string]string{"status": "ready", "store": "ok", "breaker": "closed"}},
		{"draining, open", fakeStore{state: bindings.GuardOpen, pingErr: redisstore.ErrGuardOpen}, true, 503, map[string]string{"status": "draining", "store": "unreachable", "breaker": "open"}},
		// How a sticky hit is served, for a store with a backend.
		{"cached hits", fakeStore{state: bindings.GuardClosed, hits: redisstore.HitsCached}, false, 200, map[string]string{"status": "ready", "store": "ok", "breaker": "closed", "hits": "cached"}},
		{"one round trip", fakeStore{state: bindings.GuardClosed, hits: redisstore.HitsOneRoundTrip}, false, 200, map[string]string{"status": "ready", "store": "ok", "breaker": "closed", "hits": "one round trip"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewReadiness(&tt.store)
			if tt.drain {
				r.Drain()
			}
			rec := httptest.NewRecorder()
			r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
			var got map[string]string
			if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
				t.Fatal(err)
			}
			if rec.Code != tt.code || !cmp.Equal(got, tt.want) {
				t.Errorf("/readyz: %d %v, want %d %v", rec.Code, got, tt.code, tt.want)
			}
		})
	}
}

// fakeStore stands for the store and its breaker.
type fakeStore struct {
	state   bindings.GuardState
	pingErr error
	// closeOnPing: the ping is the breaker's probe, and succeeds.
	closeOnPing bool
	hits        string
}

func (f *fakeStore) Ping(context.Context) error {
	if f.closeOnPing {
		f.state = bindings.GuardClosed
	}
	return f.pingErr
}

func (f *fakeStore) Health() bindings.Health {
	return bindings.Health{State: f.state, Hits: f.hits}
}
