package audit

import (
	"bytes"
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
)

// TestNoPlaintextUserID writes decisions through the Writer to every sink,
// exports and forgets, then reads back everything stored (files, Redis
// key names, stream fields and values) and fails if the plaintext user id
// appears anywhere.
func TestNoPlaintextUserID(t *testing.T) {
	const user = "plain-user-7f3c@example.org"
	sealer := testSealer(t)
	records := func() []Record {
		var out []Record
		for i := range 50 {
			r := Record{RequestID: NewRequestID(), ModelVersion: "v1", DecisionTime: time.Now(), Instance: "gpu-a",
				Mode: "sticky", Decision: "bind", IdentitySource: "user_device"}
			u := user
			if i%3 == 0 {
				u = "someone-else"
			}
			sealer.Attach(&r, u)
			out = append(out, r)
		}
		return out
	}
	drive := func(t *testing.T, sink Sink) {
		t.Helper()
		ctx := context.Background()
		w, err := NewWriter(sink, WriterConfig{})
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
		w, err = NewWriter(sink, WriterConfig{})
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
	check := func(t *testing.T, where string, b []byte) {
		t.Helper()
		if bytes.Contains(b, []byte(user)) {
			t.Fatalf("plaintext user id found in %s", where)
		}
	}

	t.Run("file", func(t *testing.T) {
		dir := t.TempDir()
		s := newFileSinkT(t, FileConfig{Dir: dir, Retention: MaxRetention})
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
	redisBackends(t, func(t *testing.T, c goredis.UniversalClient) {
		ctx := context.Background()
		s, err := NewRedisSink(c, RedisConfig{Retention: MaxRetention})
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
}
