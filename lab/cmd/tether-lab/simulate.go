package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/progress"
	"github.com/tetherproxy/tether/lab/bench"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/simulator"
	"github.com/tetherproxy/tether/lab/workload"
)

// simulateFlags are the flags of `tether-lab simulate`.
type simulateFlags struct {
	policy             string
	instances, zones   int
	rate               float64
	duration, drain    time.Duration
	thinkScale         float64
	timeScale          float64
	profile            string
	seed               uint64
	kvCapacityTokens   int
	kvMaxConversations int
	queuedTokens       int
	runningTokens      int
	maxInFlight        int
	idleTimeout        time.Duration
	maxSticky          time.Duration
	mix, identities    string
	stream             bool
	exact              bool
	parallel           int
	likeBench          string
	jsonOut            string
	noProgress         bool
	config             string
	regime             string
	charts             string
	cpuProfile         string
	// changed reports whether a flag was given (the file decides those it
	// names).
	changed func(name string) bool
}

// configDecides are the flags a --config file decides.
var configDecides = map[string]string{
	"instances":           "its [[instances]]",
	"zones":               "its instances' zones",
	"idle-timeout":        "routing.idle_timeout",
	"max-sticky-duration": "routing.max_sticky_duration",
	"queued-tokens":       "content.queued_tokens",
	"running-tokens":      "content.running_tokens",
}

