package main

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/cli"
	"github.com/tetherproxy/tether/lab/emulator"
)

// emulateFlags are the flags of `tether-lab emulate`.
type emulateFlags struct {
	instances          []string // NAME=HOST:PORT, repeatable
	latency            time.Duration
	logLevel           string
	allowNonLoopback   bool
	configFile         string // serve every [[instances]] of a tether config
	profile            string // a100, h200 or fixed
	timeScale          float64
	kvCapacityTokens   int
	kvMaxConversations int
	engine             string // vllm or sglang: the metrics of GET /metrics
	model              string // served model name of every instance
	reportHeaders      bool   // x-queue-depth, x-gpu-utilization on answers
}

// profileFixed is the --profile of the fixed latency without a KV cache.
const profileFixed = "fixed"

func newEmulateCmd() *cobra.Command {
	var fl emulateFlags
	cmd := &cobra.Command{
		Use:   "emulate",
		Short: "Run emulated GPU instances: OpenAI-compatible servers that name the instance that answered",
		Long: `Run emulated GPU instances: OpenAI-compatible servers that name the instance that answered.

With --profile a100 (the default) or h200, each instance has its own prefix KV cache and answers
after the time the calibrated cost model gives (prefill of the uncached tokens, decode of the
answer, queueing behind other prefills). The a100 figures are ESTIMATES derived from the measured
H200 by datasheet ratios; h200 is measured. --profile fixed answers after --latency, without a
cache. Each instance serves GET /metrics in vLLM's format (--engine sglang: SGLang's), computed
from its cache and queues, lists its served model on /v1/models (--model; with --config, each
instance's version), and serves /admin/faults, /admin/stats and /admin/reset (see
lab/emulator/README.md). The emulator-only load headers x-queue-depth and x-gpu-utilization are
sent only with --report-headers.`,
		Example: `  tether-lab emulate --config deploy/local/tether.toml
  tether-lab emulate --instance gpu-a=127.0.0.1:8001 --instance gpu-b=127.0.0.1:8002 --profile h200
  tether-lab emulate --config deploy/local/tether.toml --time-scale 0.1 --kv-max-conversations 50
  tether-lab emulate --instance gpu-a=127.0.0.1:8001 --profile fixed --latency 20ms --log-level debug
  tether-lab emulate --instance gpu-a=127.0.0.1:8001 --engine sglang --model llama-3.1-8b --report-headers`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			lvl, err := zerolog.ParseLevel(fl.logLevel)
			if err != nil || lvl == zerolog.NoLevel {
				return fmt.Errorf("--log-level %q: want trace, debug, info, warn or error", fl.logLevel)
			}
			if fl.engine != emulator.EngineVLLM && fl.engine != emulator.EngineSGLang {
				return fmt.Errorf("--engine %q: want %s or %s", fl.engine, emulator.EngineVLLM, emulator.EngineSGLang)
			}
			model, err := emulateModel(cmd, &fl)
			if err != nil {
				return err
			}
			specs, err := emulateSpecs(&fl)
			if err != nil {
				return err
			}
			log := cli.NewLogger(lvl.String())
			log.Info().Str("profile", fl.profile).Str("engine", fl.engine).Bool("report_headers", fl.reportHeaders).Msg(model.describe)
			opts := []emulator.Option{model.option, emulator.WithLogger(log), emulator.WithEngine(fl.engine)}
			if fl.allowNonLoopback {
				opts = append(opts, emulator.AllowNonLoopback())
			}
			if fl.reportHeaders {
				opts = append(opts, emulator.WithReportHeaders())
			}
			// cmd.Context() ends on SIGINT/SIGTERM (see main); ServeAll then
			// shuts every instance down and returns nil.
			return emulator.ServeAll(cmd.Context(), specs, opts...)
		},
	}
	f := cmd.Flags()
	f.StringVar(&fl.configFile, "config", "", "tether config file: emulate every [[instances]] entry at its address")
	f.StringArrayVar(&fl.instances, "instance", nil, "instance to emulate, as NAME=HOST:PORT (repeatable)")
	f.StringVar(&fl.profile, "profile", "a100",
		"cost model: a100 (estimate derived from the measured H200), h200 (measured), or fixed (--latency, no KV cache)")
	f.DurationVar(&fl.latency, "latency", emulator.DefaultLatency,
		"with --profile fixed: time each instance works on a completion request (given alone, it implies --profile fixed)")
	f.Float64Var(&fl.timeScale, "time-scale", 1, "multiply every modelled duration: 0.1 runs ten times faster than real time")
	f.IntVar(&fl.kvCapacityTokens, "kv-capacity-tokens", 0,
		"KV cache of each instance in tokens (0: the profile's, about 427k for a100 and 846k for h200)")
	f.IntVar(&fl.kvMaxConversations, "kv-max-conversations", emulator.DefaultMaxConversations,
		"conversations each KV cache keeps, least recently used dropped first (0: no cap)")
	f.StringVar(&fl.engine, "engine", emulator.EngineVLLM,
		"engine whose metrics GET /metrics serves: vllm (vLLM V1's vllm:* names) or sglang (SGLang's sglang:*)")
	f.StringVar(&fl.model, "model", "",
		"served model name of every instance (/v1/models, the metrics' model_name); default: each --config instance's version, "+
			emulator.DefaultModel+" for --instance ones")
	f.BoolVar(&fl.reportHeaders, "report-headers", false,
		"add the emulator-only load headers x-queue-depth and x-gpu-utilization to completion answers (real engines send neither)")
	f.StringVar(&fl.logLevel, "log-level", "info", "log level: debug (one line per request), info, warn, error")
	f.BoolVar(&fl.allowNonLoopback, "allow-non-loopback", false,
		"allow listening on non-loopback addresses (the emulator answers anyone with made-up completions)")
	return cmd
}

