// Package compose_test checks docker-compose.yml, which no machine here can
// run, against the files it mounts: it loads the compose file with
// compose-go (the loader Docker Compose uses) and checks that every
// service's image or build exists, every bind-mounted file is there, no
// host port is published twice, and the services agree with each other:
// Envoy's bootstrap reaches tether's ADS server, the ext_proc cluster tether
// sends Envoy reaches tether's ext_proc server, tether's Redis is the redis
// service, every instance in tether.toml is an emulator service at that
// address that runs tether-lab from the lab's image (tether's image is the
// product's, from the root Dockerfile), Prometheus scrapes tether's admin
// port and loads the alert rules, and Grafana is provisioned with
// Prometheus and the dashboard.
//
// The checks return errors instead of failing the test, so the bad-input
// tests can show that each one fails, naming the service and the path.
package compose_test

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/types"
	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/testenv"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/store"
	"github.com/tetherproxy/tether/xds"
)

var update = flag.Bool("update", false, "rewrite envoy/bootstrap-compose.yaml from deploy/compose/tether.toml")

// Paths from the repository root, and the services the checks look for.
const (
	composeFile   = "docker-compose.yml"
	productImage  = "Dockerfile"     // tether's image: the product only
	labImage      = "lab/Dockerfile" // the lab's: tether-lab, whose emulate the instances run
	bootstrapFile = "envoy/bootstrap-compose.yaml"
	toolsScript   = "scripts/tools.sh"
	alertsFile    = "deploy/prometheus/alerts.yml"
	dashboardFile = "deploy/grafana/tether.json"

	svcEnvoy      = "envoy"
	svcTether     = "tether"
	svcRedis      = "redis"
	svcPrometheus = "prometheus"
	svcGrafana    = "grafana"

	// The node id the compose bootstrap gives Envoy, and its admin address
	// inside the container.
	envoyNode  = "tether-compose"
	envoyAdmin = "0.0.0.0:9901"

	defaultPrometheusConfig = "/etc/prometheus/prometheus.yml"
	defaultPrometheusPort   = 9090
	defaultGrafanaProvision = "/etc/grafana/provisioning"
	redisPort               = 6379
)

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// load reads a compose file's content as `docker compose` would in root,
// with no environment: ${VAR:-default} takes its default.
func load(root string, content []byte) (*types.Project, error) {
	return loader.LoadWithContext(context.Background(), types.ConfigDetails{
		WorkingDir:  root,
		ConfigFiles: []types.ConfigFile{{Filename: filepath.Join(root, composeFile), Content: content}},
		Environment: types.Mapping{},
	}, func(o *loader.Options) { o.SetProjectName("tether", true) })
}

func loadRepo(t *testing.T) (string, *types.Project) {
	t.Helper()
	root := repoRoot(t)
	data, err := os.ReadFile(filepath.Join(root, composeFile))
	if err != nil {
		t.Fatal(err)
	}
	p, err := load(root, data)
	if err != nil {
		t.Fatalf("%s: %v", composeFile, err)
	}
	return root, p
}

// TestCompose: the stack as committed passes every check.
func TestCompose(t *testing.T) {
	root, p := loadRepo(t)
	s := &stack{root: root, p: p}
	if err := s.check(); err != nil {
		t.Errorf("%s:\n%v", composeFile, err)
	}
	for _, name := range []string{svcEnvoy, svcTether, svcRedis, svcPrometheus, svcGrafana} {
		if _, ok := p.Services[name]; !ok {
			t.Errorf("%s: no %q service", composeFile, name)
		}
	}
	if s.cfg == nil {
		t.Fatal("tether's config was not read")
	}
	if n := len(s.cfg.Instances); n != 4 {
		t.Errorf("tether.toml has %d instances, want the 4 emulated A100s", n)
	}
}

// TestComposeEnvoyBootstrap keeps envoy/bootstrap-compose.yaml what tether's
// ADS bootstrap builder (xds.ADSBootstrap, the one behind
// envoy/bootstrap-xds.yaml) makes for the compose network: the same node,
// admin and ADS cluster over HTTP/2, with tether's ADS server found by the
// service's name (so resolved by DNS) at the port of xds.addr. -update
// rewrites the file.
func TestComposeEnvoyBootstrap(t *testing.T) {
	root, p := loadRepo(t)
	s := &stack{root: root, p: p}
	cfg, err := s.tetherConfig()
	if err != nil {
		t.Fatal(err)
	}
	want, err := composeBootstrap(cfg)
	if err != nil {
		t.Fatal(err)
	}
	y, err := xds.YAML(want, bootstrapHeader)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(root, bootstrapFile)
	if *update {
		if err := os.WriteFile(file, y, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(file)
	if err != nil {
		t.Fatalf("%v (run `go test ./deploy/compose/ -run TestComposeEnvoyBootstrap -update` to create it)", err)
	}
	if diff := cmp.Diff(string(y), string(got)); diff != "" {
		t.Errorf("%s is stale; run `go test ./deploy/compose/ -run TestComposeEnvoyBootstrap -update` if the change is intended (-generated +file):\n%s", bootstrapFile, diff)
	}
}

const bootstrapHeader = "# Generated by `go test ./deploy/compose/ -run TestComposeEnvoyBootstrap -update` from\n" +
	"# deploy/compose/tether.toml, by the builder behind envoy/bootstrap-xds.yaml; a test fails when\n" +
	"# they disagree. Do not edit.\n" +
	"# ADS bootstrap for docker-compose.yml: node, admin and tether's ADS server, found by the compose\n" +
	"# service's name; everything else (listener, routes, the ext_proc and instance clusters) comes\n" +
	"# from tether over ADS.\n"

// composeBootstrap is xds.ADSBootstrap for the compose network: the ADS
// cluster names the tether service, so it is resolved by Docker's DNS
// (STRICT_DNS, IPv4) instead of being a static IP.
func composeBootstrap(cfg *config.Config) (*bootstrapv3.Bootstrap, error) {
	_, port, err := net.SplitHostPort(cfg.XDS.Addr)
	if err != nil {
		return nil, fmt.Errorf("xds.addr %q: %w", cfg.XDS.Addr, err)
	}
	b, err := xds.ADSBootstrap(envoyNode, envoyAdmin, net.JoinHostPort(svcTether, port))
	if err != nil {
		return nil, err
	}
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() == xds.ADSCluster {
			c.ClusterDiscoveryType = &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STRICT_DNS}
			c.DnsLookupFamily = clusterv3.Cluster_V4_ONLY
		}
	}
	return b, nil
}

// TestComposeEnvoyValidates runs the pinned Envoy's own validation of the
// compose bootstrap (it resolves no name and opens no port).
func TestComposeEnvoyValidates(t *testing.T) {
	bin := testenv.EnvoyBin(t)
	root := repoRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "--mode", "validate", "-c", filepath.Join(root, bootstrapFile), "--log-level", "warn")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("envoy --mode validate -c %s: %v\n%s", bootstrapFile, err, out)
	}
}

// TestComposePrometheusConfig runs promtool on deploy/compose/prometheus.yml,
// its rule_files pointed at the host files mounted there.
func TestComposePrometheusConfig(t *testing.T) {
	bin, err := exec.LookPath("promtool")
	testenv.Require(t, "promtool", err)
	root, p := loadRepo(t)
	s := &stack{root: root, p: p}
	pc, hostFile, err := s.prometheusConfig()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(hostFile)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	var rules []any
	for _, rf := range pc.ruleFiles {
		host, err := s.hostPath(svcPrometheus, rf)
		if err != nil {
			t.Fatal(err)
		}
		rules = append(rules, host)
	}
	doc["rule_files"] = rules
	out, err := yaml.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(t.TempDir(), "prometheus.yml")
	if err := os.WriteFile(tmp, out, 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, bin, "check", "config", tmp).CombinedOutput(); err != nil {
		t.Errorf("promtool check config %s (rule_files on the host): %v\n%s", hostFile, err, out)
	}
}

