package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/reload"
	"github.com/tetherproxy/tether/xds"
)

// Runtime is the configuration in force (reload.Runtime). The fleet API
// reads and changes it through Runtime, as a file change is applied.
type Runtime interface {
	Current() config.Config
	// Edit applies edit to the configuration in force, validates the
	// result and makes it the configuration in force. A result that does
	// not validate is refused with an error that wraps reload.ErrInvalid.
	Edit(ctx context.Context, source string, edit func(*config.Config)) (version string, next config.Config, err error)
}

// FleetChange answers POST /v1/instances and DELETE /v1/instances/{name}:
// the instances now in force and the version of Envoy's resources.
type FleetChange struct {
	Instances []config.Instance `json:"instances"`
	Version   string            `json:"version"`
}

// XDSStatus answers GET /v1/xds: the version published and every
// connected Envoy.
type XDSStatus struct {
	Nodes   []xds.NodeStatus `json:"nodes"`
	Version string           `json:"version"`
}

// fleetRoutes adds the fleet API to the admin server:
//
//	GET    /v1/instances          the instances in force
//	POST   /v1/instances          add an instance, or replace the one of that name
//	DELETE /v1/instances/{name}   remove an instance
//	GET    /v1/xds                the published version and every connected Envoy
//
// Changes go through the same path as a config file change. They last
// until the file changes next. The file stays the source of truth on
// restart.
func fleetRoutes(mux *http.ServeMux, r Runtime, ads *xds.Server) {
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
		respond(w, req, r, func(next *config.Config) {
			next.Instances = append([]config.Instance(nil), next.Instances...)
			for i := range next.Instances {
				if next.Instances[i].Name == in.Name {
					next.Instances[i] = in
					return
				}
			}
			next.Instances = append(next.Instances, in)
		})
	})
	mux.HandleFunc("DELETE /v1/instances/{name}", func(w http.ResponseWriter, req *http.Request) {
		name := req.PathValue("name")
		if !slices.ContainsFunc(r.Current().Instances, func(in config.Instance) bool { return in.Name == name }) {
			writeJSON(w, http.StatusNotFound, apiError{fmt.Sprintf("no instance %q", name)})
			return
		}
		respond(w, req, r, func(next *config.Config) {
			next.Instances = slices.DeleteFunc(slices.Clone(next.Instances), func(in config.Instance) bool { return in.Name == name })
		})
	})
	mux.HandleFunc("GET /v1/xds", func(w http.ResponseWriter, _ *http.Request) {
		if ads == nil {
			writeJSON(w, http.StatusNotFound, apiError{"the ADS server is off (xds.addr is empty)"})
			return
		}
		writeJSON(w, http.StatusOK, XDSStatus{Version: ads.Version(), Nodes: ads.Nodes()})
	})
}

func respond(w http.ResponseWriter, req *http.Request, r Runtime, edit func(*config.Config)) {
	version, next, err := r.Edit(req.Context(), "admin", edit)
	switch {
	case errors.Is(err, reload.ErrInvalid):
		writeJSON(w, http.StatusBadRequest, apiError{err.Error()})
	case err != nil:
		writeJSON(w, http.StatusInternalServerError, apiError{err.Error()})
	default:
		writeJSON(w, http.StatusOK, FleetChange{Version: version, Instances: next.Instances})
	}
}
