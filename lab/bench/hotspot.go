package bench

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/pace"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/loadgen"
)

// The hot-spot scenario: the quality workload, and in the middle half of
// the run one tenant's batch job behind one API key. Every request of the
// job carries the same bearer token, so sticky routing sees one identity
// and keeps the whole job on one instance: that instance saturates while
// the rest of the fleet has room, which is what adaptive routing is for.

const (
	hotToken        = "Bearer tk-hot-tenant-batch-job"
	hotSystemTokens = 1000 // the tenant's instructions, shared by its requests
	hotOutputTokens = 32
	hotMaxInFlight  = 512 // beyond: the request is dropped (counted as failed)
)

// Traffic is one class of requests in the hot-spot scenario.
type Traffic struct {
	Requests, Failed int
	HitRate          float64 // cached / prompt tokens of the answered ones
	TTFTP50, TTFTP99 time.Duration
	// Spilled is the share of the answered requests that tether moved off
	// a saturated instance (x-tether-decision: spilled).
	Spilled float64
	// Instances is how many instances answered these requests.
	Instances int
}

// HotspotRow is one policy in the hot-spot scenario.
type HotspotRow struct {
	Policy string
	Tenant Traffic // the hot tenant's requests
	Others Traffic // the workload's requests that started during the hot phase
	All    Traffic // every request of the run
	// Decisions and Spilled are from tether's /metrics, as in QualityRow.
	Decisions int
	Spilled   float64
	Spread    Spread
}

// sample is one request of either load, as the hot-spot figures need it.
type sample struct {
	start          time.Duration // from the start of the run
	ok             bool
	ttft           time.Duration
	instance       string
	decision       string
	prompt, cached int
}

func runHotspot(ctx context.Context, opts Options, dir string) ([]HotspotRow, error) {
	fsc := opts.Scale
	fsc.TimeScale = fsc.HotTimeScale
	fleet, instances, err := a100Fleet(fsc, 8)
	if err != nil {
		return nil, err
	}
	defer fleet.close()
	var rows []HotspotRow
	policies := []policy{policySticky}
	for _, d := range opts.Scale.HotScrapeIntervals {
		policies = append(policies, policyAdaptiveEvery(opts.Saturation, d, len(opts.Scale.HotScrapeIntervals) > 1))
	}
	for _, p := range append(policies, policyAdaptiveHeaders(opts.Saturation)) {
		fmt.Fprintf(opts.Log, "hot spot: %s (%s)\n", p.name, opts.Scale.HotDuration)
		if err := fleet.reset(ctx); err != nil {
			return rows, err
		}
		fleet.headers.Store(p.headers)
		row, err := hotspotOnce(ctx, opts, dir, p, fleet, instances)
		if err != nil {
			return rows, fmt.Errorf("%s: %w", p.name, err)
		}
		rows = append(rows, row)
	}
	return rows, nil
}

func hotspotOnce(ctx context.Context, opts Options, dir string, p policy, fleet *simFleet, instances []config.Instance) (HotspotRow, error) {
	st, err := startStack(ctx, opts, dir, p, instances)
	if err != nil {
		return HotspotRow{}, err
	}
	defer st.close()
	sc := opts.Scale
	d := sc.HotDuration
	from, to := d/4, 3*d/4
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: hotMaxInFlight}}
	defer client.CloseIdleConnections()

	// The tenant's job runs beside the workload, with the same drain, and
	// ends before this function returns.
	job := hotJob(sc, opts.Seed, from, to)
	begin := time.Now()
	hctx, cancel := context.WithDeadline(ctx, begin.Add(d+30*time.Second))
	defer cancel()
	var hot []sample
	var hotErr error
	var wg sync.WaitGroup
	wg.Go(func() { hot, hotErr = hotTenant(hctx, client, st.envoy.URL(), sc, job, begin, from) })
	res, err := replayFor(ctx, opts, d, st.envoy.URL(), instances)
	wg.Wait()
	if err = cmp.Or(err, hotErr); err != nil {
		return HotspotRow{}, err
	}
	dec, err := decisions(ctx, st.tether.Admin)
	if err != nil {
		return HotspotRow{}, err
	}
	var others, all []sample
	for _, r := range res.Records {
		s := sample{start: r.Start, ok: r.Fate == loadgen.OK, ttft: r.TTFB, instance: r.Instance,
			decision: r.TetherDecision, prompt: r.PromptTokens, cached: r.CachedTokens}
		if r.Start >= from && r.Start < to {
			others = append(others, s)
		}
		all = append(all, s)
	}
	all = append(all, hot...)
	row := HotspotRow{Policy: p.name, Tenant: trafficOf(hot), Others: trafficOf(others), All: trafficOf(all)}
	row.Spilled, row.Decisions = spilledShare(dec)
	var by []string
	for _, s := range all {
		by = append(by, s.instance)
	}
	row.Spread = spreadOf(names(instances), by, fleet.queueDepths())
	return row, nil
}

