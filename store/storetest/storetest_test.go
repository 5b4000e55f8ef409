package storetest

import (
	"context"
	"errors"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/replicas"
)

// flaws are the ways fakeStore can be wrong, each with the case that must
// catch it. A suite that passes a broken store proves nothing.
var flaws = map[string]string{
	"":                "",
	"racy":            "racing_get-or-bind_agree_on_one_winner",
	"racy-replace":    "racing_replace_agree_on_one_winner",
	"no-expiry":       "idle_expiry_creates_again",
	"no-refresh":      "use_refreshes_the_idle_timeout",
	"no-max":          "max_exceeded_renews",
	"max-always":      "max_zero_is_no_limit",
	"replace-always":  "replace_keeps_a_binding_another_caller_moved",
	"found-candidate": "second_caller_finds_the_first_binding",
	"idle-from-bind":  "a_hit_says_how_long_the_session_was_idle",
	"shared-key":      "keys_are_isolated",
	"accept-bad":      "bad_input_is_an_error,_not_a_binding",
	"no-alias":        "alias_links_and_follows",
	"alias-forever":   "alias_link_expires_with_the_idle_lifetime",
	"first-link-wins": "newer_link_overwrites_an_older_one",
	"link-unresolved": "alias_equal_to_the_resolved_key_is_ignored",
	"drop-version":    "version_is_stored_and_returned",
	"keep-move":       "replace_clears_a_pending_move",
	"index-stale":     "index_counts_binds,_expiry_and_moves",
	"index-last-idle": "index_keeps_a_session_whatever_idle_each_request_carries",
	"no-previous":     "max_exceeded_renews",
	"mark-no-limit":   "mark_selects_by_version,_limits_and_counts_what_remains",
	"drop-failovers":  "failovers_are_stored_by_replace_and_reset_by_a_new_placement",
	"bound-stale":     "bound_lists_the_live_sessions_of_an_instance",
	"inflight-self":   "sync_load_sums_the_other_replicas",
	"report-forever":  "sync_load_sums_the_other_replicas",
	"no-count":        "requests_are_counted_per_session",
	"renew-resets":    "a_renewal_keeps_counting",
	"replace-resets":  "replace_keeps_the_count",
	"count-forever":   "an_ended_session's_count_is_gone",
	"racy-count":      "racing_requests_each_get_their_own_count",
	"engine-first":    "sync_load_shares_the_newest_engine_reading",
	"engine-self":     "sync_load_shares_the_newest_engine_reading",
	"lease-shared":    "leases",
	"lease-forever":   "leases",
	"release-any":     "leases",
	// The instance circuits.
	"circuit-count-open":    "circuits_open_on_the_fleet's_count",
	"circuit-per-fleet":     "circuits_open_on_the_fleet's_count",
	"circuit-recover-early": "circuits_close_on_a_probe's_success_after_the_cooldown",
	"circuit-keep-failures": "circuits_close_on_a_probe's_success_after_the_cooldown",
	"circuit-no-window":     "circuit_failures_count_within_the_window_only",
	"circuit-window-edge":   "circuit_failures_count_within_the_window_only",
	"circuit-probe-counted": "a_failed_probe_reopens_a_circuit_at_once",
	"circuit-stale-kept":    "a_stale_half-open_circuit_is_dropped",
	"circuit-accept-bad":    "circuit_bad_input_is_an_error",
}

// TestSuiteCatchesFlaws runs the suite in a child process against a store
// with one flaw at a time and checks that the intended case fails (and, for
// the flawless store, that everything passes).
func TestSuiteCatchesFlaws(t *testing.T) {
	if os.Getenv("STORETEST_FLAW") != "" {
		t.Skip("child process")
	}
	for flaw, failing := range flaws {
		t.Run("flaw="+flaw, func(t *testing.T) {
			t.Parallel()
			cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestFakeStore$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), "STORETEST_FLAW="+flaw, "STORETEST_CHILD=1")
			out, err := cmd.CombinedOutput()
			if failing == "" {
				if err != nil {
					t.Fatalf("flawless fake store fails the suite: %v\n%s", err, out)
				}
				return
			}
			if err == nil {
				t.Fatalf("suite passes a store with flaw %q\n%s", flaw, out)
			}
			if want := "--- FAIL: TestFakeStore/" + failing; !strings.Contains(string(out), want) {
				t.Errorf("flaw %q: output lacks %q\n%s", flaw, want, out)
			}
		})
	}
}

