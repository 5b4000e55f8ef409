package reload

import (
	"crypto/tls"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/tetherproxy/tether/config"
)

// reloadCheck is how often a handshake may look at the certificate files.
const reloadCheck = time.Second

// GRPCCredentials returns the server options that put the ext_proc and xDS
// gRPC servers behind [tls]. It returns none when tether serves plaintext.
// The files are read and checked now. An expired certificate, a key that
// is not the certificate's or a client CA file without a CA fails the
// start.
func GRPCCredentials(cfg config.TLS, log zerolog.Logger, reg prometheus.Registerer) ([]grpc.ServerOption, error) {
	if !cfg.Enabled() {
		return nil, nil
	}
	src, err := newCertSource(cfg, log, time.Now)
	if err != nil {
		return nil, fmt.Errorf("tls: %w", err)
	}
	reg.MustRegister(src.reloads, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tether_tls_certificate_expiry_timestamp_seconds",
		Help: "When the certificate the gRPC servers present expires (Unix time).",
	}, src.expiry))
	leaf := src.files.Certificate.Leaf
	log.Info().Str("cert", cfg.CertFile).Str("subject", leaf.Subject.String()).Time("not_after", leaf.NotAfter).
		Str("client_auth", cfg.ClientAuth().String()).Str("min_version", cfg.MinVersion).Msg("ext_proc and xDS servers speak TLS")
	return []grpc.ServerOption{grpc.Creds(credentials.NewTLS(src.serverConfig()))}, nil
}

// certSource hands every handshake the TLS configuration built from the
// files in force. At most once per check interval, a handshake looks at
// the files' size and modification time. When they changed, the files are
// read again. So a renewed certificate or client CA is served without a
// restart. Files that fail the checks, say mid-rotation or expired, are
// logged and the previous configuration stays.
type certSource struct {
	cfg      config.TLS
	log      zerolog.Logger
	now      func() time.Time
	interval time.Duration
	reloads  *prometheus.CounterVec

	mu      sync.Mutex
	checked time.Time
	stamps  []fileStamp
	files   *config.TLSFiles
	current *tls.Config
}

type fileStamp struct {
	size int64
	mod  time.Time
}

func newCertSource(cfg config.TLS, log zerolog.Logger, now func() time.Time) (*certSource, error) {
	s := &certSource{
		cfg: cfg, log: log, now: now, interval: reloadCheck,
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tether_tls_reloads_total",
			Help: "Certificate file changes seen by the gRPC servers, by result (applied, refused).",
		}, []string{"result"}),
	}
	s.stamps = s.stat()
	files, err := cfg.ReadFiles(now())
	if err != nil {
		return nil, err
	}
	s.install(files)
	s.checked = now()
	return s, nil
}

// serverConfig is what the gRPC credentials wrap. Every handshake asks the
// source for the configuration in force.
func (s *certSource) serverConfig() *tls.Config {
	return &tls.Config{
		MinVersion:         s.cfg.MinTLSVersion(),
		NextProtos:         []string{"h2"},
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return s.config(), nil },
	}
}

func (s *certSource) paths() []string {
	p := []string{s.cfg.CertFile, s.cfg.KeyFile}
	if s.cfg.ClientCAFile != "" {
		p = append(p, s.cfg.ClientCAFile)
	}
	return p
}

func (s *certSource) stat() []fileStamp {
	out := make([]fileStamp, 0, 3)
	for _, p := range s.paths() {
		var st fileStamp
		if fi, err := os.Stat(p); err == nil {
			st = fileStamp{size: fi.Size(), mod: fi.ModTime()}
		}
		out = append(out, st)
	}
	return out
}

func (s *certSource) install(f *config.TLSFiles) {
	s.files = f
	s.current = &tls.Config{
		Certificates: []tls.Certificate{f.Certificate},
		ClientAuth:   s.cfg.ClientAuth(),
		ClientCAs:    f.ClientCAs,
		MinVersion:   s.cfg.MinTLSVersion(),
		NextProtos:   []string{"h2"},
	}
}

// config returns the configuration in force, reloading the files first
// when they changed.
func (s *certSource) config() *tls.Config {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if now.Sub(s.checked) < s.interval {
		return s.current
	}
	s.checked = now
	stamps := s.stat()
	changed := false
	for i := range stamps {
		changed = changed || stamps[i] != s.stamps[i]
	}
	if !changed {
		return s.current
	}
	// Recorded even when the reload fails. The next attempt then waits for
	// the next change, the other half of a rotation, not the next
	// handshake.
	s.stamps = stamps
	f, err := s.cfg.ReadFiles(now)
	if err != nil {
		s.reloads.WithLabelValues("refused").Inc()
		s.log.Error().Err(err).Time("not_after", s.files.Certificate.Leaf.NotAfter).
			Msg("TLS files changed but cannot be used; serving the previous certificate")
		return s.current
	}
	s.install(f)
	s.reloads.WithLabelValues("applied").Inc()
	s.log.Info().Str("cert", s.cfg.CertFile).Str("subject", f.Certificate.Leaf.Subject.String()).
		Time("not_after", f.Certificate.Leaf.NotAfter).Msg("TLS certificate reloaded")
	return s.current
}

// expiry is the expiry gauge: when the certificate in force expires. It
// reads after the rate-limited look at the files a handshake makes.
// Without it, a renewed file would show only after the next handshake. A
// tether no Envoy connects to would report the old date until it expired.
func (s *certSource) expiry() float64 {
	s.config()
	return float64(s.notAfter().Unix())
}

func (s *certSource) notAfter() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.files.Certificate.Leaf.NotAfter
}
