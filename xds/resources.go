// Package xds turns a Spec into Envoy resources and serves them over ADS.
// Package plan translates tether's configuration into the Spec. One
// builder, Build, makes both what the ADS server sends and the static
// bootstrap in envoy/envoy-static.yaml, so the two cannot drift.
package xds

import (
	"fmt"
	"net"
	"sort"
	"strconv"
	"time"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/config/accesslog/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	mutationv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	grpcalsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/grpc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	earlyv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/http/early_header_mutation/header_mutation/v3"
	prevhostsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/retry/host/previous_hosts/v3"
	prevprioritiesv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/retry/priority/previous_priorities/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/ringhash"
)

// Resource names.
const (
	ListenerName   = "tether-llm"
	RouteName      = "tether-llm"
	ExtProcCluster = "tether-extproc"
	PoolPrefix     = "pool-"
)

// Mode says how resources refer to each other.
type Mode int

const (
	// ADS means clusters take endpoints by EDS and the listener takes routes by
	// RDS, all over the one ADS stream, so an endpoint or route change does
	// not rebuild a cluster or drain the listener.
	ADS Mode = iota
	// Static means endpoints and routes inline, for a bootstrap without xDS.
	Static
)

// Resources is one consistent set of Envoy resources.
type Resources struct {
	Listener  *listenerv3.Listener
	Routes    *routev3.RouteConfiguration
	Clusters  []*clusterv3.Cluster
	Endpoints []*endpointv3.ClusterLoadAssignment // ADS mode only
}

// Build makes the resources s describes.
//
// Per instance X there is a cluster inst-X with three priorities:
//   - 0: X alone;
//   - 1: the other instances of X's model version in X's zone;
//   - 2: those in other zones.
//
// While X is healthy it gets all of inst-X's traffic. When a request to X
// fails before its response starts, Envoy retries it on a same-zone peer.
// Once outlier detection ejects X, its traffic goes to those peers
// directly. tether's own decision is what moves bound sessions for good.
// This covers the requests in between.
func Build(s Spec, mode Mode) (*Resources, error) {
	if len(s.ExtProc) == 0 {
		return nil, fmt.Errorf("xds build: no ext_proc endpoint")
	}
	if len(s.Instances) == 0 {
		return nil, fmt.Errorf("xds build: no instances")
	}
	b := &builder{spec: s, mode: mode}
	r := &Resources{}

	ext, err := b.endpoints(ExtProcCluster, [][]string{s.ExtProc})
	if err != nil {
		return nil, err
	}
	extc := b.extProcCluster(ext)
	if extc.TransportSocket, err = upstreamTLS(s.TLS); err != nil {
		return nil, fmt.Errorf("xds build: %w", err)
	}
	r.Clusters = append(r.Clusters, extc)
	r.Endpoints = append(r.Endpoints, ext)

	byVersion := map[string][]Instance{}
	for _, in := range s.Instances {
		byVersion[in.Version] = append(byVersion[in.Version], in)
	}
	for _, in := range s.Instances {
		var zone, other []string
		for _, peer := range byVersion[in.Version] {
			switch {
			case peer.Name == in.Name:
			case peer.Zone == in.Zone:
				zone = append(zone, peer.Address)
			default:
				other = append(other, peer.Address)
			}
		}
		name := fleet.Instance{Name: in.Name}.Cluster()
		cla, err := b.endpoints(name, [][]string{{in.Address}, zone, other})
		if err != nil {
			return nil, fmt.Errorf("xds build: instance %s: %w", in.Name, err)
		}
		r.Clusters = append(r.Clusters, b.modelCluster(name, true, in.Limits, cla))
		r.Endpoints = append(r.Endpoints, cla)
	}
	for _, v := range sortedVersions(byVersion) {
		var addrs, names []string
		var weights []float64
		for _, in := range byVersion[v] {
			addrs = append(addrs, in.Address)
			names = append(names, in.Name)
			weights = append(weights, in.Weight)
		}
		cla, err := b.endpoints(PoolPrefix+v, [][]string{addrs})
		if err != nil {
			return nil, fmt.Errorf("xds build: pool %s: %w", v, err)
		}
		hashKeys(cla, names)
		lbWeights(cla, weights)
		r.Clusters = append(r.Clusters, b.modelCluster(PoolPrefix+v, false, s.Pool, cla))
		r.Endpoints = append(r.Endpoints, cla)
	}

	r.Routes = b.routes(defaultVersion(s, byVersion))
	if r.Listener, err = b.listener(r.Routes); err != nil {
		return nil, err
	}
	if b.err != nil {
		return nil, b.err
	}
	if mode == Static {
		r.Endpoints = nil
	}
	return r, nil
}

