package fleet

import (
	"sync"
	"testing"
	"time"
)

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newTestBreaker(t *testing.T) (*Breaker, *clock, *[]string) {
	t.Helper()
	c := &clock{t: time.Unix(1_750_000_000, 0)}
	var changes []string
	b := NewBreaker(DefaultBreaker, c.now, func(in string, s State) { changes = append(changes, in+"="+s.String()) })
	return b, c, &changes
}

// fail sends a request to in and records a failure.
func fail(b *Breaker, in string) bool {
	return b.Done(in, b.Begin(in), Outcome{Answered: true, Failed: true})
}

func ok(b *Breaker, in string) { b.Done(in, b.Begin(in), Outcome{Answered: true}) }

func drain(b *Breaker) []Report {
	var out []Report
	for {
		select {
		case r := <-b.Reports():
			out = append(out, r)
		default:
			return out
		}
	}
}

func TestBreakerOpensAfterMoreThanThreshold(t *testing.T) {
	b, _, changes := newTestBreaker(t)
	for i := range 3 {
		if fail(b, "a") {
			t.Fatalf("failure %d opened the circuit; threshold 3 needs more than 3", i+1)
		}
		ok(b, "a") // successes do not reset a count-in-window breaker
	}
	if !b.Available("a") || b.State("a") != Closed {
		t.Fatalf("after 3 failures: available %v, state %v", b.Available("a"), b.State("a"))
	}
	if !fail(b, "a") {
		t.Fatal("the 4th failure did not open the circuit")
	}
	if b.Available("a") || b.State("a") != Open {
		t.Fatalf("after 4 failures: available %v, state %v", b.Available("a"), b.State("a"))
	}
	if !b.Available("b") {
		t.Error("another instance is out too")
	}
	if got := drain(b); len(got) != 4 {
		t.Errorf("reports = %+v, want the 4 failures", got)
	}
	if len(*changes) != 1 || (*changes)[0] != "a=open" {
		t.Errorf("changes = %v", *changes)
	}
}

func TestBreakerWindowSlides(t *testing.T) {
	b, c, _ := newTestBreaker(t)
	for range 3 {
		fail(b, "a")
		c.add(11 * time.Second)
	}
	// The first failure is 33 s old: out of the 30 s window.
	if fail(b, "a") {
		t.Fatal("failures spread over more than the window opened the circuit")
	}
	if !fail(b, "a") {
		t.Fatal("4 failures within 30 s did not open it")
	}
}

func TestBreakerHalfOpenProbe(t *testing.T) {
	b, c, changes := newTestBreaker(t)
	for range 4 {
		fail(b, "a")
	}
	c.add(29 * time.Second)
	if b.Available("a") {
		t.Fatal("available before the cooldown ended")
	}
	c.add(time.Second)
	if st := b.State("a"); st != HalfOpen || !b.Available("a") {
		t.Fatalf("after the cooldown: %v, available %v", st, b.Available("a"))
	}
	if probe, ok := b.TryBegin("a"); !probe || !ok {
		t.Fatalf("the first request after the cooldown: probe %v, ok %v; want the probe", probe, ok)
	}
	if b.Available("a") {
		t.Fatal("a second request went to a half-open instance while its probe is in flight")
	}
	if probe, ok := b.TryBegin("a"); probe || ok {
		t.Fatalf("a second request while the probe is in flight: probe %v, ok %v; want refused", probe, ok)
	}
	// A probe that ends unanswered frees the slot without a verdict.
	b.Done("a", true, Outcome{})
	if !b.Available("a") || b.State("a") != HalfOpen {
		t.Fatalf("after an unanswered probe: %v", b.State("a"))
	}
	// A failed probe opens it again for a whole cooldown.
	drain(b)
	if !fail(b, "a") || b.State("a") != Open {
		t.Fatalf("failed probe: state %v", b.State("a"))
	}
	c.add(30 * time.Second)
	ok(b, "a")
	if b.State("a") != Closed || !b.Available("a") || !b.Quiet() {
		t.Fatalf("after a good probe: %v", b.State("a"))
	}
	reports := drain(b)
	if len(reports) != 2 || reports[0].Recovered || !reports[1].Recovered {
		t.Errorf("reports = %+v, want the failed probe then the recovery", reports)
	}
	// Closed again: the count starts from zero.
	for range 3 {
		fail(b, "a")
	}
	if b.State("a") != Closed {
		t.Error("old failures counted after recovery")
	}
	want := []string{"a=open", "a=half_open", "a=open", "a=half_open", "a=closed"}
	if len(*changes) != len(want) {
		t.Fatalf("changes = %v, want %v", *changes, want)
	}
	for i := range want {
		if (*changes)[i] != want[i] {
			t.Errorf("changes = %v, want %v", *changes, want)
		}
	}
}