// TestComposeRejects: each check fails on what it is there to catch, with
// a message naming the service and the path or key.
func TestComposeRejects(t *testing.T) {
	root := repoRoot(t)
	orig, err := os.ReadFile(filepath.Join(root, composeFile))
	if err != nil {
		t.Fatal(err)
	}
	tomlData, err := os.ReadFile(filepath.Join(root, "deploy", "compose", "tether.toml"))
	if err != nil {
		t.Fatal(err)
	}
	// configDir writes a tether.toml edited by edit into a directory of its
	// own, for the tether service to mount instead of deploy/compose.
	configDir := func(t *testing.T, edit func(string) string) string {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "tether.toml"), []byte(edit(string(tomlData))), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	replace := func(t *testing.T, s, old, new string) string {
		t.Helper()
		if !strings.Contains(s, old) {
			t.Fatalf("test setup: %q is not in the text", old)
		}
		return strings.ReplaceAll(s, old, new)
	}
	const tetherMount = "./deploy/compose:/etc/tether:ro"

	cases := []struct {
		name string
		edit func(t *testing.T, compose string) string
		want []string // every one must appear in the error
	}{
		{
			name: "envoy bootstrap missing",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "./envoy/bootstrap-compose.yaml:", "./envoy/bootstrap-missing.yaml:")
			},
			want: []string{`service "envoy"`, "envoy/bootstrap-missing.yaml", "does not exist"},
		},
		{
			name: "tether config directory without tether.toml",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, tetherMount, "./deploy/grafana:/etc/tether:ro")
			},
			want: []string{`service "tether"`, "/etc/tether/tether.toml", "deploy/grafana/tether.toml", "does not exist"},
		},
		{
			name: "tether config directory missing",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, tetherMount, "./deploy/kompose:/etc/tether:ro")
			},
			want: []string{`service "tether"`, "deploy/kompose", "does not exist"},
		},
		{
			name: "tether config not mounted",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "      - "+tetherMount+"\n", "      - ./deploy/compose:/etc/tether-config:ro\n")
			},
			want: []string{`service "tether"`, "/etc/tether/tether.toml", "nothing is mounted"},
		},
		{
			name: "stop grace period shorter than the drain",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "    stop_grace_period: 20s\n", "    stop_grace_period: 5s\n")
			},
			want: []string{`service "tether"`, "stop_grace_period 5s", "server.drain_delay 3s", "server.drain_timeout 10s"},
		},
		{
			name: "stop grace period left at Docker's default",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "    stop_grace_period: 20s\n", "")
			},
			want: []string{`service "tether"`, "stop_grace_period 10s"},
		},
		{
			name: "redis host is not a service",
			edit: func(t *testing.T, c string) string {
				dir := configDir(t, func(s string) string {
					return replace(t, s, `url = "redis://redis:6379/0"`, `url = "redis://cache:6379/0"`)
				})
				return replace(t, c, tetherMount, dir+":/etc/tether:ro")
			},
			want: []string{"redis.url", `"cache"`, "not a service"},
		},
		{
			name: "redis url on another port",
			edit: func(t *testing.T, c string) string {
				dir := configDir(t, func(s string) string {
					return replace(t, s, `url = "redis://redis:6379/0"`, `url = "redis://redis:6380/0"`)
				})
				return replace(t, c, tetherMount, dir+":/etc/tether:ro")
			},
			want: []string{"redis.url", "6380", "6379"},
		},
		{
			name: "embedded redis",
			edit: func(t *testing.T, c string) string {
				dir := configDir(t, func(s string) string {
					return replace(t, s, `url = "redis://redis:6379/0"`, `url = "embedded"`)
				})
				return replace(t, c, tetherMount, dir+":/etc/tether:ro")
			},
			want: []string{"redis.url", "embedded", `"redis" service`},
		},
		{
			name: "tether config invalid",
			edit: func(t *testing.T, c string) string {
				dir := configDir(t, func(s string) string { return replace(t, s, `mode = "sticky"`, `mode = "stiky"`) })
				return replace(t, c, tetherMount, dir+":/etc/tether:ro")
			},
			want: []string{`service "tether"`, "routing.mode", "stiky"},
		},
		{
			name: "admin server on loopback",
			edit: func(t *testing.T, c string) string {
				dir := configDir(t, func(s string) string {
					return replace(t, s, `admin_addr = "0.0.0.0:8090"`, `admin_addr = "127.0.0.1:8090"`)
				})
				return replace(t, c, tetherMount, dir+":/etc/tether:ro")
			},
			want: []string{"server.admin_addr", "127.0.0.1:8090", "loopback"},
		},
		{
			name: "no identity secret",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "      TETHER_IDENTITY_SECRET: ${TETHER_IDENTITY_SECRET:-", "      IDENTITY_SECRET: ${TETHER_IDENTITY_SECRET:-")
			},
			want: []string{`service "tether"`, "TETHER_IDENTITY_SECRET", "identity.secret_env"},
		},
		{
			name: "tether healthcheck on another port",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, `"--admin", "http://127.0.0.1:8090"`, `"--admin", "http://127.0.0.1:8091"`)
			},
			want: []string{`service "tether"`, "healthcheck", "127.0.0.1:8091", "server.admin_addr"},
		},
		{
			name: "ext_proc endpoint is not the tether service",
			edit: func(t *testing.T, c string) string {
				dir := configDir(t, func(s string) string {
					return replace(t, s, `extproc_endpoints = ["10.77.0.10:50051"]`, `extproc_endpoints = ["10.77.0.11:50051"]`)
				})
				return replace(t, c, tetherMount, dir+":/etc/tether:ro")
			},
			want: []string{"ext_proc", "tether-extproc", "10.77.0.11:50051", "10.77.0.10"},
		},
		{
			name: "ext_proc endpoint on the wrong port",
			edit: func(t *testing.T, c string) string {
				dir := configDir(t, func(s string) string {
					return replace(t, s, `extproc_endpoints = ["10.77.0.10:50051"]`, `extproc_endpoints = ["10.77.0.10:50052"]`)
				})
				return replace(t, c, tetherMount, dir+":/etc/tether:ro")
			},
			want: []string{"tether-extproc", "10.77.0.10:50052", "server.extproc_addr", "50051"},
		},
		{
			name: "xds port differs from the bootstrap",
			edit: func(t *testing.T, c string) string {
				dir := configDir(t, func(s string) string {
					return replace(t, s, `addr = "0.0.0.0:18000"`, `addr = "0.0.0.0:18001"`)
				})
				return replace(t, c, tetherMount, dir+":/etc/tether:ro")
			},
			want: []string{`service "envoy"`, "tether-xds", "tether:18000", "xds.addr", "18001"},
		},
		{
			name: "instance without a service",
			edit: func(t *testing.T, c string) string {
				dir := configDir(t, func(s string) string {
					return replace(t, s, `name = "a100-west-2"`, `name = "a100-west-9"`)
				})
				return replace(t, c, tetherMount, dir+":/etc/tether:ro")
			},
			want: []string{"instances", "a100-west-9", "no compose service"},
		},
		{
			name: "emulator on another port",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "a100-east-2=0.0.0.0:8000", "a100-east-2=0.0.0.0:8001")
			},
			want: []string{`service "a100-east-2"`, "8001", "10.77.0.22:8000"},
		},
		{
			name: "emulator at another address",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "ipv4_address: 10.77.0.31", "ipv4_address: 10.77.0.41")
			},
			want: []string{`service "a100-west-1"`, "10.77.0.41", "10.77.0.31:8000"},
		},
		{
			name: "emulator refusing non-loopback",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, `"a100-west-1=0.0.0.0:8000", "--model", "llama-3.1-8b", "--allow-non-loopback"]`,
					`"a100-west-1=0.0.0.0:8000", "--model", "llama-3.1-8b"]`)
			},
			want: []string{`service "a100-west-1"`, "--allow-non-loopback"},
		},
		{
			name: "emulator serving another model than the instance's version",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, `"a100-east-1=0.0.0.0:8000", "--model", "llama-3.1-8b"`, `"a100-east-1=0.0.0.0:8000", "--model", "llama-3"`)
			},
			want: []string{`service "a100-east-1"`, `--model "llama-3"`, "want --model llama-3.1-8b"},
		},
		{
			name: "emulator runs tether emulate",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "    pull_policy: never\n    command: [\"emulate\", \"--instance\", \"a100-west-2=",
					"    pull_policy: never\n    entrypoint: [\"/tether\"]\n    command: [\"emulate\", \"--instance\", \"a100-west-2=")
			},
			want: []string{`service "a100-west-2"`, `"/tether"`, "not tether-lab emulate"},
		},
		{
			name: "emulator from the product image",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "    image: tether-lab:compose\n    pull_policy: never\n    command: [\"emulate\", \"--instance\", \"a100-west-1=",
					"    image: tether:compose\n    pull_policy: never\n    entrypoint: [\"/tether-lab\"]\n    command: [\"emulate\", \"--instance\", \"a100-west-1=")
			},
			want: []string{`service "a100-west-1"`, "tether:compose", "built from Dockerfile", labImage},
		},
		{
			name: "emulator image from no build",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "    image: tether-lab:compose\n    pull_policy: never # built by the a100-east-1 service\n    command: [\"emulate\", \"--instance\", \"a100-east-2=",
					"    image: example.com/tether-lab:v1\n    entrypoint: [\"/tether-lab\"]\n    command: [\"emulate\", \"--instance\", \"a100-east-2=")
			},
			want: []string{`service "a100-east-2"`, "example.com/tether-lab:v1", "no Dockerfile", labImage},
		},
		{
			name: "lab build without its Dockerfile",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "dockerfile: lab/Dockerfile\n", "dockerfile: lab/Dockerfile.missing\n")
			},
			want: []string{`service "a100-east-1"`, "lab/Dockerfile.missing", "does not exist"},
		},
		{
			name: "tether from the lab's Dockerfile",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "      dockerfile: Dockerfile\n", "      dockerfile: lab/Dockerfile\n")
			},
			want: []string{`service "tether"`, "/tether-lab", "not tether serve"},
		},
		{
			name: "host port published twice",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, `"127.0.0.1:8202:8000"`, `"127.0.0.1:8201:8000"`)
			},
			want: []string{"8201", `"a100-west-1"`, `"a100-west-2"`},
		},
		{
			name: "image without a pinned tag",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "image: redis:7.4.2", "image: redis")
			},
			want: []string{`service "redis"`, "pinned"},
		},
		{
			name: "envoy image off the pinned version",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "envoyproxy/envoy:v1.40.0", "envoyproxy/envoy:v1.39.0")
			},
			want: []string{`service "envoy"`, "v1.39.0", toolsScript},
		},
		{
			name: "build without a Dockerfile",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "dockerfile: Dockerfile", "dockerfile: Dockerfile.missing")
			},
			want: []string{`service "tether"`, "Dockerfile.missing", "does not exist"},
		},
		{
			name: "healthy dependency without a healthcheck",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "      test: [\"CMD\", \"redis-cli\", \"ping\"]\n", "      disable: true\n")
			},
			want: []string{`service "tether"`, `"redis"`, "healthcheck"},
		},
		{
			name: "prometheus does not scrape tether",
			edit: func(t *testing.T, c string) string {
				dir := t.TempDir()
				data, err := os.ReadFile(filepath.Join(root, "deploy", "compose", "prometheus.yml"))
				if err != nil {
					t.Fatal(err)
				}
				edited := replace(t, string(data), `"tether:8090"`, `"tether:9000"`)
				if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(edited), 0o644); err != nil {
					t.Fatal(err)
				}
				return replace(t, c, "./deploy/compose/prometheus.yml:", dir+"/prometheus.yml:")
			},
			want: []string{`service "prometheus"`, "tether:8090"},
		},
		{
			name: "alert rules not mounted",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "      - ./deploy/prometheus/alerts.yml:/etc/prometheus/rules/alerts.yml:ro\n", "")
			},
			want: []string{`service "prometheus"`, "/etc/prometheus/rules/alerts.yml", "nothing is mounted"},
		},
		{
			name: "dashboard not mounted",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "./deploy/grafana/tether.json:/etc/grafana/dashboards/tether.json:ro", "./deploy/grafana/tether.json:/etc/grafana/other/tether.json:ro")
			},
			want: []string{`service "grafana"`, dashboardFile, "/etc/grafana/dashboards"},
		},
		{
			name: "grafana datasource not provisioned",
			edit: func(t *testing.T, c string) string {
				return replace(t, c, "      - ./deploy/grafana/provisioning/datasources:/etc/grafana/provisioning/datasources:ro\n", "")
			},
			want: []string{`service "grafana"`, "datasource", "prometheus:9090"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, err := load(root, []byte(tc.edit(t, string(orig))))
			if err == nil {
				err = (&stack{root: root, p: p}).check()
			}
			if err == nil {
				t.Fatal("passed; want an error")
			}
			t.Logf("%v", err)
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not mention %q:\n%v", w, err)
				}
			}
		})
	}
}

