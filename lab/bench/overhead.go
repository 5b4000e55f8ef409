package bench

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/lab/emulator"
)

// OverheadRow is one configuration of the overhead scenario.
type OverheadRow struct {
	Name string
	// Client names the headers the requests carry beside the bench's own
	// ("": none; load.go); rows compare with the Envoy alone and floor
	// rows of the same Client.
	Client string
	// OnPath: tether is on the request path (ext_proc); Store: it keeps
	// sessions in redis-server (sticky); Floor: the ext_proc floor is
	// (floor.go), a process of its own.
	OnPath, Store, Floor bool
	// One connection, Serial requests one after another.
	Serial               int
	SerialP50, SerialP99 time.Duration
	// At a fixed open-loop rate:
	P50, P99        time.Duration
	Failed, Dropped int
	// The hit loop: closed loop on Scale.OverheadWorkers connections, as
	// fast as answers come back, each connection sending for one session
	// bound before the loop (so sticky routing sees only hits): the
	// throughput at that concurrency, not a proven maximum.
	Throughput  float64 // requests per second
	HitRequests int64   // requests answered in the hit loop
	// CPU per request each process used in the hit loop, from
	// /proc/<pid>/stat. Tether's is 0 where it is off the path, Redis's
	// without redis-server, the floor's on every row but the floor's.
	EnvoyCPUPerRequest, TetherCPUPerRequest, RedisCPUPerRequest, FloorCPUPerRequest time.Duration
	// Redis commands per request in the hit loop (INFO commandstats) less
	// what tether sends with no load over as long (Store rows only), in
	// all and by command.
	RedisCommandsPerRequest float64
	RedisCommands           map[string]float64
	// Tether's decisions in the hit loop (on-path rows; on the floor's row,
	// the requests it answered): how many, the
	// share that were hits, the degraded ones (the store did not answer
	// within redis.timeout, and the request was placed by rendezvous
	// hashing) and the store calls that failed (tether_store_errors_total).
	Decisions             int
	HitShare              float64
	Degraded, StoreErrors int
}

// hitLoopMax bounds the hit loop's requests, beside its duration: more than
// loopback on a few cores answers in Scale.OverheadDuration.
const hitLoopMax = 500_000

// serialTimeout bounds the one-connection row, beside its count.
const serialTimeout = 2 * time.Minute

// runOverhead: four zero-latency instances; Envoy alone (tether serves its
// configuration but is not on the request path), Envoy's ext_proc filter
// calling the ext_proc floor (the bound), Envoy + tether random,
// Envoy + tether sticky with redis-server, and sticky again with each other
// way outcomes reach tether (envoy.outcomes; the default is access_log);
// Envoy alone, the floor and sticky again with the OpenAI Python client's
// headers; then the floor and sticky in alternation (paired.go); then the
// same instances with a chat body of each of Scale.BodySizes (body.go).
func runOverhead(ctx context.Context, opts Options, dir string) ([]OverheadRow, []PairedRow, []BodyRow, error) {
	fleet := newSimFleet(func(string) (emulator.LatencyModel, error) { return emulator.Fixed(0), nil })
	defer fleet.close()
	var instances []config.Instance
	for i := 0; i < 4; i++ {
		in, err := fleet.add(fmt.Sprintf("zero-%d", i), "z")
		if err != nil {
			return nil, nil, nil, err
		}
		instances = append(instances, in)
	}
	sc := opts.Scale
	var rows []OverheadRow
	alone := policy{name: "Envoy alone", edit: envoyOnly("round_robin"), offPath: true}
	for _, r := range []struct {
		p policy
		c clientHeaders
	}{
		{alone, clientHeaders{}}, {policyFloor, clientHeaders{}}, {policyRandom, clientHeaders{}}, {policySticky, clientHeaders{}},
		{stickyOutcomes("observe"), clientHeaders{}}, {stickyOutcomes("inline"), clientHeaders{}},
		{alone, openAIPython}, {policyFloor, openAIPython}, {policySticky, openAIPython},
	} {
		p := r.p
		if r.c.name != "" {
			p.name += ", " + r.c.name
		}
		fmt.Fprintf(opts.Log, "overhead: %s\n", p.name)
		row, err := overheadOnce(ctx, opts, dir, p, r.c, instances, sc)
		if err != nil {
			return rows, nil, nil, fmt.Errorf("%s: %w", p.name, err)
		}
		rows = append(rows, row)
	}
	paired, err := runPaired(ctx, opts, dir, instances)
	if err != nil {
		return rows, paired, nil, fmt.Errorf("in alternation: %w", err)
	}
	bodies, err := runBodies(ctx, opts, dir, instances)
	return rows, paired, bodies, err
}

