package admin

import (
	"context"
	"encoding/json"
	"net/http"
	"sync"
	"time"

	"github.com/tetherproxy/tether/bindings"
)

// Checker tells readiness whether the binding store reaches its backend.
type Checker interface {
	// Ping returns nil when the backend answers. A store without a backend
	// always does. Ping is bounded like a call of the request path. It is
	// refused at once while the store's guard is open.
	Ping(ctx context.Context) error
	// Health returns the state of the store's guard on its backend,
	// without a round trip. A store without a backend is always up.
	Health() bindings.Health
}

// Readiness answers /readyz.
type Readiness struct {
	store    Checker
	mu       sync.Mutex
	draining bool
}

// NewReadiness returns the readiness of a tether on store.
func NewReadiness(s Checker) *Readiness { return &Readiness{store: s} }

// Drain reports the replica down from now on: it is stopping.
func (r *Readiness) Drain() { r.mu.Lock(); r.draining = true; r.mu.Unlock() }

// ServeHTTP answers /readyz. A store that does not answer leaves tether
// ready but degraded, with 200. tether still routes then, by rendezvous
// hashing. The answer never waits on a dead Redis. The store's guard
// refuses the ping at once while open. Otherwise the store's per-call
// timeout bounds it.
//
// For a store with a backend, the body has two more fields:
//   - "breaker" is the guard's state: closed, open or half-open. Dashboards
//     and probes already read that name.
//   - "hits" says how a sticky hit is served: "cached" is without a round
//     trip; the other value is "one round trip".
func (r *Readiness) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	r.mu.Lock()
	draining := r.draining
	r.mu.Unlock()
	body := map[string]string{"status": "ready", "store": "ok"}
	code := http.StatusOK
	if draining {
		body["status"], code = "draining", http.StatusServiceUnavailable
	}
	ctx, cancel := context.WithTimeout(req.Context(), time.Second)
	defer cancel()
	err := r.store.Ping(ctx)
	h := r.store.Health()
	if err != nil || !h.Up() {
		body["store"] = "unreachable"
		if !draining {
			body["status"] = "degraded"
		}
	}
	body["breaker"] = h.State.String()
	if h.Hits != "" {
		body["hits"] = h.Hits // "cached", or "one round trip" per sticky hit
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}
