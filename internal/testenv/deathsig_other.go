//go:build !linux

package testenv

import "os/exec"

// setDeathSignal has no portable equivalent outside Linux; Cleanup still
// stops the server on every ordinary exit.
func setDeathSignal(*exec.Cmd) {}
