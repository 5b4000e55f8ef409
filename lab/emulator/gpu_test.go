package emulator

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"
)

// The measurements of ../shared/calibration (h200-llama8b-shape.json and
// h200-llama8b-shape-batching.json), in milliseconds. They are copied here
// so the package tests without the calibration directory.
var (
	// A user turn of 256 new tokens after a prefix: recomputed (miss) or
	// served from the cache (hit, CUDA graph). The misses below 8k tokens
	// were timed without a CUDA graph and are launch-bound, not fair
	// figures (see the calibration README); they are not compared.
	measuredTurns = []struct {
		prefix    int
		miss, hit float64
	}{
		{512, 0, 13.14},
		{2048, 0, 14.25},
		{8192, 267.62, 18.81},
		{16384, 602.35, 25.20},
	}
	measuredDecode = []struct {
		batch, context int
		ms             float64
	}{
		{1, 2048, 8.442}, {8, 2048, 9.376}, {32, 2048, 11.175}, {64, 2048, 13.402},
		{1, 8192, 8.671}, {8, 8192, 10.793}, {32, 8192, 16.802}, {64, 8192, 24.680},
		{16, 4096, 11.118},                                                     // from the first file: not a table point, interpolated
		{1, 768, 8.420}, {1, 2304, 8.493}, {1, 8448, 8.698}, {1, 16640, 8.953}, // the turn rows' decode steps
	}
	measuredPrefill = []struct {
		prompts, tokens int
		ms              float64
	}{
		{1, 4096, 127.36}, {2, 4096, 259.63}, {4, 4096, 513.73}, {8, 4096, 1007.20},
		{2, 1024, 63.44}, {4, 1024, 120.29}, {8, 1024, 243.59}, // 1 × 1,024 (40 ms) is launch-bound
	}
)

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// within reports whether got is within tol (a fraction) of want.
func within(got, want, tol float64) bool { return math.Abs(got-want) <= tol*math.Abs(want) }

func TestH200MatchesTheCalibration(t *testing.T) {
	p := ProfileH200()
	for _, m := range measuredTurns {
		t.Run(fmt.Sprintf("turn after %d tokens", m.prefix), func(t *testing.T) {
			miss, hit := ms(p.Prefill(m.prefix+256, 0)), ms(p.Prefill(256, m.prefix))
			if !within(hit, m.hit, 0.03) {
				t.Errorf("hit %.2f ms, measured %.2f", hit, m.hit)
			}
			if m.miss == 0 {
				return
			}
			if !within(miss, m.miss, 0.03) {
				t.Errorf("miss %.1f ms, measured %.1f", miss, m.miss)
			}
			if got, want := miss/hit, m.miss/m.hit; !within(got, want, 0.05) {
				t.Errorf("miss/hit %.1f, measured %.1f", got, want)
			}
		})
	}
	for _, m := range measuredDecode {
		if got := ms(p.Decode.Step(m.batch, m.context)); !within(got, m.ms, 0.03) {
			t.Errorf("decode step, batch %d, context %d: %.3f ms, measured %.3f", m.batch, m.context, got, m.ms)
		}
	}
	for _, m := range measuredPrefill {
		// Prompts that arrive together queue for the GPU's prefill; the
		// last one is done after all of them.
		g := newGPU(t, GPUConfig{Profile: p})
		var last Cost
		for i := range m.prompts {
			last = g.Cost(Request{Prompt: text(fmt.Sprint("p", i, "-"), m.tokens)})
		}
		if got := ms(last.Wait); !within(got, m.ms, 0.12) {
			t.Errorf("prefill of %d × %d tokens: %.1f ms, measured %.1f", m.prompts, m.tokens, got, m.ms)
		}
	}
}

