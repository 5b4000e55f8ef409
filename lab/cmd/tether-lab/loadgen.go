package main

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/internal/progress"
	"github.com/tetherproxy/tether/lab/loadgen"
	"github.com/tetherproxy/tether/lab/workload"
)

// loadgenFlags are the flags of `tether-lab loadgen`.
type loadgenFlags struct {
	target      string
	rate        float64
	duration    time.Duration
	drain       time.Duration
	seed        uint64
	thinkScale  float64
	maxInFlight int
	mix         string
	identities  string
	stream      bool
	model       string
	instances   []string
	jsonOut     string
	noProgress  bool
	allowRemote bool
}

func newLoadgenCmd() *cobra.Command {
	var fl loadgenFlags
	cmd := &cobra.Command{
		Use:   "loadgen",
		Short: "Replay the field's LLM traffic mix against an OpenAI-compatible endpoint and measure KV-cache hits, latency and stickiness",
		Long: `Replay the field's LLM traffic mix against an OpenAI-compatible endpoint (normally Envoy in front
of tether and emulated GPU instances) and measure what session affinity is for.

New conversations arrive as a Poisson process so that the request rate, follow-up turns included,
averages --rate; 30% are long documents (4k-16k tokens), 20% multi-turn chats (3-12 turns, each
carrying the whole history and the answers, with think time between turns), 50% short queries.
Every request opens with its application's system prompt. Callers identify by session id, bearer
token, device and user id, or not at all. Answers are asked with ignore_eos so their length is
fixed. At the end it prints the KV hit rate (cached / prompt tokens), latency percentiles, session
continuity, load imbalance and the requests per instance; --json writes every request too.
See lab/loadgen/README.md.`,
		Example: `  tether-lab loadgen --rate 20 --duration 60s --think-scale 0.1
  tether-lab loadgen --target http://127.0.0.1:10000 --rate 50 --duration 5m --mix long=0.3,multiturn=0.2,single=0.5 --json out.json
  tether-lab loadgen --target http://127.0.0.1:8001 --rate 5 --duration 10s --stream --no-progress`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			opts, err := loadgenOptions(&fl)
			if err != nil {
				return err
			}
			if !fl.noProgress {
				opts.Progress = progress.Terminal(cmd.ErrOrStderr())
			}
			res, runErr := loadgen.Run(cmd.Context(), opts)
			if res == nil {
				return runErr
			}
			// An interrupted run (SIGINT) still reports what it measured.
			if err := res.WriteTable(cmd.OutOrStdout()); err != nil {
				return err
			}
			if fl.jsonOut != "" {
				if err := writeJSONFile(fl.jsonOut, cmd.OutOrStdout(), res); err != nil {
					return err
				}
			}
			return runErr
		},
	}
	f := cmd.Flags()
	f.StringVar(&fl.target, "target", "http://127.0.0.1:10000", "base URL of the OpenAI-compatible endpoint (Envoy); requests go to <target>/v1/chat/completions")
	f.Float64Var(&fl.rate, "rate", 20, "requests per second, follow-up turns included (new conversations arrive at rate / mean requests per conversation)")
	f.DurationVar(&fl.duration, "duration", time.Minute, "how long new requests start")
	f.DurationVar(&fl.drain, "drain", loadgen.DefaultDrain, "after --duration, how long requests in flight may finish before they are cancelled")
	f.Uint64Var(&fl.seed, "seed", 1, "seed of the workload and of the arrival times: the same seed replays the same traffic")
	f.Float64Var(&fl.thinkScale, "think-scale", 1, "multiply the think time between turns (mean 5s): 0.1 ten times shorter, 0 none")
	f.IntVar(&fl.maxInFlight, "max-inflight", loadgen.DefaultMaxInFlight, "most requests in flight; a request beyond it is dropped (counted), never queued")
	f.StringVar(&fl.mix, "mix", "", "shares of conversation kinds, for example long=0.3,multiturn=0.2,single=0.5 (the default); names left out get 0")
	f.StringVar(&fl.identities, "identities", "", "shares of identity kinds, for example session=0.55,token=0.2,device=0.15,anonymous=0.1 (the default)")
	f.BoolVar(&fl.stream, "stream", false, "ask for streamed answers (stream: true); ttfb is then the time to the first token")
	f.StringVar(&fl.model, "model", loadgen.DefaultModel, "model named in the requests")
	f.StringSliceVar(&fl.instances, "instances", nil, "names of the instances behind the target (comma-separated, optional): those that serve nothing count in the load imbalance")
	f.StringVar(&fl.jsonOut, "json", "", `write the result, every request included, as JSON to this file ("-" for standard output)`)
	f.BoolVar(&fl.noProgress, "no-progress", false, "do not draw the progress bar on standard error")
	f.BoolVar(&fl.allowRemote, "allow-remote", false, "allow a target that is not a loopback address (this is a load generator: aim it only at what you own)")
	return cmd
}

// loadgenOptions checks the flags and turns them into loadgen.Options.
func loadgenOptions(fl *loadgenFlags) (loadgen.Options, error) {
	switch {
	case math.IsNaN(fl.rate) || fl.rate <= 0 || fl.rate > loadgen.MaxRate:
		return loadgen.Options{}, fmt.Errorf("--rate %v: want requests per second above 0, at most %v", fl.rate, loadgen.MaxRate)
	case fl.duration <= 0 || fl.duration > loadgen.MaxDuration:
		return loadgen.Options{}, fmt.Errorf("--duration %v: want above 0, at most %v", fl.duration, loadgen.MaxDuration)
	case fl.drain <= 0 || fl.drain > loadgen.MaxDrain:
		return loadgen.Options{}, fmt.Errorf("--drain %v: want above 0, at most %v", fl.drain, loadgen.MaxDrain)
	case math.IsNaN(fl.thinkScale) || fl.thinkScale < 0 || fl.thinkScale > loadgen.MaxThinkScale:
		return loadgen.Options{}, fmt.Errorf("--think-scale %v: want 0 (no think time) to %v", fl.thinkScale, loadgen.MaxThinkScale)
	case fl.maxInFlight < 1 || fl.maxInFlight > loadgen.MaxInFlightLimit:
		return loadgen.Options{}, fmt.Errorf("--max-inflight %d: want 1 to %d", fl.maxInFlight, loadgen.MaxInFlightLimit)
	case strings.TrimSpace(fl.model) == "":
		return loadgen.Options{}, errors.New("--model: empty")
	}
	wl := workload.Config{Seed: fl.seed}
	if fl.mix != "" {
		m, err := workload.ParseMix(fl.mix)
		if err != nil {
			return loadgen.Options{}, fmt.Errorf("--mix: %w", err)
		}
		wl.Mix = m
	}
	if fl.identities != "" {
		m, err := workload.ParseIdentityMix(fl.identities)
		if err != nil {
			return loadgen.Options{}, fmt.Errorf("--identities: %w", err)
		}
		wl.Identities = m
	}
	opts := loadgen.Options{
		Target:      fl.target,
		AllowRemote: fl.allowRemote,
		Workload:    wl,
		Rate:        fl.rate,
		Duration:    fl.duration,
		Drain:       fl.drain,
		ThinkScale:  fl.thinkScale,
		MaxInFlight: fl.maxInFlight,
		Stream:      fl.stream,
		Model:       fl.model,
		Instances:   fl.instances,
	}
	if err := opts.Validate(); err != nil {
		return loadgen.Options{}, err
	}
	return opts, nil
}
