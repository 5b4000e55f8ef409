package xds

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sort"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// snapshotKey: every Envoy gets the same snapshot, whatever its node id.
const snapshotKey = "tether"

type oneSnapshot struct{}

func (oneSnapshot) ID(*corev3.Node) string { return snapshotKey }

// Server is the ADS server: a go-control-plane snapshot cache plus the
// bookkeeping of which Envoy acknowledged which version.
type Server struct {
	cache cachev3.SnapshotCache
	ads   serverv3.Server
	log   zerolog.Logger

	mu      sync.Mutex
	streams map[int64]*stream // open ADS streams
	changed chan struct{}     // closed and replaced on every ACK or stream change
	version string

	nacks     *prometheus.CounterVec
	connected prometheus.GaugeFunc
}

type stream struct {
	node     string
	cluster  string
	opened   time.Time
	types    map[string]bool   // type URLs this stream subscribed to
	acked    map[string]string // type URL → last acknowledged version
	lastNACK *NACK
}

// NACK is Envoy's refusal of a version.
type NACK struct {
	TypeURL string    `json:"type_url"`
	Version string    `json:"version"` // the version refused
	Detail  string    `json:"detail"`
	At      time.Time `json:"at"`
}

// NodeStatus is what the admin API shows per connected Envoy.
type NodeStatus struct {
	ID        string            `json:"id"`
	Cluster   string            `json:"cluster"`
	Connected time.Time         `json:"connected"`
	Acked     map[string]string `json:"acked"` // type URL → version
	LastNACK  *NACK             `json:"last_nack,omitempty"`
}

// NewServer returns an ADS server; ctx bounds its streams.
func NewServer(ctx context.Context, log zerolog.Logger, reg prometheus.Registerer) *Server {
	s := &Server{
		cache:   cachev3.NewSnapshotCache(true, oneSnapshot{}, logAdapter{log}),
		log:     log,
		streams: map[int64]*stream{},
		changed: make(chan struct{}),
		nacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_xds_nacks_total",
			Help: "Configurations an Envoy refused, by resource type.",
		}, []string{"type"}),
	}
	s.connected = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tether_xds_connected_streams",
		Help: "Open ADS streams from Envoy.",
	}, func() float64 { s.mu.Lock(); defer s.mu.Unlock(); return float64(len(s.streams)) })
	reg.MustRegister(s.nacks, s.connected)
	s.ads = serverv3.NewServer(ctx, s.cache, serverv3.CallbackFuncs{
		StreamOpenFunc:    s.onOpen,
		StreamClosedFunc:  s.onClosed,
		StreamRequestFunc: s.onRequest,
	})
	return s
}

// Register adds the ADS service to a gRPC server.
func (s *Server) Register(g *grpc.Server) {
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(g, s.ads)
}

// Publish makes r the configuration every Envoy receives and returns its
// version: a hash of the resources, so replicas with the same
// configuration publish the same version.
func (s *Server) Publish(r *Resources) (string, error) {
	all := r.byType()
	version, err := hashResources(all)
	if err != nil {
		return "", err
	}
	snap, err := cachev3.NewSnapshot(version, all)
	if err != nil {
		return "", fmt.Errorf("xds snapshot: %w", err)
	}
	if err := snap.Consistent(); err != nil {
		return "", fmt.Errorf("xds snapshot: %w", err)
	}
	if err := s.cache.SetSnapshot(context.Background(), snapshotKey, snap); err != nil {
		return "", fmt.Errorf("xds snapshot: %w", err)
	}
	s.mu.Lock()
	s.version = version
	s.mu.Unlock()
	return version, nil
}

// Version is the version last published.
func (s *Server) Version() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.version
}

// WaitAcked returns when every connected Envoy has acknowledged version for
// every type it subscribed to, or ctx ends. With no Envoy connected it
// returns at once.
func (s *Server) WaitAcked(ctx context.Context, version string) error {
	for {
		s.mu.Lock()
		done, changed := s.allAckedLocked(version), s.changed
		s.mu.Unlock()
		if done {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("xds: waiting for Envoy to acknowledge %s: %w", version, ctx.Err())
		}
	}
}

func (s *Server) allAckedLocked(version string) bool {
	for _, st := range s.streams {
		for t := range st.types {
			if st.acked[t] != version {
				return false
			}
		}
	}
	return true
}

