package loadgen

import (
	"fmt"
	"io"
	"time"

	"github.com/schollz/progressbar/v3"
)

// progressInterval is how often the progress bar is redrawn.
const progressInterval = 250 * time.Millisecond

// progress draws a bar of the run's duration with the request counts,
// from its own goroutine, until stop.
type progress struct {
	bar    *progressbar.ProgressBar
	w      io.Writer
	status func() string
	quit   chan struct{}
	done   chan struct{}
}

func startProgress(w io.Writer, d time.Duration, start time.Time, status func() string) *progress {
	total := max(d.Milliseconds(), 1)
	p := &progress{
		bar: progressbar.NewOptions64(total,
			progressbar.OptionSetWriter(w),
			progressbar.OptionSetDescription(status()),
			progressbar.OptionSetWidth(30),
			progressbar.OptionSetPredictTime(false),
			progressbar.OptionSetElapsedTime(true),
			progressbar.OptionShowDescriptionAtLineEnd(),
			progressbar.OptionSetRenderBlankState(true),
		),
		w:      w,
		status: status,
		quit:   make(chan struct{}),
		done:   make(chan struct{}),
	}
	go func() {
		defer close(p.done)
		tick := time.NewTicker(progressInterval)
		defer tick.Stop()
		for {
			select {
			case <-p.quit:
				return
			case <-tick.C:
				// Full only at stop: after Duration the bar waits at 99%
				// while the requests in flight drain.
				_ = p.bar.Set64(min(time.Since(start).Milliseconds(), total-1))
				p.bar.Describe(status())
			}
		}
	}()
	return p
}

// stop ends the goroutine and leaves the bar full, on its own line.
func (p *progress) stop() {
	close(p.quit)
	<-p.done
	p.bar.Describe(p.status())
	_ = p.bar.Finish()
	fmt.Fprintln(p.w)
}
