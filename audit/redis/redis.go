// Package redis is the routing audit's Redis Stream sink,
// audit.sink = "redis". The stream lives in the binding store's Redis, or
// in audit.redis_url's.
package redis

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tetherproxy/tether/audit"

	goredis "github.com/redis/go-redis/v9"
)

// Config configures a Sink.
type Config struct {
	// Prefix starts the stream's key, <prefix>audit. The default is
	// "tether:".
	Prefix string
	// Retention is at most MaxRetention.
	Retention time.Duration
	// TrimEvery is the least time between two trims made by writes. The
	// default is 1 min.
	TrimEvery time.Duration
	// ScanCount is the page size of the XRANGE scans of Delete and Export.
	// The default is 1000.
	ScanCount int64
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if err := audit.CheckRetention(c.Retention); err != nil {
		return fmt.Errorf("audit redis sink: %w", err)
	}
	if c.TrimEvery < 0 || c.ScanCount < 0 {
		return fmt.Errorf("audit redis sink: negative trim_every (%v) or scan_count (%d)", c.TrimEvery, c.ScanCount)
	}
	return nil
}

// Sink appends records to one Redis Stream, <prefix>audit, one entry per
// record. The fields are the Record's JSON names, with user_ct in base64.
// Entry ids are Redis's own: "*", the server's clock.
//
// Expired entries go with XTRIM MINID <now − Retention>, exact, not "~".
// The trim is sent in the pipeline of a write at most once per TrimEvery.
// Prune, Delete and Export also trim.
//
// Delete and Export scan the whole stream with XRANGE in pages of
// ScanCount. That is O(entries). At 1000 decisions/s and 30 days the
// stream holds 2.6 billion entries. So a busy fleet wants the PostgreSQL
// sink, indexed by pseudonym, for forget and export. The stream suits
// smaller fleets or shorter retention.
type Sink struct {
	c   goredis.UniversalClient
	cfg Config
	key string

	mu       sync.Mutex
	lastTrim time.Time
}

var (
	_ audit.Sink   = (*Sink)(nil)
	_ audit.Pruner = (*Sink)(nil)
)

