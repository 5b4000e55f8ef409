package main

import (
	"os"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/server"
)

func newServeCmd() *cobra.Command {
	var (
		path                             string
		redisURL, extprocAddr, adminAddr string
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the ext_proc server Envoy calls, and the admin server",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg := config.Default()
			if path != "" {
				var err error
				if cfg, err = config.Load(path); err != nil {
					return err
				}
			}
			flags := cmd.Flags()
			if flags.Changed("redis") {
				cfg.Redis.URL = redisURL
			}
			if flags.Changed("extproc-addr") {
				cfg.Server.ExtProcAddr = extprocAddr
			}
			if flags.Changed("admin-addr") {
				cfg.Server.AdminAddr = adminAddr
			}
			if err := cfg.Validate(); err != nil {
				return err
			}
			return server.Run(cmd.Context(), cfg, newLogger(cfg.Server.LogLevel))
		},
	}
	f := cmd.Flags()
	f.StringVar(&path, "config", "", "TOML configuration file")
	f.StringVar(&redisURL, "redis", "", `binding store: redis://host:port/db, rediss://…, unix:///path, or "embedded" (overrides redis.url)`)
	f.StringVar(&extprocAddr, "extproc-addr", "", "ext_proc gRPC listen address (overrides server.extproc_addr)")
	f.StringVar(&adminAddr, "admin-addr", "", "admin HTTP listen address (overrides server.admin_addr)")
	return cmd
}

// newLogger writes JSON lines to stderr at level ("debug", "info", …).
func newLogger(level string) zerolog.Logger {
	lvl, err := zerolog.ParseLevel(level)
	if err != nil {
		lvl = zerolog.InfoLevel
	}
	return zerolog.New(os.Stderr).Level(lvl).With().Timestamp().Logger()
}
