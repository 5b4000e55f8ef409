// Command tether is the session-affinity router for LLM fleets behind Envoy.
package main

import (
	_ "time/tzdata" // routing.rules time zones on hosts without zoneinfo

	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/internal/cli"
)

func main() { cli.Main("tether", newRootCmd()) }

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
