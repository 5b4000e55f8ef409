//go:build e2e

package e2e

import (
	"sync"
	"testing"

	"github.com/tetherproxy/tether/internal/testenv"
)

// TestFailOpenAgreesWithTether: sessions bound through tether keep their
// instance when every tether replica is down. tether places a new session
// where Envoy's fail-open pool (RING_HASH on the identity headers, its
// endpoints keyed by instance name) would send it, so when the ext_proc
// calls fail and the default route carries the next turn, Envoy's ring
// picks the instance tether bound. Reports the share per identity kind;
// the goal is 90% for session ids and bearer tokens on four instances
// (30% before tether computed Envoy's choice; chance is 25%), with equal
// weights and with weights 1, 1, 2, 4 (the pool's endpoints then carry
// load_balancing_weights and both rings are Envoy's weighted ring).
func TestFailOpenAgreesWithTether(t *testing.T) {
	for _, tt := range []struct {
		name    string
		weights []float64
	}{
		{"equal weights", nil},
		{"weights 1,1,2,4", []float64{1, 1, 2, 4}},
	} {
		t.Run(tt.name, func(t *testing.T) { failOpenAgreement(t, tt.name, tt.weights) })
	}
}

// failOpenAgreement is TestFailOpenAgreesWithTether on four instances
// with the given weights (nil: the default, 1 each).
func failOpenAgreement(t *testing.T, name string, weights []float64) {
	const sessions = 200
	rds := testenv.RedisServer(t)
	inst := startFleet(t, 4)
	for i, w := range weights {
		inst[i].Weight = w
	}
	cfg := baseConfig(rds.URL(), inst)
	a, b := startTether(t, cfg), startTether(t, cfg)
	px := startEnvoy(t, cfg, a.extproc, b.extproc)

	bound := make([][]string, len(identities))
	for k, id := range identities {
		bound[k] = make([]string, sessions)
		parallel(sessions, 4, func(i int) {
			ans := chat(t, px, id.headers(i))
			if ans.status != 200 || ans.decision != "bind" || ans.instance == "" {
				t.Errorf("%s %d: first turn %+v, want a bind through tether", id.name, i, ans)
			}
			bound[k][i] = ans.instance
		})
	}
	if t.Failed() {
		t.FailNow()
	}
	overrides := a.metric(t, "tether_failopen_overrides_total") + b.metric(t, "tether_failopen_overrides_total")

	a.Stop()
	b.Stop()

	for k, id := range identities {
		var mu sync.Mutex
		same, bypassed := 0, 0
		per := map[string]int{}
		parallel(sessions, 4, func(i int) {
			ans := chat(t, px, id.headers(i))
			if ans.status != 200 {
				t.Errorf("%s %d: next turn with tether down: status %d", id.name, i, ans.status)
			}
			mu.Lock()
			defer mu.Unlock()
			if ans.decision == "" {
				bypassed++
			}
			per[ans.instance]++
			if ans.instance == bound[k][i] {
				same++
			}
		})
		share := float64(same) / sessions
		t.Logf("fail-open agreement, %s, %s: %d/%d sessions (%.0f%%) reached their bound instance with every tether replica stopped (%d bypassed tether; spread %v)",
			name, id.name, same, sessions, 100*share, bypassed, per)
		if bypassed != sessions {
			t.Errorf("%s: %d of %d next turns bypassed tether: the replicas are not down", id.name, bypassed, sessions)
		}
		if id.name != "device and user" && share < 0.9 {
			t.Errorf("%s: %.0f%% of sessions kept their instance through the fail-open route, want at least 90%%", id.name, 100*share)
		}
	}
	t.Logf("fail-open overrides (bounded load or a full KV cache passed over the pool's choice): %.0f of %d binds", overrides, sessions*len(identities))
}