func newSimulateCmd() *cobra.Command {
	var fl simulateFlags
	cmd := &cobra.Command{
		Use:   "simulate",
		Short: "Evaluate routing policies on an emulated GPU fleet in virtual time, at the field's scale in minutes",
		Long: `Simulate the field's traffic mix (the workload tether-lab loadgen replays) on emulated GPU instances
in virtual time: a discrete-event simulation with no network and no sleeping, so an hour at
10,000 requests/s runs in minutes. Requests are routed by tether's own decision code (sticky,
random: affinity.Decider over the in-memory store), by emulations of Envoy's ring hash, round
robin and least request, or by an oracle that reads every instance's cache (the longest cached
prefix, ties to the least loaded; it always runs), and priced by the emulator's cost model (prefix KV cache, prefill queue, decode
batch). The figures are loadgen's and the bench's: KV hit rate (cached / prompt tokens), TTFT and
latency percentiles, the hit rate as a share of the oracle's and of the infinite-cache bound
(prompt tokens repeating a prefix sent before, one never-evicting cache), session continuity, load imbalance, GPU busy, GPU-seconds per 1k output
tokens. Several policies run in parallel, one per CPU. See lab/simulator/README.md.

--like-bench full|smoke takes the rate, duration, think and time scales of 'tether-lab bench''s
quality scenario (8 instances, 2 zones, streamed answers), to cross-check its table.

--config FILE replays a tether configuration: the fleet is its [[instances]] (names, zones,
versions, weights, kv_sessions; their addresses place them on the ring hash), and the policy
"tether" routes exactly as 'tether serve --config FILE' would: its rules, versions and canary,
bounded load, adaptive saturation thresholds, lifetimes and fallback, through the same translation
and the same decider. The file then decides --instances, --zones, --idle-timeout and
--max-sticky-duration (they are refused), --policy all means round-robin, least-request, ring-hash, tether and oracle,
and sticky and random are refused. The emulated GPUs (--profile, --kv-*) stay the flags'.`,
		Example: `  tether-lab simulate --policy all --instances 8 --rate 10000 --duration 1h
  tether-lab simulate --like-bench full --seed 1
  tether-lab simulate --policy sticky --instances 64 --rate 200 --duration 10m --think-scale 1 --json out.json
  tether-lab simulate --config deploy/local/tether.toml --duration 1m`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) (err error) {
			fl.changed = cmd.Flags().Changed
			if err := applyLikeBench(cmd, &fl); err != nil {
				return err
			}
			policies, base, err := simulateOptions(&fl)
			if err != nil {
				return err
			}
			if fl.cpuProfile != "" {
				stop, err := startCPUProfile(fl.cpuProfile)
				if err != nil {
					return err
				}
				defer func() { err = errors.Join(err, stop()) }()
			}
			if fl.regime != "" {
				if fl.changed("duration") {
					return errors.New("--duration: each --regime sets its own (40 to 70 minutes, ten of them warmup)")
				}
				regimes, err := regimesOf(fl.regime)
				if err != nil {
					return err
				}
				return runRegimes(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), &fl, regimes, policies, base)
			}
			if fl.charts != "" {
				return errors.New("--charts: draws the day regime's minutes: use it with --regime day or all")
			}
			return runSimulations(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), &fl, policies, base)
		},
	}
	f := cmd.Flags()
	f.StringVar(&fl.policy, "policy", "all", "routing policy: "+policyNames()+", tether (with --config), or all (comma-separated lists work too; the oracle always runs)")
	f.IntVar(&fl.instances, "instances", simulator.DefaultInstances, "emulated GPU instances")
	f.IntVar(&fl.zones, "zones", simulator.DefaultZones, "zones the instances are spread over, in turn")
	f.Float64Var(&fl.rate, "rate", 10000, "requests per second, follow-up turns included (as tether-lab loadgen's --rate)")
	f.DurationVar(&fl.duration, "duration", time.Hour, "simulated time during which requests start")
	f.DurationVar(&fl.drain, "drain", simulator.DefaultDrain, "after --duration, how long requests may finish before they are cancelled")
	f.Float64Var(&fl.thinkScale, "think-scale", 1, "multiply the think time between turns (mean 5s): 0 none")
	f.Float64Var(&fl.timeScale, "time-scale", 1, "multiply every emulated GPU duration, as tether-lab emulate --time-scale (the bench's smoke scale uses 0.05)")
	f.StringVar(&fl.profile, "profile", "a100", "emulated GPU: "+strings.Join(emulator.ProfileNames(), " or "))
	f.Uint64Var(&fl.seed, "seed", 1, "seed of the workload, the arrival times and the routers' random draws")
	f.IntVar(&fl.kvCapacityTokens, "kv-capacity-tokens", 0, "KV cache of each instance in tokens (default: the profile's)")
	f.IntVar(&fl.kvMaxConversations, "kv-max-conversations", emulator.DefaultMaxConversations,
		"conversations each KV cache keeps, as tether-lab emulate's (0: no cap)")
	f.IntVar(&fl.queuedTokens, "queued-tokens", config.DefaultQueuedTokens,
		"cache-aware: what one request waiting for a prefill on an instance costs a prompt, in tokens (tether's content.queued_tokens)")
	f.IntVar(&fl.runningTokens, "running-tokens", config.DefaultRunningTokens,
		"cache-aware: what one request an instance serves costs a prompt, in tokens (tether's content.running_tokens)")
	f.IntVar(&fl.maxInFlight, "max-inflight", 0,
		fmt.Sprintf("most requests in flight across the fleet, as tether-lab loadgen's (0: %d per instance; -1: no bound)", simulator.DefaultMaxInFlightPerInstance))
	f.DurationVar(&fl.idleTimeout, "idle-timeout", config.DefaultIdleTimeout,
		"sticky: a binding expires after this long unused, as tether's routing.idle_timeout (the bindings held grow with rate × idle timeout)")
	f.DurationVar(&fl.maxSticky, "max-sticky-duration", config.DefaultMaxStickyDuration,
		"sticky: a binding is placed again after this long, as tether's routing.max_sticky_duration (0: never)")
	f.StringVar(&fl.mix, "mix", "", "shares of conversation kinds, as tether-lab loadgen's --mix")
	f.StringVar(&fl.identities, "identities", "", "shares of identity kinds, as tether-lab loadgen's --identities")
	f.BoolVar(&fl.stream, "stream", true, "streamed answers, as the bench asks for them: TTFT is the time to the first token")
	f.BoolVar(&fl.exact, "exact", false, "price each request on its real text through emulator.GPU (slow; a check of the fast path)")
	f.IntVar(&fl.parallel, "parallel", 0, "policies simulated at once (0: one per CPU)")
	f.StringVar(&fl.likeBench, "like-bench", "", "take rate, duration, think and time scales from tether-lab bench's scale: full or smoke")
	f.StringVar(&fl.jsonOut, "json", "", `write the results as JSON to this file ("-" for standard output)`)
	f.BoolVar(&fl.noProgress, "no-progress", false, "do not draw the progress bar on standard error")
	f.StringVar(&fl.regime, "regime", "", "run the regimes instead: "+strings.Join(simulator.RegimeNames(), ", ")+", or all (comma-separated lists work too); each sets its duration and prints a Markdown table")
	f.StringVar(&fl.charts, "charts", "", "with --regime day or all: write the day's minute-by-minute charts (PNG) into this directory")
	f.StringVar(&fl.config, "config", "", "replay a tether configuration: its instances, and its policy as tether serve runs it (policy tether)")
	f.StringVar(&fl.cpuProfile, "cpuprofile", "", "write a CPU profile of the run to this file (go tool pprof); one policy's alone: --policy NAME --parallel 1")
	return cmd
}

