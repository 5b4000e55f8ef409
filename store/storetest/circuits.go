package storetest

import (
	"fmt"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/replicas"
)

// breaker is the instance breaker the circuit cases run: more than 3
// failures within 30 s open a circuit for 30 s.
var breaker = fleet.BreakerConfig{Threshold: 3, Window: 30 * time.Second, Cooldown: 30 * time.Second}

// fail reports one failure of instance seen by replica at e.now+at, with a
// member unique in the case, and returns the store's answer.
func (e *env) fail(replica, instance string, at time.Duration) (opened bool, until time.Time) {
	e.t.Helper()
	e.seq++
	opened, until, err := e.s.ReportFailure(e.ctx, instance, e.now.Add(at), fmt.Sprintf("%s:%d", replica, e.seq), e.breaker)
	if err != nil {
		e.t.Fatalf("ReportFailure(%s, +%v): %v", instance, at, err)
	}
	return opened, until
}

// failClosed reports a failure that must leave the circuit closed.
func (e *env) failClosed(replica, instance string, at time.Duration) {
	e.t.Helper()
	if opened, until := e.fail(replica, instance, at); opened || !until.IsZero() {
		e.t.Fatalf("failure of %s at +%v: opened %v until %v; want the circuit still closed", instance, at, opened, until)
	}
}

// recovered reports a probe's success on instance at e.now+at and checks
// whether it closed the circuit.
func (e *env) recovered(instance string, at time.Duration, wantClosed bool) {
	e.t.Helper()
	closed, err := e.s.ReportRecovered(e.ctx, instance, e.now.Add(at))
	if err != nil {
		e.t.Fatalf("ReportRecovered(%s, +%v): %v", instance, at, err)
	}
	if closed != wantClosed {
		e.t.Errorf("ReportRecovered(%s, +%v) closed = %v, want %v", instance, at, closed, wantClosed)
	}
}

// checkCircuits checks the circuits that are not closed at e.now+at.
func (e *env) checkCircuits(at time.Duration, want map[string]time.Time) {
	e.t.Helper()
	got, err := e.s.Circuits(e.ctx, e.now.Add(at))
	if err != nil {
		e.t.Fatalf("Circuits(+%v): %v", at, err)
	}
	if got == nil {
		e.t.Errorf("Circuits(+%v) = nil, want a map", at)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		e.t.Errorf("Circuits(+%v) (-want +got):\n%s", at, diff)
	}
}