func TestBreakerFailuresWhileOpenAreNotCounted(t *testing.T) {
	b, c, _ := newTestBreaker(t)
	for range 4 {
		fail(b, "a")
	}
	drain(b)
	for range 10 { // requests that were in flight when it opened
		if b.Done("a", false, Outcome{Answered: true, Failed: true}) {
			t.Fatal("a failure while open opened it again")
		}
	}
	if got := drain(b); len(got) != 0 {
		t.Errorf("failures while open were reported: %+v", got)
	}
	c.add(30 * time.Second)
	if b.State("a") != HalfOpen {
		t.Errorf("cooldown extended by failures while open: %v", b.State("a"))
	}
}

func TestBreakerSharedState(t *testing.T) {
	b, c, _ := newTestBreaker(t)
	now := c.now()
	// Another replica opened "a": this one follows, and lets it go when
	// the store no longer holds it (another replica's probe closed it).
	b.Sync(map[string]time.Time{"a": now.Add(10 * time.Second)}, all)
	if b.Available("a") || b.State("a") != Open {
		t.Fatalf("shared open: %v", b.State("a"))
	}
	c.add(10 * time.Second)
	if b.State("a") != HalfOpen {
		t.Fatalf("shared cooldown over: %v", b.State("a"))
	}
	b.Sync(map[string]time.Time{"a": now.Add(10 * time.Second)}, all) // still half-open in the store
	if b.State("a") != HalfOpen {
		t.Fatalf("same shared state changed it: %v", b.State("a"))
	}
	b.Sync(map[string]time.Time{}, all)
	if b.State("a") != Closed || !b.Quiet() {
		t.Fatalf("closed in the store: %v", b.State("a"))
	}

	// Opened here alone (the store was down): a sync that does not hold
	// it leaves it to run its course.
	for range 4 {
		fail(b, "b")
	}
	b.Sync(map[string]time.Time{}, all)
	if b.State("b") != Open {
		t.Fatalf("a local-only circuit closed by a sync: %v", b.State("b"))
	}
	// The store confirms it later, with its own (later) end.
	b.Opened("b", c.now().Add(40*time.Second))
	c.add(35 * time.Second)
	if b.State("b") != Open {
		t.Errorf("shared cooldown end not taken: %v", b.State("b"))
	}
	b.Sync(map[string]time.Time{}, all)
	if b.State("b") != Closed {
		t.Errorf("shared circuit the store dropped stays %v", b.State("b"))
	}
}

func TestBreakerReportsNeverBlock(t *testing.T) {
	b, _, _ := newTestBreaker(t)
	b.cfg.Threshold = 1 << 30
	for range reportBuffer + 10 {
		fail(b, "a")
	}
	if b.Dropped() != 10 {
		t.Errorf("dropped = %d, want 10", b.Dropped())
	}
}

