package discovery

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/testenv"
)

const host = "vllm.tether.test."

// sink records what it is handed, and refuses while refuse is set.
type sink struct {
	mu     sync.Mutex
	calls  [][]string // the names handed, call by call
	refuse error
}

func (s *sink) Discover(_ context.Context, _ string, found []config.Instance) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	names := []string{}
	for _, in := range found {
		names = append(names, in.Name)
	}
	s.calls = append(s.calls, names)
	return "v", s.refuse
}

// last returns how many calls the sink had and the names of the last.
func (s *sink) last() (int, []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.calls) == 0 {
		return 0, nil
	}
	return len(s.calls), s.calls[len(s.calls)-1]
}

func testGroup() config.DNSGroup {
	return config.DNSGroup{Name: "vllm", Host: host, Port: 8000, Interval: config.Dur(time.Second),
		RemoveAfter: 3, Version: "v1", Weight: 1, KVSessions: 20, Capacity: config.CapacityOnDemand}
}

func addrs(ss ...string) []netip.Addr {
	out := make([]netip.Addr, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParseAddr(s)
	}
	return out
}

func names(ss ...string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = fmt.Sprintf("vllm-%s-8000", s)
	}
	return out
}

// harness is a discoverer of one group against a real DNS server, driven
// one lookup at a time.
type harness struct {
	t    *testing.T
	dns  *testenv.DNS
	sink *sink
	d    *DNS
	reg  *prometheus.Registry
}

func newHarness(t *testing.T) *harness {
	h := &harness{t: t, dns: testenv.StartDNS(t), sink: &sink{}, reg: prometheus.NewRegistry()}
	h.d = NewDNS([]config.DNSGroup{testGroup()}, Options{Resolver: h.dns.Resolver(), Sink: h.sink, Log: zerolog.Nop()}, h.reg)
	return h
}

// lookup resolves once, and checks how many times the sink was called in
// all and what it last got.
func (h *harness) lookup(calls int, want []string) {
	h.t.Helper()
	h.d.poll(context.Background(), h.d.groups[0])
	n, got := h.sink.last()
	if n != calls {
		h.t.Errorf("sink called %d times, want %d", n, calls)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		h.t.Errorf("instances (-want +got):\n%s", diff)
	}
}

func (h *harness) count(result string) float64 {
	return testutil.ToFloat64(h.d.lookups.WithLabelValues("vllm", result))
}

// TestDNSRules drives one group through a real DNS server: an address is
// added at once and removed after remove_after answers lack it; a
// flapping one stays; an empty answer, NXDOMAIN and SERVFAIL keep the
// set in force.
func TestDNSRules(t *testing.T) {
	h := newHarness(t)
	h.dns.Set(host, addrs("10.0.0.2", "10.0.0.1")...)
	h.lookup(1, names("10-0-0-1", "10-0-0-2"))
	h.lookup(1, names("10-0-0-1", "10-0-0-2")) // unchanged: not handed again

	h.dns.Set(host, addrs("10.0.0.1", "10.0.0.2", "fd00::3")...)
	h.lookup(2, names("10-0-0-1", "10-0-0-2", "fd00--3"))

	h.dns.Set(host, addrs("10.0.0.1", "fd00::3")...) // 10.0.0.2 goes
	h.lookup(2, names("10-0-0-1", "10-0-0-2", "fd00--3"))
	h.lookup(2, names("10-0-0-1", "10-0-0-2", "fd00--3"))
	h.lookup(3, names("10-0-0-1", "fd00--3")) // the third answer without it

	// fd00::3 flaps: absent, present, absent, absent, present… It is never
	// missing from three answers in a row, so it stays, and nothing is
	// handed on.
	for i, present := range []bool{false, true, false, false, true, false, false, true} {
		if present {
			h.dns.Set(host, addrs("10.0.0.1", "fd00::3")...)
		} else {
			h.dns.Set(host, addrs("10.0.0.1")...)
		}
		h.lookup(3, names("10-0-0-1", "fd00--3"))
		if t.Failed() {
			t.Fatalf("flap %d", i)
		}
	}

	// Resolving to nothing, or failing, changes nothing, however long.
	for _, fail := range []func(){
		func() { h.dns.Set(host) },                          // NOERROR, no records
		func() { h.dns.Fail(host, dns.RcodeNameError) },     // NXDOMAIN
		func() { h.dns.Fail(host, dns.RcodeServerFailure) }, // SERVFAIL
	} {
		fail()
		for range 5 {
			h.lookup(3, names("10-0-0-1", "fd00--3"))
		}
	}
	if got := h.count(resultNotFound); got != 10 {
		t.Errorf("not_found lookups = %v, want 10", got)
	}
	if got := h.count(resultError); got != 5 {
		t.Errorf("error lookups = %v, want 5", got)
	}
	if got := testutil.ToFloat64(h.d.found.WithLabelValues("vllm")); got != 2 {
		t.Errorf("tether_discovery_instances = %v, want 2", got)
	}
	// An answer again: a failed lookup is no answer, so 10.0.0.1 has been
	// missing from none.
	h.dns.Set(host, addrs("fd00::3")...)
	h.lookup(3, names("10-0-0-1", "fd00--3"))
	h.lookup(3, names("10-0-0-1", "fd00--3"))
	h.lookup(4, names("fd00--3"))
}

