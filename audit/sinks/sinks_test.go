package sinks

// Tests every sink passes.

import (
	"context"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/audit/audittest"
	"github.com/tetherproxy/tether/audit/file"
	"github.com/tetherproxy/tether/audit/postgres"
	auditredis "github.com/tetherproxy/tether/audit/redis"
	"github.com/tetherproxy/tether/internal/testenv"
)

// openFile opens a file sink, closed when the test ends.
func openFile(t *testing.T, cfg file.Config) *file.Sink {
	t.Helper()
	s, err := file.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// openPostgresT opens a PostgreSQL sink on dsn, closed when the test ends.
func openPostgresT(t *testing.T, dsn string, cfg postgres.Config) *postgres.Sink {
	t.Helper()
	s, err := postgres.New(context.Background(), dsn, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// TestSinksRoundTripSessionKeys: every sink gives SessionKeys back (forget
// finds a user's bindings through them).
func TestSinksRoundTripSessionKeys(t *testing.T) {
	sealer := audittest.Sealer(t)
	r := audit.Record{RequestID: audit.NewRequestID(), DecisionTime: time.Now().Truncate(time.Microsecond).UTC(), Decision: "bind",
		SessionKeys: []string{"s:0f1e2d", "s:a9b8c7"}}
	sealer.Attach(&r, "alice")
	rs, err := auditredis.New(testenv.RedisServer(t).Client(), auditredis.Config{Retention: audit.MaxRetention})
	if err != nil {
		t.Fatal(err)
	}
	for name, s := range map[string]audit.Sink{
		"file":     openFile(t, file.Config{Dir: t.TempDir(), Retention: audit.MaxRetention}),
		"postgres": openPostgresT(t, pg.DSN(t), postgres.Config{Table: "sinks_round_trip", Retention: audit.MaxRetention}),
		"redis":    rs,
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			if err := s.Write(ctx, []audit.Record{r}); err != nil {
				t.Fatal(err)
			}
			got, err := s.Export(ctx, r.UserPseudonym)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff([]audit.Record{r}, got); diff != "" {
				t.Fatalf("(-want +got):\n%s", diff)
			}
		})
	}
}
