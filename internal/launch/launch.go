// Package launch starts the servers that the tests and the lab run
// against:
//   - Envoy, with StartEnvoy;
//   - redis-server, with StartRedis;
//   - `tether serve`, with StartTether;
//   - any other program, with Start. StartProven starts a server that
//     proves who it is. StartReady starts one that logs a ready line.
//
// Every process keeps its output for error reports. It dies with its
// parent on Linux. It is stopped with SIGTERM and then SIGKILL within a
// bound. It is waited for by polling with a deadline, never by a fixed
// sleep.
//
// A server counts as started only once it proves it is the process
// started. An answer on its address may come from another process that
// holds the address, while the one started fails to bind it and exits.
//
// The package never skips or fails a test. internal/testenv wraps it for
// tests. lab/bench uses it directly.
package launch

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/tetherproxy/tether/internal/syncbuf"
)

// pollInterval is how often the ready-waits look again.
const pollInterval = 10 * time.Millisecond

// outputTail is how much of a process's output an error quotes.
const outputTail = 4000

// ErrPortTaken marks a start that failed because another process holds the
// address the server was to listen on. A caller that chose the port may
// draw another.
var ErrPortTaken = errors.New("port taken by another process")

// addrInUse is how servers say a bind failed. redis-server, PostgreSQL and
// Envoy write "Address already in use". Go programs write "address already
// in use".
const addrInUse = "address already in use"

// Proc is a started child process.
type Proc struct {
	name string
	cmd  *exec.Cmd
	log  *syncbuf.Buffer
	done chan struct{} // closed once the process has exited and its output is copied
}

// Start starts cmd under name, which messages use. What cmd writes to
// standard output and standard error goes to log, unless cmd already sends
// a stream elsewhere. A nil log means a new buffer. A goroutine waits for
// the exit, which Done reports.
func Start(name string, cmd *exec.Cmd, log *syncbuf.Buffer) (*Proc, error) {
	if log == nil {
		log = &syncbuf.Buffer{}
	}
	if cmd.Stdout == nil {
		cmd.Stdout = log
	}
	if cmd.Stderr == nil {
		cmd.Stderr = log
	}
	setDeathSignal(cmd)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Proc{name: name, cmd: cmd, log: log, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Name is the name the process was started under.
func (p *Proc) Name() string { return p.name }

// Pid is the process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Log is the buffer that holds the process's output.
func (p *Proc) Log() *syncbuf.Buffer { return p.log }

// Output is what the process has written so far.
func (p *Proc) Output() string { return p.log.String() }

// Done is closed once the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// ExitCode is the exit status of an exited process. It is -1 while the
// process runs, or when a signal ended it.
func (p *Proc) ExitCode() int {
	if !p.Exited() {
		return -1
	}
	return p.cmd.ProcessState.ExitCode()
}

// Stop sends SIGTERM and waits up to d for the exit, then kills the
// process. It reports whether it had to kill. Stopping an exited process
// does nothing.
func (p *Proc) Stop(d time.Duration) (killed bool) { return p.StopWith(syscall.SIGTERM, d) }

// StopWith is Stop with another signal than SIGTERM. PostgreSQL's fast
// shutdown, for one, is SIGINT.
func (p *Proc) StopWith(sig os.Signal, d time.Duration) (killed bool) {
	if p.Exited() {
		return false
	}
	_ = p.cmd.Process.Signal(sig)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-p.done:
		return false
	case <-t.C:
		p.Kill()
		return true
	}
}

// Kill kills the process with SIGKILL, as a crash would, and waits for the
// exit.
func (p *Proc) Kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// Poll calls ready every few milliseconds until it returns nil. It fails
// when the process exits first or ctx ends. The error quotes ready's last
// error and the end of the output. ready gets ctx, to bound the calls it
// makes.
//
// It fails at once when ready's error wraps ErrPortTaken: another process
// answers on the address. An exit whose output says the address was in use
// wraps ErrPortTaken too.
func (p *Proc) Poll(ctx context.Context, what string, ready func(context.Context) error) error {
	t := time.NewTicker(pollInterval)
	defer t.Stop()
	for {
		err := ready(ctx)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, ErrPortTaken):
			return fmt.Errorf("%s: waiting for %s: %w", p.name, what, err)
		}
		select {
		case <-p.done:
			err = fmt.Errorf("%s exited (code %d) while waiting for %s (last: %w):\n%s", p.name, p.ExitCode(), what, err, p.tail())
			if strings.Contains(strings.ToLower(p.Output()), addrInUse) {
				err = fmt.Errorf("%w: %w", ErrPortTaken, err)
			}
			return err
		case <-ctx.Done():
			return fmt.Errorf("%s: waiting for %s: %w (last: %w)\n%s", p.name, what, context.Cause(ctx), err, p.tail())
		case <-t.C:
		}
	}
}

// StartProven starts cmd as Start does and polls proof, as Poll does,
// until the server shows it is this process. A proof asks the server
// something only this process can answer, such as its process id, its
// data directory or its config file. It returns an error wrapping
// ErrPortTaken when another process answers. When the wait fails the
// process is killed.
func StartProven(ctx context.Context, name string, cmd *exec.Cmd, log *syncbuf.Buffer, what string, proof func(context.Context, *Proc) error) (*Proc, error) {
	p, err := Start(name, cmd, log)
	if err != nil {
		return nil, err
	}
	if err := p.Poll(ctx, what, func(ctx context.Context) error { return proof(ctx, p) }); err != nil {
		p.Kill()
		return nil, err
	}
	return p, nil
}

// tail is the end of the output, for error messages.
func (p *Proc) tail() string {
	s := p.log.String()
	if len(s) > outputTail {
		return "…" + s[len(s)-outputTail:]
	}
	return s
}
