package testenv

import (
	"os/exec"
	"syscall"
)

// setDeathSignal kills the child if the test binary dies without running its
// cleanups (a panic, a timeout, SIGKILL), so no redis-server outlives it.
func setDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
