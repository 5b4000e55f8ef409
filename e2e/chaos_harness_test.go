//go:build e2e

package e2e

// The chaos harness (issue 6). Three parts, meant to be reused by every
// fault scenario:
//
//   - startChaosStack: emulated instances, one or more tether replicas,
//     a redis-server (or a Redis Cluster with replicas) and Envoy, each of
//     which a scenario can kill and bring back (KillEnvoy/RestartEnvoy,
//     KillTether/RestartTether, KillRedis/StartRedis, KillClusterMaster,
//     KillInstance/RestartInstance);
//   - the load driver (startLoad): a bounded pool of conversations sent
//     through Envoy at a steady rate, bounded in count and in time, every
//     answer recorded with its phase (before the fault, during it, after
//     every session recovered; a request in flight across a boundary
//     counts as during);
//   - the bindings checker (snapshot, checkBindings): every binding read
//     from Redis itself before the fault and after it; each one present
//     before must afterwards be intact, or moved for a reason the session's
//     own answers give (a decision kind in moveKinds on the instance it is
//     now bound to). Anything else is lost, and fails the scenario.
//
// runChaos strings them together; a scenario supplies the fault:
//
//	s := startChaosStack(t, chaosOptions{})
//	res := s.runChaos(t, chaosPlan{Fault: func(t *testing.T, load *loadDriver) {
//		s.KillInstance(name)
//		load.keepRunning(t, 5*time.Second)
//		s.RestartInstance(name)
//	}})
//	res.report(t, "instance-killed", "extra_figure=…")
//	res.requireNothingLost(t)
//
// Figures go to the test log, and, when TETHER_CHAOS_OUT names a file, one
// line per scenario is appended to it (RELIABILITY.md is written from
// those lines).

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/internal/launch"
	"github.com/tetherproxy/tether/internal/pace"
	"github.com/tetherproxy/tether/internal/syncbuf"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/lab/emulator"
)

// ---------------------------------------------------------------------------
// The stack.

// chaosOptions describes a stack. The zero value is 8 instances, one
// tether and one redis-server.
type chaosOptions struct {
	Instances int  // emulated instances, half in zone-a, half in zone-b; 0 means 8
	Tethers   int  // tether replicas sharing the store, all in Envoy's ext_proc cluster; 0 means 1
	Cluster   bool // store on a Redis Cluster of 3 masters + 3 replicas instead of one redis-server
	// Configure, when set, adjusts the tethers' config (baseConfig) before
	// they start.
	Configure func(*config.Config)
}

// chaosStack is one scenario's running system. Its parts are exported
// fields so a scenario can look at them; change them only through the
// kill and restore methods.
type chaosStack struct {
	t         *testing.T
	Config    config.Config // what every tether and Envoy run, instance addresses filled in
	Instances []*chaosInstance
	Redis     *testenv.Redis             // the store; nil on a cluster
	Cluster   *testenv.ReplicatedCluster // the store when chaosOptions.Cluster; else nil
	Tethers   []*tether
	Envoy     *chaosEnvoy
}

// startChaosStack starts everything on loopback and stops it when the test
// ends.
func startChaosStack(t *testing.T, o chaosOptions) *chaosStack {
	t.Helper()
	if o.Instances == 0 {
		o.Instances = 8
	}
	if o.Tethers == 0 {
		o.Tethers = 1
	}
	s := &chaosStack{t: t}
	var url string
	if o.Cluster {
		s.Cluster = testenv.RedisClusterWithReplicas(t, testenv.ReplicatedClusterOptions{})
		url = s.Cluster.URL()
	} else {
		s.Redis = testenv.RedisServer(t)
		url = s.Redis.URL()
	}
	var inst []config.Instance
	for i := range o.Instances {
		zone := []string{"zone-a", "zone-b"}[i*2/o.Instances]
		in := startChaosInstance(t, config.Instance{
			Name: fmt.Sprintf("gpu-%s-%d", zone[len(zone)-1:], i), Zone: zone, Version: "v1", Weight: 1,
		})
		s.Instances = append(s.Instances, in)
		inst = append(inst, in.Instance)
	}
	s.Config = baseConfig(url, inst)
	if o.Configure != nil {
		o.Configure(&s.Config)
	}
	var extproc []string
	for range o.Tethers {
		tt := startTether(t, s.Config)
		s.Tethers = append(s.Tethers, tt)
		extproc = append(extproc, tt.extproc)
	}
	s.Envoy = startChaosEnvoy(t, s.Config, extproc)
	return s
}

