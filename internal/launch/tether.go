package launch

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
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
// listener is bound. The line carries their addresses (server.Run).
const readyMessage = "tether ready"

// StartTether runs `tether serve --config o.Config` and waits, bounded by
// ctx, for its ready line. That line is at info level. So a config that
// logs only warnings never becomes ready here.
func StartTether(ctx context.Context, o TetherOptions) (*Tether, error) {
	if o.Bin == "" || o.Config == "" {
		return nil, errors.New("start tether: TetherOptions needs Bin and Config")
	}
	cmd := exec.Command(o.Bin, append([]string{"serve", "--config", o.Config}, o.Args...)...)
	cmd.Env = append(os.Environ(), o.Env...)
	var ev struct{ Extproc, Admin, XDS string }
	p, err := StartReady(ctx, "tether", cmd, o.Log, readyMessage, &ev)
	if err != nil {
		return nil, err
	}
	return &Tether{Proc: p, Extproc: ev.Extproc, Admin: ev.Admin, XDS: ev.XDS}, nil
}

// StartReady starts cmd under name, as Start does. It waits, bounded by
// ctx, for the first JSON line on its standard error whose "message" is
// message. That is a server's ready line, which carries the addresses it
// bound. The line is decoded into v before StartReady returns. Field names
// match the line's keys without regard to case. A process that exits
// first, or is not ready in time, is killed and its output quoted.
//
// The ready line is the proof that the addresses are this process's (see
// StartProven). The process writes it on its own standard error once it
// holds their listeners. No other process can then bind them.
func StartReady(ctx context.Context, name string, cmd *exec.Cmd, log *syncbuf.Buffer, message string, v any) (*Proc, error) {
	if log == nil {
		log = &syncbuf.Buffer{}
	}
	var mu sync.Mutex
	var ready []byte // the ready line, once seen
	cmd.Stderr = &lineWriter{to: log, line: func(line []byte) {
		var ev struct{ Message string }
		if json.Unmarshal(line, &ev) != nil || ev.Message != message {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if ready == nil { // the first one counts
			ready = bytes.Clone(line)
		}
	}}
	p, err := StartProven(ctx, name, cmd, log, "its ready line", func(context.Context, *Proc) error {
		mu.Lock()
		defer mu.Unlock()
		if ready == nil {
			return errors.New("no ready line yet")
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	mu.Lock()
	line := ready
	mu.Unlock()
	if err := json.Unmarshal(line, v); err != nil {
		p.Kill()
		return nil, fmt.Errorf("%s: ready line %s: %w", name, line, err)
	}
	return p, nil
}

// lineWriter copies what is written to it to to. It calls line for each
// complete line, without its newline. exec writes from one goroutine per
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
