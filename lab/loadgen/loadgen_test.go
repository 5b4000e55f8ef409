package loadgen

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/workload"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// serve serves h on a loopback port until the test ends and returns its
// base URL; the cleanup waits for the server to stop.
func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- emulator.Serve(ctx, ln, h) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("emulator.Serve: %v", err)
			}
		case <-time.After(15 * time.Second):
			t.Error("emulator.Serve did not return within 15s")
		}
	})
	return "http://" + ln.Addr().String()
}

// gpuInstance returns the handler of an emulated A100 running 100 times
// faster than real time, so requests take milliseconds.
func gpuInstance(t *testing.T, name string) http.Handler {
	t.Helper()
	g, err := emulator.NewGPU(emulator.GPUConfig{Profile: emulator.ProfileA100(), TimeScale: 0.01})
	if err != nil {
		t.Fatal(err)
	}
	h, err := emulator.NewHandler(emulator.Instance{Name: name, LatencyModel: g})
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// small is a workload with short texts, so runs stay light.
func small(seed uint64, mix workload.Mix) workload.Config {
	return workload.Config{
		Seed:         seed,
		Mix:          mix,
		Apps:         []workload.App{{Name: "support", SystemTokens: 300}, {Name: "code", SystemTokens: 500}},
		LongTokens:   workload.Range{Min: 1000, Max: 2000},
		SingleTokens: workload.Range{Min: 20, Max: 100},
		TurnTokens:   workload.Range{Min: 20, Max: 80},
		Turns:        workload.Range{Min: 3, Max: 5},
		LongOutput:   workload.Range{Min: 20, Max: 60},
		SingleOutput: workload.Range{Min: 10, Max: 40},
		MultiTurnOutput: workload.Range{
			Min: 20, Max: 60,
		},
	}
}

// run calls Run with a bound on how long it may take: duration + drain +
// margin. Stopping by the deadline is part of Run's contract.
func run(t *testing.T, ctx context.Context, opts Options) (*Result, error) {
	t.Helper()
	limit := opts.Duration + opts.Drain + 5*time.Second
	start := time.Now()
	res, err := Run(ctx, opts)
	if took := time.Since(start); took > limit {
		t.Errorf("Run took %v, more than duration %v + drain %v + 5s", took, opts.Duration, opts.Drain)
	}
	return res, err
}

// convIndex parses the index out of a workload conversation ID.
func convIndex(t *testing.T, id string) uint64 {
	t.Helper()
	_, n, ok := strings.Cut(id, "-c")
	i, err := strconv.ParseUint(n, 10, 64)
	if !ok || err != nil {
		t.Fatalf("conversation id %q", id)
	}
	return i
}

func TestRunFillsRecords(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run("stream="+strconv.FormatBool(stream), func(t *testing.T) {
			url := serve(t, gpuInstance(t, "gpu-a"))
			cfg := small(3, workload.Mix{})
			var progress bytes.Buffer
			res, err := run(t, t.Context(), Options{
				Target:     url,
				Workload:   cfg,
				Rate:       15,
				Duration:   2 * time.Second,
				Drain:      5 * time.Second,
				ThinkScale: 0.01,
				Stream:     stream,
				Progress:   &progress,
			})
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
			s := res.Summary
			if s.OK == 0 || s.OK != s.Requests {
				t.Fatalf("summary %+v: want every request OK", s)
			}
			gen, err := workload.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			completion := map[string][]int{} // answer lengths per conversation, by turn
			for i, r := range res.Records {
				if i > 0 && r.Start < res.Records[i-1].Start {
					t.Fatalf("records not sorted by start at %d", i)
				}
				conv := gen.At(convIndex(t, r.Conversation))
				if r.Kind != conv.Kind || r.App != conv.App || r.Identity != conv.Identity.Kind || r.Turns != len(conv.Turns) {
					t.Fatalf("record %+v does not describe conversation %s (%s, %s, %s, %d turns)", r, conv.ID, conv.Kind, conv.App, conv.Identity.Kind, len(conv.Turns))
				}
				if r.Status != http.StatusOK || r.Error != "" || r.Instance != "gpu-a" {
					t.Fatalf("record %+v: want status 200, no error, instance gpu-a", r)
				}
				if r.Latency <= 0 || r.TTFB <= 0 || r.TTFB > r.Latency {
					t.Fatalf("record %+v: want 0 < ttfb <= latency", r)
				}
				// The server counts every message: the system prompt, the
				// user messages and the answers fed back.
				want := conv.SystemTokens
				for k := 0; k <= r.Turn; k++ {
					want += conv.Turns[k].UserTokens
					if k < r.Turn {
						want += conv.Turns[k].MaxTokens
					}
				}
				if r.PromptTokens != want {
					t.Fatalf("%s turn %d: prompt tokens %d, want %d", r.Conversation, r.Turn, r.PromptTokens, want)
				}
				if r.CompletionTokens != conv.Turns[r.Turn].MaxTokens {
					t.Fatalf("%s turn %d: completion tokens %d, want max_tokens %d", r.Conversation, r.Turn, r.CompletionTokens, conv.Turns[r.Turn].MaxTokens)
				}
				if r.CachedTokens < 0 || r.CachedTokens >= r.PromptTokens {
					t.Fatalf("%s turn %d: cached tokens %d of %d", r.Conversation, r.Turn, r.CachedTokens, r.PromptTokens)
				}
				completion[r.Conversation] = append(completion[r.Conversation], r.CompletionTokens)
			}
			if s.KVHitRate <= 0 || s.KVHitRate >= 1 {
				t.Errorf("KV hit rate %v: want between 0 and 1 (shared system prompts)", s.KVHitRate)
			}
			if s.RequestsPerInstance["gpu-a"] != s.OK || s.LoadImbalance != 1 {
				t.Errorf("requests per instance %v, imbalance %v", s.RequestsPerInstance, s.LoadImbalance)
			}
			if !strings.Contains(progress.String(), "ok ") {
				t.Errorf("progress bar output %q", progress.String())
			}
			if _, err := json.Marshal(res); err != nil {
				t.Errorf("Result does not marshal: %v", err)
			}
		})
	}
}

