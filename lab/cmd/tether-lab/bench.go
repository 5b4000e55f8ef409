package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/progress"
	"github.com/tetherproxy/tether/lab/bench"
)

func newBenchCmd() *cobra.Command {
	var (
		tetherBin, envoyBin, redisBin, out, charts, scale string
		profiles, peers, peersPython                      string
		seed                                              uint64
		only                                              []string
		sat                                               = bench.DefaultSaturation
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Run the benchmark suite through real Envoy and redis-server; write BENCHMARKS.md and charts",
		Long: `Runs four scenarios on this machine, all on loopback: the overhead of Envoy + tether over
Envoy alone and over the cheapest ext_proc router (tiny requests with the bench's headers and with
the OpenAI Python client's, then chat bodies of 1, 32 and 400 KB with cache-aware placement off and
on), tether as an endpoint picker behind Envoy in Istio's gateway style (bodies streamed full duplex)
beside a stateless picker and Envoy alone with 1 and 32 KB chat bodies, routing quality (KV-cache hit rate, latency, continuity, load spread, GPU cost) of
Envoy round robin, Envoy ring hash, tether random, tether sticky and tether adaptive on eight
emulated A100 instances, a hot spot (one tenant's burst behind one API key: tether sticky against
tether adaptive), churn (an instance killed, restored, another added), shared documents (Envoy ring
hash, tether sticky, tether cache-aware), and the peers: sglang-router and vllm-router from PyPI
(scripts/tools.sh peers installs them into --peers) in front of the same fleet beside tether sticky
and tether cache-aware, on three workloads. The results replace the marked section of --out and the
charts go to --charts.`,
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
			tetherBin, err := findTether(tetherBin)
			if err != nil {
				return err
			}
			if redisBin, err = findRedisServer(redisBin); err != nil {
				return err
			}
			self, err := os.Executable() // its `bench floor` and `bench picker` serve the floor and the picker
			if err != nil {
				return err
			}
			if len(only) > 0 && !cmd.Flags().Changed("out") {
				return fmt.Errorf("--only makes a partial report, which would replace the full one in %s: give --out FILE", out)
			}
			sel := map[string]bool{}
			for _, s := range only {
				switch s {
				case "overhead", "gateway", "quality", "hotspot", "churn", "documents", "peers":
					sel[s] = true
				default:
					return fmt.Errorf("--only %q: want overhead, gateway, quality, hotspot, churn, documents or peers", s)
				}
			}
			if sat.Waiting < 0 || !(sat.KVUsage >= 0 && sat.KVUsage <= 1) || sat.Waiting == 0 && sat.KVUsage == 0 {
				return fmt.Errorf("--adaptive-waiting %d, --adaptive-kv-usage %v: want waiting not negative, a usage from 0 to 1, and one of them above 0", sat.Waiting, sat.KVUsage)
			}
			if sat.InFlight < 0 || sat.QueueDepth < 0 || sat.InFlight == 0 && sat.QueueDepth == 0 {
				return fmt.Errorf("--adaptive-inflight %d, --adaptive-queue-depth %d: want neither negative and at least one above 0", sat.InFlight, sat.QueueDepth)
			}
			if profiles != "" {
				if err := os.MkdirAll(profiles, 0o755); err != nil {
					return fmt.Errorf("--cpuprofile: %w", err)
				}
			}
			rep, err := bench.Run(cmd.Context(), bench.Options{
				TetherBin: tetherBin, EnvoyBin: envoyBin, RedisBin: redisBin, LabBin: self,
				Scale: sc, Seed: seed, Log: cmd.ErrOrStderr(), Only: sel, Saturation: sat,
				CPUProfiles: profiles, PeersDir: peers, PeersPython: peersPython,
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
			command := "make bench   # tether-lab bench --scale " + scale
			if len(only) > 0 {
				command = "tether-lab bench --scale " + scale + " --only " + strings.Join(only, ",")
			}
			meta := bench.Meta{
				Command: command,
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
	f.StringVar(&tetherBin, "tether", "", "tether binary (default: tether beside this tether-lab)")
	f.StringVar(&envoyBin, "envoy", ".tools/envoy/envoy/_bin/envoy", "Envoy binary")
	f.StringVar(&redisBin, "redis-server", "", "redis-server binary (default: from PATH)")
	f.StringVar(&out, "out", "BENCHMARKS.md", "file whose marked section the results replace")
	f.StringVar(&charts, "charts", "docs/bench", "directory for PNG charts")
	f.StringVar(&scale, "scale", "full", "full (about 45 minutes) or smoke (about a minute and a half, two more with the peers)")
	f.Uint64Var(&seed, "seed", 1, "workload seed")
	f.StringVar(&profiles, "cpuprofile", "", "directory for a CPU profile of each tether the run starts (tether serve --cpuprofile), named after its configuration")
	f.StringSliceVar(&only, "only", nil, "run only these scenarios: overhead, gateway, quality, hotspot, churn, documents, peers")
	f.StringVar(&peers, "peers", ".tools/peers", "directory of the peer routers (scripts/tools.sh peers); empty leaves the peers out unless --only names them")
	f.StringVar(&peersPython, "peers-python", "", "Python that runs the peer routers (default: the one they were installed for, PEERS/python)")
	f.IntVar(&sat.Waiting, "adaptive-waiting", sat.Waiting, "routing.saturation_waiting of the tether adaptive policy (0: off)")
	f.Float64Var(&sat.KVUsage, "adaptive-kv-usage", sat.KVUsage, "routing.saturation_kv_usage of the tether adaptive policy (0: off)")
	f.IntVar(&sat.InFlight, "adaptive-inflight", sat.InFlight, "routing.saturation_inflight of the header-signals adaptive policy (0: off)")
	f.IntVar(&sat.QueueDepth, "adaptive-queue-depth", sat.QueueDepth, "routing.saturation_queue_depth of the header-signals adaptive policy (0: off)")
	cmd.AddCommand(newBenchSoakCmd(), newBenchFloorCmd(), newBenchPickerCmd())
	return cmd
}

// newBenchFloorCmd is `tether-lab bench floor`, the ext_proc floor the
// overhead scenario starts as a process of its own; hidden, as only the
// bench runs it.
func newBenchFloorCmd() *cobra.Command {
	var (
		r              bench.FloorRoutes
		extproc, admin string
	)
	cmd := &cobra.Command{
		Use:    "floor",
		Short:  "Serve the bench's ext_proc floor: route each request by a hash of its session header, keep nothing",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := zerolog.New(cmd.ErrOrStderr()).With().Timestamp().Logger()
			// cmd.Context() ends on SIGINT/SIGTERM (see main).
			return bench.ServeFloor(cmd.Context(), r, extproc, admin, func(f bench.FloorReady) {
				log.Info().Str("extproc", f.Extproc).Str("admin", f.Admin).Msg(bench.FloorReadyMessage)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&extproc, "listen", "127.0.0.1:0", "loopback host:port of the ext_proc gRPC server")
	f.StringVar(&admin, "admin", "127.0.0.1:0", "loopback host:port of the admin endpoint (GET /requests)")
	f.StringVar(&r.SessionHeader, "session-header", config.DefaultSessionHeader, "header whose value the floor hashes")
	f.StringVar(&r.ClusterHeader, "cluster-header", config.DefaultClusterHeader, "header the floor's reply sets to the cluster")
	f.StringArrayVar(&r.Clusters, "cluster", nil, "cluster to route to (repeatable, at least one)")
	return cmd
}

// newBenchPickerCmd is `tether-lab bench picker`, the stateless endpoint
// picker the gateway scenario starts as a process of its own; hidden, as
// only the bench runs it.
func newBenchPickerCmd() *cobra.Command {
	var (
		r              bench.PickerRoutes
		extproc, admin string
	)
	cmd := &cobra.Command{
		Use:    "picker",
		Short:  "Serve the bench's stateless endpoint picker: a hash of the session header picks the endpoint, body chunks are echoed, nothing kept",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := zerolog.New(cmd.ErrOrStderr()).With().Timestamp().Logger()
			return bench.ServePicker(cmd.Context(), r, extproc, admin, func(f bench.FloorReady) {
				log.Info().Str("extproc", f.Extproc).Str("admin", f.Admin).Msg(bench.PickerReadyMessage)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&extproc, "listen", "127.0.0.1:0", "loopback host:port of the ext_proc gRPC server")
	f.StringVar(&admin, "admin", "127.0.0.1:0", "loopback host:port of the admin endpoint (GET /requests)")
	f.StringVar(&r.SessionHeader, "session-header", config.DefaultSessionHeader, "header whose value the picker hashes")
	f.StringArrayVar(&r.Endpoints, "endpoint", nil, "endpoint ip:port to route to (repeatable, at least one)")
	return cmd
}

// findTether is the --tether binary, or the tether that make build puts
// beside tether-lab.
func findTether(bin string) (string, error) {
	if bin == "" {
		self, err := os.Executable()
		if err != nil {
			return "", err
		}
		bin = filepath.Join(filepath.Dir(self), "tether")
	}
	if fi, err := os.Stat(bin); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		return "", fmt.Errorf("tether binary %s not found or not executable (make build puts it in bin/, or give --tether)", bin)
	}
	return bin, nil
}

// findRedisServer is the --redis-server binary, or redis-server from PATH.
func findRedisServer(bin string) (string, error) {
	if bin != "" {
		return bin, nil
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return "", fmt.Errorf("redis-server not found (install it with make tools, or give --redis-server): %w", err)
	}
	return bin, nil
}

func newBenchSoakCmd() *cobra.Command {
	var (
		tetherBin, envoyBin, redisBin, out, chart string
		o                                         = bench.DefaultSoak
	)
	cmd := &cobra.Command{
		Use:   "soak",
		Short: "Soak tether under steady load (default 10 minutes) and check that its RSS and goroutines stay flat",
		Long: `Starts redis-server, emulated instances, tether (sticky mode, short idle timeout) and Envoy on
loopback, sends --rate requests a second through Envoy for --duration (sessions bound, hit and
expired all along; some token and anonymous callers), and samples tether's RSS (/proc VmRSS), Go
heap in use and goroutines (its /metrics) every --every. Writes a markdown report to --out (default
stdout) and a chart to --chart, and fails when the verdict is not flat: RSS rising 5% or more over
the second half (least-squares line), or goroutines moving more than 10% (at least 3) from the first
minute to the last. Not part of make test.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			tetherBin, err := findTether(tetherBin)
			if err != nil {
				return err
			}
			if redisBin, err = findRedisServer(redisBin); err != nil {
				return err
			}
			o.TetherBin, o.EnvoyBin, o.RedisBin = tetherBin, envoyBin, redisBin
			o.Log, o.Progress = cmd.ErrOrStderr(), progress.Terminal(cmd.ErrOrStderr())
			rep, err := bench.Soak(cmd.Context(), o)
			if err != nil {
				return err
			}
			link := ""
			if chart != "" {
				if err := rep.Chart(chart); err != nil {
					return err
				}
				link = chart
				if out != "" {
					if rel, err := filepath.Rel(filepath.Dir(out), chart); err == nil {
						link = rel
					}
				}
			}
			meta := bench.Meta{
				Command: fmt.Sprintf("make soak   # tether-lab bench soak --duration %s --rate %g", o.Duration, o.Rate),
				Commit:  gitCommit(),
				Machine: fmt.Sprintf("%s/%s, %d CPUs", runtime.GOOS, runtime.GOARCH, runtime.NumCPU()),
			}
			md := rep.Markdown(meta, link)
			if out == "" {
				fmt.Fprint(cmd.OutOrStdout(), md)
			} else if err := os.WriteFile(out, []byte(md), 0o644); err != nil {
				return err
			}
			s := rep.Summary
			fmt.Fprintf(cmd.ErrOrStderr(), "soak: RSS %.1f → %.1f MiB (second half %+.1f%%), goroutines %.1f → %.1f, %d requests, %d failed\n",
				s.First.RSS/(1<<20), s.Last.RSS/(1<<20), 100*s.RSSGrowth, s.First.Goroutines, s.Last.Goroutines, rep.Sent, rep.Failed)
			if !s.Flat {
				return fmt.Errorf("soak: not flat: %s", strings.Join(s.Why, "; "))
			}
			fmt.Fprintln(cmd.ErrOrStderr(), "soak: flat")
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&tetherBin, "tether", "", "tether binary (default: tether beside this tether-lab)")
	f.StringVar(&envoyBin, "envoy", ".tools/envoy/envoy/_bin/envoy", "Envoy binary")
	f.StringVar(&redisBin, "redis-server", "", "redis-server binary (default: from PATH)")
	f.StringVar(&out, "out", "", "markdown report file (default: stdout)")
	f.StringVar(&chart, "chart", "", "PNG chart of RSS, heap and goroutines over time (default: none)")
	f.DurationVar(&o.Duration, "duration", o.Duration, "how long the load runs")
	f.Float64Var(&o.Rate, "rate", o.Rate, "requests per second")
	f.DurationVar(&o.Every, "every", o.Every, "time between samples")
	f.DurationVar(&o.IdleTimeout, "idle-timeout", o.IdleTimeout, "tether's routing.idle_timeout")
	f.IntVar(&o.Instances, "instances", o.Instances, "emulated instances")
	f.IntVar(&o.Sessions, "sessions", o.Sessions, "session ids in use at a time")
	f.IntVar(&o.Tokens, "tokens", o.Tokens, "API tokens in use at a time")
	f.IntVar(&o.Turns, "turns", o.Turns, "requests per session id or token before a fresh one replaces it")
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
