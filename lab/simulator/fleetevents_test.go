package simulator

import (
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/lab/workload"
)

// churn is the bench's churn schedule over d: instance 1 fails at d/4 and
// returns at d/2, a ninth instance joins at 3d/4.
func churn(d time.Duration) []FleetEvent {
	return []FleetEvent{
		{At: d / 4, Kind: EventFail, Instance: 1},
		{At: d / 2, Kind: EventRestore, Instance: 1},
		{At: 3 * d / 4, Kind: EventAdd, Instance: 8},
	}
}

func TestFleetEventsValidate(t *testing.T) {
	d := time.Minute
	for _, tc := range []struct {
		name   string
		events []FleetEvent
		s      Scenario
		want   string
	}{
		{name: "before the start", events: []FleetEvent{{At: 0, Kind: EventFail, Instance: 1}}, want: "event fail of instance 1 at 0s: want a time after the start"},
		{name: "after the end", events: []FleetEvent{{At: d, Kind: EventFail, Instance: 1}}, want: "before the run's duration, 1m0s"},
		{name: "instance out of range", events: []FleetEvent{{At: time.Second, Kind: EventFail, Instance: 8}}, want: "event fail of instance 8 at 1s: want an instance from 0 to 7"},
		{name: "fail twice", events: []FleetEvent{{At: time.Second, Kind: EventFail, Instance: 2}, {At: 2 * time.Second, Kind: EventFail, Instance: 2}}, want: "event fail of instance 2 at 2s: the instance is not up then"},
		{name: "restore of one up", events: []FleetEvent{{At: time.Second, Kind: EventRestore, Instance: 3}}, want: "event restore of instance 3 at 1s: the instance is not down then"},
		{name: "restore before its fail", events: []FleetEvent{{At: 2 * time.Second, Kind: EventFail, Instance: 3}, {At: time.Second, Kind: EventRestore, Instance: 3}}, want: "event restore of instance 3 at 1s: the instance is not down then"},
		{name: "add of an instance up", events: []FleetEvent{{At: time.Second, Kind: EventAdd, Instance: 0}}, want: "event add of instance 0 at 1s: want instance 8, the next spare"},
		{name: "unknown kind", events: []FleetEvent{{At: time.Second, Kind: "reboot", Instance: 0}}, want: `unknown kind "reboot": want fail, restore or add`},
		{name: "with failures", events: churn(d), s: Scenario{Failures: Failures{Every: 10 * time.Second, Down: time.Second}}, want: "events with failures"},
		{name: "with scale", events: churn(d), s: Scenario{Scale: Scale{Every: 10 * time.Second, Step: 0.25}}, want: "events with scale"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.s
			s.Events = tc.events
			err := Options{Rate: 1, Duration: d, Scenario: s}.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error with %q", err, tc.want)
			}
		})
	}
	last := []FleetEvent{{At: time.Second, Kind: EventFail, Instance: 0}}
	if err := (Options{Rate: 1, Duration: d, Instances: 1, Scenario: Scenario{Events: last}}).Validate(); err == nil || !strings.Contains(err.Error(), "last instance up") {
		t.Errorf("failing the only instance: got %v, want an error naming the last instance", err)
	}
	if err := (Options{Rate: 1, Duration: d, Scenario: Scenario{Events: churn(d)}}).Validate(); err != nil {
		t.Errorf("the churn schedule: %v", err)
	}
}

// The bench's churn, simulated: the failure reaches requests or sessions,
// sticky moves no session; the ring hash also moves sessions when the
// instance returns and when the ninth joins; the ninth serves; the
// series' four phases add up to the run.
func TestFleetEventsChurn(t *testing.T) {
	d := 90 * time.Second
	for _, p := range []Policy{Sticky, RingHash} {
		r := run(t, Options{
			Policy: p, Rate: 6, Duration: d, ThinkScale: 0.2, Stream: true, Seed: 1,
			Workload: workload.Config{Seed: 1, Mix: workload.Mix{MultiTurn: 1}, Identities: workload.IdentityMix{Session: 1}},
			Scenario: Scenario{Events: churn(d)}, Series: true, SeriesEvery: d / 4, SeriesByEnd: true,
		})
		accounted(t, r)
		if len(r.Instances) != 9 || r.Instances[8].Served == 0 {
			t.Fatalf("%s: %d instances, the ninth served %d: want it added and serving", p, len(r.Instances), r.Instances[8].Served)
		}
		if r.Regime.Failed+r.Regime.Displaced == 0 {
			t.Errorf("%s: the failure failed no request and displaced no session", p)
		}
		switch {
		case p == Sticky && r.Regime.Moved != 0:
			t.Errorf("sticky moved %d sessions off instances up: want 0", r.Regime.Moved)
		case p == RingHash && r.Regime.Moved == 0:
			t.Error("ring hash moved no session when the instance returned or the ninth joined")
		}
		if len(r.Series) < 4 {
			t.Fatalf("%s: %d series entries, want the four phases (and the drain)", p, len(r.Series))
		}
		ok, lost := 0, 0
		for i, m := range r.Series {
			ok, lost = ok+m.OK, lost+m.Lost
			if m.Start != time.Duration(i)*d/4 {
				t.Errorf("%s: entry %d starts at %v, want %v", p, i, m.Start, time.Duration(i)*d/4)
			}
		}
		if ok != r.Summary.OK || lost != r.Regime.Lost {
			t.Errorf("%s: the series has %d OK and %d lost, the run %d and %d", p, ok, lost, r.Summary.OK, r.Regime.Lost)
		}
	}
}
