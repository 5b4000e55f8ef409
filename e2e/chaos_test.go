//go:build e2e

package e2e

// Chaos scenarios (issue 6): under a steady, bounded load of about 200
// requests/s through real Envoy, one part of the stack fails and comes
// back. Each scenario prints its figures and checks, from Redis itself,
// that every binding present before the fault is afterwards intact or
// moved for a counted reason (chaos_harness_test.go). Run them with
//
//	TETHER_CHAOS_OUT=chaos.txt go test -race -tags e2e -run TestChaos ./e2e/ -v

import (
	"context"
	"fmt"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/config"
)

// TestChaosChecker: the checker tells intact, moved for a reason, lost and
// unexplained apart, so the scenarios' "nothing lost" can fail.
func TestChaosChecker(t *testing.T) {
	since := time.Unix(1000, 0)
	after := since.Add(time.Second)
	keys := []string{"k0", "k1"}
	rec := func(at time.Time, decision, instance string) chaosRecord {
		return chaosRecord{at: at, session: 0, status: 200, decision: decision, tethered: instance, instance: instance}
	}
	tests := []struct {
		name  string
		after bindingSnapshot
		recs  []chaosRecord
		want  string // intact, lost, unexplained or the moving kind
	}{
		{"same instance", bindingSnapshot{"k0": "a"}, []chaosRecord{rec(after, "hit", "a")}, "intact"},
		{"same instance, no answers", bindingSnapshot{"k0": "a"}, nil, "intact"},
		{"moved, and an answer says so", bindingSnapshot{"k0": "b"}, []chaosRecord{rec(after, "moved", "b"), rec(after, "hit", "b")}, "moved"},
		{"failover, a kind still to come", bindingSnapshot{"k0": "b"}, []chaosRecord{rec(after, "failover", "b")}, "failover"},
		{"moved, no answer says why", bindingSnapshot{"k0": "b"}, []chaosRecord{rec(after, "hit", "b")}, "unexplained"},
		{"moved elsewhere than the answer says", bindingSnapshot{"k0": "c"}, []chaosRecord{rec(after, "moved", "b")}, "unexplained"},
		{"the reason came before the fault", bindingSnapshot{"k0": "b"}, []chaosRecord{rec(since.Add(-time.Second), "moved", "b")}, "unexplained"},
		{"the reason's answer failed", bindingSnapshot{"k0": "b"}, []chaosRecord{{at: after, status: 503, decision: "moved", tethered: "b"}}, "unexplained"},
		{"gone", bindingSnapshot{}, []chaosRecord{rec(after, "degraded", "a")}, "lost"},
		{"bound anew on the same instance", bindingSnapshot{"k0": "a"}, []chaosRecord{rec(after, "bind", "a"), rec(after, "hit", "a")}, "lost"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v := checkBindings(bindingSnapshot{"k0": "a"}, tc.after, tc.recs, keys, since, nil)
			got := ""
			switch {
			case v.Checked != 1:
				t.Fatalf("checked %d bindings, want 1", v.Checked)
			case v.Intact == 1:
				got = "intact"
			case v.Lost == 1:
				got = "lost"
			case v.Unexplained == 1:
				got = "unexplained"
			case len(v.Moved) == 1:
				for k := range v.Moved {
					got = k
				}
			}
			if got != tc.want || v.ok() != (got != "lost" && got != "unexplained") {
				t.Errorf("verdict %v (ok %v), want %s", v, v.ok(), tc.want)
			}
		})
	}
	// A binding no driver session owns has no answers to explain a move.
	if v := checkBindings(bindingSnapshot{"other": "a"}, bindingSnapshot{"other": "b"}, nil, keys, since, nil); v.Unexplained != 1 {
		t.Errorf("a stranger's binding moved: %v, want unexplained", v)
	}
	if v := checkBindings(bindingSnapshot{}, bindingSnapshot{}, nil, keys, since, nil); v.ok() {
		t.Error("an empty snapshot passes: the check would prove nothing")
	}
}

// hitOnly: a session has recovered when tether finds its binding again.
func hitOnly(r chaosRecord) bool { return !r.failed() && r.decision == "hit" }

