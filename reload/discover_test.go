package reload

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
)

// TestDiscoverRefusedKeepsPrevious: instances found that do not validate
// are refused and counted; the group's previous instances stay, for this
// change and for the next file change.
func TestDiscoverRefusedKeepsPrevious(t *testing.T) {
	ctx := context.Background()
	cfg := fleetConfig("a")
	cfg.XDS.Addr = ""
	cfg.Discovery.DNS = []config.DNSGroup{{Name: "g", Host: "g.test.", Port: 8000}}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	rt := New("127.0.0.1:1", nil, zerolog.Nop(), prometheus.NewRegistry())
	if _, err := rt.Apply(ctx, cfg, "start"); err != nil {
		t.Fatal(err)
	}
	good := config.Instance{Name: "g-10-0-0-1-8000", Address: "10.0.0.1:8000"}
	if _, err := rt.Discover(ctx, "g", []config.Instance{good}); err != nil {
		t.Fatal(err)
	}
	bad := config.Instance{Name: "g-10-0-0-2-8000", Address: "10.0.0.2:8000", Weight: -1}
	if _, err := rt.Discover(ctx, "g", []config.Instance{good, bad}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("err = %v, want ErrInvalid", err)
	}
	if got := testutil.ToFloat64(rt.reloads.WithLabelValues("dns", "invalid")); got != 1 {
		t.Errorf("dns invalid = %v, want 1", got)
	}
	if _, err := rt.Apply(ctx, cfg, "file"); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, in := range rt.Fleet().All() {
		names = append(names, in.Name)
	}
	if want := []string{"a", "g-10-0-0-1-8000"}; !slices.Equal(names, want) {
		t.Errorf("fleet %v, want %v", names, want)
	}
}