type builder struct {
	spec Spec
	mode Mode
	err  error
}

// endpoints makes a load assignment with one priority per address group;
// empty groups are skipped so priorities stay contiguous.
func (b *builder) endpoints(cluster string, groups [][]string) (*endpointv3.ClusterLoadAssignment, error) {
	cla := &endpointv3.ClusterLoadAssignment{ClusterName: cluster}
	for _, g := range groups {
		if len(g) == 0 {
			continue
		}
		loc := &endpointv3.LocalityLbEndpoints{Priority: uint32(len(cla.Endpoints))}
		for _, a := range g {
			sa, err := socketAddress(a)
			if err != nil {
				return nil, err
			}
			loc.LbEndpoints = append(loc.LbEndpoints, &endpointv3.LbEndpoint{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: sa}},
			})
		}
		cla.Endpoints = append(cla.Endpoints, loc)
	}
	return cla, nil
}

// hashKeys gives the endpoints of a pool's single priority their instance
// names as hash keys, in metadata envoy.lb, key hash_key. Envoy's ring hash
// places a host by its hash_key when it has one, else by its address
// (HashingLoadBalancer::hashKey). Names are stable where addresses are not.
// Package ringhash computes the same ring from them. So tether places new
// sessions where the pool sends them when tether is unreachable.
func hashKeys(cla *endpointv3.ClusterLoadAssignment, names []string) {
	for i, ep := range cla.Endpoints[0].LbEndpoints {
		ep.Metadata = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			"envoy.lb": {Fields: map[string]*structpb.Value{"hash_key": structpb.NewStringValue(names[i])}},
		}}
	}
}

// lbWeights gives the endpoints of a pool's single priority their
// instances' weights as load_balancing_weight. Envoy wants integers of at
// least 1 summing to at most MaxUint32. ringhash.LBWeights maps the float
// weights to integers in the same ratios: 1, 1, 2, 4 stay so, and equal
// weights are 1 each. tether builds its copy of the ring from the same
// integers. So the pool's RING_HASH ring and tether's fail-open placement
// are the same ring on a weighted fleet too.
func lbWeights(cla *endpointv3.ClusterLoadAssignment, weights []float64) {
	lb := ringhash.LBWeights(nil, weights)
	for i, ep := range cla.Endpoints[0].LbEndpoints {
		ep.LoadBalancingWeight = wrapperspb.UInt32(lb[i])
	}
}

// discovery points a cluster at its endpoints: inline, or EDS over ADS.
func (b *builder) discovery(c *clusterv3.Cluster, cla *endpointv3.ClusterLoadAssignment) {
	if b.mode == Static {
		c.ClusterDiscoveryType = &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STATIC}
		c.LoadAssignment = cla
		return
	}
	c.ClusterDiscoveryType = &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS}
	c.EdsClusterConfig = &clusterv3.Cluster_EdsClusterConfig{EdsConfig: adsSource()}
}

// extProcCluster is tether's replicas. Envoy checks each with the gRPC
// health protocol twice a second. It stops sending streams to one that
// failed two checks, such as a killed or draining replica. Without the
// check, a dead replica's share of requests would skip tether until its
// connections fail one by one.
func (b *builder) extProcCluster(cla *endpointv3.ClusterLoadAssignment) *clusterv3.Cluster {
	c := &clusterv3.Cluster{
		Name:           ExtProcCluster,
		ConnectTimeout: durationpb.New(250 * time.Millisecond),
		// Observed, each request opens two streams: the routing filter's
		// and the observing filter's. Round robin over two replicas would
		// send every routing stream to one of them. Least request picks
		// the less busy of two random replicas.
		LbPolicy: clusterv3.Cluster_LEAST_REQUEST,
		HealthChecks: []*corev3.HealthCheck{{
			Timeout:            durationpb.New(250 * time.Millisecond),
			Interval:           durationpb.New(500 * time.Millisecond),
			NoTrafficInterval:  durationpb.New(time.Second),
			UnhealthyThreshold: wrapperspb.UInt32(2),
			HealthyThreshold:   wrapperspb.UInt32(1),
			HealthChecker:      &corev3.HealthCheck_GrpcHealthCheck_{GrpcHealthCheck: &corev3.HealthCheck_GrpcHealthCheck{}},
		}},
	}
	http2(b, c)
	b.discovery(c, cla)
	return c
}

