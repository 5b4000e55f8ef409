package loadgen

import (
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/tetherproxy/tether/lab/workload"
)

// Defaults and limits of Options.
const (
	// DefaultDrain is how long requests still in flight at the end of the
	// duration may run before they are cancelled.
	DefaultDrain = 30 * time.Second
	// DefaultMaxInFlight bounds the requests in flight at once.
	DefaultMaxInFlight = 256
	// DefaultModel is the model named in requests that set none.
	DefaultModel = "tether-sim"

	// MaxDuration, MaxDrain, MaxRate and MaxInFlightLimit bound the options.
	MaxDuration      = 24 * time.Hour
	MaxDrain         = time.Hour
	MaxRate          = 100_000.0
	MaxInFlightLimit = 1_000_000
	// MaxThinkScale bounds ThinkScale.
	MaxThinkScale = 1000.0
)

// Response headers a record reads.
const (
	// InstanceHeader names the instance that served a request (the
	// emulator sets it on every answer).
	InstanceHeader = "x-instance"
	// DecisionHeader and TetherInstanceHeader are tether's debug headers
	// (debug_headers = true): how it decided and the instance it chose.
	DecisionHeader       = "x-tether-decision"
	TetherInstanceHeader = "x-tether-instance"
)

// Options configures a Run.
type Options struct {
	// Target is the base URL of an OpenAI-compatible server (Envoy in front
	// of tether, or an emulated instance), such as http://127.0.0.1:10000.
	// Requests go to Target + "/v1/chat/completions" ("/chat/completions"
	// when Target already ends in /v1). It must be a loopback address
	// unless AllowRemote is set.
	Target string
	// AllowRemote allows a Target that is not a loopback address.
	AllowRemote bool

	// Workload is the traffic (mix, identities, applications, lengths,
	// seed); its zero value is the field's mix with seed 0.
	Workload workload.Config

	// Rate is the target rate in requests per second, follow-up turns
	// included. New conversations arrive as a Poisson process at Rate /
	// (mean requests per conversation); the request rate reaches Rate once
	// the first multi-turn conversations are in their later turns. Required.
	Rate float64
	// Duration is how long new requests start: no conversation arrives and
	// no turn is sent after it. Required.
	Duration time.Duration
	// Drain is how long, after Duration, requests still in flight may
	// finish; they are then cancelled. Zero: DefaultDrain.
	Drain time.Duration
	// ThinkScale multiplies the workload's think times between turns: 1
	// waits them as drawn, 0.1 ten times shorter, 0 not at all.
	ThinkScale float64
	// MaxInFlight bounds the requests in flight: a request that would
	// exceed it is not sent but recorded as dropped (and its conversation
	// ends). Zero: DefaultMaxInFlight.
	MaxInFlight int

	// Stream asks for streamed answers (stream: true); TTFB is then the
	// time to the first event, the first token.
	Stream bool
	// Model is the model named in requests. Empty: DefaultModel.
	Model string

	// Instances are the names of the instances behind Target, when known:
	// an instance that serves nothing then counts in the load imbalance
	// (see Summary). Optional.
	Instances []string

	// Client sends the requests. Nil: a client of Run's own whose idle
	// connections are closed when Run returns.
	Client *http.Client
	// Progress, when not nil, receives a progress bar (os.Stderr, say).
	Progress io.Writer
	// Rand draws the arrival times. Nil: a source seeded from
	// Workload.Seed, so a run's schedule is reproducible.
	Rand rand.Source
}

func (o Options) withDefaults() Options {
	if o.Drain == 0 {
		o.Drain = DefaultDrain
	}
	if o.MaxInFlight == 0 {
		o.MaxInFlight = DefaultMaxInFlight
	}
	if o.Model == "" {
		o.Model = DefaultModel
	}
	if o.Rand == nil {
		o.Rand = rand.NewPCG(o.Workload.Seed, 0x6172726976616c73) // "arrivals"
	}
	return o
}

// Validate reports the first problem with the options, naming the option
// and the bad value.
func (o Options) Validate() error {
	if _, err := o.endpoint(); err != nil {
		return err
	}
	switch r := o.Rate; {
	case math.IsNaN(r) || r <= 0 || r > MaxRate:
		return fmt.Errorf("loadgen: rate %v: want requests per second above 0, at most %v", r, MaxRate)
	case o.Duration <= 0 || o.Duration > MaxDuration:
		return fmt.Errorf("loadgen: duration %v: want above 0, at most %v", o.Duration, MaxDuration)
	case o.Drain < 0 || o.Drain > MaxDrain:
		return fmt.Errorf("loadgen: drain %v: want 0 (the default, %v) up to %v", o.Drain, DefaultDrain, MaxDrain)
	case math.IsNaN(o.ThinkScale) || o.ThinkScale < 0 || o.ThinkScale > MaxThinkScale:
		return fmt.Errorf("loadgen: think scale %v: want 0 (no think time) to %v", o.ThinkScale, MaxThinkScale)
	case o.MaxInFlight < 0 || o.MaxInFlight > MaxInFlightLimit:
		return fmt.Errorf("loadgen: max in flight %d: want 0 (the default, %d) to %d", o.MaxInFlight, DefaultMaxInFlight, MaxInFlightLimit)
	}
	if err := o.Workload.Validate(); err != nil {
		return fmt.Errorf("loadgen: %w", err)
	}
	return nil
}

// endpoint checks Target and returns the chat completions URL.
func (o Options) endpoint() (string, error) {
	if o.Target == "" {
		return "", errors.New("loadgen: target is empty: want a base URL such as http://127.0.0.1:10000")
	}
	u, err := url.Parse(o.Target)
	if err != nil {
		return "", fmt.Errorf("loadgen: target %q: %w", o.Target, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", fmt.Errorf("loadgen: target %q: want an http:// or https:// URL", o.Target)
	}
	if u.Hostname() == "" {
		return "", fmt.Errorf("loadgen: target %q: no host", o.Target)
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return "", fmt.Errorf("loadgen: target %q: want a base URL without query, fragment or user info", o.Target)
	}
	// A load generator aimed at a service one does not own is a
	// denial-of-service tool, and a typo (a missing "127.0.0.1", a staging
	// host name) is enough to aim it there: anything but loopback must be
	// asked for explicitly.
	if !o.AllowRemote && !isLoopback(u.Hostname()) {
		return "", fmt.Errorf("loadgen: target %q is not a loopback address (localhost, 127.0.0.0/8, ::1): a load test against another host must be allowed explicitly (AllowRemote, --allow-remote)", o.Target)
	}
	path := strings.TrimRight(u.Path, "/")
	if strings.HasSuffix(path, "/v1") {
		path += "/chat/completions"
	} else {
		path += "/v1/chat/completions"
	}
	u.Path, u.RawPath = path, ""
	return u.String(), nil
}

func isLoopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
