package replicas_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/prefix"
	"github.com/tetherproxy/tether/replicas"
)

func chainOf(seed uint64, n int) []uint64 {
	c := make([]uint64, n)
	for i := range c {
		c[i] = seed*1_000_003 + uint64(i)*0x9e3779b97f4a7c15
	}
	return c
}

func TestContentCodecRoundTrip(t *testing.T) {
	at := time.UnixMilli(1_760_000_000_123)
	tests := []struct {
		name string
		b    replicas.ContentBatch
	}{
		{"no records", replicas.ContentBatch{Replica: "r1"}},
		{"one", replicas.ContentBatch{Replica: "host-12-abcdef", Records: []replicas.ContentRecord{
			{Instance: "gpu-a", At: at, Chain: chainOf(1, 4)}}}},
		{"several, long", replicas.ContentBatch{Replica: "r", Records: []replicas.ContentRecord{
			{Instance: "gpu-a", At: at, Chain: chainOf(1, 1600)},
			{Instance: "gpu-b", At: at.Add(-time.Hour), Chain: chainOf(2, 1)},
			{Instance: "é", At: time.UnixMilli(0), Chain: chainOf(3, 128)}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			msg := replicas.EncodeContent(nil, tt.b)
			got, err := replicas.DecodeContent(msg)
			if err != nil {
				t.Fatalf("DecodeContent: %v", err)
			}
			want := tt.b
			if want.Records == nil {
				want.Records = []replicas.ContentRecord{}
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("round trip (-want +got):\n%s", diff)
			}
		})
	}
	// 1600 hashes of 8 bytes, and a header of a few.
	msg := replicas.EncodeContent(nil, tests[2].b)
	if n := len(msg); n > 8*(1600+1+128)+64 {
		t.Errorf("message of %d bytes for 1729 hashes", n)
	}
}

func TestContentDecodeRejects(t *testing.T) {
	good := replicas.EncodeContent(nil, replicas.ContentBatch{Replica: "r", Records: []replicas.ContentRecord{
		{Instance: "gpu-a", At: time.UnixMilli(5), Chain: chainOf(1, 3)}}})
	tests := map[string][]byte{
		"empty":            nil,
		"wrong version":    append([]byte{9}, good[1:]...),
		"truncated header": good[:2],
		"truncated hashes": good[:len(good)-1],
		"trailing byte":    append(bytes.Clone(good), 0),
		"huge name":        {1, 0xff, 0xff, 0xff, 0xff, 0x0f},
		"zero hashes":      {1, 1, 'r', 1, 'a', 0, 0},
		"huge count":       {1, 1, 'r', 1, 'a', 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01},
		"empty instance":   {1, 1, 'r', 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8},
	}
	for name, msg := range tests {
		t.Run(name, func(t *testing.T) {
			if b, err := replicas.DecodeContent(msg); err == nil {
				t.Errorf("DecodeContent(%x) = %+v, want an error", msg, b)
			}
		})
	}
}

func FuzzDecodeContent(f *testing.F) {
	f.Add(replicas.EncodeContent(nil, replicas.ContentBatch{Replica: "r", Records: []replicas.ContentRecord{
		{Instance: "gpu-a", At: time.UnixMilli(5), Chain: chainOf(1, 3)},
		{Instance: "gpu-b", At: time.UnixMilli(-5), Chain: chainOf(2, 1)}}}))
	f.Add([]byte{1, 0})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, msg []byte) {
		b, err := replicas.DecodeContent(msg)
		if err != nil {
			return
		}
		// What decodes encodes back to the same bytes, unless a varint
		// was not minimal.
		again, err := replicas.DecodeContent(replicas.EncodeContent(nil, b))
		if err != nil {
			t.Fatalf("re-encoded message does not decode: %v", err)
		}
		if diff := cmp.Diff(b, again); diff != "" {
			t.Fatalf("re-encoded message differs (-first +second):\n%s", diff)
		}
	})
}

// fakeBus fans every message out to every subscriber, in process.
type fakeBus struct {
	mu   sync.Mutex
	subs []chan []byte
	fail bool
	sent int
}

func (b *fakeBus) PublishContent(_ context.Context, msg []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.fail {
		return errors.New("bus down")
	}
	b.sent++
	for _, s := range b.subs {
		s <- bytes.Clone(msg)
	}
	return nil
}

