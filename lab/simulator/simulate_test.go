package simulator

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"go.uber.org/goleak"

	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/workload"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// small is a short run of the field's mix on 8 instances: about 300
// requests, light load.
func small(p Policy) Options {
	return Options{Policy: p, Rate: 6, Duration: 50 * time.Second, ThinkScale: 0.2, Workload: workload.Config{Seed: 1}, Seed: 1}
}

// chats is multi-turn conversations only, every caller identified by a
// session id unless ids says otherwise.
func chats(p Policy, ids workload.IdentityMix) Options {
	if ids == (workload.IdentityMix{}) {
		ids = workload.IdentityMix{Session: 1}
	}
	return Options{
		Policy: p, Rate: 20, Duration: 60 * time.Second, ThinkScale: 0.1, Seed: 3,
		Workload: workload.Config{Seed: 3, Mix: workload.Mix{MultiTurn: 1}, Identities: ids},
	}
}

func run(t *testing.T, o Options) *Result {
	t.Helper()
	res, err := Run(t.Context(), o)
	if err != nil {
		t.Fatalf("Run(%s): %v", o.Policy, err)
	}
	return res
}

// ignoreRunFields leaves out what differs between two runs of the same
// simulation: the wall clock, and whether the exact path ran.
var ignoreRunFields = cmp.Options{
	cmpopts.IgnoreFields(Result{}, "Wall"),
	cmpopts.IgnoreFields(Settings{}, "Exact"),
	cmpopts.EquateEmpty(),
}

func TestDeterministic(t *testing.T) {
	for _, p := range Policies() {
		t.Run(string(p), func(t *testing.T) {
			a, b := run(t, small(p)), run(t, small(p))
			if diff := cmp.Diff(a, b, ignoreRunFields); diff != "" {
				t.Errorf("two runs of the same options differ (-first +second):\n%s", diff)
			}
			o := small(p)
			o.Workload.Seed = 2
			if c := run(t, o); c.Summary.PromptTokens == a.Summary.PromptTokens {
				t.Errorf("another workload seed gave the same %d prompt tokens", a.Summary.PromptTokens)
			}
		})
	}
}

// TestFastMatchesText runs the same traffic through the fast path (block
// runs, runCache) and the exact path (the texts through emulator.GPU.Cost, as the
// emulator prices them) and wants identical results, to the nanosecond. It
// is what keeps the fast path honest when the emulator's cost model changes.
func TestFastMatchesText(t *testing.T) {
	for _, p := range Policies() {
		t.Run(string(p), func(t *testing.T) {
			o := small(p)
			o.Duration = 40 * time.Second
			o.Cache.MaxConversations = 5 // evictions by the cap too
			fast := run(t, o)
			o.Exact = true
			exact := run(t, o)
			if diff := cmp.Diff(exact, fast, ignoreRunFields); diff != "" {
				t.Errorf("fast path differs from emulator.GPU on the text (-exact +fast):\n%s", diff)
			}
			if fast.Summary.CachedTokens == 0 || fast.Summary.OK < 100 {
				t.Errorf("too little traffic to compare: %d OK, %d cached tokens", fast.Summary.OK, fast.Summary.CachedTokens)
			}
		})
	}
	t.Run("small cache", func(t *testing.T) {
		o := small(Sticky)
		o.Duration = 20 * time.Second
		o.Cache = emulator.CacheConfig{CapacityTokens: 20_000, MaxConversations: -1} // capacity evictions
		fast := run(t, o)
		o.Exact = true
		if diff := cmp.Diff(run(t, o), fast, ignoreRunFields); diff != "" {
			t.Errorf("fast path differs from emulator.GPU on the text (-exact +fast):\n%s", diff)
		}
		if ev := fast.Instances[0].Model.Cache.Evictions; ev == 0 {
			t.Errorf("no capacity evictions: the case is not exercised")
		}
	})
	// Shared documents: the fast path keys blocks by the chain
	// (chain.go) through emulator.KVCache; the exact path hashes the text.
	for _, p := range []Policy{Sticky, RoundRobin, Oracle} {
		t.Run("documents "+string(p), func(t *testing.T) {
			o := docsOptions(p)
			fast := run(t, o)
			o.Exact = true
			if diff := cmp.Diff(run(t, o), fast, ignoreRunFields); diff != "" {
				t.Errorf("fast path differs from emulator.GPU on the text (-exact +fast):\n%s", diff)
			}
			if fast.Summary.ByKind[workload.KindDocs].OK < 100 || fast.Summary.CachedTokens == 0 {
				t.Errorf("too little traffic to compare: %+v", fast.Summary.ByKind[workload.KindDocs])
			}
		})
	}
}

