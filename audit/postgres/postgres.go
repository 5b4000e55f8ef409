// Package postgres is the routing audit's PostgreSQL sink,
// audit.sink = "postgres". It stores one row per record, indexed by the
// user's pseudonym. So export and forget read only that user's rows.
package postgres

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/tetherproxy/tether/audit"

	"github.com/cespare/xxhash/v2"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Config configures a Sink. Zero values take the defaults.
type Config struct {
	// Table is the table's name, "routing_audit" by default. It holds
	// lower-case letters, digits and underscores, and starts with a letter
	// or an underscore. It is at most 40 characters: its index names add 19
	// more, and PostgreSQL cuts names at 63. It is looked up on the
	// connection's search_path. Pick a schema with the DSN, as in
	// …?search_path=audit.
	Table string
	// Retention is at most MaxRetention.
	Retention time.Duration
	// PruneBatch is the most rows one DELETE of Prune removes, 10000 by
	// default. Prune repeats it until fewer are left.
	PruneBatch int
	// ConnectTimeout bounds each connection attempt of a pool the sink
	// opens: dial, TLS and startup. The default is 5 s. A connect_timeout
	// in the DSN overrides it.
	ConnectTimeout time.Duration
	// Now is the clock (default time.Now).
	Now func() time.Time
	// Lazy opens the sink even when the server cannot be reached. That
	// covers a connection error and the opening's deadline passing. Any
	// other error still fails the opening.
	//
	// The first call that reaches the server then checks the table, and
	// creates it. Until one does, every call fails with the connection
	// error. tether serve sets Lazy, so a database outage at a restart
	// costs records, not routing. Those records are counted as failed. The
	// CLI does not set it.
	Lazy bool
}

// DefaultTable is the table Sink uses when Config.Table is empty.
const DefaultTable = "routing_audit"

