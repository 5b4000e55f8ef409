package affinity

import (
	"maps"
	"sync"
	"time"

	"github.com/tetherproxy/tether/fleet"
)

// Load is one replica's view of the fleet's load. What this replica does
// itself is exact and immediate: the requests it has in flight, the queue
// depth instances last reported to it, the sessions it placed. What the
// other replicas do arrives with each sync (replicas.LoadSync, which
// takes this replica's Report to the store and Applies what it brings
// back): their requests in flight, the sessions in every instance's index,
// the drained instances. It is safe for concurrent use; the zero value is
// not usable, call NewLoad.
type Load struct {
	mu     sync.Mutex
	flight map[string]*Flights            // requests in flight, as this replica counted them
	queue  map[string]queueReading        // last queue depth an instance reported here
	engine map[string]fleet.EngineReading // the engine readings this replica scraped
	// newest is each instance's newest reading, this replica's or the last
	// sync's: what placement reads, in one lookup.
	newest map[string]fleet.EngineReading
	// Sessions this replica placed (+) or moved away (-) that the last
	// sync's read of the index may not hold yet:
	//   - pending: placements whose store call is under way. The pipeline
	//     holds them so that concurrent placements see them.
	//   - placed: those done since the current sync began.
	//   - syncing: those done before it, dropped once the sync has read
	//     the index.
	pending, placed, syncing map[string]int
	// unsynced is the three added up, what active sessions read.
	unsynced map[string]int
	state    fleet.LoadState // the last sync
	now      func() time.Time
}

// queueFresh is how long a reported queue depth stands. A saturated
// instance that adaptive routing empties gets no responses to report a
// lower depth in, so a reading must expire rather than hold it out forever.
const queueFresh = 5 * time.Second

type queueReading struct {
	depth int
	at    time.Time
}

// NewLoad returns an empty view: this replica's own, until a sync applies
// the others'.
func NewLoad() *Load {
	return &Load{
		flight: map[string]*Flights{}, queue: map[string]queueReading{}, engine: map[string]fleet.EngineReading{},
		newest: map[string]fleet.EngineReading{}, now: time.Now,
		pending: map[string]int{}, placed: map[string]int{}, syncing: map[string]int{}, unsynced: map[string]int{},
		state: fleet.LoadState{Active: map[string]int{}, InFlight: map[string]int{}, Queue: map[string]int{}, Drained: map[string]bool{}, Engine: map[string]fleet.EngineReading{}},
	}
}

// Begin counts a request sent to instance, decided at at.
func (l *Load) Begin(instance string, at time.Time) {
	l.mu.Lock()
	l.flightsOf(instance).Add(at, 1)
	l.mu.Unlock()
}

// End counts the end of a request decided at at, on whichever replica
// hears of it. Envoy spreads its streams over the replicas, so the outcome
// may reach another replica than the one that decided. This replica's own
// count can then go below zero. Only the sum the load sync adds up is the
// instance's. A request decided more than FlightHorizon ago no longer
// counts anywhere, and its end changes nothing. queue is the queue depth
// the instance reported; known is false when it reported none.
func (l *Load) End(instance string, at time.Time, queue int, known bool) {
	l.mu.Lock()
	l.flightsOf(instance).Add(at, -1)
	if known {
		l.queue[instance] = queueReading{depth: queue, at: l.now()}
	}
	l.mu.Unlock()
}

func (l *Load) flightsOf(instance string) *Flights {
	f := l.flight[instance]
	if f == nil {
		f = NewFlights(l.now)
		l.flight[instance] = f
	}
	return f
}

// localFlight is this replica's count for instance (may be negative).
func (l *Load) localFlight(instance string) int {
	if f := l.flight[instance]; f != nil {
		return f.Sum()
	}
	return 0
}

// localFlights is every instance's localFlight, for the load report; it
// forgets instances whose counts have all expired.
func (l *Load) localFlights() map[string]int {
	out := make(map[string]int, len(l.flight))
	for in, f := range l.flight {
		if n, live := f.Count(); !live {
			delete(l.flight, in)
		} else if n != 0 {
			out[in] = n
		}
	}
	return out
}

