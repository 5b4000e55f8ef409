package sinks

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/audit/audittest"
	"github.com/tetherproxy/tether/audit/file"
	"github.com/tetherproxy/tether/audit/postgres"
	auditredis "github.com/tetherproxy/tether/audit/redis"

	"github.com/jackc/pgx/v5"
	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/testenv"
)

// TestNoPlaintextUserID writes decisions through the Writer to every sink,
// exports and forgets, then reads back everything stored (files, Redis
// key names, stream fields and values, every PostgreSQL table of a server
// of its own) and fails if the plaintext user id appears anywhere, as it
// is or in hex or base64.
func TestNoPlaintextUserID(t *testing.T) {
	const user = "plain-user-7f3c@example.org"
	sealer := audittest.Sealer(t)
	records := func() []audit.Record {
		var out []audit.Record
		for i := range 50 {
			r := audit.Record{RequestID: audit.NewRequestID(), ModelVersion: "v1", DecisionTime: time.Now(), Instance: "gpu-a",
				Mode: "sticky", Decision: "bind", IdentitySource: "user_device", SessionKeys: []string{"s:9f86d081884c7d65"}}
			u := user
			if i%3 == 0 {
				u = "someone-else"
			}
			sealer.Attach(&r, u)
			out = append(out, r)
		}
		return out
	}
	drive := func(t *testing.T, sink audit.Sink) {
		t.Helper()
		ctx := context.Background()
		w, err := audit.NewWriter(sink, audit.WriterConfig{})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range records() {
			if !w.Write(r) {
				t.Fatal("write dropped")
			}
		}
		if err := w.Close(ctx); err != nil {
			t.Fatal(err)
		}
		got, err := sink.Export(ctx, sealer.Pseudonym("someone-else"))
		if err != nil || len(got) != 17 {
			t.Fatalf("export: %d records, %v", len(got), err)
		}
		if n, err := sink.Delete(ctx, sealer.Pseudonym(user)); err != nil || n != 33 {
			t.Fatalf("forget: %d records, %v; want 33", n, err)
		}
		// Write the user's records again, so the grep below has them.
		w, err = audit.NewWriter(sink, audit.WriterConfig{})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range records() {
			w.Write(r)
		}
		if err := w.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	forms := map[string]string{
		"plain":            user,
		"hex":              hex.EncodeToString([]byte(user)),
		"HEX":              strings.ToUpper(hex.EncodeToString([]byte(user))),
		"base64":           base64.RawStdEncoding.EncodeToString([]byte(user)),
		"base64url":        base64.RawURLEncoding.EncodeToString([]byte(user)),
		"base64 (padded)":  base64.StdEncoding.EncodeToString([]byte(user)),
		"base64url (pad.)": base64.URLEncoding.EncodeToString([]byte(user)),
	}
	check := func(t *testing.T, where string, b []byte) {
		t.Helper()
		for form, v := range forms {
			if bytes.Contains(b, []byte(v)) {
				t.Fatalf("plaintext user id (%s) found in %s", form, where)
			}
		}
	}

	t.Run("file", func(t *testing.T) {
		dir := t.TempDir()
		s := openFile(t, file.Config{Dir: dir, Retention: audit.MaxRetention})
		drive(t, s)
		n := 0
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			check(t, p, []byte(p))
			check(t, p, b)
			n += len(b)
			return nil
		})
		if err != nil || n == 0 {
			t.Fatalf("walk: %v, %d bytes", err, n)
		}
	})
	audittest.RedisBackends(t, func(t *testing.T, c goredis.UniversalClient) {
		ctx := context.Background()
		s, err := auditredis.New(c, auditredis.Config{Retention: audit.MaxRetention})
		if err != nil {
			t.Fatal(err)
		}
		drive(t, s)
		keys, err := c.Keys(ctx, "*").Result()
		if err != nil || len(keys) == 0 {
			t.Fatalf("keys %v, %v", keys, err)
		}
		for _, k := range keys {
			check(t, "key name", []byte(k))
			msgs, err := c.XRange(ctx, k, "-", "+").Result()
			if err != nil {
				t.Fatalf("XRANGE %s: %v", k, err)
			}
			for _, m := range msgs {
				for f, v := range m.Values {
					check(t, k+" "+m.ID+" "+f, []byte(f))
					check(t, k+" "+m.ID+" "+f, []byte(v.(string)))
				}
			}
		}
	})
	t.Run("postgres", func(t *testing.T) {
		// A server of its own: the dump below covers every table in it.
		dsn := testenv.Postgres(t)
		ctx := context.Background()
		s := openPostgresT(t, dsn, postgres.Config{Retention: audit.MaxRetention})
		drive(t, s)
		c, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctx)
		rows, err := c.Query(ctx, `SELECT format('%I.%I', schemaname, tablename) FROM pg_tables
			WHERE schemaname NOT IN ('pg_catalog', 'information_schema')`)
		if err != nil {
			t.Fatal(err)
		}
		tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || len(tables) == 0 {
			t.Fatalf("tables %v, %v", tables, err)
		}
		for _, table := range tables {
			check(t, "table name", []byte(table))
			// What pg_dump --data-only writes: COPY's text format (bytea
			// in hex, arrays as literals)...
			var dump bytes.Buffer
			if _, err := c.PgConn().CopyTo(ctx, &dump, "COPY "+table+" TO STDOUT"); err != nil {
				t.Fatalf("COPY %s: %v", table, err)
			}
			check(t, table+" COPY dump", dump.Bytes())
			// ...and every column cast to text, row by row, with bytea
			// also as the raw bytes.
			rows, err := c.Query(ctx, "SELECT t::text FROM "+table+" t")
			if err != nil {
				t.Fatal(err)
			}
			text, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			check(t, table+" rows as text", []byte(strings.Join(text, "\n")))
			if table == "public."+postgres.DefaultTable {
				if len(text) != 67 || dump.Len() == 0 { // 50 + 50 written, 33 forgotten
					t.Fatalf("%s: %d rows, %d bytes of COPY; want 67 rows", table, len(text), dump.Len())
				}
				rows, err := c.Query(ctx, "SELECT coalesce(user_ct, '') FROM "+table)
				if err != nil {
					t.Fatal(err)
				}
				cts, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
				if err != nil {
					t.Fatal(err)
				}
				check(t, table+" user_ct bytes", bytes.Join(cts, nil))
			}
		}
	})
}