var poolLB = map[LBPolicy]clusterv3.Cluster_LbPolicy{
	RingHash:     clusterv3.Cluster_RING_HASH,
	RoundRobin:   clusterv3.Cluster_ROUND_ROBIN,
	LeastRequest: clusterv3.Cluster_LEAST_REQUEST,
}

// http2 makes a cluster speak HTTP/2 upstream, as gRPC needs.
func http2(b *builder, c *clusterv3.Cluster) {
	c.TypedExtensionProtocolOptions = map[string]*anypb.Any{
		"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": b.any(&upstreamhttpv3.HttpProtocolOptions{
			UpstreamProtocolOptions: &upstreamhttpv3.HttpProtocolOptions_ExplicitHttpConfig_{
				ExplicitHttpConfig: &upstreamhttpv3.HttpProtocolOptions_ExplicitHttpConfig{
					ProtocolConfig: &upstreamhttpv3.HttpProtocolOptions_ExplicitHttpConfig_Http2ProtocolOptions{
						Http2ProtocolOptions: &corev3.Http2ProtocolOptions{},
					},
				},
			},
		}),
	}
}

// modelCluster is an instance cluster (single) or a version pool.
//
// A pool hashes on the session headers with RING_HASH, so sessions stay
// together when tether is unreachable. An instance cluster sends everything
// to its priority 0, the instance, while it is healthy. Its fallback
// priorities use LEAST_REQUEST, for two reasons. Envoy's hashing balancers
// ignore the retry plugins that move a failed attempt to the next priority
// and another host. And a spill should go to the least busy peer anyway.
func (b *builder) modelCluster(name string, single bool, l Limits, cla *endpointv3.ClusterLoadAssignment) *clusterv3.Cluster {
	lb := poolLB[b.spec.PoolLB]
	if single {
		lb = clusterv3.Cluster_LEAST_REQUEST
	}
	c := &clusterv3.Cluster{
		Name:             name,
		ConnectTimeout:   durationpb.New(time.Second),
		LbPolicy:         lb,
		OutlierDetection: outlier(l.Outlier),
		CircuitBreakers:  breakers(l.Breakers),
	}
	b.discovery(c, cla)
	return c
}

func outlier(o Outlier) *clusterv3.OutlierDetection {
	u, d := wrapperspb.UInt32, durationpb.New
	return &clusterv3.OutlierDetection{
		Consecutive_5Xx:                    u(o.Consecutive5xx),
		EnforcingConsecutive_5Xx:           u(o.EnforcingConsecutive5xx),
		ConsecutiveGatewayFailure:          u(o.ConsecutiveGatewayFailure),
		EnforcingConsecutiveGatewayFailure: u(o.EnforcingConsecutiveGatewayFailure),
		Interval:                           d(o.Interval),
		BaseEjectionTime:                   d(o.BaseEjectionTime),
		MaxEjectionTime:                    d(o.MaxEjectionTime),
		MaxEjectionPercent:                 u(o.MaxEjectionPercent),
		SuccessRateMinimumHosts:            u(o.SuccessRateMinimumHosts),
		SuccessRateRequestVolume:           u(o.SuccessRateRequestVolume),
		SuccessRateStdevFactor:             u(o.SuccessRateStdevFactor),
		EnforcingSuccessRate:               u(o.EnforcingSuccessRate),
		FailurePercentageThreshold:         u(o.FailurePercentageThreshold),
		FailurePercentageMinimumHosts:      u(o.FailurePercentageMinimumHosts),
		FailurePercentageRequestVolume:     u(o.FailurePercentageRequestVolume),
		EnforcingFailurePercentage:         u(o.EnforcingFailurePercentage),
	}
}

func breakers(cb CircuitBreakers) *clusterv3.CircuitBreakers {
	return &clusterv3.CircuitBreakers{Thresholds: []*clusterv3.CircuitBreakers_Thresholds{{
		Priority:           corev3.RoutingPriority_DEFAULT,
		MaxConnections:     wrapperspb.UInt32(cb.MaxConnections),
		MaxPendingRequests: wrapperspb.UInt32(cb.MaxPendingRequests),
		MaxRequests:        wrapperspb.UInt32(cb.MaxRequests),
		MaxRetries:         wrapperspb.UInt32(cb.MaxRetries),
	}}}
}

