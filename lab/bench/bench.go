// Package bench is `tether-lab bench`: the benchmark suite that runs real Envoy,
// real redis-server and tether side by side with emulated GPU instances, and
// writes the results into BENCHMARKS.md with charts. The scenarios:
//
//   - overhead: what Envoy + tether adds to Envoy alone and to the ext_proc
//     floor, the cheapest router (floor.go), on a zero-latency backend,
//     with tiny requests carrying the bench's headers or the OpenAI Python
//     client's, and with chat bodies of several sizes that tether carries
//     (content off) or reads (content on, body.go);
//   - gateway: tether as an endpoint picker behind Envoy in Istio's style
//     (override_host, bodies streamed full duplex) beside a stateless
//     picker and Envoy alone, with 1 KB and 32 KB chat bodies, in
//     alternation (gateway.go, picker.go);
//   - quality: the field's traffic mix against eight emulated A100s in two
//     zones, routed by Envoy round robin, Envoy ring hash, tether random,
//     tether sticky and tether adaptive;
//   - hot spot: the same mix plus one tenant's burst behind one API key,
//     which sticky routing keeps on one instance: tether sticky against
//     tether adaptive;
//   - churn: an instance killed and restored and one added during a run,
//     Envoy ring hash against tether sticky;
//   - documents: the simulator's shared-documents regime on eight
//     emulated A100s with its small KV caches, routed by Envoy ring hash,
//     tether sticky and tether cache-aware, which reads the body of every
//     request whose placement is open (documents.go);
//   - peers: the routers of two other projects from PyPI, sglang-router
//     (cache_aware) and vllm-router (consistent_hash), in front of the same
//     fleet beside tether sticky and tether cache-aware, on the field's
//     mix, on small KV caches and on shared documents (peers.go).
//
// Every server listens on loopback; every load loop is bounded in time.
package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/tetherproxy/tether/config"
)

// Scale sets how long and how hard each scenario runs.
type Scale struct {
	Name string
	// Overhead: serial requests on one connection, then open-loop rate
	// and duration for latency; closed-loop connections (workers) and
	// duration for throughput.
	OverheadSerial   int
	OverheadRate     float64
	OverheadDuration time.Duration
	OverheadWorkers  int
	// Overhead with a chat body (body.go): each of BodySizes (bytes)
	// through Envoy alone, tether with content off and with it on;
	// BodySerial requests on one connection, then the open loop at
	// OverheadRate and the closed loop on OverheadWorkers connections for
	// BodyDuration each.
	BodySizes    []int
	BodySerial   int
	BodyDuration time.Duration
	// Quality and churn: the workload replay.
	Rate       float64       // requests per second, follow-up turns included
	Duration   time.Duration // per policy
	ThinkScale float64       // multiplies the workload's think times
	TimeScale  float64       // emulated GPU time: 1 is real time
	// Hot spot: the workload replay runs for HotDuration on a fleet whose
	// emulated time is HotTimeScale; in its middle half one tenant sends
	// HotRate requests a second (open loop), each with a document of
	// HotDocTokens of its own.
	HotDuration  time.Duration
	HotRate      float64
	HotDocTokens int
	HotTimeScale float64
	// ScrapeInterval is how often tether reads the engines' /metrics
	// (engines.scrape_interval); HotScrapeIntervals, the intervals the hot
	// spot's adaptive policy runs at, a row each.
	ScrapeInterval     time.Duration
	HotScrapeIntervals []time.Duration
	// Documents: the shared-documents workload's replay, DocsRate
	// requests a second for DocsDuration per policy, at the quality's
	// think and time scales.
	DocsRate     float64
	DocsDuration time.Duration
}

