package xds

import "time"

// Spec is what Build makes Envoy's resources from. Package plan fills it
// from tether's configuration, with every default and every per-instance
// override resolved. xds knows nothing of the configuration file. It knows
// nothing of the ext_proc handler beyond the names Spec gives it.
type Spec struct {
	// ListenerAddr is where Envoy takes client traffic (host:port).
	ListenerAddr string
	// ExtProc lists the tether replicas Envoy calls (host:port each).
	ExtProc []string
	// ExtProcFilter puts tether's ext_proc filter in the listener. Without
	// it tether is a control plane only: every request takes the default
	// route to its version's pool.
	ExtProcFilter bool
	// MessageTimeout bounds each ext_proc exchange; past it Envoy goes on
	// without tether (failure_mode_allow).
	MessageTimeout time.Duration
	// ResponseAttributes are the attributes Envoy sends tether with the
	// response headers (the ext_proc handler's names).
	ResponseAttributes []string
	// RequestHeaders are the request headers the ext_proc handler reads.
	// The routing filter sends tether these alone, in its forward_rules.
	// Empty means every header.
	RequestHeaders []string
	// ResponseHeaders are the response headers it reads. The observing
	// filter and, with outcomes inline, the routing filter's response phase
	// send these alone. Empty means every header.
	ResponseHeaders []string
	// Outcomes is how tether hears how each request ended (Outcomes*).
	Outcomes string
	// OutcomeFlush is how long Envoy's access log may hold entries to send
	// them in batches (OutcomesAccessLog). 0 sends each entry as it is
	// written.
	OutcomeFlush time.Duration
	// ReportHeaders are the response headers in which instances report
	// their state. The access log keeps them (OutcomesAccessLog).
	ReportHeaders []string
	// MetadataNamespace is the dynamic metadata namespace the routing
	// reply writes the decision's ticket in, which the access log or the
	// observing filter brings back.
	MetadataNamespace string
	// ApartMarker is the gRPC metadata key, with value "1", that the
	// routing filter's streams carry when outcomes are not inline. It tells
	// tether to leave a decision to its outcome report, not to the end of
	// the routing stream.
	ApartMarker string
	// DebugHeaders are response headers copied from fields of that
	// namespace (server.debug_headers). They are set when outcomes are not
	// inline.
	DebugHeaders []DebugHeader
	// ClusterHeader is the request header tether names a cluster in. The
	// listener strips it from every client request.
	ClusterHeader string
	// HashPolicy lists the request headers both routes hash on, strongest
	// first.
	HashPolicy []HashHeader
	// RouteTimeout bounds a whole request, streaming included.
	RouteTimeout time.Duration
	// Retries is how many times a request is retried on a fallback host
	// when it failed at its instance before its response started. 0 means
	// none.
	Retries uint32
	// Instances are the model servers, in order: one cluster each.
	Instances []Instance
	// PoolLB balances the version pools; Pool is their outlier detection
	// and circuit breakers.
	PoolLB LBPolicy
	Pool   Limits
	// DefaultVersion is the pool of the default route, taken when tether is
	// unreachable or undecided. "" means the version with the most
	// instances.
	DefaultVersion string
	// TLS is how Envoy reaches tether's gRPC servers. nil means plaintext.
	// With the ADS server off, nil may also mean a transport socket
	// configured elsewhere.
	TLS *UpstreamTLS
	// BodyLimit is the most of a request's body Envoy buffers when the
	// ext_proc handler asks for it: its request_body_buffer_limit. 0 means
	// Envoy's own, the connection's buffer limit, 1 MiB by default.
	BodyLimit int
}

// DebugHeader is a response header Envoy fills from a dynamic metadata
// field.
type DebugHeader struct{ Header, Field string }

// How tether hears how a request ended.
const (
	// OutcomesInline: the routing filter's own stream waits for the
	// response headers too. That is a second blocking exchange per request.
	OutcomesInline = "inline"
	// OutcomesAccessLog: the routing filter sends the request headers
	// only. Envoy's gRPC access log brings each request's end to tether,
	// in batches, after the request.
	OutcomesAccessLog = "access_log"
	// OutcomesObserve: the routing filter sends the request headers only.
	// A second ext_proc filter in observability mode streams the request
	// and response headers to tether without waiting for replies.
	OutcomesObserve = "observe"
)

// HashHeader is one hash policy on a request header: Terminal stops at it
// when the request has the header.
type HashHeader struct {
	Name     string
	Terminal bool
}

// Instance is one model server and the limits of its cluster.
type Instance struct {
	Name, Address, Zone, Version string
	// Weight is the instance's share of new sessions. Config holds it
	// above 0 and at most 1e6. Its version pool's endpoint carries it as a
	// load_balancing_weight, mapped by ringhash.LBWeights.
	Weight float64
	Limits Limits
}

// Limits are a cluster's outlier detection and circuit breakers.
type Limits struct {
	Outlier  Outlier
	Breakers CircuitBreakers
}

// Outlier is Envoy's outlier detection (envoy.config.cluster.v3.OutlierDetection).
type Outlier struct {
	Consecutive5xx                     uint32
	EnforcingConsecutive5xx            uint32
	ConsecutiveGatewayFailure          uint32
	EnforcingConsecutiveGatewayFailure uint32
	Interval                           time.Duration
	BaseEjectionTime                   time.Duration
	MaxEjectionTime                    time.Duration
	MaxEjectionPercent                 uint32
	SuccessRateMinimumHosts            uint32
	SuccessRateRequestVolume           uint32
	SuccessRateStdevFactor             uint32
	EnforcingSuccessRate               uint32
	FailurePercentageThreshold         uint32
	FailurePercentageMinimumHosts      uint32
	FailurePercentageRequestVolume     uint32
	EnforcingFailurePercentage         uint32
}

// CircuitBreakers are Envoy's per-cluster thresholds (default priority).
type CircuitBreakers struct {
	MaxConnections, MaxPendingRequests, MaxRequests, MaxRetries uint32
}

// LBPolicy balances a version pool.
type LBPolicy string

// The pool balancers.
const (
	RingHash     LBPolicy = "ring_hash" // on the hash policy: sessions stay together without tether
	RoundRobin   LBPolicy = "round_robin"
	LeastRequest LBPolicy = "least_request"
)

// UpstreamTLS is how Envoy connects to tether's gRPC servers when they
// speak TLS. The files are Envoy's: xds names them and reads none.
type UpstreamTLS struct {
	// CAFile verifies tether's certificate (required).
	CAFile string
	// CertFile and KeyFile are Envoy's client certificate for mutual TLS.
	// "" means none.
	CertFile, KeyFile string
	// SNI, when set, is sent and required among the certificate's DNS names.
	SNI string
	// MinVersion is "1.2" or "1.3".
	MinVersion string
}
