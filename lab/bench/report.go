package bench

import (
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/lab/simulator"
	"github.com/tetherproxy/tether/lab/workload"
)

// Markers delimit the part of BENCHMARKS.md a run rewrites; the rest of
// the file (the Go benchmarks of the decision path) is kept.
const (
	MarkerStart = "<!-- tether-lab bench: start -->"
	MarkerEnd   = "<!-- tether-lab bench: end -->"
)

// Meta describes where and how a run happened.
type Meta struct {
	Command, Commit, Machine string
}

// Markdown renders the report between the markers.
func (r *Report) Markdown(m Meta, charts []string) string {
	var b strings.Builder
	w := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	w("%s\n## Through Envoy: overhead, routing quality, hot spot, churn\n\n", MarkerStart)
	w("```sh\n%s\n```\n\n", m.Command)
	w("Run of %s, commit %s, %s, scale %q. All servers on loopback on this one machine: the load\n",
		r.Started.UTC().Format("2006-01-02 15:04 MST"), m.Commit, m.Machine, r.Scale.Name)
	w("generator, Envoy, tether, redis-server and the emulated instances share its cores, so compare\n")
	w("rows of one table, not absolute figures.\n\n")

	if len(r.Overhead) > 0 {
		r.overheadMarkdown(w)
	}
	if len(r.Gateway) > 0 {
		r.gatewayMarkdown(w)
	}
	if len(r.Quality) > 0 {
		w("### Routing quality: the field's mix on eight emulated A100s\n\n")
		w("%s\n\n", qualityPreamble(r.Scale, r.Saturation))
		w("| policy | KV hit rate | TTFT p50 | TTFT p99 | latency p50 | latency p99 | session continuity | GPU-time imbalance (max/mean) | GPU busy | GPU-s per 1k output tokens | requests | failed | simulator's hit rate | bench − simulator (points) |\n")
		w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, q := range r.Quality {
			w("| %s | %.1f%% | %s | %s | %s | %s | %.1f%% | %.2f | %.0f%% | %.2f | %d | %d | %s |\n", q.Policy, 100*q.HitRate,
				ms(q.TTFTP50), ms(q.TTFTP99), ms(q.LatencyP50), ms(q.LatencyP99),
				100*q.Continuity, q.Imbalance, 100*q.GPUBusy, q.GPUSecondsPer1kOutput, q.Requests, q.Failed, simCells(q.HitRate, q.Sim))
		}
		w("\n")
		if v := r.QualityCrossCheck().verdict("policy the simulator emulates"); v != "" {
			w("%s\n\n", v)
		}
	}
	if len(r.Hotspot) > 0 {
		w("### Hot spot: one tenant's burst behind one API key\n\n")
		w("%s\n\n", hotspotPreamble(r.Scale))
		w("| policy | traffic | requests | failed | KV hit rate | TTFT p50 | TTFT p99 | spilled | instances that answered |\n")
		w("|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, h := range r.Hotspot {
			for _, t := range []struct {
				name string
				t    Traffic
			}{{"hot tenant", h.Tenant}, {"others, started in the hot phase", h.Others}, {"all, whole run", h.All}} {
				w("| %s | %s | %d | %d | %.1f%% | %s | %s | %.1f%% | %d |\n", h.Policy, t.name, t.t.Requests, t.t.Failed,
					100*t.t.HitRate, ms(t.t.TTFTP50), ms(t.t.TTFTP99), 100*t.t.Spilled, t.t.Instances)
			}
		}
		w("\n")
	}
	if len(r.Quality) > 0 || len(r.Hotspot) > 0 {
		w("### Load spread and spills\n\n")
		w("%s\n\n", spreadPreamble)
		w("| scenario | policy | spilled | requests per instance (min–max) | max / mean | queue depth p50 | queue depth p99 | busiest instance's queue p99 |\n")
		w("|---|---|---:|---:|---:|---:|---:|---:|\n")
		row := func(scenario, policy string, decisions int, spilled float64, s Spread) {
			sp := "–"
			if decisions > 0 {
				sp = fmt.Sprintf("%.1f%%", 100*spilled)
			}
			w("| %s | %s | %s | %d–%d | %.2f | %d | %d | %d |\n", scenario, policy, sp, s.MinRequests, s.MaxRequests,
				s.Imbalance, s.QueueP50, s.QueueP99, s.BusiestQueueP99)
		}
		for _, q := range r.Quality {
			row("quality", q.Policy, q.Decisions, q.Spilled, q.Spread)
		}
		for _, h := range r.Hotspot {
			row("hot spot", h.Policy, h.Decisions, h.Spilled, h.Spread)
		}
		w("\n")
	}
	if len(r.Churn) > 0 {
		w("### Churn: an instance killed and restored, one added\n\n")
		w("%s\n\n", churnPreamble(r.Scale))
		w("| policy | phase | requests | failed | identified follow-ups moved | answered by the killed instance | KV hit rate | simulator's hit rate | bench − simulator (points) |\n")
		w("|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, c := range r.Churn {
			w("| %s | %s | %d | %d | %d of %d | %d | %.1f%% | %s |\n", c.Policy, c.Phase, c.Requests, c.Failed, c.Moved, c.FollowUps, c.VictimServed, 100*c.HitRate,
				simCells(c.HitRate, c.Sim))
		}
		w("\n")
		if v := r.ChurnCrossCheck().verdict("phase"); v != "" {
			w("%s\n\n", v)
		}
	}
	if len(r.Documents) > 0 {
		r.documentsMarkdown(w)
	}
	if len(r.Peers) > 0 {
		r.peersMarkdown(w, m)
	}
	for _, c := range charts {
		w("![%s](%s)\n\n", strings.TrimSuffix(filepath.Base(c), ".png"), c)
	}
	w("%s\n", notes)
	w("%s\n", MarkerEnd)
	return b.String()
}