func TestBreakerConcurrent(t *testing.T) {
	b := NewBreaker(BreakerConfig{Threshold: 3, Window: time.Second, Cooldown: time.Millisecond}, nil, nil)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				in := string(rune('a' + (w+i)%3))
				if b.Available(in) {
					b.Done(in, b.Begin(in), Outcome{Answered: i%5 != 0, Failed: i%3 == 0})
				}
				if i%100 == 0 {
					b.Sync(map[string]time.Time{"a": time.Now()}, all)
					drain(b)
				}
			}
		}()
	}
	wg.Wait()
	n := 0
	for _, st := range b.Snapshot() {
		if st != Closed {
			n++
		}
	}
	if int(b.notClosed.Load()) != n {
		t.Errorf("notClosed = %d, but %d circuits are not closed", b.notClosed.Load(), n)
	}
}

func all(string) bool { return true }

// TestBreakerSyncAfterOwnProbe: this replica's good probe closed the
// circuit; a sync that read the store before the recovery report reached
// it must not reopen it.
func TestBreakerSyncAfterOwnProbe(t *testing.T) {
	b, c, _ := newTestBreaker(t)
	for range 4 {
		fail(b, "a")
	}
	opened := c.now().Add(fleet30s())
	b.Opened("a", opened)
	c.add(fleet30s())
	ok(b, "a") // the probe
	if b.State("a") != Closed {
		t.Fatalf("after a good probe: %v", b.State("a"))
	}
	b.Sync(map[string]time.Time{"a": opened}, all) // stale read
	if b.State("a") != Closed || !b.Available("a") {
		t.Fatalf("a stale sync reopened the circuit: %v", b.State("a"))
	}
	// Another replica's failed probe reopened it since: that one counts.
	b.Sync(map[string]time.Time{"a": c.now().Add(fleet30s())}, all)
	if b.State("a") != Open {
		t.Fatalf("a newer opening was ignored: %v", b.State("a"))
	}
}

// TestBreakerForgetsRemovedInstances: a circuit of an instance no longer
// in the fleet is dropped, so the breaker is quiet again.
func TestBreakerForgetsRemovedInstances(t *testing.T) {
	b, c, _ := newTestBreaker(t)
	for range 4 {
		fail(b, "gone")
	}
	known := func(in string) bool { return in != "gone" }
	b.Sync(map[string]time.Time{"gone": c.now().Add(time.Hour)}, known)
	if !b.Quiet() || len(b.Snapshot()) != 0 {
		t.Fatalf("circuits of a removed instance kept: %v", b.Snapshot())
	}
}

func fleet30s() time.Duration { return DefaultBreaker.Cooldown }

// TestBreakerHalfOpenCountsOnlyProbes: requests sent before the circuit
// opened that end after its cooldown, answered or failed, neither close nor
// reopen it, nor free the probe's slot: the probe decides.
func TestBreakerHalfOpenCountsOnlyProbes(t *testing.T) {
	b, c, _ := newTestBreaker(t)
	early := []bool{b.Begin("a"), b.Begin("a")} // in flight while it opens
	for range 4 {
		fail(b, "a")
	}
	c.add(30 * time.Second)
	probe, ok := b.TryBegin("a")
	if !probe || !ok || b.State("a") != HalfOpen {
		t.Fatalf("after the cooldown: probe %v, ok %v, state %v", probe, ok, b.State("a"))
	}
	if early[0] || early[1] {
		t.Fatal("requests sent while closed were counted as probes")
	}
	b.Done("a", early[0], Outcome{Answered: true})
	b.Done("a", early[1], Outcome{Answered: true, Failed: true})
	if b.State("a") != HalfOpen || b.Available("a") {
		t.Fatalf("after two requests from before the opening ended: %v, available %v; want half-open with the probe in flight",
			b.State("a"), b.Available("a"))
	}
	b.Done("a", probe, Outcome{Answered: true})
	if b.State("a") != Closed {
		t.Errorf("after the probe answered: %v, want closed", b.State("a"))
	}
}