// New builds a sink on c, which the caller keeps and closes.
func New(c goredis.UniversalClient, cfg Config) (*Sink, error) {
	if c == nil {
		return nil, errors.New("audit redis sink: nil client")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "tether:"
	}
	if cfg.TrimEvery == 0 {
		cfg.TrimEvery = time.Minute
	}
	if cfg.ScanCount == 0 {
		cfg.ScanCount = 1000
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Sink{c: c, cfg: cfg, key: cfg.Prefix + "audit"}, nil
}

// Key is the stream's key.
func (s *Sink) Key() string { return s.key }

// minID is the first stream id to keep.
func (s *Sink) minID(now time.Time) string {
	return strconv.FormatInt(now.Add(-s.cfg.Retention).UnixMilli(), 10) + "-0"
}

// trimDue reports whether a write should trim now, and records it.
func (s *Sink) trimDue(now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.lastTrim.IsZero() && now.Sub(s.lastTrim) < s.cfg.TrimEvery && now.After(s.lastTrim) {
		return false
	}
	s.lastTrim = now
	return true
}

func fields(r audit.Record) []any {
	return []any{
		"request_id", r.RequestID,
		"model_version", r.ModelVersion,
		"decision_time", r.DecisionTime.UTC().Format(time.RFC3339Nano),
		"instance", r.Instance,
		"mode", r.Mode,
		"decision", r.Decision,
		"identity_source", r.IdentitySource,
		"user_ct", base64.StdEncoding.EncodeToString(r.UserCiphertext),
		"key_id", r.KeyID,
		"user_pseudonym", r.UserPseudonym,
		// Session keys are "kind:base64url": a space never occurs in one.
		"session_keys", strings.Join(r.SessionKeys, " "),
	}
}

func fromValues(v map[string]any) (audit.Record, error) {
	str := func(k string) string { s, _ := v[k].(string); return s }
	r := audit.Record{
		RequestID: str("request_id"), ModelVersion: str("model_version"), Instance: str("instance"),
		Mode: str("mode"), Decision: str("decision"), IdentitySource: str("identity_source"),
		KeyID: str("key_id"), UserPseudonym: str("user_pseudonym"),
		SessionKeys: strings.Fields(str("session_keys")),
	}
	if t := str("decision_time"); t != "" {
		var err error
		if r.DecisionTime, err = time.Parse(time.RFC3339Nano, t); err != nil {
			return audit.Record{}, fmt.Errorf("decision_time: %w", err)
		}
	}
	if ct := str("user_ct"); ct != "" {
		b, err := base64.StdEncoding.DecodeString(ct)
		if err != nil {
			return audit.Record{}, fmt.Errorf("user_ct: %w", err)
		}
		r.UserCiphertext = b
	}
	return r, nil
}

// Write appends recs in one pipeline, with a trim when one is due.
func (s *Sink) Write(ctx context.Context, recs []audit.Record) error {
	if len(recs) == 0 {
		return nil
	}
	now := s.cfg.Now()
	_, err := s.c.Pipelined(ctx, func(p goredis.Pipeliner) error {
		for _, r := range recs {
			p.XAdd(ctx, &goredis.XAddArgs{Stream: s.key, ID: "*", Values: fields(r)})
		}
		if s.trimDue(now) {
			p.XTrimMinID(ctx, s.key, s.minID(now))
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("audit redis sink write: %w", err)
	}
	return nil
}

// Prune trims the expired entries now.
func (s *Sink) Prune(ctx context.Context) error {
	if err := s.c.XTrimMinID(ctx, s.key, s.minID(s.cfg.Now())).Err(); err != nil {
		return fmt.Errorf("audit redis sink trim: %w", err)
	}
	return nil
}

// scan calls fn with the entries of pseudonym in each page that holds
// any, oldest first.
func (s *Sink) scan(ctx context.Context, pseudonym string, fn func([]goredis.XMessage) error) error {
	start := "-"
	for {
		page, err := s.c.XRangeN(ctx, s.key, start, "+", s.cfg.ScanCount).Result()
		if err != nil {
			return err
		}
		var match []goredis.XMessage
		for _, m := range page {
			if p, _ := m.Values["user_pseudonym"].(string); p == pseudonym {
				match = append(match, m)
			}
		}
		if len(match) > 0 {
			if err := fn(match); err != nil {
				return err
			}
		}
		if int64(len(page)) < s.cfg.ScanCount {
			return nil
		}
		if start, err = nextID(page[len(page)-1].ID); err != nil {
			return err
		}
	}
}

// nextID is the smallest stream id after id ("ms-seq").
func nextID(id string) (string, error) {
	ms, seq, ok := strings.Cut(id, "-")
	n, err := strconv.ParseUint(seq, 10, 64)
	if !ok || err != nil {
		return "", fmt.Errorf("bad stream id %q", id)
	}
	if n == ^uint64(0) {
		m, err := strconv.ParseUint(ms, 10, 64)
		if err != nil {
			return "", fmt.Errorf("bad stream id %q", id)
		}
		return strconv.FormatUint(m+1, 10) + "-0", nil
	}
	return ms + "-" + strconv.FormatUint(n+1, 10), nil
}

// Export trims, then returns the records of pseudonym.
func (s *Sink) Export(ctx context.Context, pseudonym string) ([]audit.Record, error) {
	if pseudonym == "" {
		return nil, errors.New("audit redis sink export: empty pseudonym")
	}
	if err := s.Prune(ctx); err != nil {
		return nil, err
	}
	var out []audit.Record
	err := s.scan(ctx, pseudonym, func(ms []goredis.XMessage) error {
		for _, m := range ms {
			r, err := fromValues(m.Values)
			if err != nil {
				return fmt.Errorf("entry %s: %w", m.ID, err)
			}
			out = append(out, r)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("audit redis sink export: %w", err)
	}
	return out, nil
}

// Delete trims, then removes the entries of pseudonym. It sends one XDEL
// per page that holds any.
func (s *Sink) Delete(ctx context.Context, pseudonym string) (int, error) {
	if pseudonym == "" {
		return 0, errors.New("audit redis sink delete: empty pseudonym")
	}
	if err := s.Prune(ctx); err != nil {
		return 0, err
	}
	total := 0
	err := s.scan(ctx, pseudonym, func(ms []goredis.XMessage) error {
		ids := make([]string, len(ms))
		for i, m := range ms {
			ids[i] = m.ID
		}
		k, err := s.c.XDel(ctx, s.key, ids...).Result()
		total += int(k)
		return err
	})
	if err != nil {
		return total, fmt.Errorf("audit redis sink delete: %w", err)
	}
	return total, nil
}

// Close does nothing: the client belongs to the caller.
func (s *Sink) Close() error { return nil }