// Full is what `make bench` runs (about 45 minutes; the documents rows six, the peers 24). The hot tenant's
// requests (its 1,000-token instructions cached, 2,000 tokens of document
// not) take an emulated A100 about 0.2 s of prefill each: at 5 a second
// they alone keep one instance's prefill busy, and the instance's own
// sessions push it over; the fleet as a whole has room.
var Full = Scale{
	Name: "full", OverheadSerial: 4000, OverheadRate: 300, OverheadDuration: 10 * time.Second, OverheadWorkers: 32,
	BodySizes: []int{1 << 10, 32 << 10, 400 << 10}, BodySerial: 2000, BodyDuration: 5 * time.Second,
	Rate: 6, Duration: 90 * time.Second, ThinkScale: 0.2, TimeScale: 1,
	HotDuration: 60 * time.Second, HotRate: 5, HotDocTokens: 2000, HotTimeScale: 1,
	ScrapeInterval: config.DefaultScrapeInterval,
	// The default, and the interval at which adaptive routing on scraped
	// signals relieves the hot spot as fast as on the header signals.
	HotScrapeIntervals: []time.Duration{config.DefaultScrapeInterval, 250 * time.Millisecond},
	// The regime's load per instance in BENCHMARKS.md (30 requests/s on
	// 64 instances, their GPUs 93% busy under sticky) would be 3.75/s on
	// eight; 3/s leaves the loaded machine some room.
	DocsRate: 3, DocsDuration: 90 * time.Second,
}

// Smoke is the short version the test command runs so the suite cannot
// rot: the same code, seconds instead of minutes. The hot spot's fleet
// runs at a quarter of real time rather than a twentieth: to saturate an
// instance at ×0.05 the tenant would have to send (and the in-process
// instances hash) some 200,000 words a second, which is more than a
// 2-core CI machine does without distorting every latency of the run. At
// ×0.25 each of its requests takes about 0.05 s of prefill, and 35 a
// second overload one instance by 1.75×.
var Smoke = Scale{
	Name: "smoke", OverheadSerial: 200, OverheadRate: 100, OverheadDuration: 2 * time.Second, OverheadWorkers: 32,
	// One body size, briefly: the smoke run proves the rows work, in a
	// few seconds.
	BodySizes: []int{32 << 10}, BodySerial: 30, BodyDuration: 300 * time.Millisecond,
	Rate: 8, Duration: 8 * time.Second, ThinkScale: 0.02, TimeScale: 0.05,
	HotDuration: 2 * time.Second, HotRate: 35, HotDocTokens: 2000, HotTimeScale: 0.25,
	// The hot phase lasts a second: tether must see it well within.
	ScrapeInterval:     100 * time.Millisecond,
	HotScrapeIntervals: []time.Duration{100 * time.Millisecond},
	// A few dozen requests per policy: the rows and the bodies read are
	// there, the hit rates are noise.
	DocsRate: 20, DocsDuration: 2 * time.Second,
}

// Saturation is when the adaptive policies count an instance as
// saturated; 0 turns a threshold off. "tether adaptive" reads what the
// engines publish on /metrics, as it would on a real vLLM fleet
// (routing.saturation_waiting, routing.saturation_kv_usage); "tether
// adaptive (header signals)" reads the emulator-only x-queue-depth header
// and tether's own in-flight count (routing.saturation_queue_depth,
// routing.saturation_inflight).
type Saturation struct {
	Waiting int
	KVUsage float64
	// The header-signals policy's.
	InFlight, QueueDepth int
}

// DefaultSaturation is the adaptive policy's thresholds: the engine thresholds are routing's defaults, what
// the Gateway API Inference Extension and llm-d ship (5 waiting, 80% of
// the KV cache). Under the full quality workload routed by tether sticky
// (6 requests/s on eight emulated A100s, their GPUs about 98% busy) the
// requests waiting for a prefill were 0 at the median, 2 at p99 and 4 at
// most, so steady load does not reach 5.
//
// The header thresholds were chosen from the same run: the queue depth an
// instance reports (x-queue-depth: the requests it was already working on
// when a request arrived, decoding ones included) was 3 at the median, 6
// at p90, 8 at p99 and 9 at most; saturation is what the steady load never
// reaches, a reported queue of 12, or 6 requests waiting for a prefill.
// Lower thresholds spill sessions off instances that are only as busy as
// the rest of the fleet, losing their KV cache for nothing: with a queue
// depth of 4 (the fleet's median) adaptive spilled 29% of its decisions
// in that workload and did worse than sticky on hit rate, TTFT and GPU
// cost, and with 8 (its p99, and 4 in flight) it still spilled a fifth,
// because a reported depth stands until the instance's next answer (see
// BENCHMARKS.md).
var DefaultSaturation = Saturation{Waiting: config.DefaultWaiting, KVUsage: config.DefaultKVUsage, InFlight: 6, QueueDepth: 12}