// Proxy is Envoy's listener; its address stays the same across restarts.
func (s *chaosStack) Proxy() *proxy { return s.Envoy.px }

// KillEnvoy kills Envoy with SIGKILL: open connections are reset, new ones
// refused until RestartEnvoy.
func (s *chaosStack) KillEnvoy() { s.Envoy.kill() }

// RestartEnvoy starts a new Envoy on the same bootstrap and listener port,
// and returns once it serves.
func (s *chaosStack) RestartEnvoy() { s.Envoy.start(s.Envoy.listen) }

// KillTether kills replica i with SIGKILL (no drain), as a crashed or
// evicted pod; Envoy's ext_proc cluster keeps listing it.
func (s *chaosStack) KillTether(i int) {
	p := s.Tethers[i]
	p.stopOnce.Do(p.proc.Kill) // the cleanup's Stop then finds it stopped
}

// RestartTether starts replica i again on its ext_proc address, the one
// Envoy knows.
func (s *chaosStack) RestartTether(i int) {
	cfg := s.Config
	cfg.Server.ExtProcAddr = s.Tethers[i].extproc
	s.Tethers[i] = startTether(s.t, cfg)
}

// KillRedis kills the standalone redis-server (SIGKILL), as a crash
// would. It first makes the server durable (an append-only file, fsync per
// write; testenv.Redis.Durable), so StartRedis gets the data set back as
// from a production Redis with persistence. The socket disappears, so
// every call fails at once (not by timeout) until StartRedis.
func (s *chaosStack) KillRedis() {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Redis.Durable(ctx); err != nil {
		s.t.Fatal(err)
	}
	s.Redis.Kill()
}

// StartRedis starts the redis-server again on the same socket and
// directory; it loads the append-only file KillRedis had it keep.
func (s *chaosStack) StartRedis() { s.Redis.Start() }

// KillClusterMaster kills one master of the cluster with SIGKILL and waits
// until its replica has taken over and the cluster is ok again. It returns
// the killed and the promoted node's addresses.
func (s *chaosStack) KillClusterMaster() (killed, promoted string) {
	s.t.Helper()
	return s.clusterFault(s.Cluster.KillMaster)
}

// FailoverClusterMaster hands one master's slots to its replica (CLUSTER
// FAILOVER: nothing lost, the old master stays as a replica) and waits
// until the cluster is ok again. It returns the old and the new master's
// addresses.
func (s *chaosStack) FailoverClusterMaster() (old, promoted string) {
	s.t.Helper()
	return s.clusterFault(s.Cluster.Failover)
}

func (s *chaosStack) clusterFault(fault func(context.Context, string) (string, error)) (victim, promoted string) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	masters, err := s.Cluster.Masters(ctx)
	if err != nil {
		s.t.Fatal(err)
	}
	promoted, err = fault(ctx, masters[0])
	if err != nil {
		s.t.Fatal(err)
	}
	return masters[0], promoted
}

// Instance is the emulated instance called name.
func (s *chaosStack) Instance(name string) *chaosInstance {
	s.t.Helper()
	for _, in := range s.Instances {
		if in.Name == name {
			return in
		}
	}
	s.t.Fatalf("no instance %q", name)
	return nil
}

// KillInstance closes instance name's listener and every open connection
// at once: requests in flight fail, new connections are refused.
func (s *chaosStack) KillInstance(name string) { s.Instance(name).kill() }

// RestartInstance serves instance name again on the same address, with a
// fresh handler (a restarted model server holds no KV cache).
func (s *chaosStack) RestartInstance(name string) { s.Instance(name).start(s.t) }

// chaosInstance is an emulated instance that can be killed and restarted
// on the same address.
type chaosInstance struct {
	config.Instance // Address is fixed at the first start

	mu  sync.Mutex
	srv *http.Server // nil while killed
	wg  sync.WaitGroup
}

func startChaosInstance(t *testing.T, spec config.Instance) *chaosInstance {
	t.Helper()
	in := &chaosInstance{Instance: spec}
	in.Address = "127.0.0.1:0"
	t.Cleanup(func() { in.kill(); in.wg.Wait() })
	in.start(t)
	return in
}