func overheadOnce(ctx context.Context, opts Options, dir string, p policy, c clientHeaders, instances []config.Instance, sc Scale) (OverheadRow, error) {
	st, err := startStack(ctx, opts, dir, p, instances)
	if err != nil {
		return OverheadRow{}, err
	}
	defer st.close()
	row := OverheadRow{Name: p.name, Client: c.name, OnPath: !p.offPath && !p.floor, Store: p.store, Floor: p.floor}
	url := st.envoy.URL()
	client := newLoadClient()
	defer client.CloseIdleConnections()
	// Warm connections and bindings.
	closedLoop(ctx, client, url, 4, 500*time.Millisecond, tiny(c, func(w, i int) string { return sessionFor(1000+w, i) }))
	if st.floor != nil {
		if err := checkFloorRoutes(ctx, client, url, st.floor.routes, c); err != nil {
			return row, err
		}
	}

	// One connection, one request at a time.
	one := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1}}
	defer one.CloseIdleConnections()
	// Sessions change every ten requests, in this loop and the next.
	lat, failed := serial(ctx, one, url, sc.OverheadSerial, tiny(c, sessionFor))
	sortDurations(lat)
	row.Serial, row.SerialP50, row.SerialP99, row.Failed = len(lat), percentile(lat, 0.5), percentile(lat, 0.99), failed

	lat, failed, dropped, err := fixedRate(ctx, client, url, sc.OverheadRate, sc.OverheadDuration, tiny(c, sessionFor))
	if err != nil {
		return row, err
	}
	sortDurations(lat)
	row.P50, row.P99, row.Failed, row.Dropped = percentile(lat, 0.5), percentile(lat, 0.99), row.Failed+failed, dropped

	if err := hitLoop(ctx, st, client, c, sc, &row); err != nil {
		return row, err
	}
	return row, nil
}

// hitSession is the session the hit loop's connection w sends for.
func hitSession(w, _ int) string { return fmt.Sprintf("hit-%d", w) }

// hitLoop binds one session per connection, measures what tether sends
// redis-server with no load, then runs the closed loop and fills row's
// throughput, CPU, Redis and decision figures.
func hitLoop(ctx context.Context, st *stack, client *http.Client, c clientHeaders, sc Scale, row *OverheadRow) error {
	url := st.envoy.URL()
	for w := 0; w < sc.OverheadWorkers; w++ {
		if err := send(ctx, client, url, hitSession(w, 0), c); err != nil {
			return fmt.Errorf("bind hit session %d: %w", w, err)
		}
	}
	var idle map[string]float64
	var idleFor time.Duration
	if st.rdb != nil {
		c0, err := commandStats(ctx, st)
		if err != nil {
			return err
		}
		t0 := time.Now()
		if !sleepUntil(ctx, t0.Add(sc.OverheadDuration)) {
			return ctx.Err()
		}
		c1, err := commandStats(ctx, st)
		if err != nil {
			return err
		}
		idle, idleFor = subCounts(c1, c0), time.Since(t0)
	}

	var d0 map[string]float64
	var e0 float64
	var err error
	if row.OnPath {
		if d0, e0, err = decisionsAndStoreErrors(ctx, st.tether.Admin); err != nil {
			return err
		}
	}
	var r0 map[string]float64
	if st.rdb != nil {
		if r0, err = commandStats(ctx, st); err != nil {
			return err
		}
	}
	var floor0 int64
	if st.floor != nil {
		if floor0, err = st.floor.requests(ctx); err != nil {
			return err
		}
	}
	cpu0, err := st.cpu()
	if err != nil {
		return err
	}
	t0 := time.Now()
	ok, bad := closedLoop(ctx, client, url, sc.OverheadWorkers, sc.OverheadDuration, tiny(c, hitSession))
	took := time.Since(t0)
	cpu1, err := st.cpu()
	if err != nil {
		return err
	}
	row.Failed += int(bad)
	row.HitRequests = ok
	if ok == 0 {
		return nil
	}
	row.Throughput = float64(ok) / took.Seconds()
	perReq := func(sec float64) time.Duration { return time.Duration(sec / float64(ok) * float64(time.Second)) }
	cpu := cpu1.sub(cpu0)
	row.EnvoyCPUPerRequest = perReq(cpu.Envoy)
	if row.OnPath {
		row.TetherCPUPerRequest = perReq(cpu.Tether)
	}
	row.RedisCPUPerRequest = perReq(cpu.Redis)
	row.FloorCPUPerRequest = perReq(cpu.Floor)
	if st.rdb != nil {
		r1, err := commandStats(ctx, st)
		if err != nil {
			return err
		}
		row.RedisCommands, row.RedisCommandsPerRequest = commandsPerRequest(subCounts(r1, r0), took, idle, idleFor, ok)
	}
	if st.floor != nil {
		floor1, err := st.floor.requests(ctx)
		if err != nil {
			return err
		}
		row.Decisions = int(floor1 - floor0)
	}
	if row.OnPath {
		d1, e1, err := decisionsAndStoreErrors(ctx, st.tether.Admin)
		if err != nil {
			return err
		}
		d := subCounts(d1, d0)
		var sum float64
		for _, v := range d {
			sum += v
		}
		row.Decisions = int(sum)
		if sum > 0 {
			row.HitShare = d["hit"] / sum
		}
		row.Degraded, row.StoreErrors = int(d["degraded"]), int(e1-e0)
	}
	return nil
}