// docsOptions is a small run of shared documents beside chats, half the
// callers anonymous, in small caches (capacity evictions and the cap).
func docsOptions(p Policy) Options {
	return Options{
		Policy: p, Rate: 8, Duration: 40 * time.Second, ThinkScale: 0.2, Seed: 2, Instances: 4,
		Cache: emulator.CacheConfig{CapacityTokens: 6_000, MaxConversations: 6},
		Workload: workload.Config{
			Seed: 2, Mix: workload.Mix{MultiTurn: 0.2, Single: 0.2, Docs: 0.6},
			Identities: workload.IdentityMix{Session: 0.3, Token: 0.1, Device: 0.1, Anonymous: 0.5},
			Docs:       workload.Docs{Count: 12, Tokens: workload.Range{Min: 300, Max: 1500}},
		},
	}
}

func TestStickyContinuity(t *testing.T) {
	res := run(t, chats(Sticky, workload.IdentityMix{}))
	s := res.Summary
	if s.FollowUps < 500 || s.Continuity != 1 {
		t.Errorf("sticky with a stable fleet: continuity %.4f over %d follow-ups, want 1 over at least 500", s.Continuity, s.FollowUps)
	}
	// Token and device callers are kept too; anonymous ones cannot be.
	res = run(t, chats(Sticky, workload.IdentityMix{Session: 0.3, Token: 0.3, Device: 0.3, Anonymous: 0.1}))
	if c := res.Summary.Continuity; c < 0.85 || c > 0.95 {
		t.Errorf("sticky, 10%% anonymous: continuity %.3f, want about 0.9 + 0.1/8", c)
	}
	if d := res.Summary.Decisions; d["hit"] == 0 || d["bind"] == 0 || d["anonymous"] == 0 {
		t.Errorf("decisions %v: want hits, binds and anonymous ones", d)
	}
}

func TestRandomContinuity(t *testing.T) {
	for _, n := range []int{4, 8} {
		o := chats(Random, workload.IdentityMix{})
		o.Instances = n
		s := run(t, o).Summary
		// Follow-ups land on their previous instance with probability
		// 1/n; four standard deviations of the share.
		want := 1 / float64(n)
		tol := 4 * math.Sqrt(want*(1-want)/float64(s.FollowUps))
		if s.FollowUps < 500 || math.Abs(s.Continuity-want) > tol {
			t.Errorf("random on %d instances: continuity %.4f over %d follow-ups, want %.4f ± %.4f", n, s.Continuity, s.FollowUps, want, tol)
		}
	}
}

func TestStickyHitRateAboveRandom(t *testing.T) {
	sticky, random := run(t, small(Sticky)).Summary, run(t, small(Random)).Summary
	if sticky.KVHitRate < random.KVHitRate+0.05 {
		t.Errorf("KV hit rate: sticky %.3f, random %.3f; want sticky at least 5 points higher", sticky.KVHitRate, random.KVHitRate)
	}
	if mt := sticky.ByKind[workload.KindMultiTurn].KVHitRate; mt < 0.8 {
		t.Errorf("sticky: multi-turn KV hit rate %.3f, want above 0.8 (each turn hits the previous prompt and answer)", mt)
	}
}

func TestRingHash(t *testing.T) {
	// Identified callers (session, token, device + user) keep their host.
	res := run(t, chats(RingHash, workload.IdentityMix{Session: 0.4, Token: 0.3, Device: 0.3}))
	if c := res.Summary.Continuity; c != 1 {
		t.Errorf("ring hash, identified callers: continuity %.4f, want 1", c)
	}
	// Anonymous requests carry no hash: Envoy picks a host at random, so
	// they spread over every instance and a conversation does not stay.
	res = run(t, chats(RingHash, workload.IdentityMix{Anonymous: 1}))
	s := res.Summary
	if s.Continuity > 0.25 {
		t.Errorf("ring hash, anonymous callers: continuity %.3f, want about 1/8", s.Continuity)
	}
	for name, n := range s.RequestsPerInstance {
		if n == 0 {
			t.Errorf("ring hash, anonymous callers: %s served nothing", name)
		}
	}
	if s.LoadImbalance > 1.6 {
		t.Errorf("ring hash, anonymous callers: load imbalance %.2f, want them spread", s.LoadImbalance)
	}
}

