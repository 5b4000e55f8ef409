package bench

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The ext_proc floor is the least an ext_proc server can do: it answers
// every phase Envoy sends with an empty reply (continue), reads nothing
// and keeps nothing, on gRPC's default server. Its overhead row, with
// Envoy's filter configured exactly as for tether, is what a minimal Go
// ext_proc server adds on the machine: what tether adds beyond it is its
// own work.

// floorProcessor answers each message with the empty reply of its phase,
// and counts the request headers it answered: the proof that Envoy called
// it rather than failing open.
type floorProcessor struct {
	extprocv3.UnimplementedExternalProcessorServer
	requests atomic.Int64
}

func (p *floorProcessor) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	empty := &extprocv3.HeadersResponse{}
	for {
		req, err := s.Recv()
		if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		var reply extprocv3.ProcessingResponse
		switch req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			reply.Response = &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: empty}
			p.requests.Add(1)
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			reply.Response = &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: empty}
		default:
			return status.Errorf(codes.Unimplemented, "ext_proc floor: %T is not answered", req.GetRequest())
		}
		if err := s.Send(&reply); err != nil {
			return err
		}
	}
}

// floorServer is a running ext_proc floor on loopback.
type floorServer struct {
	addr string
	gs   *grpc.Server
	done chan error
	p    floorProcessor
}

func startFloor() (*floorServer, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("ext_proc floor: %w", err)
	}
	f := &floorServer{addr: lis.Addr().String(), gs: grpc.NewServer(), done: make(chan error, 1)}
	extprocv3.RegisterExternalProcessorServer(f.gs, &f.p)
	go func() { f.done <- f.gs.Serve(lis) }()
	return f, nil
}

// stop ends the server and its streams; Serve's own error, once stopped,
// says nothing.
func (f *floorServer) stop() {
	f.gs.Stop()
	_ = <-f.done
}