// commandsPerRequest is, by command and in all, the commands of the loaded
// window (took long, n requests) less the idle window's (scaled to as
// long), per request. Commands whose difference is not above zero are
// left out of the map.
func commandsPerRequest(loaded map[string]float64, took time.Duration, idle map[string]float64, idleFor time.Duration, n int64) (map[string]float64, float64) {
	scale := 0.0
	if idleFor > 0 {
		scale = took.Seconds() / idleFor.Seconds()
	}
	by := map[string]float64{}
	var total float64
	for cmd, v := range loaded {
		total += v
		if d := v - scale*idle[cmd]; d > 0 {
			by[cmd] = d / float64(n)
		}
	}
	for _, v := range idle {
		total -= scale * v
	}
	return by, max(0, total) / float64(n)
}

func decisionsAndStoreErrors(ctx context.Context, admin string) (map[string]float64, float64, error) {
	m, err := scrape(ctx, admin)
	if err != nil {
		return nil, 0, err
	}
	d, err := decisionCounts(m)
	if err != nil {
		return nil, 0, err
	}
	g, err := gauges(m, "tether_store_errors_total")
	if err != nil {
		return nil, 0, err
	}
	return d, g["tether_store_errors_total"], nil
}

// commandStats reads redis-server's calls by command.
func commandStats(ctx context.Context, st *stack) (map[string]float64, error) {
	s, err := st.rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return nil, fmt.Errorf("redis info commandstats: %w", err)
	}
	return parseCommandStats(s)
}

// parseCommandStats reads the calls of each command from the text of INFO
// commandstats ("cmdstat_get:calls=3,usec=…"), leaving out INFO itself (the
// bench's own reads).
func parseCommandStats(info string) (map[string]float64, error) {
	out := map[string]float64{}
	for _, line := range strings.Split(info, "\n") {
		line = strings.TrimSpace(line)
		name, rest, ok := strings.Cut(line, ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		name = strings.TrimPrefix(name, "cmdstat_")
		if name == "info" {
			continue
		}
		var calls string
		for _, kv := range strings.Split(rest, ",") {
			if v, ok := strings.CutPrefix(kv, "calls="); ok {
				calls = v
			}
		}
		n, err := strconv.ParseUint(calls, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("commandstats %s: calls %q: %w", name, calls, err)
		}
		out[name] = float64(n)
	}
	return out, nil
}

// subCounts is a−b by key.
func subCounts(a, b map[string]float64) map[string]float64 {
	out := make(map[string]float64, len(a))
	for k, v := range a {
		out[k] = v - b[k]
	}
	return out
}

// topCommands renders the largest per-request command counts, "get 1.00,
// pexpire 0.50".
func topCommands(by map[string]float64, n int) string {
	type kv struct {
		k string
		v float64
	}
	var all []kv
	for k, v := range by {
		all = append(all, kv{k, v})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].v > all[j].v || (all[i].v == all[j].v && all[i].k < all[j].k) })
	var parts []string
	for i := 0; i < len(all) && i < n; i++ {
		parts = append(parts, fmt.Sprintf("%s %.2f", strings.ToUpper(all[i].k), all[i].v))
	}
	return strings.Join(parts, ", ")
}

// policyFloor is Envoy's ext_proc filter, as tether generates it, calling
// the ext_proc floor, which routes each request to an instance's cluster
// (a request Envoy sent on without it would go to the pool, round robin,
// as with Envoy alone).
var policyFloor = policy{name: "ext_proc floor", floor: true, edit: func(c *config.Config) { c.Envoy.PoolLB = "round_robin" }}

// floorProbes is how many sessions checkFloorRoutes sends a request for.
const floorProbes = 16

// checkFloorRoutes proves that the floor routes through this Envoy: the
// request of each of floorProbes sessions is answered by the instance
// (the emulator's answer header) whose cluster the floor named for it,
// and together they reach more than one instance.
func checkFloorRoutes(ctx context.Context, client *http.Client, url string, routes FloorRoutes, c clientHeaders) error {
	seen := map[string]bool{}
	for i := 0; i < floorProbes; i++ {
		session := fmt.Sprintf("route-%d", i)
		h, err := postTiny(ctx, client, url, soakCaller{session: session}, c.h)
		if err != nil {
			return fmt.Errorf("routing check, session %s: %w", session, err)
		}
		name := h.Get(emulator.InstanceHeader)
		if got, want := (fleet.Instance{Name: name}).Cluster(), routes.clusterFor(session); got != want {
			return fmt.Errorf("routing check: session %s answered by instance %q, the floor named %s", session, name, want)
		}
		seen[name] = true
	}
	if len(seen) < 2 {
		return fmt.Errorf("routing check: %d sessions all answered by %v", floorProbes, seen)
	}
	return nil
}

// stickyOutcomes is sticky routing with envoy.outcomes set to mode.
func stickyOutcomes(mode string) policy {
	return policy{name: "tether sticky, outcomes " + mode, store: true, edit: func(c *config.Config) { c.Envoy.Outcomes = mode }}
}