// TestFakeStore is the child side of TestSuiteCatchesFlaws.
func TestFakeStore(t *testing.T) {
	if os.Getenv("STORETEST_CHILD") == "" {
		t.Skip("run by TestSuiteCatchesFlaws")
	}
	flaw := os.Getenv("STORETEST_FLAW")
	Run(t, Harness{
		New:     func(*testing.T) Store { return newFakeStore(flaw) },
		Advance: func(*testing.T, time.Duration) {},
	})
}

type fakeEntry struct {
	b       bindings.Binding
	move    bindings.Move
	expires time.Time
	// "index-last-idle": the index entry is rewritten when written
	// Idle/4 ago, with the request's idle (the Redis store's old bug).
	indexed, indexUntil time.Time
	requests            int
	lastUse             time.Time
}

// index records an index write at now under "index-last-idle".
func (e *fakeEntry) index(now time.Time, idle time.Duration) {
	e.indexed, e.indexUntil = now, now.Add(idle*5/4)
}

// inIndex reports whether e counts in its instance's index at now.
func (s *fakeStore) inIndex(e fakeEntry, now time.Time) bool {
	return now.Before(e.expires) && (s.flaw != "index-last-idle" || now.Before(e.indexUntil))
}

type fakeLink struct {
	to      string
	expires time.Time
}

type fakeReport struct {
	r       fleet.LoadReport
	expires time.Time
}

// fakeStore is a deliberately simple store whose flaw can be switched on.
// Its index is derived from the bindings, except under "index-stale".
type fakeStore struct {
	flaw string
	// op makes each GetOrBind and Replace one step, as a real store's
	// script is, unless the flaw is that it is not ("racy",
	// "racy-replace", "racy-count").
	op      sync.Mutex
	mu      sync.Mutex
	m       map[string]fakeEntry
	links   map[string]fakeLink
	stale   map[string]string // "index-stale": key → the instance the index still has
	reports map[string]fakeReport
	drained map[string]bool
	fails   map[string][]time.Time // instance → failures in the window
	open    map[string]time.Time   // instance → cooldown end
	leases  map[string]fakeReport  // name → holder (as Replica) and expiry
}

func newFakeStore(flaw string) *fakeStore {
	return &fakeStore{flaw: flaw, m: map[string]fakeEntry{}, links: map[string]fakeLink{},
		stale: map[string]string{}, reports: map[string]fakeReport{}, drained: map[string]bool{},
		fails: map[string][]time.Time{}, open: map[string]time.Time{}, leases: map[string]fakeReport{}}
}

func (s *fakeStore) k(key string) string {
	if s.flaw == "shared-key" {
		return "same"
	}
	return key
}

func (s *fakeStore) bad(b bindings.Binding, lt bindings.Lifetime) bool {
	return s.flaw != "accept-bad" && bindings.CheckBinding(b, lt) != nil
}

func (s *fakeStore) load(key string, now time.Time) (fakeEntry, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.m[s.k(key)]
	if ok && !now.Before(e.expires) && s.flaw != "no-expiry" {
		return e, false
	}
	return e, ok
}

func (s *fakeStore) store(key string, e fakeEntry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.flaw == "drop-version" {
		e.b.Version = ""
	}
	s.m[s.k(key)] = e
}

// atomic holds op for a whole GetOrBind or Replace, unless the flaw is
// that this one is not atomic; the caller defers what it returns.
func (s *fakeStore) atomic(flaws ...string) func() {
	if slices.Contains(flaws, s.flaw) {
		return func() {}
	}
	s.op.Lock()
	return s.op.Unlock
}

// pause widens the window between a read and the following write, so the
// racy flaws lose their race reliably.
func (s *fakeStore) pause(flaw string) {
	if s.flaw == flaw {
		time.Sleep(5 * time.Millisecond)
	}
}

func (s *fakeStore) resolve(key string, now, until time.Time) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ln, ok := s.links[key]; ok && (now.Before(ln.expires) || s.flaw == "alias-forever") {
		s.links[key] = fakeLink{to: ln.to, expires: until}
		return ln.to
	}
	return key
}

