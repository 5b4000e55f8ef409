// Package loadgen replays a workload (package lab/workload) against an
// OpenAI-compatible server, normally Envoy in front of tether and emulated
// GPU instances, and measures what session affinity is for: the share of
// prompt tokens served from the KV cache, latency, how often a
// conversation stays on its instance, and how evenly the instances are
// loaded. See README.md for the method and the metric definitions.
package loadgen

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tetherproxy/tether/internal/pace"
	"github.com/tetherproxy/tether/internal/progress"
	"github.com/tetherproxy/tether/lab/workload"
)

// Result is the outcome of a Run. It marshals to JSON.
type Result struct {
	Settings Settings `json:"settings"`
	// Started is when the run started; Elapsed how long it took, drain
	// included.
	Started time.Time     `json:"started"`
	Elapsed time.Duration `json:"elapsed_ns"`
	// Interrupted is set when the context ended before the run did.
	Interrupted bool `json:"interrupted"`
	// OKPerSecond is the OK requests divided by Settings.Duration: the
	// throughput achieved.
	OKPerSecond float64 `json:"ok_per_second"`
	Summary     Summary `json:"summary"`
	// Records are the requests, by start time.
	Records []Record `json:"records"`
}

// Settings records the options of a run.
type Settings struct {
	Target string  `json:"target"`
	Rate   float64 `json:"rate"` // requests per second
	// ConversationRate is the arrival rate of new conversations:
	// Rate / MeanRequestsPerConversation.
	ConversationRate            float64              `json:"conversation_rate"`
	MeanRequestsPerConversation float64              `json:"mean_requests_per_conversation"`
	Duration                    time.Duration        `json:"duration_ns"`
	Drain                       time.Duration        `json:"drain_ns"`
	ThinkScale                  float64              `json:"think_scale"`
	MaxInFlight                 int                  `json:"max_in_flight"`
	Stream                      bool                 `json:"stream"`
	Model                       string               `json:"model"`
	Seed                        uint64               `json:"seed"`
	Mix                         workload.Mix         `json:"mix"`
	Identities                  workload.IdentityMix `json:"identities"`
	Apps                        []workload.App       `json:"apps"`
}

// progressInterval is how often the progress bar is redrawn.
const progressInterval = 250 * time.Millisecond

// errDrainDeadline is the cause of the cancellation of the requests still
// in flight at the end of the drain.
var errDrainDeadline = errors.New("drain deadline passed")

