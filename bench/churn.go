package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/tetherproxy/tether/loadgen"
)

// ChurnRow is one phase of the churn scenario for one policy.
type ChurnRow struct {
	Policy, Phase    string
	Requests, Failed int
	Moved, FollowUps int
	HitRate          float64
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
	events := make(chan error, 1)
	go func() {
		events <- func() error {
			steps := []struct {
				at time.Duration
				do func() error
			}{
				{d / 4, func() error { return fleet.kill(victim) }},
				{d / 2, func() error { return fleet.restore(victim) }},
				{3 * d / 4, func() error {
					in, err := fleet.add("a100-8", "zone-a", "v1")
					if err != nil {
						return err
					}
					return postJSON(ctx, "http://"+st.tether.admin+"/v1/instances", in)
				}},
			}
			start := time.Now()
			for _, s := range steps {
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(time.Until(start.Add(s.at))):
				}
				if err := s.do(); err != nil {
					return err
				}
			}
			return nil
		}()
	}()
	res, err := replay(ctx, opts, st.envoy.url, instances)
	if err != nil {
		return nil, err
	}
	if err := <-events; err != nil {
		return nil, err
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
		rows = append(rows, churnPhase(p.name, ph.name, res.Records, ph.from, ph.to))
	}
	return rows, nil
}

// churnPhase sums the records that started in [from, to). A follow-up is
// moved when an instance other than its previous turn's served it.
func churnPhase(policy, phase string, recs []loadgen.Record, from, to time.Duration) ChurnRow {
	row := ChurnRow{Policy: policy, Phase: phase}
	last := map[string]string{} // conversation → instance of its previous OK turn
	var prompt, cached int64
	for _, r := range recs {
		prev, seen := last[r.Conversation]
		if r.Outcome == loadgen.OK {
			last[r.Conversation] = r.Instance
		}
		if r.Start < from || r.Start >= to {
			continue
		}
		row.Requests++
		if r.Outcome != loadgen.OK {
			row.Failed++
			continue
		}
		prompt += int64(r.PromptTokens)
		cached += int64(r.CachedTokens)
		if r.Turn > 0 && seen {
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
