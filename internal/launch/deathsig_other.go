//go:build !linux

package launch

import "os/exec"

// setDeathSignal has no portable equivalent outside Linux. Stop still
// ends the child on every ordinary exit.
func setDeathSignal(*exec.Cmd) {}
