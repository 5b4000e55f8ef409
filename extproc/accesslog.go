package extproc

import (
	"errors"
	"io"
	"net"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	accesslogdatav3 "github.com/envoyproxy/go-control-plane/envoy/data/accesslog/v3"
	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/service/accesslog/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// AccessLog receives Envoy's gRPC access log (envoy.access_loggers.http_grpc).
// It redeems every entry that carries a ticket. How a request ended thus
// arrives after the request, off its path. Each Envoy worker keeps one
// stream open and sends entries in batches. Entries are handled on the
// stream's goroutine: a flood slows Envoy's log stream, and never grows a
// queue here. Envoy buffers what waits, then drops it and counts it.
type AccessLog struct {
	accesslogv3.UnimplementedAccessLogServiceServer
	s *Server
}

// AccessLog returns the access-log receiver. It finishes decisions with
// s's decider and recorder. s must have Options.Tickets.
func (s *Server) AccessLog() *AccessLog { return &AccessLog{s: s} }

// StreamAccessLogs serves one Envoy worker's log stream.
func (a *AccessLog) StreamAccessLogs(stream accesslogv3.AccessLogService_StreamAccessLogsServer) error {
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return stream.SendAndClose(&accesslogv3.StreamAccessLogsResponse{})
		}
		if status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		for _, e := range msg.GetHttpLogs().GetLogEntry() {
			a.s.redeem(observationOf(e))
		}
	}
}

// observationOf reads an access-log entry. Envoy writes one for every
// request, at its end. It holds the response code, 0 when none was sent.
// Its response flags say why Envoy answered itself. It names the host of
// the last attempt, and keeps the instances' report headers.
func observationOf(e *accesslogdatav3.HTTPAccessLogEntry) observation {
	c := e.GetCommonProperties()
	code := int(e.GetResponse().GetResponseCode().GetValue())
	f := c.GetResponseFlags()
	// Envoy picked no host: no such cluster or route, or no healthy host.
	noHost := f.GetNoHealthyUpstream() || f.GetNoClusterFound() || f.GetNoRouteFound()
	addr := socketAddr(c.GetUpstreamRemoteAddress())
	o := observation{
		ticket:     ticketOf(c.GetMetadata().GetFilterMetadata()[MetadataNamespace]),
		status:     code,
		none:       code == 0,
		upstream:   upstream{attrs: addr != "" || noHost, address: addr},
		overloaded: f.GetUpstreamOverflow(),
		headers:    mapHeaders(e.GetResponse().GetResponseHeaders()),
	}
	if d := c.GetTimeToFirstUpstreamRxByte(); d != nil {
		o.elapsed = max(d.AsDuration(), time.Nanosecond)
	}
	return o
}

func socketAddr(a *corev3.Address) string {
	sa := a.GetSocketAddress()
	if sa == nil || sa.GetAddress() == "" {
		return ""
	}
	return net.JoinHostPort(sa.GetAddress(), strconv.FormatUint(uint64(sa.GetPortValue()), 10))
}

// mapHeaders are the access log's response headers (lower-case names).
type mapHeaders map[string]string

func (m mapHeaders) Get(name string) string { return m[name] }
