// Package progress draws the progress bars of tether's and tether-lab's
// long commands: sessions migrate, loadgen, simulate and bench soak. All
// share one look: schollz/progressbar, 30 columns, the description after
// the bar, and the elapsed time. Bars go on standard error, and only when
// it is a terminal (Terminal).
package progress

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
)

// Terminal is w when w is a terminal, else nil. A bar is drawn only there,
// never into a log file or a pipe.
func Terminal(w io.Writer) io.Writer {
	f, ok := w.(*os.File)
	if !ok {
		return nil
	}
	fi, err := f.Stat()
	if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return nil
	}
	return w
}

// Options shape a bar.
type Options struct {
	Total       int64  // what a full bar stands for; at least 1
	Description string // the first description
	Count       bool   // show "n/total"
	Predict     bool   // show the time left
}

// Bar is a progress bar. A nil *Bar draws nothing, so callers need not
// check whether they draw one.
type Bar struct {
	bar *progressbar.ProgressBar
	w   io.Writer

	// Set for a Poll bar: its goroutine's stop and end, and its reading.
	quit, done chan struct{}
	read       func() (int64, string)
}

// New draws a bar on w. It returns nil, no bar, when w is nil.
func New(w io.Writer, o Options) *Bar {
	if w == nil {
		return nil
	}
	opts := []progressbar.Option{
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription(o.Description),
		progressbar.OptionSetWidth(30),
		progressbar.OptionShowDescriptionAtLineEnd(),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionSetPredictTime(o.Predict),
		progressbar.OptionSetRenderBlankState(true),
	}
	if o.Count {
		opts = append(opts, progressbar.OptionShowCount())
	}
	return &Bar{w: w, bar: progressbar.NewOptions64(max(o.Total, 1), opts...)}
}

// Poll is New, redrawn every interval from read on a goroutine of its own
// until Finish. read gives the value and the description. The bar stops
// one short of full until Finish. Work measured in time, such as a run's
// duration, may still have requests to drain when the time is up.
func Poll(w io.Writer, o Options, every time.Duration, read func() (int64, string)) *Bar {
	b := New(w, o)
	if b == nil {
		return nil
	}
	b.quit, b.done, b.read = make(chan struct{}), make(chan struct{}), read
	b.draw()
	go func() {
		defer close(b.done)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-b.quit:
				return
			case <-tick.C:
				b.draw()
			}
		}
	}()
	return b
}

func (b *Bar) draw() {
	n, desc := b.read()
	b.bar.Describe(desc)
	_ = b.bar.Set64(min(n, b.bar.GetMax64()-1))
}

// Set moves the bar to n.
func (b *Bar) Set(n int64) {
	if b != nil {
		_ = b.bar.Set64(n)
	}
}

// Total is what a full bar stands for.
func (b *Bar) Total() int64 {
	if b == nil {
		return 0
	}
	return b.bar.GetMax64()
}

// SetTotal changes what a full bar stands for. The first total may have
// been an estimate, or the work may grow.
func (b *Bar) SetTotal(n int64) {
	if b != nil {
		b.bar.ChangeMax64(max(n, 1))
	}
}

// Finish stops a Poll bar's redraws after a last one, fills the bar and
// ends its line.
func (b *Bar) Finish() {
	if b == nil {
		return
	}
	if b.stopPolling() {
		b.draw()
	}
	_ = b.bar.Finish()
	fmt.Fprintln(b.w)
}

// End leaves the bar where it stands and ends its line. It is for work
// that stopped short.
func (b *Bar) End() {
	if b == nil {
		return
	}
	b.stopPolling()
	_ = b.bar.Exit()
	fmt.Fprintln(b.w)
}

// stopPolling ends a Poll bar's goroutine. It returns false for a New bar.
func (b *Bar) stopPolling() bool {
	if b.quit == nil {
		return false
	}
	close(b.quit)
	<-b.done
	return true
}
