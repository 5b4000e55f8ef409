package engine

import (
	"errors"
	"fmt"

	"github.com/tetherproxy/tether/fleet"
)

// Kind names the serving engine behind an instance, which says how its
// /metrics is read.
type Kind string

// The kinds of engine. A Generic instance is not scraped.
const (
	Generic Kind = "generic"
	VLLM    Kind = "vllm"
	SGLang  Kind = "sglang"
)

// errNotScraped is what Parse and Scrape say of the generic kind.
var errNotScraped = errors.New("engine: a generic instance has no engine metrics to read")

// Sample is what one exposition says: a reading and how many engines it
// sums. It has no time or rates: At is zero and RatesKnown false.
// Tracker.Observe adds the time and the rates.
type Sample struct {
	fleet.EngineReading
	// Engines is how many engine series the exposition held. It counts the
	// distinct values of the running gauge's engine label (vLLM) or dp_rank
	// label (SGLang). It is 1 when the gauge carries no such label.
	Engines int
}

// The reasons an Error gives: the values of the label reason of
// tether_engine_scrape_errors_total.
const (
	ReasonConnect      = "connect"       // the request did not get an answer: refused, reset, no route, DNS
	ReasonTimeout      = "timeout"       // no whole answer within the scrape timeout
	ReasonStatus       = "status"        // an answer other than 200
	ReasonTooLarge     = "too_large"     // a body over the limit
	ReasonParse        = "parse"         // not the Prometheus text format (an HTML page, a truncated body…)
	ReasonMissing      = "missing"       // none of the engine's queue gauges
	ReasonBadValue     = "bad_value"     // NaN, ±Inf, a negative value, a usage above 1, or a histogram where a number belongs
	ReasonCounterReset = "counter_reset" // a counter lower than in the sample before (an engine restart)
	ReasonOther        = "other"         // any other error
)

// Reasons lists every reason Reason can return, for metrics that want each
// label value present from the start.
func Reasons() []string {
	return []string{
		ReasonConnect, ReasonTimeout, ReasonStatus, ReasonTooLarge, ReasonParse,
		ReasonMissing, ReasonBadValue, ReasonCounterReset, ReasonOther,
	}
}

// Error is a failed scrape or an unusable exposition.
type Error struct {
	Reason string
	Err    error
}

func (e *Error) Error() string {
	if e.Err == nil {
		return "engine: " + e.Reason
	}
	return "engine: " + e.Reason + ": " + e.Err.Error()
}

func (e *Error) Unwrap() error { return e.Err }

// Reason is the reason of the first *Error in err's chain, ReasonOther when
// there is none, and "" for a nil err.
func Reason(err error) string {
	if err == nil {
		return ""
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Reason
	}
	return ReasonOther
}

func errorf(reason, format string, args ...any) error {
	return &Error{Reason: reason, Err: fmt.Errorf(format, args...)}
}
