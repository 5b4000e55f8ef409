package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/lab/emulator"
)

// OverheadRow is one configuration of the overhead scenario.
type OverheadRow struct {
	Name string
	// At a fixed open-loop rate:
	P50, P99        time.Duration
	Failed, Dropped int
	// Closed loop at a fixed number of clients, as fast as answers come
	// back: the throughput at that concurrency, not a proven maximum.
	Throughput float64 // requests per second
	// CPU tether (and redis-server, for sticky) used per request in the
	// closed loop; 0 for Envoy alone, where tether is not on the path.
	TetherCPUPerRequest time.Duration
}

// runOverhead: four zero-latency instances; Envoy alone (tether serves its
// configuration but is not on the request path), Envoy + tether random,
// Envoy + tether sticky with redis-server.
func runOverhead(ctx context.Context, opts Options, dir string) ([]OverheadRow, error) {
	fleet := newSimFleet(func(string) (emulator.LatencyModel, error) { return emulator.Fixed(0), nil })
	defer fleet.close()
	var instances []config.Instance
	for i := 0; i < 4; i++ {
		in, err := fleet.add(fmt.Sprintf("zero-%d", i), "z", "v1")
		if err != nil {
			return nil, err
		}
		instances = append(instances, in)
	}
	sc := opts.Scale
	var rows []OverheadRow
	for _, p := range []policy{{name: "Envoy alone", edit: envoyOnly("round_robin"), offPath: true}, policyRandom, policySticky} {
		fmt.Fprintf(opts.Log, "overhead: %s\n", p.name)
		row, err := overheadOnce(ctx, opts, dir, p, instances, sc)
		if err != nil {
			return rows, fmt.Errorf("%s: %w", p.name, err)
		}
		rows = append(rows, row)
	}
	return rows, nil
}

func overheadOnce(ctx context.Context, opts Options, dir string, p policy, instances []config.Instance, sc Scale) (OverheadRow, error) {
	st, err := startStack(ctx, opts, dir, p, instances)
	if err != nil {
		return OverheadRow{}, err
	}
	defer st.close()
	client := newLoadClient()
	defer client.CloseIdleConnections()
	// Warm connections and bindings.
	closedLoop(ctx, client, st.envoy.URL(), 4, 500*time.Millisecond)

	lat, failed, dropped, err := fixedRate(ctx, client, st.envoy.URL(), sc.OverheadRate, sc.OverheadDuration)
	if err != nil {
		return OverheadRow{}, err
	}
	sortDurations(lat)
	row := OverheadRow{Name: p.name, P50: percentile(lat, 0.5), P99: percentile(lat, 0.99), Failed: failed, Dropped: dropped}

	cpu0, err := st.cpuSeconds()
	if err != nil {
		return row, err
	}
	ok, bad := closedLoop(ctx, client, st.envoy.URL(), sc.OverheadWorkers, sc.OverheadDuration)
	cpu1, err := st.cpuSeconds()
	if err != nil {
		return row, err
	}
	row.Failed += int(bad)
	row.Throughput = float64(ok) / sc.OverheadDuration.Seconds()
	if !p.offPath && ok > 0 {
		row.TetherCPUPerRequest = time.Duration((cpu1 - cpu0) / float64(ok) * float64(time.Second))
	}
	return row, nil
}
