package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/workload"
)

// QualityRow is one routing policy on the field's mix.
type QualityRow struct {
	Policy  string
	HitRate float64 // cached / prompt tokens
	// TTFT is the time to the first token (streamed answers): the part of
	// latency a KV-cache hit shortens. Latency is end to end, mostly decode.
	TTFTP50, TTFTP99       time.Duration
	LatencyP50, LatencyP99 time.Duration
	Continuity             float64 // follow-ups on the previous turn's instance
	// Imbalance is max / mean emulated GPU-seconds per instance: work, not
	// request counts (a 16k-token document is not a 20-token query).
	Imbalance float64
	// GPUBusy is the emulated GPU time spent over the time the fleet had.
	GPUBusy float64
	// GPUSecondsPer1kOutput is the emulated GPU time spent per 1,000
	// output tokens: the cost figure.
	GPUSecondsPer1kOutput float64
	Requests, Failed      int
	// Decisions counts tether's routing decisions (0 when tether is not on
	// the request path); Spilled is the share of them that moved a session
	// off a saturated instance (tether_requests_total{decision="spilled"}).
	Decisions int
	Spilled   float64
	Spread    Spread
	// ContentResults counts the bodies tether asked Envoy for, by result
	// of tether_content_decisions_total (placed, identity, short, …): none
	// unless the row runs [content] (the documents scenario's).
	ContentResults map[string]float64
	// Sim is the simulator's figures for the policy (crossCheckQuality).
	Sim Sim
}

// a100Fleet starts n emulated A100 instances in two zones in turn.
func a100Fleet(sc Scale, n int) (*simFleet, []config.Instance, error) {
	return a100FleetCache(sc, n, emulator.CacheConfig{})
}

// a100FleetCache is a100Fleet with each KV cache configured as cache
// (zero fields: the profile's capacity, the emulator's conversation cap).
func a100FleetCache(sc Scale, n int, cache emulator.CacheConfig) (*simFleet, []config.Instance, error) {
	return a100FleetEngine(sc, n, cache, emulator.EngineVLLM)
}

// a100FleetEngine is a100FleetCache with instances that imitate engine.
func a100FleetEngine(sc Scale, n int, cache emulator.CacheConfig, engine string) (*simFleet, []config.Instance, error) {
	f := newSimFleet(func(string) (emulator.LatencyModel, error) {
		return emulator.NewGPU(emulator.GPUConfig{Profile: emulator.ProfileA100(), TimeScale: sc.TimeScale, Cache: cache})
	})
	f.engine = engine
	var out []config.Instance
	for i := 0; i < n; i++ {
		zone := []string{"zone-a", "zone-b"}[i%2]
		in, err := f.add(fmt.Sprintf("a100-%d", i), zone)
		if err != nil {
			f.close()
			return nil, nil, err
		}
		out = append(out, in)
	}
	return f, out, nil
}

func runQuality(ctx context.Context, opts Options, dir string) ([]QualityRow, error) {
	fleet, instances, err := a100Fleet(opts.Scale, 8)
	if err != nil {
		return nil, err
	}
	defer fleet.close()
	var rows []QualityRow
	for _, p := range []policy{policyRoundRobin, policyRingHash, policyRandom, policySticky, policyAdaptive(opts.Saturation)} {
		fmt.Fprintf(opts.Log, "quality: %s (%s)\n", p.name, opts.Scale.Duration)
		if err := fleet.reset(ctx); err != nil {
			return rows, err
		}
		st, err := startStack(ctx, opts, dir, p, instances)
		if err != nil {
			return rows, fmt.Errorf("%s: %w", p.name, err)
		}
		res, err := replay(ctx, opts, st.envoy.URL(), instances)
		var dec map[string]float64
		if err == nil {
			dec, err = decisions(ctx, st.tether.Admin)
		}
		st.close()
		if err != nil {
			return rows, fmt.Errorf("%s: %w", p.name, err)
		}
		stats, err := fleet.stats(ctx)
		if err != nil {
			return rows, err
		}
		row := qualityRow(p.name, res.Summary, stats, opts.Scale)
		row.Spilled, row.Decisions = spilledShare(dec)
		row.Spread = spreadOf(names(instances), answeredBy(res.Records), fleet.queueDepths())
		rows = append(rows, row)
	}
	if err := crossCheckQuality(ctx, opts, rows); err != nil {
		return rows, err
	}
	return rows, nil
}

func names(instances []config.Instance) []string {
	out := make([]string, len(instances))
	for i, in := range instances {
		out[i] = in.Name
	}
	return out
}

// answeredBy lists the instance of every answered record.
func answeredBy(recs []loadgen.Record) []string {
	var out []string
	for _, r := range recs {
		if r.Instance != "" {
			out = append(out, r.Instance)
		}
	}
	return out
}

// replay runs the workload against url at the scale's rate and duration.
func replay(ctx context.Context, opts Options, url string, instances []config.Instance) (*loadgen.Result, error) {
	return replayFor(ctx, opts, opts.Scale.Duration, url, instances)
}

// replayFor runs the workload against url at the scale's rate for d.
func replayFor(ctx context.Context, opts Options, d time.Duration, url string, instances []config.Instance) (*loadgen.Result, error) {
	return replayWorkload(ctx, opts, workload.Config{Seed: opts.Seed}, opts.Scale.Rate, d, url, instances)
}

// replayWorkload runs w against url at rate for d, streamed, with the
// scale's think times and loadgen's drain (as simOptions simulates it).
func replayWorkload(ctx context.Context, opts Options, w workload.Config, rate float64, d time.Duration, url string, instances []config.Instance) (*loadgen.Result, error) {
	return loadgen.Run(ctx, replayOptions(opts, w, rate, d, url, instances))
}

// replayOptions are replayWorkload's load generator options.
func replayOptions(opts Options, w workload.Config, rate float64, d time.Duration, url string, instances []config.Instance) loadgen.Options {
	return loadgen.Options{
		Target:     url,
		Workload:   w,
		Rate:       rate,
		Duration:   d,
		Drain:      30 * time.Second,
		ThinkScale: opts.Scale.ThinkScale,
		Instances:  names(instances),
		Stream:     true,
	}
}

func qualityRow(name string, s loadgen.Summary, stats []emulator.Stats, sc Scale) QualityRow {
	row := QualityRow{
		Policy: name, HitRate: s.KVHitRate,
		TTFTP50: s.TTFB.P50, TTFTP99: s.TTFB.P99, LatencyP50: s.Latency.P50, LatencyP99: s.Latency.P99,
		Continuity: s.Continuity,
		Requests:   s.Requests, Failed: s.Failed + s.Dropped + s.Cancelled,
	}
	var total, most float64
	var out int64
	for _, st := range stats {
		gpu := 0.0
		if st.Model != nil {
			gpu = st.Model.PrefillGPUSeconds + st.Model.DecodeGPUSeconds
		}
		total += gpu
		most = max(most, gpu)
		out += st.CompletionTokens
	}
	if len(stats) > 0 && total > 0 {
		row.Imbalance = most / (total / float64(len(stats)))
		// Emulated time runs 1/TimeScale times faster than the wall clock.
		row.GPUBusy = total / (float64(len(stats)) * sc.Duration.Seconds() / sc.TimeScale)
	}
	if out > 0 {
		row.GPUSecondsPer1kOutput = total / float64(out) * 1000
	}
	return row
}
