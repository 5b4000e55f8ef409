package discovery

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/reload"
	"github.com/tetherproxy/tether/store/memory"
)

var _ Sink = (*reload.Runtime)(nil)

// fileConfig is a file with one static instance and a group whose
// version is the static one's.
func fileConfig(t *testing.T) config.Config {
	t.Helper()
	c, err := config.Parse([]byte(`
[xds]
addr = ""
[[instances]]
name = "static"
address = "10.0.0.9:8000"
version = "v1"
[[discovery.dns]]
name = "vllm"
host = "` + host + `"
port = 8000
version = "v1"
`))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func fleetNames(rt *reload.Runtime) []string {
	var out []string
	for _, in := range rt.Fleet().All() {
		out = append(out, in.Name)
	}
	return out
}

// TestDiscoveredThroughReload: what DNS finds reaches the fleet through
// reload.Runtime, as a file change does; a file change keeps it; an
// address the file names is the file's; DNS gone wrong keeps the fleet.
func TestDiscoveredThroughReload(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	srv := testenv.StartDNS(t)
	cfg := fileConfig(t)
	rt := reload.New("127.0.0.1:1", nil, zerolog.Nop(), prometheus.NewRegistry())
	if _, err := rt.Apply(ctx, cfg, "start"); err != nil {
		t.Fatal(err)
	}
	g := cfg.Discovery.DNS[0]
	g.Interval = config.Dur(10 * time.Millisecond) // below the file's bound, for the test
	d := NewDNS([]config.DNSGroup{g}, Options{Resolver: srv.Resolver(), Sink: rt, Log: zerolog.Nop()}, prometheus.NewRegistry())
	done := make(chan struct{})
	go func() { defer close(done); d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	// 10.0.0.9 is the static instance's address: the file's wins.
	srv.Set(host, addrs("10.0.0.1", "10.0.0.2", "10.0.0.9")...)
	want := []string{"static", "vllm-10-0-0-1-8000", "vllm-10-0-0-2-8000"}
	waitFleet(t, rt, want)

	// A file change keeps the instances found.
	next := cfg
	next.Instances = slices.Clone(cfg.Instances)
	next.Instances[0].Weight = 2
	if _, err := rt.Apply(ctx, next, "file"); err != nil {
		t.Fatal(err)
	}
	if got := fleetNames(rt); !slices.Equal(got, want) {
		t.Errorf("after a file change: fleet %v, want %v", got, want)
	}
	if n := len(rt.Current().Instances); n != 1 {
		t.Errorf("Current holds %d instances, want the file's 1", n)
	}

	// DNS that answers nothing, then fails, never empties the fleet.
	srv.Set(host)
	waitLookups(t, srv, 20)
	srv.Fail(host, 2) // SERVFAIL
	waitLookups(t, srv, 20)
	if got := fleetNames(rt); !slices.Equal(got, want) {
		t.Errorf("after empty answers and failures: fleet %v, want %v", got, want)
	}

	srv.Set(host, addrs("10.0.0.2")...)
	waitFleet(t, rt, []string{"static", "vllm-10-0-0-2-8000"})
}

// TestDiscoveredButUnhealthy: an endpoint in DNS whose instance breaker
// is open is in the fleet and the Envoy resources, but takes no new
// session: its health is the breaker's to judge, as for an instance of the
// file. The instances are found before the start, as serve does.
func TestDiscoveredButUnhealthy(t *testing.T) {
	ctx := context.Background()
	cfg := fileConfig(t)
	cfg.Instances = nil
	rt := reload.New("127.0.0.1:1", nil, zerolog.Nop(), prometheus.NewRegistry())
	g := cfg.Discovery.DNS[0]
	group := &group{cfg: g, missed: map[netip.Addr]int{}}
	group.observe(addrs("10.0.0.1", "10.0.0.2"), nil)
	// Found before the start (DNS.Prime): the start applies it.
	if _, err := rt.Discover(ctx, g.Name, group.instances()); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.Apply(ctx, cfg, "start"); err != nil {
		t.Fatal(err)
	}
	sick := "vllm-10-0-0-1-8000"
	if _, ok := rt.Fleet().Lookup(sick); !ok {
		t.Fatalf("%s not in the fleet", sick)
	}
	p := rt.Plan()
	breaker := fleet.NewBreaker(p.Breaker, nil, nil)
	breaker.Opened(sick, time.Now().Add(time.Hour))
	dec := plan.NewDecider(p, rt.Fleet(), plan.Deps{Store: memory.New(), Breaker: breaker})
	for i := range 50 {
		req := affinity.Request{ID: identity.Identity{Key: fmt.Sprintf("s:%d", i), Source: identity.SourceSession}}
		got, err := dec.Decide(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if got.Instance.Name == sick {
			t.Fatalf("session %d placed on %s, whose breaker is open", i, sick)
		}
	}
}

func waitFleet(t *testing.T, rt *reload.Runtime, want []string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !slices.Equal(fleetNames(rt), want) {
		if time.Now().After(deadline) {
			t.Fatalf("fleet %v, want %v", fleetNames(rt), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitLookups waits until the server answered n more queries.
func waitLookups(t *testing.T, srv *testenv.DNS, n int) {
	t.Helper()
	from := srv.Queries()
	deadline := time.Now().Add(10 * time.Second)
	for srv.Queries() < from+n {
		if time.Now().After(deadline) {
			t.Fatalf("%d queries in 10s, want %d", srv.Queries()-from, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestNothingFoundAtStart: a start with no instance, in the file or found,
// is refused.
func TestNothingFoundAtStart(t *testing.T) {
	cfg := fileConfig(t)
	cfg.Instances = nil
	rt := reload.New("127.0.0.1:1", nil, zerolog.Nop(), prometheus.NewRegistry())
	if _, err := rt.Apply(context.Background(), cfg, "start"); err == nil || !strings.Contains(err.Error(), "found none yet") {
		t.Fatalf("err = %v, want the start refused", err)
	}
}
