package affinity

import "time"

// Reply is what a decided request's response headers said, as extproc
// read them and metrics records them.
type Reply struct {
	Status int
	// Elapsed runs from the request headers to the response headers.
	Elapsed time.Duration
	// Served: a host answered (not Envoy's own reply for which it picked
	// none, nor its overflow).
	Served bool
	// Peer: another host than the chosen instance answered (Envoy retried
	// or went past it).
	Peer bool
	// OOM: the instance reported running out of memory.
	OOM bool
	// GPU is the utilisation (0 to 1) the instance reported, when GPUKnown.
	GPU      float64
	GPUKnown bool
	// BadReports names the report headers that were present but unreadable.
	BadReports []string
}