func TestRoundRobinSpreads(t *testing.T) {
	s := run(t, small(RoundRobin)).Summary
	if s.LoadImbalance > 1.05 {
		t.Errorf("round robin: load imbalance %.3f, want about 1", s.LoadImbalance)
	}
}

// TestEventOrder checks that virtual time never goes back, and that the
// run ends with nothing scheduled and every conversation let go.
func TestEventOrder(t *testing.T) {
	for _, p := range Policies() {
		r, err := newRunner(small(p))
		if err != nil {
			t.Fatal(err)
		}
		last, events := int64(-1), 0
		r.observe = func(at int64) {
			if at < last {
				t.Fatalf("%s: event at %d after one at %d", p, at, last)
			}
			last = at
			events++
		}
		res, err := r.run(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if int64(events) != res.Events || events == 0 {
			t.Errorf("%s: observed %d events, result says %d", p, events, res.Events)
		}
		if len(r.queue) != 0 || r.inFlight != 0 {
			t.Errorf("%s: %d events still queued, %d requests in flight at the end", p, len(r.queue), r.inFlight)
		}
		if res.Simulated < res.Settings.Duration/2 || res.Simulated > res.Settings.Duration+res.Settings.Drain {
			t.Errorf("%s: last event at %v, want within the duration %v plus drain", p, res.Simulated, res.Settings.Duration)
		}
	}
}

func TestEventQueue(t *testing.T) {
	var q eventQueue
	times := []int64{5, 3, 9, 3, 1, 7, 3, 0, 12, 5}
	for i, at := range times {
		q.push(event{at: at, seq: uint64(i)})
	}
	var prev event
	for i := range times {
		e := q.pop()
		if i > 0 && e.before(prev) {
			t.Fatalf("pop %d: (%d, %d) after (%d, %d)", i, e.at, e.seq, prev.at, prev.seq)
		}
		prev = e
	}
	if len(q) != 0 {
		t.Fatalf("%d left", len(q))
	}
}

// TestRequestCount checks the arrival process: requests (and the turns not
// sent at the end) add up to rate × duration within four standard
// deviations.
func TestRequestCount(t *testing.T) {
	t.Run("single queries: Poisson", func(t *testing.T) {
		o := Options{Policy: RoundRobin, Rate: 50, Duration: 100 * time.Second, Workload: workload.Config{Seed: 5, Mix: workload.Mix{Single: 1}}}
		s := run(t, o).Summary
		mean := o.Rate * o.Duration.Seconds()
		if d := math.Abs(float64(s.Requests) - mean); d > 4*math.Sqrt(mean) {
			t.Errorf("%d requests, want %.0f ± %.0f", s.Requests, mean, 4*math.Sqrt(mean))
		}
	})
	t.Run("field mix", func(t *testing.T) {
		o := Options{Policy: Sticky, Instances: 32, Rate: 50, Duration: 200 * time.Second, Workload: workload.Config{Seed: 5}}
		s := run(t, o).Summary
		// Conversations arrive as Poisson(λT) with λ = rate / 2.3; a
		// conversation has 1 turn (80%) or 3 to 12 (20%): the sum of the
		// turns has variance λT·E[turns²] = λT·(0.8 + 0.2·64.5).
		convs := o.Rate * o.Duration.Seconds() / 2.3
		sd := math.Sqrt(convs * (0.8 + 0.2*64.5))
		mean := o.Rate * o.Duration.Seconds()
		if got := float64(s.Requests + s.TurnsNotSent); math.Abs(got-mean) > 4*sd {
			t.Errorf("%d requests + %d turns not sent, want %.0f ± %.0f", s.Requests, s.TurnsNotSent, mean, 4*sd)
		}
		if s.Requests != s.OK+s.Dropped+s.Cancelled || s.Dropped+s.Cancelled != 0 {
			t.Errorf("requests %d = ok %d + dropped %d + cancelled %d; want all OK at this load", s.Requests, s.OK, s.Dropped, s.Cancelled)
		}
	})
}

func TestOverload(t *testing.T) {
	// Far beyond what two instances prefill: the in-flight bound drops,
	// the drain deadline cancels, and the run says it was overloaded.
	o := Options{Policy: Random, Instances: 2, Rate: 200, Duration: 20 * time.Second, MaxInFlight: 50, Workload: workload.Config{Seed: 1}}
	res := run(t, o)
	s := res.Summary
	if s.Dropped == 0 || s.Errors["50 requests in flight"] != s.Dropped {
		t.Errorf("dropped %d, errors %v: want drops counted as loadgen words them", s.Dropped, s.Errors)
	}
	o.MaxInFlight = -1
	res = run(t, o)
	if s := res.Summary; s.Dropped != 0 || s.Cancelled == 0 || s.Errors[errCancelled] != s.Cancelled {
		t.Errorf("without a bound: dropped %d, cancelled %d, errors %v; want cancellations at the drain deadline", s.Dropped, s.Cancelled, s.Errors)
	}
	if res.PrefillLoad < 1 {
		t.Errorf("without a bound: prefill load %.2f, want above 1", res.PrefillLoad)
	}
}

func TestStreamTTFB(t *testing.T) {
	o := small(Sticky)
	plain := run(t, o).Summary
	o.Stream = true
	streamed := run(t, o).Summary
	if plain.TTFB != plain.Latency {
		t.Errorf("not streamed: TTFB %+v, want the latency %+v", plain.TTFB, plain.Latency)
	}
	if streamed.TTFB.P50 >= streamed.Latency.P50/10 || streamed.Latency != plain.Latency {
		t.Errorf("streamed: TTFT p50 %v, latency p50 %v; want the first token long before the end, latency unchanged", streamed.TTFB.P50, streamed.Latency.P50)
	}
}

func TestCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	o := Options{Rate: 1000, Duration: time.Hour, Workload: workload.Config{Seed: 1}}
	var once sync.Once
	o.Progress = func(p Progress) {
		if p.Events > 0 {
			once.Do(cancel)
		}
	}
	res, err := Run(ctx, o)
	if !errors.Is(err, context.Canceled) || res == nil || !res.Interrupted || res.Summary.Requests == 0 {
		t.Fatalf("Run after cancel: result %v, error %v; want a partial result and context.Canceled", res != nil, err)
	}
	if res.Simulated >= time.Hour {
		t.Errorf("simulated %v: the run did not stop", res.Simulated)
	}
}

