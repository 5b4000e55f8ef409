package xds

import (
	"fmt"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"sigs.k8s.io/yaml"
)

// ADSCluster is the bootstrap cluster that reaches tether's ADS server.
const ADSCluster = "tether-xds"

// StaticBootstrap is a complete Envoy bootstrap without xDS: Build's
// resources in Static mode, plus the admin interface.
func StaticBootstrap(s Spec, admin string) (*bootstrapv3.Bootstrap, error) {
	r, err := Build(s, Static)
	if err != nil {
		return nil, err
	}
	a, err := adminConfig(admin)
	if err != nil {
		return nil, err
	}
	return &bootstrapv3.Bootstrap{
		Admin: a,
		StaticResources: &bootstrapv3.Bootstrap_StaticResources{
			Listeners: []*listenerv3.Listener{r.Listener},
			Clusters:  r.Clusters,
		},
	}, nil
}

// ADSBootstrap names the node, the admin interface and tether's ADS
// server, and nothing else. It reaches the ADS server over HTTP/2, and
// over TLS with WithTLS. Every listener, route, cluster and endpoint comes
// over ADS.
func ADSBootstrap(node, admin, ads string, opts ...BootstrapOption) (*bootstrapv3.Bootstrap, error) {
	var o bootstrapOptions
	for _, opt := range opts {
		opt(&o)
	}
	a, err := adminConfig(admin)
	if err != nil {
		return nil, err
	}
	addr, err := socketAddress(ads)
	if err != nil {
		return nil, fmt.Errorf("ads address: %w", err)
	}
	b := &builder{}
	xdsCluster := &clusterv3.Cluster{
		Name:                 ADSCluster,
		ConnectTimeout:       durationpb.New(time.Second),
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STATIC},
		LoadAssignment: &endpointv3.ClusterLoadAssignment{
			ClusterName: ADSCluster,
			Endpoints: []*endpointv3.LocalityLbEndpoints{{LbEndpoints: []*endpointv3.LbEndpoint{{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: addr}},
			}}}},
		},
	}
	http2(b, xdsCluster)
	if b.err != nil {
		return nil, b.err
	}
	if xdsCluster.TransportSocket, err = upstreamTLS(o.tls); err != nil {
		return nil, fmt.Errorf("ads bootstrap: %w", err)
	}
	return &bootstrapv3.Bootstrap{
		Node:  &corev3.Node{Id: node, Cluster: node},
		Admin: a,
		DynamicResources: &bootstrapv3.Bootstrap_DynamicResources{
			AdsConfig: &corev3.ApiConfigSource{
				ApiType:             corev3.ApiConfigSource_GRPC,
				TransportApiVersion: corev3.ApiVersion_V3,
				GrpcServices: []*corev3.GrpcService{{TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{
					EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{ClusterName: ADSCluster},
				}}},
			},
			CdsConfig: adsSource(),
			LdsConfig: adsSource(),
		},
		StaticResources: &bootstrapv3.Bootstrap_StaticResources{Clusters: []*clusterv3.Cluster{xdsCluster}},
	}, nil
}

func adminConfig(admin string) (*bootstrapv3.Admin, error) {
	a, err := socketAddress(admin)
	if err != nil {
		return nil, fmt.Errorf("admin address: %w", err)
	}
	return &bootstrapv3.Admin{Address: a}, nil
}

// YAML renders a message as YAML with a comment header.
func YAML(m proto.Message, header string) ([]byte, error) {
	j, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("render: %w", err)
	}
	y, err := yaml.JSONToYAML(j)
	if err != nil {
		return nil, fmt.Errorf("render: %w", err)
	}
	return append([]byte(header), y...), nil
}