func TestA100IsDerivedByDatasheetRatios(t *testing.T) {
	a, h := ProfileA100(), ProfileH200()
	if !a.Estimate || h.Estimate || !strings.Contains(a.Source, "ESTIMATE") {
		t.Errorf("a100 must say it is an estimate: %+v", a)
	}
	prefill := ms(a.Prefill(16640, 0)) / ms(h.Prefill(16640, 0))
	if prefill < 2.9 || prefill > 3.3 {
		t.Errorf("a100/h200 prefill of 16,640 tokens: %.2f, want about 3 (989/312)", prefill)
	}
	for _, m := range measuredDecode {
		if r := ms(a.Decode.Step(m.batch, m.context)) / ms(h.Decode.Step(m.batch, m.context)); !within(r, 2.4, 0.001) {
			t.Errorf("a100/h200 decode step at batch %d, context %d: %.3f, want 2.4", m.batch, m.context, r)
		}
	}
	if a.KVCapacityTokens < 400_000 || a.KVCapacityTokens > 450_000 || h.KVCapacityTokens < 800_000 {
		t.Errorf("kv capacity a100 %d, h200 %d; want 400k–450k and about 850k", a.KVCapacityTokens, h.KVCapacityTokens)
	}
	for _, name := range ProfileNames() {
		p, err := ProfileByName(strings.ToUpper(name))
		if err != nil || p.Name != name || p.Validate() != nil {
			t.Errorf("ProfileByName(%q) = %v, %v", name, p.Name, err)
		}
	}
	if _, err := ProfileByName("v100"); err == nil || !strings.Contains(err.Error(), "a100, h200") {
		t.Errorf("unknown profile: %v", err)
	}
}

func TestDecodeTableExtrapolates(t *testing.T) {
	p := ProfileH200()
	prev := time.Duration(0)
	for _, b := range []int{0, 1, 2, 8, 16, 32, 64, 128, 256} {
		s := p.Decode.Step(b, 4096)
		if s < prev {
			t.Errorf("step at batch %d (%v) is shorter than at a smaller batch (%v)", b, s, prev)
		}
		prev = s
	}
	if s1, s0 := p.Decode.Step(1, 0), p.Decode.Step(1, -5); s0 != s1 || ms(s0) < 8 || ms(s0) > 8.442 {
		t.Errorf("step at context 0: %v (negative: %v), want a little under 8.44 ms", s1, s0)
	}
	one := DecodeTable{Batches: []int{1}, Contexts: []int{100}, StepMs: [][]float64{{5}}}
	if got := one.Step(40, 1e6); got != 5*time.Millisecond {
		t.Errorf("a one-point table is constant: %v", got)
	}
}

func newGPU(t testing.TB, cfg GPUConfig) *GPU {
	t.Helper()
	g, err := NewGPU(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// turnRequests returns a prompt of prefix+256 tokens, and a second one with
// the same prefix and 256 other new tokens.
func turnRequests(prefix int) (first, second string) {
	history := text("h", prefix)
	return join(history, text("new-a", 256)), join(history, text("new-b", 256))
}

func TestGPUCostMissAndHit(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		profile   Profile
		scale     float64
		wantRatio float64 // miss / hit of the wait before the first token
		tol       float64
	}{
		{ProfileH200(), 1, 602.35 / 25.20, 0.05},   // measured 23.9
		{ProfileH200(), 0.1, 602.35 / 25.20, 0.05}, // the time scale keeps ratios
		{ProfileA100(), 1, 27.5, 0.05},             // derived
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%s scale %g", tc.profile.Name, tc.scale), func(t *testing.T) {
			g := newGPU(t, GPUConfig{Profile: tc.profile, TimeScale: tc.scale})
			first, second := turnRequests(16384)
			miss := g.Cost(Request{Prompt: first, PromptTokens: 16640, Arrived: t0})
			hit := g.Cost(Request{Prompt: second, PromptTokens: 16640, Arrived: t0.Add(time.Hour)})
			if miss.CachedTokens != 0 || hit.CachedTokens != 16384 {
				t.Fatalf("cached tokens: miss %d, hit %d; want 0, 16384", miss.CachedTokens, hit.CachedTokens)
			}
			wantMiss := time.Duration(float64(tc.profile.Prefill(16640, 0)) * tc.scale)
			if d := miss.Wait - wantMiss; d < -time.Microsecond || d > time.Microsecond || miss.Queued != 0 || miss.Decode != 0 {
				t.Errorf("miss %+v, want Wait %v and nothing else", miss, wantMiss)
			}
			if r := float64(miss.Wait) / float64(hit.Wait); !within(r, tc.wantRatio, tc.tol) {
				t.Errorf("miss %v / hit %v = %.1f, want %.1f", miss.Wait, hit.Wait, r, tc.wantRatio)
			}
			t.Logf("%s, 16,640-token prompt: miss %v, hit after 16,384 cached %v (scale %g)", tc.profile.Name, miss.Wait, hit.Wait, tc.scale)
		})
	}
}

