package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/audit/audittest"

	"github.com/google/go-cmp/cmp"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgTables numbers the tables tests make on the shared server, so that
// -count=N runs get new ones.
var pgTables atomic.Uint32

// pgTableName is a new table of the test's own on the shared server.
func pgTableName(t testing.TB) string {
	name := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			return r
		}
		if r >= 'A' && r <= 'Z' {
			return r - 'A' + 'a'
		}
		return '_'
	}, strings.TrimPrefix(t.Name(), "Test"))
	return fmt.Sprintf("t%03d_%.24s", pgTables.Add(1), name)
}

// newPostgresSinkT opens a sink on the shared server, on a table of the
// test's own unless cfg names one, closed when the test ends.
func newPostgresSinkT(t testing.TB, cfg Config) *Sink {
	t.Helper()
	dsn := pg.DSN(t)
	if cfg.Table == "" {
		cfg.Table = pgTableName(t)
	}
	if cfg.Retention == 0 {
		cfg.Retention = audit.MaxRetention
	}
	s, err := New(context.Background(), dsn, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// pgPoolT is a pool on dsn for the test's own queries.
func pgPoolT(t testing.TB, dsn string) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func countRows(t testing.TB, p *pgxpool.Pool, table, where string, args ...any) int {
	t.Helper()
	var n int
	q := "SELECT count(*) FROM " + pgx.Identifier{table}.Sanitize()
	if where != "" {
		q += " WHERE " + where
	}
	if err := p.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// stored is how a record comes back from PostgreSQL: microseconds, UTC.
func stored(r audit.Record) audit.Record {
	r.DecisionTime = r.DecisionTime.Truncate(time.Microsecond).UTC()
	return r
}

// TestPostgresSinkRoundTrip writes sealed records with session keys and
// exports them: every field comes back exactly (the time at microsecond
// precision), the user id opens, and the table has its columns and
// indexes.
func TestPostgresSinkRoundTrip(t *testing.T) {
	ctx := context.Background()
	paris := time.FixedZone("CET", 3600)
	at := time.Date(2026, 3, 1, 12, 0, 0, 123456789, paris) // nanoseconds below the microsecond
	s := newPostgresSinkT(t, Config{Now: func() time.Time { return at.Add(time.Hour) }})
	sealer := audittest.Sealer(t)
	var recs []audit.Record
	for i, u := range []string{"alice", "bob", "alice", "", "alice"} {
		r := audit.Record{RequestID: audit.NewRequestID(), ModelVersion: "llama-3.1-70b@v2", DecisionTime: at.Add(time.Duration(i) * time.Second),
			Instance: fmt.Sprintf("gpu-%d", i), Mode: "sticky", Decision: "hit", IdentitySource: "session",
			SessionKeys: []string{fmt.Sprintf("s:%064x", i), "s:ü✓"}}
		if i == 1 {
			r.SessionKeys = nil
		}
		sealer.Attach(&r, u)
		recs = append(recs, r)
	}
	if err := s.Write(ctx, recs); err != nil {
		t.Fatal(err)
	}
	got, err := s.Export(ctx, sealer.Pseudonym("alice"))
	if err != nil {
		t.Fatal(err)
	}
	want := []audit.Record{stored(recs[0]), stored(recs[2]), stored(recs[4])}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("export (-want +got):\n%s", diff)
	}
	for i, r := range got {
		if r.DecisionTime.Location() != time.UTC || r.DecisionTime.Nanosecond() != 123456000 {
			t.Errorf("export[%d] time %v", i, r.DecisionTime)
		}
		if u, err := sealer.UserID(r); err != nil || u != "alice" {
			t.Errorf("export[%d] opens to %q, %v", i, u, err)
		}
	}

	p := pgPoolT(t, pg.DSN(t))
	// The record without a user has NULLs, not empty values.
	if n := countRows(t, p, s.Table(), "request_id = $1 AND user_ct IS NULL AND key_id IS NULL AND user_pseudonym IS NULL AND session_keys IS NOT NULL", recs[3].RequestID); n != 1 {
		t.Errorf("record without a user: %d rows with NULL user columns", n)
	}
	if n := countRows(t, p, s.Table(), "request_id = $1 AND session_keys IS NULL", recs[1].RequestID); n != 1 {
		t.Errorf("record without session keys: %d rows with NULL session_keys", n)
	}

	rows, err := p.Query(ctx, `SELECT column_name || ' ' || data_type || ' ' || is_nullable FROM information_schema.columns
		WHERE table_name = $1 ORDER BY ordinal_position`, s.Table())
	if err != nil {
		t.Fatal(err)
	}
	cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	wantCols := []string{
		"request_id uuid NO", "model_version text NO", "decision_time timestamp with time zone NO",
		"instance text NO", "mode text NO", "decision text NO", "identity_source text NO",
		"user_ct bytea YES", "key_id text YES", "user_pseudonym text YES", "session_keys ARRAY YES",
	}
	if diff := cmp.Diff(wantCols, cols); diff != "" {
		t.Errorf("columns (-want +got):\n%s", diff)
	}
	rows, err = p.Query(ctx, `SELECT indexdef FROM pg_indexes WHERE tablename = $1 ORDER BY indexname`, s.Table())
	if err != nil {
		t.Fatal(err)
	}
	idx, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	joined := strings.Join(idx, "\n")
	for _, w := range []string{"(decision_time)", "(user_pseudonym, decision_time) WHERE (user_pseudonym IS NOT NULL)", "UNIQUE INDEX"} {
		if !strings.Contains(joined, w) {
			t.Errorf("no index with %q in:\n%s", w, joined)
		}
	}
}

// TestPostgresSinkDuplicate: a request id written twice (a client that
// reuses its x-request-id, which Envoy passes through), in one batch or
// two, is stored once, the first time; the later ones are reported as
// skipped (the Writer counts them failed), never silently dropped, and the
// rest of the batch is stored.
func TestPostgresSinkDuplicate(t *testing.T) {
	ctx := context.Background()
	s := newPostgresSinkT(t, Config{})
	id := audit.NewRequestID()
	first := audit.Record{RequestID: id, DecisionTime: time.Now(), Instance: "gpu-a", Decision: "bind"}
	retry := first
	retry.Instance = "gpu-b"
	other := audit.Record{RequestID: audit.NewRequestID(), DecisionTime: time.Now(), Instance: "gpu-c"}
	var bad *audit.InvalidRecordsError
	if err := s.Write(ctx, []audit.Record{first, retry, other}); !errors.As(err, &bad) || !slices.Equal(bad.Index, []int{1}) {
		t.Fatalf("batch with a duplicate: %v, want record 1 reported", err)
	}
	if err := s.Write(ctx, []audit.Record{retry}); !errors.As(err, &bad) || !slices.Equal(bad.Index, []int{0}) {
		t.Fatalf("duplicate of a stored record: %v, want it reported", err)
	}
	p := pgPoolT(t, pg.DSN(t))
	if n := countRows(t, p, s.Table(), ""); n != 2 {
		t.Fatalf("%d rows, want 2", n)
	}
	if n := countRows(t, p, s.Table(), "request_id = $1 AND instance = 'gpu-a'", id); n != 1 {
		t.Fatal("the first write of the request id was not kept")
	}
}

// TestPostgresSinkInvalidRecords: records PostgreSQL would refuse are
// skipped and reported by position; the rest of the batch is stored.
func TestPostgresSinkInvalidRecords(t *testing.T) {
	ctx := context.Background()
	s := newPostgresSinkT(t, Config{})
	good := func() audit.Record {
		return audit.Record{RequestID: audit.NewRequestID(), DecisionTime: time.Now(), Decision: "hit"}
	}
	upper := good()
	upper.RequestID = strings.ToUpper(upper.RequestID)
	nul := good()
	nul.Instance = "gpu\x00a"
	badKey := good()
	badKey.SessionKeys = []string{"s:ok", "s:\xff"}
	recs := []audit.Record{good(), {RequestID: "secret-req-7", Decision: "hit"}, good(), upper, nul, badKey, good(), {}}
	err := s.Write(ctx, recs)
	var bad *audit.InvalidRecordsError
	if !errors.Is(err, audit.ErrInvalidRecord) || !errors.As(err, &bad) {
		t.Fatalf("Write = %v, want an *InvalidRecordsError", err)
	}
	if want := []int{1, 3, 4, 5, 7}; !slices.Equal(bad.Index, want) || bad.Total != len(recs) || len(bad.Reasons) != len(want) {
		t.Fatalf("skipped %v of %d (%q), want %v of %d", bad.Index, bad.Total, bad.Reasons, want, len(recs))
	}
	msg := err.Error()
	for _, w := range []string{s.Table(), "skipped 5 of 8", "record 1: request_id", "record 4: instance", "record 5: session_keys"} {
		if !strings.Contains(msg, w) {
			t.Errorf("error %q lacks %q", msg, w)
		}
	}
	if strings.Contains(msg, "secret-req-7") || strings.Contains(msg, upper.RequestID) {
		t.Errorf("error %q shows a value", msg)
	}
	p := pgPoolT(t, pg.DSN(t))
	if n := countRows(t, p, s.Table(), ""); n != 3 {
		t.Fatalf("%d rows stored, want the 3 valid ones", n)
	}
	if s.Invalid() != 5 {
		t.Fatalf("Invalid() = %d, want 5", s.Invalid())
	}
	// A batch of invalid records only: nothing to send, still reported.
	if err := s.Write(ctx, []audit.Record{{RequestID: "x"}}); !errors.Is(err, audit.ErrInvalidRecord) {
		t.Fatalf("all-invalid batch: %v", err)
	}
}

// TestPostgresSinkPrune: Prune (the retention job) deletes the rows older
// than the retention, in bounded statements, and keeps the newer ones;
// Export never returns an expired row, even before Prune.
func TestPostgresSinkPrune(t *testing.T) {
	ctx := context.Background()
	clk := audittest.NewClock(time.Date(2026, 5, 10, 12, 0, 0, 0, time.UTC))
	s := newPostgresSinkT(t, Config{Retention: 24 * time.Hour, PruneBatch: 2, Now: clk.Now})
	sealer := audittest.Sealer(t)
	var recs []audit.Record
	ages := []time.Duration{72 * time.Hour, 48 * time.Hour, 25 * time.Hour, 24*time.Hour + time.Microsecond, 23 * time.Hour, time.Minute, 0}
	for _, age := range ages {
		r := audit.Record{RequestID: audit.NewRequestID(), DecisionTime: clk.Now().Add(-age), Decision: "hit"}
		sealer.Attach(&r, "alice")
		recs = append(recs, r)
	}
	if err := s.Write(ctx, recs); err != nil {
		t.Fatal(err)
	}
	// Rows put there directly, as an older tether or an import would.
	p := pgPoolT(t, pg.DSN(t))
	for _, age := range []time.Duration{40 * 24 * time.Hour, 30 * time.Hour, time.Hour} {
		_, err := p.Exec(ctx, `INSERT INTO `+pgx.Identifier{s.Table()}.Sanitize()+
			` (request_id, model_version, decision_time, instance, mode, decision, identity_source)
			VALUES (gen_random_uuid(), 'v0', $1, 'gpu-x', 'sticky', 'bind', 'header')`, clk.Now().Add(-age))
		if err != nil {
			t.Fatal(err)
		}
	}
	got, err := s.Export(ctx, sealer.Pseudonym("alice"))
	if err != nil {
		t.Fatal(err)
	}
	if want := []audit.Record{stored(recs[4]), stored(recs[5]), stored(recs[6])}; !cmp.Equal(want, got) {
		t.Fatalf("export before prune (-want +got):\n%s", cmp.Diff(want, got))
	}
	if err := s.Prune(ctx); err != nil {
		t.Fatal(err)
	}
	cutoff := clk.Now().Add(-24 * time.Hour)
	if n := countRows(t, p, s.Table(), "decision_time < $1", cutoff); n != 0 {
		t.Fatalf("%d expired rows left", n)
	}
	if n := countRows(t, p, s.Table(), "decision_time >= $1", cutoff); n != 4 {
		t.Fatalf("%d rows kept, want 4", n)
	}
	// A day later, everything has expired (the newest row by a microsecond).
	clk.Add(24*time.Hour + time.Microsecond)
	if err := s.Prune(ctx); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, p, s.Table(), ""); n != 0 {
		t.Fatalf("%d rows left a day later", n)
	}
}

// TestPostgresSinkConfigRefused: more than 30 days of retention, or a
// table name that is not a plain identifier, is refused before any
// connection is made.
func TestPostgresSinkConfigRefused(t *testing.T) {
	ctx := context.Background()
	const dsn = "postgres://u:hunter2@192.0.2.1:5432/db" // never dialled
	for _, d := range []time.Duration{0, -time.Minute, 31 * 24 * time.Hour} {
		_, err := New(ctx, dsn, Config{Retention: d})
		if err == nil {
			t.Fatalf("retention %v accepted", d)
		}
		if d > 0 && !strings.Contains(err.Error(), "30 days") {
			t.Errorf("retention %v: error %q does not name the 30 days", d, err)
		}
	}
	for _, table := range []string{"Routing", "a-b", "a.b", "1abc", `x"; DROP TABLE y; --`, strings.Repeat("a", 41)} {
		if _, err := New(ctx, dsn, Config{Table: table, Retention: time.Hour}); err == nil || !strings.Contains(err.Error(), "table") {
			t.Errorf("table %q: %v", table, err)
		}
	}
	if err := (Config{Retention: time.Hour, PruneBatch: -1}).Validate(); err == nil {
		t.Error("negative prune batch accepted")
	}
}

// TestPostgresSinkDelete: forget removes exactly the user's rows.
func TestPostgresSinkDelete(t *testing.T) {
	ctx := context.Background()
	s := newPostgresSinkT(t, Config{})
	sealer := audittest.Sealer(t)
	var recs []audit.Record
	for i := range 30 {
		r := audit.Record{RequestID: audit.NewRequestID(), DecisionTime: time.Now(), Decision: "hit"}
		sealer.Attach(&r, []string{"alice", "bob", ""}[i%3])
		recs = append(recs, r)
	}
	if err := s.Write(ctx, recs); err != nil {
		t.Fatal(err)
	}
	n, err := s.Delete(ctx, sealer.Pseudonym("alice"))
	if err != nil || n != 10 {
		t.Fatalf("Delete = %d, %v; want 10", n, err)
	}
	p := pgPoolT(t, pg.DSN(t))
	if n := countRows(t, p, s.Table(), ""); n != 20 {
		t.Fatalf("%d rows left, want 20", n)
	}
	if n := countRows(t, p, s.Table(), "user_pseudonym = $1", sealer.Pseudonym("bob")); n != 10 {
		t.Fatalf("bob: %d rows, want 10", n)
	}
	if got, err := s.Export(ctx, sealer.Pseudonym("alice")); err != nil || len(got) != 0 {
		t.Fatalf("alice after forget: %d records, %v", len(got), err)
	}
	if n, err := s.Delete(ctx, sealer.Pseudonym("alice")); err != nil || n != 0 {
		t.Fatalf("second Delete = %d, %v", n, err)
	}
	if _, err := s.Delete(ctx, ""); err == nil {
		t.Fatal("empty pseudonym accepted")
	}
	if _, err := s.Export(ctx, ""); err == nil {
		t.Fatal("empty pseudonym accepted")
	}
}

// TestPostgresSinkWriter drives the sink through a Writer: Close flushes
// every record, and the Writer's prune tick (the retention job) removes
// an expired row.
func TestPostgresSinkWriter(t *testing.T) {
	ctx := context.Background()
	s := newPostgresSinkT(t, Config{Retention: time.Hour})
	p := pgPoolT(t, pg.DSN(t))
	_, err := p.Exec(ctx, `INSERT INTO `+pgx.Identifier{s.Table()}.Sanitize()+
		` (request_id, model_version, decision_time, instance, mode, decision, identity_source)
		VALUES (gen_random_uuid(), 'v0', now() - interval '2 hours', 'gpu-x', 'sticky', 'bind', 'header')`)
	if err != nil {
		t.Fatal(err)
	}
	var errs []error
	var mu sync.Mutex
	w, err := audit.NewWriter(s, audit.WriterConfig{Batch: 7, PruneInterval: 10 * time.Millisecond, OnError: func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	for range 100 {
		if !w.Write(audit.Record{RequestID: audit.NewRequestID(), DecisionTime: time.Now(), Decision: "hit", SessionKeys: []string{"s:1"}}) {
			t.Fatal("write dropped")
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for countRows(t, p, s.Table(), "decision_time < now() - interval '1 hour'") != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the writer's prune did not remove the expired row in 5 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := w.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, p, s.Table(), ""); n != 100 || w.Written() != 100 || w.Failed() != 0 {
		t.Fatalf("%d rows, written %d, failed %d; want 100, 100, 0", n, w.Written(), w.Failed())
	}
	mu.Lock()
	defer mu.Unlock()
	if len(errs) != 0 {
		t.Fatalf("writer errors: %v", errs)
	}
}

// TestPostgresSinkPoolAndMigration: a sink on the caller's pool leaves it
// open; replicas opening together all succeed; a role without CREATE
// privilege opens an existing table; a table of another shape is refused.
func TestPostgresSinkPoolAndMigration(t *testing.T) {
	ctx := context.Background()
	dsn := pg.DSN(t)
	p := pgPoolT(t, dsn)
	table := pgTableName(t)

	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() {
			s, err := newFromPool(ctx, p, Config{Table: table, Retention: time.Hour})
			if err == nil {
				err = s.Close()
			}
			errs[i] = err
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("concurrent opens: %v", err)
	}
	if err := p.Ping(ctx); err != nil {
		t.Fatalf("the caller's pool after the sinks' Close: %v", err)
	}

	// A role that may only insert, select and delete.
	role := table + "_w"
	for _, q := range []string{
		`CREATE ROLE ` + role + ` LOGIN`,
		`GRANT INSERT, SELECT, DELETE ON ` + table + ` TO ` + role,
	} {
		if _, err := p.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	roleDSN := fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", role, cfg.Host, cfg.Port, cfg.Database)
	s, err := New(ctx, roleDSN, Config{Table: table, Retention: time.Hour})
	if err != nil {
		t.Fatalf("open as a role without CREATE: %v", err)
	}
	if err := s.Write(ctx, []audit.Record{{RequestID: audit.NewRequestID(), DecisionTime: time.Now()}}); err != nil {
		t.Fatal(err)
	}
	if err := s.Prune(ctx); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	if _, err := New(ctx, roleDSN, Config{Table: table + "_new", Retention: time.Hour}); err == nil ||
		!strings.Contains(err.Error(), "create") || !strings.Contains(err.Error(), table+"_new") {
		t.Fatalf("creating a table without CREATE privilege: %v", err)
	}

	other := table + "_other"
	if _, err := p.Exec(ctx, `CREATE TABLE `+other+` (request_id uuid PRIMARY KEY, note text)`); err != nil {
		t.Fatal(err)
	}
	if _, err := newFromPool(ctx, p, Config{Table: other, Retention: time.Hour}); err == nil ||
		!strings.Contains(err.Error(), "lacks the sink's columns") || !strings.Contains(err.Error(), other) {
		t.Fatalf("table of another shape: %v", err)
	}
}

// TestPostgresSinkBadDSN: a malformed DSN gives an error without its
// password; a server that does not answer gives an error, naming the
// table and the host but not the password, within the connect timeout.
func TestPostgresSinkBadDSN(t *testing.T) {
	ctx := context.Background()
	const pw = "hunter2-s3cret"
	for _, dsn := range []string{
		"postgres://tether:" + pw + "@127.0.0.1:notaport/db",
		"postgres://tether:" + pw + "@[::1/db",
		"host=127.0.0.1 password " + pw,
		"host=127.0.0.1 password='" + pw,
		"postgres://tether:" + pw + "@127.0.0.1/db?sslmode=sometimes",
	} {
		_, err := New(ctx, dsn, Config{Retention: time.Hour})
		if err == nil {
			t.Errorf("%q accepted", dsn)
			continue
		}
		if msg := err.Error(); strings.Contains(msg, pw) || !strings.Contains(msg, "dsn does not parse") || !strings.Contains(msg, "routing_audit") {
			t.Errorf("malformed dsn: error %q", msg)
		}
	}

	// A server that accepts connections and never answers.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var held []net.Conn
	var mu sync.Mutex
	acceptDone := make(chan struct{})
	go func() {
		defer close(acceptDone)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	defer func() {
		_ = l.Close()
		<-acceptDone
		for _, c := range held {
			_ = c.Close()
		}
	}()
	addr := l.Addr().(*net.TCPAddr)
	for _, tc := range []struct {
		name, dsn string
		cfg       Config
	}{
		{"silent server", fmt.Sprintf("postgres://tether:%s@127.0.0.1:%d/audit", pw, addr.Port), Config{ConnectTimeout: 300 * time.Millisecond}},
		{"connect_timeout in the dsn", fmt.Sprintf("host=127.0.0.1 port=%d dbname=audit user=tether password=%s connect_timeout=1 sslmode=disable", addr.Port, pw), Config{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Retention = time.Hour
			start := time.Now()
			_, err := New(ctx, tc.dsn, tc.cfg)
			took := time.Since(start)
			if err == nil {
				t.Fatal("opened")
			}
			msg := err.Error()
			if strings.Contains(msg, pw) || !strings.Contains(msg, "open routing_audit") || !strings.Contains(msg, fmt.Sprintf("127.0.0.1:%d/audit", addr.Port)) {
				t.Errorf("error %q", msg)
			}
			if took > 3*time.Second {
				t.Errorf("took %v", took)
			}
			t.Logf("%v: %v", took.Round(time.Millisecond), err)
		})
	}
}

// BenchmarkPostgresSinkWrite writes batches of 256 records (the Writer's
// default batch).
func BenchmarkPostgresSinkWrite(b *testing.B) {
	s := newPostgresSinkT(b, Config{})
	sealer := audittest.Sealer(b)
	batch := make([]audit.Record, 256)
	ctx := context.Background()
	for b.Loop() {
		for i := range batch {
			r := audit.Record{RequestID: audit.NewRequestID(), ModelVersion: "v1", DecisionTime: time.Now(), Instance: "gpu-a",
				Mode: "sticky", Decision: "hit", IdentitySource: "session", SessionKeys: []string{"s:0123456789abcdef"}}
			sealer.Attach(&r, "alice")
			batch[i] = r
		}
		if err := s.Write(ctx, batch); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*len(batch)), "µs/record")
}

// gate is a TCP proxy on loopback to a PostgreSQL server that, while
// closed, accepts connections and hangs up at once, as a server that is
// restarting does.
type gate struct {
	addr    string
	backend string
	open    atomic.Bool
}

func newGate(t *testing.T, backend string) *gate {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &gate{addr: l.Addr().String(), backend: backend}
	var conns sync.WaitGroup
	t.Cleanup(func() { _ = l.Close(); conns.Wait() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if !g.open.Load() {
				_ = c.Close()
				continue
			}
			conns.Go(func() { g.pipe(c) })
		}
	}()
	return g
}

// pipe copies between c and a new connection to the backend until either
// side closes.
func (g *gate) pipe(c net.Conn) {
	defer c.Close()
	b, err := net.Dial("tcp", g.backend)
	if err != nil {
		return
	}
	defer b.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(b, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, b); done <- struct{}{} }()
	<-done
}

// TestPostgresSinkLazy: while the server hangs up on every connection, a
// sink that is not Lazy refuses to open and a Lazy one opens, not Ready,
// and fails each call with the connection error; once the server answers,
// the Lazy sink creates its table and stores, exports and forgets. A
// Lazy opening still fails on an error other than a connection's.
func TestPostgresSinkLazy(t *testing.T) {
	ctx := context.Background()
	dsn := pg.DSN(t)
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	g := newGate(t, u.Host)
	u.Host = g.addr
	gated := u.String()
	table := pgTableName(t)
	cfg := Config{Table: table, Retention: time.Hour, ConnectTimeout: 2 * time.Second}

	if _, err := New(ctx, gated, cfg); err == nil || !strings.Contains(err.Error(), "open "+table) {
		t.Fatalf("opening while the server hangs up, not Lazy: %v, want refused", err)
	}
	cfg.Lazy = true
	s, err := New(ctx, gated, cfg)
	if err != nil {
		t.Fatalf("Lazy opening while the server hangs up: %v", err)
	}
	defer s.Close()
	if s.Ready() {
		t.Fatal("Ready before the server was reached")
	}
	rec := audit.Record{RequestID: audit.NewRequestID(), ModelVersion: "v1", DecisionTime: time.Now(), UserPseudonym: "p1"}
	var ce *pgconn.ConnectError
	if err := s.Write(ctx, []audit.Record{rec}); !errors.As(err, &ce) {
		t.Fatalf("Write while the server hangs up: %v, want a connection error", err)
	}
	if _, err := s.Export(ctx, "p1"); !errors.As(err, &ce) {
		t.Fatalf("Export while the server hangs up: %v, want a connection error", err)
	}

	g.open.Store(true)
	if err := s.Write(ctx, []audit.Record{rec}); err != nil {
		t.Fatalf("Write once the server answers: %v", err)
	}
	if !s.Ready() {
		t.Error("not Ready after a Write reached the server")
	}
	p := pgPoolT(t, dsn)
	if n := countRows(t, p, table, ""); n != 1 {
		t.Fatalf("%d rows, want the record written after the server came back", n)
	}
	if got, err := s.Export(ctx, "p1"); err != nil || len(got) != 1 || got[0].RequestID != rec.RequestID {
		t.Fatalf("Export: %v, %v", got, err)
	}
	if n, err := s.Delete(ctx, "p1"); err != nil || n != 1 {
		t.Fatalf("Delete: %d, %v", n, err)
	}

	// A table of another shape is a configuration error, Lazy or not.
	other := table + "_other"
	if _, err := p.Exec(ctx, `CREATE TABLE `+other+` (id int)`); err != nil {
		t.Fatal(err)
	}
	cfg.Table = other
	if _, err := New(ctx, gated, cfg); err == nil || !strings.Contains(err.Error(), other) {
		t.Fatalf("Lazy opening of a table of another shape: %v, want refused", err)
	}
}

// newFromPool builds a sink on pool, which the caller keeps
// and closes, and creates the table and its indexes if the table is
// missing.
func newFromPool(ctx context.Context, pool *pgxpool.Pool, cfg Config) (*Sink, error) {
	if pool == nil {
		return nil, errors.New("audit postgres sink: nil pool")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	c := pool.Config().ConnConfig
	return newSink(ctx, pool, cfg, c.Host+":"+strconv.Itoa(int(c.Port))+"/"+c.Database)
}
