package audit

import (
	"errors"
	"sync/atomic"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/identity"
)

// DefaultMaxUserIDBytes bounds the user ids a Recorder seals.
const DefaultMaxUserIDBytes = 256

// RecorderConfig configures a Recorder.
type RecorderConfig struct {
	// MaxUserIDBytes bounds the user id sealed into a record. The default
	// is DefaultMaxUserIDBytes. tether passes identity.max_value_bytes, so
	// every user id that routing accepts is recorded. A longer one, or one
	// with control characters, is left out of the record. It is counted in
	// UserIDsRejected and never logged.
	MaxUserIDBytes int
}

// Recorder turns decisions into Records for a Writer. It is tether's
// extproc.Auditor. Audit runs on the request path and does not block. A
// decision that is sampled out costs a hash of its request id.
type Recorder struct {
	w       *Writer
	sealer  *Sealer
	maxUser int

	generated, rejected atomic.Uint64
}

// NewRecorder returns a Recorder writing to w, sealing user ids with s.
func NewRecorder(w *Writer, s *Sealer, cfg RecorderConfig) (*Recorder, error) {
	switch {
	case w == nil:
		return nil, errors.New("audit recorder: nil writer")
	case s == nil:
		return nil, errors.New("audit recorder: nil sealer")
	case cfg.MaxUserIDBytes < 0:
		return nil, errors.New("audit recorder: negative max user id length")
	}
	if cfg.MaxUserIDBytes == 0 {
		cfg.MaxUserIDBytes = DefaultMaxUserIDBytes
	}
	return &Recorder{w: w, sealer: s, maxUser: cfg.MaxUserIDBytes}, nil
}

// Audit records one decision (extproc.Auditor). requestID is Envoy's
// x-request-id and userID the raw user header. Both are unchecked, and ""
// when absent.
//
//   - The record's request id is requestID, lower-cased, when it is a UUID
//     of any version. Otherwise it is a new one, counted in
//     RequestIDsGenerated.
//   - Decisions that make or change a binding are always recorded. So
//     forget finds every binding made while the audit is on.
//   - Hits, random, anonymous, fallback and degraded decisions are sampled
//     at the Writer's SampleRate (Writer.Sample).
//   - The record names the session keys the decision used: the identity's
//     key and aliases. Forget finds the bindings by them.
//   - The user id is sealed into the record when it is at most
//     MaxUserIDBytes long without control characters. Otherwise it is
//     left out and counted in UserIDsRejected.
func (r *Recorder) Audit(requestID, userID string, id identity.Identity, d affinity.Decision, at time.Time) {
	rid, ok := canonicalUUID(requestID)
	if !ok {
		rid = NewRequestID()
		r.generated.Add(1)
	}
	userOK := userID != "" && r.validUser(userID)
	if userID != "" && !userOK {
		r.rejected.Add(1)
	}
	if !AlwaysRecorded(d.Kind) && !r.w.Sample(rid) {
		return
	}
	rec := Record{
		RequestID:      rid,
		ModelVersion:   d.Instance.Version,
		DecisionTime:   at.UTC(),
		Instance:       d.Instance.Name,
		Mode:           string(d.Mode),
		Decision:       string(d.Kind),
		IdentitySource: string(id.Source),
		SessionKeys:    sessionKeys(id, d.Key),
	}
	if userOK {
		r.sealer.Attach(&rec, userID)
	}
	r.w.WriteAlways(rec)
}

// sessionKeys are the keys the decision used. They are keyed hashes, never
// a raw identifier. They hold the identity's key and its aliases. When the
// identity's key is an alias linked to another key, they also hold the key
// the binding is stored under. So forget finds the binding even once the
// link has gone. sessionKeys is nil when anonymous.
func sessionKeys(id identity.Identity, stored string) []string {
	if id.Key == "" && len(id.Aliases) == 0 && stored == "" {
		return nil
	}
	keys := make([]string, 0, 2+len(id.Aliases))
	if id.Key != "" {
		keys = append(keys, id.Key)
	}
	if stored != "" && stored != id.Key {
		keys = append(keys, stored)
	}
	for _, a := range id.Aliases {
		if a != "" {
			keys = append(keys, a)
		}
	}
	return keys
}

// RequestIDsGenerated counts the decisions whose x-request-id was absent
// or not a UUID, recorded under a new request id.
func (r *Recorder) RequestIDsGenerated() uint64 { return r.generated.Load() }

// UserIDsRejected counts the user ids left out of records: too long, or
// with control characters.
func (r *Recorder) UserIDsRejected() uint64 { return r.rejected.Load() }

// AlwaysRecorded reports whether decisions of kind k make or change a
// binding, and so are recorded whatever the sample rate. That is every
// kind but hit, random, anonymous, fallback and degraded. Fallback keeps
// the binding. Degraded stores nothing. A kind added later is recorded
// until it is listed here.
func AlwaysRecorded(k affinity.Kind) bool {
	switch k {
	case affinity.KindHit, affinity.KindRandom, affinity.KindAnonymous, affinity.KindFallback, affinity.KindDegraded:
		return false
	}
	return true
}

func (r *Recorder) validUser(u string) bool {
	if len(u) > r.maxUser {
		return false
	}
	for i := 0; i < len(u); i++ {
		if b := u[i]; b < 0x20 || b == 0x7f {
			return false
		}
	}
	return true
}

// canonicalUUID reports whether s is a UUID in its 36-character text form:
// 8-4-4-4-12 hex digits, any version and variant. It returns s in lower
// case, the form PostgreSQL's uuid type gives back. The ciphertext is
// bound to the request id, so the id must read back as it was sealed. It
// allocates only for an id with upper-case digits.
func canonicalUUID(s string) (string, bool) {
	if len(s) != 36 || s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
		return "", false
	}
	var seen byte
	for _, g := range [...][2]int{{0, 8}, {9, 13}, {14, 18}, {19, 23}, {24, 36}} {
		for _, c := range []byte(s[g[0]:g[1]]) {
			k := hexClass[c]
			if k == 0 {
				return "", false
			}
			seen |= k
		}
	}
	if seen&hexUpper == 0 {
		return s, true
	}
	b := []byte(s)
	for i, c := range b {
		if hexClass[c] == hexUpper {
			b[i] = c + ('a' - 'A')
		}
	}
	return string(b), true
}

// hexClass classes the bytes of a UUID's text form: 0 not a hex digit.
var hexClass = func() (t [256]byte) {
	for c := '0'; c <= '9'; c++ {
		t[c] = hexLower
	}
	for c := 'a'; c <= 'f'; c++ {
		t[c] = hexLower
	}
	for c := 'A'; c <= 'F'; c++ {
		t[c] = hexUpper
	}
	return t
}()

const (
	hexLower = 1 // a digit or a-f
	hexUpper = 2 // A-F
)
