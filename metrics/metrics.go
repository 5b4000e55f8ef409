// Package metrics holds tether's Prometheus collectors. The registry is
// injected: nothing registers itself globally. A label naming a GPU
// instance is called upstream. Prometheus gives every scraped series an
// instance label of its own, the tether replica, which would rename ours.
package metrics

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
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
	inference         *prometheus.HistogramVec
	followups         *prometheus.CounterVec
	migrations        *prometheus.CounterVec
	oom               *prometheus.CounterVec
	gpu               *prometheus.GaugeVec
	reportErrors      *prometheus.CounterVec
	outcomes          *prometheus.CounterVec
	promptTokens      *prometheus.CounterVec
	usageMissing      prometheus.Counter
	content           *prometheus.CounterVec
	sessions          *SessionLengths // nil: not tracked (TrackSessions)

	// The children the request path counts into, cached (children).
	requestsBy  *children[requestLabels, prometheus.Counter]
	responsesBy *children[responseLabels, prometheus.Counter]
	inferenceBy [2]prometheus.Observer // sticky, random
	followupsBy [2]prometheus.Counter  // broken, kept
}

type requestLabels struct{ mode, kind, source string }

type responseLabels struct {
	upstream string
	class    int // status / 100; 0 for an invalid status
}

// New creates the collectors and registers them with reg.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{}
	reg.MustRegister(m.decisionCollectors()...)
	reg.MustRegister(m.answerCollectors()...)
	reg.MustRegister(m.storeCollectors()...)
	m.requestsBy = newChildren(func(l requestLabels) prometheus.Counter {
		return m.requests.WithLabelValues(l.mode, l.kind, l.source)
	})
	m.responsesBy = newChildren(func(l responseLabels) prometheus.Counter {
		return m.upstreamResponses.WithLabelValues(l.upstream, classLabel(l.class))
	})
	m.inferenceBy = [2]prometheus.Observer{m.inference.WithLabelValues("sticky"), m.inference.WithLabelValues("random")}
	m.followupsBy = [2]prometheus.Counter{m.followups.WithLabelValues("broken"), m.followups.WithLabelValues("kept")}
	return m
}

// decisionCollectors are how each request was placed, and how long
// deciding took.
func (m *Metrics) decisionCollectors() []prometheus.Collector {
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_requests_total",
		Help: "Routing decisions by mode (sticky, adaptive, random), decision (hit, bind, rebind, moved, migrated, drained, spilled, random, anonymous, degraded, failover, fallback, expired) and identity source.",
	}, []string{"mode", "decision", "source"})
	m.failovers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_failovers_total",
		Help: "Requests of sessions whose instance was out (breaker open), by the fallback ladder's rung: same_zone, other_zone (rebound) or random.",
	}, []string{"stage"})
	m.identityRejected = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_identity_rejected_total",
		Help: "Requests whose identifier was present but unusable (too long, control characters, malformed bearer token); they are routed as anonymous.",
	}, []string{"header", "reason"})
	m.decisionErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_decision_errors_total",
		Help: "Requests tether could not place; Envoy routes them on its default route.",
	}, []string{"reason"})
	m.decisionSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "tether_decision_duration_seconds",
		Help:    "Time to decide a request's instance, store round trip included.",
		Buckets: []float64{50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3},
	})
	m.migrations = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_session_migrations_total",
		Help: "Sessions moved to another instance at a request, by the instance they left and the reason (the decision: moved, migrated, drained, spilled, failover, rebind). Sessions moved ahead of their next request when a breaker opened are counted in tether_sessions_evacuated_total.",
	}, []string{"upstream", "reason"})
	m.content = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_content_decisions_total",
		Help: "Requests whose placement was open (a new session, one placed again, an anonymous request) with cache-aware placement on, by what their body did: " +
			"placed (by what the caches hold of the prompt against each instance's work); identity (read, but no instance holds enough of it); " +
			"not fetched or unusable, each placed by identity: encoded (compressed), over_limit (longer than Envoy's buffer), incomplete (the stream ended first), " +
			"not_json, not_prompt, bad_messages, short (under one block).",
	}, []string{"result"})
	return []prometheus.Collector{m.requests, m.failovers, m.identityRejected, m.decisionErrors, m.decisionSeconds, m.migrations, m.content}
}

