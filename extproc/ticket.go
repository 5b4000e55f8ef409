package extproc

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
)

// A ticket is a decision as it travels to its outcome. An outcome reported
// apart may reach another replica, later, or not at all. So the decision
// goes along with the request, in Envoy's dynamic metadata. It is a short
// signed string with what Finish needs: the instance, when, the breaker's
// probe flag, the mode and the previous instance.
//
//	1|<decided, Unix ms>|<issuer>-<seq>|<flags>|<instance>|<previous>|<mac>
//
// flags: "r" random mode, "p" the half-open circuit's probe, "-" neither.
// The MAC is HMAC-SHA256, cut to 9 bytes. Its key derives from the
// identity secret, which every replica sharing a store has. An outcome
// without one of tether's tickets is counted and ignored. So nothing else
// that reaches tether's port can feed the breaker.
const ticketVersion = "1"

// The dynamic metadata namespace the routing reply writes in, and its
// fields. The filters' metadata_options name the namespace. Envoy copies
// the debug fields into the response (Options.DebugHeaders).
// MetadataDecision holds "none:<reason>" when tether did not decide.
const (
	MetadataNamespace = "tether"
	ticketField       = "t"
	MetadataInstance  = "instance"
	MetadataDecision  = "decision"
)

// ApartMarker is the gRPC metadata key of an apart stream, with value "1".
// Its request's end is reported apart: in the access log, or by an
// observing filter. The report finishes the decision, never the stream's
// end. Envoy may close the stream once the request headers are answered.
const ApartMarker = "x-tether-outcomes-apart"

// Tickets issues and reads tickets. It is safe for concurrent use.
type Tickets struct {
	issuer  string // this process, in the tickets' ids
	seq     atomic.Uint64
	scratch sync.Pool // of *macScratch
}

// NewTickets derives the ticket key from secret (the identity secret).
func NewTickets(secret []byte) *Tickets {
	key := hmac.New(sha256.New, secret)
	key.Write([]byte("tether outcome ticket v1"))
	k := key.Sum(nil)
	var tag [4]byte
	_, _ = rand.Read(tag[:])
	t := &Tickets{issuer: hex.EncodeToString(tag[:])}
	t.scratch.New = func() any {
		return &macScratch{mac: hmac.New(sha256.New, k), buf: make([]byte, 0, 128)}
	}
	return t
}

// ticket is a decoded ticket.
type ticket struct {
	id       string
	at       time.Time
	instance string
	previous string
	random   bool
	probe    bool
}

// decision is what Finish and the recorder need of t's decision.
func (t ticket) decision(in fleet.Instance) affinity.Decision {
	mode := affinity.Sticky
	if t.random {
		mode = affinity.Random
	}
	return affinity.Decision{Instance: in, Mode: mode, Previous: t.previous, At: t.at, Probe: t.probe}
}

const macLen = 9 // bytes; 12 characters

// Issue writes d's ticket.
func (k *Tickets) Issue(d affinity.Decision) string {
	flags := "-"
	switch {
	case d.Mode == affinity.Random && d.Probe:
		flags = "rp"
	case d.Mode == affinity.Random:
		flags = "r"
	case d.Probe:
		flags = "p"
	}
	sc := k.scratch.Get().(*macScratch)
	b := append(sc.buf[:0], ticketVersion...)
	b = append(b, '|')
	b = strconv.AppendInt(b, d.At.UnixMilli(), 10)
	b = append(b, '|')
	b = append(b, k.issuer...)
	b = append(b, '-')
	b = strconv.AppendUint(b, k.seq.Add(1), 36)
	b = append(b, '|')
	b = append(b, flags...)
	b = append(b, '|')
	b = append(b, d.Instance.Name...)
	b = append(b, '|')
	b = append(b, d.Previous...)
	b = append(b, '|')
	b = sc.appendMAC(b, b)
	t := string(b)
	k.put(sc, b)
	return t
}

// own reports whether a ticket's id is one this process issued.
func (k *Tickets) own(id string) bool {
	rest, ok := strings.CutPrefix(id, k.issuer)
	return ok && strings.HasPrefix(rest, "-")
}

// macScratch is a MAC under the ticket key, and a buffer. A pool reuses
// them: every apart routing reply issues a ticket.
type macScratch struct {
	mac hash.Hash
	buf []byte
	sum [sha256.Size]byte
}

// appendMAC appends body's MAC, in base64url, to dst.
func (sc *macScratch) appendMAC(dst, body []byte) []byte {
	sc.mac.Reset()
	sc.mac.Write(body)
	return base64.RawURLEncoding.AppendEncode(dst, sc.mac.Sum(sc.sum[:0])[:macLen])
}

func (k *Tickets) put(sc *macScratch, b []byte) {
	if cap(b) <= 2*maxTicket {
		sc.buf = b[:0]
	}
	k.scratch.Put(sc)
}

// validMAC reports whether mac is body's.
func (k *Tickets) validMAC(body, mac string) bool {
	sc := k.scratch.Get().(*macScratch)
	b := append(sc.buf[:0], body...)
	want := sc.appendMAC(b[len(b):], b)
	ok := hmac.Equal([]byte(mac), want)
	k.put(sc, b)
	return ok
}

// Why a ticket is refused.
var (
	errNoTicket  = errors.New("no ticket")
	errMalformed = errors.New("malformed ticket")
	errForged    = errors.New("ticket not signed by this deployment")
)

// maxTicket bounds what is parsed: two instance names of 63 and the rest.
const maxTicket = 256

// read checks and decodes s.
func (k *Tickets) read(s string) (ticket, error) {
	if s == "" {
		return ticket{}, errNoTicket
	}
	if len(s) > maxTicket {
		return ticket{}, errMalformed
	}
	cut := strings.LastIndexByte(s, '|')
	if cut < 0 {
		return ticket{}, errMalformed
	}
	body, mac := s[:cut+1], s[cut+1:]
	if !k.validMAC(body, mac) {
		return ticket{}, errForged
	}
	f := strings.Split(body[:cut], "|")
	if len(f) != 6 || f[0] != ticketVersion || f[2] == "" || f[4] == "" {
		return ticket{}, errMalformed
	}
	ms, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil || ms <= 0 {
		return ticket{}, errMalformed
	}
	t := ticket{id: f[2], at: time.UnixMilli(ms), instance: f[4], previous: f[5]}
	switch f[3] {
	case "-":
	case "r":
		t.random = true
	case "p":
		t.probe = true
	case "rp":
		t.random, t.probe = true, true
	default:
		return ticket{}, fmt.Errorf("%w: flags %q", errMalformed, f[3])
	}
	return t, nil
}
