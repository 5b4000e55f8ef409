package plan

import (
	"fmt"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/ringhash"
	"github.com/tetherproxy/tether/xds"
)

func TestFailOpenIsThePoolsRing(t *testing.T) {
	spec := xds.Spec{PoolLB: xds.RingHash, HashPolicy: []xds.HashHeader{
		{Name: "x-session-id", Terminal: true}, {Name: "authorization", Terminal: true},
		{Name: "x-device-id"}, {Name: "x-user-id", Terminal: true},
	}}
	all := []fleet.Instance{
		{Name: "a", Version: "v1"}, {Name: "b", Version: "v1"}, {Name: "old", Version: "v0"},
		{Name: "c", Version: "v1"}, {Name: "d", Version: "v1"},
	}
	pool := []string{"a", "b", "c", "d"} // v1 has the most instances: the default pool
	ring := ringhash.New(pool, 0)
	f := failOpen(spec)
	for _, s := range []string{"s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8"} {
		got, ok := f(identity.Map{"x-session-id": s}, all)
		if want := pool[ring.Pick(xxhash.Sum64String(s))]; !ok || got != want {
			t.Errorf("session %s: %q, %v; want %q", s, got, ok, want)
		}
	}
	if _, ok := f(identity.Map{"user-agent": "curl"}, all); ok {
		t.Error("no hashed header: the pool picks at random, want ok false")
	}
	if _, ok := f(nil, all); ok {
		t.Error("no headers: want ok false")
	}
	spec.DefaultVersion = "v0"
	if got, _ := failOpen(spec)(identity.Map{"x-session-id": "s1"}, all); got != "old" {
		t.Errorf("default_version v0: %q, want old", got)
	}
	weighted := append([]fleet.Instance(nil), all...)
	for i, w := range []float64{1, 1, 7, 2, 4} { // a, b, old, c, d
		weighted[i].Weight = w
	}
	if got, ok := failOpen(spec)(identity.Map{"x-session-id": "s1"}, weighted); !ok || got != "old" {
		t.Errorf("weights differ outside the pool (v0): %q, %v; want old", got, ok)
	}
	spec.DefaultVersion = ""
	// Within the pool: Envoy's weighted ring over weights 1, 1, 2, 4.
	wring := ringhash.NewWeighted(pool, []uint32{1, 1, 2, 4}, 0)
	f = failOpen(spec)
	moved := 0
	for i := range 200 {
		s := fmt.Sprintf("s%d", i)
		got, ok := f(identity.Map{"x-session-id": s}, weighted)
		if want := pool[wring.Pick(xxhash.Sum64String(s))]; !ok || got != want {
			t.Fatalf("weighted pool, session %s: %q, %v; want %q", s, got, ok, want)
		}
		if got != pool[ring.Pick(xxhash.Sum64String(s))] {
			moved++
		}
	}
	if moved == 0 {
		t.Error("weights 1, 1, 2, 4 place every session as equal weights do: weights ignored")
	}
	// One pool per fleet snapshot: a session of a snapshot allocates
	// nothing, and a new snapshot (the same instances, other weights)
	// gets its own ring.
	h := identity.Map{"x-session-id": "s1"}
	f(h, weighted)
	if n := testing.AllocsPerRun(100, func() { f(h, weighted) }); n != 0 {
		t.Errorf("a session of a known snapshot allocates %v times, want 0", n)
	}
	for i := range 200 {
		s := fmt.Sprintf("s%d", i)
		got, _ := f(identity.Map{"x-session-id": s}, all)
		if want := pool[ring.Pick(xxhash.Sum64String(s))]; got != want {
			t.Fatalf("back to equal weights, session %s: %q; want %q", s, got, want)
		}
	}
	spec.PoolLB = xds.LeastRequest
	if failOpen(spec) != nil {
		t.Error("a pool that does not hash: want no fail-open choice")
	}
}