// Run replays the workload of opts against opts.Target and returns the
// records and their summary.
//
// New conversations arrive as a Poisson process for opts.Duration; each
// runs in its own goroutine, turn after turn: it sends a turn, waits for
// the answer, waits the turn's think time (scaled by ThinkScale), then
// sends the next turn with the answers so far. A turn that would exceed
// MaxInFlight is dropped; a turn that does not end OK ends its
// conversation. After Duration no request starts; the requests in flight
// may finish until Duration + Drain, then they are cancelled. Run returns
// once every goroutine it started has ended.
//
// When ctx ends first, Run cancels what is in flight and returns the
// partial result with ctx's error.
func Run(ctx context.Context, opts Options) (*Result, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	gen, err := workload.New(opts.Workload)
	if err != nil {
		return nil, fmt.Errorf("loadgen: %w", err)
	}
	url, err := opts.endpoint()
	if err != nil {
		return nil, err
	}
	r := &runner{opts: opts, gen: gen, url: url, client: opts.Client, slots: make(chan struct{}, opts.MaxInFlight)}
	if r.client == nil {
		tr := &http.Transport{
			Proxy:             http.ProxyFromEnvironment, // never used for loopback targets
			DialContext:       (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			IdleConnTimeout:   90 * time.Second,
			ForceAttemptHTTP2: false, // one request per connection at a time, as clients of an LLM API do
			// Keep a connection per request in flight instead of Go's
			// default of 2 idle ones per host, so connections are reused
			// under load rather than opened for every request.
			MaxIdleConns:        opts.MaxInFlight,
			MaxIdleConnsPerHost: opts.MaxInFlight,
		}
		r.client = &http.Client{Transport: tr}
		defer tr.CloseIdleConnections()
	}
	return r.run(ctx)
}

// runner is the state of one Run.
type runner struct {
	opts   Options
	gen    *workload.Generator
	url    string
	client *http.Client
	slots  chan struct{} // one token per request in flight
	start  time.Time

	counts struct{ ok, failed, dropped, cancelled atomic.Int64 }

	mu      sync.Mutex
	records []Record
}

func (r *runner) run(ctx context.Context) (*Result, error) {
	meanRequests := r.gen.MeanRequestsPerConversation()
	convRate := r.opts.Rate / meanRequests
	rng := rand.New(r.opts.Rand)

	r.start = time.Now()
	stopAt := r.start.Add(r.opts.Duration)
	// sendCtx ends when no request may start any more; reqCtx, which the
	// requests run under, when the drain ends.
	sendCtx, cancelSend := context.WithDeadline(ctx, stopAt)
	defer cancelSend()
	reqCtx, cancelReqs := context.WithDeadlineCause(ctx, stopAt.Add(r.opts.Drain), errDrainDeadline)
	defer cancelReqs()

	bar := progress.Poll(r.opts.Progress, progress.Options{Total: r.opts.Duration.Milliseconds(), Description: r.status()},
		progressInterval, func() (int64, string) { return time.Since(r.start).Milliseconds(), r.status() })

	// The arrival process: open loop, never waiting on the conversations,
	// at exponential gaps, until the schedule passes Duration or sendCtx
	// ends. Conversations are drawn in arrival order, so a seed gives the
	// same ones.
	arrivals := pace.Schedule{
		Gap:   func() time.Duration { return time.Duration(rng.ExpFloat64() / convRate * float64(time.Second)) },
		For:   r.opts.Duration,
		Start: r.start,
	}
	err := arrivals.Run(sendCtx, func(pace.Arrival) func() {
		conv := r.gen.Next()
		return func() { r.converse(sendCtx, reqCtx, conv) }
	})
	// The run lasts Duration even when the last conversation arrived (and
	// ended) earlier. Every conversation ends by the drain deadline: its
	// think time ends with sendCtx, its request with reqCtx.
	<-sendCtx.Done()
	elapsed := time.Since(r.start)
	bar.Finish()

	slices.SortStableFunc(r.records, func(a, b Record) int {
		return cmp.Or(cmp.Compare(a.Start, b.Start), cmp.Compare(a.Conversation, b.Conversation), cmp.Compare(a.Turn, b.Turn))
	})
	cfg := r.gen.Config()
	res := &Result{
		Settings: Settings{
			Target:                      r.opts.Target,
			Rate:                        r.opts.Rate,
			ConversationRate:            convRate,
			MeanRequestsPerConversation: meanRequests,
			Duration:                    r.opts.Duration,
			Drain:                       r.opts.Drain,
			ThinkScale:                  r.opts.ThinkScale,
			MaxInFlight:                 r.opts.MaxInFlight,
			Stream:                      r.opts.Stream,
			Model:                       r.opts.Model,
			Seed:                        cfg.Seed,
			Mix:                         cfg.Mix,
			Identities:                  cfg.Identities,
			Apps:                        cfg.Apps,
		},
		Started:     r.start,
		Elapsed:     elapsed,
		Interrupted: ctx.Err() != nil,
		Records:     r.records,
		Summary:     Summarize(r.records, r.opts.Instances),
	}
	res.OKPerSecond = float64(res.Summary.OK) / r.opts.Duration.Seconds()
	if err != nil {
		return res, fmt.Errorf("loadgen: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return res, fmt.Errorf("loadgen: interrupted: %w", err)
	}
	return res, nil
}

// converse runs one conversation, turn after turn, until its last turn, a
// turn that does not end OK, or the end of sendCtx.
func (r *runner) converse(sendCtx, reqCtx context.Context, conv workload.Conversation) {
	answers := make([]string, 0, len(conv.Turns))
	records := make([]Record, 0, len(conv.Turns))
	defer func() {
		r.mu.Lock()
		r.records = append(r.records, records...)
		r.mu.Unlock()
	}()
	for k, turn := range conv.Turns {
		if k > 0 && !sleep(sendCtx, time.Duration(float64(turn.Think)*r.opts.ThinkScale)) {
			return // the run stopped starting requests
		}
		if sendCtx.Err() != nil {
			return
		}
		rec := Record{
			Conversation: conv.ID,
			Kind:         conv.Kind,
			App:          conv.App,
			Identity:     conv.Identity.Kind,
			Turn:         k,
			Turns:        len(conv.Turns),
		}
		select {
		case r.slots <- struct{}{}:
		default:
			// MaxInFlight requests are in flight: drop, never wait.
			rec.Start, rec.Fate, rec.Error = time.Since(r.start), Dropped, fmt.Sprintf("%d requests in flight", r.opts.MaxInFlight)
			r.counts.dropped.Add(1)
			records = append(records, rec)
			return
		}
		ans := r.send(reqCtx, &rec, conv, k, answers)
		<-r.slots
		records = append(records, rec)
		switch rec.Fate {
		case OK:
			r.counts.ok.Add(1)
		case Cancelled:
			r.counts.cancelled.Add(1)
			return
		default:
			r.counts.failed.Add(1)
			return
		}
		answers = append(answers, ans)
	}
}

// status is the progress bar's line.
func (r *runner) status() string {
	return fmt.Sprintf("ok %d failed %d dropped %d in flight %d",
		r.counts.ok.Load(), r.counts.failed.Load(), r.counts.dropped.Load(), len(r.slots))
}

// sleep waits d, or until ctx ends; it reports whether d passed with ctx
// still alive.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return ctx.Err() == nil
	case <-ctx.Done():
		return false
	}
}