// stack checks one loaded project.
type stack struct {
	root string
	p    *types.Project
	errs []error

	cfg *config.Config // tether's, once read
}

func (s *stack) errf(format string, a ...any) { s.errs = append(s.errs, fmt.Errorf(format, a...)) }

func (s *stack) add(err error) {
	if err != nil {
		s.errs = append(s.errs, err)
	}
}

// check runs every check and returns every problem found.
func (s *stack) check() error {
	s.checkImages()
	s.checkMounts()
	s.checkPorts()
	s.checkAddresses()
	s.checkDependencies()
	cfg, err := s.tetherConfig()
	if err != nil {
		s.add(err)
	} else {
		s.cfg = cfg
		s.checkTetherListens(cfg)
		s.checkStopGrace(cfg)
		s.checkRedis(cfg)
		s.checkInstances(cfg)
		s.checkEnvoy(cfg)
		s.checkPrometheus(cfg)
	}
	s.checkGrafana()
	return errors.Join(s.errs...)
}

// rel shows a host path relative to the repository when it is inside it.
func (s *stack) rel(p string) string {
	if r, err := filepath.Rel(s.root, p); err == nil && !strings.HasPrefix(r, "..") {
		return r
	}
	return p
}

func (s *stack) service(name string) (types.ServiceConfig, error) {
	svc, ok := s.p.Services[name]
	if !ok {
		return types.ServiceConfig{}, fmt.Errorf("%s: no %q service (services: %s)", composeFile, name, strings.Join(s.serviceNames(), ", "))
	}
	return svc, nil
}