// TestChaosEnvoyRestart: Envoy is killed (SIGKILL) and a new one started
// on the same listener port while the load runs. The requests of the gap
// fail with transport errors and are counted; no binding changes, and
// afterwards every session hits its instance again.
func TestChaosEnvoyRestart(t *testing.T) {
	s := startChaosStack(t, chaosOptions{})
	var down time.Duration
	res := s.runChaos(t, chaosPlan{
		Fault: func(t *testing.T, _ *loadDriver) {
			began := time.Now()
			s.KillEnvoy()
			s.RestartEnvoy()
			down = time.Since(began)
		},
		Recovered: hitOnly,
	})
	res.report(t, "envoy-restart", fmt.Sprintf("envoy_down=%v", down.Round(time.Millisecond)))
	res.requireNothingLost(t)
	b, d, a := res.Phases[phaseBefore], res.Phases[phaseDuring], res.Phases[phaseAfter]
	if b.Failed+a.Failed > 0 {
		t.Errorf("failed requests with Envoy up: %d before, %d after: %s %s", b.Failed, a.Failed, res.failures(phaseBefore), res.failures(phaseAfter))
	}
	if d.Transport == 0 {
		t.Errorf("no transport error while Envoy was down for %v: the fault did not happen", down)
	}
	if d.Failed != d.Transport {
		t.Errorf("during the restart %d requests failed, %d of them with transport errors; the rest: %s", d.Failed, d.Transport, res.failures(phaseDuring))
	}
	if res.Verdict.Intact != res.Verdict.Checked {
		t.Errorf("an Envoy restart moved bindings: %v", res.Verdict)
	}
	if a.Decisions["hit"] != a.Requests || len(res.OffBinding) > 0 {
		t.Errorf("after the restart: decisions %v of %d requests, off their binding %v; want every one a hit on its instance",
			a.Decisions, a.Requests, res.OffBinding)
	}
}

// TestChaosTetherReplicaKilled: of two tether replicas sharing one
// redis-server, both in Envoy's ext_proc cluster, one is killed (SIGKILL),
// left dead for 5 s, then started again on its address. Envoy goes on
// without tether (failure_mode_allow) for the requests it sends to the dead
// replica; those bypass tether and take the default route.
func TestChaosTetherReplicaKilled(t *testing.T) {
	s := startChaosStack(t, chaosOptions{Tethers: 2})
	const down = 5 * time.Second
	var decided float64
	res := s.runChaos(t, chaosPlan{
		Fault: func(t *testing.T, load *loadDriver) {
			decided = s.Tethers[1].metric(t, "tether_requests_total")
			s.KillTether(1)
			load.keepRunning(t, down)
			s.RestartTether(1)
		},
	})
	// Bypassed answers during the fault that another instance than the
	// session's binding served: the cost of the dead replica.
	offDuring := 0
	for _, r := range res.Records {
		if r.phase == phaseDuring && !r.failed() && r.decision == "" && r.instance != res.Before[res.Keys[r.session]] {
			offDuring++
		}
	}
	d, a := res.Phases[phaseDuring], res.Phases[phaseAfter]
	res.report(t, "tether-replica-killed",
		fmt.Sprintf("killed_replica_decided_before=%.0f", decided),
		fmt.Sprintf("bypassed_share_during=%.0f%%", 100*float64(d.Bypassed)/float64(max(d.Requests, 1))),
		fmt.Sprintf("bypassed_off_binding_during=%d", offDuring))
	res.requireNothingLost(t)
	if decided == 0 {
		t.Fatal("the killed replica had decided no request: the fault changed nothing")
	}
	for p := range phases {
		if f := res.Phases[p].Failed; f > 0 {
			t.Errorf("%d requests failed %s the kill (failure_mode_allow and the default route should carry them): %s", f, p, res.failures(p))
		}
	}
	if d.Bypassed == 0 {
		t.Errorf("no request bypassed tether while a replica was dead for %v: the fault did not reach Envoy", down)
	}
	if res.Verdict.Intact != res.Verdict.Checked {
		t.Errorf("a replica's death moved bindings: %v", res.Verdict)
	}
	if a.Bypassed > 0 || len(res.OffBinding) > 0 {
		t.Errorf("after the replica came back: %d requests bypassed tether, off their binding %v", a.Bypassed, res.OffBinding)
	}
}