const notes = `What is emulated, and what that means for these numbers:

- The instances are tether's emulator (lab/emulator/), not GPUs. Their latency follows a cost model fitted to
  one H200 measurement (../shared/calibration/): a per-request floor, prefill per uncached token,
  decode per output token slowing with the batch, prefills queueing behind each other. The A100
  profile is derived from the H200 figures by datasheet ratios (prefill about 3.2× slower, decode
  2.4×): an estimate, not a measurement.
- Their KV cache is a prefix-block cache (16-token blocks, chained hashes, LRU, at most 20
  conversations per instance), as serving engines' automatic prefix caching works. Hit rate is
  cached prompt tokens over all prompt tokens, as the instances report them.
- Tokens are whitespace-separated words of generated text, not a real tokenizer.
- The workload follows the field's mix (30% long documents, 20% multi-turn conversations, 50% short
  queries, each opening with one of four shared application system prompts) with shortened think
  times; it is synthetic, deterministic from its seed, and the same for every policy.
- The field's reference figures for this experiment are 62% (random) against 89% (sticky) KV hit
  rate and 218 ms against 189 ms P99. The tables above are ours, from this emulation; the field did not
  say which latency its P99 is, so compare our TTFT and end-to-end figures with it only loosely.`

func qualityPreamble(s Scale, sat Saturation) string {
	return fmt.Sprintf("Eight emulated A100 instances in two zones (emulated time ×%g). The same seeded workload for every\n"+
		"policy: %.0f requests/s, follow-up turns included, for %s (think times ×%g), streamed answers;\n"+
		"caches emptied between policies and not warmed first. TTFT is the time to the first token, the part\n"+
		"of latency a KV-cache hit shortens; end-to-end latency is mostly decode, which routing does not\n"+
		"change. Continuity: follow-up turns served by the instance of the previous turn (anonymous callers\n"+
		"are routed at random by every policy). GPU-seconds: the emulated GPU time the instances spent\n"+
		"(prefill, plus each decode step divided among the requests in flight on the instance); GPU busy is\n"+
		"that over the fleet's time. The instances publish vLLM's /metrics and send none of the emulator's own\n"+
		"headers; every tether policy scrapes them (`engines.default = \"vllm\"`, every second). Tether\n"+
		"adaptive is tether sticky with `routing.adaptive_sticky = 1`, `saturation_waiting = %d` and\n"+
		"`saturation_kv_usage = %g` read from those metrics: thresholds above what this steady load reaches\n"+
		"(the reading notes say why), so that only a real hot spot moves sessions. The simulator's columns:\n"+
		"the same workload and fleet in virtual time (lab/simulator, as `tether-lab simulate --like-bench`),\n"+
		"for the policies it emulates.",
		s.TimeScale, s.Rate, s.Duration, s.ThinkScale, sat.Waiting, sat.KVUsage)
}

