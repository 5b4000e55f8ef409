package simulator

import (
	"context"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/workload"
)

// RegimeFigures are the figures a Scenario's changes call for. Counts of
// conversations count each once, however often it happened to it; only
// requests sent after the warmup count.
type RegimeFigures struct {
	// Moved counts the conversations with an identity (a header Envoy's
	// hash policies read) whose follow-up went to another instance while
	// the one that served its previous turn was still up and unchanged: a
	// move the router chose. Displaced counts those whose instance had
	// gone (scaled in, failed) or restarted (upgraded) meanwhile.
	Moved     int `json:"moved"`
	Displaced int `json:"displaced"`
	// ModelSwitches counts the conversations with a turn served by another
	// model version than their previous turn.
	ModelSwitches int `json:"model_switches"`
	// Failed counts the requests that failed with their instance; Refused
	// those tether refused (strict version affinity and no instance of
	// the session's version left); FailOpen those Envoy's fail-open route
	// carried while tether was unreachable (OK ones).
	Failed   int `json:"failed"`
	Refused  int `json:"refused"`
	FailOpen int `json:"fail_open"`
	// Lost adds up every request that did not end OK: dropped, cancelled,
	// failed, refused.
	Lost int `json:"lost"`
	// Queued counts the OK requests whose prefill waited for another
	// request's (the instance was prefilling when they arrived);
	// QueuedShare is their share of the OK requests.
	Queued      int     `json:"queued"`
	QueuedShare float64 `json:"queued_share"`
	// FanOut counts the OK fan-out requests of a turn but its first
	// (Scenario.FanOut), FanOutTogether those served by the instance that
	// served the turn's first; FanOutTogetherShare is the share.
	FanOut              int     `json:"fan_out"`
	FanOutTogether      int     `json:"fan_out_together"`
	FanOutTogetherShare float64 `json:"fan_out_together_share"`
	// MeanInstances is the instances up, on average; ActiveConversations
	// the conversations in progress (in a turn or thinking), on average;
	// KVConversations the conversations the fleet's KV caches keep at
	// most (mean instances × each cache's conversation cap, 0: no cap), and
	// KVPressure the ratio of the two.
	MeanInstances       float64 `json:"mean_instances"`
	ActiveConversations float64 `json:"active_conversations"`
	KVConversations     float64 `json:"kv_conversations"`
	KVPressure          float64 `json:"kv_pressure"`
	// BurstTTFT and OthersTTFT are the time to first token of the burst
	// tenant's requests and of everyone else's (Scenario.Burst).
	BurstTTFT  loadgen.Percentiles `json:"burst_ttft,omitzero"`
	OthersTTFT loadgen.Percentiles `json:"others_ttft,omitzero"`
}

func (f *RegimeFigures) finish(r *runner, s loadgen.Summary, instances float64) {
	f.Lost = s.Dropped + s.Cancelled + f.Failed + f.Refused
	f.QueuedShare = ratio(float64(f.Queued), float64(s.OK))
	f.FanOutTogetherShare = ratio(float64(f.FanOutTogether), float64(f.FanOut))
	f.MeanInstances = instances
	measured := float64(r.end - r.measureFrom)
	f.ActiveConversations = r.convArea / measured
	if cap := r.conversationCap(); cap > 0 {
		f.KVConversations = instances * float64(cap)
		f.KVPressure = f.ActiveConversations / f.KVConversations
	}
	if r.opts.Scenario.Burst != (Burst{}) {
		f.BurstTTFT, f.OthersTTFT = r.burstTTFB.percentiles(), r.othersTTFB.percentiles()
	}
}

// conversationCap is each instance's conversation cap (0: none).
func (r *runner) conversationCap() int {
	switch n := r.opts.Cache.MaxConversations; {
	case n == 0:
		return emulator.DefaultMaxConversations
	case n > 0:
		return n
	}
	return 0
}

// Minute is one minute of a run (Options.Series), from the warmup's end,
// or one Options.SeriesEvery.
type Minute struct {
	Start     time.Duration `json:"start_ns"` // from the start of the run
	Instances int           `json:"instances"`
	OK        int           `json:"ok"`
	Lost      int           `json:"lost"`
	KVHitRate float64       `json:"kv_hit_rate"`
	// The OK requests' prompt tokens and those the cache held (KVHitRate
	// is their ratio), to add entries up.
	PromptTokens int64         `json:"prompt_tokens"`
	CachedTokens int64         `json:"cached_tokens"`
	TTFTP50      time.Duration `json:"ttft_p50_ns"`
	TTFTP99      time.Duration `json:"ttft_p99_ns"`
}