// TestChaosTetherReplicaStopped: a rolling update's stop. One of two
// replicas gets SIGTERM mid-load and is started again 3 s after it exits.
// For server.drain_delay (the default 2 s) it reports NOT_SERVING but
// keeps deciding, so Envoy's health checks take it out before its port
// closes: no request skips tether and none fails.
func TestChaosTetherReplicaStopped(t *testing.T) {
	s := startChaosStack(t, chaosOptions{Tethers: 2, Configure: func(c *config.Config) {
		c.Server.DrainDelay = config.Dur(config.DefaultDrainDelay)
	}})
	var decided float64
	var took time.Duration
	res := s.runChaos(t, chaosPlan{
		Fault: func(t *testing.T, load *loadDriver) {
			decided = s.Tethers[1].metric(t, "tether_requests_total")
			began := time.Now()
			s.Tethers[1].Stop()
			took = time.Since(began)
			load.keepRunning(t, 3*time.Second)
			s.RestartTether(1)
		},
	})
	d := res.Phases[phaseDuring]
	res.report(t, "tether-replica-stopped",
		fmt.Sprintf("drain_delay=%v", s.Config.Server.DrainDelay.D),
		fmt.Sprintf("stopped_replica_decided_before=%.0f", decided),
		fmt.Sprintf("sigterm_to_exit=%v", took.Round(10*time.Millisecond)),
		fmt.Sprintf("bypassed_during=%d_of_%d", d.Bypassed, d.Requests))
	res.requireNothingLost(t)
	if decided == 0 {
		t.Fatal("the stopped replica had decided no request: the fault changed nothing")
	}
	if took < s.Config.Server.DrainDelay.D {
		t.Errorf("the replica exited %v after SIGTERM, before its %v drain delay", took, s.Config.Server.DrainDelay.D)
	}
	for p := range phases {
		if f := res.Phases[p].Failed; f > 0 {
			t.Errorf("%d requests failed %s the stop: %s", f, p, res.failures(p))
		}
		if b := res.Phases[p].Bypassed; b > 0 {
			t.Errorf("%d requests bypassed tether %s the stop: Envoy sent streams to a closed port", b, p)
		}
	}
	if res.Verdict.Intact != res.Verdict.Checked || len(res.OffBinding) > 0 {
		t.Errorf("a replica's stop moved bindings: %v, off their binding %v", res.Verdict, res.OffBinding)
	}
}

// TestChaosRedisOutage: the redis-server is killed (SIGKILL) for 10 s and
// started again with its data (an append-only file, see KillRedis).
// No request fails: tether places by rendezvous hashing meanwhile
// ("degraded"). Afterwards the bindings are back and every session is
// intact or moved for a counted reason.
func TestChaosRedisOutage(t *testing.T) {
	s := startChaosStack(t, chaosOptions{})
	const outage = 10 * time.Second
	var down time.Duration
	res := s.runChaos(t, chaosPlan{
		Fault: func(t *testing.T, load *loadDriver) {
			began := time.Now()
			s.KillRedis()
			load.keepRunning(t, outage)
			s.StartRedis()
			down = time.Since(began)
		},
	})
	// The rendezvous share: of the sessions answered "degraded" during the
	// outage, those whose every degraded answer came from the instance
	// they were bound to before it.
	degradedOn := map[int]map[string]bool{}
	for _, r := range res.Records {
		if r.phase == phaseDuring && !r.failed() && r.decision == "degraded" {
			if degradedOn[r.session] == nil {
				degradedOn[r.session] = map[string]bool{}
			}
			degradedOn[r.session][r.instance] = true
		}
	}
	same, split := 0, 0
	for sess, on := range degradedOn {
		if len(on) > 1 {
			split++
		}
		if len(on) == 1 && on[res.Before[res.Keys[sess]]] {
			same++
		}
	}
	share := float64(same) / float64(max(len(degradedOn), 1))
	d := res.Phases[phaseDuring]
	res.report(t, "redis-outage",
		fmt.Sprintf("redis_down=%v", down.Round(10*time.Millisecond)),
		fmt.Sprintf("degraded_sessions=%d", len(degradedOn)),
		fmt.Sprintf("rendezvous_share=%.1f%%", 100*share),
		fmt.Sprintf("sessions_on_two_instances_during=%d", split),
		fmt.Sprintf("bindings_after=%d", len(res.After)))
	res.requireNothingLost(t)
	for p := range phases {
		if f := res.Phases[p].Failed; f > 0 {
			t.Errorf("%d requests failed %s the Redis outage: %s", f, p, res.failures(p))
		}
	}
	if d.Decisions["degraded"] == 0 || len(degradedOn) < len(res.Keys)/2 {
		t.Errorf("during a %v Redis outage: decisions %v, %d sessions degraded; tether did not notice the outage", outage, d.Decisions, len(degradedOn))
	}
	if split > 0 {
		t.Errorf("%d sessions were placed on two instances during the outage: rendezvous placement should be stable", split)
	}
	if len(res.OffBinding) > 0 {
		t.Errorf("after Redis came back, answers off their binding: %v", res.OffBinding)
	}
}