func (s *stack) serviceNames() []string {
	names := make([]string, 0, len(s.p.Services))
	for n := range s.p.Services {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func (s *stack) sortedServices() []types.ServiceConfig {
	var out []types.ServiceConfig
	for _, n := range s.serviceNames() {
		out = append(out, s.p.Services[n])
	}
	return out
}

// builtImages maps an image name to the service that builds it.
func (s *stack) builtImages() map[string]string {
	m := map[string]string{}
	for _, svc := range s.sortedServices() {
		if svc.Build != nil && svc.Image != "" {
			m[svc.Image] = svc.Name
		}
	}
	return m
}

var digest = regexp.MustCompile(`@sha256:[0-9a-f]{64}$`)

// pinned: the image names a digest, or a tag other than latest (a
// registry's port, as in host:5000/name, is not a tag).
func pinned(image string) bool {
	if digest.MatchString(image) {
		return true
	}
	_, tag, ok := strings.Cut(lastPathElem(image), ":")
	return ok && tag != "" && tag != "latest"
}

// checkImages: every service has a build whose context and Dockerfile
// exist, or an image that is pinned (a tag other than latest, or a digest),
// or an image another service of the file builds.
func (s *stack) checkImages() {
	built := s.builtImages()
	envoyVersion, verr := pinnedEnvoy(s.root)
	for _, svc := range s.sortedServices() {
		switch {
		case svc.Build != nil:
			ctx := svc.Build.Context
			if st, err := os.Stat(ctx); err != nil || !st.IsDir() {
				s.errf("service %q: build context %s does not exist", svc.Name, s.rel(ctx))
				continue
			}
			df := svc.Build.Dockerfile
			if df == "" {
				df = "Dockerfile"
			}
			if !filepath.IsAbs(df) {
				df = filepath.Join(ctx, df)
			}
			if _, err := os.Stat(df); err != nil {
				s.errf("service %q: build Dockerfile %s does not exist", svc.Name, s.rel(df))
			}
		case svc.Image == "":
			s.errf("service %q: neither image nor build", svc.Name)
		case built[svc.Image] != "":
			if svc.PullPolicy != types.PullPolicyNever {
				s.errf("service %q: image %s is built by service %q: set pull_policy: never so compose does not look for it in a registry", svc.Name, svc.Image, built[svc.Image])
			}
		default:
			if !pinned(svc.Image) {
				s.errf("service %q: image %s is not pinned: give a version tag (not latest) or a digest", svc.Name, svc.Image)
			}
		}
		if strings.HasPrefix(svc.Image, "envoyproxy/envoy") {
			if verr != nil {
				s.add(verr)
			} else if want := "envoyproxy/envoy:v" + envoyVersion; svc.Image != want {
				s.errf("service %q: image %s: want %s, the Envoy version %s pins for the tests", svc.Name, svc.Image, want, toolsScript)
			}
		}
	}
}

func lastPathElem(image string) string {
	if i := strings.LastIndex(image, "/"); i >= 0 {
		return image[i+1:]
	}
	return image
}

// pinnedEnvoy reads ENVOY_VERSION from scripts/tools.sh.
func pinnedEnvoy(root string) (string, error) {
	data, err := os.ReadFile(filepath.Join(root, toolsScript))
	if err != nil {
		return "", err
	}
	m := regexp.MustCompile(`(?m)^ENVOY_VERSION=([0-9.]+)$`).FindSubmatch(data)
	if m == nil {
		return "", fmt.Errorf("%s: no ENVOY_VERSION=", toolsScript)
	}
	return string(m[1]), nil
}

// checkMounts: every bind mount's host path exists. (Docker would create a
// missing one as an empty directory, and the service would fail later with
// a less helpful message.)
func (s *stack) checkMounts() {
	for _, svc := range s.sortedServices() {
		for _, v := range svc.Volumes {
			if v.Type != types.VolumeTypeBind {
				continue
			}
			if _, err := os.Stat(v.Source); err != nil {
				s.errf("service %q: bind mount %s → %s: %s does not exist", svc.Name, s.rel(v.Source), v.Target, s.rel(v.Source))
			}
		}
	}
}

// hostPath maps a path inside a service's containers to the host path of
// the bind mount that covers it (the longest target that is it or one of
// its parents), and checks it exists.
func (s *stack) hostPath(service, inside string) (string, error) {
	svc, err := s.service(service)
	if err != nil {
		return "", err
	}
	inside = path.Clean(inside)
	var best *types.ServiceVolumeConfig
	for i, v := range svc.Volumes {
		if v.Type != types.VolumeTypeBind {
			continue
		}
		t := path.Clean(v.Target)
		if (inside == t || strings.HasPrefix(inside, t+"/")) && (best == nil || len(t) > len(path.Clean(best.Target))) {
			best = &svc.Volumes[i]
		}
	}
	if best == nil {
		return "", fmt.Errorf("service %q: nothing is mounted at %s (bind mounts: %s)", service, inside, s.mounts(svc))
	}
	host := filepath.Join(best.Source, filepath.FromSlash(strings.TrimPrefix(inside, path.Clean(best.Target))))
	if _, err := os.Stat(host); err != nil {
		return "", fmt.Errorf("service %q: %s is %s on the host (bind mount %s → %s), which does not exist",
			service, inside, s.rel(host), s.rel(best.Source), best.Target)
	}
	return host, nil
}

func (s *stack) mounts(svc types.ServiceConfig) string {
	var m []string
	for _, v := range svc.Volumes {
		if v.Type == types.VolumeTypeBind {
			m = append(m, s.rel(v.Source)+" → "+v.Target)
		}
	}
	if len(m) == 0 {
		return "none"
	}
	return strings.Join(m, ", ")
}

// checkPorts: no host port is published twice, and every published port
// names its host port (no random ones: the README gives them).
func (s *stack) checkPorts() {
	seen := map[string]string{}
	for _, svc := range s.sortedServices() {
		for _, p := range svc.Ports {
			proto := p.Protocol
			if proto == "" {
				proto = "tcp"
			}
			if p.Published == "" {
				s.errf("service %q: port %d is published on a random host port: give one", svc.Name, p.Target)
				continue
			}
			key := p.Published + "/" + proto
			if other, dup := seen[key]; dup {
				s.errf("host port %s is published by service %q and by service %q", key, other, svc.Name)
				continue
			}
			seen[key] = svc.Name
		}
	}
}

// network is one compose network's subnet and dynamic range.
type network struct {
	subnet, dynamic netip.Prefix
}

func (s *stack) networks() map[string]network {
	m := map[string]network{}
	for name, n := range s.p.Networks {
		var nw network
		for _, pool := range n.Ipam.Config {
			if pool == nil {
				continue
			}
			nw.subnet, _ = netip.ParsePrefix(pool.Subnet)
			nw.dynamic, _ = netip.ParsePrefix(pool.IPRange)
		}
		m[name] = nw
	}
	return m
}

// checkAddresses: fixed addresses are unique, inside their network's
// subnet and outside the range Docker hands out to the other containers.
func (s *stack) checkAddresses() {
	nets := s.networks()
	seen := map[string]string{}
	for _, svc := range s.sortedServices() {
		for name, sn := range svc.Networks {
			if sn == nil || sn.Ipv4Address == "" {
				continue
			}
			ip, err := netip.ParseAddr(sn.Ipv4Address)
			if err != nil {
				s.errf("service %q: network %s: ipv4_address %q: %v", svc.Name, name, sn.Ipv4Address, err)
				continue
			}
			nw := nets[name]
			switch {
			case !nw.subnet.IsValid():
				s.errf("service %q: network %s: ipv4_address %s needs the network's ipam subnet", svc.Name, name, ip)
			case !nw.subnet.Contains(ip):
				s.errf("service %q: network %s: ipv4_address %s is outside the subnet %s", svc.Name, name, ip, nw.subnet)
			case nw.dynamic.IsValid() && nw.dynamic.Contains(ip):
				s.errf("service %q: network %s: ipv4_address %s is inside ip_range %s, which Docker hands out to other containers", svc.Name, name, ip, nw.dynamic)
			}
			if other, dup := seen[name+"/"+ip.String()]; dup {
				s.errf("service %q: network %s: ipv4_address %s is also service %q's", svc.Name, name, ip, other)
			}
			seen[name+"/"+ip.String()] = svc.Name
		}
	}
}

// checkDependencies: a service waited for as healthy has a healthcheck.
func (s *stack) checkDependencies() {
	for _, svc := range s.sortedServices() {
		deps := make([]string, 0, len(svc.DependsOn))
		for d := range svc.DependsOn {
			deps = append(deps, d)
		}
		sort.Strings(deps)
		for _, d := range deps {
			dep, ok := s.p.Services[d]
			if !ok {
				s.errf("service %q: depends on %q, which is not a service", svc.Name, d)
				continue
			}
			if svc.DependsOn[d].Condition == types.ServiceConditionHealthy &&
				(dep.HealthCheck == nil || dep.HealthCheck.Disable || len(dep.HealthCheck.Test) == 0) {
				s.errf("service %q: waits for %q to be healthy, but %q has no healthcheck", svc.Name, d, d)
			}
		}
	}
}

// argv is what a service's containers run: its entrypoint and command, or,
// when it sets neither entrypoint, the image's ENTRYPOINT (known for the
// images built from a Dockerfile here) followed by its command.
func (s *stack) argv(svc types.ServiceConfig) ([]string, error) {
	if len(svc.Entrypoint) > 0 {
		return append(slices.Clone([]string(svc.Entrypoint)), svc.Command...), nil
	}
	builder := svc
	if svc.Build == nil {
		if b, ok := s.builtImages()[svc.Image]; ok {
			builder = s.p.Services[b]
		}
	}
	if builder.Build == nil {
		return slices.Clone([]string(svc.Command)), nil
	}
	entry, cmd, err := dockerfileArgv(builder.Build)
	if err != nil {
		return nil, fmt.Errorf("service %q: %w", svc.Name, err)
	}
	if len(svc.Command) > 0 {
		cmd = svc.Command
	}
	return append(entry, cmd...), nil
}

// dockerfile is the host path of a build's Dockerfile.
func dockerfile(b *types.BuildConfig) string {
	df := b.Dockerfile
	if df == "" {
		df = "Dockerfile"
	}
	if !filepath.IsAbs(df) {
		df = filepath.Join(b.Context, df)
	}
	return df
}

// dockerfileOf is the Dockerfile (relative to the repository) that builds
// a service's image: the service's own build, or the build of the service
// of this file that makes the image it names; "" when none does.
func (s *stack) dockerfileOf(svc types.ServiceConfig) string {
	if svc.Build == nil {
		b, ok := s.builtImages()[svc.Image]
		if !ok {
			return ""
		}
		svc = s.p.Services[b]
	}
	return filepath.ToSlash(s.rel(dockerfile(svc.Build)))
}

func orNone(s string) string {
	if s == "" {
		return "no Dockerfile of this repository"
	}
	return s
}

// dockerfileArgv reads the exec-form ENTRYPOINT and CMD of a Dockerfile's
// last stage.
func dockerfileArgv(b *types.BuildConfig) (entry, cmd []string, err error) {
	df := dockerfile(b)
	data, err := os.ReadFile(df)
	if err != nil {
		return nil, nil, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		instr, args, _ := strings.Cut(strings.TrimSpace(line), " ")
		var dst *[]string
		switch strings.ToUpper(instr) {
		case "FROM":
			entry, cmd = nil, nil
			continue
		case "ENTRYPOINT":
			dst = &entry
		case "CMD":
			dst = &cmd
		default:
			continue
		}
		if err := json.Unmarshal([]byte(strings.TrimSpace(args)), dst); err != nil {
			return nil, nil, fmt.Errorf("%s: %s %s: want the exec (JSON) form", df, instr, args)
		}
	}
	return entry, cmd, nil
}

// flagValues returns the values of a flag (--name V or --name=V; for a
// one-letter flag, -n V) in argv.
func flagValues(argv []string, names ...string) []string {
	var out []string
	for i := 0; i < len(argv); i++ {
		for _, n := range names {
			switch {
			case argv[i] == n && i+1 < len(argv):
				out = append(out, argv[i+1])
			case strings.HasPrefix(argv[i], n+"="):
				out = append(out, strings.TrimPrefix(argv[i], n+"="))
			}
		}
	}
	return out
}

// tetherConfig reads the config file the tether service's `serve --config`
// names, through its bind mount, with tether's own loader (which
// validates it).
func (s *stack) tetherConfig() (*config.Config, error) {
	svc, err := s.service(svcTether)
	if err != nil {
		return nil, err
	}
	argv, err := s.argv(svc)
	if err != nil {
		return nil, err
	}
	if len(argv) == 0 || path.Base(argv[0]) != "tether" || !slices.Contains(argv, "serve") {
		return nil, fmt.Errorf("service %q: runs %q, not tether serve", svc.Name, argv)
	}
	if df := s.dockerfileOf(svc); df != productImage {
		return nil, fmt.Errorf("service %q: image %q is built from %s: want the product's image, from %s", svc.Name, svc.Image, orNone(df), productImage)
	}
	paths := flagValues(argv, "--config")
	if len(paths) != 1 {
		return nil, fmt.Errorf("service %q: runs %q: want one --config", svc.Name, argv)
	}
	host, err := s.hostPath(svc.Name, paths[0])
	if err != nil {
		return nil, err
	}
	cfg, err := config.Load(host)
	if err != nil {
		return nil, fmt.Errorf("service %q: %s (%s on the host): %w", svc.Name, paths[0], s.rel(host), err)
	}
	if err := store.CheckURL(cfg.Redis.URL); err != nil {
		return nil, fmt.Errorf("service %q: %s: redis.url: %w", svc.Name, s.rel(host), err)
	}
	// tether refuses a shared Redis without an identity secret, and every
	// replica must have the same one: from the service's environment.
	env := cfg.Identity.SecretEnv
	if v, ok := svc.Environment[env]; !ok || v == nil || len(*v) < 16 {
		if cfg.Identity.Secret == "" {
			return nil, fmt.Errorf("service %q: environment %s (identity.secret_env) must hold the identity secret, 16 bytes or more", svc.Name, env)
		}
	}
	return &cfg, nil
}

// onAllInterfaces: other containers reach a server in this one only when
// it does not listen on loopback.
func onAllInterfaces(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return false
	}
	if host == "" {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && !ip.IsLoopback()
}

func port(hostport string) uint32 {
	_, p, err := net.SplitHostPort(hostport)
	if err != nil {
		return 0
	}
	n, err := strconv.ParseUint(p, 10, 16)
	if err != nil {
		return 0
	}
	return uint32(n)
}

// checkTetherListens: the servers other containers call are not on
// loopback, and what the tether service publishes is a port tether serves.
func (s *stack) checkTetherListens(cfg *config.Config) {
	for _, a := range []struct{ key, addr, who string }{
		{"server.extproc_addr", cfg.Server.ExtProcAddr, "Envoy cannot call ext_proc"},
		{"server.admin_addr", cfg.Server.AdminAddr, "Prometheus cannot scrape /metrics"},
		{"xds.addr", cfg.XDS.Addr, "Envoy cannot reach the ADS server"},
	} {
		if a.addr == "" && a.key == "xds.addr" {
			s.errf("service %q: xds.addr is off: Envoy's bootstrap takes everything from tether's ADS server", svcTether)
			continue
		}
		if !onAllInterfaces(a.addr) {
			s.errf("service %q: %s = %q listens on loopback inside the container, so %s from another container: use \"0.0.0.0:%d\"",
				svcTether, a.key, a.addr, a.who, port(a.addr))
		}
	}
	svc, _ := s.service(svcTether)
	if hc := svc.HealthCheck; hc != nil {
		for _, u := range flagValues(hc.Test, "--admin") {
			if pu, err := url.Parse(u); err != nil || port(pu.Host) != port(cfg.Server.AdminAddr) {
				s.errf("service %q: the healthcheck asks the admin server at %s, but server.admin_addr is %s", svcTether, u, cfg.Server.AdminAddr)
			}
		}
	}
	serves := map[uint32]bool{port(cfg.Server.ExtProcAddr): true, port(cfg.Server.AdminAddr): true, port(cfg.XDS.Addr): true}
	for _, p := range svc.Ports {
		if !serves[p.Target] {
			s.errf("service %q: publishes container port %d, which tether does not serve (ext_proc %d, admin %d, xds %d)",
				svcTether, p.Target, port(cfg.Server.ExtProcAddr), port(cfg.Server.AdminAddr), port(cfg.XDS.Addr))
		}
	}
}

// checkStopGrace: Docker waits long enough after SIGTERM for tether's
// drain delay and drain timeout, 1 s for the ADS server's streams when it
// runs and 2 s for the admin server, before it kills the container.
func (s *stack) checkStopGrace(cfg *config.Config) {
	svc, err := s.service(svcTether)
	if err != nil {
		s.add(err)
		return
	}
	grace := 10 * time.Second // Docker's default
	if svc.StopGracePeriod != nil {
		grace = time.Duration(*svc.StopGracePeriod)
	}
	rest := 2 * time.Second
	if cfg.XDS.Addr != "" {
		rest += time.Second
	}
	if need := cfg.Server.DrainDelay.D + cfg.Server.DrainTimeout.D + rest; grace <= need {
		s.errf("service %q: stop_grace_period %v, want above server.drain_delay %v + server.drain_timeout %v + %v for the ADS and admin servers, or Docker kills tether mid-drain",
			svcTether, grace, cfg.Server.DrainDelay.D, cfg.Server.DrainTimeout.D, rest)
	}
}

// checkRedis: tether's redis.url names the redis service (every host of
// it, for the cluster and sentinel forms) on the port it listens on.
func (s *stack) checkRedis(cfg *config.Config) {
	u := cfg.Redis.URL
	if u == store.Embedded {
		s.errf("tether.toml: redis.url = %q: in the compose stack the bindings belong in the %q service (redis://%s:%d/0), where replicas share them and tether restarts keep them",
			u, svcRedis, svcRedis, redisPort)
		return
	}
	parsed, err := url.Parse(u)
	if err != nil || parsed.Scheme == "unix" {
		s.errf("tether.toml: redis.url: want redis://%s:%d/0 (the %q service)", svcRedis, redisPort, svcRedis)
		return
	}
	hosts := []string{parsed.Host}
	hosts = append(hosts, parsed.Query()["addr"]...)
	for _, hp := range hosts {
		host, p, err := net.SplitHostPort(hp)
		if err != nil {
			host, p = hp, strconv.Itoa(redisPort)
		}
		svc, ok := s.p.Services[host]
		if !ok {
			s.errf("tether.toml: redis.url host %q is not a service of %s (services: %s): want redis://%s:%d/0",
				host, composeFile, strings.Join(s.serviceNames(), ", "), svcRedis, redisPort)
			continue
		}
		want := redisPort
		if ps := flagValues(svc.Command, "--port"); len(ps) > 0 {
			want, _ = strconv.Atoi(ps[len(ps)-1])
		}
		if p != strconv.Itoa(want) {
			s.errf("tether.toml: redis.url %s:%s: service %q listens on %d", host, p, host, want)
		}
		if repo, _, _ := strings.Cut(lastPathElem(svc.Image), ":"); repo != "redis" {
			s.errf("tether.toml: redis.url host %q: service %q runs image %q, not redis", host, host, svc.Image)
		}
	}
}

// checkInstances: every [[instances]] entry is a compose service of the
// same name that runs `tether-lab emulate` from the lab's image for that
// instance, on the instance's port, at the instance's address, serving the
// instance's version as its model; and every emulated instance is one
// tether routes to.
func (s *stack) checkInstances(cfg *config.Config) {
	known := map[string]bool{}
	for i, in := range cfg.Instances {
		known[in.Name] = true
		key := fmt.Sprintf("tether.toml: instances[%d] %s (%s)", i, in.Name, in.Address)
		ap, err := netip.ParseAddrPort(in.Address)
		if err != nil {
			s.errf("%s: %v", key, err)
			continue
		}
		svc, ok := s.p.Services[in.Name]
		if !ok {
			s.errf("%s: no compose service of that name runs its emulator (services: %s)", key, strings.Join(s.serviceNames(), ", "))
			continue
		}
		argv, err := s.argv(svc)
		if err != nil {
			s.add(err)
			continue
		}
		if len(argv) < 2 || path.Base(argv[0]) != "tether-lab" || argv[1] != "emulate" {
			s.errf("service %q: runs %q, not tether-lab emulate, for %s", svc.Name, argv, key)
			continue
		}
		var listen string
		for _, spec := range flagValues(argv, "--instance") {
			if name, addr, _ := strings.Cut(spec, "="); name == in.Name {
				listen = addr
			}
		}
		if listen == "" {
			s.errf("service %q: emulates no --instance %s=HOST:%d for %s", svc.Name, in.Name, ap.Port(), key)
			continue
		}
		host, p, err := net.SplitHostPort(listen)
		if err != nil || p != strconv.Itoa(int(ap.Port())) {
			s.errf("service %q: emulates %s on %s, but tether routes it to %s", svc.Name, in.Name, listen, in.Address)
			continue
		}
		if host != "0.0.0.0" && host != "" && host != ap.Addr().String() {
			s.errf("service %q: emulates %s on %s, not on %s or all interfaces", svc.Name, in.Name, listen, ap.Addr())
		}
		if !slices.Contains(argv, "--allow-non-loopback") {
			s.errf("service %q: emulate listens on %s without --allow-non-loopback, which it refuses", svc.Name, listen)
		}
		// The instance serves its version as its model (/v1/models, the
		// model_name label of its /metrics), as a real engine of that
		// version would.
		if models := flagValues(argv, "--model"); len(models) != 1 || models[0] != in.Version {
			got := "no --model"
			if len(models) > 0 {
				got = fmt.Sprintf("--model %q", models[len(models)-1])
			}
			s.errf("service %q: emulates %s with %s, want --model %s, its version in tether.toml", svc.Name, in.Name, got, in.Version)
		}
		var addrs []string
		for _, sn := range svc.Networks {
			if sn != nil && sn.Ipv4Address != "" {
				addrs = append(addrs, sn.Ipv4Address)
			}
		}
		if !slices.Contains(addrs, ap.Addr().String()) {
			s.errf("service %q: has address %v on its networks, but tether and Envoy reach %s at %s: set ipv4_address: %s",
				svc.Name, addrs, in.Name, in.Address, ap.Addr())
		}
		if df := s.dockerfileOf(svc); df != labImage {
			s.errf("service %q: image %q is built from %s: want the lab's image, from %s, whose `tether-lab emulate` the instances run (tether's carries the product only)",
				svc.Name, svc.Image, orNone(df), labImage)
		}
	}
	for _, svc := range s.sortedServices() {
		argv, err := s.argv(svc)
		if err != nil || !slices.Contains(argv, "emulate") || slices.Contains(argv, "serve") {
			continue
		}
		for _, spec := range flagValues(argv, "--instance") {
			if name, _, _ := strings.Cut(spec, "="); !known[name] {
				s.errf("service %q: emulates %s, which tether.toml does not list in [[instances]]", svc.Name, name)
			}
		}
	}
}

// checkEnvoy parses the bootstrap the envoy service starts from, as Envoy's
// own proto, and checks the ADS cluster reaches tether's xds.addr port by
// the tether service's name or address, and that the ext_proc cluster
// tether sends over ADS reaches tether's ext_proc port. The listener and
// admin ports the service publishes are served on all interfaces.
func (s *stack) checkEnvoy(cfg *config.Config) {
	svc, err := s.service(svcEnvoy)
	if err != nil {
		s.add(err)
		return
	}
	argv, _ := s.argv(svc)
	paths := flagValues(argv, "-c", "--config-path")
	if len(paths) != 1 {
		s.errf("service %q: runs %q: want one -c BOOTSTRAP", svc.Name, argv)
		return
	}
	host, err := s.hostPath(svc.Name, paths[0])
	if err != nil {
		s.add(err)
		return
	}
	b, err := parseBootstrap(host)
	if err != nil {
		s.errf("service %q: %s (%s): %v", svc.Name, paths[0], s.rel(host), err)
		return
	}
	where := fmt.Sprintf("service %q: %s", svc.Name, s.rel(host))
	tsvc, _ := s.service(svcTether)
	tetherNames := map[string]bool{svcTether: true}
	for _, sn := range tsvc.Networks {
		if sn != nil {
			if sn.Ipv4Address != "" {
				tetherNames[sn.Ipv4Address] = true
			}
			for _, a := range sn.Aliases {
				tetherNames[a] = true
			}
		}
	}

	// The ADS cluster.
	var adsCluster string
	for _, g := range b.GetDynamicResources().GetAdsConfig().GetGrpcServices() {
		adsCluster = g.GetEnvoyGrpc().GetClusterName()
	}
	if adsCluster == "" {
		s.errf("%s: no ads_config with an envoy_grpc cluster: Envoy would not ask tether for its configuration", where)
	} else {
		var c *clusterv3.Cluster
		for _, sc := range b.GetStaticResources().GetClusters() {
			if sc.GetName() == adsCluster {
				c = sc
			}
		}
		if c == nil {
			s.errf("%s: ads_config names cluster %q, which static_resources does not define", where, adsCluster)
		} else {
			s.checkUpstream(where, c, tetherNames, port(cfg.XDS.Addr), "xds.addr "+cfg.XDS.Addr)
			if !hasHTTP2(c) {
				s.errf("%s: cluster %s: no http2_protocol_options: gRPC needs HTTP/2", where, c.GetName())
			}
		}
	}

	// The ext_proc cluster: tether sends it over ADS, built from its config
	// the way serve builds it.
	p, err := plan.FromConfig(*cfg, plan.Options{})
	if err != nil {
		s.errf("tether.toml: the resources tether would send Envoy: %v", err)
		return
	}
	res, err := xds.Build(p.Envoy, xds.ADS)
	if err != nil {
		s.errf("tether.toml: the resources tether would send Envoy: %v", err)
		return
	}
	for _, cla := range res.Endpoints {
		if cla.GetClusterName() != xds.ExtProcCluster {
			continue
		}
		for _, loc := range cla.GetEndpoints() {
			for _, ep := range loc.GetLbEndpoints() {
				sa := ep.GetEndpoint().GetAddress().GetSocketAddress()
				addr := net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue())))
				if !tetherNames[sa.GetAddress()] {
					s.errf("tether.toml: envoy.extproc_endpoints: the ext_proc cluster %s tether sends Envoy reaches %s, which is not the %q service (%s): set extproc_endpoints to its ipv4_address and the port of server.extproc_addr",
						xds.ExtProcCluster, addr, svcTether, strings.Join(sortedKeys(tetherNames), ", "))
				} else if sa.GetPortValue() != port(cfg.Server.ExtProcAddr) {
					s.errf("tether.toml: envoy.extproc_endpoints: the ext_proc cluster %s reaches %s, but server.extproc_addr listens on %d",
						xds.ExtProcCluster, addr, port(cfg.Server.ExtProcAddr))
				}
			}
		}
	}

	// What the service publishes: the listener and the admin interface,
	// served on all interfaces of the container.
	serves := map[uint32]string{port(cfg.Envoy.ListenerAddr): cfg.Envoy.ListenerAddr}
	if a := b.GetAdmin().GetAddress().GetSocketAddress(); a != nil {
		serves[a.GetPortValue()] = net.JoinHostPort(a.GetAddress(), strconv.Itoa(int(a.GetPortValue())))
	}
	listenerPublished := false
	for _, p := range svc.Ports {
		addr, ok := serves[p.Target]
		switch {
		case !ok:
			s.errf("service %q: publishes container port %d, which Envoy does not serve (listener %s, admin %v)", svc.Name, p.Target, cfg.Envoy.ListenerAddr, serves)
		case !onAllInterfaces(addr):
			s.errf("service %q: publishes port %d, but Envoy serves it on %s, loopback inside the container", svc.Name, p.Target, addr)
		}
		listenerPublished = listenerPublished || p.Target == port(cfg.Envoy.ListenerAddr)
	}
	if !listenerPublished {
		s.errf("service %q: does not publish the listener port %d (envoy.listener_addr %s)", svc.Name, port(cfg.Envoy.ListenerAddr), cfg.Envoy.ListenerAddr)
	}
}

