package bench

import (
	"fmt"
	"math"
	"time"
)

// The overhead goals: what tether on the path of every request may cost
// beside Envoy alone, and beside the ext_proc floor (floor.go), the least
// a router behind the same Envoy filter costs.
const (
	GoalAddedP50        = 300 * time.Microsecond
	GoalAddedP99        = time.Millisecond
	GoalThroughputRatio = 0.75
	GoalCPUPerHit       = 50 * time.Microsecond // tether + redis-server
	GoalRedisPerHit     = 0.0                   // commands per sticky hit
	// Over the floor: the p50 tether adds to it, its throughput and
	// Envoy's CPU per request as shares of the floor's.
	GoalP50OverFloor      = 100 * time.Microsecond
	GoalThroughputVsFloor = 0.90
	GoalEnvoyCPUVsFloor   = 1.10
)

// Goal is one overhead goal for one configuration, with the figure the run
// measured.
type Goal struct {
	Path string // the configuration (an OverheadRow's Name)
	What string
	// Value against Limit: reached when Value ≤ Limit (AtMost) or ≥ it,
	// compared as Figure shows them (at the precision of Unit).
	Value, Limit float64
	AtMost       bool
	Unit         string // "ms", "µs", "×" or "" (a count)
	Reached      bool
	// NoVerdict: an added latency below zero, where Envoy alone's figure
	// was the noisier one; neither reached nor missed.
	NoVerdict bool
	// Bound is the same figure on the ext_proc floor's row (HasBound):
	// what any Go ext_proc server behind this Envoy costs.
	Bound    float64
	HasBound bool
}

// Verdict is how the report says whether g was reached.
func (g Goal) Verdict() string {
	switch {
	case g.Reached:
		return "yes"
	case g.NoVerdict:
		return "no verdict (Envoy alone was slower: noise)"
	}
	return "no"
}

// BoundFigure is the floor's figure as the report shows it; "–" without.
func (g Goal) BoundFigure() string {
	if !g.HasBound {
		return "–"
	}
	return formatGoal(g.Bound, g.Unit)
}

// Figure is the goal's measured value as the report shows it.
func (g Goal) Figure() string { return formatGoal(g.Value, g.Unit) }

// Target is the goal itself, "≤ 0.30 ms".
func (g Goal) Target() string {
	op := "≥"
	if g.AtMost {
		op = "≤"
	}
	if g.AtMost && g.Limit == 0 {
		op = "="
	}
	return op + " " + formatGoal(g.Limit, g.Unit)
}

// goalDigits is the precision a unit is shown and judged at.
func goalDigits(unit string) int {
	if unit == "µs" {
		return 0
	}
	return 2
}

func formatGoal(v float64, unit string) string {
	s := fmt.Sprintf("%.*f", goalDigits(unit), v)
	switch unit {
	case "":
		return s
	case "×":
		return s + "×"
	}
	return s + " " + unit
}

func newGoal(path, what string, value, limit float64, atMost bool, unit string) Goal {
	p := math.Pow(10, float64(goalDigits(unit)))
	v, l := math.Round(value*p), math.Round(limit*p)
	reached := v >= l
	if atMost {
		reached = v <= l
	}
	return Goal{Path: path, What: what, Value: value, Limit: limit, AtMost: atMost, Unit: unit, Reached: reached}
}

// addedGoal is a latency goal over Envoy alone: below zero, the baseline's
// noise outweighed tether's cost, and the run says nothing.
func addedGoal(path, what string, value, limit float64) Goal {
	g := newGoal(path, what, value, limit, true, "ms")
	if value < 0 {
		g.Reached, g.NoVerdict = false, true
	}
	return g
}