type minuteTally struct {
	ok, lost, instances int
	prompt, cached      int64
	ttfb                latencies
}

func (m *minuteTally) add(k *call, instances int) {
	m.ok++
	m.prompt += int64(k.prompt)
	m.cached += int64(k.cached)
	m.ttfb.add(k.ttfb)
	m.instances = max(m.instances, instances)
}

func (m *minuteTally) minute(from int64, i int, every time.Duration) Minute {
	p := m.ttfb.percentiles()
	return Minute{
		Start: time.Duration(from) + time.Duration(i)*every, Instances: m.instances,
		OK: m.ok, Lost: m.lost, KVHitRate: ratio(float64(m.cached), float64(m.prompt)), TTFTP50: p.P50, TTFTP99: p.P99,
		PromptTokens: m.prompt, CachedTokens: m.cached,
	}
}

// minute is the tally of the series entry (Options.SeriesEvery) holding
// a request sent at sent and ending now, by Options.SeriesByEnd, or nil
// when the run keeps no series or the request was sent in the warmup.
func (r *runner) minute(sent int64) *minuteTally {
	if !r.opts.Series || !r.measuring || sent < r.measureFrom {
		return nil
	}
	t := sent
	if r.opts.SeriesByEnd {
		t = r.now
	}
	i := int((t - r.measureFrom) / int64(r.opts.SeriesEvery))
	for len(r.series) <= i {
		r.series = append(r.series, minuteTally{})
	}
	return &r.series[i]
}

// lost counts a request sent at t that did not end OK in its entry.
func (r *runner) lost(t int64) {
	if m := r.minute(t); m != nil {
		m.lost++
	}
}

// Regime is a named scenario: a workload condition in which routing
// decides the outcome, run on the caller's fleet and rate.
type Regime struct {
	Name string
	// What says, in a line, what the regime does and what to read in it.
	What string
	// Apply sets the regime's duration, warmup and scenario on o (its
	// fleet, rate and workload are the caller's). It may run a short
	// pilot simulation (kv-pressure sizes the caches from one).
	Apply func(o Options) (Options, error)
}

// The regimes' common shape: ten minutes warm the caches, the figures
// cover the rest.
const (
	regimeWarmup   = 10 * time.Minute
	regimeDuration = 40 * time.Minute
)

// SharedDocumentsKVTokens is each instance's KV cache in the
// shared-documents regime: 12,288 tokens, two documents of the mean
// length (6,000 tokens) at most. The 200 documents hold about 1.2 M
// tokens, so 64 instances keep at most two thirds of them (786 k tokens)
// even were no document cached twice and nothing else cached.
const SharedDocumentsKVTokens = 12288

// SharedDocuments is the shared-documents regime's traffic and caches on
// the caller's seed and applications (its duration and warmup the
// caller's too; the bench's documents run replays it through Envoy): KindDocs conversations only
// (workload.DefaultDocs: 200 documents of 4,000–8,000 tokens, Zipf s = 1,
// 2–4 questions of 20–100 tokens), half the callers anonymous (the rest
// 30% session id, 10% bearer token, 10% device and user), in caches of
// SharedDocumentsKVTokens (the conversation cap the caller's).
func SharedDocuments(o Options) Options {
	o.Workload.Mix = workload.Mix{Docs: 1}
	o.Workload.Identities = workload.IdentityMix{Session: 0.3, Token: 0.1, Device: 0.1, Anonymous: 0.5}
	o.Workload.Docs = workload.Docs{}
	o.Cache.CapacityTokens = SharedDocumentsKVTokens
	return o
}

// KVPressureTarget is the kv-pressure regime's active conversations over
// the fleet's KV capacity in conversations.
const KVPressureTarget = 1.5

