// Package audit records tether's routing decisions for auditors. Each
// sampled decision makes one Record. A Writer writes records
// asynchronously to a Sink: a Redis Stream, a PostgreSQL table or
// JSON-lines files.
//
// The user id is never stored in plain text. A Sealer encrypts it with
// AES-256-GCM, bound to the request id. It also derives a keyed pseudonym
// with HMAC-SHA256. "forget" and "export" look records up by that
// pseudonym. See README.md.
package audit

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
)

// MaxRetention is the longest any sink keeps a record.
const MaxRetention = 30 * 24 * time.Hour

// CheckRetention refuses a retention that is not positive or longer than
// MaxRetention. Every sink calls it when it is built.
func CheckRetention(d time.Duration) error {
	switch {
	case d <= 0:
		return fmt.Errorf("audit retention %v: must be positive", d)
	case d > MaxRetention:
		return fmt.Errorf("audit retention %v: longer than the maximum of 30 days (720h)", d)
	}
	return nil
}

// Record is one routing decision. It has no field for the plaintext user
// id. UserCiphertext holds it sealed under the key KeyID, bound to
// RequestID. UserPseudonym is its keyed hash (see Sealer).
type Record struct {
	RequestID      string    `json:"request_id"`
	ModelVersion   string    `json:"model_version"`
	DecisionTime   time.Time `json:"decision_time"`
	Instance       string    `json:"instance"`
	Mode           string    `json:"mode"`
	Decision       string    `json:"decision"`
	IdentitySource string    `json:"identity_source"`
	// UserCiphertext is nonce || AES-256-GCM sealed user id, base64 in
	// JSON. It is empty when the request carried no user id.
	UserCiphertext []byte `json:"user_ct,omitempty"`
	KeyID          string `json:"key_id,omitempty"`
	UserPseudonym  string `json:"user_pseudonym,omitempty"`
	// SessionKeys are the opaque session keys the decision used. They are
	// keyed hashes such as "s:…", never a plaintext session id or user id.
	// With them, "forget" finds the user's session bindings from the audit
	// records.
	SessionKeys []string `json:"session_keys,omitempty"`
}

// NewRequestID returns a random version 4 UUID. It serves a request that
// came without Envoy's x-request-id.
func NewRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go ≥ 1.24)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	var s [36]byte
	hex.Encode(s[0:8], b[0:4])
	s[8] = '-'
	hex.Encode(s[9:13], b[4:6])
	s[13] = '-'
	hex.Encode(s[14:18], b[6:8])
	s[18] = '-'
	hex.Encode(s[19:23], b[8:10])
	s[23] = '-'
	hex.Encode(s[24:], b[10:])
	return string(s[:])
}

// Sink stores records. Each implementation has its own package:
// audit/file, audit/redis and audit/postgres. audit/sinks opens the one
// [audit] names.
type Sink interface {
	// Write stores a batch of records, in order.
	Write(ctx context.Context, recs []Record) error
	// Delete removes every record with this pseudonym, for "forget". It
	// returns how many it removed.
	Delete(ctx context.Context, pseudonym string) (int, error)
	// Export returns every stored record with this pseudonym, oldest first.
	Export(ctx context.Context, pseudonym string) ([]Record, error)
	// Close releases the sink's resources. It does not close a client it
	// was given.
	Close() error
}

// Pruner is a Sink that removes records older than its retention when
// asked. The Writer asks every WriterConfig.PruneInterval. So a sink that
// receives no records still forgets old ones.
type Pruner interface {
	Prune(ctx context.Context) error
}

// ErrInvalidRecord marks records a sink could not store as they are. See
// InvalidRecordsError.
var ErrInvalidRecord = errors.New("invalid audit record")

// InvalidRecordsError is what a sink's Write returns when it skipped
// records of a batch that its store would refuse, and stored the others.
// The PostgreSQL sink, audit/postgres, refuses two things:
//   - a request_id that is not a UUID in lower-case canonical form;
//   - a text field that is not UTF-8 or holds a NUL byte.
//
// The error names the records by position and the field by name, never by
// value. errors.Is(err, ErrInvalidRecord) holds. The Writer counts the
// skipped records as failed and the others as written.
type InvalidRecordsError struct {
	Table   string
	Total   int      // records in the batch
	Index   []int    // positions of the skipped records, ascending
	Reasons []string // why, one per skipped record
}

func (e *InvalidRecordsError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "audit postgres sink: write %s: skipped %d of %d records (the others are stored)", e.Table, len(e.Index), e.Total)
	const show = 5
	for i, idx := range e.Index[:min(len(e.Index), show)] {
		fmt.Fprintf(&b, "; record %d: %s", idx, e.Reasons[i])
	}
	if len(e.Index) > show {
		fmt.Fprintf(&b, "; and %d more", len(e.Index)-show)
	}
	return b.String()
}

func (e *InvalidRecordsError) Unwrap() error { return ErrInvalidRecord }