func TestResultJSON(t *testing.T) {
	res := run(t, small(Sticky))
	b, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{`"kv_hit_rate"`, `"continuity"`, `"gpu_seconds_per_1k_output"`, `"load_imbalance"`, `"wall_ns"`, `"events"`} {
		if !strings.Contains(string(b), key) {
			t.Errorf("JSON has no %s", key)
		}
	}
}

func TestValidate(t *testing.T) {
	ok := Options{Rate: 1, Duration: time.Second}
	tests := []struct {
		name string
		edit func(*Options)
		want string // in the error; "" for none
	}{
		{"defaults", func(*Options) {}, ""},
		{"policy", func(o *Options) { o.Policy = "least-loaded" }, "unknown policy"},
		{"no rate", func(o *Options) { o.Rate = 0 }, "rate"},
		{"nan rate", func(o *Options) { o.Rate = math.NaN() }, "rate"},
		{"no duration", func(o *Options) { o.Duration = 0 }, "duration"},
		{"instances", func(o *Options) { o.Instances = -1 }, "instances"},
		{"zones", func(o *Options) { o.Instances, o.Zones = 2, 3 }, "zones"},
		{"drain", func(o *Options) { o.Drain = -time.Second }, "drain"},
		{"think", func(o *Options) { o.ThinkScale = -1 }, "think scale"},
		{"time scale", func(o *Options) { o.TimeScale = math.Inf(1) }, "time scale"},
		{"ring", func(o *Options) { o.RingSize = -1 }, "ring size"},
		{"lifetime", func(o *Options) { o.Lifetime.Max = time.Minute }, "lifetime"},
		{"cache", func(o *Options) { o.Cache.CapacityTokens = 3 }, "capacity"},
		{"workload", func(o *Options) { o.Workload.Mix = workload.Mix{Long: 2} }, "mix"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := ok
			tt.edit(&o)
			err := o.Validate()
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("Validate: %v", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("Validate: %v, want an error about %q", err, tt.want)
			}
		})
	}
}

// recorder is a latency model that keeps the requests the emulator's
// handler gives it.
type recorder struct {
	mu   sync.Mutex
	reqs []emulator.Request
}

func (r *recorder) Cost(req emulator.Request) emulator.Cost {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reqs = append(r.reqs, req)
	return emulator.Cost{}
}