// Regimes lists the regimes, in the order the tables show them; "day" is
// all of them at once over an hour.
func Regimes() []Regime {
	steady := func(o Options) Options {
		o.Duration, o.Scenario = regimeDuration, Scenario{Warmup: regimeWarmup}
		return o
	}
	scale := Scale{Every: 10 * time.Minute, Step: 0.25, Lag: time.Minute}
	upgrade := func(o Options, at time.Duration) Upgrade {
		from := o.versions()[0]
		to := "v2"
		if from != "v1" {
			to = from + "-next"
		}
		return Upgrade{From: from, To: to, At: at, Over: 20 * time.Minute}
	}
	failures := Failures{Every: 10 * time.Minute, Down: 2 * time.Minute}
	return []Regime{
		{"steady", "a fixed fleet at the given rate, caches warm: the load against capacity is in the table",
			func(o Options) (Options, error) { return steady(o), nil }},
		{"kv-pressure", fmt.Sprintf("as steady, with each KV cache keeping fewer conversations: %.1f× as many conversations in progress as the fleet's caches keep", KVPressureTarget),
			func(o Options) (Options, error) { return kvPressure(steady(o)) }},
		{"autoscale", "the load steps by a quarter every ten minutes (up, back, down, back) and the fleet follows a minute later, as a queue-based autoscaler would",
			func(o Options) (Options, error) {
				o = steady(o)
				o.Duration, o.Scenario.Scale = 50*time.Minute, scale
				return o, nil
			}},
		{"upgrade", "from minute 15 the instances restart on a new model version (v2) one by one over twenty minutes; tether runs strict version affinity",
			func(o Options) (Options, error) {
				o = steady(o)
				o.Scenario.Upgrade = upgrade(o, 15*time.Minute)
				return o, nil
			}},
		{"failures", "an instance fails every ten minutes and returns two minutes later with an empty cache",
			func(o Options) (Options, error) {
				o = steady(o)
				o.Scenario.Failures = failures
				return o, nil
			}},
		{"burst", "from minute 15, for five minutes, one tenant adds 15% of the rate behind one API key (no session id)",
			func(o Options) (Options, error) {
				o = steady(o)
				o.Scenario.Burst = Burst{At: 15 * time.Minute, For: 5 * time.Minute, Share: 0.15}
				return o, nil
			}},
		{"agents", "every turn fans out eight concurrent requests on one prompt under the conversation's session (the rate counts each)",
			func(o Options) (Options, error) {
				o = steady(o)
				o.Scenario.FanOut = 8
				return o, nil
			}},
		{"outage", "every tether replica is unreachable from minute 15 for one minute: Envoy's fail-open route carries tether's traffic",
			func(o Options) (Options, error) {
				o = steady(o)
				o.Scenario.Outage = Outage{At: 15 * time.Minute, For: time.Minute}
				return o, nil
			}},
		{"shared-documents", fmt.Sprintf("questions about %d long shared documents (%d–%d tokens, Zipf s = %g), half the callers anonymous, each KV cache %d tokens: the fleet's caches hold a fraction of the documents", workload.DefaultDocs().Count, workload.DefaultDocs().Tokens.Min, workload.DefaultDocs().Tokens.Max, workload.DefaultDocs().Skew, SharedDocumentsKVTokens),
			func(o Options) (Options, error) { return SharedDocuments(steady(o)), nil }},
		{"day", "a day in the life: one hour after the warmup with the autoscaler, an upgrade from minute 25, a failure every ten minutes and a burst at minute 50",
			func(o Options) (Options, error) {
				o.Duration = regimeWarmup + time.Hour
				o.Scenario = Scenario{
					Warmup: regimeWarmup, Scale: scale, Failures: failures,
					Upgrade: upgrade(o, 25*time.Minute),
					Burst:   Burst{At: 50 * time.Minute, For: 5 * time.Minute, Share: 0.15},
				}
				return o, nil
			}},
	}
}

// RegimeNames lists the regimes' names.
func RegimeNames() []string {
	var out []string
	for _, r := range Regimes() {
		out = append(out, r.Name)
	}
	return out
}

// LookupRegime returns the regime called name.
func LookupRegime(name string) (Regime, error) {
	for _, r := range Regimes() {
		if strings.EqualFold(r.Name, name) {
			return r, nil
		}
	}
	return Regime{}, fmt.Errorf("simulate: unknown regime %q: want one of %s", name, strings.Join(RegimeNames(), ", "))
}

// kvPressure sizes each instance's conversation cap so the conversations
// in progress are KVPressureTarget times what the fleet's caches keep: a
// pilot run of o (Envoy's ring hash: the conversations in progress hardly
// depend on the router) counts them.
func kvPressure(o Options) (Options, error) {
	pilot := o
	pilot.Policy, pilot.Progress, pilot.Series = RingHash, nil, false
	res, err := Run(context.Background(), pilot)
	if err != nil {
		return o, fmt.Errorf("simulate: kv-pressure pilot run: %w", err)
	}
	active := res.Regime.ActiveConversations
	// Rounded down: at least the target.
	o.Cache.MaxConversations = max(int(math.Floor(active/KVPressureTarget/float64(o.withDefaults().Instances))), 1)
	return o, nil
}