func (s *fakeStore) link(aliases []string, key string, until time.Time) {
	if s.flaw == "no-alias" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, a := range aliases {
		if a == "" || a == key {
			continue
		}
		if _, ok := s.links[a]; ok && s.flaw == "first-link-wins" {
			continue
		}
		s.links[a] = fakeLink{to: key, expires: until}
	}
}

func (s *fakeStore) GetOrBind(ctx context.Context, l bindings.Lookup) (bindings.Result, error) {
	if err := ctx.Err(); err != nil {
		return bindings.Result{}, err
	}
	defer s.atomic("racy", "racy-count")()
	c, lt := l.Candidate, l.Lifetime
	if s.bad(c, lt) {
		return bindings.Result{}, errors.New("bad input")
	}
	now := c.Since
	if s.flaw == "link-unresolved" {
		s.link(l.Aliases, l.Key, now.Add(lt.Idle))
	}
	key := s.resolve(l.Key, now, now.Add(lt.Idle))
	if s.flaw != "link-unresolved" {
		s.link(l.Aliases, key, now.Add(lt.Idle))
	}
	e, ok := s.load(key, now)
	out := bindings.Created
	if ok {
		old := (lt.Max > 0 && now.Sub(e.b.Since) >= lt.Max) || s.flaw == "max-always"
		if s.flaw == "no-max" {
			old = false
		}
		if !old {
			refresh := func(e *fakeEntry) {}
			if s.flaw != "no-refresh" {
				refresh = func(e *fakeEntry) {
					if s.flaw != "idle-from-bind" {
						e.lastUse = now
					}
					e.expires = now.Add(lt.Idle)
					if now.Sub(e.indexed) >= lt.Idle/4 {
						e.index(now, lt.Idle)
					}
				}
			}
			r := bindings.Result{Key: key, Binding: e.b, Origin: bindings.Found, Move: e.move, Idle: now.Sub(e.lastUse), Requests: s.use(key, refresh)}
			if s.flaw == "found-candidate" {
				r.Binding = c
			}
			return r, nil
		}
		out = bindings.Renewed
	}
	s.pause("racy")
	stored := fakeEntry{b: c, expires: now.Add(lt.Idle), requests: 1, lastUse: now}
	if out == bindings.Renewed && s.flaw != "renew-resets" {
		stored.requests = e.requests + 1
	}
	stored.index(now, lt.Idle)
	s.store(key, stored)
	if s.flaw == "drop-version" {
		c.Version = ""
	}
	r := bindings.Result{Key: key, Binding: c, Origin: out, Requests: stored.requests}
	if out == bindings.Renewed && s.flaw != "no-previous" {
		r.Previous = e.b
	}
	return r, nil
}

func (s *fakeStore) Replace(ctx context.Context, key, old string, next bindings.Binding, lt bindings.Lifetime) (bindings.Binding, error) {
	if err := ctx.Err(); err != nil {
		return bindings.Binding{}, err
	}
	defer s.atomic("racy-replace")()
	if s.bad(next, lt) {
		return bindings.Binding{}, errors.New("bad input")
	}
	e, ok := s.load(key, next.Since)
	if ok && e.b.Instance != old && s.flaw != "replace-always" {
		e.expires = next.Since.Add(lt.Idle)
		s.store(key, e)
		return e.b, nil
	}
	s.pause("racy-replace")
	stored := fakeEntry{b: next, expires: next.Since.Add(lt.Idle)}
	if ok && s.flaw != "replace-resets" {
		stored.requests = e.requests
	}
	stored.index(next.Since, lt.Idle)
	if s.flaw == "keep-move" {
		stored.move = e.move
	}
	if s.flaw == "index-stale" && ok {
		s.mu.Lock()
		s.stale[key] = e.b.Instance
		s.mu.Unlock()
	}
	s.store(key, stored)
	if s.flaw == "drop-version" {
		next.Version = ""
	}
	if s.flaw == "drop-failovers" {
		stored.b.Failovers = 0
		s.store(key, stored)
		next.Failovers = 0
	}
	return next, nil
}

