package plan

import (
	"reflect"
	"slices"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/xds"
)

// envoy is the spec of Envoy's resources for cfg. replicas lists the
// tether replicas Envoy calls when envoy.extproc_endpoints names none.
func envoy(cfg config.Config, replicas []string) xds.Spec {
	e := cfg.Envoy
	ext := e.ExtProcEndpoints
	switch {
	case len(ext) > 0:
	case len(replicas) > 0:
		ext = replicas
	default:
		ext = []string{cfg.Server.ExtProcAddr}
	}
	s := xds.Spec{
		ListenerAddr:       e.ListenerAddr,
		ExtProc:            ext,
		ExtProcFilter:      e.ExtProc,
		MessageTimeout:     e.MessageTimeout.D,
		ResponseAttributes: responseAttributes(),
		Outcomes:           e.Outcomes,
		OutcomeFlush:       e.OutcomeFlush.D,
		ReportHeaders:      reportHeaders(cfg),
		MetadataNamespace:  extproc.MetadataNamespace,
		ApartMarker:        extproc.ApartMarker,
		DebugHeaders:       debugHeaders(cfg),
		ClusterHeader:      cfg.Routing.ClusterHeader,
		HashPolicy:         hashPolicy(cfg.Identity),
		RouteTimeout:       e.RouteTimeout.D,
		Retries:            e.Retries,
		PoolLB:             xds.LBPolicy(e.PoolLB),
		Pool:               limits(cfg, ""),
		DefaultVersion:     e.DefaultVersion,
		TLS:                upstreamTLS(cfg.TLS),
		BodyLimit:          cfg.Content.MaxBodyBytes,
	}
	for _, in := range cfg.Instances {
		s.Instances = append(s.Instances, xds.Instance{
			Name: in.Name, Address: in.Address, Zone: in.Zone, Version: in.Version,
			Weight: in.Weight, Limits: limits(cfg, in.Name),
		})
	}
	return s
}

// forwarded are the headers Envoy sends tether: the ext_proc filters'
// forward_rules (xds.Spec.RequestHeaders and ResponseHeaders). They are
// exactly those the handler reads under p; each reader names its own.
//
// The request's come from the identity, the fail-open pool's hash, the
// policy (canary, rules, tier) and the handler itself. The handler reads
// the path, the request id and the audit's user. When [content] may leave
// a placement open, it also reads what says whether the body can be read.
// The decider hashes a new session as Envoy's pool would, hence the hash.
//
// The response's are the status, Envoy's overload mark and the
// instances' reports. Each list is sorted, without repeats.
// extproc's TestForwardedHeadersAreRead holds them to what the handler
// reads.
func forwarded(p Plan) (request, response []string) {
	request = slices.Concat(p.Identity.Headers(), p.Policy.Headers(), p.ExtProc.RequestHeaders(p.Policy.OpensPlacement()))
	for _, h := range p.Envoy.HashPolicy {
		request = append(request, h.Name)
	}
	return names(request), names(p.ExtProc.ResponseHeaders())
}

// names is list sorted, without repeats or empty names.
func names(list []string) []string {
	list = slices.DeleteFunc(slices.Clone(list), func(n string) bool { return n == "" })
	slices.Sort(list)
	return slices.Compact(list)
}

// responseAttributes are what the ext_proc handler reads in the response
// phase. The first is the host that answered. When Envoy retried on a
// peer, or passed over an instance it had ejected, that is not the
// instance tether chose: the chosen one failed although the client got an
// answer. The second is the status, which shows the attributes arrive at
// all.
func responseAttributes() []string {
	return []string{extproc.AttrUpstreamAddress, extproc.AttrResponseCode}
}

// debugHeaders: with server.debug_headers, Envoy copies the decision
// into the response from the routing reply's metadata.
func debugHeaders(cfg config.Config) []xds.DebugHeader {
	if !cfg.Server.DebugHeaders {
		return nil
	}
	return []xds.DebugHeader{
		{Header: extproc.HeaderInstance, Field: extproc.MetadataInstance},
		{Header: extproc.HeaderDecision, Field: extproc.MetadataDecision},
	}
}

