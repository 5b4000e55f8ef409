package bench

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tetherproxy/tether/internal/pace"
)

// The overhead scenario's own load: tiny requests, so what is measured is
// the proxy path, not the model.

const tinyBody = `{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":1}`

// newLoadClient is the overhead scenario's client; one per run, closed
// with it.
func newLoadClient() *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 256, MaxConnsPerHost: 256}}
}

// send posts one tiny request for session s, with the client's headers
// beside the bench's own.
func send(ctx context.Context, client *http.Client, url, s string, c clientHeaders) error {
	return sendAs(ctx, client, url, soakCaller{session: s}, c.h)
}

// clientHeaders is what a kind of client sends with every request beside
// the bench's own headers (content type and session id; Go adds host,
// user agent, content length and accept-encoding), keys in canonical
// form; the zero value adds nothing.
type clientHeaders struct {
	name string // "" for the bench's own client
	h    http.Header
}

// openAIPython is what the official OpenAI Python client (openai-python
// 2.x over httpx, with its default timeout, on Linux x86-64) sends with a
// chat completion: its platform headers (x-stainless-*), user agent, API
// key, accept, connection and accept-encoding; with content type, host
// and content length, 17 headers, and 18 with the session id an
// application adds (default_headers). The key is the bench's own, made
// up.
var openAIPython = clientHeaders{name: "OpenAI Python client's headers", h: http.Header{
	"Accept":                      {"application/json"},
	"Accept-Encoding":             {"gzip, deflate"},
	"Authorization":               {"Bearer sk-bench-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKL"},
	"Connection":                  {"keep-alive"},
	"User-Agent":                  {"OpenAI/Python 2.54.0"},
	"X-Stainless-Arch":            {"x64"},
	"X-Stainless-Async":           {"false"},
	"X-Stainless-Lang":            {"python"},
	"X-Stainless-Os":              {"Linux"},
	"X-Stainless-Package-Version": {"2.54.0"},
	"X-Stainless-Read-Timeout":    {"600"},
	"X-Stainless-Retry-Count":     {"0"},
	"X-Stainless-Runtime":         {"CPython"},
	"X-Stainless-Runtime-Version": {"3.12.7"},
}}

// request sends the i-th request of worker w of a loop (a schedule's n-th
// arrival is worker n%64's request n/64; a serial run is worker 2000's).
type request func(ctx context.Context, client *http.Client, url string, w, i int) error

// tiny is the tiny request for session(w, i), with c's headers.
func tiny(c clientHeaders, session func(w, i int) string) request {
	return func(ctx context.Context, client *http.Client, url string, w, i int) error {
		return send(ctx, client, url, session(w, i), c)
	}
}

// session names: ten requests per session, so sticky routing sees nine
// hits for each new binding.
func sessionFor(worker, i int) string { return fmt.Sprintf("ovh-%d-%d", worker, i/10) }

// fixedRate sends rate requests a second for d (open loop: arrivals do
// not wait for answers; at most maxInFlight are outstanding, the rest are
// counted as dropped) and returns the latencies of the successful ones,
// each measured from the moment it was due, so a sender that falls behind
// shows as latency rather than hiding it.
func fixedRate(ctx context.Context, client *http.Client, url string, rate float64, d time.Duration, req request) (lat []time.Duration, failed, dropped int, err error) {
	const maxInFlight = 512
	var mu sync.Mutex
	err = pace.Schedule{Rate: rate, For: d, MaxInFlight: maxInFlight}.Run(ctx, func(a pace.Arrival) func() {
		if a.Dropped {
			dropped++
			return nil
		}
		return func() {
			err := req(ctx, client, url, a.N%64, a.N/64)
			took := time.Since(a.Due)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed++
				return
			}
			lat = append(lat, took)
		}
	})
	return lat, failed, dropped, err
}

// closedLoop runs workers that each send as fast as answers come back,
// the i-th request of worker w being req(w, i), for d or until hitLoopMax
// requests were sent, and returns the requests completed and failed.
func closedLoop(ctx context.Context, client *http.Client, url string, workers int, d time.Duration, req request) (ok, failed int64) {
	const limit = hitLoopMax
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var okN, failN, sent atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; ctx.Err() == nil && sent.Add(1) <= limit; i++ {
				if err := req(ctx, client, url, w, i); err != nil {
					if ctx.Err() == nil {
						failN.Add(1)
					}
					continue
				}
				okN.Add(1)
			}
		}(w)
	}
	wg.Wait()
	return okN.Load(), failN.Load()
}

// serial sends n requests one after another (on client, which should hold
// one connection), for at most serialTimeout, each req(2000, i), and
// returns the latencies of the successful ones.
func serial(ctx context.Context, client *http.Client, url string, n int, req request) (lat []time.Duration, failed int) {
	ctx, cancel := context.WithTimeout(ctx, serialTimeout)
	defer cancel()
	lat = make([]time.Duration, 0, n)
	for i := 0; i < n && ctx.Err() == nil; i++ {
		t0 := time.Now()
		if err := req(ctx, client, url, 2000, i); err != nil {
			if ctx.Err() == nil {
				failed++
			}
			continue
		}
		lat = append(lat, time.Since(t0))
	}
	return lat, failed
}

// percentile of sorted durations, q in (0,1], by nearest rank
// (ceil(q·n)), the definition loadgen uses too.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func sortDurations(d []time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
}