// Options configure a run.
type Options struct {
	TetherBin, EnvoyBin, RedisBin string
	// LabBin is tether-lab, whose `bench floor` serves the ext_proc floor
	// of the overhead scenario (floor.go).
	LabBin string
	Scale  Scale
	Seed   uint64
	Log    io.Writer // progress lines
	// Only, when set, runs just these scenarios ("overhead", "gateway", "quality",
	// "hotspot", "churn", "documents", "peers").
	Only map[string]bool
	// PeersDir holds the peer routers (scripts/tools.sh peers installs
	// them into .tools/peers). Empty leaves the peers scenario out unless
	// Only names it, which then fails.
	PeersDir string
	// PeersPython runs them; empty: PeersDir/python, the interpreter they
	// were installed for.
	PeersPython string
	// Saturation for the adaptive policy; zero: DefaultSaturation.
	Saturation Saturation
	// CPUProfiles, when set, is a directory where each tether the run
	// starts writes its CPU profile, named after its configuration.
	CPUProfiles string
}

// Report is one run's results.
type Report struct {
	Started  time.Time
	Scale    Scale
	Overhead []OverheadRow
	// Bodies are the overhead rows with a chat body (body.go).
	Bodies []BodyRow
	// Paired is tether sticky beside the floor, in alternation
	// (paired.go).
	Paired []PairedRow
	// Gateway is the gateway scenario's rows: tether and the stateless
	// picker behind Envoy in Istio's style (gateway.go).
	Gateway []GatewayRow
	Quality []QualityRow
	Hotspot []HotspotRow
	Churn   []ChurnRow
	// Documents are the shared-documents rows (documents.go).
	Documents []QualityRow
	// Peers are the peers scenario's rows, workload by workload, and
	// PeerRouters the routers it started (peers.go).
	Peers       []PeerRow
	PeerRouters []PeerRouter
	// Saturation is what the adaptive policy ran with.
	Saturation Saturation
}

// secret is the identity secret of the tethers a run starts.
const secret = "tether-bench-identity-secret-0123"

// Run runs the scenarios in order and returns what they measured.
func Run(ctx context.Context, opts Options) (*Report, error) {
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	dir, err := os.MkdirTemp("", "tether-bench")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(dir) }() // scratch files only
	if opts.Saturation == (Saturation{}) {
		opts.Saturation = DefaultSaturation
	}
	r := &Report{Started: time.Now(), Scale: opts.Scale, Saturation: opts.Saturation}
	want := func(s string) bool { return len(opts.Only) == 0 || opts.Only[s] }
	peers := want("peers") && (opts.PeersDir != "" || opts.Only["peers"])
	if peers {
		// Missing peers fail the run now, not after the other scenarios.
		if _, err := installedPeers(opts.PeersDir); err != nil {
			return r, fmt.Errorf("peers: %w", err)
		}
	}
	if want("overhead") {
		if r.Overhead, r.Paired, r.Bodies, err = runOverhead(ctx, opts, dir); err != nil {
			return r, fmt.Errorf("overhead: %w", err)
		}
	}
	if want("gateway") {
		if r.Gateway, err = runGateway(ctx, opts, dir); err != nil {
			return r, fmt.Errorf("gateway: %w", err)
		}
	}
	if want("quality") {
		if r.Quality, err = runQuality(ctx, opts, dir); err != nil {
			return r, fmt.Errorf("quality: %w", err)
		}
	}
	if want("hotspot") {
		if r.Hotspot, err = runHotspot(ctx, opts, dir); err != nil {
			return r, fmt.Errorf("hot spot: %w", err)
		}
	}
	if want("churn") {
		if r.Churn, err = runChurn(ctx, opts, dir); err != nil {
			return r, fmt.Errorf("churn: %w", err)
		}
	}
	if want("documents") {
		if r.Documents, err = runDocuments(ctx, opts, dir); err != nil {
			return r, fmt.Errorf("documents: %w", err)
		}
	}
	if peers {
		if r.Peers, r.PeerRouters, err = runPeers(ctx, opts, dir); err != nil {
			return r, fmt.Errorf("peers: %w", err)
		}
	}
	return r, nil
}