// checkUpstream: every endpoint of c is the tether service on port want.
func (s *stack) checkUpstream(where string, c *clusterv3.Cluster, tether map[string]bool, want uint32, key string) {
	n := 0
	for _, loc := range c.GetLoadAssignment().GetEndpoints() {
		for _, ep := range loc.GetLbEndpoints() {
			n++
			sa := ep.GetEndpoint().GetAddress().GetSocketAddress()
			addr := net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue())))
			if !tether[sa.GetAddress()] {
				s.errf("%s: cluster %s reaches %s, which is not the %q service", where, c.GetName(), addr, svcTether)
			}
			if sa.GetPortValue() != want {
				s.errf("%s: cluster %s reaches %s, but tether's %s listens on %d", where, c.GetName(), addr, key, want)
			}
			if _, err := netip.ParseAddr(sa.GetAddress()); err != nil && c.GetType() != clusterv3.Cluster_STRICT_DNS && c.GetType() != clusterv3.Cluster_LOGICAL_DNS {
				s.errf("%s: cluster %s reaches the name %s but is %s: a name needs STRICT_DNS or LOGICAL_DNS", where, c.GetName(), sa.GetAddress(), c.GetType())
			}
		}
	}
	if n == 0 {
		s.errf("%s: cluster %s has no endpoint", where, c.GetName())
	}
}