// FlightHorizon is how long a request counts as in flight at most: one
// whose end tether never hears of (its outcome lost with an Envoy restart,
// a dropped access-log batch, a replica killed) stops counting this long
// after its decision. It is longer than any generation a route allows.
const FlightHorizon = 15 * time.Minute

// flightSlots divide the horizon: each counts the requests decided in one
// minute, and drops them when that minute leaves the horizon.
const flightSlots = int(FlightHorizon/time.Minute) + 1

// Flights counts requests in flight by the minute they were decided in,
// and drops them when that minute leaves the horizon: one instance's in
// Load, the requests a replica routed whose end it awaits in extproc. It
// is not safe for concurrent use.
type Flights struct {
	now    func() time.Time
	minute [flightSlots]int64 // the minute (Unix) each slot counts
	n      [flightSlots]int
}

// NewFlights returns an empty count on the clock now.
func NewFlights(now func() time.Time) *Flights { return &Flights{now: now} }

// Add counts n requests decided at at (negative: ended).
func (f *Flights) Add(at time.Time, n int) {
	m := at.Unix() / 60
	if now := f.now().Unix() / 60; m <= now-int64(flightSlots)+1 || m > now+1 {
		return // past the horizon (or from a clock far ahead): counts nowhere
	}
	i := int(m % int64(flightSlots))
	if f.minute[i] != m {
		f.minute[i], f.n[i] = m, 0
	}
	f.n[i] += n
}

// Sum is the requests within the horizon.
func (f *Flights) Sum() int {
	n, _ := f.Count()
	return n
}

// Count is the requests within the horizon; live is false when no slot is.
func (f *Flights) Count() (n int, live bool) {
	now := f.now().Unix() / 60
	for i, m := range f.minute {
		if m > now-int64(flightSlots)+1 && m != 0 {
			n += f.n[i]
			live = true
		}
	}
	return n, live
}

// unreserve ends a reservation on reserved. bound says whether the session
// was bound there (the store kept the candidate); from is the instance it
// left ("" for a new session).
func (l *Load) unreserve(reserved string, bound bool, from string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.count(l.pending, reserved, -1)
	if bound {
		l.count(l.placed, reserved, 1)
		if from != "" {
			l.count(l.placed, from, -1)
		}
	}
}

// count adds n to instance in m, one of pending, placed and syncing, and
// to unsynced.
func (l *Load) count(m map[string]int, instance string, n int) {
	add(m, instance, n)
	add(l.unsynced, instance, n)
}

func add(m map[string]int, k string, n int) {
	if m[k] += n; m[k] == 0 {
		delete(m, k)
	}
}

// Active is the number of sessions bound to instance.
func (l *Load) Active(instance string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.activeLocked(instance)
}

func (l *Load) activeLocked(instance string) int {
	return max(l.state.Active[instance]+l.unsynced[instance], 0)
}

// InFlight is the number of requests in flight to instance across replicas.
func (l *Load) InFlight(instance string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return max(l.state.InFlight[instance]+l.localFlight(instance), 0)
}

// Queue is the highest queue depth the instance reported to any replica
// in the last few seconds.
func (l *Load) Queue(instance string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	d, _ := l.freshQueue(instance)
	return max(l.state.Queue[instance], d)
}

// freshQueue is the depth instance last reported here; ok is false when
// it reported none, or too long ago.
func (l *Load) freshQueue(instance string) (depth int, ok bool) {
	q, ok := l.queue[instance]
	if !ok {
		return 0, false
	}
	if l.now().Sub(q.at) > queueFresh {
		delete(l.queue, instance)
		return 0, false
	}
	return q.depth, true
}

// freshQueues is every fresh reading, for reports and snapshots.
func (l *Load) freshQueues() map[string]int {
	out := make(map[string]int, len(l.queue))
	for in := range l.queue {
		if d, ok := l.freshQueue(in); ok {
			out[in] = d
		}
	}
	return out
}

