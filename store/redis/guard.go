package redis

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"github.com/tetherproxy/tether/bindings"
)

// The guard's settings (see the package comment, "Outages").
const (
	// guardThreshold is how many calls in a row must fail for the guard to
	// open.
	guardThreshold = 5
	// guardCooldown is how long the guard stays open before it lets one
	// probe call through; each failed probe doubles it, up to
	// guardMaxCooldown.
	guardCooldown    = 500 * time.Millisecond
	guardMaxCooldown = 2 * time.Second
	// startTimeout bounds the store's start-up PING. Past it the store
	// starts with its guard open. loadTimeout bounds loading the scripts
	// once Redis answered. A loaded machine can make that slow.
	startTimeout = time.Second
	loadTimeout  = 5 * time.Second
)

// ErrGuardOpen is the error of a call the store refused without sending
// it, because its guard is open. Redis failed the calls before it, and is
// taken as unreachable. The errors the store returns wrap it. Test with
// errors.Is.
var ErrGuardOpen = errors.New("redis unavailable")

// Health returns the state of the store's guard on Redis. It does not
// touch the network.
func (s *Store) Health() bindings.Health {
	h := s.guard.health()
	h.Hits = s.hits
	return h
}

// guardConfig tunes a guard; the zero values of threshold, cooldown,
// maxCooldown and now take the defaults.
type guardConfig struct {
	threshold             int
	cooldown, maxCooldown time.Duration
	now                   func() time.Time
	// redact removes secrets from an error text (nil: none).
	redact func(string) string
	// onFailure, when set, hears every failed call, outside the lock. A
	// cluster client reloads its slot map then, because a dead master sends
	// no MOVED to say its replica took over.
	onFailure func()
}

// guard is a store's guard on Redis. It is a go-redis hook that fails calls
// at once while Redis is taken as down. It is a circuit breaker, named
// apart from the instance breaker, fleet.Breaker. It is safe for concurrent
// use. A closed guard costs an atomic load before a call and another after
// it. It takes its lock only when the call failed or follows a failure.
type guard struct {
	threshold             int
	cooldown, maxCooldown time.Duration
	now                   func() time.Time
	redact                func(string) string
	onFailure             func()
	// off says the store was closed. go-redis cannot remove a hook. So on a
	// client the caller owns, from New, the guard stays installed. It must
	// let every call through untouched.
	off atomic.Bool

	// word holds the state in its low bits and, above them, a generation
	// bumped at every change of state. A call's outcome counts only if the
	// word is still the one it was admitted under. So calls sent before the
	// guard opened cannot close it, and a late failure cannot reopen it.
	word      atomic.Uint64
	openUntil atomic.Int64 // unix nanoseconds; meaningful while open
	reject    atomic.Pointer[unavailableError]
	fails     atomic.Int64 // written under mu
	// dialErr is the error of the last dial, nil after one succeeded: a
	// call that times out while dialling reports only its deadline.
	dialErr atomic.Pointer[string]

	// Counters for tests: probes let through, and dials.
	probes, dials atomic.Uint64

	mu       sync.Mutex
	current  time.Duration // the cooldown of the current opening
	lastErr  string
	since    time.Time
	opens    uint64
	onChange func(open bool)
}

const (
	stateBits = 2
	stateMask = 1<<stateBits - 1
)

func newGuard(c guardConfig) *guard {
	g := &guard{threshold: c.threshold, cooldown: c.cooldown, maxCooldown: c.maxCooldown, now: c.now, redact: c.redact, onFailure: c.onFailure}
	if g.threshold <= 0 {
		g.threshold = guardThreshold
	}
	if g.cooldown <= 0 {
		g.cooldown = guardCooldown
	}
	if g.maxCooldown <= 0 {
		g.maxCooldown = guardMaxCooldown
	}
	g.maxCooldown = max(g.maxCooldown, g.cooldown)
	if g.now == nil {
		g.now = time.Now
	}
	if g.redact == nil {
		g.redact = func(s string) string { return s }
	}
	g.current = g.cooldown
	g.since = g.now()
	return g
}

// unavailableError is what a refused call returns: ErrGuardOpen and why.
type unavailableError struct{ msg string }

func (e *unavailableError) Error() string { return e.msg }
func (e *unavailableError) Unwrap() error { return ErrGuardOpen }

