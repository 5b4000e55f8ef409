package affinity_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/store/memory"
)

// TestEngineSaturation: an engine reading saturates an instance at the
// waiting or KV-usage threshold, only while it is fresh, and a reading
// without a KV figure never saturates by KV.
func TestEngineSaturation(t *testing.T) {
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	s := affinity.Saturation{Waiting: 5, KVUsage: 0.8, Stale: 5 * time.Second}
	d := affinity.New(memory.New(), fleet.New(instances(2)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime},
		affinity.WithClock(clk.now))
	l := d.Load()
	for _, tc := range []struct {
		name string
		r    fleet.EngineReading
		age  time.Duration
		s    affinity.Saturation
		want bool
	}{
		{"idle", fleet.EngineReading{Waiting: 0, KVUsage: 0.1, KVKnown: true}, 0, s, false},
		{"waiting at the threshold", fleet.EngineReading{Waiting: 5}, 0, s, true},
		{"waiting below", fleet.EngineReading{Waiting: 4, KVUsage: 0.79, KVKnown: true}, 0, s, false},
		{"kv at the threshold", fleet.EngineReading{KVUsage: 0.8, KVKnown: true}, 0, s, true},
		{"kv unknown", fleet.EngineReading{KVUsage: 0.95}, 0, s, false},
		{"stale", fleet.EngineReading{Waiting: 50, KVUsage: 1, KVKnown: true}, 6 * time.Second, s, false},
		{"just fresh", fleet.EngineReading{Waiting: 50}, 5 * time.Second, s, true},
		{"thresholds off", fleet.EngineReading{Waiting: 50, KVUsage: 1, KVKnown: true}, 0, affinity.Saturation{Stale: time.Minute}, false},
	} {
		r := tc.r
		r.At = clk.now().Add(-tc.age)
		l.SetEngine("gpu-0", r)
		if got := l.Saturated("gpu-0", tc.s); got != tc.want {
			t.Errorf("%s: saturated = %v, want %v", tc.name, got, tc.want)
		}
	}
	l.ForgetEngine("gpu-0")
	if _, ok := l.Engine("gpu-0", 0); ok {
		t.Error("a forgotten reading is still there")
	}
}

// TestEngineReadingFromOtherReplica: a reading that arrives through the
// load sync counts like this replica's own, and the newer of the two wins.
func TestEngineReadingFromOtherReplica(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	st := memory.New()
	scraper, other := affinity.NewLoad(), affinity.NewLoad()
	scraper.SetEngine("gpu-0", fleet.EngineReading{Waiting: 9, At: time.Now()})
	names := []string{"gpu-0", "gpu-1"}
	for i, l := range []*affinity.Load{scraper, other} {
		if err := syncLoad(t.Context(), l, st, fmt.Sprintf("r%d", i+1), names, now); err != nil {
			t.Fatal(err)
		}
	}
	r, ok := other.Engine("gpu-0", 5*time.Second)
	if !ok || r.Waiting != 9 {
		t.Fatalf("r2's view of gpu-0: %+v, %v; want r1's reading of 9 waiting", r, ok)
	}
	if !other.Saturated("gpu-0", affinity.Saturation{Waiting: 5, Stale: 5 * time.Second}) {
		t.Error("r2 does not count gpu-0 saturated by r1's reading")
	}
	// An older reading of r2's own loses to r1's newer one.
	other.SetEngine("gpu-0", fleet.EngineReading{Waiting: 1, At: time.Now().Add(-time.Second)})
	if r, _ := other.Engine("gpu-0", 0); r.Waiting != 9 {
		t.Errorf("r2's view with an older reading of its own: %d waiting, want r1's 9", r.Waiting)
	}
	if got := other.Snapshot().Engine["gpu-0"].Waiting; got != 9 {
		t.Errorf("snapshot: %d waiting, want 9", got)
	}
}

