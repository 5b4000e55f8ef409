package audit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
)

// WriterConfig configures a Writer. Zero values take the defaults.
type WriterConfig struct {
	// Buffer is how many records may wait for the sink, 4096 by default.
	// A record that finds the buffer full is dropped and counted.
	Buffer int
	// Batch is the most records handed to one Sink.Write, 256 by default.
	Batch int
	// SampleRate is the fraction of decisions recorded, in (0, 1]. The
	// default, 1, records every decision. See Sampled.
	SampleRate float64
	// WriteTimeout bounds one Sink.Write, 5 s by default.
	WriteTimeout time.Duration
	// PruneInterval is how often a sink that is a Pruner is asked to drop
	// expired records, 1 min by default.
	PruneInterval time.Duration
	// OnError hears of failed sink writes and prunes. It is called from
	// the writer's goroutine. Optional.
	OnError func(error)
}

// Validate checks the values set. Zeros mean the defaults.
func (c WriterConfig) Validate() error {
	switch {
	case c.Buffer < 0:
		return fmt.Errorf("audit buffer %d: must not be negative", c.Buffer)
	case c.Batch < 0:
		return fmt.Errorf("audit batch %d: must not be negative", c.Batch)
	case math.IsNaN(c.SampleRate) || c.SampleRate < 0 || c.SampleRate > 1:
		return fmt.Errorf("audit sample_rate %v: want 0 < rate <= 1", c.SampleRate)
	case c.WriteTimeout < 0:
		return fmt.Errorf("audit write_timeout %v: must not be negative", c.WriteTimeout)
	case c.PruneInterval < 0:
		return fmt.Errorf("audit prune_interval %v: must not be negative", c.PruneInterval)
	}
	return nil
}

func (c WriterConfig) withDefaults() WriterConfig {
	if c.Buffer == 0 {
		c.Buffer = 4096
	}
	if c.Batch == 0 {
		c.Batch = 256
	}
	if c.SampleRate == 0 {
		c.SampleRate = 1
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = 5 * time.Second
	}
	if c.PruneInterval == 0 {
		c.PruneInterval = time.Minute
	}
	return c
}

// Sampled reports whether the decision with this request id is recorded
// at rate. It hashes the id, so every replica agrees, and so does a retry.
func Sampled(requestID string, rate float64) bool {
	if rate >= 1 {
		return true
	}
	// The top 53 bits as a fraction in [0, 1).
	return float64(xxhash.Sum64String(requestID)>>11)/(1<<53) < rate
}

// Writer hands records to a Sink from one goroutine. Write never blocks.
type Writer struct {
	sink Sink
	cfg  WriterConfig

	mu     sync.RWMutex // Write holds it shared; Close exclusively, to close ch
	closed bool
	ch     chan Record

	ctx    context.Context // sink calls; cancelled when Close gives up
	cancel context.CancelFunc
	done   chan struct{}

	written, dropped, failed, skipped atomic.Uint64
}

