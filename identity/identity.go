// Package identity works out who is calling from request headers. It
// tries, in order:
//   - the application's session id;
//   - a bearer token;
//   - a device: an explicit device id or a fingerprint of stable client
//     headers, plus the user id;
//   - else nobody.
//
// It returns an opaque key, never the raw value. Every key is an
// HMAC-SHA256 of the identifier under a server secret. So a Redis dump or
// a log line cannot be turned back into a token or a user id.
//
// The package is pure: no I/O, no clock, no globals. It is safe for
// concurrent use.
package identity

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"hash"
	"strings"
	"sync"
)

// Source says which identifier a key came from, strongest first.
type Source string

// The sources, strongest first.
const (
	SourceSession   Source = "session"
	SourceToken     Source = "token"
	SourceDevice    Source = "device"
	SourceAnonymous Source = "anonymous"
)

// Reason says why a present identifier was not used.
type Reason string

// The reasons.
const (
	ReasonNone          Reason = ""
	ReasonTooLong       Reason = "too_long"
	ReasonControlChars  Reason = "control_chars"
	ReasonMalformedAuth Reason = "malformed_auth"
)

// Identity is the result of Extract.
type Identity struct {
	// Key is the opaque session key: "s:…", "t:…" or "d:…". It is empty
	// when anonymous.
	Key    string
	Source Source
	// Rejected is set when an identifier was present but unusable. The
	// request is then anonymous. Header names which header it was.
	Rejected Reason
	Header   string
	// Aliases are the keys of the weaker identifiers the request also
	// carried. Examples are a token and a device sent with a session id,
	// or a device sent with a token. The store links them to the session,
	// so a later request with only one of them finds it. Invalid weaker
	// identifiers are left out, not rejected.
	Aliases []string
	// Cohort is a keyed hash of the user id, "u:…". It is empty without a
	// user id. Canary cohorts hash it, so a user is in or out of a canary
	// across all of their sessions.
	Cohort string
}

// Anonymous reports whether no usable identity was found.
func (id Identity) Anonymous() bool { return id.Key == "" }

// Headers gives the value of a request header by lower-case name. It
// gives "" when the header is absent.
type Headers interface {
	Get(name string) string
}

// Map is a Headers backed by a map with lower-case keys.
type Map map[string]string

// Get implements Headers.
func (m Map) Get(name string) string { return m[name] }

// Config names the headers and the secret. Header names are lower-case.
type Config struct {
	SessionHeader  string // default x-session-id
	AuthHeader     string // default authorization
	DeviceHeader   string // default x-device-id
	UserHeader     string // default x-user-id
	UserAgent      string // default user-agent
	AcceptLanguage string // default accept-language
	ForwardedFor   string // default x-forwarded-for
	MaxValueBytes  int    // default DefaultMaxValueBytes
	Secret         []byte // HMAC key; at least 16 bytes
}

// DefaultMaxValueBytes bounds an identifier's length. It leaves room for a
// JWT bearer token, commonly 1-2 KB with its claims. It also bounds the
// work per request.
const DefaultMaxValueBytes = 4096

// ErrShortSecret is returned by New for a secret under 16 bytes.
var ErrShortSecret = errors.New("identity secret must be at least 16 bytes")

func (c *Config) setDefaults() {
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
		*s = strings.ToLower(*s)
	}
	def(&c.SessionHeader, "x-session-id")
	def(&c.AuthHeader, "authorization")
	def(&c.DeviceHeader, "x-device-id")
	def(&c.UserHeader, "x-user-id")
	def(&c.UserAgent, "user-agent")
	def(&c.AcceptLanguage, "accept-language")
	def(&c.ForwardedFor, "x-forwarded-for")
	if c.MaxValueBytes <= 0 {
		c.MaxValueBytes = DefaultMaxValueBytes
	}
}

// Headers are the request headers Extract reads. Names c leaves unset take
// their defaults. Envoy must send these headers (forward_rules).
func (c Config) Headers() []string {
	c.setDefaults()
	return []string{c.SessionHeader, c.AuthHeader, c.DeviceHeader, c.UserHeader, c.UserAgent, c.AcceptLanguage, c.ForwardedFor}
}

// Extractor turns headers into an Identity.
type Extractor struct {
	cfg     Config
	scratch sync.Pool // of *scratch
}

// New returns an Extractor. Unset header names take their defaults.
func New(cfg Config) (*Extractor, error) {
	if len(cfg.Secret) < 16 {
		return nil, ErrShortSecret
	}
	cfg.setDefaults()
	secret := append([]byte(nil), cfg.Secret...)
	cfg.Secret = nil
	e := &Extractor{cfg: cfg}
	e.scratch.New = func() any {
		return &scratch{mac: hmac.New(sha256.New, secret), buf: make([]byte, 0, 256)}
	}
	return e, nil
}

// Extract finds the strongest identifier in h. An identifier may be
// present but unusable: too long, with control characters, or a malformed
// bearer token. That makes the request anonymous. A weaker identifier does
// not stand in for it. tether never guesses which conversation a broken
// request belongs to.
func (e *Extractor) Extract(h Headers) Identity {
	c := &e.cfg
	id := e.strongest(h)
	if id.Anonymous() {
		return id
	}
	if user := h.Get(c.UserHeader); user != "" && e.check(user) == ReasonNone {
		id.Cohort = e.key('u', user)
	}
	return id
}

