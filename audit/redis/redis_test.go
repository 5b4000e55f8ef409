package redis

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/audit/audittest"

	goredis "github.com/redis/go-redis/v9"
)

// rec is the i-th record of a test.
func rec(i int) audit.Record {
	return audit.Record{RequestID: fmt.Sprintf("req-%d", i), Decision: "hit"}
}

func TestRedisSinkRetentionRefused(t *testing.T) {
	c := goredis.NewClient(&goredis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	for _, d := range []time.Duration{0, -time.Minute, 31 * 24 * time.Hour} {
		if _, err := New(c, Config{Retention: d}); err == nil {
			t.Errorf("retention %v accepted", d)
		}
	}
}

func TestRedisSink(t *testing.T) {
	audittest.RedisBackends(t, func(t *testing.T, c goredis.UniversalClient) {
		ctx := context.Background()
		s, err := New(c, Config{Prefix: "t:", Retention: 24 * time.Hour, ScanCount: 2})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		sealer := audittest.Sealer(t)
		at := time.Date(2026, 3, 1, 12, 0, 0, 123456789, time.UTC)
		var recs []audit.Record
		for i, u := range []string{"alice", "bob", "alice", "", "alice"} {
			r := audit.Record{RequestID: audit.NewRequestID(), ModelVersion: "v2", DecisionTime: at, Instance: "gpu-" + strconv.Itoa(i),
				Mode: "sticky", Decision: "hit", IdentitySource: "session"}
			sealer.Attach(&r, u)
			recs = append(recs, r)
		}
		if err := s.Write(ctx, recs); err != nil {
			t.Fatal(err)
		}
		if n := c.XLen(ctx, "t:audit").Val(); n != 5 {
			t.Fatalf("XLEN %d, want 5", n)
		}
		alice := sealer.Pseudonym("alice")
		got, err := s.Export(ctx, alice) // pages of 2: crosses pages
		if err != nil {
			t.Fatal(err)
		}
		want := []audit.Record{recs[0], recs[2], recs[4]}
		if len(got) != 3 {
			t.Fatalf("export: %d records, want 3", len(got))
		}
		for i := range got {
			if got[i].RequestID != want[i].RequestID || !got[i].DecisionTime.Equal(at) || got[i].Instance != want[i].Instance ||
				got[i].ModelVersion != "v2" || got[i].KeyID != want[i].KeyID {
				t.Fatalf("export[%d] = %+v, want %+v", i, got[i], want[i])
			}
			if u, err := sealer.UserID(got[i]); err != nil || u != "alice" {
				t.Fatalf("export[%d] opens to %q, %v", i, u, err)
			}
		}
		n, err := s.Delete(ctx, alice)
		if err != nil || n != 3 {
			t.Fatalf("Delete = %d, %v; want 3", n, err)
		}
		if got, _ := s.Export(ctx, alice); len(got) != 0 {
			t.Fatalf("after delete: %d records", len(got))
		}
		if got, _ := s.Export(ctx, sealer.Pseudonym("bob")); len(got) != 1 {
			t.Fatalf("bob: %d records, want 1", len(got))
		}
		if n := c.XLen(ctx, "t:audit").Val(); n != 2 {
			t.Fatalf("XLEN %d after delete, want 2", n)
		}
	})
}

// TestRedisSinkTrim: entries older than the retention (by the injected
// clock) go with the first write, then at most once per TrimEvery.
func TestRedisSinkTrim(t *testing.T) {
	audittest.RedisBackends(t, func(t *testing.T, c goredis.UniversalClient) {
		ctx := context.Background()
		clk := audittest.NewClock(time.Now())
		s, err := New(c, Config{Retention: time.Hour, Now: clk.Now})
		if err != nil {
			t.Fatal(err)
		}
		key := s.Key()
		if key != "tether:audit" {
			t.Fatalf("key %q", key)
		}
		// An entry written (by id) 2 h ago, one 30 min ago.
		old := strconv.FormatInt(clk.Now().Add(-2*time.Hour).UnixMilli(), 10) + "-0"
		recent := strconv.FormatInt(clk.Now().Add(-30*time.Minute).UnixMilli(), 10) + "-0"
		for _, id := range []string{old, recent} {
			if err := c.XAdd(ctx, &goredis.XAddArgs{Stream: key, ID: id, Values: []any{"request_id", id}}).Err(); err != nil {
				t.Fatal(err)
			}
		}
		ids := func() []string {
			msgs, err := c.XRange(ctx, key, "-", "+").Result()
			if err != nil {
				t.Fatal(err)
			}
			var out []string
			for _, m := range msgs {
				out = append(out, m.ID)
			}
			return out
		}
		if err := s.Write(ctx, []audit.Record{rec(1)}); err != nil {
			t.Fatal(err)
		}
		got := ids()
		if len(got) != 2 || got[0] != recent {
			t.Fatalf("after the first write: %v; want %s and the new entry", got, recent)
		}
		// 40 min later the "recent" entry has expired; the trim is due.
		clk.Add(40 * time.Minute)
		if err := s.Write(ctx, []audit.Record{rec(2)}); err != nil {
			t.Fatal(err)
		}
		if got := ids(); len(got) != 2 || slices.Contains(got, recent) {
			t.Fatalf("after 40 min: %v; want the two new entries", got)
		}
		// Prune trims whatever the throttle: move past every entry.
		clk.Add(2 * time.Hour)
		if err := s.Prune(ctx); err != nil {
			t.Fatal(err)
		}
		if got := ids(); len(got) != 0 {
			t.Fatalf("after prune: %v", got)
		}
	})
}

// TestRedisSinkTrimThrottle: writes trim at most once per TrimEvery. With
// a 10 s retention and the clock moved 30 s, a trim would remove every
// entry (their ids are the server's clock, the real time).
func TestRedisSinkTrimThrottle(t *testing.T) {
	audittest.RedisBackends(t, func(t *testing.T, c goredis.UniversalClient) {
		ctx := context.Background()
		clk := audittest.NewClock(time.Now())
		s, err := New(c, Config{Retention: 10 * time.Second, TrimEvery: time.Minute, Now: clk.Now})
		if err != nil {
			t.Fatal(err)
		}
		for i, step := range []struct {
			advance time.Duration
			want    int64
		}{
			{0, 1},                // first write trims (nothing expired yet)
			{30 * time.Second, 2}, // everything expired, but a trim ran 30 s ago
			{31 * time.Second, 0}, // 61 s since the last trim: trims all
		} {
			clk.Add(step.advance)
			if err := s.Write(ctx, []audit.Record{rec(i)}); err != nil {
				t.Fatal(err)
			}
			if n := c.XLen(ctx, s.Key()).Val(); n != step.want {
				t.Fatalf("step %d: XLEN %d, want %d", i, n, step.want)
			}
		}
	})
}