// TestAnswerTextMatchesEmulator checks the exact path's texts against the
// emulator's handler: the prompt a chat request becomes, and the answer an
// instance gives with ignore_eos.
func TestAnswerTextMatchesEmulator(t *testing.T) {
	g, err := workload.New(workload.Config{Seed: 4, Mix: workload.Mix{MultiTurn: 1}})
	if err != nil {
		t.Fatal(err)
	}
	conv := g.At(0)
	rec := &recorder{}
	h, err := emulator.NewHandler(emulator.Instance{Name: "a100-3", LatencyModel: rec})
	if err != nil {
		t.Fatal(err)
	}
	var answers []string
	for k := range 2 {
		msgs, err := conv.Messages(k, answers)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs, "max_tokens": conv.Turns[k].MaxTokens, "ignore_eos": true})
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequestWithContext(t.Context(), "POST", "/v1/chat/completions", strings.NewReader(string(body))))
		var out struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(w.Body.Bytes(), &out); err != nil || len(out.Choices) != 1 {
			t.Fatalf("turn %d: answer %q: %v", k, w.Body.String(), err)
		}
		got := rec.reqs[k]
		c := &conversation{text: &conv, answers: answers, turn: k, shape: shapeOf(conv, g.Config().Apps), history: conv.SystemTokens}
		for i := range k {
			c.history += conv.Turns[i].UserTokens + conv.Turns[i].MaxTokens
		}
		gpu, _ := emulator.NewGPU(emulator.GPUConfig{Profile: emulator.ProfileA100()})
		m := &textModel{name: "a100-3", gpu: gpu}
		m.cost(c, 0, 0)
		want := strings.Join(func() []string {
			var parts []string
			for _, m := range msgs {
				parts = append(parts, m.Content)
			}
			return parts
		}(), "\n")
		if got.Prompt != want || got.Completion != c.answer || out.Choices[0].Message.Content != c.answer {
			t.Fatalf("turn %d: the emulator saw prompt %d bytes, completion %q, answered %q; the exact path builds %d bytes and %q",
				k, len(got.Prompt), got.Completion, out.Choices[0].Message.Content, len(want), c.answer)
		}
		if got.PromptTokens != c.history+c.shape.turns[k].userTokens || got.CompletionTokens != conv.Turns[k].MaxTokens {
			t.Fatalf("turn %d: emulator counted %d prompt and %d completion tokens; the fast path %d and %d", k,
				got.PromptTokens, got.CompletionTokens, c.history+c.shape.turns[k].userTokens, conv.Turns[k].MaxTokens)
		}
		answers = append(answers, c.answer)
	}
}

func TestPercentiles(t *testing.T) {
	var exact, hist latencies
	rng := newTestRand(9)
	var all []time.Duration
	for i := range exactLatencies + 5000 {
		d := time.Duration(rng.ExpFloat64() * float64(200*time.Millisecond))
		if i%1000 == 0 {
			d = time.Duration(i) // small values, exact buckets
		}
		all = append(all, d)
		hist.add(d)
		if i < 10000 {
			exact.add(d)
		}
	}
	if exact.counts != nil || hist.counts == nil {
		t.Fatalf("exact kept a histogram (%v) or the long one did not (%v)", exact.counts != nil, hist.counts == nil)
	}
	// The exact one is loadgen's nearest rank.
	if p := exact.percentiles(); p.P50 == 0 || p.Max < p.P99 || p.P99 < p.P90 || p.P90 < p.P50 {
		t.Errorf("exact percentiles out of order: %+v", p)
	}
	ref := latencies{exact: append([]time.Duration(nil), all...), n: int64(len(all))}
	want, got := ref.percentiles(), hist.percentiles()
	for _, c := range []struct {
		name      string
		want, got time.Duration
	}{{"p50", want.P50, got.P50}, {"p90", want.P90, got.P90}, {"p99", want.P99, got.P99}, {"max", want.Max, got.Max}, {"mean", want.Mean, got.Mean}} {
		if math.Abs(float64(c.got-c.want)) > float64(c.want)/2000+1 {
			t.Errorf("%s: histogram %v, exact %v: more than 0.05%% apart", c.name, c.got, c.want)
		}
	}
	for _, d := range []time.Duration{0, 1, 2047, 2048, 2049, 4095, 4096, time.Hour, math.MaxInt64} {
		if v := bucketValue(bucketOf(d)); math.Abs(float64(v-d)) > float64(d)/2000+1 {
			t.Errorf("bucket of %d stands for %d", d, v)
		}
	}
}