// policyNames lists the policies of --policy all.
func policyNames() string {
	var names []string
	for _, p := range simulator.Policies() {
		names = append(names, string(p))
	}
	return strings.Join(names, ", ")
}

// startCPUProfile profiles the process into path until stop.
func startCPUProfile(path string) (stop func() error, err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	return func() error {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		return nil
	}, nil
}

// applyLikeBench sets the flags the user left alone from a bench scale.
func applyLikeBench(cmd *cobra.Command, fl *simulateFlags) error {
	var sc bench.Scale
	switch fl.likeBench {
	case "":
		return nil
	case "full":
		sc = bench.Full
	case "smoke":
		sc = bench.Smoke
	default:
		return fmt.Errorf("--like-bench %q: want full or smoke", fl.likeBench)
	}
	changed := cmd.Flags().Changed
	set := func(name string, apply func()) {
		if !changed(name) {
			apply()
		}
	}
	set("rate", func() { fl.rate = sc.Rate })
	set("duration", func() { fl.duration = sc.Duration })
	set("think-scale", func() { fl.thinkScale = sc.ThinkScale })
	set("time-scale", func() { fl.timeScale = sc.TimeScale })
	if fl.config == "" { // else the file's fleet
		set("instances", func() { fl.instances = 8 })
		set("zones", func() { fl.zones = 2 })
	}
	set("stream", func() { fl.stream = true })
	return nil
}

