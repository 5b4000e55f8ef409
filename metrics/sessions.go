package metrics

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Counts reads the sessions' request counts (bindings.Result.Requests)
// from the binding store, for the session-length metrics.
type Counts interface {
	// Requests returns the request count of each session key's live
	// binding at now, in the order of keys. A key without one, ended or
	// never bound, gives 0. keys are session keys (bindings.Result.Key). An
	// alias link is not followed.
	Requests(ctx context.Context, keys []string, now time.Time) ([]int, error)
}

// SessionLengths measures how many requests a session makes before it ends,
// in tether_session_requests. A session ends when its binding expires or is
// deleted.
//
// No replica sees every request of a session. But every request carries the
// session's count from the binding store (affinity.Decision.Requests). So
// the replica that served the last request holds the final count. Each
// replica remembers, per session key, the highest count it saw and when
// (Seen). Once a session has been quiet here for 30 s, Sweep asks the store
// for its current count:
//
//   - Lower than ours, 0 included: the binding we saw is gone, and nobody
//     served it after us. A new session may have started on the key since.
//     Observe our count and forget the session.
//   - Higher: another replica served it later and will observe it. Forget
//     the session without observing.
//   - Equal: it is still live, and ours. Ask again 30 s later, then every
//     minute.
//
// Rechecks are never further apart than a minute, because a binding may
// live as little as a second, the shortest idle timeout. Still, a replica
// that did not serve the last request learns so only when it reads the
// higher count while the binding lives. It reads at most every 1 min 15 s:
// the recheck plus a sweep period. So a session whose idle timeout is
// shorter than that may be observed more than once, by every replica that
// served it and found its binding gone.
//
// With longer idle timeouts each ended session is observed once. These
// are missed:
//
//   - sessions whose last request this replica served when it stopped or
//     restarted;
//   - sessions whose last request this replica served while it tracked too
//     many sessions. tether_session_requests_untracked_total counts them.
//   - sessions whose last requests the store counted but that got no
//     decision. They were refused by fallback_policy "none" or by strict
//     version affinity, or cancelled.
//
// A session whose key starts a new session within a minute or so of the
// old binding expiring may be merged into the new one.
//
// Cost: Seen is a map update under a mutex. It allocates nothing for a
// session already tracked. The sweep reads, in pipelines, one count per
// quiet session per replica that served it. The replica that served the
// last request reads one a minute while the session stays quiet. Memory is
// about 100 bytes per tracked session, bounded by MaxSessions.
type SessionLengths struct {
	store       Counts // the binding store
	now         func() time.Time
	maxSessions int

	lengths     prometheus.Histogram
	checkErrors prometheus.Counter
	untracked   prometheus.Counter

	mu       sync.Mutex
	sessions map[string]tracked
}

// tracked is what a replica remembers of one session. Times are unix
// nanoseconds.
type tracked struct {
	max   int           // the highest request count seen
	last  int64         // when a request was last seen
	check int64         // when Sweep asks the store next
	back  time.Duration // the wait after a check that finds the session live and ours
}

const (
	// DefaultMaxSessions is how many sessions a replica tracks at most.
	DefaultMaxSessions = 500_000
	// SweepEvery is how often Run sweeps.
	SweepEvery = 15 * time.Second
	// quiet is how long after the last request seen a session is checked,
	// and the first recheck's wait; maxRecheck caps the doubling waits.
	quiet      = 30 * time.Second
	maxRecheck = time.Minute
	// reorderWindow tells a new session from a race. A count lower than
	// the highest seen, arriving later than this after it, is a new session
	// on the key. Arriving earlier, it is a request that raced the one with
	// the higher count.
	reorderWindow = 500 * time.Millisecond
	// checkBatch is how many counts one store call reads. checkTimeout
	// bounds the call. scanChunk is how many sessions the sweep looks at
	// between releases of the lock, so Seen never waits long.
	checkBatch   = 256
	checkTimeout = 5 * time.Second
	scanChunk    = 4096
)

// SessionLengthsOptions tunes a SessionLengths; the zero value is tether's.
type SessionLengthsOptions struct {
	// MaxSessions caps the sessions tracked; beyond it new sessions are
	// counted in tether_session_requests_untracked_total and not observed
	// (0: DefaultMaxSessions).
	MaxSessions int
	// Now is Sweep's clock (nil: time.Now).
	Now func() time.Time
}