// answerCollectors are how requests ended: their status, latency and
// continuity, and what the instances reported.
func (m *Metrics) answerCollectors() []prometheus.Collector {
	m.upstreamResponses = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_upstream_responses_total",
		Help: "Response statuses seen per instance, by status class (2xx…5xx).",
	}, []string{"upstream", "code"})
	m.inference = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tether_inference_duration_seconds",
		Help:    "Time from a request's headers to its response headers as tether sees them (queueing and prefill: the part a KV-cache hit shortens), by route: sticky (sticky and adaptive modes) or random (random mode, anonymous callers, the random fallback rung). Envoy's own replies without an instance are left out.",
		Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
	}, []string{"route"})
	m.followups = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_followups_total",
		Help: "Answered follow-up requests of bound sessions, by continuity: kept when the instance the session was bound to (the one holding its KV cache) answered it without error, broken otherwise (moved, failed over, retried on a peer, or a 5xx). Continuity rate = kept / all.",
	}, []string{"continuity"})
	m.oom = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_instance_oom_total",
		Help: "Out-of-memory answers per instance: status 507, or the instance's out-of-memory report header.",
	}, []string{"upstream"})
	m.gpu = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "tether_instance_gpu_utilization_ratio",
		Help: "GPU utilisation (0 to 1) the instance last reported in its response header.",
	}, []string{"upstream"})
	m.reportErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_instance_report_errors_total",
		Help: "Instance report headers (queue depth, GPU utilisation, out of memory) that were present but unreadable; the value was ignored.",
	}, []string{"header"})
	m.outcomes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_outcomes_total",
		Help: "Outcome reports that reached tether apart from the routing exchange (Envoy's access log, an observing filter), by result: " +
			"applied; undecided (no ticket: tether did not route the request); malformed; forged (not signed by this deployment); " +
			"late (decided more than 15 min before); duplicate (applied already). Only applied ones reach the breaker and the load view.",
	}, []string{"result"})
	m.promptTokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_prompt_tokens_total",
		Help: "Prompt tokens of the answers whose usage tether read (a gateway streaming response bodies), per instance, by cached: " +
			"true for those the engine's KV cache held (usage.prompt_tokens_details.cached_tokens), false for the rest. " +
			"KV hit rate = cached / all.",
	}, []string{"upstream", "cached"})
	m.usageMissing = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tether_answers_without_usage_total",
		Help: "Streamed answers that ended without a usage object tether could read (the engine reports none, or the client did not ask for it).",
	})
	return []prometheus.Collector{m.upstreamResponses, m.inference, m.followups, m.oom, m.gpu, m.reportErrors, m.outcomes, m.promptTokens, m.usageMissing}
}

// storeCollectors are the binding store's failures and its guard, and
// the load sync's failures.
func (m *Metrics) storeCollectors() []prometheus.Collector {
	m.storeErrors = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tether_store_errors_total",
		Help: "Binding store calls that failed; the request was placed by rendezvous hashing instead.",
	})
	m.loadSyncFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tether_load_sync_failures_total",
		Help: "Failed exchanges of load (sessions per instance, requests in flight, drained instances) with the other replicas; placement used the last view.",
	})
	m.indexErrors = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tether_session_index_errors_total",
		Help: "Failed writes to the per-instance session index; the binding itself was stored, active-session counts may lag.",
	})
	m.redisUp = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "tether_redis_up",
		Help: "1 while the binding store's breaker on Redis is closed, 0 while it is open (Redis unreachable: requests are placed by rendezvous hashing without calling it).",
	})
	m.redisOpens = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tether_redis_breaker_opens_total",
		Help: "Times the binding store's breaker on Redis opened after consecutive failed calls (a start without Redis included; reopenings after a failed probe are not counted).",
	})
	return []prometheus.Collector{m.storeErrors, m.loadSyncFailures, m.indexErrors, m.redisUp, m.redisOpens}
}