func hasHTTP2(c *clusterv3.Cluster) bool {
	a, ok := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
	if !ok {
		return false
	}
	var o upstreamhttpv3.HttpProtocolOptions
	if err := a.UnmarshalTo(&o); err != nil {
		return false
	}
	return o.GetExplicitHttpConfig().GetHttp2ProtocolOptions() != nil
}

// parseBootstrap reads an Envoy bootstrap in YAML strictly: an unknown
// field fails, and protoc-gen-validate's rules apply.
func parseBootstrap(file string) (*bootstrapv3.Bootstrap, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	j, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("yaml: %w", err)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(j, &b); err != nil {
		return nil, fmt.Errorf("as envoy.config.bootstrap.v3.Bootstrap: %w", err)
	}
	if err := b.ValidateAll(); err != nil {
		return nil, fmt.Errorf("invalid bootstrap: %w", err)
	}
	return &b, nil
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// prometheusConfigFile is what the checks read of prometheus.yml.
type prometheusConfigFile struct {
	RuleFiles     []string `json:"rule_files"`
	ScrapeConfigs []struct {
		JobName       string `json:"job_name"`
		MetricsPath   string `json:"metrics_path"`
		Scheme        string `json:"scheme"`
		StaticConfigs []struct {
			Targets []string `json:"targets"`
		} `json:"static_configs"`
	} `json:"scrape_configs"`
}

// promConfig is prometheus.yml with its rule files as paths inside the
// container.
type promConfig struct {
	file      prometheusConfigFile
	ruleFiles []string
}

// prometheusConfig reads the prometheus service's --config.file through
// its bind mount.
func (s *stack) prometheusConfig() (*promConfig, string, error) {
	svc, err := s.service(svcPrometheus)
	if err != nil {
		return nil, "", err
	}
	argv, _ := s.argv(svc)
	inside := defaultPrometheusConfig
	if v := flagValues(argv, "--config.file"); len(v) > 0 {
		inside = v[len(v)-1]
	}
	host, err := s.hostPath(svc.Name, inside)
	if err != nil {
		return nil, "", err
	}
	data, err := os.ReadFile(host)
	if err != nil {
		return nil, "", err
	}
	var pc promConfig
	if err := yaml.Unmarshal(data, &pc.file); err != nil {
		return nil, "", fmt.Errorf("service %q: %s: %w", svc.Name, s.rel(host), err)
	}
	for _, rf := range pc.file.RuleFiles {
		if !path.IsAbs(rf) {
			rf = path.Join(path.Dir(inside), rf)
		}
		pc.ruleFiles = append(pc.ruleFiles, rf)
	}
	return &pc, host, nil
}

// checkPrometheus: Prometheus scrapes tether's admin port (/metrics, plain
// HTTP), every scrape target is a service, and every rule file is mounted,
// deploy/prometheus/alerts.yml among them.
func (s *stack) checkPrometheus(cfg *config.Config) {
	pc, host, err := s.prometheusConfig()
	if err != nil {
		s.add(err)
		return
	}
	where := fmt.Sprintf("service %q: %s", svcPrometheus, s.rel(host))
	want := net.JoinHostPort(svcTether, strconv.Itoa(int(port(cfg.Server.AdminAddr))))
	found := false
	for _, sc := range pc.file.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			for _, target := range st.Targets {
				h, _, err := net.SplitHostPort(target)
				if _, ok := s.p.Services[h]; err != nil || !ok {
					s.errf("%s: job %s: target %q is not SERVICE:PORT of a compose service", where, sc.JobName, target)
				}
				if target == want && (sc.MetricsPath == "" || sc.MetricsPath == "/metrics") && (sc.Scheme == "" || sc.Scheme == "http") {
					found = true
				}
			}
		}
	}
	if !found {
		s.errf("%s: no job scrapes tether's /metrics at %s (the tether service, port of server.admin_addr %s)", where, want, cfg.Server.AdminAddr)
	}
	alerts := filepath.Join(s.root, alertsFile)
	loaded := false
	for _, rf := range pc.ruleFiles {
		h, err := s.hostPath(svcPrometheus, rf)
		if err != nil {
			s.errf("%s: rule_files %s: %v", where, rf, err)
			continue
		}
		loaded = loaded || h == alerts
	}
	if !loaded {
		s.errf("%s: rule_files do not load %s", where, alertsFile)
	}
}