// circuitCases are the instance breaker's shared state. Times are the
// caller's (the cases pass them), so no case waits.
var circuitCases = []testCase{
	{"circuits open on the fleet's count", func(e *env) {
		e.checkCircuits(0, map[string]time.Time{})
		// Two replicas, two failures each: the fleet's count opens it, and
		// only the report that tipped it says "opened".
		for i, r := range []string{"r1", "r2", "r1"} {
			e.failClosed(r, "a", time.Duration(i)*time.Second)
		}
		e.failClosed("r1", "b", 0) // another instance counts apart
		opened, until := e.fail("r2", "a", 3*time.Second)
		if want := e.now.Add(33 * time.Second); !opened || !until.Equal(want) {
			e.t.Fatalf("4th failure: opened %v until %v, want true until %v", opened, until, want)
		}
		// Failures while open were in flight when it opened: not counted,
		// so however many there are, they open nothing.
		for i := range 2 * breaker.Threshold {
			at := 4*time.Second + time.Duration(i)*time.Second
			if opened, until2 := e.fail("r1", "a", at); opened || !until2.Equal(until) {
				e.t.Fatalf("failure %d while open: opened %v until %v, want false until %v", i+1, opened, until2, until)
			}
		}
		e.checkCircuits(5*time.Second, map[string]time.Time{"a": until})
		// Half-open (the cooldown is over) until a probe answers.
		e.checkCircuits(time.Hour, map[string]time.Time{"a": until})
	}},
	{"circuits close on a probe's success after the cooldown", func(e *env) {
		// A cooldown shorter than the window, so that failures from before
		// the opening would still be in the window after it.
		e.breaker.Cooldown = 10 * time.Second
		for i := range 4 {
			e.fail("r1", "a", time.Duration(i)*time.Millisecond)
		}
		until := e.now.Add(3*time.Millisecond + e.breaker.Cooldown)
		e.checkCircuits(0, map[string]time.Time{"a": until})
		// A success during the cooldown (a request sent before it opened)
		// changes nothing; one after it closes the circuit.
		e.recovered("a", 5*time.Second, false)
		e.checkCircuits(5*time.Second, map[string]time.Time{"a": until})
		e.recovered("a", until.Sub(e.now), true)
		e.checkCircuits(until.Sub(e.now), map[string]time.Time{})
		e.recovered("a", until.Sub(e.now), false)
		e.recovered("never-failed", 0, false)
		// Recovery forgets the old failures: three more do not reopen it.
		at := until.Sub(e.now)
		for i := range 3 {
			e.failClosed("r1", "a", at+time.Duration(i)*time.Second)
		}
	}},
	{"circuit failures count within the window only", func(e *env) {
		// 11 s apart, never 4 within 30 s.
		for i := range 6 {
			e.failClosed("r1", "a", time.Duration(i)*11*time.Second)
		}
		// A failure exactly a window old has left it.
		for i := range 3 {
			e.failClosed("r2", "b", time.Duration(i)*time.Second)
		}
		e.failClosed("r2", "b", breaker.Window)
		e.checkCircuits(time.Minute, map[string]time.Time{})
	}},
	{"a failed probe reopens a circuit at once", func(e *env) {
		for i := range 4 {
			e.fail("r1", "a", time.Duration(i)*time.Millisecond)
		}
		later := time.Minute // past the cooldown: half-open
		opened, until := e.fail("r2", "a", later)
		if want := e.now.Add(later + breaker.Cooldown); !opened || !until.Equal(want) {
			e.t.Fatalf("failed probe: opened %v until %v, want true until %v", opened, until, want)
		}
		e.checkCircuits(later, map[string]time.Time{"a": until})
		e.recovered("a", later+time.Second, false)
	}},
	{"a stale half-open circuit is dropped", func(e *env) {
		for _, in := range []string{"old", "recent"} {
			for i := range 4 {
				e.fail("r1", in, time.Duration(i)*time.Millisecond)
			}
		}
		// A day later, less a minute: both are half-open, and "recent" is
		// probed (and fails).
		e.skew(replicas.StaleCircuit - time.Minute)
		for i := range 4 {
			e.fail("r1", "recent", time.Duration(i)*time.Millisecond) // a failed probe: open again
		}
		recent := e.now.Add(breaker.Cooldown)
		// Unprobed for longer than StaleCircuit: forgotten, for good.
		e.checkCircuits(2*time.Minute, map[string]time.Time{"recent": recent})
		e.checkCircuits(0, map[string]time.Time{"recent": recent})
		e.recovered("old", 0, false)
	}},
	{"circuit bad input is an error", func(e *env) {
		for _, c := range []struct {
			name, instance, member string
			cfg                    fleet.BreakerConfig
		}{
			{"empty instance", "", "m", breaker},
			{"empty member", "a", "", breaker},
			{"zero window", "a", "m", fleet.BreakerConfig{Threshold: 3, Cooldown: time.Second}},
			{"zero cooldown", "a", "m", fleet.BreakerConfig{Threshold: 3, Window: time.Second}},
			{"negative threshold", "a", "m", fleet.BreakerConfig{Threshold: -1, Window: time.Second, Cooldown: time.Second}},
		} {
			if _, _, err := e.s.ReportFailure(e.ctx, c.instance, e.now, c.member, c.cfg); err == nil {
				e.t.Errorf("ReportFailure with %s succeeded", c.name)
			}
		}
		if _, err := e.s.ReportRecovered(e.ctx, "", e.now); err == nil {
			e.t.Error("ReportRecovered with an empty instance succeeded")
		}
		// Nothing was counted: three failures leave a closed.
		for i := range 3 {
			e.failClosed("r1", "a", time.Duration(i)*time.Millisecond)
		}
		e.checkCircuits(0, map[string]time.Time{})
	}},
}