// TestChaosClusterMasterKilled: tether runs on a Redis Cluster of three
// masters with a replica each (redis+cluster://). One master is killed
// (SIGKILL) mid-load; its replica takes over after the node timeout (1 s).
// No request fails, no binding is lost (the replica holds the killed
// master's bindings), and every session is back on its binding within the
// recovery timeout: a dead master sends no MOVED, so the store asks the
// client to reload the slot map whenever a call fails.
func TestChaosClusterMasterKilled(t *testing.T) {
	clusterScenario(t, "cluster-master-killed", (*chaosStack).KillClusterMaster, false)
}

// TestChaosClusterFailover: as TestChaosClusterMasterKilled, but the master
// hands its slots to its replica (CLUSTER FAILOVER, as for maintenance):
// tether follows at once, every session is back on its binding within the
// recovery timeout.
func TestChaosClusterFailover(t *testing.T) {
	clusterScenario(t, "cluster-failover", (*chaosStack).FailoverClusterMaster, false)
}

func clusterScenario(t *testing.T, name string, fault func(*chaosStack) (string, string), slow bool) {
	s := startChaosStack(t, chaosOptions{Cluster: true})
	var victim, promoted string
	var onVictim int
	var took time.Duration
	res := s.runChaos(t, chaosPlan{
		Fault: func(t *testing.T, _ *loadDriver) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			masters, err := s.Cluster.Masters(ctx)
			if err != nil {
				t.Fatal(err)
			}
			onVictim = countBindings(t, ctx, masters[0])
			began := time.Now()
			victim, promoted = fault(s)
			took = time.Since(began)
			if victim != masters[0] {
				t.Fatalf("the fault hit %s, bindings counted on %s", victim, masters[0])
			}
		},
		SlowRecovery:    slow,
		RecoveryTimeout: 15 * time.Second,
	})
	res.report(t, name,
		fmt.Sprintf("bindings_on_old_master=%d", onVictim),
		fmt.Sprintf("promotion=%v", took.Round(10*time.Millisecond)))
	t.Logf("master %s replaced by its replica %s after %v; %d sessions not back on their binding %v after that",
		victim, promoted, took.Round(time.Millisecond), res.Unrecovered, 15*time.Second)
	res.requireNothingLost(t)
	for p := range phases {
		if f := res.Phases[p].Failed; f > 0 {
			t.Errorf("%d requests failed %s the failover: %s", f, p, res.failures(p))
		}
	}
	if onVictim == 0 {
		t.Error("the old master held no binding: the check proves nothing")
	}
	if res.Unrecovered > onVictim {
		t.Errorf("%d sessions had not recovered %v after the failover, more than the %d bound through the old master: the fault spread to healthy masters' slots",
			res.Unrecovered, 15*time.Second, onVictim)
	}
	if !slow && len(res.OffBinding) > 0 {
		t.Errorf("after the failover, answers off their binding: %v", res.OffBinding)
	}
}