// modelChoice is the latency model chosen by the flags.
type modelChoice struct {
	option   emulator.Option
	describe string // one log line
}

// emulateModel checks the model flags and returns the option that gives
// every instance its latency model: one GPU model (and KV cache) per
// instance, or the fixed latency.
func emulateModel(cmd *cobra.Command, fl *emulateFlags) (modelChoice, error) {
	changed := cmd.Flags().Changed
	if changed("latency") && !changed("profile") {
		fl.profile = profileFixed // --latency alone keeps its old meaning
	}
	if fl.profile == profileFixed {
		for _, name := range []string{"time-scale", "kv-capacity-tokens", "kv-max-conversations"} {
			if changed(name) {
				return modelChoice{}, fmt.Errorf("--%s applies to the a100 and h200 profiles, not --profile fixed", name)
			}
		}
		if fl.latency < 0 {
			return modelChoice{}, fmt.Errorf("--latency %v: must not be negative", fl.latency)
		}
		return modelChoice{
			option:   emulator.WithLatency(fl.latency),
			describe: fmt.Sprintf("fixed latency %v, no KV cache", fl.latency),
		}, nil
	}
	if changed("latency") {
		return modelChoice{}, fmt.Errorf("--latency applies to --profile fixed, not %q", fl.profile)
	}
	profile, err := emulator.ProfileByName(fl.profile)
	if err != nil {
		return modelChoice{}, fmt.Errorf("--profile %q: want a100, h200 or fixed", fl.profile)
	}
	fl.profile = profile.Name
	if s := fl.timeScale; math.IsNaN(s) || math.IsInf(s, 0) || s <= 0 {
		return modelChoice{}, fmt.Errorf("--time-scale %v: want a number > 0 (1 is real time, 0.1 ten times faster)", s)
	}
	if c := fl.kvCapacityTokens; c != 0 && c < emulator.BlockSize {
		return modelChoice{}, fmt.Errorf("--kv-capacity-tokens %d: want 0 (the profile's) or at least %d", c, emulator.BlockSize)
	}
	if fl.kvMaxConversations < 0 {
		return modelChoice{}, fmt.Errorf("--kv-max-conversations %d: want 0 (no cap) or more", fl.kvMaxConversations)
	}
	maxConv := fl.kvMaxConversations
	if maxConv == 0 {
		maxConv = -1 // no cap
	}
	cfg := emulator.GPUConfig{
		Profile:   profile,
		TimeScale: fl.timeScale,
		Cache:     emulator.CacheConfig{CapacityTokens: fl.kvCapacityTokens, MaxConversations: maxConv},
	}
	probe, err := emulator.NewGPU(cfg)
	if err != nil {
		return modelChoice{}, err
	}
	st := probe.Stats()
	return modelChoice{
		option: emulator.WithModelFactory(func(string) (emulator.LatencyModel, error) { return emulator.NewGPU(cfg) }),
		describe: fmt.Sprintf("GPU cost model %s (%s), time scale %g, KV cache %d tokens, %s",
			profile.Name, profile.Source, fl.timeScale, st.Cache.CapacityTokens, conversationCap(st.Cache.MaxConversations)),
	}, nil
}

func conversationCap(n int) string {
	if n == 0 {
		return "no conversation cap"
	}
	return fmt.Sprintf("at most %d conversations", n)
}

// emulateSpecs returns the instances to emulate: those of --config first,
// so the emulator serves the fleet tether routes to, each serving its
// version as its model, then --instance ones. --model names the model of
// all of them.
func emulateSpecs(fl *emulateFlags) ([]emulator.Spec, error) {
	var specs []emulator.Spec
	if fl.configFile != "" {
		cfg, err := config.Load(fl.configFile)
		if err != nil {
			return nil, err
		}
		for _, in := range cfg.Instances {
			specs = append(specs, emulator.Spec{Name: in.Name, Addr: in.Address, Model: in.Version})
		}
	}
	for _, s := range fl.instances {
		sp, err := emulator.ParseSpec(s)
		if err != nil {
			return nil, fmt.Errorf("--instance: %w", err)
		}
		specs = append(specs, sp)
	}
	if len(specs) == 0 {
		return nil, errors.New("no instances: give --config FILE or at least one --instance NAME=HOST:PORT")
	}
	if fl.model != "" {
		for i := range specs {
			specs[i].Model = fl.model
		}
	}
	return specs, nil
}
