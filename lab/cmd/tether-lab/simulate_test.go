package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"
)

// runLab runs tether-lab with args.
func runLab(t *testing.T, args ...string) (string, error) {
	t.Helper()
	root := newRootCmd()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.ExecuteContext(t.Context())
	return out.String(), err
}

// TestSimulateConfig: --config replays the file's instances and policy;
// the flags the file decides are refused, naming the file's key.
func TestSimulateConfig(t *testing.T) {
	local := filepath.Join("..", "..", "..", "deploy", "local", "tether.toml")
	out, err := runLab(t, "simulate", "--config", local, "--rate", "20", "--duration", "5s", "--no-progress")
	if err != nil {
		t.Fatalf("simulate --config: %v\n%s", err, out)
	}
	for _, want := range []string{"8 × a100 instances in 2 zones", "instances and tether's policy from " + local, "tether (config)", "Envoy ring hash", "Envoy round robin"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--instances", "4"}, "--instances: --config " + local + " decides it"},
		{[]string{"--zones", "3"}, "--zones"},
		{[]string{"--idle-timeout", "1m"}, "routing.idle_timeout"},
		{[]string{"--max-sticky-duration", "1m"}, "routing.max_sticky_duration"},
		{[]string{"--policy", "sticky"}, "--policy sticky: with --config"},
		{[]string{"--config", filepath.Join(t.TempDir(), "missing.toml")}, "--config"},
	} {
		args := append([]string{"simulate", "--config", local, "--duration", "1s", "--no-progress"}, tc.args...)
		if _, err := runLab(t, args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error with %q", tc.args, err, tc.want)
		}
	}
	if _, err := runLab(t, "simulate", "--policy", "tether", "--duration", "1s", "--no-progress"); err == nil || !strings.Contains(err.Error(), "--config") {
		t.Errorf("--policy tether without --config: %v, want it refused", err)
	}
}

// TestSimulateBounds: every table has the oracle and the bound, and each
// policy's hit rate as a share of both; bad options are refused naming the
// flag.
func TestSimulateBounds(t *testing.T) {
	out, err := runLab(t, "simulate", "--policy", "sticky,least-request", "--rate", "6", "--duration", "20s", "--no-progress")
	if err != nil {
		t.Fatalf("simulate: %v\n%s", err, out)
	}
	for _, want := range []string{"of oracle", "of bound", "tether sticky", "Envoy least request", "oracle (longest cached prefix)", "infinite-cache bound"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--rate", "-1"}, "--rate -1"},
		{[]string{"--rate", "0"}, "--rate 0"},
		{[]string{"--kv-capacity-tokens", "0"}, "--kv-capacity-tokens 0"},
		{[]string{"--kv-capacity-tokens", "-16"}, "--kv-capacity-tokens -16"},
		{[]string{"--policy", "least-loaded"}, "--policy"},
	} {
		args := append([]string{"simulate", "--duration", "1s", "--no-progress"}, tc.args...)
		if _, err := runLab(t, args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error with %q", tc.args, err, tc.want)
		}
	}
}

func TestSimulateRegimes(t *testing.T) {
	dir := t.TempDir()
	out, err := runLab(t, "simulate", "--regime", "outage,day", "--instances", "8", "--rate", "2", "--think-scale", "0.2",
		"--policy", "sticky,ring-hash", "--charts", dir, "--no-progress")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"### outage", "### day", "| tether sticky |", "| Envoy ring hash |", "carried by fail-open",
		"mid-conversation model switches", "day-kv-hit-rate.png", "2 regimes × 3 policies"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--regime", "weekend"}, `unknown regime "weekend"`},
		{[]string{"--regime", "steady", "--duration", "1h"}, "--duration: each --regime sets its own"},
		{[]string{"--regime", "autoscale", "--instances", "1", "--zones", "1"}, "scale step 0.25 of 1 instances"},
		{[]string{"--regime", "autoscale", "--config", "../../../deploy/local/tether.toml"}, "scale: with a configuration, the fleet is its [[instances]]"},
		{[]string{"--charts", dir}, "--charts: draws the day regime's minutes"},
		{[]string{"--regime", "steady", "--rate", "-3"}, "--rate -3"},
		{[]string{"--regime", "steady", "--kv-capacity-tokens", "0"}, "--kv-capacity-tokens 0"},
	} {
		args := append([]string{"simulate", "--no-progress", "--rate", "2", "--policy", "ring-hash"}, tc.args...)
		if _, err := runLab(t, args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error with %q", tc.args, err, tc.want)
		}
	}
}
