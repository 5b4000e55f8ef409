package admin

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/reload"
)

func TestNewClient(t *testing.T) {
	for _, tt := range []struct{ in, base string }{
		{"127.0.0.1:8090", "http://127.0.0.1:8090"},
		{"http://127.0.0.1:8090/", "http://127.0.0.1:8090"},
		{"https://tether.internal:8443/admin", "https://tether.internal:8443/admin"},
		{"ftp://x", ""},
		{"http://", ""},
		{"http://h:1/?q=1", ""},
	} {
		c, err := NewClient(tt.in, "")
		switch {
		case tt.base == "" && err == nil:
			t.Errorf("NewClient(%q) = %q, want an error", tt.in, c.base)
		case tt.base != "" && (err != nil || c.base != tt.base):
			t.Errorf("NewClient(%q) = %v, %v; want %q", tt.in, c, err, tt.base)
		}
	}
}

// TestClientFleet drives the fleet API through the typed client, over the
// handler Run serves and a live-reload runtime.
func TestClientFleet(t *testing.T) {
	ctx := t.Context()
	rt := reload.New("127.0.0.1:50051", nil, zerolog.Nop(), prometheus.NewRegistry())
	cfg := config.Default()
	cfg.Instances = []config.Instance{{Name: "a", Address: "127.0.0.1:1", Version: "v1", Weight: 1}}
	if _, err := rt.Apply(ctx, cfg, "start"); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(NewHandler(Config{
		Metrics: prometheus.NewRegistry(), Ready: http.NotFoundHandler(), Runtime: rt,
		Sessions: NewSessionOps(SessionOpsConfig{Logger: zerolog.Nop()}),
	}))
	defer srv.Close()
	c, err := NewClient(srv.URL, "")
	if err != nil {
		t.Fatal(err)
	}
	names := func(in []config.Instance) []string {
		var out []string
		for _, i := range in {
			out = append(out, i.Name)
		}
		return out
	}
	if in, err := c.Instances(ctx); err != nil || !slices.Equal(names(in), []string{"a"}) {
		t.Fatalf("instances %v, %v", names(in), err)
	}
	fc, err := c.PutInstance(ctx, config.Instance{Name: "b", Address: "127.0.0.1:2"})
	if err != nil || !slices.Equal(names(fc.Instances), []string{"a", "b"}) || fc.Version == "" {
		t.Fatalf("add: %+v, %v", fc, err)
	}
	if n := len(rt.Fleet().All()); n != 2 {
		t.Errorf("the fleet has %d instances after the add, want 2", n)
	}
	var ae *Error
	if _, err := c.PutInstance(ctx, config.Instance{Name: "Not A Name", Address: "127.0.0.1:3"}); !errors.As(err, &ae) || ae.Status != http.StatusBadRequest || !strings.Contains(ae.Message, "instances") {
		t.Errorf("an invalid instance: %v, want a 400 naming the key", err)
	}
	if _, err := c.RemoveInstance(ctx, "zzz"); !errors.As(err, &ae) || ae.Status != http.StatusNotFound {
		t.Errorf("removing an unknown instance: %v, want a 404", err)
	}
	if fc, err := c.RemoveInstance(ctx, "a"); err != nil || !slices.Equal(names(fc.Instances), []string{"b"}) {
		t.Errorf("remove: %+v, %v", fc, err)
	}
	if _, err := c.XDS(ctx); !errors.As(err, &ae) || ae.Status != http.StatusNotFound || !strings.Contains(ae.Message, "ADS server is off") {
		t.Errorf("/v1/xds without an ADS server: %v, want a 404 saying so", err)
	}
}

// The fleet endpoints, for the test; tether's CLI does not call them.

// Instances is GET /v1/instances.
func (c *Client) Instances(ctx context.Context) ([]config.Instance, error) {
	var in []config.Instance
	return in, c.do(ctx, http.MethodGet, "/v1/instances", nil, &in)
}

// PutInstance is POST /v1/instances: add in, or replace the instance of
// its name.
func (c *Client) PutInstance(ctx context.Context, in config.Instance) (FleetChange, error) {
	var fc FleetChange
	return fc, c.do(ctx, http.MethodPost, "/v1/instances", in, &fc)
}

// RemoveInstance is DELETE /v1/instances/{name}.
func (c *Client) RemoveInstance(ctx context.Context, name string) (FleetChange, error) {
	var fc FleetChange
	return fc, c.do(ctx, http.MethodDelete, "/v1/instances/"+url.PathEscape(name), nil, &fc)
}

// XDS is GET /v1/xds.
func (c *Client) XDS(ctx context.Context) (XDSStatus, error) {
	var st XDSStatus
	return st, c.do(ctx, http.MethodGet, "/v1/xds", nil, &st)
}