// countBindings counts the bindings on one cluster node.
func countBindings(t *testing.T, ctx context.Context, addr string) int {
	t.Helper()
	node := goredis.NewClient(&goredis.Options{Addr: addr, ContextTimeoutEnabled: true})
	defer node.Close()
	n := 0
	iter := node.Scan(ctx, 0, "tether:{*}:b", 500).Iterator()
	for iter.Next(ctx) {
		n++
	}
	if err := iter.Err(); err != nil {
		t.Fatalf("scan %s: %v", addr, err)
	}
	return n
}

// TestChaosInstanceKilled: one emulated instance is killed (its listener
// and every connection closed) mid-load, and restored. tether's breaker
// counts its failures: Envoy's 503s for the refused connections, and the
// answers Envoy got from a peer when it retried there (the response
// phase's upstream.address names the peer). Past failure_threshold the
// circuit opens, the replica that opened it moves the instance's sessions
// down the fallback ladder (same zone first) before their next turn, and
// sessions it has not reached move at their next request ("failover").
// Every other session stays where it was. Restored, the instance takes new
// sessions again once a probe after the cooldown succeeds.
//
// It runs with Envoy's default retry on a peer (the client sees the
// peer's answer) and with retries off (the client sees the failures the
// breaker needs before it opens); and with each way outcomes reach tether
// (envoy.outcomes): the breaker, the in-flight counts and the failover
// work the same whether the response comes on the routing stream, an
// observing filter's or the access log.
func TestChaosInstanceKilled(t *testing.T) {
	for _, c := range []struct {
		retries  uint32
		outcomes string
	}{{1, "access_log"}, {0, "access_log"}, {1, "observe"}, {1, "inline"}} {
		t.Run(fmt.Sprintf("retries=%d/outcomes=%s", c.retries, c.outcomes), func(t *testing.T) { instanceKilled(t, c.retries, c.outcomes) })
	}
}