func (b *fakeBus) SubscribeContent(ctx context.Context, on func([]byte)) {
	ch := make(chan []byte, 64)
	b.mu.Lock()
	b.subs = append(b.subs, ch)
	b.mu.Unlock()
	for {
		select {
		case <-ctx.Done():
			return
		case m := <-ch:
			on(m)
		}
	}
}

func (b *fakeBus) subscribers() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.subs)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestContentShareTwoReplicas: what one replica records, the other's index
// holds within a flush; a replica does not apply its own messages, and
// records of instances outside the fleet are received but not applied.
func TestContentShareTwoReplicas(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	bus := &fakeBus{}
	known := func(in string) bool { return in != "gone" }
	ia, ib := prefix.NewIndex(10_000), prefix.NewIndex(10_000)
	a := replicas.NewContentShare("a", ia, bus, known, zerolog.Nop())
	b := replicas.NewContentShare("b", ib, bus, known, zerolog.Nop())
	var wg sync.WaitGroup
	wg.Go(func() { a.Run(ctx) })
	wg.Go(func() { b.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()
	waitFor(t, "two subscribers", func() bool { return bus.subscribers() == 2 })

	doc := chainOf(7, 128)
	start := time.Now()
	a.Record("gpu-2", doc, start)
	a.Record("gone", chainOf(8, 4), start)
	depth := make([]int, 3)
	names := []string{"gpu-1", "gpu-2", "gpu-3"}
	waitFor(t, "b to index a's record", func() bool { return b.Match(doc, names, depth) == 128 })
	t.Logf("shared in %v", time.Since(start))
	if diff := cmp.Diff([]int{0, 128, 0}, depth); diff != "" {
		t.Errorf("b's depths (-want +got):\n%s", diff)
	}
	// A follow-up decided on b goes back to a.
	longer := append(append([]uint64(nil), doc...), chainOf(9, 4)...)
	b.Record("gpu-2", longer, time.Now())
	waitFor(t, "a to index b's record", func() bool { return a.Match(longer, names, depth) == 132 })

	want := replicas.ContentStats{Published: 2, Received: 1, Applied: 1}
	waitFor(t, "stats", func() bool { return a.Stats().Published == 2 && b.Stats().Received == 2 })
	if diff := cmp.Diff(want, a.Stats()); diff != "" {
		t.Errorf("a's stats (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(replicas.ContentStats{Published: 1, Received: 2, Applied: 1}, b.Stats()); diff != "" {
		t.Errorf("b's stats (-want +got):\n%s", diff)
	}
	// Only a's index holds "gone".
	if got := ib.Match(chainOf(8, 4), []string{"gone"}, depth[:1]); got != 0 {
		t.Errorf("b applied a record of an instance outside the fleet: depth %d", got)
	}
}

// TestContentShareBounded: Record never waits. With nothing publishing,
// the buffer fills and further records are dropped and counted; a bus
// that fails counts its records unpublished; a message that does not
// decode is counted bad.
func TestContentShareBounded(t *testing.T) {
	bus := &fakeBus{}
	idx := prefix.NewIndex(1 << 20)
	s := replicas.NewContentShare("a", idx, bus, nil, zerolog.Nop())
	chain := chainOf(1, 1600) // 12.8 KB a record
	fit := replicas.ContentBufferBytes / (8*1600 + 20)
	for range fit + 10 {
		s.Record("gpu-1", chain, time.Now())
	}
	st := s.Stats()
	if st.Dropped < 10 || st.Dropped > 12 {
		t.Errorf("dropped %d of %d records, want about 10 past the buffer", st.Dropped, fit+10)
	}
	bus.fail = true
	if err := s.Flush(t.Context()); err == nil {
		t.Error("Flush over a failing bus: no error")
	}
	if got, want := s.Stats().Unpublished, uint64(fit+10)-st.Dropped; got != want {
		t.Errorf("unpublished %d, want %d", got, want)
	}
	// The buffer is free again.
	bus.fail = false
	s.Record("gpu-1", chain, time.Now())
	if err := s.Flush(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := s.Stats().Published; got != 1 {
		t.Errorf("published %d after the buffer emptied, want 1", got)
	}

	// Bad messages, through a subscription.
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	waitFor(t, "a subscriber", func() bool { return bus.subscribers() == 1 })
	for _, m := range [][]byte{nil, {1}, {1, 1, 'b', 1, 'x', 0, 5}} {
		if err := bus.PublishContent(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "three bad messages", func() bool { return s.Stats().Bad == 3 })
	cancel()
	<-done
}