// simulateOptions checks the flags and turns them into the policies to run
// and the options they share.
func simulateOptions(fl *simulateFlags) ([]simulator.Policy, simulator.Options, error) {
	var cfg *config.Config
	if fl.config != "" {
		for _, name := range slices.Sorted(maps.Keys(configDecides)) {
			if fl.changed != nil && fl.changed(name) {
				return nil, simulator.Options{}, fmt.Errorf("--%s: --config %s decides it (%s)", name, fl.config, configDecides[name])
			}
		}
		c, err := config.Load(fl.config)
		if err != nil {
			return nil, simulator.Options{}, fmt.Errorf("--config: %w", err)
		}
		cfg = &c
	}
	var policies []simulator.Policy
	for name := range strings.SplitSeq(fl.policy, ",") {
		name = strings.TrimSpace(name)
		if strings.EqualFold(name, "all") {
			if cfg != nil {
				policies = append(policies, simulator.ConfigPolicies()...)
			} else {
				policies = append(policies, simulator.Policies()...)
			}
			continue
		}
		p, err := simulator.ParsePolicy(name)
		if err != nil {
			return nil, simulator.Options{}, fmt.Errorf("--policy: %w", err)
		}
		policies = append(policies, p)
	}
	policies = withOracle(policies)
	switch {
	case math.IsNaN(fl.rate) || fl.rate <= 0:
		return nil, simulator.Options{}, fmt.Errorf("--rate %v: want requests per second above 0", fl.rate)
	case fl.kvCapacityTokens == 0 && fl.changed != nil && fl.changed("kv-capacity-tokens"):
		return nil, simulator.Options{}, fmt.Errorf("--kv-capacity-tokens 0: want at least one block (%d tokens); leave it out for the profile's", emulator.BlockSize)
	case fl.instances < 1:
		return nil, simulator.Options{}, fmt.Errorf("--instances %d: want at least 1", fl.instances)
	case fl.zones < 1:
		return nil, simulator.Options{}, fmt.Errorf("--zones %d: want at least 1", fl.zones)
	case fl.drain <= 0:
		return nil, simulator.Options{}, fmt.Errorf("--drain %v: want above 0", fl.drain)
	case math.IsNaN(fl.timeScale) || fl.timeScale <= 0:
		return nil, simulator.Options{}, fmt.Errorf("--time-scale %v: want above 0", fl.timeScale)
	case fl.kvCapacityTokens < 0:
		return nil, simulator.Options{}, fmt.Errorf("--kv-capacity-tokens %d: want 0 (the profile's) or more", fl.kvCapacityTokens)
	case fl.kvMaxConversations < 0:
		return nil, simulator.Options{}, fmt.Errorf("--kv-max-conversations %d: want 0 (no cap) or more", fl.kvMaxConversations)
	case fl.maxInFlight < -1:
		return nil, simulator.Options{}, fmt.Errorf("--max-inflight %d: want -1 (no bound), 0 (the default) or more", fl.maxInFlight)
	case fl.idleTimeout < time.Second:
		return nil, simulator.Options{}, fmt.Errorf("--idle-timeout %v: want at least 1s", fl.idleTimeout)
	case fl.maxSticky < 0:
		return nil, simulator.Options{}, fmt.Errorf("--max-sticky-duration %v: want 0 (never) or more", fl.maxSticky)
	case fl.parallel < 0:
		return nil, simulator.Options{}, fmt.Errorf("--parallel %d: want 0 (one per CPU) or more", fl.parallel)
	}
	profile, err := emulator.ProfileByName(fl.profile)
	if err != nil {
		return nil, simulator.Options{}, fmt.Errorf("--profile: %w", err)
	}
	wl := workload.Config{Seed: fl.seed}
	if fl.mix != "" {
		if wl.Mix, err = workload.ParseMix(fl.mix); err != nil {
			return nil, simulator.Options{}, fmt.Errorf("--mix: %w", err)
		}
	}
	if fl.identities != "" {
		if wl.Identities, err = workload.ParseIdentityMix(fl.identities); err != nil {
			return nil, simulator.Options{}, fmt.Errorf("--identities: %w", err)
		}
	}
	maxConv := fl.kvMaxConversations
	if maxConv == 0 {
		maxConv = -1 // no cap
	}
	opts := simulator.Options{
		Instances:   fl.instances,
		Zones:       fl.zones,
		Profile:     profile,
		TimeScale:   fl.timeScale,
		Cache:       emulator.CacheConfig{CapacityTokens: fl.kvCapacityTokens, MaxConversations: maxConv},
		Workload:    wl,
		Rate:        fl.rate,
		Duration:    fl.duration,
		Drain:       fl.drain,
		ThinkScale:  fl.thinkScale,
		MaxInFlight: fl.maxInFlight,
		Lifetime:    bindings.Lifetime{Idle: fl.idleTimeout, Max: fl.maxSticky},
		Stream:      fl.stream,
		Seed:        fl.seed,
		Exact:       fl.exact,
	}
	if fl.changed("queued-tokens") || fl.changed("running-tokens") {
		opts.ContentCosts = &simulator.ContentCosts{Queued: fl.queuedTokens, Running: fl.runningTokens}
	}
	if cfg != nil {
		opts.Config = cfg
		opts.Instances, opts.Zones, opts.Lifetime = 0, 0, bindings.Lifetime{}
	}
	for _, p := range policies {
		o := opts
		o.Policy = p
		if err := o.Validate(); err != nil {
			if cfg != nil && (p == simulator.Sticky || p == simulator.Random) {
				return nil, simulator.Options{}, fmt.Errorf("--policy %s: with --config, tether routes by the file's [routing]: use --policy tether", p)
			}
			return nil, simulator.Options{}, err
		}
	}
	return policies, opts, nil
}

// runSimulations runs the policies, at most --parallel at once, and
// reports them. An interrupted run (SIGINT) still reports what it measured.
func runSimulations(ctx context.Context, stdout, stderr io.Writer, fl *simulateFlags, policies []simulator.Policy, base simulator.Options) error {
	done, err := simulateAll(ctx, stderr, fl, policies, base)
	if len(done) > 0 {
		if err := writeSimulateTable(stdout, done, fl.config); err != nil {
			return err
		}
		if fl.jsonOut != "" {
			if err := writeJSONFile(fl.jsonOut, stdout, struct {
				Results []*simulator.Result `json:"results"`
			}{done}); err != nil {
				return err
			}
		}
	}
	return err
}

