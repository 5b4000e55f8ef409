// Command tether-lab measures tether: emulated GPU instances, the field's
// traffic mix, the benchmark suite and the event simulator. None of it is
// in the tether binary or its image, which carry what operators deploy.
package main

import (
	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/internal/cli"
)

func main() { cli.Main("tether-lab", newRootCmd()) }

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
