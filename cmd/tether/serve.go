package main

import (
	"errors"
	"fmt"
	"os"
	"runtime/pprof"

	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/cli"
	"github.com/tetherproxy/tether/server"
)

func newServeCmd() *cobra.Command {
	var (
		path, cpuProfile                          string
		redisURL, extprocAddr, adminAddr, xdsAddr string
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the ext_proc server Envoy calls, and the admin server",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) (runErr error) {
			flags := cmd.Flags()
			// Flags win over the file, at start and on every reload.
			overrides := func(c *config.Config) {
				if flags.Changed("redis") {
					c.Redis.URL = redisURL
				}
				if flags.Changed("extproc-addr") {
					c.Server.ExtProcAddr = extprocAddr
				}
				if flags.Changed("admin-addr") {
					c.Server.AdminAddr = adminAddr
				}
				if flags.Changed("xds-addr") {
					c.XDS.Addr = xdsAddr
				}
			}
			cfg, err := config.Load(path, overrides)
			if err != nil {
				return err
			}
			if cpuProfile != "" {
				stop, err := startCPUProfile(cpuProfile)
				if err != nil {
					return err
				}
				defer func() { runErr = errors.Join(runErr, stop()) }()
			}
			log := cli.NewLogger(cfg.Server.LogLevel)
			setRedisLogger(log)
			return server.Run(cmd.Context(), cfg, server.Options{
				Logger:     log,
				ConfigPath: path,
				Overrides:  overrides,
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&path, "config", "", "TOML configuration file")
	f.StringVar(&redisURL, "redis", "", `binding store: redis://host:port/db, rediss://…, unix:///path, or "embedded" (overrides redis.url)`)
	f.StringVar(&extprocAddr, "extproc-addr", "", "ext_proc gRPC listen address (overrides server.extproc_addr)")
	f.StringVar(&adminAddr, "admin-addr", "", "admin HTTP listen address (overrides server.admin_addr)")
	f.StringVar(&xdsAddr, "xds-addr", "", `ADS server listen address, "" for none (overrides xds.addr)`)
	f.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the whole run to this file, for `go tool pprof` (written at shutdown)")
	return cmd
}

// startCPUProfile profiles the process into path until stop. stop reports
// a profile it could not write out.
func startCPUProfile(path string) (stop func() error, err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		return nil, errors.Join(fmt.Errorf("--cpuprofile: %w", err), f.Close())
	}
	return func() error {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		return nil
	}, nil
}