// routes sends requests tether marked to the cluster it named. The rest go
// to the default version's pool: tether was unreachable or undecided. Both
// hash on the caller's identity headers, strongest first. So a session
// keeps to one host of whichever cluster serves it.
func (b *builder) routes(defaultVersion string) *routev3.RouteConfiguration {
	hash := make([]*routev3.RouteAction_HashPolicy, len(b.spec.HashPolicy))
	for i, h := range b.spec.HashPolicy {
		hash[i] = headerHash(h.Name, h.Terminal)
	}
	action := func(target func(*routev3.RouteAction)) *routev3.Route_Route {
		ra := &routev3.RouteAction{
			Timeout:     durationpb.New(b.spec.RouteTimeout),
			HashPolicy:  hash,
			RetryPolicy: b.retryPolicy(),
		}
		target(ra)
		return &routev3.Route_Route{Route: ra}
	}
	header := b.spec.ClusterHeader
	return &routev3.RouteConfiguration{
		Name: RouteName,
		VirtualHosts: []*routev3.VirtualHost{{
			Name:                 "llm",
			Domains:              []string{"*"},
			ResponseHeadersToAdd: b.debugHeaders(),
			Routes: []*routev3.Route{
				{
					Name: "tether",
					Match: &routev3.RouteMatch{
						PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"},
						Headers: []*routev3.HeaderMatcher{{
							Name:                 header,
							HeaderMatchSpecifier: &routev3.HeaderMatcher_PresentMatch{PresentMatch: true},
						}},
					},
					Action: action(func(ra *routev3.RouteAction) {
						ra.ClusterSpecifier = &routev3.RouteAction_ClusterHeader{ClusterHeader: header}
					}),
				},
				{
					Name:  "default",
					Match: &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}},
					Action: action(func(ra *routev3.RouteAction) {
						ra.ClusterSpecifier = &routev3.RouteAction_Cluster{Cluster: PoolPrefix + defaultVersion}
					}),
				},
			},
		}},
	}
}

func headerHash(name string, terminal bool) *routev3.RouteAction_HashPolicy {
	return &routev3.RouteAction_HashPolicy{
		PolicySpecifier: &routev3.RouteAction_HashPolicy_Header_{Header: &routev3.RouteAction_HashPolicy_Header{HeaderName: name}},
		Terminal:        terminal,
	}
}

// retryPolicy retries a request that failed at the instance on another
// priority and another host: the same-zone peers, then other zones. Only
// failures before the response started are retried, so a streamed answer is
// never duplicated.
func (b *builder) retryPolicy() *routev3.RetryPolicy {
	n := b.spec.Retries
	if n == 0 {
		return nil
	}
	return &routev3.RetryPolicy{
		RetryOn:    "connect-failure,refused-stream,reset,gateway-error",
		NumRetries: wrapperspb.UInt32(n),
		RetryPriority: &routev3.RetryPolicy_RetryPriority{
			Name:       "envoy.retry_priorities.previous_priorities",
			ConfigType: &routev3.RetryPolicy_RetryPriority_TypedConfig{TypedConfig: b.any(&prevprioritiesv3.PreviousPrioritiesConfig{UpdateFrequency: 1})},
		},
		RetryHostPredicate: []*routev3.RetryPolicy_RetryHostPredicate{{
			Name:       "envoy.retry_host_predicates.previous_hosts",
			ConfigType: &routev3.RetryPolicy_RetryHostPredicate_TypedConfig{TypedConfig: b.any(&prevhostsv3.PreviousHostsPredicate{})},
		}},
		HostSelectionRetryMaxAttempts: 3,
	}
}