// reportHeaders are the response headers instances report their state in
// (the ext_proc handler reads them; the access log must keep them).
func reportHeaders(cfg config.Config) []string {
	var out []string
	for _, h := range []string{cfg.Routing.QueueDepthHeader, cfg.Routing.OOMHeader, cfg.Routing.GPUUtilizationHeader} {
		if h != "" {
			out = append(out, h)
		}
	}
	return out
}

// hashPolicy: the identity headers, strongest first, each terminal when
// present but the device id, which goes with the user id.
func hashPolicy(id config.Identity) []xds.HashHeader {
	return []xds.HashHeader{
		{Name: id.SessionHeader, Terminal: true},
		{Name: id.AuthHeader, Terminal: true},
		{Name: id.DeviceHeader, Terminal: false},
		{Name: id.UserHeader, Terminal: true},
	}
}

// limits are the outlier detection and circuit breakers of instance's
// cluster ("" for the version pools): the sections', with the keys the
// instance's own tables set over them.
func limits(cfg config.Config, instance string) xds.Limits {
	o, b := cfg.OutlierDetection.OutlierSettings, cfg.CircuitBreakers.CircuitBreakerSettings
	if instance != "" {
		overlay(&o, cfg.OutlierDetection.Instances[instance])
		overlay(&b, cfg.CircuitBreakers.Instances[instance])
	}
	return xds.Limits{
		Outlier: xds.Outlier{
			Consecutive5xx:                     *o.Consecutive5xx,
			EnforcingConsecutive5xx:            *o.EnforcingConsecutive5xx,
			ConsecutiveGatewayFailure:          *o.ConsecutiveGatewayFailure,
			EnforcingConsecutiveGatewayFailure: *o.EnforcingConsecutiveGatewayFailure,
			Interval:                           o.Interval.D,
			BaseEjectionTime:                   o.BaseEjectionTime.D,
			MaxEjectionTime:                    o.MaxEjectionTime.D,
			MaxEjectionPercent:                 *o.MaxEjectionPercent,
			SuccessRateMinimumHosts:            *o.SuccessRateMinimumHosts,
			SuccessRateRequestVolume:           *o.SuccessRateRequestVolume,
			SuccessRateStdevFactor:             *o.SuccessRateStdevFactor,
			EnforcingSuccessRate:               *o.EnforcingSuccessRate,
			FailurePercentageThreshold:         *o.FailurePercentageThreshold,
			FailurePercentageMinimumHosts:      *o.FailurePercentageMinimumHosts,
			FailurePercentageRequestVolume:     *o.FailurePercentageRequestVolume,
			EnforcingFailurePercentage:         *o.EnforcingFailurePercentage,
		},
		Breakers: xds.CircuitBreakers{
			MaxConnections:     *b.MaxConnections,
			MaxPendingRequests: *b.MaxPendingRequests,
			MaxRequests:        *b.MaxRequests,
			MaxRetries:         *b.MaxRetries,
		},
	}
}

// upstreamTLS is how Envoy reaches tether's gRPC servers under [tls]. It
// is nil when tether serves plaintext. It is nil too when [tls.envoy] is
// empty. config.Validate allows that only with the ADS server off: then
// Envoy is configured elsewhere, as under Istio, and that configuration
// sets Envoy's TLS to tether (docs/security.md). config.Validate refuses
// a [tls.envoy] that lacks what Envoy needs.
func upstreamTLS(t config.TLS) *xds.UpstreamTLS {
	e := t.Envoy
	if t.CertFile == "" || e == (config.EnvoyTLS{}) {
		return nil
	}
	return &xds.UpstreamTLS{CAFile: e.CAFile, CertFile: e.CertFile, KeyFile: e.KeyFile, SNI: e.SNI, MinVersion: t.MinVersion}
}

// overlay sets every field of dst (a struct of pointer fields) that src
// sets: an instance's table over its section's.
func overlay[T any](dst *T, src T) {
	d, s := reflect.ValueOf(dst).Elem(), reflect.ValueOf(src)
	for i := range s.NumField() {
		if f := s.Field(i); !f.IsNil() {
			d.Field(i).Set(f)
		}
	}
}
