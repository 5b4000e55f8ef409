package launch

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"sync"

	"github.com/tetherproxy/tether/internal/syncbuf"
)

// TetherOptions describe a `tether serve` process.
type TetherOptions struct {
	Bin    string   // the tether binary
	Config string   // the config file it serves (and watches)
	Env    []string // added to the environment, "KEY=value" (TETHER_IDENTITY_SECRET, say)
	Args   []string // added after serve --config (--cpuprofile FILE, say)
	Log    *syncbuf.Buffer
}

// Tether is a running `tether serve`, its addresses read from its ready
// line.
type Tether struct {
	*Proc
	Extproc string // host:port of the ext_proc gRPC server
	Admin   string // host:port of the admin API (and /metrics)
	XDS     string // host:port of the ADS server; "" when it is off
}

// readyMessage is the message of the log line tether writes once every
// listener is bound; the line carries their addresses (server.Run).
const readyMessage = "tether ready"

// StartTether runs `tether serve --config o.Config` and waits, bounded by
// ctx, for its ready line (at info level: a config that logs only warnings
// never becomes ready here).
func StartTether(ctx context.Context, o TetherOptions) (*Tether, error) {
	if o.Bin == "" || o.Config == "" {
		return nil, errors.New("start tether: TetherOptions needs Bin and Config")
	}
	if o.Log == nil {
		o.Log = &syncbuf.Buffer{}
	}
	t := &Tether{}
	var mu sync.Mutex
	ready := false
	cmd := exec.Command(o.Bin, append([]string{"serve", "--config", o.Config}, o.Args...)...)
	cmd.Env = append(os.Environ(), o.Env...)
	cmd.Stderr = &lineWriter{to: o.Log, line: func(line []byte) {
		var ev struct{ Message, Extproc, Admin, XDS string }
		if json.Unmarshal(line, &ev) != nil || ev.Message != readyMessage {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if !ready { // the first one counts: the fields are the caller's once StartTether returns
			t.Extproc, t.Admin, t.XDS, ready = ev.Extproc, ev.Admin, ev.XDS, true
		}
	}}
	p, err := Start("tether", cmd, o.Log)
	if err != nil {
		return nil, err
	}
	t.Proc = p
	err = p.Poll(ctx, "its ready line", func(context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		if !ready {
			return errors.New("no ready line yet")
		}
		return nil
	})
	if err != nil {
		p.Kill()
		return nil, err
	}
	return t, nil
}

// lineWriter copies what is written to it to to, and calls line for each
// complete line (without its newline). exec writes from one goroutine per
// stream, so it needs no lock of its own.
type lineWriter struct {
	to      *syncbuf.Buffer
	line    func([]byte)
	partial []byte
}

func (w *lineWriter) Write(b []byte) (int, error) {
	n, err := w.to.Write(b)
	w.partial = append(w.partial, b...)
	for {
		i := bytes.IndexByte(w.partial, '\n')
		if i < 0 {
			break
		}
		w.line(w.partial[:i])
		w.partial = w.partial[i+1:]
	}
	if len(w.partial) > 1<<20 { // no newline in a megabyte: not a log line
		w.partial = w.partial[:0]
	}
	return n, err
}