func TestGPUCostSemantics(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	p := ProfileH200()
	sys := text("sys", 1024)

	t.Run("the last prompt token is always computed", func(t *testing.T) {
		g := newGPU(t, GPUConfig{Profile: p})
		for i, want := range []int{0, 16} {
			if c := g.Cost(Request{Prompt: text("x", 32), Arrived: t0.Add(time.Duration(i) * time.Hour)}); c.CachedTokens != want {
				t.Errorf("request %d of the same 32 tokens: %d cached, want %d", i, c.CachedTokens, want)
			}
		}
	})
	t.Run("a prefill queued behind another finds what that one computed", func(t *testing.T) {
		g := newGPU(t, GPUConfig{Profile: p})
		first := g.Cost(Request{Prompt: join(sys, text("a", 100)), Arrived: t0})
		// Arrives while the first prefill runs: it queues (prefills run one
		// at a time) and starts once the shared prefix is in the cache.
		during := g.Cost(Request{Prompt: join(sys, text("b", 100)), Arrived: t0.Add(first.Wait - time.Microsecond)})
		after := g.Cost(Request{Prompt: join(sys, text("c", 100)), Arrived: t0.Add(time.Hour)})
		if during.Queued <= 0 || during.CachedTokens != 1024 || after.CachedTokens != 1024 {
			t.Errorf("queued %v with %d cached, later %d cached; want queued with 1024, then 1024", during.Queued, during.CachedTokens, after.CachedTokens)
		}
	})
	t.Run("answer blocks serve once the decode is done", func(t *testing.T) {
		g := newGPU(t, GPUConfig{Profile: p})
		prompt := join(sys, text("q", 100))
		answer := text("ans", 320)
		first := g.Cost(Request{Prompt: prompt, Completion: answer, CompletionTokens: 320, Arrived: t0})
		next := join(prompt, answer, text("q2", 20))
		mid := g.Cost(Request{Prompt: next, Arrived: t0.Add(first.Wait + first.Decode/2)})
		late := g.Cost(Request{Prompt: next, Arrived: t0.Add(time.Hour)})
		if mid.CachedTokens >= late.CachedTokens {
			t.Errorf("mid-decode %d cached, after %d: the answer's blocks served before they existed", mid.CachedTokens, late.CachedTokens)
		}
	})
	t.Run("the next turn hits the previous answer", func(t *testing.T) {
		for _, promptOnly := range []bool{false, true} {
			g := newGPU(t, GPUConfig{Profile: p, PromptOnly: promptOnly})
			turn1 := join(sys, text("q", 40))    // 1,064 tokens: 66 blocks + 8
			answer := text("answer", 100)        // with the 8: 6 more blocks
			turn2 := join(turn1, answer, "next") // 1,165 tokens
			g.Cost(Request{Prompt: turn1, Completion: answer, CompletionTokens: 100, Arrived: t0})
			c := g.Cost(Request{Prompt: turn2, Arrived: t0.Add(time.Hour)})
			want := 72 * BlockSize
			if promptOnly {
				want = 66 * BlockSize
			}
			if c.CachedTokens != want {
				t.Errorf("prompt only %v: turn 2 cached %d, want %d", promptOnly, c.CachedTokens, want)
			}
		}
	})
	t.Run("concurrent prefills queue", func(t *testing.T) {
		g := newGPU(t, GPUConfig{Profile: p})
		a := g.Cost(Request{Prompt: text("a", 4096), Arrived: t0})
		b := g.Cost(Request{Prompt: text("b", 4096), Arrived: t0.Add(10 * time.Millisecond)})
		c := g.Cost(Request{Prompt: text("c", 4096), Arrived: t0.Add(time.Hour)})
		if b.Queued != a.Wait-10*time.Millisecond || b.Wait != b.Queued+a.Wait {
			t.Errorf("a %+v, b %+v: b must wait for a's prefill, then its own", a, b)
		}
		if c.Queued != 0 || c.Wait != a.Wait {
			t.Errorf("c arrives on an idle GPU: %+v, want %v and no queue", c, a.Wait)
		}
	})
	t.Run("decode rises with the requests in flight", func(t *testing.T) {
		g := newGPU(t, GPUConfig{Profile: p})
		var prev time.Duration
		for i, inFlight := range []int{0, 7, 31, 63} {
			c := g.Cost(Request{Prompt: text(fmt.Sprint("r", i), 2000), CompletionTokens: 97, InFlight: inFlight, Arrived: t0.Add(time.Duration(i) * time.Hour)})
			want := 96 * p.Decode.Step(inFlight+1, 2000+48)
			if c.Decode != want || c.Decode <= prev {
				t.Errorf("in flight %d: decode %v, want %v (and more than %v)", inFlight, c.Decode, want, prev)
			}
			prev = c.Decode
		}
		// Batch 64 against batch 1 at 2k context: the table's 1.6×.
		b1, b64 := p.Decode.Step(1, 2048), p.Decode.Step(64, 2048)
		if r := float64(b64) / float64(b1); !within(r, 1.59, 0.02) {
			t.Errorf("batch 64 / batch 1 at 2k: %.2f, want 1.59", r)
		}
	})
	t.Run("time scale", func(t *testing.T) {
		full, tenth := newGPU(t, GPUConfig{Profile: p}), newGPU(t, GPUConfig{Profile: p, TimeScale: 0.1})
		r := Request{Prompt: text("s", 3000), CompletionTokens: 50, InFlight: 3, Arrived: t0}
		a, b := full.Cost(r), tenth.Cost(r)
		for _, pair := range [][2]time.Duration{{a.Wait, b.Wait}, {a.Decode, b.Decode}} {
			if d := pair[0]/10 - pair[1]; d < -time.Microsecond || d > time.Microsecond {
				t.Errorf("scale 0.1: %v, want a tenth of %v", pair[1], pair[0])
			}
		}
		if s := tenth.Stats(); s.TimeScale != 0.1 || !within(s.PrefillGPUSeconds, a.Wait.Seconds(), 1e-6) {
			t.Errorf("stats count unscaled GPU time: %+v (prefill %v)", s, a.Wait)
		}
	})
	t.Run("stats and reset", func(t *testing.T) {
		g := newGPU(t, GPUConfig{Profile: ProfileA100(), Cache: CacheConfig{CapacityTokens: 4096, MaxConversations: 3}})
		for i := range 5 {
			g.Cost(Request{Session: fmt.Sprint("s", i), Prompt: text(fmt.Sprint("p", i), 1600), Completion: "ok", CompletionTokens: 11, Arrived: t0.Add(time.Duration(i) * time.Hour)})
		}
		s := g.Stats()
		if s.Profile != "a100" || !s.Estimate || s.Cache.Conversations != 3 || s.Cache.ConversationEvictions != 2 ||
			s.Cache.Tokens > 4096 || s.Cache.CapacityTokens != 4096 || s.PrefillGPUSeconds <= 0 || s.DecodeGPUSeconds <= 0 {
			t.Errorf("stats %+v", s)
		}
		if err := g.Cache().check(); err != nil {
			t.Error(err)
		}
		g.Reset()
		if s := g.Stats(); s.Cache.Blocks != 0 || s.Cache.Conversations != 0 || s.Cache.Evictions != 0 || s.PrefillGPUSeconds != 0 {
			t.Errorf("after Reset: %+v", s)
		}
		if c := g.Cost(Request{Prompt: text("p0", 1600), Arrived: t0}); c.Queued != 0 || c.CachedTokens != 0 {
			t.Errorf("after Reset the queue and cache are empty: %+v", c)
		}
	})
}