// baseConfig is a tether config for instances: loopback listeners on
// ports the kernel picks, ADS on, the default Envoy settings.
func baseConfig(sc Scale, instances []config.Instance) config.Config {
	c := config.Default()
	c.Server.ExtProcAddr = "127.0.0.1:0"
	c.Server.AdminAddr = "127.0.0.1:0"
	c.Server.LogLevel = "info" // the ready line is at info
	c.Server.DebugHeaders = true
	// A stack stops Envoy before tether, so no request is in flight by
	// then: no drain delay, and a short drain timeout, since the ends of
	// requests a loop cancelled while tether decided never come back
	// (docs/operations.md) and waiting for them would outlast the stop's
	// timeout, losing --cpuprofile.
	c.Server.DrainDelay = config.Dur(0)
	c.Server.DrainTimeout = config.Dur(time.Second)
	c.XDS.Addr = "127.0.0.1:0"
	c.Envoy.ListenerAddr = "127.0.0.1:0"
	// The emulated instances are vLLM engines, and tether reads their
	// /metrics as it would a real fleet's.
	c.Engines.Default = config.EngineVLLM
	if sc.ScrapeInterval > 0 {
		setScrapeInterval(&c, sc.ScrapeInterval)
	}
	// Identity alone: the cache-aware rows turn [content] on themselves.
	c.Content.Enabled = false
	c.Instances = instances
	return c
}

// policy is one way of routing the same traffic.
type policy struct {
	name    string
	store   bool // needs redis-server
	offPath bool // tether only serves Envoy's configuration
	floor   bool // Envoy's ext_proc filter calls the ext_proc floor (floor.go), not tether
	headers bool // the instances send the emulator-only load headers
	content bool // edit turns [content] on
	edit    func(*config.Config)
}

func envoyOnly(lb string) func(*config.Config) {
	return func(c *config.Config) {
		c.Envoy.ExtProc = false
		c.Envoy.PoolLB = lb
	}
}

var (
	policyRoundRobin = policy{name: "Envoy round robin", offPath: true, edit: envoyOnly("round_robin")}
	policyRingHash   = policy{name: "Envoy ring hash", offPath: true, edit: envoyOnly("ring_hash")}
	policyRandom     = policy{name: "tether random", edit: func(c *config.Config) { c.Routing.Mode = config.ModeRandom }}
	policySticky     = policy{name: "tether sticky", store: true, edit: func(*config.Config) {}}
)

func setScrapeInterval(c *config.Config, d time.Duration) {
	c.Engines.ScrapeInterval = config.Dur(d)
	c.Engines.ScrapeTimeout = config.Dur(min(config.DefaultScrapeTimeout, d))
}

// policyAdaptive is sticky routing that lets a session leave a saturated
// instance for its next choice, saturation read from the engines' /metrics.
func policyAdaptive(s Saturation) policy {
	return policy{name: "tether adaptive", store: true, edit: func(c *config.Config) {
		c.Routing.AdaptiveSticky = 1
		c.Routing.SaturationWaiting, c.Routing.SaturationKVUsage = s.Waiting, s.KVUsage
		c.Routing.SaturationInFlight, c.Routing.SaturationQueueDepth = 0, 0
	}}
}

// policyAdaptiveEvery is policyAdaptive with the engines scraped every d,
// named by it when there are several.
func policyAdaptiveEvery(s Saturation, d time.Duration, named bool) policy {
	p := policyAdaptive(s)
	if named {
		p.name = fmt.Sprintf("tether adaptive (scrape %v)", d)
	}
	edit := p.edit
	p.edit = func(c *config.Config) {
		edit(c)
		setScrapeInterval(c, d)
	}
	return p
}

// policyAdaptiveHeaders is adaptive routing on the signals tether had
// before it read engines: the emulator-only x-queue-depth header and its
// own in-flight count, with the engines not scraped.
func policyAdaptiveHeaders(s Saturation) policy {
	return policy{name: "tether adaptive (header signals)", store: true, headers: true, edit: func(c *config.Config) {
		c.Engines.Default = config.EngineGeneric
		c.Routing.AdaptiveSticky = 1
		c.Routing.SaturationWaiting, c.Routing.SaturationKVUsage = 0, 0
		c.Routing.SaturationInFlight, c.Routing.SaturationQueueDepth = s.InFlight, s.QueueDepth
	}}
}
