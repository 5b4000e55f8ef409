package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
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
// writes nothing for it. It runs as a process of its own, as tether does
// (`tether-lab bench floor`, ServeFloor), so that it shares neither a Go
// runtime nor a scheduler with the bench's load. Its overhead row, with
// Envoy's filter configured exactly as for tether, is what routing
// through a minimal Go ext_proc server costs on the machine: what tether
// adds beyond it is its own work.

// FloorRoutes is what the floor routes by: the session header it hashes,
// the header Envoy routes on and the clusters to choose from.
type FloorRoutes struct {
	SessionHeader, ClusterHeader string
	Clusters                     []string
}

// check refuses routes the floor cannot route by.
func (r FloorRoutes) check() error {
	if len(r.Clusters) == 0 || r.SessionHeader == "" || r.ClusterHeader == "" {
		return fmt.Errorf("ext_proc floor: session header %q, cluster header %q, %d clusters: want both headers and a cluster",
			r.SessionHeader, r.ClusterHeader, len(r.Clusters))
	}
	return nil
}

// pick is the index of the cluster for a session: the 32-bit FNV-1a hash
// of its value modulo the clusters (a request without the header hashes
// as empty).
func (r FloorRoutes) pick(session []byte) int {
	h := uint32(2166136261)
	for _, b := range session {
		h ^= uint32(b)
		h *= 16777619
	}
	return int(h % uint32(len(r.Clusters)))
}

// clusterFor is the cluster the floor routes session to.
func (r FloorRoutes) clusterFor(session string) string {
	return r.Clusters[r.pick([]byte(session))]
}

// floorProcessor answers request headers with the reply of the cluster
// the session's hash picks, response headers (which tether's filter sends
// only with outcomes inline) with an empty reply, and counts the request
// headers it answered: the proof that Envoy called it rather than failing
// open.
type floorProcessor struct {
	extprocv3.UnimplementedExternalProcessorServer
	routes   FloorRoutes
	replies  []*extprocv3.ProcessingResponse // one per cluster, alike
	requests atomic.Int64
}

func newFloorProcessor(r FloorRoutes) (*floorProcessor, error) {
	if err := r.check(); err != nil {
		return nil, err
	}
	p := &floorProcessor{routes: r}
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

// sessionOf is the value of the session header in hs, nil without it.
func (p *floorProcessor) sessionOf(hs *extprocv3.HttpHeaders) []byte {
	for _, h := range hs.GetHeaders().GetHeaders() {
		if h.GetKey() == p.routes.SessionHeader {
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
			reply = p.replies[p.routes.pick(p.sessionOf(r.RequestHeaders))]
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

// FloorReady is what a floor that is serving tells its caller: its
// ext_proc gRPC address and its admin address (host:port each), where
// GET /requests answers with FloorCount.
type FloorReady struct{ Extproc, Admin string }

// FloorCount is the floor's admin answer: the request headers it has
// answered, the proof that Envoy called it rather than failing open.
type FloorCount struct {
	Requests int64 `json:"requests"`
}

// ServeFloor serves the floor for r, its ext_proc gRPC server on extproc
// and its admin endpoint on admin (loopback host:port each, port 0 for
// any), calls ready once both listen, and stops them, streams and all,
// when ctx ends.
func ServeFloor(ctx context.Context, r FloorRoutes, extproc, admin string, ready func(FloorReady)) error {
	p, err := newFloorProcessor(r)
	if err != nil {
		return err
	}
	glis, err := listenLoopback(extproc)
	if err != nil {
		return fmt.Errorf("ext_proc floor: %w", err)
	}
	alis, err := listenLoopback(admin)
	if err != nil {
		_ = glis.Close()
		return fmt.Errorf("ext_proc floor admin: %w", err)
	}
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, p)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /requests", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(FloorCount{Requests: p.requests.Load()})
	})
	hs := &http.Server{Handler: mux}
	done := make(chan error, 2)
	go func() { done <- gs.Serve(glis) }()
	go func() { done <- hs.Serve(alis) }()
	ready(FloorReady{Extproc: glis.Addr().String(), Admin: alis.Addr().String()})
	select {
	case <-ctx.Done():
		err = nil
	case err = <-done: // a server that stops on its own
		err = fmt.Errorf("ext_proc floor: %w", err)
	}
	// Envoy keeps its streams open: they end with the server, not before.
	gs.Stop()
	_ = hs.Close()
	return err
}

// listenLoopback listens on addr, which must be on loopback: the floor
// answers anyone who reaches it.
func listenLoopback(addr string) (net.Listener, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return nil, fmt.Errorf("%s: want a loopback address", addr)
	}
	return net.Listen("tcp", addr)
}