func instanceKilled(t *testing.T, retries uint32, outcomes string) {
	const cooldown = 3 * time.Second
	s := startChaosStack(t, chaosOptions{Configure: func(c *config.Config) {
		c.Envoy.Retries = retries
		c.Envoy.Outcomes = outcomes
		c.Routing.FailureCooldown = config.Duration{D: cooldown}
		// Envoy ejects the dead host too (consecutive gateway failures) and
		// then sends its cluster's requests to a peer: through Envoy the
		// instance is back only when the ejection ends, so tether's probe
		// fails until then. Shortened from 30 s to keep the test short.
		c.OutlierDetection.BaseEjectionTime = &config.Duration{D: cooldown}
	}})
	tt := s.Tethers[0]
	victim := s.Instances[0].Name
	state := func() float64 {
		return tt.metric(t, "tether_instance_breaker_state", `upstream="`+victim+`"`)
	}
	var opened, restoredAt time.Duration
	res := s.runChaos(t, chaosPlan{
		Fault: func(t *testing.T, load *loadDriver) {
			began := time.Now()
			s.KillInstance(victim)
			waitFor(t, 15*time.Second, "the breaker to open", func() bool { return state() == 1 })
			opened = time.Since(began)
			load.keepRunning(t, 2*time.Second) // serve the moved sessions elsewhere a while
			s.RestartInstance(victim)
			restoredAt = time.Since(began)
		},
		// A session moved before its next turn shows no move in its
		// answers: counted by tether_sessions_evacuated_total, checked below.
		Explain: func(_, was, _ string) string {
			if was == victim {
				return "evacuated"
			}
			return ""
		},
	})

	// The bindings, by hand: the sessions of the victim must have left it,
	// each explained by a failover answer or by the evacuation count; every
	// other session must be where it was.
	failedOver := map[string]bool{}
	for _, r := range res.Records {
		if !r.failed() && r.at.After(res.FaultAt) && r.decision == "failover" {
			failedOver[res.Keys[r.session]] = true
		}
	}
	evacuated := int(tt.metric(t, "tether_sessions_evacuated_total", `upstream="`+victim+`"`))
	onVictim, movedByFailover, movedAhead, stayed, lost, otherMoved := 0, 0, 0, 0, 0, 0
	sameZone := 0
	zone := map[string]string{}
	for _, in := range s.Instances {
		zone[in.Name] = in.Zone
	}
	for _, key := range res.Keys {
		before, ok := res.Before[key]
		after, ok2 := res.After[key]
		switch {
		case !ok:
			continue
		case !ok2:
			lost++
		case before == victim && after == victim:
			stayed++
		case before == victim:
			onVictim++
			if zone[after] == zone[victim] {
				sameZone++
			}
			if failedOver[key] {
				movedByFailover++
			} else {
				movedAhead++
			}
		case after != before:
			otherMoved++
		}
	}
	d := res.Phases[phaseDuring]
	peerAnswers := 0
	for _, r := range res.Records {
		if r.phase == phaseDuring && !r.failed() && r.tethered == victim && r.instance != victim {
			peerAnswers++
		}
	}
	res.report(t, fmt.Sprintf("instance-killed(retries=%d,outcomes=%s)", retries, outcomes),
		fmt.Sprintf("breaker_open_after=%v", opened.Round(time.Millisecond)),
		fmt.Sprintf("restored_after=%v", restoredAt.Round(time.Millisecond)),
		fmt.Sprintf("sessions_on_victim=%d", onVictim+stayed),
		fmt.Sprintf("moved_ahead=%d", movedAhead),
		fmt.Sprintf("moved_at_next_turn=%d", movedByFailover),
		fmt.Sprintf("evacuated_metric=%d", evacuated),
		fmt.Sprintf("moved_same_zone=%d", sameZone),
		fmt.Sprintf("answered_by_peer_during=%d", peerAnswers),
		fmt.Sprintf("other_sessions_moved=%d", otherMoved))
	if lost > 0 || stayed > 0 || otherMoved > 0 {
		t.Errorf("bindings: %d lost, %d still on the dead instance, %d other sessions moved", lost, stayed, otherMoved)
	}
	if onVictim == 0 {
		t.Fatal("no session was bound to the victim: the scenario proves nothing")
	}
	if movedAhead > evacuated {
		t.Errorf("%d sessions left the victim without a failover answer, but only %d were evacuated", movedAhead, evacuated)
	}
	if sameZone != onVictim {
		t.Errorf("%d of %d moved sessions stayed in the victim's zone; the ladder goes to the same zone first while it has room", sameZone, onVictim)
	}
	// Failed requests: at most the threshold's worth (plus one) of
	// failures before the circuit opened, plus those in flight at the kill.
	threshold := s.Config.Routing.FailureThreshold
	if limit := threshold + 1 + 64; d.Failed > limit {
		t.Errorf("%d requests failed during the fault, more than threshold+1 plus those in flight (%d): %s", d.Failed, limit, res.failures(phaseDuring))
	}
	if f := res.Phases[phaseBefore].Failed + res.Phases[phaseAfter].Failed; f > 0 {
		t.Errorf("%d requests failed outside the fault", f)
	}

	// Restored: after the cooldown a probe closes the circuit and new
	// sessions land on the victim again.
	time.Sleep(cooldown)
	landed := 0
	for i := range 200 {
		a := chat(t, s.Proxy(), map[string]string{"x-session-id": fmt.Sprint("after-restore-", i)})
		if a.status == 200 && a.tethered == victim && a.instance == victim {
			landed++
		}
	}
	if landed == 0 || state() != 0 {
		t.Errorf("after restore: %d of 200 new sessions on %s, breaker state %v; want some, and closed (0)", landed, victim, state())
	}
	t.Logf("after restore: %d of 200 new sessions placed on %s", landed, victim)

	// Every request's end was heard, once: nothing is left in flight, and
	// reported apart, every report carried a ticket this deployment
	// signed, applied once (a decision tether did not make has none).
	waitFor(t, 10*time.Second, "no request left in flight", func() bool { return tt.metric(t, "tether_instance_in_flight") == 0 })
	applied := tt.metric(t, "tether_outcomes_total", `result="applied"`)
	refused := tt.metric(t, "tether_outcomes_total") - applied - tt.metric(t, "tether_outcomes_total", `result="undecided"`)
	t.Logf("outcomes: %v applied, %v refused", applied, refused)
	if apart := outcomes != "inline"; apart && (applied < float64(len(res.Records)) || refused != 0) || !apart && applied != 0 {
		t.Errorf("outcomes %s: %v applied for %d requests, %v refused (malformed, forged, late or duplicate)", outcomes, applied, len(res.Records), refused)
	}
}