var tableNameRE = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,39}$`)

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.Table != "" && !tableNameRE.MatchString(c.Table) {
		return fmt.Errorf("audit postgres sink: table %q: want lower-case letters, digits and _, not starting with a digit, at most 40", c.Table)
	}
	if err := audit.CheckRetention(c.Retention); err != nil {
		return fmt.Errorf("audit postgres sink: %w", err)
	}
	if c.PruneBatch < 0 || c.ConnectTimeout < 0 {
		return fmt.Errorf("audit postgres sink: negative prune_batch (%d) or connect_timeout (%v)", c.PruneBatch, c.ConnectTimeout)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.PruneBatch == 0 {
		c.PruneBatch = 10000
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 5 * time.Second
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// sortSkipped orders the skipped records by position, reasons along.
func sortSkipped(e *audit.InvalidRecordsError) {
	order := make([]int, len(e.Index))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return e.Index[a] - e.Index[b] })
	idx, why := make([]int, len(order)), make([]string, len(order))
	for i, o := range order {
		idx[i], why[i] = e.Index[o], e.Reasons[o]
	}
	e.Index, e.Reasons = idx, why
}

// Sink stores records in a PostgreSQL table, one row per record. README.md
// shows the table. The request id is the primary key. A record whose
// request id is already stored, as on an Envoy retry, is ignored.
//
// Prune removes rows older than the retention; the Writer calls it every
// PruneInterval. Such rows are never exported. Forget and export use an
// index on the pseudonym.
//
// decision_time is stored with PostgreSQL's precision, the microsecond.
// The nanoseconds below it are truncated. Export returns it in UTC.
type Sink struct {
	pool  *pgxpool.Pool
	owned bool // the sink opened pool and closes it
	cfg   Config
	where string // host:port/database, for errors; no user or password

	insertSQL, pruneSQL, deleteSQL, exportSQL string

	invalid atomic.Uint64
	ready   atomic.Bool // the table was checked (migrate)
	migrMu  sync.Mutex  // one migrate at a time
}

var (
	_ audit.Sink   = (*Sink)(nil)
	_ audit.Pruner = (*Sink)(nil)
)

// New opens a pool on dsn. dsn is a postgres:// URL or key=value pairs,
// and may carry pgxpool's pool_* settings. New creates the table and its
// indexes if the table is missing. It returns a sink that closes the pool
// on Close. ctx bounds the opening. Errors show the DSN's host, port and
// database, never the DSN itself.
func New(ctx context.Context, dsn string, cfg Config) (*Sink, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	pc, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		// pgx's message quotes the DSN, and masks the password on a
		// best-effort basis only. So say nothing of it.
		return nil, fmt.Errorf("audit postgres sink: open %s: the dsn does not parse (not shown: it may hold a password); "+
			"want postgres://user@host:port/database?sslmode=… or host=… port=… dbname=… pairs", cfg.Table)
	}
	if pc.ConnConfig.ConnectTimeout == 0 {
		pc.ConnConfig.ConnectTimeout = cfg.ConnectTimeout
	}
	where := pc.ConnConfig.Host + ":" + strconv.Itoa(int(pc.ConnConfig.Port)) + "/" + pc.ConnConfig.Database
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("audit postgres sink: open %s on %s: %w", cfg.Table, where, err)
	}
	s, err := newSink(ctx, pool, cfg, where)
	if err != nil {
		pool.Close()
		return nil, err
	}
	s.owned = true
	return s, nil
}

const columns = `request_id, model_version, decision_time, instance, mode, decision, identity_source, user_ct, key_id, user_pseudonym, session_keys`

func newSink(ctx context.Context, pool *pgxpool.Pool, cfg Config, where string) (*Sink, error) {
	t := pgx.Identifier{cfg.Table}.Sanitize()
	s := &Sink{
		pool: pool, cfg: cfg, where: where,
		insertSQL: `INSERT INTO ` + t + ` (` + columns + `) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ` +
			`ON CONFLICT (request_id) DO NOTHING`,
		pruneSQL: `DELETE FROM ` + t + ` WHERE request_id IN (SELECT request_id FROM ` + t +
			` WHERE decision_time < $1 ORDER BY decision_time LIMIT $2)`,
		deleteSQL: `DELETE FROM ` + t + ` WHERE user_pseudonym = $1`,
		exportSQL: `SELECT request_id::text, model_version, decision_time, instance, mode, decision, identity_source, ` +
			`user_ct, coalesce(key_id, ''), coalesce(user_pseudonym, ''), session_keys FROM ` + t +
			` WHERE user_pseudonym = $1 AND decision_time >= $2 ORDER BY decision_time, request_id`,
	}
	if err := s.ensure(ctx); err != nil {
		var ce *pgconn.ConnectError
		unreachable := errors.As(err, &ce) || errors.Is(err, context.DeadlineExceeded)
		if !cfg.Lazy || !unreachable {
			return nil, fmt.Errorf("audit postgres sink: open %s on %s: %w", cfg.Table, where, err)
		}
	}
	return s, nil
}

// Ready reports whether the sink has reached the server and checked its
// table. Only a Lazy sink can be open without.
func (s *Sink) Ready() bool { return s.ready.Load() }

// ensure checks the table once, and creates it if missing. It runs when
// the sink opens. A Lazy sink that could not reach the server then runs it
// at each call until one does.
func (s *Sink) ensure(ctx context.Context) error {
	if s.ready.Load() {
		return nil
	}
	s.migrMu.Lock()
	defer s.migrMu.Unlock()
	if s.ready.Load() {
		return nil
	}
	if err := s.migrate(ctx); err != nil {
		return err
	}
	s.ready.Store(true)
	return nil
}

// migrate creates the table and its indexes when the table is missing. It
// checks that the table has the sink's columns. An advisory lock
// serialises replicas that start together, since concurrent CREATE TABLE
// IF NOT EXISTS can fail. A table that exists needs no CREATE privilege.
// So the sink can run as a role that may only insert, select and delete.
func (s *Sink) migrate(ctx context.Context) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	lock := int64(xxhash.Sum64String("tether audit table " + s.cfg.Table))
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, lock); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, s.cfg.Table).Scan(&exists); err != nil {
		return fmt.Errorf("look up the table: %w", err)
	}
	t := pgx.Identifier{s.cfg.Table}.Sanitize()
	if !exists {
		for _, stmt := range []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
				request_id      UUID PRIMARY KEY,
				model_version   TEXT NOT NULL,
				decision_time   TIMESTAMPTZ NOT NULL,
				instance        TEXT NOT NULL,
				mode            TEXT NOT NULL,
				decision        TEXT NOT NULL,
				identity_source TEXT NOT NULL,
				user_ct         BYTEA,
				key_id          TEXT,
				user_pseudonym  TEXT,
				session_keys    TEXT[]
			)`,
			// Retention: Prune deletes the oldest rows first.
			`CREATE INDEX IF NOT EXISTS ` + pgx.Identifier{s.cfg.Table + "_decision_time_idx"}.Sanitize() +
				` ON ` + t + ` (decision_time)`,
			// Forget and export: a user's rows, in time order. Rows without
			// a user are left out of it.
			`CREATE INDEX IF NOT EXISTS ` + pgx.Identifier{s.cfg.Table + "_user_pseudonym_idx"}.Sanitize() +
				` ON ` + t + ` (user_pseudonym, decision_time) WHERE user_pseudonym IS NOT NULL`,
		} {
			if _, err := tx.Exec(ctx, stmt); err != nil {
				return fmt.Errorf("create: %w", err)
			}
		}
	}
	if _, err := tx.Exec(ctx, `SELECT `+columns+` FROM `+t+` LIMIT 0`); err != nil {
		return fmt.Errorf("the table lacks the sink's columns: %w", err)
	}
	return tx.Commit(ctx)
}