func TestMultiTurnOnOneInstanceHitsTheCache(t *testing.T) {
	url := serve(t, gpuInstance(t, "gpu-a"))
	res, err := run(t, t.Context(), Options{
		Target:   url,
		Workload: small(5, workload.Mix{MultiTurn: 1}),
		Rate:     12,
		Duration: 2 * time.Second,
		Drain:    5 * time.Second,
	})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	byConv := conversations(res.Records)
	var prompt, cached int
	for id, turns := range byConv {
		for i := 1; i < len(turns); i++ {
			prev, cur := turns[i-1], turns[i]
			// The previous request stored its prompt and its answer; this
			// prompt carries both, so every full block of them hits.
			want := (prev.PromptTokens + prev.CompletionTokens) / emulator.BlockSize * emulator.BlockSize
			if cur.CachedTokens < want {
				t.Errorf("%s turn %d: %d cached tokens, want at least %d (the full blocks of turn %d's prompt and answer)", id, cur.Turn, cur.CachedTokens, want, prev.Turn)
			}
			prompt += cur.PromptTokens
			cached += cur.CachedTokens
		}
	}
	if prompt == 0 {
		t.Fatal("no follow-up turn answered")
	}
	if share := float64(cached) / float64(prompt); share < 0.8 {
		t.Errorf("follow-up turns: %.2f of the prompt tokens cached, want at least 0.8", share)
	}
	if c := res.Summary.Continuity; c != 1 {
		t.Errorf("continuity %v with one instance, want 1", c)
	}
}

// concurrency counts the requests a handler serves at once.
type concurrency struct {
	h         http.Handler
	now, peak atomic.Int64
}

func (c *concurrency) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := c.now.Add(1)
	defer c.now.Add(-1)
	for p := c.peak.Load(); n > p && !c.peak.CompareAndSwap(p, n); p = c.peak.Load() {
	}
	c.h.ServeHTTP(w, r)
}