func TestGPUConfigRejects(t *testing.T) {
	bad := ProfileH200()
	bad.Decode.StepMs = bad.Decode.StepMs[:1]
	negative := ProfileH200()
	negative.PrefillPerToken = -1
	tests := []struct {
		name string
		cfg  GPUConfig
		want string
	}{
		{"no profile", GPUConfig{}, "no name"},
		{"negative time scale", GPUConfig{Profile: ProfileH200(), TimeScale: -1}, "time_scale -1"},
		{"NaN time scale", GPUConfig{Profile: ProfileH200(), TimeScale: math.NaN()}, "time_scale NaN"},
		{"tiny cache", GPUConfig{Profile: ProfileH200(), Cache: CacheConfig{CapacityTokens: 8}}, "capacity_tokens 8"},
		{"decode rows", GPUConfig{Profile: bad}, "one row of steps per context"},
		{"negative figure", GPUConfig{Profile: negative}, "prefill_per_token -1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewGPU(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("NewGPU = %v, want an error containing %q", err, tc.want)
			}
		})
	}
	g := newGPU(t, GPUConfig{Profile: ProfileH200()})
	if s := g.Stats(); s.TimeScale != 1 || s.Cache.CapacityTokens != ProfileH200().KVCapacityTokens/BlockSize*BlockSize ||
		s.Cache.MaxConversations != DefaultMaxConversations {
		t.Errorf("defaults: %+v", s)
	}
}