func (in *chaosInstance) start(t *testing.T) {
	t.Helper()
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.srv != nil {
		return
	}
	h, err := emulator.NewHandler(emulator.Instance{Name: in.Name, Latency: time.Millisecond, Model: in.Version})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", in.Address)
	if err != nil {
		t.Fatalf("instance %s: %v", in.Name, err)
	}
	in.Address = ln.Addr().String()
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	in.srv = srv
	in.wg.Add(1)
	go func() { defer in.wg.Done(); _ = srv.Serve(ln) }()
}

func (in *chaosInstance) kill() {
	in.mu.Lock()
	srv := in.srv
	in.srv = nil
	in.mu.Unlock()
	if srv != nil {
		_ = srv.Close()
	}
}

// chaosEnvoy is an Envoy on the static bootstrap that can be killed and
// started again on the same listener port.
type chaosEnvoy struct {
	t       *testing.T
	cfg     config.Config
	extproc []string
	px      *proxy // the url is set at the first start and kept
	listen  string // the listener's host:port, fixed at the first start
	logs    *syncbuf.Buffer
	proc    *launch.Envoy // nil while killed; only the scenario's goroutine starts and kills
}

func startChaosEnvoy(t *testing.T, cfg config.Config, extproc []string) *chaosEnvoy {
	t.Helper()
	e := &chaosEnvoy{t: t, cfg: cfg, extproc: extproc, px: &proxy{}, logs: &syncbuf.Buffer{}}
	t.Cleanup(func() { // each start stops its own Envoy when the test ends
		if t.Failed() {
			t.Logf("envoy logs:\n%s", e.logs)
		}
	})
	e.start("127.0.0.1:0")
	return e
}

// start runs Envoy with its listener on listen and waits until it serves.
func (e *chaosEnvoy) start(listen string) {
	t := e.t
	t.Helper()
	cfg := e.cfg
	cfg.Envoy.ListenerAddr = listen
	b, err := staticBootstrap(cfg, e.extproc)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(e.logs, "--- envoy start, listener %s\n", listen)
	p := launchEnvoy(t, b, e.logs)
	e.proc = p
	testenv.WaitServing(t, p)
	e.listen = p.Listener
	if e.px.url == "" {
		e.px.url = p.URL()
	} else if e.px.url != p.URL() {
		t.Fatalf("restarted envoy listens on %s, want %s", e.listen, e.px.url)
	}
	e.px.admin = p.Admin
}

// kill sends SIGKILL and waits for the exit.
func (e *chaosEnvoy) kill() {
	if e.proc != nil {
		e.proc.Kill()
		e.proc = nil
	}
}

// ---------------------------------------------------------------------------
// The load driver.

// phase is when a request was sent, relative to the fault.
type phase int

const (
	phaseBefore phase = iota // steady state, every session bound
	phaseDuring              // from the fault until every session has recovered
	phaseAfter               // the stack whole again
	phases
)

func (p phase) String() string { return [...]string{"before", "during", "after"}[p] }

// loadOptions shape the load. The zero value is 300 conversations, every
// fifth known by a bearer token alone, at 200 requests/s, at most 64 in
// flight, for at most 60 s.
type loadOptions struct {
	Sessions    int           // conversations, taking turns round-robin; 0 means 300
	TokenEvery  int           // every TokenEvery-th session sends only authorization: Bearer; 0 means 5
	Rate        float64       // requests per second; 0 means 200
	MaxInFlight int           // a request due while this many are in flight is skipped (and counted); 0 means 64
	MaxDuration time.Duration // the driver stops by itself after this long; 0 means 60 s
}

// chaosRecord is one request the driver sent.
type chaosRecord struct {
	at       time.Time // when it was sent
	phase    phase     // the phase it was sent and answered in; during if it overlapped the fault at all
	session  int
	status   int    // 0 on a transport error
	instance string // x-instance: the instance that answered
	tethered string // x-tether-instance: the instance tether chose
	decision string // x-tether-decision; "" when the request bypassed tether
	err      string // the transport error
}

// failed: a transport error or a status other than 2xx.
func (r chaosRecord) failed() bool { return r.err != "" || r.status < 200 || r.status > 299 }

