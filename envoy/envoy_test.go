package envoy

import (
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/config"
)

var update = flag.Bool("update", false, "rewrite envoy-static.yaml from the template and deploy/local/tether.toml")

// LocalStatic is how envoy-static.yaml is made: the local stack's tether
// config, Envoy on 127.0.0.1:10000, admin on 127.0.0.1:9901.
func localStatic(t *testing.T) []byte {
	t.Helper()
	cfg, err := config.Load(filepath.Join("..", "deploy", "local", "tether.toml"))
	if err != nil {
		t.Fatal(err)
	}
	ext, err := ParseAddr(cfg.Server.ExtProcAddr)
	if err != nil {
		t.Fatal(err)
	}
	p, err := ParamsFromConfig(cfg, Addr{"127.0.0.1", 10000}, Addr{"127.0.0.1", 9901}, ext)
	if err != nil {
		t.Fatal(err)
	}
	out, err := Static(p)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestStaticFileMatchesTemplate(t *testing.T) {
	want := localStatic(t)
	if *update {
		if err := os.WriteFile("envoy-static.yaml", want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile("envoy-static.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(string(want), string(got)); diff != "" {
		t.Errorf("envoy-static.yaml is stale; run `make envoy-config` (-template +file):\n%s", diff)
	}
}

func TestStaticRefusesEmpty(t *testing.T) {
	if _, err := Static(Params{}); err == nil {
		t.Fatal("want an error for params without ext_proc or instances")
	}
	if _, err := Static(Params{ExtProc: []Addr{{"127.0.0.1", 1}}}); err == nil {
		t.Fatal("want an error for params without instances")
	}
}

func TestParseAddr(t *testing.T) {
	for _, tc := range []struct {
		in string
		ok bool
	}{{"127.0.0.1:80", true}, {"[::1]:0", true}, {"nohost", false}, {"h:99999", false}, {"h:x", false}} {
		_, err := ParseAddr(tc.in)
		if (err == nil) != tc.ok {
			t.Errorf("ParseAddr(%q) err = %v, want ok=%v", tc.in, err, tc.ok)
		}
	}
}