// Decision records one decision.
func (m *Metrics) Decision(id identity.Identity, d affinity.Decision, took time.Duration) {
	if id.Rejected != identity.ReasonNone {
		m.identityRejected.WithLabelValues(id.Header, string(id.Rejected)).Inc()
	}
	if d.Err != nil {
		m.storeErrors.Inc()
	}
	m.requestsBy.of(requestLabels{string(d.Mode), string(d.Kind), string(id.Source)}).Inc()
	if d.Stage != affinity.StageNone {
		m.failovers.WithLabelValues(d.Stage.String()).Inc()
	}
	if moved(d) {
		m.migrations.WithLabelValues(d.Previous, string(d.Kind)).Inc()
	}
	m.decisionSeconds.Observe(took.Seconds())
	if m.sessions != nil {
		m.sessions.Seen(d.Key, d.Requests, time.Now())
	}
}

// moved reports whether d rebound its session to another instance. A
// fallback routes one request elsewhere but keeps the binding, and a
// degraded decision stored nothing.
func moved(d affinity.Decision) bool {
	return d.Previous != "" && d.Instance.Name != d.Previous &&
		d.Kind != affinity.KindFallback && d.Kind != affinity.KindDegraded
}

// DecisionFailed records a request that got no decision.
func (m *Metrics) DecisionFailed(id identity.Identity, reason string) {
	if id.Rejected != identity.ReasonNone {
		m.identityRejected.WithLabelValues(id.Header, string(id.Rejected)).Inc()
	}
	m.decisionErrors.WithLabelValues(reason).Inc()
}

// Usage counts the prompt tokens of an answer, cached and not, or an
// answer without usage.
func (m *Metrics) Usage(d affinity.Decision, prompt, cached int, ok bool) {
	if !ok || prompt < 0 || cached < 0 || cached > prompt {
		m.usageMissing.Inc()
		return
	}
	m.promptTokens.WithLabelValues(d.Instance.Name, "true").Add(float64(cached))
	m.promptTokens.WithLabelValues(d.Instance.Name, "false").Add(float64(prompt - cached))
}

// Reported counts one outcome report by its result.
func (m *Metrics) Reported(result string) { m.outcomes.WithLabelValues(result).Inc() }

// Content counts one decision whose placement was open, by what its body
// did.
func (m *Metrics) Content(result string) { m.content.WithLabelValues(result).Inc() }

// Response records how a decided request was answered. r is how it
// ended, when it had response headers.
func (m *Metrics) Response(d affinity.Decision, r fleet.Outcome) {
	instance := d.Instance.Name
	m.responsesBy.of(responseLabels{instance, statusClass(r.Status)}).Inc()
	for _, h := range r.BadReports {
		m.reportErrors.WithLabelValues(h).Inc()
	}
	if !r.Answered {
		return
	}
	route := 0 // sticky
	if d.Mode == affinity.Random {
		route = 1
	}
	m.inferenceBy[route].Observe(r.Elapsed.Seconds())
	if d.Previous != "" {
		kept := d.Instance.Name == d.Previous && !r.Peer && r.Status < 500
		m.followupsBy[continuity(kept)].Inc()
	}
	if r.Peer {
		return // the reports are a peer's, not the instance's
	}
	if r.OOM {
		m.oom.WithLabelValues(instance).Inc()
	}
	if r.GPUKnown {
		m.gpu.WithLabelValues(instance).Set(r.GPU)
	}
}

// continuity indexes followupsBy.
func continuity(kept bool) int {
	if kept {
		return 1
	}
	return 0
}

// statusClass is s's class: 1 to 5, 0 for an invalid status.
func statusClass(s int) int {
	if s < 100 || s > 599 {
		return 0
	}
	return s / 100
}

func classLabel(class int) string {
	if class == 0 {
		return "invalid"
	}
	return strconv.Itoa(class) + "xx"
}

// LoadSyncFailures counts failed load exchanges with the other replicas.
func (m *Metrics) LoadSyncFailures() prometheus.Counter { return m.loadSyncFailures }

// IndexError counts a failed session index write.
func (m *Metrics) IndexError(error) { m.indexErrors.Inc() }

// RedisGuard records the state of the store's guard on Redis. It is the
// store's OnGuard hook: it hears the state at start, then each opening
// and closing. The metrics keep their "breaker" names.
func (m *Metrics) RedisGuard(open bool) {
	if open {
		m.redisUp.Set(0)
		m.redisOpens.Inc()
		return
	}
	m.redisUp.Set(1)
}
