package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/sim"
)

// emulateFlags are the flags of `tether emulate`.
type emulateFlags struct {
	instances        []string // NAME=HOST:PORT, repeatable
	latency          time.Duration
	logLevel         string
	allowNonLoopback bool
	configFile       string // serve every [[instances]] of a tether config
}

func newEmulateCmd() *cobra.Command {
	var fl emulateFlags
	cmd := &cobra.Command{
		Use:   "emulate",
		Short: "Run emulated GPU instances: OpenAI-compatible servers that name the instance that answered",
		Example: `  tether emulate --config deploy/local/tether.toml
  tether emulate --instance gpu-a=127.0.0.1:8001 --instance gpu-b=127.0.0.1:8002
  tether emulate --instance gpu-a=127.0.0.1:8001 --latency 20ms --log-level debug`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			lvl, err := zerolog.ParseLevel(fl.logLevel)
			if err != nil || lvl == zerolog.NoLevel {
				return fmt.Errorf("--log-level %q: want trace, debug, info, warn or error", fl.logLevel)
			}
			if fl.latency < 0 {
				return fmt.Errorf("--latency %v: must not be negative", fl.latency)
			}
			specs, err := emulateSpecs(&fl)
			if err != nil {
				return err
			}
			opts := []sim.Option{
				sim.WithLatency(fl.latency),
				sim.WithLogger(newLogger(lvl.String())),
			}
			if fl.allowNonLoopback {
				opts = append(opts, sim.AllowNonLoopback())
			}
			// cmd.Context() ends on SIGINT/SIGTERM (see main); ServeAll then
			// shuts every instance down and returns nil.
			return sim.ServeAll(cmd.Context(), specs, opts...)
		},
	}
	f := cmd.Flags()
	f.StringVar(&fl.configFile, "config", "", "tether config file: emulate every [[instances]] entry at its address")
	f.StringArrayVar(&fl.instances, "instance", nil, "instance to emulate, as NAME=HOST:PORT (repeatable)")
	f.DurationVar(&fl.latency, "latency", sim.DefaultLatency, "fixed time each instance works on a completion request")
	f.StringVar(&fl.logLevel, "log-level", "info", "log level: debug (one line per request), info, warn, error")
	f.BoolVar(&fl.allowNonLoopback, "allow-non-loopback", false,
		"allow listening on non-loopback addresses (the emulator answers anyone with made-up completions)")
	return cmd
}

// emulateSpecs returns the instances to emulate: those of --config first,
// so the emulator serves the fleet tether routes to, then --instance ones.
func emulateSpecs(fl *emulateFlags) ([]sim.Spec, error) {
	var specs []sim.Spec
	if fl.configFile != "" {
		cfg, err := config.Load(fl.configFile)
		if err != nil {
			return nil, err
		}
		for _, in := range cfg.Instances {
			specs = append(specs, sim.Spec{Name: in.Name, Addr: in.Address})
		}
	}
	for _, s := range fl.instances {
		sp, err := sim.ParseSpec(s)
		if err != nil {
			return nil, fmt.Errorf("--instance: %w", err)
		}
		specs = append(specs, sp)
	}
	if len(specs) == 0 {
		return nil, errors.New("no instances: give --config FILE or at least one --instance NAME=HOST:PORT")
	}
	return specs, nil
}