// grafanaDatasources is a datasource provisioning file.
type grafanaDatasources struct {
	APIVersion  int `json:"apiVersion"`
	Datasources []struct {
		Name      string `json:"name"`
		UID       string `json:"uid"`
		Type      string `json:"type"`
		Access    string `json:"access"`
		URL       string `json:"url"`
		IsDefault bool   `json:"isDefault"`
		Editable  bool   `json:"editable"`
		JSONData  struct {
			TimeInterval string `json:"timeInterval"`
		} `json:"jsonData"`
	} `json:"datasources"`
}

// grafanaDashboards is a dashboard provider provisioning file.
type grafanaDashboards struct {
	APIVersion int `json:"apiVersion"`
	Providers  []struct {
		Name                  string `json:"name"`
		Folder                string `json:"folder"`
		Type                  string `json:"type"`
		DisableDeletion       bool   `json:"disableDeletion"`
		AllowUIUpdates        bool   `json:"allowUiUpdates"`
		UpdateIntervalSeconds int    `json:"updateIntervalSeconds"`
		Options               struct {
			Path                      string `json:"path"`
			FoldersFromFilesStructure bool   `json:"foldersFromFilesStructure"`
		} `json:"options"`
	} `json:"providers"`
}

// checkGrafana: the provisioning directories are mounted where Grafana
// reads them; a datasource of type prometheus points at the prometheus
// service's port; a file provider's path holds deploy/grafana/tether.json,
// which parses.
func (s *stack) checkGrafana() {
	svc, err := s.service(svcGrafana)
	if err != nil {
		s.add(err)
		return
	}
	prov := defaultGrafanaProvision
	if v, ok := svc.Environment["GF_PATHS_PROVISIONING"]; ok && v != nil {
		prov = *v
	}
	promPort := defaultPrometheusPort
	if psvc, err := s.service(svcPrometheus); err == nil {
		if v := flagValues(psvc.Command, "--web.listen-address"); len(v) > 0 {
			promPort = int(port(v[len(v)-1]))
		}
	}
	wantURL := fmt.Sprintf("http://%s:%d", svcPrometheus, promPort)

	// Datasources.
	dsOK := false
	for _, f := range s.provisioningFiles(svc.Name, path.Join(prov, "datasources")) {
		var ds grafanaDatasources
		if err := yaml.UnmarshalStrict(f.data, &ds); err != nil {
			s.errf("service %q: %s: %v", svc.Name, s.rel(f.host), err)
			continue
		}
		for _, d := range ds.Datasources {
			if d.Type == "prometheus" && strings.TrimSuffix(d.URL, "/") == wantURL {
				dsOK = true
			}
		}
	}
	if !dsOK {
		s.errf("service %q: no datasource of type prometheus at %s is provisioned in %s/datasources", svc.Name, wantURL, prov)
	}

	// Dashboards.
	dashboard := filepath.Join(s.root, dashboardFile)
	var dashOK bool
	var paths []string
	for _, f := range s.provisioningFiles(svc.Name, path.Join(prov, "dashboards")) {
		var dp grafanaDashboards
		if err := yaml.UnmarshalStrict(f.data, &dp); err != nil {
			s.errf("service %q: %s: %v", svc.Name, s.rel(f.host), err)
			continue
		}
		for _, p := range dp.Providers {
			if p.Type != "file" && p.Type != "" {
				continue
			}
			paths = append(paths, p.Options.Path)
			host, err := s.hostPath(svc.Name, path.Join(p.Options.Path, "tether.json"))
			if err == nil && host == dashboard {
				dashOK = true
			}
		}
	}
	if !dashOK {
		s.errf("service %q: %s is not mounted in a dashboard provider's path (providers' paths: %v)", svc.Name, dashboardFile, paths)
	}
	data, err := os.ReadFile(dashboard)
	if err != nil {
		s.add(err)
		return
	}
	var d struct {
		Title string `json:"title"`
	}
	if err := json.Unmarshal(data, &d); err != nil || d.Title == "" {
		s.errf("%s: not a dashboard with a title: %v", dashboardFile, err)
	}
}

