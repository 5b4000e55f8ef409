package bench

import (
	"context"
	"fmt"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/lab/simulator"
)

// The documents scenario: the simulator's shared-documents regime
// (simulator.SharedDocuments: questions about long shared documents, half
// the callers anonymous, small KV caches) replayed through real Envoy on
// eight emulated A100s whose caches are the regime's, routed by Envoy ring
// hash, tether sticky and tether cache-aware ([content] on: tether asks
// Envoy for the body of every request whose placement is open and places
// it by what the instances' caches hold of its prompt). Each row is
// cross-checked against the simulator's same scenario.

// policyDefaults is tether as it ships: sticky, with [content] on at its
// defaults, block and capacity included.
var policyDefaults = policy{name: "tether cache-aware", store: true, content: true, edit: func(c *config.Config) {
	c.Content = config.Default().Content
}}

// policyCacheAware is tether sticky with [content] on, as the simulator's
// CacheAware policy configures it on caches of cache.
func policyCacheAware(o simulator.Options) policy {
	return policy{name: "tether cache-aware", store: true, content: true, edit: func(c *config.Config) {
		c.Content = simulator.CacheAwareContent(o.Cache)
	}}
}

// docsSimOptions are the simulator's options for the documents scenario's
// policy p: the quality replay's (simOptions) at the scale's documents
// rate and duration, with the shared-documents regime's workload and
// caches. The bench's replay and fleet take theirs from it, so the two
// run one scenario.
func docsSimOptions(opts Options, p simulator.Policy) simulator.Options {
	o := simOptions(opts, p)
	o.Rate, o.Duration = opts.Scale.DocsRate, opts.Scale.DocsDuration
	return simulator.SharedDocuments(o)
}

// docsSimPolicies are the simulator's policies of the documents rows.
var docsSimPolicies = map[string]simulator.Policy{
	policyRingHash.name:  simulator.RingHash,
	policySticky.name:    simulator.Sticky,
	"tether cache-aware": simulator.CacheAware,
}

func runDocuments(ctx context.Context, opts Options, dir string) ([]QualityRow, error) {
	sc := opts.Scale
	scenario := docsSimOptions(opts, simulator.Sticky)
	fleet, instances, err := a100FleetCache(sc, scenario.Instances, scenario.Cache)
	if err != nil {
		return nil, err
	}
	defer fleet.close()
	pols := []policy{policyRingHash, policySticky, policyCacheAware(scenario)}
	// The stacks start at once, each in its own directory: the smoke run
	// stays seconds long.
	stacks, err := startStacks(ctx, opts, dir, pols, instances)
	defer closeStacks(stacks)
	if err != nil {
		return nil, err
	}
	var rows []QualityRow
	for i, p := range pols {
		fmt.Fprintf(opts.Log, "documents: %s (%s)\n", p.name, sc.DocsDuration)
		if err := fleet.reset(ctx); err != nil {
			return rows, err
		}
		st := stacks[i]
		res, err := replayWorkload(ctx, opts, scenario.Workload, scenario.Rate, scenario.Duration, st.envoy.URL(), instances)
		var dec, content map[string]float64
		if err == nil && !p.offPath {
			dec, content, err = decisionsAndContent(ctx, st.tether.Admin)
		}
		if err != nil {
			return rows, fmt.Errorf("%s: %w", p.name, err)
		}
		stats, err := fleet.stats(ctx)
		if err != nil {
			return rows, err
		}
		dsc := sc
		dsc.Duration = sc.DocsDuration
		row := qualityRow(p.name, res.Summary, stats, dsc)
		row.Spilled, row.Decisions = spilledShare(dec)
		row.Spread = spreadOf(names(instances), answeredBy(res.Records), fleet.queueDepths())
		if p.content {
			row.ContentResults = map[string]float64{}
			for k, v := range content {
				if v > 0 {
					row.ContentResults[k] = v
				}
			}
		}
		rows = append(rows, row)
	}
	if err := crossCheckDocuments(ctx, opts, rows); err != nil {
		return rows, err
	}
	return rows, nil
}

// crossCheckDocuments sets the simulator's figures on the documents rows.
func crossCheckDocuments(ctx context.Context, opts Options, rows []QualityRow) error {
	for i := range rows {
		p, ok := docsSimPolicies[rows[i].Policy]
		if !ok {
			continue
		}
		res, err := simulator.Run(ctx, docsSimOptions(opts, p))
		if err != nil {
			return fmt.Errorf("simulate %s: %w", rows[i].Policy, err)
		}
		rows[i].Sim = Sim{Ran: true, Requests: res.Summary.Requests, HitRate: res.Summary.KVHitRate}
	}
	return nil
}

// BodiesRead is the number of bodies tether asked Envoy for in the row.
func (q QualityRow) BodiesRead() int {
	var n float64
	for _, v := range q.ContentResults {
		n += v
	}
	return int(n)
}

// DocumentsCrossCheck is the verdict over the documents rows.
func (r *Report) DocumentsCrossCheck() CrossCheck {
	bench, sims := make([]float64, len(r.Documents)), make([]Sim, len(r.Documents))
	for i, q := range r.Documents {
		bench[i], sims[i] = q.HitRate, q.Sim
	}
	return crossCheck(bench, sims)
}