func trafficOf(samples []sample) Traffic {
	var t Traffic
	var ttft []time.Duration
	var prompt, cached int64
	spilled := 0
	served := map[string]bool{}
	for _, s := range samples {
		t.Requests++
		if !s.ok {
			t.Failed++
			continue
		}
		ttft = append(ttft, s.ttft)
		prompt += int64(s.prompt)
		cached += int64(s.cached)
		served[s.instance] = true
		if s.decision == "spilled" {
			spilled++
		}
	}
	sortDurations(ttft)
	t.TTFTP50, t.TTFTP99 = percentile(ttft, 0.5), percentile(ttft, 0.99)
	if prompt > 0 {
		t.HitRate = float64(cached) / float64(prompt)
	}
	if len(ttft) > 0 {
		t.Spilled = float64(spilled) / float64(len(ttft))
	}
	t.Instances = len(served)
	return t
}

// hotJob is the bodies of the tenant's requests, one every 1/sc.HotRate
// seconds from from to to, made in advance so that making them does not
// delay sending them.
func hotJob(sc Scale, seed uint64, from, to time.Duration) [][]byte {
	rng := rand.New(rand.NewPCG(seed, 0x686f74)) // "hot"
	system := words(rng, "sys", hotSystemTokens)
	n := int(math.Ceil((to - from).Seconds() * sc.HotRate))
	bodies := make([][]byte, n)
	for i := range bodies {
		b, err := json.Marshal(hotRequest(system, words(rng, fmt.Sprintf("d%d-", i), sc.HotDocTokens)))
		if err != nil {
			panic(err) // plain strings and ints always encode
		}
		bodies[i] = b
	}
	return bodies
}

// hotTenant sends the tenant's job: request i at begin+from+i/sc.HotRate,
// open loop (a request does not wait for the ones before it), each timed
// from the moment it was due so that a queue shows as latency. It returns
// when every request has ended.
func hotTenant(ctx context.Context, client *http.Client, url string, sc Scale, job [][]byte, begin time.Time, from time.Duration) ([]sample, error) {
	var (
		mu  sync.Mutex
		out []sample
	)
	add := func(s sample) {
		mu.Lock()
		defer mu.Unlock()
		out = append(out, s)
	}
	err := pace.Schedule{Rate: sc.HotRate, Count: len(job), Start: begin.Add(from), MaxInFlight: hotMaxInFlight}.Run(ctx, func(a pace.Arrival) func() {
		at := a.Due.Sub(begin)
		if a.Dropped {
			add(sample{start: at})
			return nil
		}
		body := job[a.N]
		return func() {
			s := hotSend(ctx, client, url, body, a.Due)
			s.start = at
			add(s)
		}
	})
	return out, err
}

// sleepUntil waits until t; false when ctx ended first.
func sleepUntil(ctx context.Context, t time.Time) bool {
	timer := time.NewTimer(time.Until(t))
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-timer.C:
		return true
	}
}

// words is n distinct-looking words: the emulator counts a word as a token.
func words(rng *rand.Rand, prefix string, n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(prefix)
		b.WriteString(strconv.FormatUint(rng.Uint64N(1<<20), 36))
	}
	return b.String()
}

type hotMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type hotBody struct {
	Model         string          `json:"model"`
	Messages      []hotMessage    `json:"messages"`
	MaxTokens     int             `json:"max_tokens"`
	IgnoreEOS     bool            `json:"ignore_eos"`
	Stream        bool            `json:"stream"`
	StreamOptions map[string]bool `json:"stream_options"`
}

func hotRequest(system, doc string) hotBody {
	return hotBody{
		Model:     loadgen.DefaultModel,
		Messages:  []hotMessage{{Role: "system", Content: system}, {Role: "user", Content: doc}},
		MaxTokens: hotOutputTokens, IgnoreEOS: true,
		Stream: true, StreamOptions: map[string]bool{"include_usage": true},
	}
}

// hotSend posts one request of the tenant and reads the streamed answer.
func hotSend(ctx context.Context, client *http.Client, url string, body []byte, due time.Time) sample {
	var s sample
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return s
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", hotToken)
	resp, err := client.Do(req)
	if err != nil {
		return s
	}
	defer resp.Body.Close()
	s.instance = resp.Header.Get(emulator.InstanceHeader)
	s.decision = resp.Header.Get(loadgen.DecisionHeader)
	br := bufio.NewReader(resp.Body)
	if _, err := br.Peek(1); err != nil {
		return s
	}
	s.ttft = time.Since(due)
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, br)
		return s
	}
	// The last chunk before [DONE] carries the usage.
	sc := bufio.NewScanner(br)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || !strings.Contains(data, `"usage"`) {
			continue
		}
		var chunk struct {
			Usage *struct {
				PromptTokens int `json:"prompt_tokens"`
				Details      struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if json.Unmarshal([]byte(data), &chunk) == nil && chunk.Usage != nil {
			s.prompt, s.cached = chunk.Usage.PromptTokens, chunk.Usage.Details.CachedTokens
		}
	}
	s.ok = sc.Err() == nil && s.prompt > 0
	return s
}