type provFile struct {
	host string
	data []byte
}

// provisioningFiles reads the YAML files Grafana would read in a
// provisioning directory of the service.
func (s *stack) provisioningFiles(service, dir string) []provFile {
	host, err := s.hostPath(service, dir)
	if err != nil {
		return nil
	}
	entries, err := os.ReadDir(host)
	if err != nil {
		s.errf("service %q: %s (%s): %v", service, dir, s.rel(host), err)
		return nil
	}
	var out []provFile
	for _, e := range entries {
		if e.IsDir() || (filepath.Ext(e.Name()) != ".yml" && filepath.Ext(e.Name()) != ".yaml") {
			continue
		}
		f := filepath.Join(host, e.Name())
		data, err := os.ReadFile(f)
		if err != nil {
			s.add(err)
			continue
		}
		out = append(out, provFile{host: f, data: data})
	}
	return out
}

func TestPinned(t *testing.T) {
	for image, want := range map[string]bool{
		"redis:7.4.2":                             true,
		"envoyproxy/envoy:v1.40.0":                true,
		"redis":                                   false,
		"redis:latest":                            false,
		"localhost:5000/redis":                    false,
		"localhost:5000/redis:7.4.2":              true,
		"redis@sha256:" + strings.Repeat("a", 64): true,
	} {
		if got := pinned(image); got != want {
			t.Errorf("pinned(%q) = %v, want %v", image, got, want)
		}
	}
}
