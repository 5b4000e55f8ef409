package metrics

import (
	"context"
	"errors"
	"net"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
)

// Store times the binding store calls the decider makes (Redis on the
// request path) and counts their errors by kind.
type Store struct {
	next    affinity.Store
	seconds *prometheus.HistogramVec
	errors  *prometheus.CounterVec
}

// NewStore wraps next and registers its collectors with reg.
func NewStore(reg prometheus.Registerer, next affinity.Store) *Store {
	s := &Store{
		next: next,
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tether_redis_duration_seconds",
			Help:    "Binding store (Redis) calls made while deciding, by operation (get_or_bind, replace), failed ones included.",
			Buckets: []float64{50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3},
		}, []string{"op"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_redis_errors_total",
			Help: "Failed binding store (Redis) calls made while deciding, by operation and kind: timeout, canceled (the request went away), or error (refused, breaker open, bad reply).",
		}, []string{"op", "kind"}),
	}
	reg.MustRegister(s.seconds, s.errors)
	return s
}

// GetOrBind implements affinity.Store.
func (s *Store) GetOrBind(ctx context.Context, l bindings.Lookup) (bindings.Result, error) {
	start := time.Now()
	r, err := s.next.GetOrBind(ctx, l)
	s.done("get_or_bind", start, err)
	return r, err
}

// Peek implements affinity.Peeker when the store it wraps does. It is not
// timed: it makes no call.
func (s *Store) Peek(key string, now time.Time, lt bindings.Lifetime) (bindings.Binding, bool) {
	if p, ok := s.next.(affinity.Peeker); ok {
		return p.Peek(key, now, lt)
	}
	return bindings.Binding{}, false
}

// Replace implements affinity.Store.
func (s *Store) Replace(ctx context.Context, key, old string, next bindings.Binding, lt bindings.Lifetime) (bindings.Binding, error) {
	start := time.Now()
	b, err := s.next.Replace(ctx, key, old, next, lt)
	s.done("replace", start, err)
	return b, err
}

func (s *Store) done(op string, start time.Time, err error) {
	s.seconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
	if err == nil {
		return
	}
	kind := "error"
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		kind = "timeout"
	case errors.Is(err, context.Canceled):
		kind = "canceled"
	}
	s.errors.WithLabelValues(op, kind).Inc()
}
