package bench

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/tetherproxy/tether/lab/simulator"
	"github.com/tetherproxy/tether/lab/workload"
)

// CrossCheckPoints is how far, in points of KV hit rate, the bench and the
// simulator may be apart in a row (a phase of the churn, a policy of the
// quality table) for the cross-check to pass.
const CrossCheckPoints = 3.0

// Sim is the simulator's figures for a row of the bench's, from a
// simulation of the same workload, fleet and schedule in virtual time
// (lab/simulator, as `tether-lab simulate --like-bench`).
type Sim struct {
	// Ran: the simulator has this row (false: a policy it does not
	// emulate).
	Ran      bool
	Requests int // OK and lost
	HitRate  float64
}

// Gap is the difference in points of hit rate, bench minus simulator.
func (s Sim) Gap(bench float64) float64 { return 100 * (bench - s.HitRate) }

// simPolicies are the simulator's policies of the bench's.
var simPolicies = map[string]simulator.Policy{
	policyRoundRobin.name: simulator.RoundRobin,
	policyRingHash.name:   simulator.RingHash,
	policyRandom.name:     simulator.Random,
	policySticky.name:     simulator.Sticky,
}

// simOptions are the simulator's options for the bench's quality and churn
// replays: eight A100s in two zones, the scale's rate, duration, think
// and time scales, streamed, the bench's seed for the workload and the
// routers, loadgen's drain; as `tether-lab simulate --like-bench`.
func simOptions(opts Options, p simulator.Policy) simulator.Options {
	sc := opts.Scale
	return simulator.Options{
		Policy: p, Instances: 8, Zones: 2, TimeScale: sc.TimeScale,
		Workload: workload.Config{Seed: opts.Seed},
		Rate:     sc.Rate, Duration: sc.Duration, ThinkScale: sc.ThinkScale, Drain: 30 * time.Second,
		Stream: true, Seed: opts.Seed,
	}
}

// churnSchedule is runChurn's: instances[1] killed at d/4, restored at
// d/2, a ninth added at 3d/4.
func churnSchedule(d time.Duration) []simulator.FleetEvent {
	return []simulator.FleetEvent{
		{At: d / 4, Kind: simulator.EventFail, Instance: 1},
		{At: d / 2, Kind: simulator.EventRestore, Instance: 1},
		{At: 3 * d / 4, Kind: simulator.EventAdd, Instance: 8},
	}
}

// simulateChurn runs the churn's schedule in the simulator for policy and
// returns its four phases, each request counted in the phase it ended in
// (as churnPhase counts them; the drain with the last).
func simulateChurn(ctx context.Context, opts Options, policy string) ([]Sim, error) {
	p, ok := simPolicies[policy]
	if !ok {
		return nil, nil
	}
	o := simOptions(opts, p)
	o.Scenario.Events = churnSchedule(o.Duration)
	o.Series, o.SeriesEvery, o.SeriesByEnd = true, o.Duration/4, true
	res, err := simulator.Run(ctx, o)
	if err != nil {
		return nil, fmt.Errorf("simulate %s: %w", policy, err)
	}
	return churnPhasesOf(res.Series, 4), nil
}

// churnPhasesOf adds the series' entries up into n phases, the entries
// past the last phase (the drain) into it.
func churnPhasesOf(series []simulator.Minute, n int) []Sim {
	type sum struct {
		requests       int
		prompt, cached int64
	}
	sums := make([]sum, n)
	for i, m := range series {
		s := &sums[min(i, n-1)]
		s.requests += m.OK + m.Lost
		s.prompt += m.PromptTokens
		s.cached += m.CachedTokens
	}
	out := make([]Sim, n)
	for i, s := range sums {
		out[i] = Sim{Ran: true, Requests: s.requests}
		if s.prompt > 0 {
			out[i].HitRate = float64(s.cached) / float64(s.prompt)
		}
	}
	return out
}

// crossCheckChurn sets the simulator's figures on the churn's rows (each
// policy's four phases, in order).
func crossCheckChurn(ctx context.Context, opts Options, rows []ChurnRow) error {
	sims := map[string][]Sim{}
	for i := range rows {
		pol := rows[i].Policy
		if _, done := sims[pol]; !done {
			s, err := simulateChurn(ctx, opts, pol)
			if err != nil {
				return err
			}
			sims[pol] = s
		}
		if j := phaseIndex(rows, i); j < len(sims[pol]) {
			rows[i].Sim = sims[pol][j]
		}
	}
	return nil
}

// phaseIndex is which of its policy's phases rows[i] is.
func phaseIndex(rows []ChurnRow, i int) int {
	j := 0
	for k := range i {
		if rows[k].Policy == rows[i].Policy {
			j++
		}
	}
	return j
}

// crossCheckQuality sets the simulator's figures on the quality rows of
// the policies it emulates.
func crossCheckQuality(ctx context.Context, opts Options, rows []QualityRow) error {
	for i := range rows {
		p, ok := simPolicies[rows[i].Policy]
		if !ok {
			continue
		}
		res, err := simulator.Run(ctx, simOptions(opts, p))
		if err != nil {
			return fmt.Errorf("simulate %s: %w", rows[i].Policy, err)
		}
		rows[i].Sim = Sim{Ran: true, Requests: res.Summary.Requests, HitRate: res.Summary.KVHitRate}
	}
	return nil
}

// CrossCheck is the verdict over rows' gaps: how many rows the simulator
// ran, the largest gap in points (its sign kept), and whether every one
// is within CrossCheckPoints.
type CrossCheck struct {
	Rows   int
	Widest float64
	Within bool
}

func crossCheck(bench []float64, sims []Sim) CrossCheck {
	c := CrossCheck{Within: true}
	for i, s := range sims {
		if !s.Ran {
			continue
		}
		c.Rows++
		g := s.Gap(bench[i])
		if math.Abs(g) > math.Abs(c.Widest) {
			c.Widest = g
		}
		if math.Abs(g) > CrossCheckPoints {
			c.Within = false
		}
	}
	return c
}

// ChurnCrossCheck is the verdict over the churn's rows.
func (r *Report) ChurnCrossCheck() CrossCheck {
	bench, sims := make([]float64, len(r.Churn)), make([]Sim, len(r.Churn))
	for i, c := range r.Churn {
		bench[i], sims[i] = c.HitRate, c.Sim
	}
	return crossCheck(bench, sims)
}

// QualityCrossCheck is the verdict over the quality rows.
func (r *Report) QualityCrossCheck() CrossCheck {
	bench, sims := make([]float64, len(r.Quality)), make([]Sim, len(r.Quality))
	for i, q := range r.Quality {
		bench[i], sims[i] = q.HitRate, q.Sim
	}
	return crossCheck(bench, sims)
}

// verdict says in a sentence what c found.
func (c CrossCheck) verdict(what string) string {
	switch {
	case c.Rows == 0:
		return ""
	case c.Within:
		return fmt.Sprintf("Every %s is within %.0f points of the simulator's hit rate (the widest gap %+.1f points).", what, CrossCheckPoints, c.Widest)
	}
	return fmt.Sprintf("Not every %s is within %.0f points of the simulator's hit rate: the widest gap is %+.1f points.", what, CrossCheckPoints, c.Widest)
}

// simCells are a row's simulator columns: its hit rate and the gap.
func simCells(bench float64, s Sim) string {
	if !s.Ran {
		return "– | –"
	}
	return fmt.Sprintf("%.1f%% | %+.1f", 100*s.HitRate, s.Gap(bench))
}