func TestGPUConcurrent(t *testing.T) {
	g := newGPU(t, GPUConfig{Profile: ProfileA100(), TimeScale: 0.01, Cache: CacheConfig{CapacityTokens: 20_000, MaxConversations: 8}})
	sys := text("sys", 700)
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Go(func() {
			history := sys
			for turn := range 20 {
				c := g.Cost(Request{
					Session: fmt.Sprint("s", w%10), Prompt: history, Completion: "served by x",
					CompletionTokens: 3, InFlight: w, Arrived: t0.Add(time.Duration(turn) * time.Second),
				})
				if c.Wait <= 0 || c.CachedTokens < 0 {
					t.Errorf("worker %d turn %d: %+v", w, turn, c)
					return
				}
				history = join(history, "served by x", text(fmt.Sprintf("w%d-t%d-", w, turn), 50))
			}
		})
	}
	wg.Wait()
	if err := g.Cache().check(); err != nil {
		t.Fatal(err)
	}
	if s := g.Stats(); s.Cache.Conversations > 8 || s.Cache.Tokens > 20_000 {
		t.Errorf("bounds exceeded: %+v", s.Cache)
	}
}

func BenchmarkGPUCost16kHit(b *testing.B) {
	g := newGPU(b, GPUConfig{Profile: ProfileA100()})
	first, second := turnRequests(16384)
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	g.Cost(Request{Prompt: first, Arrived: t0})
	i := 0
	for b.Loop() {
		i++
		g.Cost(Request{Prompt: second, Completion: "served by gpu-a", CompletionTokens: 3, Arrived: t0.Add(time.Duration(i) * time.Hour)})
	}
}

// TestGPUUtilization: the share of the last second the GPU was booked for,
// from a prefill's start to its decode's end; concurrent work counts once,
// and work that ended over a second ago or starts later not at all.
func TestGPUUtilization(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	g := newGPU(t, GPUConfig{Profile: ProfileA100(), TimeScale: 0.1})
	if u := g.Utilization(t0); u != 0 {
		t.Fatalf("idle: %v, want 0", u)
	}
	first, _ := turnRequests(8192)
	c := g.Cost(Request{Prompt: first, PromptTokens: 8448, CompletionTokens: 64, Arrived: t0})
	work := c.Wait + c.Decode
	if work <= 0 || work >= UtilizationWindow/2 {
		t.Fatalf("test setup: one request takes %v, want between 0 and %v", work, UtilizationWindow/2)
	}
	share := func(d time.Duration) float64 { return float64(d) / float64(UtilizationWindow) }
	for _, tc := range []struct {
		at   time.Duration
		want float64
	}{
		{0, 0},                      // booked, not yet worked
		{work / 2, share(work / 2)}, // half done
		{work, share(work)},
		{work + UtilizationWindow/2, share(work)}, // done, still in the window
		{work/2 + UtilizationWindow, share(work / 2)},
		{work + UtilizationWindow, 0},
	} {
		if u := g.Utilization(t0.Add(tc.at)); math.Abs(u-tc.want) > 1e-9 {
			t.Errorf("at %v: %v, want %v", tc.at, u, tc.want)
		}
	}

	// 50 requests at once: the prefills queue one after another and the
	// decodes overlap, so the GPU is busy without a gap until the last
	// ends, and never more than fully.
	g = newGPU(t, GPUConfig{Profile: ProfileA100()})
	var end time.Duration
	for i := range 50 {
		p, _ := turnRequests(2048 + 64*i)
		c := g.Cost(Request{Prompt: p, PromptTokens: 2304 + 64*i, CompletionTokens: 128, Arrived: t0, InFlight: i})
		end = max(end, c.Wait+c.Decode)
	}
	if end <= UtilizationWindow {
		t.Fatalf("test setup: 50 requests end after %v, want more than %v", end, UtilizationWindow)
	}
	for _, at := range []time.Duration{UtilizationWindow / 2, UtilizationWindow, end} {
		want := min(share(at), 1)
		if u := g.Utilization(t0.Add(at)); math.Abs(u-want) > 1e-9 {
			t.Errorf("50 concurrent requests, at %v: %v, want %v", at, u, want)
		}
	}
	g.Reset()
	if u := g.Utilization(t0.Add(end)); u != 0 {
		t.Errorf("after Reset: %v, want 0", u)
	}
}