// Nodes lists the connected Envoys, by node id.
func (s *Server) Nodes() []NodeStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]NodeStatus, 0, len(s.streams))
	for _, st := range s.streams {
		acked := make(map[string]string, len(st.acked))
		for t, v := range st.acked {
			acked[t] = v
		}
		out = append(out, NodeStatus{ID: st.node, Cluster: st.cluster, Connected: st.opened, Acked: acked, LastNACK: st.lastNACK})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

func (s *Server) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *Server) onOpen(_ context.Context, id int64, _ string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.streams[id] = &stream{opened: time.Now(), types: map[string]bool{}, acked: map[string]string{}}
	s.notifyLocked()
	return nil
}

func (s *Server) onClosed(id int64, node *corev3.Node) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.streams, id)
	s.notifyLocked()
	s.log.Info().Str("node", node.GetId()).Msg("envoy disconnected from ADS")
}

// onRequest sees every DiscoveryRequest. The first on a stream names the
// node. One with a response nonce acknowledges the version it answers. With
// error_detail, it refuses that version instead.
func (s *Server) onRequest(id int64, req *discoveryv3.DiscoveryRequest) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	st, ok := s.streams[id]
	if !ok {
		return nil
	}
	if n := req.GetNode(); n != nil && st.node == "" {
		st.node, st.cluster = n.GetId(), n.GetCluster()
		s.log.Info().Str("node", st.node).Msg("envoy connected to ADS")
	}
	st.types[req.GetTypeUrl()] = true
	switch {
	case req.GetErrorDetail() != nil:
		nack := &NACK{TypeURL: req.GetTypeUrl(), Version: s.version, Detail: req.GetErrorDetail().GetMessage(), At: time.Now()}
		st.lastNACK = nack
		s.nacks.WithLabelValues(shortType(req.GetTypeUrl())).Inc()
		s.log.Error().Str("node", st.node).Str("type", shortType(req.GetTypeUrl())).Str("refused", s.version).
			Str("kept", req.GetVersionInfo()).Str("detail", nack.Detail).Msg("envoy refused a configuration (NACK)")
	case req.GetResponseNonce() != "":
		st.acked[req.GetTypeUrl()] = req.GetVersionInfo()
	}
	s.notifyLocked()
	return nil
}

func shortType(url string) string {
	for i := len(url) - 1; i >= 0; i-- {
		if url[i] == '.' {
			return url[i+1:]
		}
	}
	return url
}

// hashResources is a stable hash of every resource, in type order.
func hashResources(all map[resource.Type][]types.Resource) (string, error) {
	h := sha256.New()
	typesSorted := make([]string, 0, len(all))
	for t := range all {
		typesSorted = append(typesSorted, t)
	}
	sort.Strings(typesSorted)
	opts := proto.MarshalOptions{Deterministic: true}
	for _, t := range typesSorted {
		h.Write([]byte(t))
		for _, r := range all[t] {
			b, err := opts.Marshal(r)
			if err != nil {
				return "", fmt.Errorf("xds version: %w", err)
			}
			h.Write(b)
		}
	}
	return hex.EncodeToString(h.Sum(nil))[:12], nil
}

// logAdapter sends go-control-plane's logging to zerolog at debug level.
// Its info lines are per-request chatter.
type logAdapter struct{ l zerolog.Logger }

func (a logAdapter) Debugf(f string, args ...any) { a.l.Debug().Msgf(f, args...) }
func (a logAdapter) Infof(f string, args ...any)  { a.l.Debug().Msgf(f, args...) }
func (a logAdapter) Warnf(f string, args ...any)  { a.l.Warn().Msgf(f, args...) }
func (a logAdapter) Errorf(f string, args ...any) { a.l.Error().Msgf(f, args...) }

// Version is the version Publish would give r.
func Version(r *Resources) (string, error) { return hashResources(r.byType()) }

func (r *Resources) byType() map[resource.Type][]types.Resource {
	all := map[resource.Type][]types.Resource{
		resource.ListenerType: {r.Listener},
		resource.RouteType:    {r.Routes},
	}
	for _, c := range r.Clusters {
		all[resource.ClusterType] = append(all[resource.ClusterType], c)
	}
	for _, e := range r.Endpoints {
		all[resource.EndpointType] = append(all[resource.EndpointType], e)
	}
	return all
}