// Saturated reports whether instance is at a threshold of s. An engine
// reading older than s.Stale counts for nothing: an instance whose
// /metrics fails is neither saturated nor unhealthy by it.
func (l *Load) Saturated(instance string, s Saturation) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.saturatedLocked(instance, s)
}

func (l *Load) saturatedLocked(instance string, s Saturation) bool {
	return l.saturatedWith(instance, s, l.engineLoadSince(instance, l.cutoff(s.Stale)))
}

// saturatedWith is saturatedLocked given instance's engine reading.
func (l *Load) saturatedWith(instance string, s Saturation, e engineLoad) bool {
	if s.InFlight > 0 && l.state.InFlight[instance]+l.localFlight(instance) >= s.InFlight {
		return true
	}
	if s.QueueDepth > 0 {
		if d, _ := l.freshQueue(instance); max(l.state.Queue[instance], d) >= s.QueueDepth {
			return true
		}
	}
	return e.ok && (s.Waiting > 0 && e.waiting >= s.Waiting || s.KVUsage > 0 && e.kvKnown && e.kvUsage >= s.KVUsage)
}

// engineLoad is what placement reads of an engine's reading: ok false
// when there is none young enough.
type engineLoad struct {
	waiting, running int
	kvUsage          float64
	kvKnown, ok      bool
}

// engineLoadSince is instance's engineLoad from its newest reading taken
// since cutoff.
func (l *Load) engineLoadSince(instance string, cutoff time.Time) engineLoad {
	r, ok := l.engineSince(instance, cutoff)
	if !ok {
		return engineLoad{}
	}
	return engineLoad{waiting: r.Waiting, running: r.Running, kvUsage: r.KVUsage, kvKnown: r.KVKnown, ok: true}
}

// workWith is what instance has to do, as placement by content weighs it.
// queued is the requests waiting for a prefill; running is all those it
// serves. Each is the higher of two counts: tether's requests in flight,
// less the caller's own (self), and the engine's reading e. tether counts
// a request in flight until its response headers. For a streamed answer
// that is until its prefill is done.
func (l *Load) workWith(instance string, self int, e engineLoad) (queued, running int) {
	f := max(l.state.InFlight[instance]+l.localFlight(instance)-self, 0)
	queued, running = f, f
	if e.ok {
		queued, running = max(queued, e.waiting), max(running, e.running+e.waiting)
	}
	return queued, running
}

// SetEngine records a reading this replica took of instance's engine; the
// next Sync shares it with the other replicas.
func (l *Load) SetEngine(instance string, r fleet.EngineReading) {
	l.mu.Lock()
	l.engine[instance] = r
	l.renew(instance)
	l.mu.Unlock()
}

// ForgetEngine drops this replica's reading of instance (it no longer
// scrapes it).
func (l *Load) ForgetEngine(instance string) {
	l.mu.Lock()
	delete(l.engine, instance)
	l.renew(instance)
	l.mu.Unlock()
}

// renew sets newest for instance from this replica's reading and the
// last sync's.
func (l *Load) renew(instance string) {
	r, ok := l.engine[instance]
	if o, ook := l.state.Engine[instance]; ook && (!ok || o.At.After(r.At)) {
		r, ok = o, true
	}
	if ok {
		l.newest[instance] = r
	} else {
		delete(l.newest, instance)
	}
}

// Engine is the newest reading of instance's engine any replica took, if
// one is younger than stale (0: any age).
func (l *Load) Engine(instance string, stale time.Duration) (fleet.EngineReading, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.engineLocked(instance, stale)
}

func (l *Load) engineLocked(instance string, stale time.Duration) (fleet.EngineReading, bool) {
	return l.engineSince(instance, l.cutoff(stale))
}

// cutoff is when a reading is taken earliest to be younger than stale,
// zero for any age (stale 0).
func (l *Load) cutoff(stale time.Duration) time.Time {
	if stale <= 0 {
		return time.Time{}
	}
	return l.now().Add(-stale)
}

