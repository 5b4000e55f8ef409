package audit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"
)

// memSink keeps records in memory; gate, when set, stalls Write until it
// is closed or the write's context ends.
type memSink struct {
	mu      sync.Mutex
	recs    []Record
	gate    chan struct{}
	entered chan struct{} // receives once per Write call, if set
	fail    error
}

func (m *memSink) Write(ctx context.Context, recs []Record) error {
	if m.entered != nil {
		select {
		case m.entered <- struct{}{}:
		default:
		}
	}
	if m.gate != nil {
		select {
		case <-m.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if m.fail != nil {
		return m.fail
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.recs = append(m.recs, recs...)
	return nil
}

func (m *memSink) Delete(context.Context, string) (int, error)      { return 0, nil }
func (m *memSink) Export(context.Context, string) ([]Record, error) { return nil, nil }
func (m *memSink) Close() error                                     { return nil }

func (m *memSink) len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.recs)
}

func rec(i int) Record { return Record{RequestID: fmt.Sprintf("req-%d", i), Decision: "hit"} }

func newWriterT(t *testing.T, s Sink, cfg WriterConfig) *Writer {
	t.Helper()
	w, err := NewWriter(s, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = w.Close(ctx)
	})
	return w
}

// TestWriterNeverBlocks: with the sink stalled, writes past the buffer are
// dropped and counted, and every write returns.
func TestWriterNeverBlocks(t *testing.T) {
	const buffer, batch, n = 10, 4, 1000
	sink := &memSink{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	w := newWriterT(t, sink, WriterConfig{Buffer: buffer, Batch: batch})
	if !w.Write(rec(-1)) {
		t.Fatal("first write refused")
	}
	<-sink.entered // the goroutine holds that record, stalled in the sink
	accepted := 0
	for i := range n {
		if w.Write(rec(i)) {
			accepted++
		}
	}
	if accepted != buffer || w.Dropped() != n-buffer {
		t.Fatalf("accepted %d, dropped %d; want %d and %d", accepted, w.Dropped(), buffer, n-buffer)
	}
	close(sink.gate)
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := sink.len(); got != buffer+1 || w.Written() != uint64(buffer+1) {
		t.Fatalf("sink has %d, Written %d; want %d", got, w.Written(), buffer+1)
	}
}

func TestWriterCloseFlushes(t *testing.T) {
	sink := &memSink{}
	w := newWriterT(t, sink, WriterConfig{Buffer: 5000, Batch: 7})
	for i := range 3000 {
		if !w.Write(rec(i)) {
			t.Fatalf("write %d refused", i)
		}
	}
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if sink.len() != 3000 || w.Written() != 3000 || w.Dropped() != 0 {
		t.Fatalf("sink %d, written %d, dropped %d", sink.len(), w.Written(), w.Dropped())
	}
	for i, r := range sink.recs {
		if r.RequestID != rec(i).RequestID {
			t.Fatalf("record %d is %q: out of order", i, r.RequestID)
		}
	}
	if w.Write(rec(0)) || w.Dropped() != 1 {
		t.Fatal("a write after Close was not dropped")
	}
	if err := w.Close(context.Background()); err != nil { // twice is fine
		t.Fatal(err)
	}
}

// TestWriterCloseDeadline: a stalled sink cannot hold Close past its
// context; what was left is counted as dropped.
func TestWriterCloseDeadline(t *testing.T) {
	sink := &memSink{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	w := newWriterT(t, sink, WriterConfig{Buffer: 100, Batch: 1})
	w.Write(rec(0))
	<-sink.entered
	for i := 1; i < 50; i++ {
		w.Write(rec(i))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := w.Close(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Close = %v, want deadline exceeded", err)
	}
	if w.Failed() != 1 || w.Dropped() != 49 || w.Written() != 0 {
		t.Fatalf("failed %d, dropped %d, written %d", w.Failed(), w.Dropped(), w.Written())
	}
}

func TestWriterSinkError(t *testing.T) {
	var mu sync.Mutex
	var errs []error
	sink := &memSink{fail: errors.New("disk full")}
	w := newWriterT(t, sink, WriterConfig{OnError: func(err error) { mu.Lock(); errs = append(errs, err); mu.Unlock() }})
	w.Write(rec(0))
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if w.Failed() != 1 || len(errs) != 1 || !strings.Contains(errs[0].Error(), "disk full") {
		t.Fatalf("failed %d, errors %v", w.Failed(), errs)
	}
}

func TestSampled(t *testing.T) {
	const n = 10000
	for _, rate := range []float64{0.01, 0.1, 0.5, 0.9, 1} {
		t.Run(fmt.Sprint(rate), func(t *testing.T) {
			got := 0
			for i := range n {
				id := fmt.Sprintf("%08x-req-%d", i*2654435761, i)
				a := Sampled(id, rate)
				if a != Sampled(id, rate) {
					t.Fatalf("Sampled(%q) is not deterministic", id)
				}
				if a {
					got++
				}
			}
			// Binomial: allow 5 standard deviations (and at least 10).
			sd := math.Sqrt(n * rate * (1 - rate))
			if d := math.Abs(float64(got) - n*rate); d > math.Max(5*sd, 10) {
				t.Fatalf("sampled %d of %d at rate %v", got, n, rate)
			}
		})
	}
}

func TestWriterSampling(t *testing.T) {
	sink := &memSink{}
	w := newWriterT(t, sink, WriterConfig{SampleRate: 0.25, Buffer: 20000})
	want := 0
	for i := range 10000 {
		if Sampled(rec(i).RequestID, 0.25) {
			want++
		}
		w.Write(rec(i))
	}
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if sink.len() != want || int(w.Skipped()) != 10000-want {
		t.Fatalf("sink %d (want %d), skipped %d", sink.len(), want, w.Skipped())
	}
}

func TestWriterConfigValidate(t *testing.T) {
	for _, cfg := range []WriterConfig{
		{SampleRate: -0.1}, {SampleRate: 1.5}, {SampleRate: math.NaN()}, {Buffer: -1}, {Batch: -1},
		{WriteTimeout: -time.Second}, {PruneInterval: -time.Second},
	} {
		if _, err := NewWriter(&memSink{}, cfg); err == nil {
			t.Errorf("NewWriter(%+v) accepted", cfg)
		}
	}
	if _, err := NewWriter(nil, WriterConfig{}); err == nil {
		t.Error("nil sink accepted")
	}
}

type pruneSink struct {
	memSink
	pruned chan struct{}
}

func (p *pruneSink) Prune(context.Context) error {
	select {
	case p.pruned <- struct{}{}:
	default:
	}
	return nil
}

func TestWriterPrunes(t *testing.T) {
	sink := &pruneSink{pruned: make(chan struct{}, 1)}
	newWriterT(t, sink, WriterConfig{PruneInterval: time.Millisecond})
	select {
	case <-sink.pruned:
	case <-time.After(5 * time.Second):
		t.Fatal("the writer never pruned an idle sink")
	}
}

// TestWriterWriteAlways: WriteAlways ignores the sample rate; Sample is
// Write's own test and counts what it leaves out.
func TestWriterWriteAlways(t *testing.T) {
	const n, rate = 2000, 0.1
	sink := &memSink{}
	w := newWriterT(t, sink, WriterConfig{SampleRate: rate, Buffer: 2 * n})
	kept := 0
	for i := range n {
		if !w.WriteAlways(rec(i)) {
			t.Fatalf("WriteAlways %d refused", i)
		}
		if w.Sample(rec(i).RequestID) {
			kept++
			if !Sampled(rec(i).RequestID, rate) {
				t.Fatalf("Sample(%q) kept what Sampled leaves out", rec(i).RequestID)
			}
		}
	}
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if sink.len() != n || w.Written() != n {
		t.Fatalf("sink %d, written %d; want %d", sink.len(), w.Written(), n)
	}
	if int(w.Skipped()) != n-kept || kept == 0 || kept == n {
		t.Fatalf("Sample kept %d of %d, skipped %d", kept, n, w.Skipped())
	}
	if w.WriteAlways(rec(0)) || w.Dropped() != 1 {
		t.Fatal("WriteAlways after Close was not dropped")
	}
}

// skipSink stores every record but the first of each batch, as the
// PostgreSQL sink does with a record it cannot store.
type skipSink struct{ memSink }

func (s *skipSink) Write(ctx context.Context, recs []Record) error {
	if err := s.memSink.Write(ctx, recs[1:]); err != nil {
		return err
	}
	return &InvalidRecordsError{Table: "t", Total: len(recs), Index: []int{0}, Reasons: []string{"bad"}}
}

// TestWriterPartialBatch: records the sink stored count as written even
// when it skipped others in the batch.
func TestWriterPartialBatch(t *testing.T) {
	w := newWriterT(t, &skipSink{}, WriterConfig{Batch: 4})
	for i := range 4 {
		w.Write(rec(i))
	}
	if err := w.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if w.Written()+w.Failed() != 4 || w.Failed() < 1 || w.Written() < 2 {
		t.Fatalf("written %d, failed %d: want the skipped ones failed and the rest written", w.Written(), w.Failed())
	}
}