func hotspotPreamble(s Scale) string {
	return fmt.Sprintf("The quality workload for %s on the eight emulated A100s (emulated time ×%g), and from %s to %s one\n"+
		"tenant's batch job: %g requests/s (open loop)\n"+
		"under one API key (`Authorization: Bearer …`, no session id), each the tenant's %d-token instructions,\n"+
		"shared, and a %d-token document of its own, %d streamed output tokens. Sticky routing sees one identity\n"+
		"and keeps the whole job on one instance; adaptive moves it (and the other sessions bound there) to\n"+
		"their next choice while that instance is saturated: \"tether adaptive\" by what the engines publish on\n"+
		"/metrics (waiting requests, KV-cache usage), scraped every `engines.scrape_interval` (the default\n"+
		"1s, or the interval its name gives), \"header signals\" by the emulator-only x-queue-depth header\n"+
		"and tether's in-flight count, the signals tether had before it read engines. \"Others\" are the workload's requests that\n"+
		"started during the hot phase, the ones that share the fleet with the burst. Spilled: answers whose\n"+
		"x-tether-decision was \"spilled\". TTFT of the tenant's requests is timed from when each was due.",
		s.HotDuration, s.HotTimeScale, s.HotDuration/4, 3*s.HotDuration/4, s.HotRate, hotSystemTokens, s.HotDocTokens, hotOutputTokens)
}

const spreadPreamble = `Spilled: the share of tether's routing decisions that moved a session off a saturated instance
(tether_requests_total{decision="spilled"} from tether's /metrics; – where tether is not on the request
path). Requests per instance: the answers each of the eight instances gave. Queue depth: what the
instances reported on each answer (x-queue-depth: the requests the instance was already working on,
decoding ones included, when that request arrived), the signal adaptive routing reads.`

func churnPreamble(s Scale) string {
	return fmt.Sprintf("The quality workload for %s; at 1/4 of the run one instance is killed (connections refused),\n"+
		"at 1/2 it is restored with an empty cache, at 3/4 a ninth instance is added. A follow-up is\n"+
		"\"moved\" when another instance than the previous turn's served it. The simulator's columns: the same\n"+
		"workload, fleet and schedule in virtual time (lab/simulator, its events fail, restore and add), each\n"+
		"request counted in the phase it ended in, as here.", s.Duration)
}

func documentsPreamble(s Scale) string {
	o := simulator.SharedDocuments(simulator.Options{})
	d := workload.DefaultDocs()
	return fmt.Sprintf("The simulator's shared-documents regime through Envoy: questions about %d shared documents of\n"+
		"%d–%d tokens (Zipf s = %g), half the callers anonymous, on eight emulated A100s in two zones whose KV\n"+
		"caches hold %d tokens each, as the regime's (emulated time ×%g); %g requests/s for %s (think times\n"+
		"×%g), streamed answers, caches emptied between policies and not warmed first. Tether cache-aware is\n"+
		"tether sticky with `[content] enabled = true` (the simulator's blocks: `block_bytes = %d`,\n"+
		"`cache_tokens` the caches'): its reply to the headers of a request whose placement is open asks Envoy\n"+
		"for the body, and its reply to the body places the request by what the instances' caches hold of the\n"+
		"prompt. Bodies read: tether_content_decisions_total by result, from tether's /metrics. The\n"+
		"simulator's columns: the same scenario in virtual time (`tether-lab simulate --regime\n"+
		"shared-documents` on the bench's fleet, rate and duration, no warmup).",
		d.Count, d.Tokens.Min, d.Tokens.Max, d.Skew, o.Cache.CapacityTokens, s.TimeScale, s.DocsRate, s.DocsDuration,
		s.ThinkScale, simulator.CacheAwareContent(o.Cache).BlockBytes)
}

// documentsMarkdown writes the documents table and its cross-check.
func (r *Report) documentsMarkdown(w func(string, ...any)) {
	w("### Routing quality: shared documents, bodies read on demand\n\n")
	w("%s\n\n", documentsPreamble(r.Scale))
	w("| policy | KV hit rate | TTFT p50 | TTFT p99 | session continuity | GPU busy | requests | failed | bodies read | simulator's hit rate | bench − simulator (points) |\n")
	w("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|\n")
	for _, q := range r.Documents {
		bodies := "–"
		if q.ContentResults != nil {
			bodies = fmt.Sprintf("%d", q.BodiesRead())
			if t := topResults(q.ContentResults); t != "" {
				bodies += ": " + t
			}
		}
		w("| %s | %.1f%% | %s | %s | %.1f%% | %.0f%% | %d | %d | %s | %s |\n", q.Policy, 100*q.HitRate,
			ms(q.TTFTP50), ms(q.TTFTP99), 100*q.Continuity, 100*q.GPUBusy, q.Requests, q.Failed, bodies, simCells(q.HitRate, q.Sim))
	}
	w("\n")
	if v := r.DocumentsCrossCheck().verdict("policy"); v != "" {
		w("%s\n\n", v)
	}
}