// Table is the table's name.
func (s *Sink) Table() string { return s.cfg.Table }

// Invalid counts the records Write skipped as invalid (see
// InvalidRecordsError).
func (s *Sink) Invalid() uint64 { return s.invalid.Load() }

func (s *Sink) wrap(op string, err error) error {
	return fmt.Errorf("audit postgres sink: %s %s: %w", op, s.cfg.Table, err)
}

// Write stores recs in one round trip, once a connection has prepared the
// statement. It sends one INSERT … ON CONFLICT (request_id) DO NOTHING per
// record, pipelined in a pgx.Batch that runs as one transaction. A record
// already stored is ignored.
//
// A record PostgreSQL would refuse is skipped, so it cannot fail the batch
// (see InvalidRecordsError). Write stores the others and returns an
// *InvalidRecordsError. When the batch itself failed, it returns that
// error joined with the batch's.
func (s *Sink) Write(ctx context.Context, recs []audit.Record) error {
	if len(recs) == 0 {
		return nil
	}
	if err := s.ensure(ctx); err != nil {
		return s.wrap("write", err)
	}
	var bad *audit.InvalidRecordsError
	skip := func(i int, reason string) {
		if bad == nil {
			bad = &audit.InvalidRecordsError{Table: s.cfg.Table, Total: len(recs)}
		}
		bad.Index = append(bad.Index, i)
		bad.Reasons = append(bad.Reasons, reason)
	}
	b := &pgx.Batch{}
	var queued []int // positions in recs of the queued inserts
	for i, r := range recs {
		if reason := invalidReason(r); reason != "" {
			skip(i, reason)
			continue
		}
		b.Queue(s.insertSQL, r.RequestID, r.ModelVersion, r.DecisionTime, r.Instance, r.Mode, r.Decision,
			r.IdentitySource, nullBytes(r.UserCiphertext), nullText(r.KeyID), nullText(r.UserPseudonym), nullTexts(r.SessionKeys))
		queued = append(queued, i)
	}
	var err error
	if b.Len() > 0 {
		br := s.pool.SendBatch(ctx, b)
		for _, i := range queued {
			tag, e := br.Exec()
			if e != nil {
				err = e
				break
			}
			if tag.RowsAffected() == 0 {
				// ON CONFLICT DO NOTHING: a client reused an x-request-id.
				// Envoy passes a client's own through. The row already
				// stored stays. This one is counted, not silently lost.
				skip(i, "request_id already stored (a reused x-request-id)")
			}
		}
		if e := br.Close(); err == nil {
			err = e
		}
	}
	if bad != nil {
		sortSkipped(bad) // duplicates are found after the invalid ones

		s.invalid.Add(uint64(len(bad.Index)))
		if err != nil {
			return errors.Join(s.wrap("write", err), bad)
		}
		return bad
	}
	if err != nil {
		return s.wrap("write", err)
	}
	return nil
}