// loadDriver sends requests through Envoy at a steady rate until stopped or
// until its bounds (Rate × MaxDuration requests, MaxDuration) are reached.
type loadDriver struct {
	px      *proxy
	opts    loadOptions
	headers []map[string]string // per session
	keys    []string            // per session: its binding's Redis key
	phase   atomic.Int32
	cancel  context.CancelFunc // stops sending
	done    chan struct{}      // closed once the driver stopped and every answer is in
	err     error              // why the driver could not run, once done

	mu      sync.Mutex
	recs    []chaosRecord
	marks   [phases]time.Time // when each phase began
	end     time.Time         // when the last request was answered
	skipped [phases]int
}

// startLoad starts the driver against s's Envoy.
func (s *chaosStack) startLoad(t *testing.T, o loadOptions) *loadDriver {
	t.Helper()
	if o.Sessions == 0 {
		o.Sessions = 300
	}
	if o.TokenEvery == 0 {
		o.TokenEvery = 5
	}
	if o.Rate == 0 {
		o.Rate = 200
	}
	if o.MaxInFlight == 0 {
		o.MaxInFlight = 64
	}
	if o.MaxDuration == 0 {
		o.MaxDuration = 60 * time.Second
	}
	ctx, cancel := context.WithCancel(context.Background())
	d := &loadDriver{px: s.Proxy(), opts: o, cancel: cancel, done: make(chan struct{})}
	ids := extractor(t)
	for i := range o.Sessions {
		h := map[string]string{"x-session-id": fmt.Sprintf("chaos-%d", i)}
		if i%o.TokenEvery == o.TokenEvery-1 {
			h = map[string]string{"authorization": fmt.Sprintf("Bearer chaos.tok.%d", i)}
		}
		d.headers = append(d.headers, h)
		d.keys = append(d.keys, bindingKey(ids.Extract(identity.Map(h)).Key))
	}
	d.marks[phaseBefore] = time.Now()
	t.Cleanup(func() { d.stop() })
	go d.run(ctx)
	return d
}

// run paces the requests (pace.Schedule) until ctx ends or the bounds are
// reached; a request due while MaxInFlight are in flight is skipped and
// counted in the phase it was due in.
func (d *loadDriver) run(ctx context.Context) {
	defer close(d.done)
	d.err = pace.Schedule{
		Rate:        d.opts.Rate,
		Count:       int(d.opts.Rate * d.opts.MaxDuration.Seconds()),
		For:         d.opts.MaxDuration,
		MaxInFlight: d.opts.MaxInFlight,
	}.Run(ctx, func(a pace.Arrival) func() {
		ph := phase(d.phase.Load())
		if a.Dropped {
			d.mu.Lock()
			d.skipped[ph]++
			d.mu.Unlock()
			return nil
		}
		return func() { d.send(a.N%d.opts.Sessions, ph) }
	})
}

func (d *loadDriver) send(session int, ph phase) {
	r := chaosRecord{at: time.Now(), phase: ph, session: session}
	a, err := tryChat(d.px, d.headers[session])
	if err != nil {
		r.err = err.Error()
	} else {
		r.status, r.instance, r.tethered, r.decision = a.status, a.instance, a.tethered, a.decision
	}
	if phase(d.phase.Load()) != ph {
		r.phase = phaseDuring // in flight across a phase boundary: it overlapped the fault
	}
	d.mu.Lock()
	d.recs = append(d.recs, r)
	d.end = time.Now()
	d.mu.Unlock()
}

// mark begins phase p for the requests sent from now on.
func (d *loadDriver) mark(p phase) time.Time {
	now := time.Now()
	d.mu.Lock()
	d.marks[p] = now
	d.mu.Unlock()
	d.phase.Store(int32(p))
	return now
}

// keepRunning lets the load run for dur; it fails t if the driver stopped
// by itself first (its bounds are too tight for the scenario).
func (d *loadDriver) keepRunning(t *testing.T, dur time.Duration) {
	t.Helper()
	select {
	case <-time.After(dur):
	case <-d.done:
		if d.err != nil {
			t.Fatalf("the load driver: %v", d.err)
		}
		t.Fatalf("the load driver reached its bounds (%v, %.0f requests/s) before the scenario ended", d.opts.MaxDuration, d.opts.Rate)
	}
}

