// Command tether is the session-affinity router for LLM fleets behind Envoy.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	_ "time/tzdata" // routing.rules time zones on hosts without zoneinfo

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal starts a graceful stop; a second one, back on the
	// default handler, ends the process at once.
	go func() { <-ctx.Done(); stop() }()
	if err := newRootCmd().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "tether:", err)
		os.Exit(1)
	}
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "tether",
		Short:         "Keep each LLM conversation on the GPU instance that holds its KV cache",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(
		newServeCmd(),
		newConfigCmd(),
		newSessionsCmd(),
		newAuditCmd(),
	)
	return root
}