// simulateAll runs the policies on base, at most --parallel at once, and
// returns the results of those that ran (in the policies' order) with
// their errors.
func simulateAll(ctx context.Context, stderr io.Writer, fl *simulateFlags, policies []simulator.Policy, base simulator.Options) ([]*simulator.Result, error) {
	parallel := fl.parallel
	if parallel == 0 {
		parallel = runtime.GOMAXPROCS(0)
	}
	var prog *simulateProgress
	if w := progress.Terminal(stderr); w != nil && !fl.noProgress {
		prog = startSimulateProgress(w, len(policies), base.Duration)
	}
	results := make([]*simulator.Result, len(policies))
	errs := make([]error, len(policies))
	// The policies start costliest first (costliestFirst), so the
	// slowest does not start last: the run takes about as long as its
	// slowest policy, or its share of the CPUs.
	next := make(chan int, len(policies))
	for _, i := range costliestFirst(policies) {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for range min(parallel, len(policies)) {
		wg.Go(func() {
			for i := range next {
				if err := ctx.Err(); err != nil {
					errs[i] = err
					continue
				}
				o := base
				o.Policy = policies[i]
				if prog != nil {
					o.Progress = prog.reporter(i)
				}
				results[i], errs[i] = simulator.Run(ctx, o)
			}
		})
	}
	wg.Wait()
	if prog != nil {
		prog.stop()
	}
	var done []*simulator.Result
	for _, r := range results {
		if r != nil {
			done = append(done, r)
		}
	}
	return done, errors.Join(errs...)
}

// costliestFirst is the indexes of policies, the costliest to simulate
// first, each rank in the given order: the run then takes about as long
// as its slowest policy, or its share of the CPUs, and not a costly
// policy started last. The ranks follow their CPU time on one simulated
// hour of 64 instances at 60 requests/s (BENCHMARKS.md, "Simulator
// speed with the content-reading policies"): tether's decider with cache-aware placement (and a
// configuration's policy, which may have it), adaptive, sticky; SGLang's
// router; tether random, GIE's scorer and the oracle; Envoy's balancers.
func costliestFirst(policies []simulator.Policy) []int {
	rank := func(p simulator.Policy) int {
		switch p {
		case simulator.CacheAware, simulator.Tether:
			return 0
		case simulator.Adaptive:
			return 1
		case simulator.Sticky:
			return 2
		case simulator.SGLangCacheAware:
			return 3
		case simulator.Random, simulator.GIEPrefix, simulator.Oracle:
			return 4
		}
		return 5
	}
	order := make([]int, len(policies))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return rank(policies[a]) - rank(policies[b]) })
	return order
}

// writeSimulateTable prints one row per policy, then what the settings
// were and what the wall clock says.
func writeSimulateTable(w io.Writer, results []*simulator.Result, configFile string) error {
	st := results[0].Settings
	first := "TTFB"
	if st.Stream {
		first = "TTFT"
	}
	fmt.Fprintf(w, "%d × %s instances in %d zones, %.0f requests/s for %s (drain %s), think times ×%g, time scale %g, seed %d\n",
		st.Instances, st.Profile, st.Zones, st.Rate, st.Duration, st.Drain, st.ThinkScale, st.TimeScale, st.Seed)
	fmt.Fprintf(w, "KV cache %d tokens per instance, %s; at most %s requests in flight; sticky bindings idle %s, max %s\n",
		st.Cache.CapacityTokens, convCap(st.Cache.MaxConversations), inFlightCap(st.MaxInFlight), st.IdleTimeout, st.MaxStickyDuration)
	if configFile != "" {
		fmt.Fprintf(w, "instances and tether's policy from %s\n", configFile)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "policy\trequests\tok\tdropped\tcancelled\tKV hit\tof oracle\tof bound\t%s p50\t%s p99\tlatency p50\tlatency p99\tcontinuity\timbalance (req)\tGPU imbalance\tGPU busy\tGPU-s/1k out\t\n", first, first)
	oracle := oracleResult(results)
	for _, r := range results {
		s := r.Summary
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%.1f%%\t%s\t%s\t%s\t%s\t%s\t%s\t%.1f%%\t%.2f\t%.2f\t%.0f%%\t%.2f\t\n",
			r.Settings.Label, s.Requests, s.OK, s.Dropped, s.Cancelled, 100*s.KVHitRate,
			shareOf(s.KVHitRate, oracle), shareOf(s.KVHitRate, r.InfiniteCacheBound),
			simMs(s.TTFB.P50), simMs(s.TTFB.P99), simMs(s.Latency.P50), simMs(s.Latency.P99),
			100*s.Continuity, s.LoadImbalance, r.GPUImbalance, 100*r.GPUBusy, r.GPUSecondsPer1kOutput)
	}
	if b, ok := boundRange(results); ok {
		fmt.Fprintf(tw, "infinite-cache bound\t\t\t\t\t%s\t\t100%%\t\t\t\t\t\t\t\t\t\t\n", b)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	for _, r := range results {
		note := ""
		if r.Interrupted {
			note = " (interrupted)"
		}
		rate := ""
		if r.Wall > 0 {
			rate = fmt.Sprintf(" (%.2fM events/s)", float64(r.Events)/r.Wall.Seconds()/1e6)
		}
		fmt.Fprintf(w, "%s: %d events in %s%s, %s simulated%s\n", r.Settings.Label, r.Events,
			r.Wall.Round(time.Millisecond), rate, r.Simulated.Round(time.Millisecond), note)
	}
	fmt.Fprintln(w, "of oracle: the KV hit rate as a share of the oracle's (the longest cached prefix of its own, then the least loaded);")
	fmt.Fprintln(w, "of bound: as a share of the infinite-cache bound on the policy's own requests (prompt tokens repeating a prefix sent before, one never-evicting cache)")
	for _, r := range results {
		if r.PrefillLoad >= 0.9 {
			fmt.Fprintf(w, "warning: %s: the instances spent %.0f%% of the run prefilling: the fleet is overloaded at this rate (requests queue, then are dropped or cancelled)\n",
				r.Settings.Label, 100*r.PrefillLoad)
		}
	}
	return nil
}

