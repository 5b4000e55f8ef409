// Package admin is tether's admin HTTP API. It holds:
//   - the probes, /healthz and /readyz;
//   - /metrics;
//   - the fleet API, /v1/instances and /v1/xds;
//   - the session operations, /v1/sessions/...;
//   - the bearer-token guard in front of them;
//   - their JSON types;
//   - Client, the typed client `tether sessions` uses.
package admin

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"net"
	"net/http"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/xds"
)

// Config is what the admin API serves.
type Config struct {
	// Metrics is the registry /metrics serves.
	Metrics *prometheus.Registry
	// Ready answers /readyz (Readiness).
	Ready http.Handler
	// Runtime is the configuration in force. The fleet API reads and
	// changes it.
	Runtime Runtime
	// ADS is the ADS server /v1/xds shows. It is nil when the server is
	// off.
	ADS *xds.Server
	// Sessions are the session operations.
	Sessions *SessionOps
}

// NewHandler returns the admin API's routes, unguarded (see Guard).
func NewHandler(c Config) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.Handle("GET /readyz", c.Ready)
	mux.Handle("GET /metrics", promhttp.HandlerFor(c.Metrics, promhttp.HandlerOpts{Registry: c.Metrics}))
	fleetRoutes(mux, c.Runtime, c.ADS)
	c.Sessions.Routes(mux)
	return mux
}

// Guard guards the admin API with tok, the bearer token of cfg. The token
// comes from server.admin_token_file or $server.admin_token_env. Every
// endpoint answers 401 to a request without it, except /healthz and
// /readyz: probes call those without credentials.
//
// Without a token the API is open. On an address beyond loopback that is
// logged as a warning. The shipped Kubernetes manifests do listen on the
// pod address, for the kubelet's probes. They rely on the Service and a
// NetworkPolicy instead. The token is never logged.
func Guard(tok string, cfg config.Server, addr net.Addr, log zerolog.Logger, h http.Handler) http.Handler {
	if tok == "" {
		if ta, ok := addr.(*net.TCPAddr); ok && !ta.IP.IsLoopback() {
			log.Warn().Str("admin", addr.String()).Str("env", cfg.AdminTokenEnv).
				Msg("the admin API listens beyond loopback without a token: whoever reaches it can change the fleet and move or delete sessions; set the token or keep the port private")
		}
		return h
	}
	from := "$" + cfg.AdminTokenEnv
	if cfg.AdminTokenFile != "" {
		from = cfg.AdminTokenFile
	}
	log.Info().Str("token_from", from).Msg("the admin API requires a bearer token (except /healthz and /readyz)")
	// Comparing digests keeps the comparison constant-time whatever the
	// length of what the client sent.
	want := sha256.Sum256([]byte(tok))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/healthz" || r.URL.Path == "/readyz" {
			h.ServeHTTP(w, r)
			return
		}
		got, ok := bearer(r.Header.Get("Authorization"))
		sum := sha256.Sum256([]byte(got))
		if !ok || subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="tether admin"`)
			writeJSON(w, http.StatusUnauthorized, apiError{"this endpoint needs Authorization: Bearer <the admin token>"})
			return
		}
		h.ServeHTTP(w, r)
	})
}

// bearer returns the token of an "Authorization: Bearer <token>" value.
func bearer(v string) (string, bool) {
	scheme, tok, ok := strings.Cut(v, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	tok = strings.TrimSpace(tok)
	return tok, tok != ""
}

// apiError is every refusal's body.
type apiError struct {
	Error string `json:"error"`
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}