// use refreshes key's live binding and counts a request of it, in one
// step, and returns its count.
func (s *fakeStore) use(key string, refresh func(*fakeEntry)) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.m[s.k(key)]
	refresh(&e)
	switch s.flaw {
	case "no-count":
		e.requests = 1
	case "racy-count":
		n := e.requests + 1
		s.mu.Unlock()
		time.Sleep(time.Millisecond)
		s.mu.Lock()
		e = s.m[s.k(key)]
		e.requests = n
	default:
		e.requests++
	}
	s.m[s.k(key)] = e
	return e.requests
}

func (s *fakeStore) Requests(ctx context.Context, keys []string, now time.Time) ([]int, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	out := make([]int, len(keys))
	for i, k := range keys {
		if e, ok := s.load(k, now); ok || s.flaw == "count-forever" {
			out[i] = e.requests
		}
	}
	return out, nil
}

func (s *fakeStore) Bound(ctx context.Context, instance string, limit int, now time.Time) ([]bindings.Session, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if bindings.CheckBound(instance, limit) != nil {
		return nil, errors.New("bad input")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []bindings.Session
	for _, key := range slices.Sorted(maps.Keys(s.m)) {
		e := s.m[key]
		if s.flaw != "bound-stale" && (!s.inIndex(e, now) || e.b.Instance != instance) {
			continue
		}
		if limit > 0 && len(out) == limit {
			break
		}
		out = append(out, bindings.Session{Key: key, Binding: e.b, Move: e.move, TTL: e.expires.Sub(now)})
	}
	return out, nil
}

func (s *fakeStore) Show(ctx context.Context, key string, now time.Time) (bindings.Session, bool, error) {
	if err := ctx.Err(); err != nil {
		return bindings.Session{}, false, err
	}
	s.mu.Lock()
	if ln, ok := s.links[key]; ok && now.Before(ln.expires) {
		key = ln.to
	}
	s.mu.Unlock()
	e, ok := s.load(key, now)
	if !ok {
		return bindings.Session{}, false, nil
	}
	return bindings.Session{Key: key, Binding: e.b, Move: e.move, TTL: e.expires.Sub(now)}, true, nil
}

// instanceOf is the instance key counts for in the index.
func (s *fakeStore) instanceOf(key string, e fakeEntry) string {
	if in, ok := s.stale[key]; ok {
		return in
	}
	return e.b.Instance
}

func (s *fakeStore) Mark(ctx context.Context, f bindings.MarkFilter, m bindings.Move, now time.Time) (marked, remaining int, err error) {
	if err := ctx.Err(); err != nil {
		return 0, 0, err
	}
	if f.Instance == "" || f.Limit < 0 || !m.Pending() {
		return 0, 0, errors.New("bad input")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, key := range slices.Sorted(maps.Keys(s.m)) {
		e := s.m[key]
		if !s.inIndex(e, now) || e.b.Instance != f.Instance || (f.Version != "" && e.b.Version != f.Version) || e.move.Pending() {
			continue
		}
		if f.Limit == 0 || marked < f.Limit || s.flaw == "mark-no-limit" {
			e.move = m
			s.m[key] = e
			marked++
		} else {
			remaining++
		}
	}
	return marked, remaining, nil
}

func (s *fakeStore) SyncLoad(ctx context.Context, r fleet.LoadReport, instances []string, ttl time.Duration, now time.Time) (fleet.LoadState, error) {
	if err := ctx.Err(); err != nil {
		return fleet.LoadState{}, err
	}
	if r.Replica == "" || ttl <= 0 {
		return fleet.LoadState{}, errors.New("bad input")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reports[r.Replica] = fakeReport{r: r, expires: now.Add(ttl)}
	st := fleet.LoadState{Active: map[string]int{}, InFlight: map[string]int{}, Queue: map[string]int{}, Drained: maps.Clone(s.drained),
		Engine: map[string]fleet.EngineReading{}}
	for name, rep := range s.reports {
		if name != r.Replica && (now.Before(rep.expires) || s.flaw == "report-forever") {
			st.Replicas++
		}
	}
	for _, in := range instances {
		st.Active[in] = 0
		for key, e := range s.m {
			if s.inIndex(e, now) && s.instanceOf(key, e) == in {
				st.Active[in]++
			}
		}
		for name, rep := range s.reports {
			if !now.Before(rep.expires) && s.flaw != "report-forever" {
				continue
			}
			if n, ok := rep.r.InFlight[in]; ok && (name != r.Replica || s.flaw == "inflight-self") {
				st.InFlight[in] += n
			}
			if q, ok := rep.r.Queue[in]; ok {
				if cur, seen := st.Queue[in]; !seen || q > cur {
					st.Queue[in] = q
				}
			}
			if e, ok := rep.r.Engine[in]; ok && (name != r.Replica || s.flaw == "engine-self") {
				if cur, seen := st.Engine[in]; !seen || e.At.After(cur.At) != (s.flaw == "engine-first") {
					st.Engine[in] = e
				}
			}
		}
	}
	return st, nil
}

func (s *fakeStore) Lease(ctx context.Context, name, holder string, ttl time.Duration, now time.Time) (bool, error) {
	if err := replicas.CheckLease(name, holder, ttl); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.leases[name]
	if ok && l.r.Replica != holder && (now.Before(l.expires) || s.flaw == "lease-forever") && s.flaw != "lease-shared" {
		return false, nil
	}
	s.leases[name] = fakeReport{r: fleet.LoadReport{Replica: holder}, expires: now.Add(ttl)}
	return true, nil
}

func (s *fakeStore) Release(_ context.Context, name, holder string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if l, ok := s.leases[name]; ok && (l.r.Replica == holder || s.flaw == "release-any") {
		delete(s.leases, name)
	}
	return nil
}

func (s *fakeStore) SetDrained(ctx context.Context, instance string, drained bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if instance == "" {
		return errors.New("bad input")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if drained {
		s.drained[instance] = true
	} else {
		delete(s.drained, instance)
	}
	return nil
}

func (s *fakeStore) ReportFailure(ctx context.Context, instance string, at time.Time, member string, cfg fleet.BreakerConfig) (bool, time.Time, error) {
	if err := ctx.Err(); err != nil {
		return false, time.Time{}, err
	}
	if s.flaw != "circuit-accept-bad" && replicas.CheckFailure(instance, member, cfg) != nil {
		return false, time.Time{}, errors.New("bad input")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.flaw == "circuit-per-fleet" {
		instance = "fleet"
	}
	open := func() (bool, time.Time, error) {
		s.open[instance] = at.Add(cfg.Cooldown)
		if s.flaw != "circuit-keep-failures" {
			delete(s.fails, instance)
		}
		return true, s.open[instance], nil
	}
	if till, ok := s.open[instance]; ok {
		switch {
		case till.After(at) && s.flaw != "circuit-count-open":
			return false, till, nil
		case !till.After(at) && s.flaw != "circuit-probe-counted":
			return open()
		}
	}
	var kept []time.Time
	for _, t := range append(s.fails[instance], at) {
		switch {
		case s.flaw == "circuit-no-window", t.After(at.Add(-cfg.Window)):
			kept = append(kept, t)
		case s.flaw == "circuit-window-edge" && t.Equal(at.Add(-cfg.Window)):
			kept = append(kept, t)
		}
	}
	s.fails[instance] = kept
	if len(kept) > cfg.Threshold {
		return open()
	}
	if till, ok := s.open[instance]; ok {
		return false, till, nil
	}
	return false, time.Time{}, nil
}

func (s *fakeStore) ReportRecovered(ctx context.Context, instance string, at time.Time) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if instance == "" && s.flaw != "circuit-accept-bad" {
		return false, errors.New("bad input")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	till, ok := s.open[instance]
	if !ok || (till.After(at) && s.flaw != "circuit-recover-early") {
		return false, nil
	}
	delete(s.open, instance)
	if s.flaw != "circuit-keep-failures" {
		delete(s.fails, instance)
	}
	return true, nil
}

func (s *fakeStore) Circuits(ctx context.Context, now time.Time) (map[string]time.Time, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.flaw != "circuit-stale-kept" {
		maps.DeleteFunc(s.open, func(_ string, until time.Time) bool { return now.Sub(until) > replicas.StaleCircuit })
	}
	return maps.Clone(s.open), nil
}