// invalidReason says why PostgreSQL would refuse r, or "" if it would not.
// The request id must be a lower-case canonical UUID, as PostgreSQL gives
// it back. The user id's seal is bound to its exact text.
func invalidReason(r audit.Record) string {
	if !isLowerUUID(r.RequestID) {
		return "request_id is not a UUID (lower-case, 8-4-4-4-12 hex digits)"
	}
	for _, f := range [...]struct{ name, v string }{
		{"model_version", r.ModelVersion}, {"instance", r.Instance}, {"mode", r.Mode},
		{"decision", r.Decision}, {"identity_source", r.IdentitySource}, {"key_id", r.KeyID},
		{"user_pseudonym", r.UserPseudonym},
	} {
		if !storableText(f.v) {
			return f.name + " is not UTF-8 or holds a NUL byte"
		}
	}
	for _, k := range r.SessionKeys {
		if !storableText(k) {
			return "session_keys: a key is not UTF-8 or holds a NUL byte"
		}
	}
	return ""
}

func isLowerUUID(s string) bool {
	if len(s) != 36 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
				return false
			}
		}
	}
	return true
}

func storableText(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

// nullText, nullBytes and nullTexts store an empty value as NULL. Export
// gives NULL back as the empty value.
func nullText(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func nullBytes(b []byte) any {
	if len(b) == 0 {
		return nil
	}
	return b
}

func nullTexts(ss []string) any {
	if len(ss) == 0 {
		return nil
	}
	return ss
}

// Prune deletes the rows whose decision_time is older than now minus the
// retention. It deletes oldest first, at most PruneBatch rows per
// statement, until none is left or ctx ends. The next Prune goes on from
// there.
func (s *Sink) Prune(ctx context.Context) error {
	if err := s.ensure(ctx); err != nil {
		return s.wrap("prune", err)
	}
	cutoff := s.cfg.Now().Add(-s.cfg.Retention)
	for {
		tag, err := s.pool.Exec(ctx, s.pruneSQL, cutoff, s.cfg.PruneBatch)
		if err != nil {
			return s.wrap("prune", err)
		}
		if tag.RowsAffected() < int64(s.cfg.PruneBatch) {
			return nil
		}
	}
}

// Delete removes every row of pseudonym, expired or not, in one statement.
func (s *Sink) Delete(ctx context.Context, pseudonym string) (int, error) {
	if pseudonym == "" {
		return 0, errors.New("audit postgres sink: delete: empty pseudonym")
	}
	if err := s.ensure(ctx); err != nil {
		return 0, s.wrap("delete", err)
	}
	tag, err := s.pool.Exec(ctx, s.deleteSQL, pseudonym)
	if err != nil {
		return 0, s.wrap("delete", err)
	}
	return int(tag.RowsAffected()), nil
}

// Export returns the unexpired records of pseudonym, with decision_time in
// UTC. They come oldest first, by decision_time, then request_id.
func (s *Sink) Export(ctx context.Context, pseudonym string) ([]audit.Record, error) {
	if pseudonym == "" {
		return nil, errors.New("audit postgres sink: export: empty pseudonym")
	}
	if err := s.ensure(ctx); err != nil {
		return nil, s.wrap("export", err)
	}
	rows, err := s.pool.Query(ctx, s.exportSQL, pseudonym, s.cfg.Now().Add(-s.cfg.Retention))
	if err != nil {
		return nil, s.wrap("export", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (audit.Record, error) {
		var r audit.Record
		err := row.Scan(&r.RequestID, &r.ModelVersion, &r.DecisionTime, &r.Instance, &r.Mode, &r.Decision,
			&r.IdentitySource, &r.UserCiphertext, &r.KeyID, &r.UserPseudonym, &r.SessionKeys)
		r.DecisionTime = r.DecisionTime.UTC()
		return r, err
	})
	if err != nil {
		return nil, s.wrap("export", err)
	}
	return out, nil
}

// Close closes the pool if the sink opened it in New. It does not close a
// pool it was given.
func (s *Sink) Close() error {
	if s.owned {
		s.pool.Close()
	}
	return nil
}
