package fleet

import "time"

// Outcome is how a request sent to an instance ended, as Envoy reported it
// to tether. Envoy reports it in the response headers or the access-log
// entry. The decider, its instance breaker and the metrics hear it. The
// zero value is a request that ended before any response, as when the
// client left or the stream broke. It says nothing about the instance.
type Outcome struct {
	// Answered: a host answered, with any status; not Envoy's own reply for
	// which it picked no host, nor its overflow, which say nothing about
	// the instance either.
	Answered bool
	// Failed says the instance failed the request. That is a 5xx of its
	// own, or a reply Envoy made because it could not reach or hear from
	// it. It is also an answer from another host (Peer). The instance
	// breaker counts it.
	Failed bool
	// Status is the response's HTTP status (0: none).
	Status int
	// Elapsed runs from the decision to the response headers.
	Elapsed time.Duration
	// Peer: another host than the chosen instance answered (Envoy retried
	// or went past it).
	Peer bool
	// Queue is the queue depth the instance reported, when QueueKnown (never
	// for a peer's answer, nor an answer that says nothing of the instance).
	Queue      int
	QueueKnown bool
	// OOM: the instance reported running out of memory.
	OOM bool
	// GPU is the utilisation (0 to 1) the instance reported, when GPUKnown.
	GPU      float64
	GPUKnown bool
	// BadReports names the report headers that were present but unreadable.
	BadReports []string
}
