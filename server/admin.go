package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/tetherproxy/tether/config"
)

// routes adds the fleet API to the admin server:
//
//	GET    /v1/instances          the instances in force
//	POST   /v1/instances          add an instance, or replace the one of that name
//	DELETE /v1/instances/{name}   remove an instance
//	GET    /v1/xds                the published version and every connected Envoy
//
// Changes go through the same path as a config file change and last until
// the file changes next (the file stays the source of truth on restart).
func (r *runtime) routes(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/instances", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, r.current().Instances)
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
		next := r.current()
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
		r.respond(w, req, next)
	})
	mux.HandleFunc("DELETE /v1/instances/{name}", func(w http.ResponseWriter, req *http.Request) {
		name := req.PathValue("name")
		next := r.current()
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
		r.respond(w, req, next)
	})
	mux.HandleFunc("GET /v1/xds", func(w http.ResponseWriter, _ *http.Request) {
		if r.ads == nil {
			writeJSON(w, http.StatusNotFound, apiError{"the ADS server is off (xds.addr is empty)"})
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"version": r.ads.Version(), "nodes": r.ads.Nodes()})
	})
}

func (r *runtime) respond(w http.ResponseWriter, req *http.Request, next config.Config) {
	version, err := r.apply(req.Context(), next, "admin")
	switch {
	case errors.Is(err, ErrInvalid):
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