// DialHook counts dials and keeps the last one's error. It never refuses a
// dial. So go-redis's own pool recovery keeps working while the guard is
// open. That recovery is a background dial once a second after many failed
// dials.
func (g *guard) DialHook(next goredis.DialHook) goredis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		g.dials.Add(1)
		conn, err := next(ctx, network, addr)
		if err != nil {
			msg := err.Error()
			g.dialErr.Store(&msg)
		} else if g.dialErr.Load() != nil {
			g.dialErr.Store(nil)
		}
		return conn, err
	}
}

// ProcessHook guards one command, retries included.
func (g *guard) ProcessHook(next goredis.ProcessHook) goredis.ProcessHook {
	return func(ctx context.Context, cmd goredis.Cmder) error {
		if setupCommand(cmd) || g.off.Load() {
			return next(ctx, cmd)
		}
		token, err := g.admit()
		if err != nil {
			cmd.SetErr(err)
			return err
		}
		err = next(ctx, cmd)
		g.done(token, err)
		return err
	}
}

// ProcessPipelineHook guards a pipeline (or transaction) as one call.
func (g *guard) ProcessPipelineHook(next goredis.ProcessPipelineHook) goredis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []goredis.Cmder) error {
		if len(cmds) == 0 || setupCommand(cmds[0]) || g.off.Load() {
			return next(ctx, cmds)
		}
		token, err := g.admit()
		if err != nil {
			for _, c := range cmds {
				c.SetErr(err)
			}
			return err
		}
		err = next(ctx, cmds)
		g.done(token, err)
		return err
	}
}

// setupCommand reports whether cmd is one go-redis sends to set up a new
// connection: HELLO, AUTH, SELECT, READONLY, CLIENT SETNAME/SETINFO/….
// go-redis sends them through the client's hooks, from within the call that
// needed the connection. They pass unguarded and uncounted. Otherwise a
// probe would be refused its own connection, and a failed set-up would
// count twice. The store sends none of them itself.
func setupCommand(cmd goredis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "auth", "select", "readonly", "client":
		return true
	}
	return false
}

// admit lets a call through, returning the word it was admitted under, or
// refuses it with an error wrapping ErrGuardOpen.
func (g *guard) admit() (uint64, error) {
	for {
		w := g.word.Load()
		switch bindings.GuardState(w & stateMask) {
		case bindings.GuardClosed:
			return w, nil
		case bindings.GuardOpen:
			if g.now().UnixNano() < g.openUntil.Load() {
				return 0, g.reject.Load()
			}
			// The cooldown has passed: this call may be the probe.
			g.mu.Lock()
			if g.word.Load() != w {
				g.mu.Unlock()
				continue // another call got there first
			}
			token := g.setState(bindings.GuardHalfOpen)
			g.mu.Unlock()
			g.probes.Add(1)
			return token, nil
		default: // half-open: the probe is out
			return 0, g.reject.Load()
		}
	}
}

// outcome is what a call's result says about Redis.
type outcome int

const (
	answered     outcome = iota // Redis answered, maybe with an error reply
	failed                      // Redis is unreachable, slow or not serving
	inconclusive                // says nothing about Redis
)

// classify sorts a call's error. Replies are answers, except those that
// say the server cannot serve now (loading, cluster down, busy script,
// failover in progress, too many clients). Errors that are not replies
// (network errors, timeouts, pool timeouts) are failures, except a
// caller's cancellation, a closed client and another guard's refusal.
func classify(err error) outcome {
	if err == nil {
		return answered
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, goredis.ErrClosed) || errors.Is(err, ErrGuardOpen) {
		return inconclusive
	}
	var reply goredis.Error
	if !errors.As(err, &reply) {
		return failed
	}
	if goredis.IsLoadingError(err) || goredis.IsClusterDownError(err) || goredis.IsTryAgainError(err) ||
		goredis.IsMasterDownError(err) || goredis.IsReadOnlyError(err) || goredis.IsMaxClientsError(err) ||
		goredis.HasErrorPrefix(err, "BUSY ") {
		return failed
	}
	return answered
}

