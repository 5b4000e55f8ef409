// Command tether-lab measures tether: emulated GPU instances, the field's
// traffic mix, the benchmark suite and the event simulator. None of it is
// in the tether binary or its image, which carry what operators deploy.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal starts a graceful stop; a second one, back on the
	// default handler, ends the process at once.
	go func() { <-ctx.Done(); stop() }()
	if err := newRootCmd().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "tether-lab:", err)
		os.Exit(1)
	}
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "tether-lab",
		Short:         "Measure tether: emulated GPU instances, load generation, benchmarks and simulation",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(
		newEmulateCmd(),
		newLoadgenCmd(),
		newBenchCmd(),
		newSimulateCmd(),
	)
	return root
}

// newLogger writes JSON lines to stderr at level ("debug", "info", …).
func newLogger(level string) zerolog.Logger {
	lvl, err := zerolog.ParseLevel(level)
	if err != nil {
		lvl = zerolog.InfoLevel
	}
	return zerolog.New(os.Stderr).Level(lvl).With().Timestamp().Logger()
}
