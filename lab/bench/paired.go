package bench

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/tetherproxy/tether/config"
)

// The overhead scenario's rows run one configuration after another, each
// for tens of seconds, so on a shared machine a neighbour's burst can land
// on one row and not the next: three runs of the same code put tether's
// throughput at 0.82–0.99× the floor's. The paired measurement keeps the
// floor and tether sticky up side by side and alternates between them in
// short slices, so that what the machine does over a minute falls on both
// alike, and judges the goals over the floor on the sums.

// PairedSide is one side of the paired measurement, summed over its
// slices.
type PairedSide struct {
	SerialP50, P50 time.Duration
	Requests       int64         // answered in the closed-loop slices
	Took           time.Duration // the closed-loop slices' time
	// CPU per request over the closed-loop slices: Envoy's, and the
	// router's (the floor's, or tether's).
	EnvoyCPUPerRequest, RouterCPUPerRequest time.Duration
	Failed                                  int
}

// Throughput is the side's requests per second in its closed-loop slices.
func (s PairedSide) Throughput() float64 { return ratio(float64(s.Requests), s.Took.Seconds()) }

// PairedRow is tether sticky beside the floor with one client's headers.
type PairedRow struct {
	Client        string // "" for the bench's own headers
	Rounds        int
	Floor, Tether PairedSide
	// RoundRatios are tether's closed-loop throughput over the floor's,
	// round by round: how far one slice's comparison can stray.
	RoundRatios []float64
}

// pairedRounds is how many times each measurement alternates: a slice is
// a tenth of the row's measurement, a second of the closed loop at full
// scale.
const pairedRounds = 10