// NewWriter starts the writer's goroutine; Close stops it.
func NewWriter(sink Sink, cfg WriterConfig) (*Writer, error) {
	if sink == nil {
		return nil, errors.New("audit writer: nil sink")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	w := &Writer{sink: sink, cfg: cfg, ch: make(chan Record, cfg.Buffer), ctx: ctx, cancel: cancel, done: make(chan struct{})}
	go w.run()
	return w, nil
}

// Write queues r unless it is sampled out (see Sample), the buffer is
// full or the writer is closed. It never waits. It reports whether r was
// queued.
func (w *Writer) Write(r Record) bool {
	if !w.Sample(r.RequestID) {
		return false
	}
	return w.WriteAlways(r)
}

// Sample reports whether the record of the decision with this request id
// is kept at the writer's SampleRate (Sampled). A record not kept is
// counted as skipped. Write calls it. A caller whose records cost
// something to build calls Sample first, then WriteAlways.
func (w *Writer) Sample(requestID string) bool {
	if Sampled(requestID, w.cfg.SampleRate) {
		return true
	}
	w.skipped.Add(1)
	return false
}

// WriteAlways queues r whatever the SampleRate, unless the buffer is full
// or the writer is closed. It never waits. It reports whether r was
// queued. It is for records that passed Sample, and for records that must
// not be sampled out. The Recorder's binding changes are such records:
// forget relies on them.
func (w *Writer) WriteAlways(r Record) bool {
	w.mu.RLock()
	defer w.mu.RUnlock()
	if w.closed {
		w.dropped.Add(1)
		return false
	}
	select {
	case w.ch <- r:
		return true
	default:
		w.dropped.Add(1)
		return false
	}
}

// Written counts the records the sink accepted.
func (w *Writer) Written() uint64 { return w.written.Load() }

// Dropped counts the records lost before the sink. They found the buffer
// full, came after Close, or were still buffered when Close gave up.
func (w *Writer) Dropped() uint64 { return w.dropped.Load() }

// Failed counts the records of sink writes that failed.
func (w *Writer) Failed() uint64 { return w.failed.Load() }

// Skipped counts the records sampling left out.
func (w *Writer) Skipped() uint64 { return w.skipped.Load() }

// Close stops accepting records, writes what is buffered and returns. If
// ctx ends first it cancels the sink call in flight, counts what is left
// as dropped and returns ctx's error. It does not close the sink.
func (w *Writer) Close(ctx context.Context) error {
	w.mu.Lock()
	if !w.closed {
		w.closed = true
		close(w.ch)
	}
	w.mu.Unlock()
	select {
	case <-w.done:
		return nil
	case <-ctx.Done():
		w.cancel()
		<-w.done
		return fmt.Errorf("audit writer close: %w", ctx.Err())
	}
}

func (w *Writer) run() {
	defer close(w.done)
	defer w.cancel()
	tick := time.NewTicker(w.cfg.PruneInterval)
	defer tick.Stop()
	batch := make([]Record, 0, w.cfg.Batch)
	for {
		select {
		case r, ok := <-w.ch:
			if !ok {
				return
			}
			batch = append(batch[:0], r)
			open := w.fill(&batch)
			w.flush(batch)
			if !open {
				return
			}
		case <-tick.C:
			w.prune()
		}
	}
}

// fill adds what is buffered to batch, up to Batch records. It reports
// false when the channel is closed and drained.
func (w *Writer) fill(batch *[]Record) bool {
	for len(*batch) < w.cfg.Batch {
		select {
		case r, ok := <-w.ch:
			if !ok {
				return false
			}
			*batch = append(*batch, r)
		default:
			return true
		}
	}
	return true
}

func (w *Writer) flush(batch []Record) {
	if w.ctx.Err() != nil { // Close gave up: count, do not write
		w.dropped.Add(uint64(len(batch)))
		return
	}
	ctx, cancel := context.WithTimeout(w.ctx, w.cfg.WriteTimeout)
	err := w.sink.Write(ctx, batch)
	cancel()
	// A sink that skipped some records stored the others. It returns
	// *InvalidRecordsError, joined with another error when the write
	// itself failed too.
	skipped, only := err.(*InvalidRecordsError) //nolint:errorlint // the error itself: a wrapped or joined one means the write failed too
	switch {
	case only && skipped.Total == len(batch):
		w.written.Add(uint64(len(batch) - len(skipped.Index)))
		w.failed.Add(uint64(len(skipped.Index)))
		w.report(err)
		return
	case err != nil:
		w.failed.Add(uint64(len(batch)))
		w.report(fmt.Errorf("audit write of %d records: %w", len(batch), err))
		return
	}
	w.written.Add(uint64(len(batch)))
}

func (w *Writer) prune() {
	p, ok := w.sink.(Pruner)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(w.ctx, w.cfg.WriteTimeout)
	defer cancel()
	if err := p.Prune(ctx); err != nil {
		w.report(fmt.Errorf("audit prune: %w", err))
	}
}

func (w *Writer) report(err error) {
	if w.cfg.OnError != nil {
		w.cfg.OnError(err)
	}
}
