package testenv

import (
	"context"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/miekg/dns"
)

// DNS is a DNS server on 127.0.0.1, over UDP and TCP, that answers A and
// AAAA queries from records the test sets and changes between lookups.
// A UDP answer too big for the client's buffer is truncated, so the
// client asks again over TCP, as with a real server.
type DNS struct {
	udp, tcp string // the servers' addresses

	mu      sync.Mutex
	records map[string][]netip.Addr
	rcodes  map[string]int
	queries int
}

// StartDNS starts a DNS server that knows no name yet. It stops when the
// test ends.
func StartDNS(t testing.TB) *DNS {
	t.Helper()
	d := &DNS{records: map[string][]netip.Addr{}, rcodes: map[string]int{}}
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("dns: %v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = pc.Close()
		t.Fatalf("dns: %v", err)
	}
	d.udp, d.tcp = pc.LocalAddr().String(), l.Addr().String()
	for _, srv := range []*dns.Server{{PacketConn: pc, Handler: d}, {Listener: l, Handler: d}} {
		started := make(chan struct{})
		srv.NotifyStartedFunc = func() { close(started) }
		done := make(chan struct{})
		go func() { defer close(done); _ = srv.ActivateAndServe() }() // returns at Shutdown
		<-started
		t.Cleanup(func() { _ = srv.Shutdown(); <-done })
	}
	return d
}

// Set makes name answer with addrs: A records for the IPv4 addresses,
// AAAA for the IPv6 ones. No addrs is an answer without records (NOERROR,
// no data).
func (d *DNS) Set(name string, addrs ...netip.Addr) {
	d.mu.Lock()
	defer d.mu.Unlock()
	name = fqdn(name)
	d.records[name] = append([]netip.Addr(nil), addrs...)
	delete(d.rcodes, name)
}

// Fail makes name answer with rcode, such as dns.RcodeNameError
// (NXDOMAIN) or dns.RcodeServerFailure (SERVFAIL).
func (d *DNS) Fail(name string, rcode int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rcodes[fqdn(name)] = rcode
}

// Queries is how many queries the server answered, over UDP and TCP.
func (d *DNS) Queries() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.queries
}

// Resolver is Go's resolver, asking this server alone: over UDP, and over
// TCP when an answer is truncated.
func (d *DNS) Resolver() *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		addr := d.udp
		if strings.HasPrefix(network, "tcp") {
			addr = d.tcp
		}
		var dialer net.Dialer
		return dialer.DialContext(ctx, network, addr)
	}}
}

func fqdn(name string) string { return dns.Fqdn(strings.ToLower(name)) }

// ServeDNS answers one query. A name the test never set is NXDOMAIN.
func (d *DNS) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	d.mu.Lock()
	d.queries++
	for _, q := range req.Question {
		name := strings.ToLower(q.Name)
		if rcode, ok := d.rcodes[name]; ok {
			m.Rcode = rcode
			continue
		}
		addrs, ok := d.records[name]
		if !ok {
			m.Rcode = dns.RcodeNameError
			continue
		}
		for _, a := range addrs {
			hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: 1}
			switch {
			case q.Qtype == dns.TypeA && a.Is4():
				hdr.Rrtype = dns.TypeA
				m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: a.AsSlice()})
			case q.Qtype == dns.TypeAAAA && a.Is6():
				hdr.Rrtype = dns.TypeAAAA
				m.Answer = append(m.Answer, &dns.AAAA{Hdr: hdr, AAAA: a.AsSlice()})
			}
		}
	}
	d.mu.Unlock()
	if _, udp := w.RemoteAddr().(*net.UDPAddr); udp {
		size := dns.MinMsgSize
		if opt := req.IsEdns0(); opt != nil {
			size = int(opt.UDPSize())
		}
		m.Truncate(size)
	}
	_ = w.WriteMsg(m) // a client gone is the client's to retry
}