// engineSince is instance's newest reading, unless it was taken before
// cutoff (zero: any age). A placement reads the clock once for all its
// candidates.
func (l *Load) engineSince(instance string, cutoff time.Time) (fleet.EngineReading, bool) {
	r, ok := l.newest[instance]
	if !ok || r.At.Before(cutoff) {
		return fleet.EngineReading{}, false
	}
	return r, true
}

// EnginesIdle reports whether each of instances has an engine reading
// taken after after that shows no request running or waiting; false for
// no instances, or one never read (a generic instance is not scraped).
func (l *Load) EnginesIdle(instances []fleet.Instance, after time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, in := range instances {
		r, ok := l.engineLocked(in.Name, 0)
		if !ok || !r.At.After(after) || r.Running > 0 || r.Waiting > 0 {
			return false
		}
	}
	return len(instances) > 0
}

// Engines is every instance's newest engine reading younger than stale
// (0: any age), for metrics and operators.
func (l *Load) Engines(stale time.Duration) map[string]fleet.EngineReading {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.enginesLocked(stale)
}

func (l *Load) enginesLocked(stale time.Duration) map[string]fleet.EngineReading {
	out := make(map[string]fleet.EngineReading, len(l.newest))
	cutoff := l.cutoff(stale)
	for in := range l.newest {
		if r, ok := l.engineSince(in, cutoff); ok {
			out[in] = r
		}
	}
	return out
}

// Drained reports whether an operator is draining instance.
func (l *Load) Drained(instance string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state.Drained[instance]
}

// drained returns the drained set; the map must not be modified (Sync
// replaces it whole).
func (l *Load) drained() map[string]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state.Drained
}

// Snapshot returns the view as of now, for operators.
func (l *Load) Snapshot() fleet.LoadState {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := fleet.LoadState{Active: maps.Clone(l.state.Active), InFlight: maps.Clone(l.state.InFlight),
		Queue: maps.Clone(l.state.Queue), Drained: maps.Clone(l.state.Drained), Engine: l.enginesLocked(0)}
	for in, n := range l.unsynced {
		s.Active[in] += n
	}
	for in, n := range s.Active {
		s.Active[in] = max(n, 0)
	}
	for in, n := range l.localFlights() {
		s.InFlight[in] += n
	}
	for in, n := range s.InFlight {
		if n <= 0 {
			delete(s.InFlight, in)
		}
	}
	for in, q := range l.freshQueues() {
		s.Queue[in] = max(s.Queue[in], q)
	}
	return s
}

// Report is what this replica tells the others at a sync: its requests
// in flight, its fresh queue readings and the engine readings it took.
// The placements done before it are in the index the sync reads and are no
// longer counted apart once Apply takes the sync's state in; those done
// after it may be counted twice until the next sync.
func (l *Load) Report(replica string) fleet.LoadReport {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := fleet.LoadReport{Replica: replica, InFlight: l.localFlights(), Queue: l.freshQueues(), Engine: maps.Clone(l.engine)}
	for in, n := range l.placed {
		add(l.syncing, in, n)
	}
	clear(l.placed)
	return r
}

// Apply takes in the state a sync brought back (the sync that sent the
// last Report). Until a sync succeeds, the placements reported keep
// counting.
func (l *Load) Apply(st fleet.LoadState) {
	st.Active, st.InFlight, st.Queue, st.Drained = orEmpty(st.Active), orEmpty(st.InFlight), orEmpty(st.Queue), orEmpty(st.Drained)
	st.Engine = orEmpty(st.Engine)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.state = st
	for in, n := range l.syncing {
		add(l.unsynced, in, -n)
	}
	clear(l.syncing)
	clear(l.newest)
	for in := range l.engine {
		l.renew(in)
	}
	for in := range st.Engine {
		l.renew(in)
	}
}

// Replicas is how many other replicas the last sync found live.
func (l *Load) Replicas() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state.Replicas
}

func orEmpty[V any](m map[string]V) map[string]V {
	if m == nil {
		return map[string]V{}
	}
	return m
}
