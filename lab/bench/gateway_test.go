package bench

import (
	"strings"
	"testing"
	"time"
)

// TestGatewayOrder: every round has each configuration once, and each
// configuration goes first in some round and last in another.
func TestGatewayOrder(t *testing.T) {
	sides := make([]*gatewaySide, len(gatewayConfigs))
	for i := range sides {
		sides[i] = &gatewaySide{}
	}
	first, last := map[*gatewaySide]bool{}, map[*gatewaySide]bool{}
	for r := 0; r < pairedRounds; r++ {
		order := gatewayOrder(sides, r)
		seen := map[*gatewaySide]bool{}
		for _, s := range order {
			if s == nil || seen[s] {
				t.Fatalf("round %d: order %v is not a permutation", r, order)
			}
			seen[s] = true
		}
		first[order[0]], last[order[len(order)-1]] = true, true
	}
	if len(first) != len(sides) || len(last) != len(sides) {
		t.Errorf("over %d rounds %d configurations went first and %d last, of %d", pairedRounds, len(first), len(last), len(sides))
	}
}

// TestGatewayBootstrap: the ext_proc filter streams both bodies with the
// trailers sent, lets the picker write envoy.lb, and is left out for
// Envoy alone; the pool lists every endpoint behind override_host.
func TestGatewayBootstrap(t *testing.T) {
	eps := []string{"127.0.0.1:1001", "127.0.0.1:1002"}
	b, err := gatewayBootstrap("127.0.0.1:9000", bodiesDuplex, eps)
	if err != nil {
		t.Fatal(err)
	}
	y := string(b)
	for _, want := range []string{"request_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: FULL_DUPLEX_STREAMED",
		"request_trailer_mode: SEND", "response_trailer_mode: SEND", "receiving_namespaces: {untyped: [envoy.lb]}",
		"port_value: 9000", "port_value: 1001", "port_value: 1002", "envoy.load_balancing_policies.override_host"} {
		if !strings.Contains(y, want) {
			t.Errorf("bootstrap lacks %q:\n%s", want, y)
		}
	}
	b, err = gatewayBootstrap("", "", eps)
	if err != nil {
		t.Fatal(err)
	}
	if y := string(b); strings.Contains(y, "ext_proc") || !strings.Contains(y, "override_host") {
		t.Errorf("Envoy alone's bootstrap:\n%s", y)
	}
}

// TestGatewayGoals: the goals compare tether streaming with the picker
// streaming, per body size, and the report renders them.
func TestGatewayGoals(t *testing.T) {
	row := func(c gatewayConfig, n int, serial, p50 time.Duration, requests int64) GatewayRow {
		return GatewayRow{Name: c.name, Router: c.router, Bodies: c.bodies, BodyBytes: n, SerialP50: serial, P50: p50,
			Rate: 300, Requests: requests, Took: 10 * time.Second, RoundThroughputs: []float64{1, 2}}
	}
	ms := time.Millisecond
	r := &Report{Started: time.Unix(0, 0), Scale: Smoke}
	for _, n := range gatewayBodySizes {
		for _, c := range gatewayConfigs {
			r.Gateway = append(r.Gateway, row(c, n, ms, ms, 1000))
		}
	}
	// 32 KB: tether 0.15 ms slower in the open loop, 0.85× the throughput.
	for i := range r.Gateway {
		if g := &r.Gateway[i]; g.Name == gatewayTetherDuplex.name && g.BodyBytes == 32<<10 {
			g.P50, g.Requests = ms+150*time.Microsecond, 850
		}
	}
	goals := r.GatewayGoals()
	if len(goals) != 6 {
		t.Fatalf("%d goals, want 6: %+v", len(goals), goals)
	}
	for i, wantReached := range []bool{true, true, true, true, false, false} {
		if goals[i].Reached != wantReached {
			t.Errorf("goal %d %s, %s: reached %v, want %v", i, goals[i].Path, goals[i].What, goals[i].Reached, wantReached)
		}
	}
	md := r.Markdown(Meta{Command: "x"}, nil)
	for _, want := range []string{"### Behind a gateway", "tether over the stateless picker, bodies streamed", "| tether behind Istio's gateway, 32 KB (32768 B) bodies | throughput vs the stateless picker | ≥ 0.90× | 0.85× | no |"} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}
}
