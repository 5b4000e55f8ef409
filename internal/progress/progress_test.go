package progress

import (
	"bytes"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// buffer is a bytes.Buffer safe for the Poll goroutine and the test.
type buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *buffer) Write(p []byte) (int, error) { b.mu.Lock(); defer b.mu.Unlock(); return b.b.Write(p) }
func (b *buffer) String() string              { b.mu.Lock(); defer b.mu.Unlock(); return b.b.String() }

func TestTerminal(t *testing.T) {
	if Terminal(&bytes.Buffer{}) != nil {
		t.Error("a buffer counts as a terminal")
	}
	f, err := os.CreateTemp(t.TempDir(), "log")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if Terminal(f) != nil {
		t.Error("a file counts as a terminal")
	}
	if tty, err := os.OpenFile("/dev/tty", os.O_WRONLY, 0); err == nil { // only where the test has a terminal
		defer tty.Close()
		if Terminal(tty) == nil {
			t.Error("/dev/tty does not count as a terminal")
		}
	}
}

func TestNilBarDrawsNothing(t *testing.T) {
	var b *Bar = New(nil, Options{Total: 10})
	if b != nil {
		t.Fatal("New(nil) made a bar")
	}
	b.Set(3)
	b.SetTotal(20)
	b.Finish()
	b.End()
	if b.Total() != 0 || Poll(nil, Options{}, time.Millisecond, nil) != nil {
		t.Error("a nil bar has a total, or Poll(nil) made one")
	}
}

func TestCountedBar(t *testing.T) {
	var out buffer
	b := New(&out, Options{Total: 40, Description: "sessions marked", Count: true})
	b.Set(10)
	b.SetTotal(30)
	if b.Total() != 30 {
		t.Errorf("total %d after SetTotal(30)", b.Total())
	}
	b.Set(30)
	b.End()
	if s := out.String(); !strings.Contains(s, "30/30") || !strings.Contains(s, "sessions marked") || !strings.HasSuffix(s, "\n") {
		t.Errorf("output %q: want 30/30, the description and a final newline", s)
	}
}

func TestPolledBarIsFullOnlyAtFinish(t *testing.T) {
	var out buffer
	var n atomic.Int64
	n.Store(100) // already past the end, as a run whose drain goes on
	reads := atomic.Int64{}
	b := Poll(&out, Options{Total: 100, Count: true}, time.Millisecond, func() (int64, string) {
		reads.Add(1)
		return n.Load(), "ok 7 failed 0"
	})
	deadline := time.Now().Add(5 * time.Second)
	for reads.Load() < 3 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if s := out.String(); strings.Contains(s, "100/100") || !strings.Contains(s, "99/100") || !strings.Contains(s, "ok 7 failed 0") {
		t.Errorf("before Finish: %q, want 99/100 and the description", s)
	}
	b.Finish()
	after := reads.Load()
	if s := out.String(); !strings.Contains(s, "100/100") || !strings.HasSuffix(s, "\n") {
		t.Errorf("after Finish: %q, want 100/100 and a final newline", s)
	}
	time.Sleep(10 * time.Millisecond)
	if reads.Load() != after {
		t.Error("the bar is still redrawn after Finish")
	}
}