func peersPreamble(s Scale) string {
	docs := simulator.SharedDocuments(simulator.Options{})
	return fmt.Sprintf("Eight emulated A100s in two zones (emulated time ×%g) and three workloads, each replayed for every\n"+
		"router with the same seed: %g requests/s for %s (think times ×%g), streamed answers naming the model the\n"+
		"instances serve, caches emptied between rows and not warmed first. The default mix is the quality\n"+
		"scenario's; KV pressure is the same mix on KV caches of %d tokens each; shared documents is the documents\n"+
		"scenario's workload (questions about long shared documents, half the callers anonymous) on its %d-token\n"+
		"caches, at this rate. Tether sticky (`[content] enabled = false`) and tether cache-aware (tether as it\n"+
		"ships: `[content]` at its defaults, each cache's capacity as its engine publishes it) run behind Envoy with\n"+
		"redis-server, as in the tables above. The peers are SGLang's and vLLM's routers as PyPI ships them\n"+
		"(`scripts/tools.sh peers` pins them), each started with its policy and two loopback listeners, every\n"+
		"other setting its own default; the load generator sends to the router's port, a router being a proxy\n"+
		"itself. sglang-router fronts instances that imitate SGLang (it registers a worker by its\n"+
		"`/get_server_info` and `/get_model_info`), vllm-router instances that imitate vLLM; the two engines\n"+
		"differ only in the paths and metrics they publish. vllm-router's consistent_hash keys a request on a\n"+
		"session or user header when it has one (`x-session-id`, `x-user-id`, …), as the workload's session and\n"+
		"device callers send. GPU-time imbalance: max over mean of each instance's emulated prefill and decode GPU-seconds\n"+
		"(`/admin/stats`). Requests per instance: the fewest and the most completion requests an instance\n"+
		"received, by its own count.",
		s.TimeScale, s.Rate, s.Duration, s.ThinkScale, PeersKVPressureTokens, docs.Cache.CapacityTokens)
}

