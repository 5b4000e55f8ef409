package server

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"

	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/reload"
)

// adminAuth guards the admin API with tok, the bearer token of cfg
// (server.admin_token_file or $server.admin_token_env): every endpoint but
// /healthz and /readyz, which probes call without credentials, answers 401
// to a request without it. Without a token the API is open; on an address
// beyond loopback that is logged as a warning (the shipped Kubernetes
// manifests listen on the pod address for the kubelet's probes and rely on
// the Service and a NetworkPolicy). The token is never logged.
func adminAuth(tok string, cfg config.Server, addr net.Addr, log zerolog.Logger, h http.Handler) http.Handler {
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

// routes adds the fleet API to the admin server:
//
//	GET    /v1/instances          the instances in force
//	POST   /v1/instances          add an instance, or replace the one of that name
//	DELETE /v1/instances/{name}   remove an instance
//	GET    /v1/xds                the published version and every connected Envoy
//
// Changes go through the same path as a config file change and last until
// the file changes next (the file stays the source of truth on restart).
func fleetRoutes(mux *http.ServeMux, r *reload.Runtime) {
	mux.HandleFunc("GET /v1/instances", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, r.Current().Instances)
	})
	mux.HandleFunc("POST /v1/instances", func(w http.ResponseWriter, req *http.Request) {
		var in config.Instance
		dec := json.NewDecoder(http.MaxBytesReader(w, req.Body, 64<<10))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&in); err != nil {
			writeJSON(w, http.StatusBadRequest, apiError{fmt.Sprintf("instance: %v", err)})
			return
		}
		if in.Version == "" {
			in.Version = config.DefaultVersion
		}
		if in.Weight == 0 {
			in.Weight = 1
		}
		next := r.Current()
		next.Instances = append([]config.Instance(nil), next.Instances...)
		replaced := false
		for i := range next.Instances {
			if next.Instances[i].Name == in.Name {
				next.Instances[i], replaced = in, true
			}
		}
		if !replaced {
			next.Instances = append(next.Instances, in)
		}
		respond(w, req, r, next)
	})
	mux.HandleFunc("DELETE /v1/instances/{name}", func(w http.ResponseWriter, req *http.Request) {
		name := req.PathValue("name")
		next := r.Current()
		kept := make([]config.Instance, 0, len(next.Instances))
		for _, in := range next.Instances {
			if in.Name != name {
				kept = append(kept, in)
			}
		}
		if len(kept) == len(next.Instances) {
			writeJSON(w, http.StatusNotFound, apiError{fmt.Sprintf("no instance %q", name)})
			return
		}
		next.Instances = kept
		respond(w, req, r, next)
	})
	mux.HandleFunc("GET /v1/xds", func(w http.ResponseWriter, _ *http.Request) {
		ads := r.ADS()
		if ads == nil {
			writeJSON(w, http.StatusNotFound, apiError{"the ADS server is off (xds.addr is empty)"})
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"version": ads.Version(), "nodes": ads.Nodes()})
	})
}

func respond(w http.ResponseWriter, req *http.Request, r *reload.Runtime, next config.Config) {
	version, err := r.Apply(req.Context(), next, "admin")
	switch {
	case errors.Is(err, reload.ErrInvalid):
		writeJSON(w, http.StatusBadRequest, apiError{err.Error()})
	case err != nil:
		writeJSON(w, http.StatusInternalServerError, apiError{err.Error()})
	default:
		writeJSON(w, http.StatusOK, map[string]any{"version": version, "instances": next.Instances})
	}
}

type apiError struct {
	Error string `json:"error"`
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}
