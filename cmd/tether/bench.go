package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/bench"
)

func newBenchCmd() *cobra.Command {
	var (
		envoyBin, redisBin, out, charts, scale string
		seed                                   uint64
		only                                   []string
		sat                                    = bench.DefaultSaturation
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Run the benchmark suite through real Envoy and redis-server; write BENCHMARKS.md and charts",
		Long: `Runs four scenarios on this machine, all on loopback: the overhead of Envoy + tether over
Envoy alone, routing quality (KV-cache hit rate, latency, continuity, load spread, GPU cost) of
Envoy round robin, Envoy ring hash, tether random, tether sticky and tether adaptive on eight
emulated A100 instances, a hot spot (one tenant's burst behind one API key: tether sticky against
tether adaptive), and churn (an instance killed, restored, another added). The results replace the
marked section of --out and the charts go to --charts.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var sc bench.Scale
			switch scale {
			case "full":
				sc = bench.Full
			case "smoke":
				sc = bench.Smoke
			default:
				return fmt.Errorf("--scale %q: want full or smoke", scale)
			}
			self, err := os.Executable()
			if err != nil {
				return err
			}
			if redisBin == "" {
				if redisBin, err = exec.LookPath("redis-server"); err != nil {
					return fmt.Errorf("redis-server not found (install it with make tools, or give --redis-server): %w", err)
				}
			}
			if len(only) > 0 && !cmd.Flags().Changed("out") {
				return fmt.Errorf("--only makes a partial report, which would replace the full one in %s: give --out FILE", out)
			}
			sel := map[string]bool{}
			for _, s := range only {
				switch s {
				case "overhead", "quality", "hotspot", "churn":
					sel[s] = true
				default:
					return fmt.Errorf("--only %q: want overhead, quality, hotspot or churn", s)
				}
			}
			if sat.InFlight < 0 || sat.QueueDepth < 0 || sat == (bench.Saturation{}) {
				return fmt.Errorf("--adaptive-inflight %d, --adaptive-queue-depth %d: want neither negative and at least one above 0", sat.InFlight, sat.QueueDepth)
			}
			rep, err := bench.Run(cmd.Context(), bench.Options{
				TetherBin: self, EnvoyBin: envoyBin, RedisBin: redisBin,
				Scale: sc, Seed: seed, Log: cmd.ErrOrStderr(), Only: sel, Saturation: sat,
			})
			if err != nil {
				return err
			}
			paths, err := rep.Charts(charts)
			if err != nil {
				return err
			}
			rel := make([]string, len(paths))
			for i, p := range paths {
				if rel[i], err = filepath.Rel(filepath.Dir(out), p); err != nil {
					rel[i] = p
				}
			}
			meta := bench.Meta{
				Command: "make bench   # tether bench --scale " + scale,
				Commit:  gitCommit(),
				Machine: fmt.Sprintf("%s/%s, %d CPUs", runtime.GOOS, runtime.GOARCH, runtime.NumCPU()),
			}
			if err := bench.WriteInto(out, rep.Markdown(meta, rel)); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s and %d charts in %s\n", out, len(paths), charts)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&envoyBin, "envoy", ".tools/envoy/envoy/_bin/envoy", "Envoy binary")
	f.StringVar(&redisBin, "redis-server", "", "redis-server binary (default: from PATH)")
	f.StringVar(&out, "out", "BENCHMARKS.md", "file whose marked section the results replace")
	f.StringVar(&charts, "charts", "docs/bench", "directory for PNG charts")
	f.StringVar(&scale, "scale", "full", "full (about 16 minutes) or smoke (about a minute and a half)")
	f.Uint64Var(&seed, "seed", 1, "workload seed")
	f.StringSliceVar(&only, "only", nil, "run only these scenarios: overhead, quality, hotspot, churn")
	f.IntVar(&sat.InFlight, "adaptive-inflight", sat.InFlight, "routing.saturation_inflight of the tether adaptive policy (0: off)")
	f.IntVar(&sat.QueueDepth, "adaptive-queue-depth", sat.QueueDepth, "routing.saturation_queue_depth of the tether adaptive policy (0: off)")
	return cmd
}

// gitCommit is the short commit of the working tree, or "unknown".
func gitCommit() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	c := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
		c += "+changes"
	}
	return c
}
