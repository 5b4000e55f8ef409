// Package cli is what tether's two commands share: cmd/tether and
// lab/cmd/tether-lab. It runs a cobra command tree under signals, and
// makes their log.
package cli

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"
)

// Main runs root with a context that ends on SIGINT or SIGTERM. It prints
// an error as "name: error" on standard error and exits 1 on it. The first
// signal starts a graceful stop. A second one, back on the default
// handler, ends the process at once.
func Main(name string, root *cobra.Command) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() { <-ctx.Done(); stop() }()
	err := root.ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		os.Exit(1)
	}
}

// NewLogger writes JSON lines to stderr at level: "debug", "info" and so
// on. A level that does not parse means info.
func NewLogger(level string) zerolog.Logger {
	lvl, err := zerolog.ParseLevel(level)
	if err != nil {
		lvl = zerolog.InfoLevel
	}
	return zerolog.New(os.Stderr).Level(lvl).With().Timestamp().Logger()
}
