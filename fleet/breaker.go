package fleet

import (
	"sync"
	"sync/atomic"
	"time"
)

// BreakerConfig sets the instance breaker.
type BreakerConfig struct {
	// Threshold: more than this many failures within Window open an
	// instance's circuit.
	Threshold int
	Window    time.Duration
	// Cooldown is how long an open circuit keeps the instance out. Then it
	// is half-open: one request at a time goes through as a probe, and its
	// answer closes the circuit or opens it again.
	Cooldown time.Duration
}

// DefaultBreaker is failure_threshold 3 in a 30 s window, 30 s cooldown.
var DefaultBreaker = BreakerConfig{Threshold: 3, Window: 30 * time.Second, Cooldown: 30 * time.Second}

// State is a circuit's state.
type State int

// The states of a circuit.
const (
	Closed   State = iota // the instance takes traffic
	Open                  // the instance is out until the cooldown ends
	HalfOpen              // cooldown over: one probe at a time
)

func (s State) String() string {
	switch s {
	case Open:
		return "open"
	case HalfOpen:
		return "half_open"
	}
	return "closed"
}

// Report is what one replica tells the others through the shared store:
// a failure it saw, or a probe that succeeded on a half-open circuit.
type Report struct {
	Instance  string
	Recovered bool // false: a failure
	At        time.Time
}

// Breaker tracks instance failures for one tether replica. Each replica
// counts what it sees itself, and opens a circuit on its own count at once.
// The replicas' counts also meet in a shared store. Reports go out, and Sync
// brings the shared circuits back. So a circuit holds everywhere when the
// fleet's combined count opened it, or another replica's probe closed it.
// Without a store, or while it is down, the local view decides alone.
//
// It is safe for concurrent use. Available is lock-free while every
// circuit is closed.
type Breaker struct {
	cfg     BreakerConfig
	now     func() time.Time
	reports chan Report
	dropped atomic.Uint64

	notClosed atomic.Int32 // circuits not closed; 0 lets Available skip the lock
	mu        sync.Mutex
	circuits  map[string]*circuit
	onChange  func(instance string, s State)
}

type circuit struct {
	state    State
	failures []time.Time // local failures within the window (closed only)
	until    time.Time   // end of the cooldown (open)
	probes   int         // probes in flight (half-open)
	probeAt  time.Time   // when the last probe began
	shared   bool        // the store holds this open circuit
	// recovered is the cooldown end of the opening this replica's own
	// probe closed. The store may still hold that opening until the report
	// reaches it. Sync must not reopen the circuit for it.
	recovered time.Time
}

// reportBuffer bounds the reports waiting for the store. A full buffer
// drops reports (counted): the local view still decides.
const reportBuffer = 1024

// NewBreaker returns a breaker with every circuit closed. now is the clock,
// time.Now when nil. onChange, when not nil, hears every state change, for
// metrics and logs. It is called with the breaker's lock held, and must not
// call back into it.
func NewBreaker(cfg BreakerConfig, now func() time.Time, onChange func(instance string, s State)) *Breaker {
	if now == nil {
		now = time.Now
	}
	return &Breaker{cfg: cfg, now: now, reports: make(chan Report, reportBuffer), circuits: map[string]*circuit{}, onChange: onChange}
}

// Config returns the breaker's settings.
func (b *Breaker) Config() BreakerConfig { return b.cfg }

// Reports is the stream of reports for the shared store.
func (b *Breaker) Reports() <-chan Report { return b.reports }

// Dropped counts reports dropped because the buffer was full.
func (b *Breaker) Dropped() uint64 { return b.dropped.Load() }

// Quiet reports whether every circuit is closed (lock-free).
func (b *Breaker) Quiet() bool { return b.notClosed.Load() == 0 }

