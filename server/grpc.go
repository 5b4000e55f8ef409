package server

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/keepalive"

	"github.com/tetherproxy/tether/config"
)

// The ext_proc server's transport, for what Envoy does to it. Envoy opens
// one HTTP/2 connection per worker, and one for its health checks. Each
// carries a new stream of a few small messages per HTTP request, for as
// long as Envoy runs.
const (
	// Flow control windows, fixed. A message is under a kilobyte, except
	// a request body tether asks for ([content]). So a stream seldom comes
	// near 64 KB, and 1 MB per connection is room for the streams of a
	// burst. A body goes through in a few window updates. Fixed windows
	// also turn off gRPC's bandwidth-delay estimation, which pings the
	// peer while data keeps arriving. On a connection that is never
	// quiet, that is a ping and its acknowledgement for nothing
	// (BENCHMARKS.md).
	streamWindow = 64 << 10
	connWindow   = 1 << 20

	// Envoy may be set to ping its upstreams: the ext_proc cluster's
	// connection_keepalive. gRPC's default policy closes a connection
	// that pings more often than every 5 minutes, or at all without a
	// stream, with GOAWAY "too_many_pings". Envoy would reconnect, and
	// its requests in flight would fail. So tether accepts a ping every
	// 5 s, idle or not.
	pingMinTime = 5 * time.Second

	// tether's own pings find a dead peer (an Envoy gone without a FIN)
	// after a minute of silence, and give it 20 s to answer.
	idlePing    = time.Minute
	pingTimeout = 20 * time.Second

	// maxMessage is the largest message tether reads: a request body at
	// content.max_body_bytes' bound, with room for the message around it.
	// gRPC's default is 4 MiB.
	maxMessage = config.MaxContentBodyBytes + 64<<10
)

// extprocServerOptions are the ext_proc gRPC server's options, apart from
// its credentials. Write buffers are shared and read buffers pooled by
// default in gRPC since 1.66; the pool is tether's (codec.go), for the
// frames read and the messages decoded and encoded.
func extprocServerOptions() []grpc.ServerOption {
	pool := bufferPool()
	return []grpc.ServerOption{
		experimental.BufferPool(pool),
		grpc.ForceServerCodecV2(codec{pool}),
		grpc.StaticStreamWindowSize(streamWindow),
		grpc.StaticConnWindowSize(connWindow),
		grpc.MaxRecvMsgSize(maxMessage),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: pingMinTime, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: idlePing, Timeout: pingTimeout}),
	}
}