// withOracle appends the oracle to policies unless they have it: every
// table reports the hit rates as a share of the oracle's.
func withOracle(policies []simulator.Policy) []simulator.Policy {
	if slices.Contains(policies, simulator.Oracle) {
		return policies
	}
	return append(policies, simulator.Oracle)
}

// oracleResult is the oracle's hit rate among results (0: not run).
func oracleResult(results []*simulator.Result) float64 {
	for _, r := range results {
		if r.Settings.Policy == simulator.Oracle {
			return r.Summary.KVHitRate
		}
	}
	return 0
}

// shareOf is hit as a percentage of of, "–" when of is 0.
func shareOf(hit, of float64) string {
	if of <= 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f%%", 100*hit/of)
}

// boundRange is the infinite-cache bound of the runs: one figure, or the
// lowest and highest when the runs sent different requests (a faster
// policy sends a few more turns before the end).
func boundRange(results []*simulator.Result) (string, bool) {
	if len(results) == 0 {
		return "", false
	}
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, r := range results {
		lo, hi = min(lo, r.InfiniteCacheBound), max(hi, r.InfiniteCacheBound)
	}
	if hi-lo < 0.0005 {
		return fmt.Sprintf("%.1f%%", 100*hi), true
	}
	return fmt.Sprintf("%.1f–%.1f%%", 100*lo, 100*hi), true
}

func convCap(n int) string {
	if n < 0 {
		return "no conversation cap"
	}
	return fmt.Sprintf("at most %d conversations", n)
}

func inFlightCap(n int) string {
	if n < 0 {
		return "unbounded"
	}
	return fmt.Sprint(n)
}

func simMs(d time.Duration) string {
	return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
}

// simulateProgress draws one bar for all the policies: the simulated time
// they have covered out of policies × duration.
type simulateProgress struct {
	bar      *progress.Bar
	total    int64 // ms
	reached  []atomic.Int64
	requests []atomic.Int64
}

func startSimulateProgress(w io.Writer, policies int, d time.Duration) *simulateProgress {
	p := &simulateProgress{
		total:    max(int64(policies)*d.Milliseconds(), 1),
		reached:  make([]atomic.Int64, policies),
		requests: make([]atomic.Int64, policies),
	}
	p.bar = progress.Poll(w, progress.Options{Total: p.total, Description: "simulated", Predict: true}, 250*time.Millisecond, p.read)
	return p
}

// reporter is the Progress callback of policy i; d caps what one policy
// counts (the drain runs past the duration).
func (p *simulateProgress) reporter(i int) func(simulator.Progress) {
	per := p.total / int64(len(p.reached))
	return func(pr simulator.Progress) {
		p.reached[i].Store(min(pr.Simulated.Milliseconds(), per))
		p.requests[i].Store(pr.Requests)
	}
}

// read is the bar's value and description.
func (p *simulateProgress) read() (int64, string) {
	var at, reqs int64
	for i := range p.reached {
		at += p.reached[i].Load()
		reqs += p.requests[i].Load()
	}
	return at, fmt.Sprintf("%d requests simulated", reqs)
}

func (p *simulateProgress) stop() { p.bar.Finish() }