func TestMaxInFlightDrops(t *testing.T) {
	h, err := emulator.NewHandler(emulator.Instance{Name: "slow", Latency: 150 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	c := &concurrency{h: h}
	res, err := run(t, t.Context(), Options{
		Target:      serve(t, c),
		Workload:    small(2, workload.Mix{Single: 1}),
		Rate:        60,
		Duration:    time.Second,
		Drain:       2 * time.Second,
		MaxInFlight: 2,
	})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	s := res.Summary
	if s.Dropped == 0 || s.OK == 0 {
		t.Fatalf("summary %+v: want both dropped and OK requests", s)
	}
	if p := c.peak.Load(); p > 2 {
		t.Errorf("the server saw %d requests at once, more than max in flight 2", p)
	}
	for _, r := range res.Records {
		if r.Fate == Dropped && (r.Status != 0 || r.Latency != 0 || r.Instance != "" || !strings.Contains(r.Error, "2 requests in flight")) {
			t.Errorf("dropped record %+v", r)
		}
	}
}

// hang answers nothing until the request is cancelled.
type hang struct{ started atomic.Int64 }

func (h *hang) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.started.Add(1)
	// Read the body, so the server watches the connection and cancels the
	// request when the client goes away.
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set(InstanceHeader, "stuck")
	<-r.Context().Done()
}

func TestRunStopsByTheDrainDeadline(t *testing.T) {
	h := &hang{}
	opts := Options{
		Target:   serve(t, h),
		Workload: small(4, workload.Mix{}),
		Rate:     20,
		Duration: 500 * time.Millisecond,
		Drain:    300 * time.Millisecond,
	}
	res, err := run(t, t.Context(), opts)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	s := res.Summary
	if s.Cancelled == 0 || s.Cancelled != s.Requests || int64(s.Requests) != h.started.Load() {
		t.Fatalf("summary %+v, server saw %d: want every request cancelled", s, h.started.Load())
	}
	for _, r := range res.Records {
		if !strings.Contains(r.Error, errDrainDeadline.Error()) {
			t.Fatalf("record %+v: want the drain deadline as the error", r)
		}
	}
	if res.Interrupted {
		t.Error("Interrupted set without the context ending")
	}
}

func TestRunStopsWhenTheContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(300*time.Millisecond, cancel)
	start := time.Now()
	res, err := Run(ctx, Options{
		Target:   serve(t, &hang{}),
		Workload: small(4, workload.Mix{}),
		Rate:     20,
		Duration: time.Minute,
		Drain:    time.Minute,
	})
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("Run took %v after the context ended", took)
	}
	if !errors.Is(err, context.Canceled) || res == nil || !res.Interrupted {
		t.Fatalf("Run: %v, result %v: want the partial result and context.Canceled", err, res != nil)
	}
	for _, r := range res.Records {
		if r.Fate != Cancelled {
			t.Fatalf("record %+v: want cancelled", r)
		}
	}
}

func TestFailedTurnEndsItsConversation(t *testing.T) {
	h, err := emulator.NewHandler(emulator.Instance{Name: "gpu-down"})
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/admin/faults", strings.NewReader(`{"down":true}`)))
	if rec.Code != http.StatusOK {
		t.Fatalf("POST /admin/faults: %d %s", rec.Code, rec.Body)
	}
	res, err := run(t, t.Context(), Options{
		Target:   serve(t, h),
		Workload: small(6, workload.Mix{MultiTurn: 1}),
		Rate:     20,
		Duration: 500 * time.Millisecond,
		Drain:    2 * time.Second,
	})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	s := res.Summary
	if s.Failed == 0 || s.Failed != s.Requests || s.Failed != s.Conversations {
		t.Fatalf("summary %+v: want one failed request per conversation", s)
	}
	if s.TurnsNotSent == 0 {
		t.Errorf("no turn left unsent after failures")
	}
	for _, r := range res.Records {
		if r.Status != http.StatusServiceUnavailable || r.Instance != "gpu-down" || !strings.HasPrefix(r.Error, "HTTP 503: ") {
			t.Fatalf("record %+v: want 503 from gpu-down with its message", r)
		}
	}
}

