// Package metrics holds tether's Prometheus collectors. The registry is
// injected: nothing registers itself globally.
package metrics

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/identity"
)

// Metrics records what the request path does.
type Metrics struct {
	requests          *prometheus.CounterVec
	failovers         *prometheus.CounterVec
	identityRejected  *prometheus.CounterVec
	decisionErrors    *prometheus.CounterVec
	storeErrors       prometheus.Counter
	decisionSeconds   prometheus.Histogram
	upstreamResponses *prometheus.CounterVec
	loadSyncFailures  prometheus.Counter
	indexErrors       prometheus.Counter
	redisUp           prometheus.Gauge
	redisOpens        prometheus.Counter
}

// New creates the collectors and registers them with reg.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		failovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_failovers_total",
			Help: "Requests of sessions whose instance was out (breaker open), by the fallback ladder's rung: same_zone, other_zone (rebound) or random.",
		}, []string{"stage"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_requests_total",
			Help: "Routing decisions by mode (sticky, adaptive, random), decision (hit, bind, rebind, moved, migrated, drained, spilled, random, anonymous, degraded) and identity source.",
		}, []string{"mode", "decision", "source"}),
		identityRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_identity_rejected_total",
			Help: "Requests whose identifier was present but unusable (too long, control characters, malformed bearer token); they are routed as anonymous.",
		}, []string{"header", "reason"}),
		decisionErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_decision_errors_total",
			Help: "Requests tether could not place; Envoy routes them on its default route.",
		}, []string{"reason"}),
		storeErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tether_store_errors_total",
			Help: "Binding store calls that failed; the request was placed by rendezvous hashing instead.",
		}),
		decisionSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tether_decision_duration_seconds",
			Help:    "Time to decide a request's instance, store round trip included.",
			Buckets: []float64{50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3},
		}),
		upstreamResponses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_upstream_responses_total",
			Help: "Response statuses seen per instance, by status class (2xx…5xx).",
		}, []string{"upstream", "code"}),
		loadSyncFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tether_load_sync_failures_total",
			Help: "Failed exchanges of load (sessions per instance, requests in flight, drained instances) with the other replicas; placement used the last view.",
		}),
		indexErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tether_session_index_errors_total",
			Help: "Failed writes to the per-instance session index; the binding itself was stored, active-session counts may lag.",
		}),
		redisUp: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tether_redis_up",
			Help: "1 while the binding store's breaker on Redis is closed, 0 while it is open (Redis unreachable: requests are placed by rendezvous hashing without calling it).",
		}),
		redisOpens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tether_redis_breaker_opens_total",
			Help: "Times the binding store's breaker on Redis opened after consecutive failed calls (a start without Redis included; reopenings after a failed probe are not counted).",
		}),
	}
	reg.MustRegister(m.requests, m.failovers, m.identityRejected, m.decisionErrors, m.storeErrors, m.decisionSeconds, m.upstreamResponses,
		m.loadSyncFailures, m.indexErrors, m.redisUp, m.redisOpens)
	return m
}

// Decision records one decision.
func (m *Metrics) Decision(id identity.Identity, d affinity.Decision, took time.Duration) {
	if id.Rejected != identity.ReasonNone {
		m.identityRejected.WithLabelValues(id.Header, string(id.Rejected)).Inc()
	}
	if d.Err != nil {
		m.storeErrors.Inc()
	}
	m.requests.WithLabelValues(string(d.Mode), string(d.Kind), string(id.Source)).Inc()
	if d.Stage != affinity.StageNone {
		m.failovers.WithLabelValues(d.Stage.String()).Inc()
	}
	m.decisionSeconds.Observe(took.Seconds())
}

// DecisionFailed records a request that got no decision.
func (m *Metrics) DecisionFailed(id identity.Identity, reason string) {
	if id.Rejected != identity.ReasonNone {
		m.identityRejected.WithLabelValues(id.Header, string(id.Rejected)).Inc()
	}
	m.decisionErrors.WithLabelValues(reason).Inc()
}

// Response records the status an instance answered with.
func (m *Metrics) Response(instance string, status int) {
	m.upstreamResponses.WithLabelValues(instance, statusClass(status)).Inc()
}

func statusClass(s int) string {
	if s < 100 || s > 599 {
		return "invalid"
	}
	return strconv.Itoa(s/100) + "xx"
}

// LoadSyncFailures counts failed load exchanges with the other replicas.
func (m *Metrics) LoadSyncFailures() prometheus.Counter { return m.loadSyncFailures }

// IndexError counts a failed session index write.
func (m *Metrics) IndexError(error) { m.indexErrors.Inc() }

// RedisBreaker records the state of the store's breaker on Redis: the
// store's OnBreaker hook, which reports the state at start, then each
// opening and closing.
func (m *Metrics) RedisBreaker(open bool) {
	if open {
		m.redisUp.Set(0)
		m.redisOpens.Inc()
		return
	}
	m.redisUp.Set(1)
}