// Available reports whether instance may take a request now: its circuit
// is closed, or half-open with no probe in flight.
func (b *Breaker) Available(instance string) bool {
	if b.notClosed.Load() == 0 {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.circuits[instance]
	if c == nil {
		return true
	}
	switch b.stateLocked(instance, c) {
	case Open:
		return false
	case HalfOpen:
		return c.probes == 0
	}
	return true
}

// State returns instance's circuit state.
func (b *Breaker) State(instance string) State {
	if b.notClosed.Load() == 0 {
		return Closed
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if c := b.circuits[instance]; c != nil {
		return b.stateLocked(instance, c)
	}
	return Closed
}

// Begin counts a request sent to instance and says whether it is the probe
// of a half-open circuit (Outcome.Probe, for Done). It counts the request
// even when another probe is in flight; TryBegin does not.
func (b *Breaker) Begin(instance string) (probe bool) {
	probe, _ = b.begin(instance, true)
	return probe
}

// TryBegin is Begin that refuses a half-open instance whose probe is in
// flight. It then returns ok false and counts nothing. Available said yes to
// every request that asked before the first of them began. Only one may
// probe.
func (b *Breaker) TryBegin(instance string) (probe, ok bool) {
	return b.begin(instance, false)
}

func (b *Breaker) begin(instance string, force bool) (probe, ok bool) {
	if b.notClosed.Load() == 0 {
		return false, true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.circuits[instance]
	if c == nil || b.stateLocked(instance, c) != HalfOpen {
		return false, true
	}
	if c.probes > 0 && !force {
		return false, false
	}
	c.probes++
	c.probeAt = b.now()
	return true, true
}

// Done records how a request Begin counted ended. While the circuit is
// half-open only its probes count. A request sent before the circuit opened
// says nothing of the instance since its cooldown. probe is what Begin
// returned, true when the request was a half-open probe. Done returns true
// when this failure opened the circuit.
func (b *Breaker) Done(instance string, probe bool, o Outcome) (opened bool) {
	answered, failed := o.Answered, o.Failed
	if !failed && b.notClosed.Load() == 0 {
		return false
	}
	now := b.now()
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.circuits[instance]
	if c == nil {
		if !failed {
			return false
		}
		c = &circuit{}
		b.circuits[instance] = c
	}
	st := b.stateLocked(instance, c)
	if st == HalfOpen {
		if !probe {
			return false
		}
		if c.probes > 0 {
			c.probes--
		}
	}
	switch {
	case !answered && !failed:
		return false
	case failed && st == HalfOpen:
		b.report(Report{Instance: instance, At: now})
		b.openLocked(instance, c, now.Add(b.cfg.Cooldown), false)
		return true
	case failed && st == Closed:
		b.report(Report{Instance: instance, At: now})
		c.failures = append(pruned(c.failures, now.Add(-b.cfg.Window)), now)
		if len(c.failures) > b.cfg.Threshold {
			b.openLocked(instance, c, now.Add(b.cfg.Cooldown), false)
			return true
		}
	case !failed && st == HalfOpen:
		b.report(Report{Instance: instance, Recovered: true, At: now})
		until := c.until
		b.closeLocked(instance, c)
		c.recovered = until
	}
	return false
}

// Opened records that the shared store opened instance's circuit until
// until (a Report of this replica's tipped the fleet's count, or another
// replica's did).
func (b *Breaker) Opened(instance string, until time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.circuits[instance]
	if c == nil {
		c = &circuit{}
		b.circuits[instance] = c
	}
	if c.state != Open || until.After(c.until) || !c.shared {
		if until.Before(c.until) {
			until = c.until
		}
		b.openLocked(instance, c, until, true)
	}
}

// Sync applies the shared circuits. open maps each instance the store holds
// open to the end of its cooldown. That includes half-open circuits, whose
// cooldown is over.
//
// A circuit this replica learnt from the store, and the store no longer
// holds, was closed by another replica's probe. Circuits this replica
// opened alone, while the store was down, run their own course.
//
// known says which instances are in the fleet. The others' circuits are
// dropped. So an instance removed while out does not keep the breaker busy.
func (b *Breaker) Sync(open map[string]time.Time, known func(instance string) bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for in, c := range b.circuits {
		if !known(in) {
			if c.state != Closed {
				b.closeLocked(in, c)
			}
			delete(b.circuits, in)
		}
	}
	for in, until := range open {
		if !known(in) {
			continue
		}
		c := b.circuits[in]
		if c == nil {
			c = &circuit{}
			b.circuits[in] = c
		}
		if c.state == Closed && !until.After(c.recovered) {
			continue // this replica's probe closed that opening; the store has not heard yet
		}
		if c.state == Closed || until.After(c.until) || !c.shared {
			if until.Before(c.until) {
				until = c.until
			}
			b.openLocked(in, c, until, true)
		}
	}
	for in, c := range b.circuits {
		if _, held := open[in]; !held && c.state != Closed && c.shared {
			b.closeLocked(in, c)
		}
	}
}

// Snapshot returns every circuit that is not closed, with its state.
func (b *Breaker) Snapshot() map[string]State {
	out := map[string]State{}
	if b.notClosed.Load() == 0 {
		return out
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for in, c := range b.circuits {
		if st := b.stateLocked(in, c); st != Closed {
			out[in] = st
		}
	}
	return out
}

// stateLocked is c's state now. An open circuit whose cooldown is over is
// half-open. A probe not heard of within a cooldown frees its place. Its
// outcome may have gone to another replica, whose report then reaches this
// one through the store. Or it may have been lost.
func (b *Breaker) stateLocked(instance string, c *circuit) State {
	now := b.now()
	if c.state == Open && !now.Before(c.until) {
		c.state, c.probes = HalfOpen, 0
		b.changed(instance, HalfOpen)
	}
	if c.state == HalfOpen && c.probes > 0 && now.Sub(c.probeAt) >= b.cfg.Cooldown {
		c.probes = 0
	}
	return c.state
}

func (b *Breaker) openLocked(instance string, c *circuit, until time.Time, shared bool) {
	if c.state == Closed {
		b.notClosed.Add(1)
	}
	c.state, c.until, c.failures, c.probes, c.shared = Open, until, nil, 0, shared
	if !b.now().Before(until) {
		c.state = HalfOpen
	}
	b.changed(instance, c.state)
}

func (b *Breaker) closeLocked(instance string, c *circuit) {
	if c.state != Closed {
		b.notClosed.Add(-1)
	}
	*c = circuit{}
	b.changed(instance, Closed)
}

func (b *Breaker) changed(instance string, s State) {
	if b.onChange != nil {
		b.onChange(instance, s)
	}
}

// report queues r for the shared store without waiting.
func (b *Breaker) report(r Report) {
	select {
	case b.reports <- r:
	default:
		b.dropped.Add(1)
	}
}

// pruned drops the times before from, in place.
func pruned(ts []time.Time, from time.Time) []time.Time {
	i := 0
	for i < len(ts) && ts[i].Before(from) {
		i++
	}
	return append(ts[:0], ts[i:]...)
}