// OverheadGoals evaluates the overhead goals for every configuration with
// tether on the request path against Envoy alone with the same client's
// headers; nil when the run has no such pair. Where the run has the
// ext_proc floor with those headers, each latency and throughput goal
// carries the floor's figure as its bound, and the goals over the floor
// follow.
func (r *Report) OverheadGoals() []Goal {
	var goals []Goal
	for _, o := range r.Overhead {
		if !o.OnPath {
			continue
		}
		base, floor := r.overheadPeers(o.Client)
		if base == nil {
			continue
		}
		bounds := map[string]float64{}
		if floor != nil {
			for _, g := range r.goalsOf(*floor, *base) {
				bounds[g.What] = g.Value
			}
		}
		for _, g := range r.goalsOf(o, *base) {
			g.Bound, g.HasBound = bounds[g.What]
			goals = append(goals, g)
		}
		if floor != nil {
			goals = append(goals, r.floorGoals(o, *floor)...)
		}
	}
	return goals
}

// overheadPeers are the first rows of Envoy alone and of the ext_proc
// floor whose requests carried client's headers; nil where there is none.
func (r *Report) overheadPeers(client string) (base, floor *OverheadRow) {
	for i := range r.Overhead {
		o := &r.Overhead[i]
		switch {
		case o.Client != client:
		case o.Floor && floor == nil:
			floor = o
		case !o.OnPath && !o.Floor && base == nil:
			base = o
		}
	}
	return base, floor
}

// floorGoals are o's goals over the floor with the same headers.
func (r *Report) floorGoals(o, floor OverheadRow) []Goal {
	return floorGoalsOf(o.Name, r.Scale.OverheadRate, o, floor)
}

// floorGoalsOf are the goals over the floor of the configuration path: the
// p50 it adds (below zero, tether was the faster: reached) on one
// connection and in the open loop at rate, its throughput, and Envoy's CPU
// per request, left out when the floor's was not measured.
func floorGoalsOf(path string, rate float64, o, floor OverheadRow) []Goal {
	goals := []Goal{
		newGoal(path, "added p50 over the floor, one connection", millis(o.SerialP50-floor.SerialP50), millis(GoalP50OverFloor), true, "ms"),
		newGoal(path, fmt.Sprintf("added p50 over the floor, at %.0f requests/s", rate), millis(o.P50-floor.P50), millis(GoalP50OverFloor), true, "ms"),
		newGoal(path, "throughput vs the floor", ratio(o.Throughput, floor.Throughput), GoalThroughputVsFloor, false, "×"),
	}
	if floor.EnvoyCPUPerRequest > 0 {
		goals = append(goals, newGoal(path, "Envoy CPU per request vs the floor",
			ratio(float64(o.EnvoyCPUPerRequest), float64(floor.EnvoyCPUPerRequest)), GoalEnvoyCPUVsFloor, true, "×"))
	}
	return goals
}

// ratio is a/b, 0 without b.
func ratio(a, b float64) float64 {
	if b <= 0 {
		return 0
	}
	return a / b
}

// goalsOf is o's goals over base: latency and throughput, and for a row
// with a store its CPU and Redis commands per hit.
func (r *Report) goalsOf(o, base OverheadRow) []Goal {
	msOf := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	usOf := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	rate := fmt.Sprintf("at %.0f requests/s", r.Scale.OverheadRate)
	goals := []Goal{
		addedGoal(o.Name, "added p50, one connection", msOf(o.SerialP50-base.SerialP50), msOf(GoalAddedP50)),
		addedGoal(o.Name, "added p99, one connection", msOf(o.SerialP99-base.SerialP99), msOf(GoalAddedP99)),
		addedGoal(o.Name, "added p50, "+rate, msOf(o.P50-base.P50), msOf(GoalAddedP50)),
		addedGoal(o.Name, "added p99, "+rate, msOf(o.P99-base.P99), msOf(GoalAddedP99)),
	}
	goals = append(goals, newGoal(o.Name, fmt.Sprintf("throughput at %d connections vs Envoy alone", r.Scale.OverheadWorkers),
		ratio(o.Throughput, base.Throughput), GoalThroughputRatio, false, "×"))
	if o.Store {
		goals = append(goals,
			newGoal(o.Name, "tether + redis-server CPU per sticky hit", usOf(o.TetherCPUPerRequest+o.RedisCPUPerRequest), usOf(GoalCPUPerHit), true, "µs"),
			newGoal(o.Name, "Redis commands per sticky hit", o.RedisCommandsPerRequest, GoalRedisPerHit, true, ""))
	}
	return goals
}