// peersMarkdown writes the peers scenario: how to run it, its rows and
// the routers it started.
func (r *Report) peersMarkdown(w func(string, ...any), m Meta) {
	w("### The peers through the bench's fleet (issue 32)\n\n")
	w("```sh\nscripts/tools.sh peers   # make bench installs them\n%s\n```\n\n", m.Command)
	w("Run of %s, commit %s, %s, scale %q.\n", r.Started.UTC().Format("2006-01-02 15:04 MST"), m.Commit, m.Machine, r.Scale.Name)
	w("%s\n\n", peersPreamble(r.Scale))
	w("| workload | router | KV hit rate | TTFT p50 | TTFT p99 | GPU-time imbalance (max/mean) | requests per instance (fewest–most) | requests | failed: errors, cancelled at the end |\n")
	w("|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
	var errs []string
	for _, p := range r.Peers {
		failed := fmt.Sprintf("%d, %d", p.Errors, p.Cancelled)
		if p.Dropped > 0 {
			failed += fmt.Sprintf(" (and %d not sent)", p.Dropped)
		}
		w("| %s | %s | %.1f%% | %s | %s | %.2f | %d–%d | %d | %s |\n", p.Workload, p.Policy, 100*p.HitRate, ms(p.TTFTP50), ms(p.TTFTP99),
			p.Imbalance, p.Spread.MinRequests, p.Spread.MaxRequests, p.Requests, failed)
		for _, msg := range slices.Sorted(maps.Keys(p.ErrorKinds)) {
			errs = append(errs, fmt.Sprintf("- %s, %s: %d × `%s`", p.Workload, p.Policy, p.ErrorKinds[msg], msg))
		}
	}
	w("\nCancelled at the end: still running when the load generator's drain (30 s after the last request\n")
	w("started) ran out.")
	if len(errs) > 0 {
		w(" The errors:\n\n%s", strings.Join(errs, "\n"))
	}
	w("\n")
	w("\n| router | version | policy | started as | requests to the bench's stand-in Hugging Face hub |\n")
	w("|---|---|---|---|---:|\n")
	for _, p := range r.PeerRouters {
		w("| %s | %s | %s | `%s` | %d |\n", p.Name, p.Version, p.Policy, p.Command, p.HubRequests)
	}
	w("\n`HF_ENDPOINT` points each router at that stand-in, on loopback, which answers 404: sglang-router asks the\n")
	w("hub for a tokenizer of the model its SGLang workers name, and routes HTTP requests without one.\n\n")
}

// overheadMarkdown writes the overhead tables and the goals block.
func (r *Report) overheadMarkdown(w func(string, ...any)) {
	sc := r.Scale
	// baseOf is Envoy alone with o's headers (the first row without).
	baseOf := func(o OverheadRow) OverheadRow {
		if b, _ := r.overheadPeers(o.Client); b != nil {
			return *b
		}
		return r.Overhead[0]
	}
	w("### Overhead on a zero-latency backend\n\n")
	w("Four instances that answer at once; Envoy runs one worker thread. \"Envoy alone\" has the same clusters\n")
	w("with tether off the request path; \"added\" is over Envoy alone. Latency on one connection: %d requests\n", sc.OverheadSerial)
	w("one after another. Latency at %.0f requests/s: open loop for %s, timed from each request's scheduled send.\n",
		sc.OverheadRate, sc.OverheadDuration)
	w("Both change session every ten requests (nine sticky hits per binding).")
	for _, o := range r.Overhead {
		if o.Floor {
			w(" %q is Envoy's ext_proc filter, configured as for tether, calling the\n", o.Name)
			w("bench's ext_proc floor, the least a router can do, in a process of its own as tether is (`tether-lab bench\n")
			w("floor`): it answers each request's headers with the routing\n")
			w("header (`x-tether-cluster`, an instance's cluster chosen by the FNV-1a hash of the session id) and\n")
			w("`clear_route_cache`, as tether's reply does, from replies built once per instance, on gRPC's default\n")
			w("server; it sets no dynamic metadata, so the outcome access log, which logs only requests with tether's\n")
			w("ticket, writes nothing. Before each of its runs the bench checks through Envoy that the requests of %d\n", floorProbes)
			w("sessions are answered by the instance the floor named. It is the bound tether's rows are read against.\n")
			w("Its CPU per request is in the column of tether's, and its own count of the requests it answered proves\n")
			w("that Envoy called it rather than failing open.")
			break
		}
	}
	for _, o := range r.Overhead {
		if o.Client == openAIPython.name {
			w(" Rows named \"…, %s\" send, with the session id, the\n", openAIPython.name)
			w("headers of the official OpenAI Python client: %s, content-type, host\n", headerNames(openAIPython.h))
			w("and content-length; the other rows send the session id, content-type and what Go's client adds (host,\n")
			w("user-agent, content-length, accept-encoding). Each row is compared with Envoy alone, and the floor, with\n")
			w("the same headers.")
			break
		}
	}
	w("\n\n")
	w("| configuration | one connection p50 | p99 | added p50 | added p99 | at %.0f/s p50 | p99 | added p50 | added p99 | failed | dropped |\n", sc.OverheadRate)
	w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, o := range r.Overhead {
		base := baseOf(o)
		w("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %d | %d |\n", o.Name,
			ms2(o.SerialP50), ms2(o.SerialP99), ms2(o.SerialP50-base.SerialP50), ms2(o.SerialP99-base.SerialP99),
			ms2(o.P50), ms2(o.P99), ms2(o.P50-base.P50), ms2(o.P99-base.P99), o.Failed, o.Dropped)
	}
	w("\n")
	w("Throughput and cost: %d connections in a closed loop for %s (at most %d requests), each sending for one\n",
		sc.OverheadWorkers, sc.OverheadDuration, hitLoopMax)
	w("session bound before the loop, so every sticky decision is a hit; the rate at that concurrency, not a\n")
	w("proven maximum. CPU per request: utime+stime from /proc/<pid>/stat over the loop, divided by the\n")
	w("requests answered (10 ms ticks). Redis commands per hit: INFO commandstats over the loop less an idle\n")
	w("baseline of %s with no load (INFO itself left out); the commands of a hit in brackets. Hits, degraded\n", sc.OverheadDuration)
	w("decisions (redis-server did not answer within `redis.timeout`, %s, and rendezvous hashing placed the\n", config.DefaultRedisTimeout)
	w("request) and store errors: tether's /metrics over the loop.\n\n")
	w("| configuration | requests | throughput | vs Envoy alone | vs the floor | Envoy CPU per request | tether (or floor) CPU per request | redis-server CPU per request | Redis commands per hit | hits | degraded | store errors |\n")
	w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, o := range r.Overhead {
		vsFloor := "–"
		if _, floor := r.overheadPeers(o.Client); floor != nil {
			vsFloor = fmt.Sprintf("%.2f", ratio(o.Throughput, floor.Throughput))
		}
		tether, redis, cmds, hits, degraded, storeErr := "–", "–", "–", "–", "–", "–"
		if o.Floor {
			tether = us(o.FloorCPUPerRequest)
		}
		if o.OnPath {
			tether = us(o.TetherCPUPerRequest)
			degraded, storeErr = fmt.Sprintf("%d of %d", o.Degraded, o.Decisions), fmt.Sprint(o.StoreErrors)
		}
		if o.Store {
			redis = us(o.RedisCPUPerRequest)
			cmds = fmt.Sprintf("%.2f", o.RedisCommandsPerRequest)
			if t := topCommands(o.RedisCommands, 5); t != "" {
				cmds += " (" + t + ")"
			}
			hits = fmt.Sprintf("%.1f%%", 100*o.HitShare)
		}
		w("| %s | %d | %.0f/s | %.2f | %s | %s | %s | %s | %s | %s | %s | %s |\n", o.Name, o.HitRequests, o.Throughput,
			ratio(o.Throughput, baseOf(o).Throughput), vsFloor, us(o.EnvoyCPUPerRequest), tether, redis, cmds, hits, degraded, storeErr)
	}
	w("\n")
	if goals := r.OverheadGoals(); len(goals) > 0 {
		w("#### Overhead goals\n\n")
		w("Each goal for each configuration with tether on the path, judged at the precision shown. One run on\n")
		w("a shared machine: a goal missed here may be the machine's noise; compare runs before concluding.\n")
		w("\"ext_proc floor\" is the same figure on the floor's row: a goal the floor misses too is one a minimal Go\n")
		w("ext_proc router behind this Envoy does not reach on this machine. The goals \"over\" and \"vs the floor\"\n")
		w("compare with the floor's row of the same headers: the median tether adds to it, its throughput and\n")
		w("Envoy's CPU per request in the closed loop as shares of the floor's.\n\n")
		w("| configuration | goal | target | ext_proc floor | measured | reached |\n")
		w("|---|---|---:|---:|---:|---|\n")
		for _, g := range goals {
			w("| %s | %s | %s | %s | %s | %s |\n", g.Path, g.What, g.Target(), g.BoundFigure(), g.Figure(), g.Verdict())
		}
		w("\n")
	}
	if len(r.Paired) > 0 {
		r.pairedMarkdown(w)
	}
	if len(r.Bodies) > 0 {
		r.bodyMarkdown(w)
	}
}

// pairedMarkdown writes the paired measurement (paired.go) and its goals.
func (r *Report) pairedMarkdown(w func(string, ...any)) {
	sc := r.Scale
	w("#### Beside the floor, in alternation\n\n")
	w("The rows above run one after another, each for tens of seconds, so a neighbour's burst on this shared\n")
	w("machine can fall on one row and not the next. Here the floor and tether sticky run side by side, each\n")
	w("behind an Envoy of its own, and the bench alternates between them in %d rounds (floor first in odd\n", pairedRounds)
	w("rounds, tether first in even ones): per round and side %d requests on one connection, the open loop at\n", max(1, sc.OverheadSerial/pairedRounds))
	w("%.0f/s for %s and the closed loop on %d connections (every sticky decision a hit) for %s. Figures are\n",
		sc.OverheadRate, sc.OverheadDuration/pairedRounds, sc.OverheadWorkers, sc.OverheadDuration/pairedRounds)
	w("over all rounds; \"round by round\" is tether's closed-loop throughput over the floor's in each round.\n\n")
	w("| headers | router | one connection p50 | at %.0f/s p50 | throughput | Envoy CPU per request | router CPU per request | failed |\n", sc.OverheadRate)
	w("|---|---|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range r.Paired {
		headers := "the bench's"
		if p.Client != "" {
			headers = p.Client
		}
		for _, side := range []struct {
			name string
			s    PairedSide
		}{{policyFloor.name, p.Floor}, {policySticky.name, p.Tether}} {
			w("| %s | %s | %s | %s | %.0f/s | %s | %s | %d |\n", headers, side.name, ms2(side.s.SerialP50), ms2(side.s.P50),
				side.s.Throughput(), us(side.s.EnvoyCPUPerRequest), us(side.s.RouterCPUPerRequest), side.s.Failed)
		}
		rs := slices.Sorted(slices.Values(p.RoundRatios))
		if len(rs) > 0 {
			w("| %s | tether ÷ floor, round by round | | | %.2f–%.2f (median %.2f) | | | |\n", headers, rs[0], rs[len(rs)-1], rs[len(rs)/2])
		}
	}
	w("\n| configuration | goal | target | measured | reached |\n")
	w("|---|---|---:|---:|---|\n")
	for _, g := range r.PairedGoals() {
		w("| %s | %s | %s | %s | %s |\n", g.Path, g.What, g.Target(), g.Figure(), g.Verdict())
	}
	w("\n")
}

// bodyMarkdown writes the tables of the rows with a chat body, each
// compared with Envoy alone carrying the same body.
func (r *Report) bodyMarkdown(w func(string, ...any)) {
	sc := r.Scale
	base := map[int]BodyRow{}
	for _, b := range r.Bodies {
		if _, ok := base[b.BodyBytes]; !ok && !b.OnPath {
			base[b.BodyBytes] = b
		}
	}
	w("#### With a chat body\n\n")
	w("The same four instances, each request an OpenAI chat completion (`POST /v1/chat/completions`, compact JSON:\n")
	w("a system message holding a document, the same in every request, then a user question that differs in each,\n")
	w("`max_tokens` 1) of the size shown, sent anonymously (no session id, token or device), so that every\n")
	w("request's placement is open. \"tether sticky, content off\" decides on the headers and Envoy carries the\n")
	w("body past it; \"content on\" (`content.enabled = true`) asks Envoy for every body (ext_proc\n")
	w("`mode_override`, `BUFFERED_PARTIAL`), parses and hashes the prompt and places the request on the instance\n")
	w("holding its longest prefix. The three configurations run side by side, each body size through each in\n")
	w("turn; \"added\" is over Envoy alone with the same body. Throughput: %d connections in a closed loop for %s;\n",
		sc.OverheadWorkers, sc.BodyDuration)
	w("latency on one connection: %d requests one after another; open loop: for %s at the rate shown, half of\n", sc.BodySerial, sc.BodyDuration)
	w("what Envoy alone answered with the body in the closed loop and at most %.0f/s, timed from each request's\n", sc.OverheadRate)
	w("scheduled send (past Envoy alone's own rate every configuration would only queue). The\n")
	w("instances (in the bench's process) read each body too. Bodies read: tether_content_decisions_total over\n")
	w("the closed loop, by result.\n\n")
	w("| configuration | body | one connection p50 | p99 | added p50 | added p99 | open loop rate | p50 | p99 | added p50 | added p99 | failed | dropped |\n")
	w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, b := range r.Bodies {
		e := base[b.BodyBytes]
		w("| %s | %s | %s | %s | %s | %s | %.0f/s | %s | %s | %s | %s | %d | %d |\n", b.Name, bodySize(b.BodyBytes),
			ms2(b.SerialP50), ms2(b.SerialP99), ms2(b.SerialP50-e.SerialP50), ms2(b.SerialP99-e.SerialP99),
			b.Rate, ms2(b.P50), ms2(b.P99), ms2(b.P50-e.P50), ms2(b.P99-e.P99), b.Failed, b.Dropped)
	}
	w("\n")
	w("| configuration | body | requests | throughput | vs Envoy alone | Envoy CPU per request | tether CPU per request | bodies read |\n")
	w("|---|---:|---:|---:|---:|---:|---:|---|\n")
	for _, b := range r.Bodies {
		tether, read := "–", "–"
		if b.OnPath {
			tether = us(b.TetherCPUPerRequest)
			read = fmt.Sprintf("%d of %d", b.BodiesRead(), b.Decisions)
			if t := topResults(b.ContentResults); t != "" {
				read += " (" + t + ")"
			}
		}
		w("| %s | %s | %d | %.0f/s | %.2f | %s | %s | %s |\n", b.Name, bodySize(b.BodyBytes), b.Requests, b.Throughput, ratio(b.Throughput, base[b.BodyBytes].Throughput),
			us(b.EnvoyCPUPerRequest), tether, read)
	}
	w("\n")
}

// headerNames lists h's names in lower case, sorted: "accept,
// user-agent".
func headerNames(h http.Header) string {
	names := make([]string, 0, len(h))
	for k := range h {
		names = append(names, strings.ToLower(k))
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// bodySize is a body's size in KiB, "32 KB (32768 B)", or in bytes
// under 1 KiB.
func bodySize(n int) string {
	if n < 1<<10 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.0f KB (%d B)", float64(n)/(1<<10), n)
}

// topResults renders content results by count, "placed 990, short 10".
func topResults(by map[string]float64) string {
	type kv struct {
		k string
		v float64
	}
	var all []kv
	for k, v := range by {
		all = append(all, kv{k, v})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].v > all[j].v || (all[i].v == all[j].v && all[i].k < all[j].k) })
	var parts []string
	for _, e := range all {
		parts = append(parts, fmt.Sprintf("%s %.0f", e.k, e.v))
	}
	return strings.Join(parts, ", ")
}

func us(d time.Duration) string { return fmt.Sprintf("%d µs", d.Microseconds()) }

func ms2(d time.Duration) string {
	return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
}

func millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func ms(d time.Duration) string {
	return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
}

// Charts writes PNG bar charts into dir and returns their paths.
func (r *Report) Charts(dir string) ([]string, error) {
	// A series is one bar per name; a chart of two or more has a legend
	// and puts each name's bars side by side.
	type series struct {
		label string
		v     plotter.Values
	}
	type chart struct {
		file, title, ylabel string
		names               []string
		series              []series
	}
	var charts []chart
	if len(r.Quality) > 0 {
		var names []string
		var hit, p99 plotter.Values
		for _, q := range r.Quality {
			names = append(names, q.Policy)
			hit = append(hit, 100*q.HitRate)
			p99 = append(p99, millis(q.TTFTP99))
		}
		charts = append(charts,
			chart{"kv-hit-rate.png", "KV-cache hit rate by policy", "cached / prompt tokens (%)", names, []series{{v: hit}}},
			chart{"ttft-p99.png", "P99 time to first token by policy", "milliseconds", names, []series{{v: p99}}})
	}
	if len(r.Hotspot) > 0 {
		var names []string
		var tenant, others plotter.Values
		for _, h := range r.Hotspot {
			// "tether adaptive (scrape 1s)" → "adaptive" over "(scrape 1s)"
			names = append(names, strings.Replace(strings.TrimPrefix(h.Policy, "tether "), " (", "\n(", 1))
			tenant = append(tenant, millis(h.Tenant.TTFTP99))
			others = append(others, millis(h.Others.TTFTP99))
		}
		charts = append(charts, chart{"hotspot-ttft-p99.png", "Hot spot: P99 time to first token", "milliseconds", names,
			[]series{{"hot tenant", tenant}, {"others, started in the hot phase", others}}})
	}
	if len(charts) == 0 {
		return nil, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var out []string
	for _, c := range charts {
		p := plot.New()
		p.Title.Text = c.title
		p.Y.Label.Text = c.ylabel
		width := vg.Points(40)
		if n := len(c.series); n > 1 {
			width = vg.Points(60 / float64(n))
		}
		for i, se := range c.series {
			bars, err := plotter.NewBarChart(se.v, width)
			if err != nil {
				return out, err
			}
			bars.Offset = width * vg.Length(2*i-len(c.series)+1) / 2
			bars.Color = plotutil.Color(i)
			bars.LineStyle.Width = 0
			p.Add(bars)
			if len(c.series) > 1 {
				p.Legend.Add(se.label, bars)
			}
		}
		p.Legend.Top = true
		p.NominalX(c.names...)
		path := filepath.Join(dir, c.file)
		if err := p.Save(7*vg.Inch, 4*vg.Inch, path); err != nil {
			return out, err
		}
		out = append(out, path)
	}
	return out, nil
}

// WriteInto replaces the marked section of the file at path (or appends
// it), keeping everything else.
func WriteInto(path, section string) error {
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	s := string(old)
	if i, j := strings.Index(s, MarkerStart), strings.Index(s, MarkerEnd); i >= 0 && j > i {
		rest := strings.TrimPrefix(s[j+len(MarkerEnd):], "\n")
		s = s[:i] + section + rest
	} else {
		s = strings.TrimRight(s, "\n") + "\n\n" + section
	}
	return os.WriteFile(path, []byte(s), 0o644)
}
