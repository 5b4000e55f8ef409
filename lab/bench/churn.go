package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/workload"
)

// ChurnRow is one phase of the churn scenario for one policy.
type ChurnRow struct {
	Policy, Phase    string
	Requests, Failed int
	// Moved of FollowUps: follow-up turns of identified callers (anonymous
	// ones are routed at random by every policy) that another instance than
	// the previous turn's served.
	Moved, FollowUps int
	// VictimServed counts answers from the instance that is killed.
	VictimServed int
	HitRate      float64
	// Sim is the simulator's figures for the phase (crossCheckChurn).
	Sim Sim
}

// runChurn replays the workload while the fleet changes: at 1/4 of the run
// one instance is killed, at 1/2 restored (cache empty), at 3/4 a ninth
// instance is added through tether's admin API (tether serves Envoy's
// configuration in both policies, so both see the same fleet).
func runChurn(ctx context.Context, opts Options, dir string) ([]ChurnRow, error) {
	var rows []ChurnRow
	for _, p := range []policy{policyRingHash, policySticky} {
		fmt.Fprintf(opts.Log, "churn: %s (%s)\n", p.name, opts.Scale.Duration)
		r, err := churnOnce(ctx, opts, dir, p)
		if err != nil {
			return rows, fmt.Errorf("%s: %w", p.name, err)
		}
		rows = append(rows, r...)
	}
	if err := crossCheckChurn(ctx, opts, rows); err != nil {
		return rows, err
	}
	return rows, nil
}

func churnOnce(ctx context.Context, opts Options, dir string, p policy) ([]ChurnRow, error) {
	fleet, instances, err := a100Fleet(opts.Scale, 8)
	if err != nil {
		return nil, err
	}
	defer fleet.close()
	st, err := startStack(ctx, opts, dir, p, instances)
	if err != nil {
		return nil, err
	}
	defer st.close()

	d := opts.Scale.Duration
	victim := instances[1].Name
	// The fleet changes on a schedule while the workload runs; the
	// goroutine ends before the fleet closes, whatever happens.
	ectx, stopEvents := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var eventErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		eventErr = churnEvents(ectx, d, []func() error{
			func() error { return fleet.kill(victim) },
			func() error { return fleet.restore(victim) },
			func() error {
				in, err := fleet.add("a100-8", "zone-a")
				if err != nil {
					return err
				}
				return postJSON(ectx, "http://"+st.tether.Admin+"/v1/instances", in)
			},
		})
	}()
	res, err := replay(ctx, opts, st.envoy.URL(), instances)
	stopEvents()
	wg.Wait()
	if err != nil {
		return nil, err
	}
	if eventErr != nil {
		return nil, eventErr
	}
	phases := []struct {
		name     string
		from, to time.Duration
	}{
		{"steady", 0, d / 4},
		{"instance killed", d / 4, d / 2},
		{"instance restored", d / 2, 3 * d / 4},
		{"instance added", 3 * d / 4, d + time.Hour},
	}
	var rows []ChurnRow
	for _, ph := range phases {
		rows = append(rows, churnPhase(p.name, ph.name, victim, res.Records, ph.from, ph.to))
	}
	return rows, nil
}

// churnEvents runs steps at 1/4, 2/4, 3/4… of d.
func churnEvents(ctx context.Context, d time.Duration, steps []func() error) error {
	start := time.Now()
	for i, step := range steps {
		at := start.Add(time.Duration(i+1) * d / time.Duration(len(steps)+1))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Until(at)):
		}
		if err := step(); err != nil {
			return err
		}
	}
	return nil
}

// churnPhase sums the requests that ended in [from, to): an answer belongs
// to the fleet as it was when the answer came (a request in flight at a
// kill and retried elsewhere by Envoy counts after the kill). Dropped and
// cancelled requests (the load generator's, not the fleet's) are left out.
func churnPhase(policy, phase, victim string, recs []loadgen.Record, from, to time.Duration) ChurnRow {
	row := ChurnRow{Policy: policy, Phase: phase}
	last := map[string]string{} // conversation → instance of its previous OK turn
	var prompt, cached int64
	for _, r := range recs {
		if r.Fate != loadgen.OK && r.Fate != loadgen.Failed {
			continue
		}
		prev, seen := last[r.Conversation]
		if r.Fate == loadgen.OK {
			last[r.Conversation] = r.Instance
		}
		if end := r.Start + r.Latency; end < from || end >= to {
			continue
		}
		row.Requests++
		if r.Fate == loadgen.Failed {
			row.Failed++
			continue
		}
		if r.Instance == victim {
			row.VictimServed++
		}
		prompt += int64(r.PromptTokens)
		cached += int64(r.CachedTokens)
		if r.Turn > 0 && seen && r.Identity != workload.IdentityAnonymous {
			row.FollowUps++
			if prev != r.Instance {
				row.Moved++
			}
		}
	}
	if prompt > 0 {
		row.HitRate = float64(cached) / float64(prompt)
	}
	return row
}
