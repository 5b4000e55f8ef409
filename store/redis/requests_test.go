package redis

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/internal/testenv"
)

// TestRequestsRedisServer reads request counts from a real server: more
// keys than one pipeline holds, keys without a binding, and bindings
// whose count is missing or damaged (those count as 0, and the next
// request heals them to 1).
func TestRequestsRedisServer(t *testing.T) {
	r := testenv.RedisServer(t)
	ctx := t.Context()
	opts := testOptions
	opts.Prefix = "requests:"
	s := newStoreT(t, r.Client(), opts)
	lt := bindings.Lifetime{Idle: time.Minute}
	use := func(key string, want int) {
		t.Helper()
		res, err := s.GetOrBind(ctx, bindings.Lookup{Key: key, Candidate: bindings.Binding{Instance: "a", Since: time.Now()}, Lifetime: lt})
		if err != nil || res.Requests != want {
			t.Fatalf("GetOrBind(%q) = %d requests, %v; want %d", key, res.Requests, err, want)
		}
	}
	read := func(keys []string, want []int) {
		t.Helper()
		got, err := s.Requests(ctx, keys, time.Now())
		if err != nil {
			t.Fatalf("Requests: %v", err)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("Requests (-want +got):\n%s", diff)
		}
	}

	var keys []string
	var want []int
	for i := range markBatch + 44 { // two pipelines
		k := fmt.Sprint("k", i)
		for n := range i%3 + 1 {
			use(k, n+1)
		}
		keys = append(keys, k, fmt.Sprint("missing", i))
		want = append(want, i%3+1, 0)
	}
	read(keys, want)

	// A binding stored before counts were kept, a damaged count, and a
	// key that holds no hash at all.
	rc := r.Client()
	for _, k := range []string{"old", "bad", "huge"} {
		use(k, 1)
		use(k, 2)
	}
	if err := rc.HDel(ctx, s.bindingKey("old"), "n").Err(); err != nil {
		t.Fatal(err)
	}
	if err := rc.HSet(ctx, s.bindingKey("bad"), "n", "lots").Err(); err != nil {
		t.Fatal(err)
	}
	if err := rc.HSet(ctx, s.bindingKey("huge"), "n", "99999999999999999999").Err(); err != nil {
		t.Fatal(err)
	}
	if err := rc.Set(ctx, s.bindingKey("str"), "v", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	read([]string{"old", "bad", "str"}, []int{0, 0, 0})
	use("old", 1)
	use("bad", 1)
	use("huge", 1) // past what HINCRBY and Lua count exactly: starts again
	use("huge", 2)
	read([]string{"old", "bad", "huge"}, []int{1, 1, 2})

	// A replace keeps the count; over no binding it has none to keep.
	if _, err := s.Replace(ctx, "k2", "a", bindings.Binding{Instance: "b", Since: time.Now()}, lt); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Replace(ctx, "fresh", "a", bindings.Binding{Instance: "b", Since: time.Now()}, lt); err != nil {
		t.Fatal(err)
	}
	read([]string{"k2", "fresh"}, []int{3, 0})

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Requests(cctx, []string{"k1"}, time.Now()); err == nil {
		t.Error("Requests with a cancelled context succeeded")
	}
	read(nil, []int{})
}
