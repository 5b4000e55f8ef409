package launch

import (
	"os/exec"
	"syscall"
)

// setDeathSignal kills the child if its parent dies without stopping it,
// as on a panic, a test timeout or SIGKILL. So no server outlives the test
// binary or the lab run that started it.
func setDeathSignal(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}
