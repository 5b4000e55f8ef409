package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tetherproxy/tether/fleet"
)

// Breaker records the instance breaker: circuit states, their changes,
// the sessions moved off an instance whose circuit opened, and the shared
// store's trouble.
type Breaker struct {
	state       *prometheus.GaugeVec
	transitions *prometheus.CounterVec
	evacuated   *prometheus.CounterVec
	syncErrors  prometheus.Counter
}

// NewBreaker creates the breaker's collectors and registers them with reg.
// dropped reads how many reports the breaker dropped because its buffer
// to the store was full.
func NewBreaker(reg prometheus.Registerer, dropped func() uint64) *Breaker {
	m := &Breaker{
		state: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tether_instance_breaker_state",
			Help: "Instance breaker state as this replica sees it: 0 closed (available), 1 open (unavailable), 2 half-open (probing).",
		}, []string{"upstream"}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_instance_breaker_transitions_total",
			Help: "Instance breaker state changes seen by this replica, by the state entered.",
		}, []string{"upstream", "state"}),
		evacuated: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_sessions_evacuated_total",
			Help: "Sessions this replica moved off an instance ahead of their next request, after its breaker opened.",
		}, []string{"upstream"}),
		syncErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tether_breaker_store_errors_total",
			Help: "Failed exchanges of breaker state with the store; this replica's own view decides meanwhile.",
		}),
	}
	dropCounter := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "tether_breaker_reports_dropped_total",
		Help: "Breaker reports not shared with the other replicas because the buffer to the store was full.",
	}, func() float64 { return float64(dropped()) })
	reg.MustRegister(m.state, m.transitions, m.evacuated, m.syncErrors, dropCounter)
	return m
}

// Changed records that instance's circuit entered s.
func (m *Breaker) Changed(instance string, s fleet.State) {
	m.state.WithLabelValues(instance).Set(float64(s))
	m.transitions.WithLabelValues(instance, s.String()).Inc()
}

// Evacuated counts n sessions moved off instance.
func (m *Breaker) Evacuated(instance string, n int) {
	m.evacuated.WithLabelValues(instance).Add(float64(n))
}

// StoreError counts a failed exchange with the store.
func (m *Breaker) StoreError() { m.syncErrors.Inc() }