// waitSessions polls until every session has an answer sent at or after
// since for which ok holds, and returns how long after since the last of
// those sessions' first such answer was sent.
func (d *loadDriver) waitSessions(t *testing.T, since time.Time, timeout time.Duration, what string, ok func(chaosRecord) bool) time.Duration {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		took, waiting, seen := d.sessionsOK(since, ok)
		if waiting == 0 {
			return took
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s: %d of %d sessions still waiting; answers since: %s",
				timeout, what, waiting, d.opts.Sessions, countsString(seen))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitSessionsUpTo is waitSessions that gives up at the timeout and says
// how many sessions were still waiting.
func (d *loadDriver) waitSessionsUpTo(since time.Time, timeout time.Duration, ok func(chaosRecord) bool) (time.Duration, int) {
	deadline := time.Now().Add(timeout)
	for {
		took, waiting, _ := d.sessionsOK(since, ok)
		if waiting == 0 || time.Now().After(deadline) {
			return took, waiting
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// sessionsOK is how long after since the last session's first answer for
// which ok holds was sent, how many sessions have no such answer yet, and
// the answers since by decision (or "failed").
func (d *loadDriver) sessionsOK(since time.Time, ok func(chaosRecord) bool) (took time.Duration, waiting int, seen map[string]int) {
	first := make([]time.Time, d.opts.Sessions)
	seen = map[string]int{}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range d.recs {
		if r.at.Before(since) {
			continue
		}
		if r.failed() {
			seen["failed"]++
		} else {
			seen[r.decision]++
		}
		if ok(r) && (first[r.session].IsZero() || r.at.Before(first[r.session])) {
			first[r.session] = r.at
		}
	}
	for _, at := range first {
		if at.IsZero() {
			waiting++
		}
		took = max(took, at.Sub(since))
	}
	return took, waiting, seen
}

// first is the send time of the first answer sent at or after since for
// which ok holds, or the zero time.
func (d *loadDriver) first(since time.Time, ok func(chaosRecord) bool) time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	var at time.Time
	for _, r := range d.recs {
		if !r.at.Before(since) && ok(r) && (at.IsZero() || r.at.Before(at)) {
			at = r.at
		}
	}
	return at
}

// stop stops sending, waits for the requests in flight and returns every
// record, in the order the answers came.
func (d *loadDriver) stop() []chaosRecord {
	d.cancel()
	<-d.done
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.recs)
}

// phaseSummary is what one phase's requests came to.
type phaseSummary struct {
	Requests  int
	Failed    int            // transport errors and non-2xx
	Transport int            // transport errors among Failed
	Bypassed  int            // 2xx without a tether decision: Envoy went on without tether
	Skipped   int            // due while MaxInFlight were in flight, not sent
	Decisions map[string]int // by x-tether-decision
	Took      time.Duration
}

// summarize splits recs by phase.
func (d *loadDriver) summarize(recs []chaosRecord) (out [phases]phaseSummary) {
	d.mu.Lock()
	marks, end, skipped := d.marks, d.end, d.skipped
	d.mu.Unlock()
	for p := range phases {
		out[p].Decisions = map[string]int{}
		out[p].Skipped = skipped[p]
		if marks[p].IsZero() {
			continue
		}
		stop := end
		for q := p + 1; q < phases; q++ {
			if !marks[q].IsZero() {
				stop = marks[q]
				break
			}
		}
		out[p].Took = stop.Sub(marks[p])
	}
	for _, r := range recs {
		s := &out[r.phase]
		s.Requests++
		switch {
		case r.err != "":
			s.Failed++
			s.Transport++
		case r.failed():
			s.Failed++
		case r.decision == "":
			s.Bypassed++
		}
		if r.err == "" {
			s.Decisions[r.decision]++
		}
	}
	return out
}

// ---------------------------------------------------------------------------
// Bindings and the checker.

// moveKinds are the decisions that move a session to another instance for
// a reason tether counts. "failover" and "fallback" are the breaker's.
var moveKinds = []string{"moved", "migrated", "drained", "spilled", "degraded", "rebind", "failover", "fallback"}

// bindingKey is the Redis key of a session key's binding, as store/redis
// names it (default prefix; '%', '{', '}' escaped).
func bindingKey(key string) string {
	return "tether:{" + strings.NewReplacer("%", "%25", "{", "%7B", "}", "%7D").Replace(key) + "}:b"
}

// bindingSnapshot maps each binding's Redis key to its instance (field i).
type bindingSnapshot map[string]string

// snapshot reads every binding from Redis directly: on a cluster, from
// every master.
func (s *chaosStack) snapshot(t *testing.T) bindingSnapshot {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out := bindingSnapshot{}
	var mu sync.Mutex
	read := func(ctx context.Context, c goredis.Cmdable) error {
		iter := c.Scan(ctx, 0, "tether:{*}:b", 500).Iterator()
		var keys []string
		for iter.Next(ctx) {
			keys = append(keys, iter.Val())
		}
		if err := iter.Err(); err != nil {
			return fmt.Errorf("scan: %w", err)
		}
		for batch := range slices.Chunk(keys, 500) {
			cmds, err := c.Pipelined(ctx, func(p goredis.Pipeliner) error {
				for _, k := range batch {
					p.HGet(ctx, k, "i")
				}
				return nil
			})
			if err != nil && !errors.Is(err, goredis.Nil) {
				return fmt.Errorf("hget: %w", err)
			}
			mu.Lock()
			for i, cmd := range cmds {
				if v, err := cmd.(*goredis.StringCmd).Result(); err == nil {
					out[batch[i]] = v
				}
			}
			mu.Unlock()
		}
		return nil
	}
	var err error
	if s.Cluster != nil {
		err = s.Cluster.Client().ForEachMaster(ctx, func(ctx context.Context, m *goredis.Client) error { return read(ctx, m) })
	} else {
		err = read(ctx, s.Redis.Client())
	}
	if err != nil {
		t.Fatalf("bindings snapshot: %v", err)
	}
	return out
}

// bindingVerdict is what became of the bindings present before a fault.
type bindingVerdict struct {
	Checked     int            // bindings present before the fault
	Intact      int            // on the same instance afterwards
	Moved       map[string]int // on another instance, by the decision kind that moved them
	Lost        int            // gone afterwards, or bound anew ("bind") after the fault
	Unexplained int            // on another instance, and no answer of the session says why
	Examples    []string       // the first lost or unexplained ones
}

func (v bindingVerdict) ok() bool { return v.Checked > 0 && v.Lost == 0 && v.Unexplained == 0 }

func (v bindingVerdict) movedTotal() int {
	n := 0
	for _, c := range v.Moved {
		n += c
	}
	return n
}

func (v bindingVerdict) String() string {
	return fmt.Sprintf("%d bindings: intact %d, moved %d %s, lost %d, unexplained %d",
		v.Checked, v.Intact, v.movedTotal(), countsString(v.Moved), v.Lost, v.Unexplained)
}

// checkBindings decides, for each binding present before the fault (sent
// at since), what became of it:
//
//   - lost: it is gone afterwards, or one of the session's answers sent
//     after since says "bind" (tether found no binding and made a new
//     one, wherever it put it);
//   - intact: the same instance before and after;
//   - moved: another instance afterwards, and one of the session's answers
//     sent after since carries a decision in moveKinds and names that very
//     instance in x-tether-instance; it counts under that decision;
//   - unexplained: another instance, and no such answer.
//
// keys[i] is session i's binding key; a binding of no session the driver
// knows has no answers to explain a move: it is intact, lost or
// unexplained. explain, when not nil, may name the counted reason for a
// move no answer shows (tether moved the session before its next turn);
// the scenario checks that count against tether's own.
func checkBindings(before, after bindingSnapshot, recs []chaosRecord, keys []string, since time.Time, explain func(key, was, now string) string) bindingVerdict {
	session := map[string]int{}
	for i, k := range keys {
		session[k] = i
	}
	evidence := map[int][]chaosRecord{}
	for _, r := range recs {
		if !r.at.Before(since) && r.decision != "" && !r.failed() {
			evidence[r.session] = append(evidence[r.session], r)
		}
	}
	v := bindingVerdict{Moved: map[string]int{}}
	bad := func(format string, args ...any) {
		if len(v.Examples) < 5 {
			v.Examples = append(v.Examples, fmt.Sprintf(format, args...))
		}
	}
	for _, key := range slices.Sorted(maps.Keys(before)) {
		was := before[key]
		v.Checked++
		s, known := session[key]
		now, present := after[key]
		rebound := known && slices.ContainsFunc(evidence[s], func(r chaosRecord) bool { return r.decision == "bind" })
		switch {
		case !present:
			v.Lost++
			bad("session %d (%s): bound to %s before the fault, no binding after", s, key, was)
		case rebound:
			v.Lost++
			bad("session %d (%s): bound to %s before the fault, bound anew after it (now %s)", s, key, was, now)
		case now == was:
			v.Intact++
		default:
			kind := ""
			if known {
				for _, r := range evidence[s] {
					if slices.Contains(moveKinds, r.decision) && r.tethered == now {
						kind = r.decision
					}
				}
			}
			if kind == "" && explain != nil {
				kind = explain(key, was, now)
			}
			if kind == "" {
				v.Unexplained++
				bad("session %d (%s): %s before the fault, %s after, and no answer says why", s, key, was, now)
				continue
			}
			v.Moved[kind]++
		}
	}
	return v
}

// offBinding counts the after-phase 2xx answers of sessions whose binding
// is intact that another instance served, by decision ("" = bypassed
// tether).
func offBinding(before, after bindingSnapshot, recs []chaosRecord, keys []string) map[string]int {
	out := map[string]int{}
	for _, r := range recs {
		k := keys[r.session]
		if r.phase != phaseAfter || r.failed() || before[k] == "" || before[k] != after[k] {
			continue
		}
		if r.instance != after[k] {
			out[r.decision]++
		}
	}
	return out
}

// ---------------------------------------------------------------------------
// A scenario's timeline.

// chaosPlan is one scenario: load, the fault, recovery, load.
type chaosPlan struct {
	Load   loadOptions
	Before time.Duration // load after every session is bound, before the fault; 0 means 4 s
	After  time.Duration // load once every session has recovered; 0 means 4 s
	// Fault breaks something and repairs it while the load runs, and
	// returns when the stack is whole again (the restore time).
	Fault func(t *testing.T, load *loadDriver)
	// Recovered says that an answer shows its session recovered; nil means
	// a 2xx with a tether decision other than degraded.
	Recovered       func(chaosRecord) bool
	RecoveryTimeout time.Duration // 0 means 20 s
	// Explain, when set, names the counted reason for a binding that moved
	// without an answer saying so (see checkBindings).
	Explain func(key, was, now string) string
	// SlowRecovery lets the run go on to the after phase when some sessions
	// have not recovered within RecoveryTimeout (counted in
	// chaosResult.Unrecovered) instead of failing the test.
	SlowRecovery bool
}

// chaosResult is what a plan's run measured.
type chaosResult struct {
	Records       []chaosRecord
	Keys          []string // per session: its binding key
	Before, After bindingSnapshot
	Verdict       bindingVerdict
	Phases        [phases]phaseSummary
	Rate          float64       // requests per second over the whole run
	FaultAt       time.Time     // when Fault was called
	RestoredAt    time.Time     // when Fault returned
	FirstBack     time.Duration // restore → the first recovered answer
	AllBack       time.Duration // restore → every session has had a recovered answer (when Unrecovered is 0)
	Unrecovered   int           // sessions without a recovered answer at RecoveryTimeout (SlowRecovery only)
	OffBinding    map[string]int
}

func recoveredDefault(r chaosRecord) bool {
	return !r.failed() && r.decision != "" && r.decision != "degraded"
}

// runChaos runs plan on s: load until every session is bound and for
// plan.Before more; the bindings snapshot; plan.Fault, the during phase;
// the wait until every session has recovered; plan.After of load; the
// second snapshot and the checker.
func (s *chaosStack) runChaos(t *testing.T, plan chaosPlan) chaosResult {
	t.Helper()
	if plan.Before == 0 {
		plan.Before = 4 * time.Second
	}
	if plan.After == 0 {
		plan.After = 4 * time.Second
	}
	if plan.Recovered == nil {
		plan.Recovered = recoveredDefault
	}
	if plan.RecoveryTimeout == 0 {
		plan.RecoveryTimeout = 20 * time.Second
	}
	load := s.startLoad(t, plan.Load)
	begun := time.Now()
	load.waitSessions(t, begun, 20*time.Second, "every session bound", recoveredDefault)
	load.keepRunning(t, plan.Before)

	var res chaosResult
	res.Before = s.snapshot(t)
	res.FaultAt = load.mark(phaseDuring)
	plan.Fault(t, load)
	res.RestoredAt = time.Now()
	if plan.SlowRecovery {
		res.AllBack, res.Unrecovered = load.waitSessionsUpTo(res.RestoredAt, plan.RecoveryTimeout, plan.Recovered)
	} else {
		res.AllBack = load.waitSessions(t, res.RestoredAt, plan.RecoveryTimeout, "every session to recover", plan.Recovered)
	}
	if at := load.first(res.RestoredAt, plan.Recovered); !at.IsZero() {
		res.FirstBack = at.Sub(res.RestoredAt)
	}
	load.mark(phaseAfter)
	load.keepRunning(t, plan.After)
	res.Records = load.stop()
	res.After = s.snapshot(t)
	res.Keys = load.keys
	res.Phases = load.summarize(res.Records)
	res.Rate = float64(len(res.Records)) / load.end.Sub(begun).Seconds()
	res.Verdict = checkBindings(res.Before, res.After, res.Records, res.Keys, res.FaultAt, plan.Explain)
	res.OffBinding = offBinding(res.Before, res.After, res.Records, res.Keys)
	return res
}

// requireNothingLost fails t unless every binding present before the fault
// is intact or moved for a counted reason.
func (r chaosResult) requireNothingLost(t *testing.T) {
	t.Helper()
	if !r.Verdict.ok() {
		t.Errorf("bindings: %v; the first:\n  %s", r.Verdict, strings.Join(r.Verdict.Examples, "\n  "))
	}
}

// failures is the first few failed requests of phase p, for messages.
func (r chaosResult) failures(p phase) string {
	var out []string
	for _, rec := range r.Records {
		if rec.phase == p && rec.failed() && len(out) < 3 {
			out = append(out, fmt.Sprintf("session %d at +%v: status %d %s", rec.session,
				rec.at.Sub(r.FaultAt).Round(time.Millisecond), rec.status, rec.err))
		}
	}
	return strings.Join(out, "; ")
}

// report logs the scenario's figures in one line and appends the same line
// to $TETHER_CHAOS_OUT when set. extra holds the scenario's own figures as
// "name=value".
func (r chaosResult) report(t *testing.T, scenario string, extra ...string) {
	t.Helper()
	b, d, a := r.Phases[phaseBefore], r.Phases[phaseDuring], r.Phases[phaseAfter]
	fields := []string{
		"scenario=" + scenario,
		fmt.Sprintf("requests=%d", len(r.Records)),
		fmt.Sprintf("rate=%.0f/s", r.Rate),
		fmt.Sprintf("failed=%d/%d,%d/%d,%d/%d", b.Failed, b.Requests, d.Failed, d.Requests, a.Failed, a.Requests),
		fmt.Sprintf("transport_errors=%d", b.Transport+d.Transport+a.Transport),
		fmt.Sprintf("bypassed=%d,%d,%d", b.Bypassed, d.Bypassed, a.Bypassed),
		fmt.Sprintf("skipped=%d,%d,%d", b.Skipped, d.Skipped, a.Skipped),
		fmt.Sprintf("during=%v", d.Took.Round(10*time.Millisecond)),
		"during_decisions=" + countsString(d.Decisions),
		fmt.Sprintf("recovery_first=%v", r.FirstBack.Round(time.Millisecond)),
		"recovery_all=" + r.allBack(),
		fmt.Sprintf("unrecovered=%d", r.Unrecovered),
		fmt.Sprintf("bindings=%d", r.Verdict.Checked),
		fmt.Sprintf("intact=%d", r.Verdict.Intact),
		"moved=" + countsString(r.Verdict.Moved),
		fmt.Sprintf("lost=%d", r.Verdict.Lost+r.Verdict.Unexplained),
		"after_off_binding=" + countsString(r.OffBinding),
	}
	fields = append(fields, extra...)
	line := strings.Join(fields, " ")
	t.Logf("chaos (failed, bypassed, skipped: before, during, after): %s", line)
	path := os.Getenv("TETHER_CHAOS_OUT")
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatalf("TETHER_CHAOS_OUT: %v", err)
	}
	defer f.Close()
	if _, err := fmt.Fprintf(f, "%s %s\n", time.Now().UTC().Format(time.RFC3339), line); err != nil {
		t.Fatalf("TETHER_CHAOS_OUT: %v", err)
	}
}

// allBack is AllBack, or "-" when some sessions never recovered.
func (r chaosResult) allBack() string {
	if r.Unrecovered > 0 {
		return "-"
	}
	return r.AllBack.Round(time.Millisecond).String()
}

// countsString is "{a:1,b:2}" in key order ("-" for the empty key).
func countsString(m map[string]int) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		name := k
		if name == "" {
			name = "-"
		}
		parts = append(parts, fmt.Sprintf("%s:%d", name, m[k]))
	}
	return "{" + strings.Join(parts, ",") + "}"
}
