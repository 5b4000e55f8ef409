package storetest

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
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
	"shared-key":      "keys_are_isolated",
	"accept-bad":      "bad_input_is_an_error,_not_a_binding",
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
		New:     func(*testing.T) affinity.Store { return &fakeStore{flaw: flaw, m: map[string]fakeEntry{}} },
		Advance: func(*testing.T, time.Duration) {},
	})
}

type fakeEntry struct {
	b       affinity.Binding
	expires time.Time
}

// fakeStore is a deliberately simple store whose flaw can be switched on.
type fakeStore struct {
	flaw string
	mu   sync.Mutex
	m    map[string]fakeEntry
}

func (s *fakeStore) k(key string) string {
	if s.flaw == "shared-key" {
		return "same"
	}
	return key
}

func (s *fakeStore) bad(b affinity.Binding, lt affinity.Lifetime) bool {
	return s.flaw != "accept-bad" && (b.Instance == "" || b.Since.IsZero() || lt.Idle <= 0 || lt.Max < 0)
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
	s.m[s.k(key)] = e
}

// pause widens the window between a read and the following write, so the
// racy flaws lose their race reliably.
func (s *fakeStore) pause(flaw string) {
	if s.flaw == flaw {
		time.Sleep(5 * time.Millisecond)
	}
}

func (s *fakeStore) GetOrBind(ctx context.Context, key string, c affinity.Binding, lt affinity.Lifetime) (affinity.Binding, affinity.Outcome, error) {
	if err := ctx.Err(); err != nil {
		return affinity.Binding{}, 0, err
	}
	if s.bad(c, lt) {
		return affinity.Binding{}, 0, context.DeadlineExceeded // any error
	}
	now := c.Since
	e, ok := s.load(key, now)
	out := affinity.Created
	if ok {
		old := (lt.Max > 0 && now.Sub(e.b.Since) >= lt.Max) || s.flaw == "max-always"
		if s.flaw == "no-max" {
			old = false
		}
		if !old {
			if s.flaw != "no-refresh" {
				e.expires = now.Add(lt.Idle)
				s.store(key, e)
			}
			if s.flaw == "found-candidate" {
				return c, affinity.Found, nil
			}
			return e.b, affinity.Found, nil
		}
		out = affinity.Renewed
	}
	s.pause("racy")
	s.store(key, fakeEntry{b: c, expires: now.Add(lt.Idle)})
	return c, out, nil
}

func (s *fakeStore) Replace(ctx context.Context, key, old string, next affinity.Binding, lt affinity.Lifetime) (affinity.Binding, error) {
	if err := ctx.Err(); err != nil {
		return affinity.Binding{}, err
	}
	if s.bad(next, lt) {
		return affinity.Binding{}, context.DeadlineExceeded
	}
	e, ok := s.load(key, next.Since)
	if ok && e.b.Instance != old && s.flaw != "replace-always" {
		e.expires = next.Since.Add(lt.Idle)
		s.store(key, e)
		return e.b, nil
	}
	s.pause("racy-replace")
	s.store(key, fakeEntry{b: next, expires: next.Since.Add(lt.Idle)})
	return next, nil
}