func (b *builder) listener(routes *routev3.RouteConfiguration) (*listenerv3.Listener, error) {
	addr, err := socketAddress(b.spec.ListenerAddr)
	if err != nil {
		return nil, fmt.Errorf("xds build: envoy.listener_addr: %w", err)
	}
	m := &hcmv3.HttpConnectionManager{
		StatPrefix: "llm",
		// A client must not pick its own cluster: the routing header is
		// dropped before any filter or route sees it.
		EarlyHeaderMutationExtensions: []*corev3.TypedExtensionConfig{{
			Name: "envoy.http.early_header_mutation.header_mutation",
			TypedConfig: b.any(&earlyv3.HeaderMutation{Mutations: []*mutationv3.HeaderMutation{{
				Action: &mutationv3.HeaderMutation_Remove{Remove: b.spec.ClusterHeader},
			}}}),
		}},
	}
	if b.spec.ExtProcFilter {
		m.HttpFilters = append(m.HttpFilters, &hcmv3.HttpFilter{
			Name: "envoy.filters.http.ext_proc", ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: b.any(b.extProcFilter())},
		})
		switch b.spec.Outcomes {
		case OutcomesObserve:
			m.HttpFilters = append(m.HttpFilters, &hcmv3.HttpFilter{
				Name: ObserveFilterName, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: b.any(b.observeFilter())},
			})
		case OutcomesAccessLog:
			m.AccessLog = append(m.AccessLog, b.outcomeLog())
		}
	}
	m.HttpFilters = append(m.HttpFilters, &hcmv3.HttpFilter{
		Name: "envoy.filters.http.router", ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: b.any(&routerv3.Router{})},
	})
	if b.mode == Static {
		m.RouteSpecifier = &hcmv3.HttpConnectionManager_RouteConfig{RouteConfig: routes}
	} else {
		m.RouteSpecifier = &hcmv3.HttpConnectionManager_Rds{Rds: &hcmv3.Rds{RouteConfigName: RouteName, ConfigSource: adsSource()}}
	}
	return &listenerv3.Listener{
		Name:    ListenerName,
		Address: addr,
		// The connection's buffer bounds the body Envoy buffers for
		// tether. HTTP/1.1 streams take it as theirs.
		PerConnectionBufferLimitBytes: b.connectionLimit(),
		FilterChains: []*listenerv3.FilterChain{{Filters: []*listenerv3.Filter{{
			Name:       "envoy.filters.network.http_connection_manager",
			ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: b.any(m)},
		}}}},
	}, nil
}

// extProcFilter is the routing filter. Envoy goes on without tether when
// it is down or slower than the message timeout.
//
// With outcomes inline it sends the response headers too, with the
// attributes the ext_proc handler asks for in Spec.ResponseAttributes. One
// is the host that answered. It differs from the instance tether chose
// when Envoy retried on a peer or sent the request past an ejected
// instance.
//
// Otherwise only the request headers block, and no attribute is asked for.
// The reply's ticket is accepted into the request's dynamic metadata.
func (b *builder) extProcFilter() *extprocv3.ExternalProcessor {
	f := &extprocv3.ExternalProcessor{
		GrpcService:      b.tetherService(),
		FailureModeAllow: true,
		MessageTimeout:   durationpb.New(b.spec.MessageTimeout),
		// The handler may ask for one request's body, for cache-aware
		// placement, and for nothing else.
		AllowModeOverride:    true,
		AllowedOverrideModes: []*extprocv3.ProcessingMode{b.bodyOverride()},
		ProcessingMode: &extprocv3.ProcessingMode{
			RequestHeaderMode:   extprocv3.ProcessingMode_SEND,
			ResponseHeaderMode:  extprocv3.ProcessingMode_SKIP,
			RequestBodyMode:     extprocv3.ProcessingMode_NONE,
			ResponseBodyMode:    extprocv3.ProcessingMode_NONE,
			RequestTrailerMode:  extprocv3.ProcessingMode_SKIP,
			ResponseTrailerMode: extprocv3.ProcessingMode_SKIP,
		},
	}
	if b.inline() {
		f.ProcessingMode.ResponseHeaderMode = extprocv3.ProcessingMode_SEND
		f.ResponseAttributes = b.spec.ResponseAttributes
		f.ForwardRules = forwardRules(b.spec.RequestHeaders, b.spec.ResponseHeaders)
		return f
	}
	f.ForwardRules = forwardRules(b.spec.RequestHeaders)
	f.MetadataOptions = &extprocv3.MetadataOptions{
		ReceivingNamespaces: &extprocv3.MetadataOptions_MetadataNamespaces{Untyped: []string{b.spec.MetadataNamespace}},
	}
	if b.spec.ApartMarker != "" {
		f.GrpcService.InitialMetadata = []*corev3.HeaderValue{{Key: b.spec.ApartMarker, Value: "1"}}
	}
	return f
}