// runPaired starts the floor and tether sticky side by side and measures
// them in alternation with the bench's headers and the OpenAI Python
// client's.
func runPaired(ctx context.Context, opts Options, dir string, instances []config.Instance) ([]PairedRow, error) {
	pols := []policy{policyFloor, policySticky}
	stacks, err := startStacks(ctx, opts, dir, pols, instances)
	defer closeStacks(stacks)
	if err != nil {
		return nil, err
	}
	var rows []PairedRow
	for _, c := range []clientHeaders{{}, openAIPython} {
		fmt.Fprintf(opts.Log, "overhead: %s\n", pairedName(c))
		row, err := pairedOnce(ctx, stacks[0], stacks[1], c, opts.Scale)
		if err != nil {
			return rows, err
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// pairedSide is one side's connections and what it measured so far.
type pairedSide struct {
	st          *stack
	url         string
	client, one *http.Client
	serial, lat []time.Duration
	router      func(procCPU) float64 // the router's CPU seconds
	// Over the closed-loop slices: CPU seconds of Envoy and the router,
	// and the throughput of each round.
	envoyCPU, routerCPU float64
	rates               []float64
	out                 PairedSide
}

// pairedOnce measures the floor and tether in alternation with c's
// headers, after warming each side's connections and binding its hit
// sessions.
func pairedOnce(ctx context.Context, floor, tether *stack, c clientHeaders, sc Scale) (PairedRow, error) {
	row := PairedRow{Client: c.name, Rounds: pairedRounds}
	var sides [2]*pairedSide
	routers := []func(procCPU) float64{
		func(c procCPU) float64 { return c.Floor },
		func(c procCPU) float64 { return c.Tether },
	}
	for i, st := range []*stack{floor, tether} {
		s := &pairedSide{st: st, url: st.envoy.URL(), client: newLoadClient(), router: routers[i],
			one: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1}}}
		defer s.client.CloseIdleConnections()
		defer s.one.CloseIdleConnections()
		closedLoop(ctx, s.client, s.url, 4, 500*time.Millisecond, tiny(c, func(w, i int) string { return sessionFor(1000+w, i) }))
		for w := 0; w < sc.OverheadWorkers; w++ {
			if err := send(ctx, s.client, s.url, hitSession(w, 0), c); err != nil {
				return row, fmt.Errorf("bind hit session %d: %w", w, err)
			}
		}
		sides[i] = s
	}
	if err := checkFloorRoutes(ctx, sides[0].client, sides[0].url, floor.floor.routes, c); err != nil {
		return row, err
	}
	serialN := max(1, sc.OverheadSerial/pairedRounds)
	slice := sc.OverheadDuration / pairedRounds
	for r := 0; r < pairedRounds; r++ {
		order := []*pairedSide{sides[0], sides[1]}
		if r%2 == 1 {
			order[0], order[1] = order[1], order[0] // ABBA: a drift falls on both alike
		}
		for _, s := range order {
			// Sessions change every ten requests, as in the rows.
			lat, failed := serial(ctx, s.one, s.url, serialN, tiny(c, func(w, i int) string { return sessionFor(w, r*serialN+i) }))
			s.serial, s.out.Failed = append(s.serial, lat...), s.out.Failed+failed
		}
		for _, s := range order {
			lat, failed, _, err := fixedRate(ctx, s.client, s.url, sc.OverheadRate, slice, tiny(c, func(w, i int) string { return sessionFor(w+64*r, i) }))
			if err != nil {
				return row, err
			}
			s.lat, s.out.Failed = append(s.lat, lat...), s.out.Failed+failed
		}
		for _, s := range order {
			cpu0, err := s.st.cpu()
			if err != nil {
				return row, err
			}
			t0 := time.Now()
			ok, bad := closedLoop(ctx, s.client, s.url, sc.OverheadWorkers, slice, tiny(c, hitSession))
			d := time.Since(t0)
			cpu1, err := s.st.cpu()
			if err != nil {
				return row, err
			}
			cpu := cpu1.sub(cpu0)
			s.out.Requests, s.out.Took, s.out.Failed = s.out.Requests+ok, s.out.Took+d, s.out.Failed+int(bad)
			s.envoyCPU, s.routerCPU = s.envoyCPU+cpu.Envoy, s.routerCPU+s.router(cpu)
			s.rates = append(s.rates, float64(ok)/d.Seconds())
		}
	}
	for r := range pairedRounds {
		row.RoundRatios = append(row.RoundRatios, ratio(sides[1].rates[r], sides[0].rates[r]))
	}
	for _, s := range sides {
		sortDurations(s.serial)
		sortDurations(s.lat)
		s.out.SerialP50, s.out.P50 = percentile(s.serial, 0.5), percentile(s.lat, 0.5)
		perReq := func(sec float64) time.Duration {
			return time.Duration(ratio(sec, float64(s.out.Requests)) * float64(time.Second))
		}
		s.out.EnvoyCPUPerRequest, s.out.RouterCPUPerRequest = perReq(s.envoyCPU), perReq(s.routerCPU)
	}
	row.Floor, row.Tether = sides[0].out, sides[1].out
	return row, nil
}

// PairedGoals are the goals over the floor judged on the paired sums.
func (r *Report) PairedGoals() []Goal {
	var goals []Goal
	for _, p := range r.Paired {
		goals = append(goals, floorGoalsOf(pairedName(clientHeaders{name: p.Client}), r.Scale.OverheadRate,
			OverheadRow{SerialP50: p.Tether.SerialP50, P50: p.Tether.P50, Throughput: p.Tether.Throughput(), EnvoyCPUPerRequest: p.Tether.EnvoyCPUPerRequest},
			OverheadRow{SerialP50: p.Floor.SerialP50, P50: p.Floor.P50, Throughput: p.Floor.Throughput(), EnvoyCPUPerRequest: p.Floor.EnvoyCPUPerRequest})...)
	}
	return goals
}

// pairedName names tether's side of the paired measurement with c's
// headers.
func pairedName(c clientHeaders) string {
	name := policySticky.name + ", in alternation with the floor"
	if c.name != "" {
		name += ", " + c.name
	}
	return name
}
