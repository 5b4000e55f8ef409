//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/lab/emulator"
)

// stopDelay is the drain delay the stop tests run with: long enough that
// the exit's margin over it is what they measure.
const stopDelay = 500 * time.Millisecond

// startSlowInstance serves one emulated instance that works latency on
// every completion.
func startSlowInstance(t *testing.T, name string, latency time.Duration) config.Instance {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h, err := emulator.NewHandler(emulator.Instance{Name: name, Latency: latency, Model: "v1"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = emulator.Serve(ctx, ln, h) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	return config.Instance{Name: name, Address: ln.Addr().String(), Zone: "zone-a", Version: "v1", Weight: 1}
}

// stopTimed sends SIGTERM and returns how long tether took to exit.
func stopTimed(t *testing.T, tt *tether) time.Duration {
	t.Helper()
	began := time.Now()
	tt.Stop()
	return time.Since(began)
}

// TestStopWithEnvoyConnected: with Envoy connected (its access-log
// streams, the default outcome report, stay open as long as Envoy runs)
// and no request in flight, SIGTERM to exit takes the drain delay and
// less than a second more, not the drain timeout.
func TestStopWithEnvoyConnected(t *testing.T) {
	cfg := baseConfig("embedded", startFleet(t, 2))
	cfg.Server.DrainDelay = config.Dur(stopDelay)
	cfg.Server.DrainTimeout = config.Dur(10 * time.Second)
	tt, px := startXDS(t, cfg)
	for i := range 5 {
		if a := chat(t, px, map[string]string{"x-session-id": "stop-" + string(rune('a'+i))}); a.status != 200 || a.decision == "" {
			t.Fatalf("request %d: %+v", i, a)
		}
	}
	// Their ends came back on Envoy's access log: its streams are open.
	waitFor(t, 10*time.Second, "the 5 outcomes in the access log", func() bool {
		return tt.metric(t, "tether_outcomes_total", `result="applied"`) >= 5
	})
	took := stopTimed(t, tt)
	t.Logf("SIGTERM to exit: %v (drain delay %v)", took.Round(time.Millisecond), stopDelay)
	if took < stopDelay || took > stopDelay+time.Second {
		t.Errorf("SIGTERM to exit took %v, want the %v drain delay and at most 1s more\n%s", took, stopDelay, tt.logs)
	}
	if log := tt.logs.String(); !strings.Contains(log, "every request's end heard") {
		t.Errorf("tether did not say the requests' ends were all heard:\n%s", log)
	}
}

// TestStopWaitsForARequestInFlight: a request still running when the drain
// delay ends holds the stop until its end comes back in Envoy's access
// log (its outcome is applied), then tether exits at once, well inside
// the drain timeout; the client gets its answer.
func TestStopWaitsForARequestInFlight(t *testing.T) {
	const work = 3 * time.Second
	cfg := baseConfig("embedded", []config.Instance{startSlowInstance(t, "slow", work)})
	cfg.Server.DrainDelay = config.Dur(stopDelay)
	cfg.Server.DrainTimeout = config.Dur(15 * time.Second)
	tt, px := startXDS(t, cfg)
	type result struct {
		a   answer
		err error
		at  time.Time
	}
	got := make(chan result, 1)
	sent := time.Now()
	go func() {
		a, err := tryChat(px, map[string]string{"x-session-id": "slow-1"})
		got <- result{a, err, time.Now()}
	}()
	waitFor(t, 5*time.Second, "the request decided", func() bool {
		return tt.metric(t, "tether_requests_total") >= 1
	})
	took := stopTimed(t, tt)
	exited := time.Now()
	r := <-got
	if r.err != nil || r.a.status != 200 || r.a.instance != "slow" {
		t.Fatalf("the request in flight during the stop: %+v, %v", r.a, r.err)
	}
	t.Logf("request answered %v after it was sent; tether exited %v after SIGTERM, %v after the answer",
		r.at.Sub(sent).Round(time.Millisecond), took.Round(time.Millisecond), exited.Sub(r.at).Round(time.Millisecond))
	if exited.Before(r.at) {
		t.Errorf("tether exited %v before the request in flight was answered", r.at.Sub(exited))
	}
	if exited.Sub(r.at) > 2*time.Second {
		t.Errorf("tether exited %v after the last request was answered, want its access-log report and no more", exited.Sub(r.at))
	}
	log := tt.logs.String()
	if strings.Contains(log, "drain timeout") || !strings.Contains(log, "every request's end heard") {
		t.Errorf("the request's end was not heard before the exit:\n%s", log)
	}
}

// TestStopAfterCancelledRequests: clients that cancel requests while
// tether decides leave tickets whose ends never come (Envoy drops the reply,
// and logs the request without the ticket). With the engines read (vLLM's
// /metrics) and every one idle since the last decision, the stop does not
// wait the drain timeout for them. (Without the engines' readings it
// does: in runs of this test 35–45 of the 320 cancelled requests left
// their ticket, and the stop took the whole 10 s drain timeout.)
func TestStopAfterCancelledRequests(t *testing.T) {
	cfg := baseConfig("embedded", startFleet(t, 2))
	cfg.Server.DrainDelay = config.Dur(stopDelay)
	cfg.Server.DrainTimeout = config.Dur(10 * time.Second)
	cfg.Engines.Default = config.EngineVLLM
	cfg.Engines.ScrapeInterval = config.Dur(200 * time.Millisecond)
	cfg.Engines.ScrapeTimeout = config.Dur(200 * time.Millisecond)
	tt, px := startXDS(t, cfg)
	// 32 connections as fast as answers come, all cancelled at once, in
	// ten bursts.
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	defer c.CloseIdleConnections()
	for burst := range 10 {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		var wg sync.WaitGroup
		for w := range 32 {
			wg.Go(func() {
				for i := 0; ctx.Err() == nil; i++ {
					req, err := http.NewRequestWithContext(ctx, http.MethodPost, px.url+"/v1/chat/completions", nil)
					if err != nil {
						t.Error(err)
						return
					}
					req.Header.Set("x-session-id", fmt.Sprint("cancel-", burst, "-", w, "-", i/10))
					if resp, err := c.Do(req); err == nil {
						resp.Body.Close()
					}
				}
			})
		}
		wg.Wait()
		cancel()
	}
	// Traffic stopped: the engines are read idle a second after the last
	// decision, within the drain delay.
	time.Sleep(time.Second)
	took := stopTimed(t, tt)
	log := tt.logs.String()
	t.Logf("SIGTERM to exit: %v (drain delay %v)", took.Round(time.Millisecond), stopDelay)
	if took < stopDelay || took > stopDelay+time.Second {
		t.Errorf("SIGTERM to exit took %v, want the %v drain delay and at most 1s more\n%s", took, stopDelay, log)
	}
	if strings.Contains(log, "drain timeout") {
		t.Errorf("the stop waited for the drain timeout:\n%s", log)
	}
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, "every engine idle") || strings.Contains(l, "every request's end heard") {
			t.Log(l)
		}
	}
}
