package server

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/xds"
)

func fleetConfig(names ...string) config.Config {
	c := testConfig()
	c.Instances = nil
	for i, n := range names {
		c.Instances = append(c.Instances, config.Instance{Name: n, Address: fmt.Sprintf("127.0.0.1:%d", 1000+i), Version: "v1", Weight: 1})
	}
	return c
}

func TestApply(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg := prometheus.NewRegistry()
	ads := xds.NewServer(ctx, zerolog.Nop(), reg)
	rt := newRuntime([]string{"127.0.0.1:50051"}, ads, zerolog.Nop(), reg)

	v1, err := rt.apply(ctx, fleetConfig("a", "b"), "start")
	if err != nil || v1 == "" || ads.Version() != v1 {
		t.Fatalf("first apply: %q, %v (published %q)", v1, err, ads.Version())
	}
	if got := len(rt.fleet.All()); got != 2 {
		t.Fatalf("fleet has %d instances", got)
	}
	// Same configuration: nothing published, counted as unchanged.
	if v, err := rt.apply(ctx, fleetConfig("a", "b"), "file"); err != nil || v != v1 {
		t.Fatalf("unchanged apply: %q, %v", v, err)
	}
	if n := testutil.ToFloat64(rt.reloads.WithLabelValues("file", "unchanged")); n != 1 {
		t.Fatalf("unchanged count %v", n)
	}
	// A weight change moves no Envoy resource but does change the fleet.
	w := fleetConfig("a", "b")
	w.Instances[0].Weight = 3
	if v, err := rt.apply(ctx, w, "file"); err != nil || v != v1 {
		t.Fatalf("weight change: %q, %v", v, err)
	}
	if in, _ := rt.fleet.Lookup("a"); in.Weight != 3 {
		t.Fatalf("weight not applied: %+v", in)
	}
	// Invalid: refused, counted, nothing changes.
	bad := fleetConfig("a", "a")
	if _, err := rt.apply(ctx, bad, "file"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("duplicate names: err %v", err)
	}
	none := fleetConfig()
	if _, err := rt.apply(ctx, none, "admin"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("no instances: err %v", err)
	}
	if n := testutil.ToFloat64(rt.reloads.WithLabelValues("file", "invalid")) + testutil.ToFloat64(rt.reloads.WithLabelValues("admin", "invalid")); n != 2 {
		t.Fatalf("invalid count %v", n)
	}
	if ads.Version() != v1 || len(rt.fleet.All()) != 2 {
		t.Fatal("a refused configuration changed the state")
	}
	// A new instance: new version, fleet follows.
	v2, err := rt.apply(ctx, fleetConfig("a", "b", "c"), "admin")
	if err != nil || v2 == v1 || len(rt.fleet.All()) != 3 {
		t.Fatalf("add: %q, %v, %d instances", v2, err, len(rt.fleet.All()))
	}
}
