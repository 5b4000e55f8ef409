package server

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/audit/postgres"
	"github.com/tetherproxy/tether/audit/sinks"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/extproc"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

var _ extproc.Auditor = (*audit.Recorder)(nil)

// auditCloseTimeout bounds the flush of the routing audit on shutdown;
// what is left after it is counted as dropped.
const auditCloseTimeout = 5 * time.Second

// recordBytes is what one record costs in a Redis Stream (MEMORY USAGE
// over 20,000 records with sealed user ids on redis-server 7.0).
const recordBytes = 489

// auditPart is the routing audit [audit] configures: the sink, its
// Writer and the Recorder extproc calls. When the audit is off it does
// nothing and its recorder is nil.
type auditPart struct {
	recorder  extproc.Auditor
	w         *audit.Writer
	closeSink func() error
	log       zerolog.Logger
}

// openAudit opens the audit on the binding store, with the writer's
// counters registered on reg. Missing keys or DSN fail the start with a
// message that names the variable. A PostgreSQL server that cannot be
// reached does not: routing must not wait for the audit. Records fail
// until it answers, counted and alerted on (TetherAuditRecordsLost).
func openAudit(ctx context.Context, a config.Audit, maxUserID int, store *redisstore.Store, reg prometheus.Registerer, log zerolog.Logger) (*auditPart, error) {
	if !a.Enabled {
		return &auditPart{}, nil
	}
	sealer, err := audit.LoadSealer(sinks.Keys(a))
	if err != nil {
		return nil, fmt.Errorf("routing audit ([audit] enabled): %w", err)
	}
	sink, closeSink, err := sinks.OpenLazy(ctx, a, store)
	if err != nil {
		return nil, fmt.Errorf("routing audit ([audit] enabled): %w", err)
	}
	if ps, ok := sink.(*postgres.Sink); ok && !ps.Ready() {
		log.Error().Str("table", ps.Table()).Msg("routing audit: PostgreSQL cannot be reached; tether starts anyway, " +
			"and records fail (tether_audit_records_total{result=\"failed\"}) until it answers")
	}
	warn := log.Sample(&zerolog.BurstSampler{Burst: 5, Period: time.Minute})
	w, err := audit.NewWriter(sink, audit.WriterConfig{
		Buffer: a.Buffer, Batch: a.Batch, SampleRate: a.SampleRate,
		OnError: func(err error) { warn.Warn().Err(err).Str("sink", a.Sink).Msg("routing audit: records not written") },
	})
	if err != nil {
		_ = closeSink()
		return nil, fmt.Errorf("routing audit: %w", err)
	}
	rec, err := audit.NewRecorder(w, sealer, audit.RecorderConfig{MaxUserIDBytes: maxUserID})
	if err == nil {
		err = registerAuditMetrics(reg, w, rec)
	}
	if err != nil {
		_ = w.Close(context.Background())
		_ = closeSink()
		return nil, fmt.Errorf("routing audit: %w", err)
	}
	log.Info().Str("sink", a.Sink).Dur("retention", a.Retention.D).Float64("sample_rate", a.SampleRate).
		Str("key_id", sealer.CurrentKeyID()).Msg("routing audit on")
	if a.Sink == config.AuditSinkRedis && a.RedisURL == "" {
		// About 0.5 KB per record, kept for the whole retention, in the
		// Redis that holds the bindings: at maxmemory the bindings fail
		// (noeviction) or are evicted first (volatile-*).
		log.Warn().Float64("gib_per_day_at_100_rps", 100*86400*recordBytes/(1<<30)).Dur("retention", a.Retention.D).
			Msg("routing audit stream shares the binding store's Redis; size it for the retention, or set audit.redis_url or sink = \"postgres\"")
	}
	return &auditPart{recorder: rec, w: w, closeSink: closeSink, log: log}, nil
}

func (*auditPart) Name() string          { return "routing audit" }
func (*auditPart) Start(context.Context) {}

// Stop flushes the buffered records until ctx ends, and closes the sink.
// The ext_proc server stops before it, so in-flight decisions are
// recorded; the store stops after it, for the Redis sink.
func (p *auditPart) Stop(ctx context.Context) error {
	if p.w == nil {
		return nil
	}
	ev := p.log.Info()
	if err := p.w.Close(ctx); err != nil {
		ev = p.log.Warn().Err(err)
	}
	if err := p.closeSink(); err != nil {
		ev = p.log.Warn().Err(err)
	}
	ev.Uint64("written", p.w.Written()).Uint64("dropped", p.w.Dropped()).Uint64("failed", p.w.Failed()).
		Msg("routing audit closed")
	return nil
}

// registerAuditMetrics exposes the writer's and the recorder's counters.
func registerAuditMetrics(reg prometheus.Registerer, w *audit.Writer, rec *audit.Recorder) error {
	counter := func(name, help string, labels prometheus.Labels, f func() uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return float64(f()) })
	}
	const recordsHelp = "Routing audit records: written (the sink took them), dropped (buffer full, or left at shutdown), " +
		"failed (the sink refused them; not retried), skipped (sampled out)."
	cs := []prometheus.Collector{
		counter("tether_audit_records_total", recordsHelp, prometheus.Labels{"result": "written"}, w.Written),
		counter("tether_audit_records_total", recordsHelp, prometheus.Labels{"result": "dropped"}, w.Dropped),
		counter("tether_audit_records_total", recordsHelp, prometheus.Labels{"result": "failed"}, w.Failed),
		counter("tether_audit_records_total", recordsHelp, prometheus.Labels{"result": "skipped"}, w.Skipped),
		counter("tether_audit_request_ids_generated_total",
			"Decisions recorded under a request id tether generated: x-request-id was absent or not a UUID.", nil, rec.RequestIDsGenerated),
		counter("tether_audit_user_ids_rejected_total",
			"User ids left out of audit records: longer than identity.max_value_bytes, or with control characters.", nil, rec.UserIDsRejected),
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("metrics: %w", err)
		}
	}
	return nil
}