// strongest returns the identity of the strongest identifier, with the
// weaker ones as aliases.
func (e *Extractor) strongest(h Headers) Identity {
	c := &e.cfg
	if v := h.Get(c.SessionHeader); v != "" {
		if r := e.check(v); r != ReasonNone {
			return rejected(r, c.SessionHeader)
		}
		id := Identity{Key: e.key('s', v), Source: SourceSession}
		if tok, ok := e.token(h); ok {
			id.Aliases = append(id.Aliases, tok.Key)
		}
		if dev := e.device(h); !dev.Anonymous() {
			id.Aliases = append(id.Aliases, dev.Key)
		}
		return id
	}
	if tok, ok := e.token(h); ok || tok.Rejected != ReasonNone {
		if dev := e.device(h); ok && !dev.Anonymous() {
			tok.Aliases = []string{dev.Key}
		}
		return tok
	}
	return e.device(h)
}

// token keys a bearer token. ok is false when there is none. A present but
// malformed one is returned rejected, with ok false and Rejected set.
// Another scheme, such as Basic or Digest, is not a session identifier and
// gives !ok.
func (e *Extractor) token(h Headers) (Identity, bool) {
	c := &e.cfg
	v := h.Get(c.AuthHeader)
	if v == "" {
		return Identity{}, false
	}
	token, ok, r := e.bearer(v)
	if r != ReasonNone {
		return rejected(r, c.AuthHeader), false
	}
	if !ok {
		return Identity{}, false
	}
	return Identity{Key: e.key('t', token), Source: SourceToken}, true
}

// device keys a caller by an explicit device id, or by a fingerprint of
// stable client headers. Both are combined with the user id. A fingerprint
// without a user id is too coarse: every user of one browser build shares
// it. So it is not used alone.
func (e *Extractor) device(h Headers) Identity {
	c := &e.cfg
	user := h.Get(c.UserHeader)
	if user != "" {
		if r := e.check(user); r != ReasonNone {
			return rejected(r, c.UserHeader)
		}
	}
	if dev := h.Get(c.DeviceHeader); dev != "" {
		if r := e.check(dev); r != ReasonNone {
			return rejected(r, c.DeviceHeader)
		}
		return Identity{Key: e.key('d', "id", dev, user), Source: SourceDevice}
	}
	if user == "" {
		return Identity{Source: SourceAnonymous}
	}
	ua, lang := h.Get(c.UserAgent), h.Get(c.AcceptLanguage)
	xff, _, _ := strings.Cut(h.Get(c.ForwardedFor), ",")
	xff = strings.TrimSpace(xff)
	for _, hv := range [...]struct{ name, v string }{{c.UserAgent, ua}, {c.AcceptLanguage, lang}, {c.ForwardedFor, xff}} {
		if r := e.check(hv.v); r != ReasonNone {
			return rejected(r, hv.name)
		}
	}
	return Identity{Key: e.key('d', "fp", ua, lang, xff, user), Source: SourceDevice}
}

func rejected(r Reason, header string) Identity {
	return Identity{Source: SourceAnonymous, Rejected: r, Header: header}
}

// check validates one header value used as (part of) an identity.
func (e *Extractor) check(v string) Reason {
	if len(v) > e.cfg.MaxValueBytes {
		return ReasonTooLong
	}
	for i := 0; i < len(v); i++ {
		if b := v[i]; b < 0x20 || b == 0x7f {
			return ReasonControlChars
		}
	}
	return ReasonNone
}

// bearer parses "Bearer <token>". ok is false for other schemes. A Bearer
// header with a missing or malformed token is rejected. The token must be
// an RFC 6750 b64token.
func (e *Extractor) bearer(v string) (token string, ok bool, r Reason) {
	if r := e.check(v); r != ReasonNone {
		return "", false, r
	}
	scheme, rest, _ := strings.Cut(strings.TrimSpace(v), " ")
	if !strings.EqualFold(scheme, "bearer") {
		return "", false, ReasonNone
	}
	token = strings.TrimSpace(rest)
	if !isB64Token(token) {
		return "", false, ReasonMalformedAuth
	}
	return token, true, ReasonNone
}

// isB64Token reports whether s matches 1*( ALPHA / DIGIT / "-" / "." / "_" /
// "~" / "+" / "/" ) *"=".
func isB64Token(s string) bool {
	i := 0
	for ; i < len(s); i++ {
		b := s[i]
		if !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' ||
			b == '-' || b == '.' || b == '_' || b == '~' || b == '+' || b == '/') {
			break
		}
	}
	if i == 0 {
		return false
	}
	for ; i < len(s); i++ {
		if s[i] != '=' {
			return false
		}
	}
	return true
}

// key returns kind ":" base64url(HMAC(secret, kind, parts…)[:16]). Parts
// are length-prefixed, so ("ab","c") and ("a","bc") cannot collide.
func (e *Extractor) key(kind byte, parts ...string) string {
	sc := e.scratch.Get().(*scratch)
	// The message goes in one buffer, hashed in one Write. A []byte(part)
	// per Write would be an allocation each. So would a digest array
	// passed to Sum through the interface.
	b := append(sc.buf[:0], kind)
	for _, p := range parts {
		n := len(p)
		b = append(b, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
		b = append(b, p...)
	}
	sc.mac.Reset()
	sc.mac.Write(b)
	sum := sc.mac.Sum(b[len(b):])
	out := append(sum[len(sum):], kind, ':')
	out = base64.RawURLEncoding.AppendEncode(out, sum[:16])
	key := string(out)
	if cap(b) <= maxScratch {
		sc.buf = b[:0]
		e.scratch.Put(sc)
	}
	return key
}

// scratch is one key derivation's MAC and buffer, reused through a pool.
type scratch struct {
	mac hash.Hash // keyed with the secret
	buf []byte
}

// maxScratch bounds the buffer a pool keeps. A fingerprint of four values
// at MaxValueBytes each is rare, and is not worth holding on to.
const maxScratch = 4 << 10