// done records the outcome of a call admitted under token.
func (g *guard) done(token uint64, err error) {
	o := classify(err)
	if o == answered && token&stateMask == uint64(bindings.GuardClosed) && g.fails.Load() == 0 {
		return // the fast path: nothing to change
	}
	if o == failed && g.onFailure != nil {
		g.onFailure()
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.word.Load() != token {
		return // the state changed while the call was out
	}
	switch o {
	case answered:
		g.fails.Store(0)
		if token&stateMask != uint64(bindings.GuardClosed) {
			g.current = g.cooldown
			g.since = g.now()
			g.setState(bindings.GuardClosed)
			g.notify(false)
		}
	case failed:
		g.fail(err)
	case inconclusive:
		if token&stateMask == uint64(bindings.GuardHalfOpen) {
			// The probe said nothing: the next call probes again.
			g.openUntil.Store(g.now().UnixNano())
			g.setState(bindings.GuardOpen)
		}
	}
}

// fail records a failed call; mu is held.
func (g *guard) fail(err error) {
	n := g.fails.Add(1)
	g.lastErr = g.describe(err)
	switch bindings.GuardState(g.word.Load() & stateMask) {
	case bindings.GuardClosed:
		if n >= int64(g.threshold) {
			g.open(g.cooldown)
		}
	case bindings.GuardHalfOpen:
		g.open(min(2*g.current, g.maxCooldown))
	}
}

// describe is the text Health reports for err: with the last dial's error
// when err is a bare deadline (the dial is usually why), without secrets.
func (g *guard) describe(err error) string {
	msg := err.Error()
	if d := g.dialErr.Load(); d != nil && errors.Is(err, context.DeadlineExceeded) && !strings.Contains(msg, *d) {
		msg += " (last dial: " + *d + ")"
	}
	return g.redact(msg)
}

// trip opens the guard at once (a start without Redis); mu is not held.
func (g *guard) trip(err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.fails.Load() == 0 {
		g.fails.Store(1) // the hook did not count it (a refusal)
	}
	g.lastErr = g.describe(err)
	if bindings.GuardState(g.word.Load()&stateMask) != bindings.GuardOpen {
		g.open(g.cooldown)
	}
}

// open opens the guard for cooldown; mu is held.
func (g *guard) open(cooldown time.Duration) {
	now := g.now()
	g.current = cooldown
	fromClosed := bindings.GuardState(g.word.Load()&stateMask) == bindings.GuardClosed
	g.reject.Store(&unavailableError{msg: fmt.Sprintf("%v: guard open after %d failed calls in a row (last: %s)",
		ErrGuardOpen, g.fails.Load(), g.lastErr)})
	g.openUntil.Store(now.Add(cooldown).UnixNano())
	g.setState(bindings.GuardOpen)
	if fromClosed {
		g.since = now
		g.opens++
		g.notify(true)
	}
}

// setState moves to s with a new generation and returns the new word; mu
// is held.
func (g *guard) setState(s bindings.GuardState) uint64 {
	w := (g.word.Load()>>stateBits+1)<<stateBits | uint64(s)
	g.word.Store(w)
	return w
}

// notify tells the OnGuard hook; mu is held.
func (g *guard) notify(open bool) {
	if g.onChange != nil {
		g.onChange(open)
	}
}

// watch installs the OnGuard hook and reports the current state to it.
func (g *guard) watch(fn func(open bool)) {
	if fn == nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.onChange = fn
	fn(bindings.GuardState(g.word.Load()&stateMask) != bindings.GuardClosed)
}

func (g *guard) health() bindings.Health {
	g.mu.Lock()
	defer g.mu.Unlock()
	return bindings.Health{
		State:     bindings.GuardState(g.word.Load() & stateMask),
		Failures:  int(g.fails.Load()),
		LastError: g.lastErr,
		Since:     g.since,
		Opens:     g.opens,
	}
}

// start checks that Redis answers a PING within startTimeout. Then it loads
// the scripts within loadTimeout, so that calls go straight to EVALSHA.
//
// A Redis that cannot be reached, as classify says, does not fail start.
// The store starts with its guard open. A call that finds its script
// missing sends it with EVAL, which caches it (exec). A Redis that answers
// with an error does fail start. Such errors are a wrong password, or no
// permission to run scripts.
func (s *Store) start(ctx context.Context, scripts []*goredis.Script) error {
	unavailable := func(err error) bool {
		if classify(err) == failed || errors.Is(err, ErrGuardOpen) {
			s.guard.trip(err)
			return true
		}
		return false
	}
	pctx, cancel := context.WithTimeout(ctx, startTimeout)
	err := s.client.Ping(pctx).Err()
	cancel()
	if err != nil {
		if unavailable(err) {
			return nil
		}
		return fmt.Errorf("redis store: ping: %w", err)
	}
	lctx, cancel := context.WithTimeout(ctx, loadTimeout)
	defer cancel()
	for _, sc := range scripts {
		if err := sc.Load(lctx, s.client).Err(); err != nil {
			if unavailable(err) {
				return nil
			}
			return fmt.Errorf("redis store: load scripts: %w", err)
		}
	}
	return nil
}