// TestPlacementPrefersKVRoom: a new session skips an instance whose engine
// reports a full KV cache while another has room inside the bounded load,
// and places as if nothing were full when every instance is.
func TestPlacementPrefersKVRoom(t *testing.T) {
	ins := instances(4)
	p := affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25,
		Saturation: affinity.Saturation{KVUsage: 0.8, Stale: time.Minute}}
	full := fleet.EngineReading{KVUsage: 0.9, KVKnown: true}
	t.Run("one full", func(t *testing.T) {
		d := affinity.New(memory.New(), fleet.New(ins), p)
		full.At = time.Now()
		d.Load().SetEngine("gpu-1", full)
		placed := map[string]int{}
		for i := range 200 {
			placed[decide(t, d, session(fmt.Sprint(i))).Instance.Name]++
		}
		// The others take sessions up to their bound, (1+ε) × their share,
		// so gpu-1 takes only what they cannot: 200 - 3 × ⌈1.25 × 201/4⌉ at
		// most, where its share would be 50.
		if placed["gpu-1"] > 200-3*62 {
			t.Errorf("placements %v: gpu-1 reports a full KV cache and took %d", placed, placed["gpu-1"])
		}
		for _, in := range []string{"gpu-0", "gpu-2", "gpu-3"} {
			if placed[in] < 55 {
				t.Errorf("placements %v: %s took fewer than 55", placed, in)
			}
		}
	})
	t.Run("all full", func(t *testing.T) {
		d, plain := affinity.New(memory.New(), fleet.New(ins), p), affinity.New(memory.New(), fleet.New(ins), p)
		for _, in := range ins {
			full.At = time.Now()
			d.Load().SetEngine(in.Name, full)
		}
		for i := range 200 {
			r := session(fmt.Sprint(i))
			if got, want := decide(t, d, r).Instance, decide(t, plain, r).Instance; got.Name != want.Name {
				t.Fatalf("session %d on a fleet of full caches: %s, want %s as without readings", i, got.Name, want.Name)
			}
		}
	})
	t.Run("stale reading ignored", func(t *testing.T) {
		d := affinity.New(memory.New(), fleet.New(ins), p)
		full.At = time.Now().Add(-2 * time.Minute)
		d.Load().SetEngine("gpu-1", full)
		for i := range 200 {
			r := session(fmt.Sprint(i))
			if got, want := decide(t, d, r).Instance, affinity.Rendezvous(r.ID.Key, ins); got.Name == "gpu-1" || want.Name != "gpu-1" {
				continue
			}
			return // gpu-1 took a session again
		}
		t.Error("gpu-1 took no session while its only full reading is two minutes old")
	})
}

// TestEnginesIdle: the fleet is idle when every instance has a reading
// taken after the given time with nothing running or waiting.
func TestEnginesIdle(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	ins := []fleet.Instance{{Name: "gpu-0"}, {Name: "gpu-1"}}
	for _, tc := range []struct {
		name      string
		r0, r1    fleet.EngineReading
		none1     bool
		instances []fleet.Instance
		want      bool
	}{
		{name: "both idle, after", r0: fleet.EngineReading{At: now.Add(time.Second)}, r1: fleet.EngineReading{At: now.Add(time.Millisecond)}, instances: ins, want: true},
		{name: "one running", r0: fleet.EngineReading{At: now.Add(time.Second)}, r1: fleet.EngineReading{Running: 1, At: now.Add(time.Second)}, instances: ins},
		{name: "one waiting", r0: fleet.EngineReading{Waiting: 2, At: now.Add(time.Second)}, r1: fleet.EngineReading{At: now.Add(time.Second)}, instances: ins},
		{name: "one read before", r0: fleet.EngineReading{At: now.Add(time.Second)}, r1: fleet.EngineReading{At: now}, instances: ins},
		{name: "one never read", r0: fleet.EngineReading{At: now.Add(time.Second)}, none1: true, instances: ins},
		{name: "no instances", r0: fleet.EngineReading{At: now.Add(time.Second)}, r1: fleet.EngineReading{At: now.Add(time.Second)}},
	} {
		l := affinity.NewLoad()
		l.SetEngine("gpu-0", tc.r0)
		if !tc.none1 {
			l.SetEngine("gpu-1", tc.r1)
		}
		if got := l.EnginesIdle(tc.instances, now); got != tc.want {
			t.Errorf("%s: idle = %v, want %v", tc.name, got, tc.want)
		}
	}
}