// forwardRules limits the headers a filter sends tether to the names
// given, for each phase it sends. Each name is an exact match, listed once,
// in the order given. nil, for no names, sends every header.
//
// Envoy checks every entry of the header map against the rules, the
// pseudo-headers too. It does so for the request and the response phase
// alike. See MutationUtils::headersToProto in
// source/extensions/filters/http/ext_proc/mutation_utils.cc, called by
// Filter::buildHeaderRequest in ext_proc.cc. An empty allowed list allows
// all. So a pseudo-header the handler reads, such as :path or :status,
// must be listed. The ones it does not read (:method, :authority, :scheme)
// stay in Envoy.
func forwardRules(names ...[]string) *extprocv3.HeaderForwardingRules {
	var patterns []*matcherv3.StringMatcher
	seen := map[string]bool{}
	for _, list := range names {
		for _, n := range list {
			if n == "" || seen[n] {
				continue
			}
			seen[n] = true
			patterns = append(patterns, &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: n}})
		}
	}
	if len(patterns) == 0 {
		return nil
	}
	return &extprocv3.HeaderForwardingRules{AllowedHeaders: &matcherv3.ListStringMatcher{Patterns: patterns}}
}

// connectionLimit is the listener's buffer (Spec.BodyLimit), nil for
// Envoy's default.
func (b *builder) connectionLimit() *wrapperspb.UInt32Value {
	if b.spec.BodyLimit <= 0 {
		return nil
	}
	return wrapperspb.UInt32(uint32(b.spec.BodyLimit))
}

// bodyOverride is the one processing mode the handler may switch a
// request to. It is the filter's own f.ProcessingMode with the request
// body buffered, partially when it is over the limit (see extproc's
// readBody). Envoy compares the override with this list field by field,
// ignoring the request header mode. So it must be written out whole.
func (b *builder) bodyOverride() *extprocv3.ProcessingMode {
	m := &extprocv3.ProcessingMode{
		RequestHeaderMode:   extprocv3.ProcessingMode_SEND,
		ResponseHeaderMode:  extprocv3.ProcessingMode_SKIP,
		RequestBodyMode:     extprocv3.ProcessingMode_BUFFERED_PARTIAL,
		ResponseBodyMode:    extprocv3.ProcessingMode_NONE,
		RequestTrailerMode:  extprocv3.ProcessingMode_SKIP,
		ResponseTrailerMode: extprocv3.ProcessingMode_SKIP,
	}
	if b.inline() {
		m.ResponseHeaderMode = extprocv3.ProcessingMode_SEND
	}
	return m
}

// debugHeaders copy the decision the routing reply wrote in the dynamic
// metadata into the response (Spec.DebugHeaders). So they need no
// response phase. A value the metadata lacks adds no header. Inline, the
// response phase sets them and these overwrite nothing.
func (b *builder) debugHeaders() []*corev3.HeaderValueOption {
	if len(b.spec.DebugHeaders) == 0 || b.inline() {
		return nil
	}
	out := make([]*corev3.HeaderValueOption, 0, len(b.spec.DebugHeaders))
	for _, h := range b.spec.DebugHeaders {
		out = append(out, &corev3.HeaderValueOption{
			Header:       &corev3.HeaderValue{Key: h.Header, Value: "%DYNAMIC_METADATA(" + b.spec.MetadataNamespace + ":" + h.Field + ")%"},
			AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
		})
	}
	return out
}

// inline: outcomes come on the routing stream (the default when unset).
func (b *builder) inline() bool {
	return b.spec.Outcomes == OutcomesInline || b.spec.Outcomes == ""
}

// ObserveFilterName names the observing filter (OutcomesObserve).
const ObserveFilterName = "tether.observe"

// observeFilter streams the request and response headers to tether in
// observability mode. Envoy sends them and goes on, reading no reply. The
// request headers bring the routing filter's ticket as forwarded dynamic
// metadata. The response headers bring the status and the host that
// answered.
func (b *builder) observeFilter() *extprocv3.ExternalProcessor {
	return &extprocv3.ExternalProcessor{
		GrpcService:        b.tetherService(),
		FailureModeAllow:   true,
		ObservabilityMode:  true,
		ResponseAttributes: b.spec.ResponseAttributes,
		// The request headers it sends carry the ticket in their metadata:
		// tether reads none of the headers themselves.
		ForwardRules: forwardRules(b.spec.ResponseHeaders),
		// tether closes the stream once it has the response headers. This
		// bounds it when a request ends otherwise.
		DeferredCloseTimeout: durationpb.New(time.Second),
		MetadataOptions: &extprocv3.MetadataOptions{
			ForwardingNamespaces: &extprocv3.MetadataOptions_MetadataNamespaces{Untyped: []string{b.spec.MetadataNamespace}},
		},
		ProcessingMode: &extprocv3.ProcessingMode{
			RequestHeaderMode:   extprocv3.ProcessingMode_SEND,
			ResponseHeaderMode:  extprocv3.ProcessingMode_SEND,
			RequestBodyMode:     extprocv3.ProcessingMode_NONE,
			ResponseBodyMode:    extprocv3.ProcessingMode_NONE,
			RequestTrailerMode:  extprocv3.ProcessingMode_SKIP,
			ResponseTrailerMode: extprocv3.ProcessingMode_SKIP,
		},
	}
}