// TestDNSManyAddresses: a hundred addresses come over TCP (the UDP answer
// is truncated) and all are taken; past config.MaxDiscovered, the lowest
// are taken and the lookup counts as truncated.
func TestDNSManyAddresses(t *testing.T) {
	h := newHarness(t)
	var hundred []netip.Addr
	for i := range 100 {
		hundred = append(hundred, netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(i%250 + 1)}))
	}
	h.dns.Set(host, hundred...)
	h.d.poll(context.Background(), h.d.groups[0])
	if _, got := h.sink.last(); len(got) != 100 {
		t.Fatalf("%d instances, want 100", len(got))
	}
	if h.count(resultOK) != 1 {
		t.Errorf("ok lookups = %v, want 1", h.count(resultOK))
	}

	var many []netip.Addr
	for i := range 300 {
		many = append(many, netip.AddrFrom4([4]byte{10, 2, byte(i / 250), byte(i%250 + 1)}))
	}
	slices.Reverse(many) // the answer's order does not choose
	h.dns.Set(host, many...)
	h.d.poll(context.Background(), h.d.groups[0])
	_, got := h.sink.last()
	// The hundred stay until three answers lack them.
	if len(got) != 100+config.MaxDiscovered {
		t.Fatalf("%d instances, want %d", len(got), 100+config.MaxDiscovered)
	}
	for range 2 {
		h.d.poll(context.Background(), h.d.groups[0])
	}
	_, got = h.sink.last()
	if len(got) != config.MaxDiscovered || got[0] != "vllm-10-2-0-1-8000" || got[len(got)-1] != "vllm-10-2-1-6-8000" {
		t.Errorf("%d instances, %s to %s; want the lowest %d, vllm-10-2-0-1-8000 to vllm-10-2-1-6-8000",
			len(got), got[0], got[len(got)-1], config.MaxDiscovered)
	}
	if h.count(resultTruncated) != 3 {
		t.Errorf("truncated lookups = %v, want 3", h.count(resultTruncated))
	}
}

// TestDNSRefusedIsRetried: a set the sink refused is handed again after
// the next lookup, though DNS did not change.
func TestDNSRefusedIsRetried(t *testing.T) {
	h := newHarness(t)
	h.sink.refuse = fmt.Errorf("invalid")
	h.dns.Set(host, addrs("10.0.0.1")...)
	h.lookup(1, names("10-0-0-1"))
	h.lookup(2, names("10-0-0-1"))
	h.sink.refuse = nil
	h.lookup(3, names("10-0-0-1"))
	h.lookup(3, names("10-0-0-1"))
}

// TestUsable: an answer's addresses sorted, once each, IPv4-mapped ones
// as IPv4, without zoned, unspecified or multicast ones.
func TestUsable(t *testing.T) {
	got, truncated := usable(addrs("10.0.0.2", "::ffff:10.0.0.1", "10.0.0.1", "fe80::1%eth0", "0.0.0.0", "::", "ff02::1", "fd00::1"))
	if diff := cmp.Diff(addrs("10.0.0.1", "10.0.0.2", "fd00::1"), got, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); diff != "" || truncated {
		t.Errorf("usable (-want +got):\n%s (truncated %v)", diff, truncated)
	}
}

// TestRun: Run resolves at once and on the interval, and returns when its
// context ends.
func TestRun(t *testing.T) {
	srv := testenv.StartDNS(t)
	srv.Set(host, addrs("10.0.0.1")...)
	g := testGroup()
	g.Interval = config.Dur(10 * time.Millisecond)
	s := &sink{}
	d := NewDNS([]config.DNSGroup{g}, Options{Resolver: srv.Resolver(), Sink: s, Log: zerolog.Nop()}, prometheus.NewRegistry())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitFor(t, s, names("10-0-0-1"))
	srv.Set(host, addrs("10.0.0.1", "10.0.0.2")...)
	waitFor(t, s, names("10-0-0-1", "10-0-0-2"))
}

func waitFor(t *testing.T, s *sink, want []string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, got := s.last()
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("instances %v, want %v", got, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
