package affinity

import (
	"context"
	"maps"
	"sync"
	"time"

	"github.com/tetherproxy/tether/fleet"
)

// Load is one replica's view of the fleet's load. What this replica does
// itself is exact and immediate: the requests it has in flight, the queue
// depth instances last reported to it, the sessions it placed. What the
// other replicas do arrives with each Sync (LoadSyncer through the store):
// their requests in flight, the sessions in every instance's index, the
// drained instances. It is safe for concurrent use; the zero value is not
// usable, call NewLoad.
type Load struct {
	syncer  LoadSyncer // nil: this replica's own view only
	replica string

	mu     sync.Mutex
	flight map[string]int // this replica's requests in flight
	queue  map[string]int // last queue depth an instance reported here
	placed map[string]int // sessions placed (+) or moved away (-) here since the last sync
	state  LoadState      // the last sync
}

// NewLoad returns an empty view. replica names this replica in the reports
// it publishes; replicas must use distinct names.
func NewLoad(syncer LoadSyncer, replica string) *Load {
	return &Load{
		syncer: syncer, replica: replica,
		flight: map[string]int{}, queue: map[string]int{}, placed: map[string]int{},
		state: LoadState{Active: map[string]int{}, InFlight: map[string]int{}, Queue: map[string]int{}, Drained: map[string]bool{}},
	}
}

// Begin counts a request sent to instance.
func (l *Load) Begin(instance string) {
	l.mu.Lock()
	l.flight[instance]++
	l.mu.Unlock()
}

// End counts the end of a request Begin counted. queue is the queue depth
// the instance reported in its response (known false when it did not).
func (l *Load) End(instance string, queue int, known bool) {
	l.mu.Lock()
	if l.flight[instance]--; l.flight[instance] <= 0 {
		delete(l.flight, instance)
	}
	if known {
		l.queue[instance] = queue
	}
	l.mu.Unlock()
}

// Placed counts a session bound to to, moved from from ("" for a new one).
func (l *Load) Placed(to, from string) {
	l.mu.Lock()
	l.placed[to]++
	if from != "" {
		l.placed[from]--
	}
	l.mu.Unlock()
}

// Active is the number of sessions bound to instance.
func (l *Load) Active(instance string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return max(l.state.Active[instance]+l.placed[instance], 0)
}

// activeOf appends the active sessions of each instance to dst, under one lock.
func (l *Load) activeOf(instances []fleet.Instance, dst []int) []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, in := range instances {
		dst = append(dst, max(l.state.Active[in.Name]+l.placed[in.Name], 0))
	}
	return dst
}

// InFlight is the number of requests in flight to instance across replicas.
func (l *Load) InFlight(instance string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state.InFlight[instance] + l.flight[instance]
}

// Queue is the highest queue depth the instance last reported to any replica.
func (l *Load) Queue(instance string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return max(l.state.Queue[instance], l.queue[instance])
}

// Saturated reports whether instance is at a threshold of s.
func (l *Load) Saturated(instance string, s Saturation) bool {
	return s.InFlight > 0 && l.InFlight(instance) >= s.InFlight ||
		s.QueueDepth > 0 && l.Queue(instance) >= s.QueueDepth
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
func (l *Load) Snapshot() LoadState {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := LoadState{Active: maps.Clone(l.state.Active), InFlight: maps.Clone(l.state.InFlight),
		Queue: maps.Clone(l.state.Queue), Drained: maps.Clone(l.state.Drained)}
	for in, n := range l.placed {
		s.Active[in] = max(s.Active[in]+n, 0)
	}
	for in, n := range l.flight {
		s.InFlight[in] += n
	}
	for in, q := range l.queue {
		s.Queue[in] = max(s.Queue[in], q)
	}
	return s
}

// Sync publishes this replica's report and takes in the others'. The
// sessions placed here since the last sync are then part of the index and
// are no longer counted separately. Reports live for ttl, so a replica
// that stops syncing drops out after it.
func (l *Load) Sync(ctx context.Context, instances []string, ttl time.Duration, now time.Time) error {
	if l.syncer == nil {
		return nil
	}
	l.mu.Lock()
	r := LoadReport{Replica: l.replica, InFlight: maps.Clone(l.flight), Queue: maps.Clone(l.queue)}
	sent := maps.Clone(l.placed)
	l.mu.Unlock()
	st, err := l.syncer.SyncLoad(ctx, r, instances, ttl, now)
	if err != nil {
		return err
	}
	st.Active, st.InFlight, st.Queue, st.Drained = orEmpty(st.Active), orEmpty(st.InFlight), orEmpty(st.Queue), orEmpty(st.Drained)
	l.mu.Lock()
	l.state = st
	// Placements made while the sync ran are not in st yet: keep them.
	for in, n := range sent {
		if l.placed[in] -= n; l.placed[in] == 0 {
			delete(l.placed, in)
		}
	}
	l.mu.Unlock()
	return nil
}

func orEmpty[V any](m map[string]V) map[string]V {
	if m == nil {
		return map[string]V{}
	}
	return m
}
