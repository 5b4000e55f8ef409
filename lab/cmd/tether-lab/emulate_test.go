package main

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/lab/emulator"
)

// TestEmulateSpecsServeTheVersion: --config instances serve their version
// as their model, --instance ones the emulator's default; --model names
// the model of all.
func TestEmulateSpecsServeTheVersion(t *testing.T) {
	local := filepath.Join("..", "..", "..", "deploy", "local", "tether.toml")
	specs, err := emulateSpecs(&emulateFlags{configFile: local, instances: []string{"extra=127.0.0.1:0"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(specs) != 9 {
		t.Fatalf("%d specs, want the 8 of %s and one more", len(specs), local)
	}
	for _, sp := range specs[:8] {
		if sp.Model != "llama-3.1-8b" {
			t.Errorf("%s serves %q, want its version llama-3.1-8b", sp.Name, sp.Model)
		}
	}
	if sp := specs[8]; sp.Name != "extra" || sp.Model != "" {
		t.Errorf("--instance spec %+v: want no model (the default)", sp)
	}
	specs, err = emulateSpecs(&emulateFlags{configFile: local, instances: []string{"extra=127.0.0.1:0"}, model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	for _, sp := range specs {
		if sp.Model != "m" {
			t.Errorf("with --model m, %s serves %q", sp.Name, sp.Model)
		}
	}
}

func TestEmulateRefusesAnUnknownEngine(t *testing.T) {
	_, err := runLab(t, "emulate", "--instance", "a=127.0.0.1:0", "--engine", "tgi")
	if err == nil || !strings.Contains(err.Error(), `--engine "tgi"`) {
		t.Errorf("--engine tgi: %v, want a refusal naming it", err)
	}
}

// TestEmulateEngineModelAndHeaders runs `emulate` with --engine sglang,
// --model and --report-headers, and reads what the instance serves.
func TestEmulateEngineModelAndHeaders(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		root := newRootCmd()
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		root.SetArgs([]string{"emulate", "--instance", "gpu-a=" + addr, "--profile", "fixed", "--engine", "sglang",
			"--model", "llama-3.1-8b", "--report-headers", "--log-level", "error"})
		done <- root.ExecuteContext(ctx)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("emulate: %v", err)
		}
	}()

	client := &http.Client{Timeout: 5 * time.Second}
	var resp *http.Response
	for i := 0; ; i++ {
		if resp, err = client.Get("http://" + addr + "/v1/models"); err == nil {
			break
		}
		if i > 200 {
			t.Fatalf("the instance did not start: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	var list struct {
		Data []struct{ ID string }
	}
	err = json.NewDecoder(resp.Body).Decode(&list)
	_ = resp.Body.Close()
	if err != nil || len(list.Data) != 1 || list.Data[0].ID != "llama-3.1-8b" {
		t.Errorf("/v1/models: %+v (%v)", list, err)
	}
	resp, err = client.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.Header.Get(emulator.QueueDepthHeader) != "0" {
		t.Errorf("--report-headers: %s = %q", emulator.QueueDepthHeader, resp.Header.Get(emulator.QueueDepthHeader))
	}
	resp, err = client.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if !strings.Contains(string(body), `sglang:prompt_tokens_total{model_name="llama-3.1-8b"} 1`) {
		t.Errorf("/metrics lacks SGLang's prompt token counter for the request:\n%s", body)
	}
}