func TestSummarize(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	rec := func(conv string, kind workload.Kind, turn, turns int, out Fate, inst string, prompt, cached int, lat time.Duration) Record {
		return Record{Conversation: conv, Kind: kind, Turn: turn, Turns: turns, Fate: out, Instance: inst,
			PromptTokens: prompt, CachedTokens: cached, Latency: lat, TTFB: lat / 2}
	}
	records := []Record{
		// c1: four turns, a → a → b → b: three follow-ups, two on the
		// instance of the turn before.
		rec("c1", workload.KindMultiTurn, 0, 4, OK, "a", 100, 0, ms(10)),
		rec("c1", workload.KindMultiTurn, 2, 4, OK, "b", 300, 0, ms(30)),
		rec("c1", workload.KindMultiTurn, 1, 4, OK, "a", 200, 150, ms(20)),
		rec("c1", workload.KindMultiTurn, 3, 4, OK, "b", 400, 300, ms(40)),
		// c2: three turns, the second failed on c: no follow-up counts,
		// one turn not sent.
		rec("c2", workload.KindMultiTurn, 0, 3, OK, "a", 100, 50, ms(50)),
		rec("c2", workload.KindMultiTurn, 1, 3, Failed, "c", 0, 0, ms(60)),
		// Single requests: one OK, one dropped, one cancelled.
		rec("c3", workload.KindSingle, 0, 1, OK, "a", 1000, 400, ms(70)),
		rec("c4", workload.KindSingle, 0, 1, Dropped, "", 0, 0, 0),
		rec("c5", workload.KindSingle, 0, 1, Cancelled, "", 0, 0, ms(80)),
	}
	records[0].TetherDecision, records[2].TetherDecision = "bind", "hit"
	records[5].Error, records[7].Error, records[8].Error = "HTTP 503: down", "2 requests in flight", "cancelled: drain deadline passed"
	s := Summarize(records, []string{"a", "b", "c", "idle"})

	check := func(name string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-9 {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	check("conversations", float64(s.Conversations), 5)
	check("completed", float64(s.ConversationsCompleted), 2)
	check("requests", float64(s.Requests), 9)
	check("ok", float64(s.OK), 6)
	check("failed", float64(s.Failed), 1)
	check("dropped", float64(s.Dropped), 1)
	check("cancelled", float64(s.Cancelled), 1)
	check("turns not sent", float64(s.TurnsNotSent), 1)
	check("prompt tokens", float64(s.PromptTokens), 2100)
	check("cached tokens", float64(s.CachedTokens), 900)
	check("KV hit rate", s.KVHitRate, 900.0/2100)
	check("follow-ups", float64(s.FollowUps), 3)
	check("same instance", float64(s.FollowUpsSameInstance), 2)
	check("continuity", s.Continuity, 2.0/3)
	// a: 4 (c1 ×2, c2, c3), b: 2, c: 1 (the failed answer), idle: 0;
	// mean 7/4, max 4.
	check("load imbalance", s.LoadImbalance, 4/(7.0/4))
	if got := s.RequestsPerInstance; len(got) != 4 || got["a"] != 4 || got["b"] != 2 || got["c"] != 1 || got["idle"] != 0 {
		t.Errorf("requests per instance %v", got)
	}
	// OK latencies 10 20 30 40 50 70 ms: nearest rank p50 = 3rd, p90 = 6th.
	if s.Latency.P50 != ms(30) || s.Latency.P90 != ms(70) || s.Latency.P99 != ms(70) || s.Latency.Max != ms(70) || s.Latency.Mean != ms(220)/6 {
		t.Errorf("latency %+v", s.Latency)
	}
	if s.TTFB.P50 != ms(15) {
		t.Errorf("ttfb p50 %v, want 15ms", s.TTFB.P50)
	}
	if s.Decisions["bind"] != 1 || s.Decisions["hit"] != 1 || len(s.Decisions) != 2 {
		t.Errorf("decisions %v", s.Decisions)
	}
	if len(s.Errors) != 3 || s.Errors["HTTP 503: down"] != 1 {
		t.Errorf("errors %v", s.Errors)
	}
	mt := s.ByKind[workload.KindMultiTurn]
	if mt.Requests != 6 || mt.OK != 5 || math.Abs(mt.KVHitRate-500.0/1100) > 1e-9 || math.Abs(mt.Continuity-2.0/3) > 1e-9 || mt.Latency.P50 != ms(30) {
		t.Errorf("multiturn %+v", mt)
	}
	if sg := s.ByKind[workload.KindSingle]; sg.Requests != 3 || sg.OK != 1 || sg.KVHitRate != 0.4 || sg.Continuity != 0 {
		t.Errorf("single %+v", sg)
	}

	empty := Summarize(nil, nil)
	if empty.KVHitRate != 0 || empty.Continuity != 0 || empty.LoadImbalance != 0 || empty.Latency != (Percentiles{}) {
		t.Errorf("summary of nothing %+v", empty)
	}
}

func TestOptionsValidate(t *testing.T) {
	ok := Options{Target: "http://127.0.0.1:10000", Rate: 1, Duration: time.Second}
	tests := []struct {
		name   string
		modify func(*Options)
		want   string // error substring, or the endpoint when valid
	}{
		{"defaults", func(*Options) {}, "http://127.0.0.1:10000/v1/chat/completions"},
		{"localhost with path", func(o *Options) { o.Target = "http://localhost:8001/api/" }, "http://localhost:8001/api/v1/chat/completions"},
		{"already /v1", func(o *Options) { o.Target = "http://[::1]:8001/v1" }, "http://[::1]:8001/v1/chat/completions"},
		{"remote allowed", func(o *Options) { o.Target, o.AllowRemote = "https://gpu.example.com", true }, "https://gpu.example.com/v1/chat/completions"},
		{"remote", func(o *Options) { o.Target = "http://10.0.0.8:8000" }, "is not a loopback address"},
		{"remote name", func(o *Options) { o.Target = "http://example.com" }, "--allow-remote"},
		{"empty target", func(o *Options) { o.Target = "" }, "target is empty"},
		{"scheme", func(o *Options) { o.Target = "ftp://127.0.0.1" }, "want an http:// or https:// URL"},
		{"no scheme", func(o *Options) { o.Target = "127.0.0.1:10000" }, "127.0.0.1:10000"},
		{"query", func(o *Options) { o.Target = "http://127.0.0.1/?a=b" }, "without query"},
		{"zero rate", func(o *Options) { o.Rate = 0 }, "rate 0: want requests per second above 0"},
		{"NaN rate", func(o *Options) { o.Rate = math.NaN() }, "rate NaN"},
		{"zero duration", func(o *Options) { o.Duration = 0 }, "duration 0s"},
		{"negative drain", func(o *Options) { o.Drain = -time.Second }, "drain -1s"},
		{"think scale", func(o *Options) { o.ThinkScale = -1 }, "think scale -1"},
		{"max in flight", func(o *Options) { o.MaxInFlight = -1 }, "max in flight -1"},
		{"workload", func(o *Options) { o.Workload.Mix = workload.Mix{Long: 0.5} }, "loadgen: workload: mix: shares"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := ok
			tt.modify(&o)
			err := o.Validate()
			if strings.HasPrefix(tt.want, "http") && strings.HasSuffix(tt.want, "/completions") {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				if got, _ := o.endpoint(); got != tt.want {
					t.Fatalf("endpoint %q, want %q", got, tt.want)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate: %v, want an error containing %q", err, tt.want)
			}
		})
	}
	if _, err := Run(t.Context(), Options{}); err == nil {
		t.Error("Run with zero options: no error")
	}
}

// TestRunIsReproducible checks that a seed gives the same arrivals: the
// conversations of the stream from the first on, as many each time (give or
// take the last one, which may arrive just as the duration ends).
func TestRunIsReproducible(t *testing.T) {
	url := serve(t, gpuInstance(t, "gpu-a"))
	var counts [2]int
	for i := range counts {
		res, err := run(t, t.Context(), Options{
			Target:   url,
			Workload: small(9, workload.Mix{Single: 1}),
			Rate:     20,
			Duration: time.Second,
			Drain:    5 * time.Second,
		})
		if err != nil {
			t.Fatal(err)
		}
		seen := map[uint64]bool{}
		for _, r := range res.Records {
			seen[convIndex(t, r.Conversation)] = true
		}
		for n := range uint64(len(seen)) {
			if !seen[n] {
				t.Fatalf("run %d: conversation %d missing among %d", i, n, len(seen))
			}
		}
		counts[i] = len(seen)
	}
	if counts[0] == 0 || counts[0]-counts[1] > 1 || counts[1]-counts[0] > 1 {
		t.Errorf("two runs with seed 9 started %d and %d conversations", counts[0], counts[1])
	}
}

func TestSummarizeCapsErrorKinds(t *testing.T) {
	var records []Record
	for i := range MaxErrorKinds + 5 {
		records = append(records, Record{Conversation: strconv.Itoa(i), Fate: Failed, Error: "error " + strconv.Itoa(i)})
	}
	s := Summarize(records, nil)
	if len(s.Errors) != MaxErrorKinds+1 || s.Errors[OtherErrors] != 5 {
		t.Errorf("%d error kinds, %d others: want %d kinds and 5 others", len(s.Errors), s.Errors[OtherErrors], MaxErrorKinds)
	}
}
