//go:build e2e

package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/testenv"
)

// Audit keys for the test (32 bytes each, hex).
const (
	auditKeyring   = "k1=" + "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
	auditPseudonym = "f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff000102030405060708090a0b0c0d0e0f"
)

// TestAuditToPostgres: tether, Envoy, redis-server and PostgreSQL, all
// real. Every decision leaves one row in routing_audit; the user ids the
// requests carried appear in no row, Redis key or value, or log line; the
// CLI exports one user's records decrypted, and forgets them with their
// session bindings while another user's stay.
func TestAuditToPostgres(t *testing.T) {
	rds := testenv.RedisServer(t)
	dsn := testenv.Postgres(t)
	t.Setenv(config.DefaultAuditKeyringEnv, auditKeyring)
	t.Setenv(config.DefaultAuditPseudonymEnv, auditPseudonym)
	t.Setenv(config.DefaultAuditPostgresDSNEnv, dsn)

	cfg := baseConfig(rds.URL(), startFleet(t, 2))
	cfg.Server.LogLevel = "debug" // every request logged: the plaintext must be in none of it
	cfg.Audit.Enabled = true
	cfg.Audit.Sink = config.AuditSinkPostgres
	tt := startTether(t, cfg)
	envoy := startEnvoy(t, cfg, tt.extproc)

	const alice, bob = "alice.liddell@example.org", "bob.builder@example.org"
	users := map[string]string{"alice": alice, "bob": bob}
	const turns = 4
	for who, user := range users {
		for s := range 3 {
			for range turns {
				a := chat(t, envoy, map[string]string{"x-session-id": fmt.Sprintf("%s-%d", who, s), "x-user-id": user})
				if a.status != http.StatusOK {
					t.Fatalf("%s: status %d", who, a.status)
				}
			}
		}
	}
	want := 3 * turns // records per user
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pg, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close(context.Background())
	rows := func() int {
		var n int
		if err := pg.QueryRow(ctx, `SELECT count(*) FROM routing_audit`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor(t, 10*time.Second, "every decision in routing_audit", func() bool { return rows() == 2*want })

	// The plaintext, and its hex and base64 forms, are nowhere.
	dump := pgDump(t, ctx, pg) + redisDump(t, ctx, rds) + tt.logs.String()
	for _, user := range users {
		for _, form := range []string{user, hex.EncodeToString([]byte(user)), base64.StdEncoding.EncodeToString([]byte(user)), strings.SplitN(user, "@", 2)[0]} {
			if strings.Contains(dump, form) {
				t.Fatalf("%q (a form of a user id) found in PostgreSQL, Redis or tether's logs", form)
			}
		}
	}

	// Export: alice's records, decrypted, oldest first.
	out := auditCLI(t, tt.path, "export", alice)
	var exported []map[string]any
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var rec map[string]any
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("export line %q: %v", sc.Text(), err)
		}
		exported = append(exported, rec)
	}
	if len(exported) != want {
		t.Fatalf("export gave %d records, want %d:\n%s", len(exported), want, out)
	}
	for i, rec := range exported {
		if rec["user_id"] != alice {
			t.Fatalf("record %d: user_id %v, want alice's", i, rec["user_id"])
		}
		if i > 0 && fmt.Sprint(rec["decision_time"]) < fmt.Sprint(exported[i-1]["decision_time"]) {
			t.Fatalf("export not oldest first at %d", i)
		}
	}

	// Forget: alice's rows and bindings go, bob's stay.
	auditCLI(t, tt.path, "forget", alice)
	if n := rows(); n != want {
		t.Fatalf("%d rows after forgetting alice, want bob's %d", n, want)
	}
	if out := auditCLI(t, tt.path, "export", alice); strings.TrimSpace(out) != "" {
		t.Fatalf("alice's records exported after forget:\n%s", out)
	}
	for who, user := range users {
		a := chat(t, envoy, map[string]string{"x-session-id": who + "-0", "x-user-id": user})
		wantKind := "hit"
		if who == "alice" {
			wantKind = "bind" // her binding is gone: a new session
		}
		if a.decision != wantKind {
			t.Errorf("%s after forget: decision %q, want %q", who, a.decision, wantKind)
		}
	}
}

// auditCLI runs `tether audit <cmd> --user user --config path` with the
// test's environment and returns its standard output.
func auditCLI(t *testing.T, path, cmd, user string) string {
	t.Helper()
	c := exec.Command(tetherBin, "audit", cmd, "--user", user, "--config", path)
	c.Env = append(os.Environ(), "TETHER_IDENTITY_SECRET="+secret)
	var stdout, stderr bytes.Buffer
	c.Stdout, c.Stderr = &stdout, &stderr
	if err := c.Run(); err != nil {
		t.Fatalf("tether audit %s: %v\n%s", cmd, err, stderr.String())
	}
	if strings.Contains(stderr.String(), user) {
		t.Fatalf("tether audit %s printed the user id on stderr:\n%s", cmd, stderr.String())
	}
	return stdout.String()
}

// pgDump is every row of every table in the public schema, as text.
func pgDump(t *testing.T, ctx context.Context, pg *pgx.Conn) string {
	t.Helper()
	rows, err := pg.Query(ctx, `SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'`)
	if err != nil {
		t.Fatal(err)
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, tb := range tables {
		rows, err := pg.Query(ctx, fmt.Sprintf(`SELECT row_to_json(x)::text FROM %s x`, pgx.Identifier{tb}.Sanitize()))
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		b.WriteString(strings.Join(lines, "\n"))
	}
	if !strings.Contains(b.String(), "request_id") {
		t.Fatal("the PostgreSQL dump holds no audit row: the check would prove nothing")
	}
	return b.String()
}

// redisDump is every key and the serialized value of each.
func redisDump(t *testing.T, ctx context.Context, rds *testenv.Redis) string {
	t.Helper()
	c := rds.Client()
	var b strings.Builder
	iter := c.Scan(ctx, 0, "*", 1000).Iterator()
	n := 0
	for iter.Next(ctx) {
		key := iter.Val()
		// Each value read as its type (DUMP may compress it).
		var v any
		switch typ, _ := c.Type(ctx, key).Result(); typ {
		case "string":
			v = c.Get(ctx, key).Val()
		case "hash":
			v = c.HGetAll(ctx, key).Val()
		case "zset":
			v = c.ZRangeWithScores(ctx, key, 0, -1).Val()
		case "set":
			v = c.SMembers(ctx, key).Val()
		case "list":
			v = c.LRange(ctx, key, 0, -1).Val()
		case "stream":
			v = c.XRange(ctx, key, "-", "+").Val()
		case "none":
			continue // expired in between
		default:
			t.Fatalf("key %q of type %q: the dump does not read it", key, typ)
		}
		fmt.Fprintf(&b, "%s\n%v\n", key, v)
		n++
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("Redis holds no key: the check would prove nothing")
	}
	return b.String()
}