// NewSessionLengths creates the tracker and registers its collectors with
// reg. Feed it with Seen (Metrics.TrackSessions) and run Run.
func NewSessionLengths(reg prometheus.Registerer, store Counts, o SessionLengthsOptions) *SessionLengths {
	s := &SessionLengths{
		store:       store,
		now:         o.Now,
		maxSessions: o.MaxSessions,
		sessions:    map[string]tracked{},
		lengths: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "tether_session_requests",
			Help:    "Requests a session made before it ended (its binding expired or was deleted), observed by the replica that served its last request, up to about a minute after the binding ended. Sessions with an idle timeout under about 75 s may be observed once per replica that served them.",
			Buckets: []float64{1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233},
		}),
		checkErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tether_session_requests_check_errors_total",
			Help: "Failed reads of session request counts from the binding store; the sessions are checked again at the next sweep.",
		}),
		untracked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tether_session_requests_untracked_total",
			Help: "Sessions this replica did not track because it tracked the most it may; those whose last request it served are missing from tether_session_requests.",
		}),
	}
	if s.now == nil {
		s.now = time.Now
	}
	if s.maxSessions <= 0 {
		s.maxSessions = DefaultMaxSessions
	}
	tracking := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tether_session_requests_tracked",
		Help: "Sessions this replica tracks for tether_session_requests: seen here and not yet known to have ended or moved on to another replica.",
	}, func() float64 {
		s.mu.Lock()
		defer s.mu.Unlock()
		return float64(len(s.sessions))
	})
	reg.MustRegister(s.lengths, s.checkErrors, s.untracked, tracking)
	return s
}

// TrackSessions makes Decision report every decision's session count to s
// (nil: none). Call it before m records decisions.
func (m *Metrics) TrackSessions(s *SessionLengths) { m.sessions = s }

// Seen records that a request of the session stored under key was served
// here with the session's count requests (affinity.Decision.Key,
// Requests). Empty keys and counts below 1 (unknown) are ignored.
func (s *SessionLengths) Seen(key string, requests int, now time.Time) {
	if key == "" || requests < 1 {
		return
	}
	t := now.UnixNano()
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.sessions[key]
	switch {
	case !ok && len(s.sessions) >= s.maxSessions:
		s.untracked.Inc()
		return
	case !ok:
		key = strings.Clone(key) // the map keeps it: never a slice of something larger
	case requests < e.max && time.Duration(t-e.last) >= reorderWindow:
		// The binding we saw is gone and the key started again: as if
		// Sweep had found it gone.
		s.lengths.Observe(float64(e.max))
		e = tracked{}
	}
	e.max = max(e.max, requests)
	e.last, e.check, e.back = t, t+int64(quiet), quiet
	s.sessions[key] = e
}

// Run sweeps every SweepEvery until ctx ends.
func (s *SessionLengths) Run(ctx context.Context) {
	t := time.NewTicker(SweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_ = s.Sweep(ctx) // counted in tether_session_requests_check_errors_total
		}
	}
}

// due is a session Sweep asks the store about, as it was when picked.
type due struct {
	key  string
	max  int
	last int64
}

// Sweep checks the sessions quiet since their check time against the
// store (see SessionLengths). It stops at the first failed store call,
// leaving the rest for the next sweep, and returns its error.
func (s *SessionLengths) Sweep(ctx context.Context) error {
	now := s.now()
	t := now.UnixNano()
	batch, keys := make([]due, 0, checkBatch), make([]string, 0, checkBatch)
	s.mu.Lock()
	defer s.mu.Unlock()
	seen := 0
	// The lock is released now and then inside the loop (for the store
	// calls, and every scanChunk sessions so Seen never waits long).
	// Go's map iteration allows the map to change meanwhile: a session
	// added may or may not be visited, one deleted is not.
	for key, e := range s.sessions {
		if e.check <= t {
			batch = append(batch, due{key: key, max: e.max, last: e.last})
		}
		seen++
		switch {
		case len(batch) == checkBatch:
			if err := s.check(ctx, batch, keys, now); err != nil {
				return err
			}
			batch = batch[:0]
		case seen%scanChunk == 0:
			s.mu.Unlock()
			s.mu.Lock()
		}
	}
	if len(batch) > 0 {
		return s.check(ctx, batch, keys, now)
	}
	return nil
}

// check asks the store for the counts of batch and acts on them; keys is
// a buffer. Called with s.mu held; it releases it during the store call.
func (s *SessionLengths) check(ctx context.Context, batch []due, keys []string, now time.Time) error {
	keys = keys[:0]
	for _, d := range batch {
		keys = append(keys, d.key)
	}
	s.mu.Unlock()
	err := ctx.Err()
	var counts []int
	if err == nil {
		cctx, cancel := context.WithTimeout(ctx, checkTimeout)
		counts, err = s.store.Requests(cctx, keys, now)
		cancel()
		if err == nil && len(counts) != len(keys) {
			err = fmt.Errorf("store returned %d counts for %d sessions", len(counts), len(keys))
		}
	}
	s.mu.Lock()
	if err != nil {
		if ctx.Err() == nil {
			s.checkErrors.Inc()
		}
		return fmt.Errorf("session lengths: %w", err)
	}
	t := now.UnixNano()
	for i, d := range batch {
		e, ok := s.sessions[d.key]
		if !ok || e.max != d.max || e.last != d.last {
			continue // seen again meanwhile: not quiet any more
		}
		switch n := counts[i]; {
		case n == e.max:
			e.check, e.back = t+int64(e.back), min(2*e.back, maxRecheck)
			s.sessions[d.key] = e
		case n > e.max:
			delete(s.sessions, d.key)
		default:
			s.lengths.Observe(float64(e.max))
			delete(s.sessions, d.key)
		}
	}
	return nil
}
