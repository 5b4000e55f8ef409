package bench

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The ext_proc floor is the least an ext_proc router can do: it answers
// each request's headers as tether's reply does, with the routing header
// naming an instance's cluster and clear_route_cache (Envoy re-selects
// the route, which then sends the request to that cluster), and keeps
// nothing. It picks the cluster statelessly, by a hash of the session
// header, from replies built once per cluster, on gRPC's default server,
// and sets no dynamic metadata, so the outcome access log of tether's
// configuration (which logs only requests that carry tether's ticket)
// writes nothing for it. Its overhead row, with Envoy's filter configured
// exactly as for tether, is what routing through a minimal Go ext_proc
// server costs on the machine: what tether adds beyond it is its own work.

// floorRoutes is what the floor routes by: the session header it hashes,
// the header Envoy routes on and the clusters to choose from.
type floorRoutes struct {
	SessionHeader, ClusterHeader string
	Clusters                     []string
}

// floorProcessor answers request headers with the reply of the cluster
// the session's hash picks, response headers (which tether's filter sends
// only with outcomes inline) with an empty reply, and counts the request
// headers it answered: the proof that Envoy called it rather than failing
// open.
type floorProcessor struct {
	extprocv3.UnimplementedExternalProcessorServer
	session  string
	clusters []string
	replies  []*extprocv3.ProcessingResponse // one per cluster, alike
	requests atomic.Int64
}

func newFloorProcessor(r floorRoutes) (*floorProcessor, error) {
	if len(r.Clusters) == 0 || r.SessionHeader == "" || r.ClusterHeader == "" {
		return nil, fmt.Errorf("ext_proc floor: session header %q, cluster header %q, %d clusters: want both headers and a cluster",
			r.SessionHeader, r.ClusterHeader, len(r.Clusters))
	}
	p := &floorProcessor{session: r.SessionHeader, clusters: r.Clusters}
	// gRPC only reads a reply it sends, so each is shared by the requests
	// routed to its cluster.
	for _, c := range r.Clusters {
		p.replies = append(p.replies, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
				HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
					Header: &corev3.HeaderValue{Key: r.ClusterHeader, RawValue: []byte(c)},
				}}},
				ClearRouteCache: true,
			}},
		}})
	}
	return p, nil
}

// pick is the index of the cluster for a session: the 32-bit FNV-1a hash
// of its value modulo the clusters (a request without the header hashes
// as empty).
func (p *floorProcessor) pick(session []byte) int {
	h := uint32(2166136261)
	for _, b := range session {
		h ^= uint32(b)
		h *= 16777619
	}
	return int(h % uint32(len(p.replies)))
}

// clusterFor is the cluster the floor routes session to.
func (p *floorProcessor) clusterFor(session string) string {
	return p.clusters[p.pick([]byte(session))]
}

// sessionOf is the value of the session header in hs, nil without it.
func (p *floorProcessor) sessionOf(hs *extprocv3.HttpHeaders) []byte {
	for _, h := range hs.GetHeaders().GetHeaders() {
		if h.GetKey() == p.session {
			if raw := h.GetRawValue(); len(raw) > 0 {
				return raw
			}
			return []byte(h.GetValue())
		}
	}
	return nil
}

func (p *floorProcessor) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	empty := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
	for {
		req, err := s.Recv()
		if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		var reply *extprocv3.ProcessingResponse
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			reply = p.replies[p.pick(p.sessionOf(r.RequestHeaders))]
			p.requests.Add(1)
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			reply = empty
		default:
			return status.Errorf(codes.Unimplemented, "ext_proc floor: %T is not answered", req.GetRequest())
		}
		if err := s.Send(reply); err != nil {
			return err
		}
	}
}

// floorServer is a running ext_proc floor on loopback.
type floorServer struct {
	addr string
	gs   *grpc.Server
	done chan error
	p    *floorProcessor
}

func startFloor(r floorRoutes) (*floorServer, error) {
	p, err := newFloorProcessor(r)
	if err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("ext_proc floor: %w", err)
	}
	f := &floorServer{addr: lis.Addr().String(), gs: grpc.NewServer(), done: make(chan error, 1), p: p}
	extprocv3.RegisterExternalProcessorServer(f.gs, p)
	go func() { f.done <- f.gs.Serve(lis) }()
	return f, nil
}

// stop ends the server and its streams; Serve's own error, once stopped,
// says nothing.
func (f *floorServer) stop() {
	f.gs.Stop()
	_ = <-f.done
}