// OutcomeLogName is the gRPC access log's log_name (OutcomesAccessLog).
const OutcomeLogName = "tether.outcomes"

// outcomeLog is Envoy's gRPC access log to tether. It logs the requests
// tether routed, whose dynamic metadata holds a ticket. Entries carry the
// instances' report headers. Each entry is sent as it is written, or
// batched per worker for Spec.OutcomeFlush.
func (b *builder) outcomeLog() *accesslogv3.AccessLog {
	common := &grpcalsv3.CommonGrpcAccessLogConfig{
		LogName:             OutcomeLogName,
		GrpcService:         b.tetherService(),
		TransportApiVersion: corev3.ApiVersion_V3,
	}
	if b.spec.OutcomeFlush > 0 {
		common.BufferFlushInterval = durationpb.New(b.spec.OutcomeFlush)
	} else {
		// Envoy sends its buffer once it holds more than this: every entry.
		common.BufferSizeBytes = wrapperspb.UInt32(1)
	}
	return &accesslogv3.AccessLog{
		Name: "envoy.access_loggers.http_grpc",
		Filter: &accesslogv3.AccessLogFilter{FilterSpecifier: &accesslogv3.AccessLogFilter_MetadataFilter{
			MetadataFilter: &accesslogv3.MetadataFilter{Matcher: &matcherv3.MetadataMatcher{
				Filter: b.spec.MetadataNamespace,
				Path:   []*matcherv3.MetadataMatcher_PathSegment{{Segment: &matcherv3.MetadataMatcher_PathSegment_Key{Key: "t"}}},
				Value:  &matcherv3.ValueMatcher{MatchPattern: &matcherv3.ValueMatcher_PresentMatch{PresentMatch: true}},
			}},
		}},
		ConfigType: &accesslogv3.AccessLog_TypedConfig{TypedConfig: b.any(&grpcalsv3.HttpGrpcAccessLogConfig{
			CommonConfig:                   common,
			AdditionalResponseHeadersToLog: b.spec.ReportHeaders,
		})},
	}
}

// tetherService is the gRPC service of tether's replicas.
func (b *builder) tetherService() *corev3.GrpcService {
	return &corev3.GrpcService{TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{
		EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{ClusterName: ExtProcCluster},
	}}
}

func adsSource() *corev3.ConfigSource {
	return &corev3.ConfigSource{
		ResourceApiVersion:    corev3.ApiVersion_V3,
		ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}},
	}
}

func socketAddress(hostport string) (*corev3.Address, error) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, fmt.Errorf("address %q: %w", hostport, err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || host == "" {
		return nil, fmt.Errorf("address %q: want host:port", hostport)
	}
	return &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
		Address:       host,
		PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: uint32(p)},
	}}}, nil
}

// defaultVersion is the spec's, else the version with the most instances.
// Ties go to the lowest name, so the default route is deterministic.
func defaultVersion(s Spec, byVersion map[string][]Instance) string {
	if s.DefaultVersion != "" {
		return s.DefaultVersion
	}
	best := ""
	for _, v := range sortedVersions(byVersion) {
		if best == "" || len(byVersion[v]) > len(byVersion[best]) {
			best = v
		}
	}
	return best
}

func sortedVersions(m map[string][]Instance) []string {
	out := make([]string, 0, len(m))
	for v := range m {
		out = append(out, v)
	}
	sort.Strings(out)
	return out
}

// any packs m; the first failure is kept and returned by Build.
func (b *builder) any(m proto.Message) *anypb.Any {
	a, err := anypb.New(m)
	if err != nil && b.err == nil {
		b.err = fmt.Errorf("xds build: pack %T: %w", m, err)
	}
	return a
}
