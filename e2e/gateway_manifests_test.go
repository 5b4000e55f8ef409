//go:build e2e

package e2e

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v6"
	inferencev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	"sigs.k8s.io/yaml"

	"github.com/tetherproxy/tether/config"
)

// The InferencePool CRD as the Inference Extension's Go module ships it
// (go.mod pins the module's version), and the API version it must serve.
const (
	gieModule     = "sigs.k8s.io/gateway-api-inference-extension"
	poolCRDPath   = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
	poolGroup     = "inference.networking.k8s.io"
	poolVersion   = "v1"
	gatewayAPIDir = "../deploy/gateway-api"
)

// TestGatewayManifests checks deploy/gateway-api/<gateway>/: each
// InferencePool against the CRD's openAPIV3Schema and the module's Go
// types (strictly: an unknown field fails), each tether.toml with
// `tether config validate`, and that the pieces name each other: the
// route's backend is the pool, its parent the Gateway beside it; the pool's
// picker is tether's Service on tether's ext_proc port; the headless
// Service tether resolves selects the pool's pods on its target port.
func TestGatewayManifests(t *testing.T) {
	schema := poolSchema(t)
	dirs, err := filepath.Glob(filepath.Join(gatewayAPIDir, "*"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, d := range dirs {
		names = append(names, filepath.Base(d))
	}
	if want := "envoy-ai-gateway gke istio kgateway"; strings.Join(names, " ") != want {
		t.Fatalf("deploy/gateway-api holds %v, want %s", names, want)
	}
	for _, dir := range dirs {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			objs := readManifests(t, dir)
			pool := one(t, objs, "InferencePool")
			if err := validatePool(schema, pool.raw); err != nil {
				t.Fatalf("InferencePool %s: %v", pool.name(), err)
			}
			checkPool(t, objs, pool)
			checkRoute(t, objs, pool)
			checkTether(t, filepath.Base(dir), objs, pool)
		})
	}
}

// TestGatewayManifestsBadPools: the validator refuses what the API server
// would.
func TestGatewayManifestsBadPools(t *testing.T) {
	schema := poolSchema(t)
	good := one(t, readManifests(t, filepath.Join(gatewayAPIDir, "istio")), "InferencePool").raw
	if err := validatePool(schema, good); err != nil {
		t.Fatalf("the good pool: %v", err)
	}
	for _, tc := range []struct{ name, from, to string }{
		{"no selector", "  selector:\n    matchLabels:\n      app: vllm-llama3-8b\n", ""},
		{"target port out of range", "    - number: 8000\n", "    - number: 70000\n"},
		{"target port 0", "    - number: 8000\n", "    - number: 0\n"},
		{"unknown failure mode", "failureMode: FailOpen", "failureMode: FailSometimes"},
		{"unknown field", "    port:\n      number: 9002\n", "    portNumber: 9002\n    port:\n      number: 9002\n"},
		{"picker port missing", "    port:\n      number: 9002\n", ""},
		{"target port twice", "    - number: 8000\n", "    - number: 8000\n    - number: 8000\n"},
		{"no target ports", "  targetPorts:\n    - number: 8000\n", ""},
		{"v1alpha2", "apiVersion: inference.networking.k8s.io/v1\n", "apiVersion: inference.networking.x-k8s.io/v1alpha2\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bad := strings.Replace(string(good), tc.from, tc.to, 1)
			if bad == string(good) {
				t.Fatalf("%q is not in the pool", tc.from)
			}
			err := validatePool(schema, []byte(bad))
			if err == nil {
				t.Fatalf("a pool with %s passed:\n%s", tc.name, bad)
			}
			t.Logf("refused: %v", err)
		})
	}
}

// poolSchema compiles the v1 openAPIV3Schema of the CRD in the module's
// directory, as a JSON Schema (draft 4, which OpenAPI v3's schema object
// follows). The API server's own rules beyond the schema are kept where
// they are plain JSON Schema: x-kubernetes-* extensions are dropped, and an
// object that lists its properties takes no others, as kubectl's strict
// field validation refuses unknown fields. The CRD's CEL rules
// (x-kubernetes-validations) must be the ones celRules checks by hand.
func poolSchema(t *testing.T) *jsonschema.Schema {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", gieModule).Output()
	if err != nil || len(bytes.TrimSpace(out)) == 0 {
		t.Fatalf("go list -m %s: %v %s", gieModule, err, out)
	}
	crd, err := os.ReadFile(filepath.Join(string(bytes.TrimSpace(out)), poolCRDPath))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Spec struct {
			Group    string `json:"group"`
			Versions []struct {
				Name   string `json:"name"`
				Served bool   `json:"served"`
				Schema struct {
					OpenAPIV3Schema json.RawMessage `json:"openAPIV3Schema"`
				} `json:"schema"`
			} `json:"versions"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(crd, &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Spec.Group != poolGroup {
		t.Fatalf("the CRD's group is %q", doc.Spec.Group)
	}
	for _, v := range doc.Spec.Versions {
		if v.Name != poolVersion || !v.Served {
			continue
		}
		s, err := jsonschema.UnmarshalJSON(bytes.NewReader(v.Schema.OpenAPIV3Schema))
		if err != nil {
			t.Fatal(err)
		}
		rules := map[string]bool{}
		celOf(s, rules)
		for r := range rules {
			if _, ok := celRules[r]; !ok {
				t.Fatalf("the CRD has a CEL rule this test does not check: %s", r)
			}
		}
		c := jsonschema.NewCompiler()
		c.DefaultDraft(jsonschema.Draft4)
		if err := c.AddResource("inferencepool.json", structural(s)); err != nil {
			t.Fatal(err)
		}
		sch, err := c.Compile("inferencepool.json")
		if err != nil {
			t.Fatal(err)
		}
		return sch
	}
	t.Fatalf("the CRD serves no %s", poolVersion)
	return nil
}

// celRules are the CEL rules of the CRD's v1 schema, each checked in Go.
var celRules = map[string]func(*inferencev1.InferencePool) error{
	"self.kind != 'Service' || has(self.port)": func(p *inferencev1.InferencePool) error {
		if r := p.Spec.EndpointPickerRef; (r.Kind == "" || r.Kind == "Service") && r.Port == nil {
			return fmt.Errorf("endpointPickerRef: a Service needs its port")
		}
		return nil
	},
	"self.all(p1, self.exists_one(p2, p1.number==p2.number))": func(p *inferencev1.InferencePool) error {
		seen := map[int32]bool{}
		for _, tp := range p.Spec.TargetPorts {
			if seen[int32(tp.Number)] {
				return fmt.Errorf("targetPorts: %d twice", tp.Number)
			}
			seen[int32(tp.Number)] = true
		}
		return nil
	},
}

// celOf collects the CEL rules of a schema.
func celOf(v any, rules map[string]bool) {
	switch n := v.(type) {
	case map[string]any:
		for k, x := range n {
			if k != "x-kubernetes-validations" {
				celOf(x, rules)
				continue
			}
			for _, r := range x.([]any) {
				rules[r.(map[string]any)["rule"].(string)] = true
			}
		}
	case []any:
		for _, x := range n {
			celOf(x, rules)
		}
	}
}

// structural rewrites a CRD schema node as a JSON Schema (poolSchema).
func structural(v any) any {
	switch n := v.(type) {
	case map[string]any:
		out := map[string]any{}
		for k, x := range n {
			if strings.HasPrefix(k, "x-kubernetes-") {
				continue
			}
			if k == "properties" {
				props := map[string]any{}
				for name, p := range x.(map[string]any) {
					props[name] = structural(p)
				}
				out[k] = props
				continue
			}
			out[k] = structural(x)
		}
		_, open := n["x-kubernetes-preserve-unknown-fields"]
		if _, listed := n["properties"]; listed && !open && n["additionalProperties"] == nil {
			out["additionalProperties"] = false
		}
		return out
	case []any:
		out := make([]any, len(n))
		for i, x := range n {
			out[i] = structural(x)
		}
		return out
	}
	return v
}

// validatePool checks one InferencePool, as YAML: its apiVersion and kind,
// the CRD's schema, a strict decode into the module's Go type, then the
// CRD's CEL rules.
func validatePool(schema *jsonschema.Schema, doc []byte) error {
	js, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return err
	}
	var head struct{ APIVersion, Kind string }
	if err := json.Unmarshal(js, &head); err != nil {
		return err
	}
	if head.APIVersion != poolGroup+"/"+poolVersion || head.Kind != "InferencePool" {
		return fmt.Errorf("%s %s, want %s/%s InferencePool", head.APIVersion, head.Kind, poolGroup, poolVersion)
	}
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(js))
	if err != nil {
		return err
	}
	if err := schema.Validate(inst); err != nil {
		return err
	}
	var typed inferencev1.InferencePool
	if err := yaml.UnmarshalStrict(doc, &typed); err != nil {
		return err
	}
	for _, check := range celRules {
		if err := check(&typed); err != nil {
			return err
		}
	}
	return nil
}

// object is one manifest of a file: its YAML and what the checks read.
type object struct {
	raw  []byte
	file string
	obj  map[string]any
}

func (o object) kind() string { return str(o.obj, "kind") }
func (o object) name() string { return str(o.obj, "metadata", "name") }

// readManifests reads every document of the YAML files in dir: all that
// `kubectl apply -f dir` applies. Each must be a Kubernetes object.
func readManifests(t *testing.T, dir string) []object {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var objs []object
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range regexp.MustCompile(`(?m)^---\n`).Split(string(data), -1) {
			var m map[string]any
			if err := yaml.Unmarshal([]byte(doc), &m); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			if m == nil {
				continue
			}
			o := object{raw: []byte(doc), file: filepath.Base(f), obj: m}
			if o.kind() == "" || o.name() == "" {
				t.Fatalf("%s: a document with no kind or name", f)
			}
			if ns := str(m, "metadata", "namespace"); o.kind() != "GatewayClass" && ns != "inference" {
				t.Errorf("%s: %s %s is in namespace %q, want inference", f, o.kind(), o.name(), ns)
			}
			objs = append(objs, o)
		}
	}
	return objs
}

// checkPool: the picker is tether's Service, failing open; the headless
// Service selects the pool's pods on its target port.
func checkPool(t *testing.T, objs []object, pool object) {
	t.Helper()
	ref := get(pool.obj, "spec", "endpointPickerRef")
	if str(ref, "failureMode") != "FailOpen" {
		t.Errorf("failureMode %q, want FailOpen", str(ref, "failureMode"))
	}
	svc := named(t, objs, "Service", str(ref, "name"))
	port := num(get(ref, "port"), "number")
	sp := servicePort(t, svc, port)
	if sp["targetPort"] != "extproc" {
		t.Errorf("Service %s port %d goes to %v, want the container port extproc", svc.name(), port, sp["targetPort"])
	}
	headless := headlessService(t, objs)
	if !equalJSON(get(pool.obj, "spec", "selector", "matchLabels"), get(headless.obj, "spec", "selector")) {
		t.Errorf("the headless Service %s selects %v, the pool %v", headless.name(),
			get(headless.obj, "spec", "selector"), get(pool.obj, "spec", "selector", "matchLabels"))
	}
	target := num(list(pool.obj, "spec", "targetPorts")[0].(map[string]any), "number")
	servicePort(t, headless, target)
}

// checkRoute: the HTTPRoute sends the Gateway beside it to the pool.
func checkRoute(t *testing.T, objs []object, pool object) {
	t.Helper()
	route := one(t, objs, "HTTPRoute")
	gw := one(t, objs, "Gateway")
	parent := list(route.obj, "spec", "parentRefs")[0].(map[string]any)
	if str(parent, "name") != gw.name() || str(parent, "kind") != "Gateway" {
		t.Errorf("the route's parent is %v, want Gateway %s", parent, gw.name())
	}
	for _, r := range list(route.obj, "spec", "rules") {
		for _, b := range list(r.(map[string]any), "backendRefs") {
			b := b.(map[string]any)
			if str(b, "group") != poolGroup || str(b, "kind") != "InferencePool" || str(b, "name") != pool.name() {
				t.Errorf("the route's backend is %v, want InferencePool %s", b, pool.name())
			}
		}
	}
}

// checkTether runs `tether config validate` on the ConfigMap's tether.toml
// and checks it against the rest: the ext_proc port, the headless Service
// it resolves, TLS where the gateway calls the picker over TLS (all but
// Istio), fallbacks where the gateway takes a list (Istio alone).
func checkTether(t *testing.T, gateway string, objs []object, pool object) {
	t.Helper()
	cm := named(t, objs, "ConfigMap", "tether-config")
	toml := str(cm.obj, "data", "tether.toml")
	dir := t.TempDir()
	cert, key := selfSigned(t, dir)
	local := strings.NewReplacer(`"/etc/tether-tls/tls.crt"`, strconv.Quote(cert), `"/etc/tether-tls/tls.key"`, strconv.Quote(key)).Replace(toml)
	path := filepath.Join(dir, "tether.toml")
	if err := os.WriteFile(path, []byte(local), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(tetherBin, "config", "validate", path)
	cmd.Env = append(os.Environ(), "TETHER_IDENTITY_SECRET="+secret)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("tether config validate: %v\n%s", err, out)
	}
	c, err := config.Parse([]byte(toml))
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(c.Server.ExtProcAddr)
	if p := num(get(pool.obj, "spec", "endpointPickerRef", "port"), "number"); port != strconv.Itoa(p) {
		t.Errorf("server.extproc_addr %s, the pool's picker port %d", c.Server.ExtProcAddr, p)
	}
	if p := containerPort(t, named(t, objs, "Deployment", "tether"), "extproc"); port != strconv.Itoa(p) {
		t.Errorf("server.extproc_addr %s, the container port extproc %d", c.Server.ExtProcAddr, p)
	}
	headless := headlessService(t, objs)
	host := fmt.Sprintf("%s.%s.svc.cluster.local.", headless.name(), str(headless.obj, "metadata", "namespace"))
	target := num(list(pool.obj, "spec", "targetPorts")[0].(map[string]any), "number")
	if len(c.Discovery.DNS) != 1 || c.Discovery.DNS[0].Host != host || c.Discovery.DNS[0].Port != target {
		t.Errorf("[[discovery.dns]] %+v, want host %s port %d", c.Discovery.DNS, host, target)
	}
	wantFallbacks, wantTLS := 0, true
	if gateway == "istio" {
		wantFallbacks, wantTLS = 2, false
	}
	if c.Server.DestinationFallbacks != wantFallbacks {
		t.Errorf("server.destination_fallbacks = %d, want %d", c.Server.DestinationFallbacks, wantFallbacks)
	}
	if (c.TLS.CertFile != "") != wantTLS {
		t.Errorf("tls.cert_file = %q: TLS on should be %v", c.TLS.CertFile, wantTLS)
	}
}

// selfSigned writes a certificate and key, for the [tls] of the files.
func selfSigned(t *testing.T, dir string) (cert, key string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "tether-epp.inference.svc"},
		DNSNames:     []string{"tether-epp.inference.svc"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	cert, key = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	for path, block := range map[string]*pem.Block{cert: {Type: "CERTIFICATE", Bytes: der}, key: {Type: "EC PRIVATE KEY", Bytes: kder}} {
		if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return cert, key
}

func one(t *testing.T, objs []object, kind string) object {
	t.Helper()
	var found []object
	for _, o := range objs {
		if o.kind() == kind {
			found = append(found, o)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%d of kind %s, want 1", len(found), kind)
	}
	return found[0]
}

func named(t *testing.T, objs []object, kind, name string) object {
	t.Helper()
	for _, o := range objs {
		if o.kind() == kind && o.name() == name {
			return o
		}
	}
	t.Fatalf("no %s %s", kind, name)
	return object{}
}

func headlessService(t *testing.T, objs []object) object {
	t.Helper()
	for _, o := range objs {
		if o.kind() == "Service" && str(o.obj, "spec", "clusterIP") == "None" {
			return o
		}
	}
	t.Fatal("no headless Service")
	return object{}
}

func servicePort(t *testing.T, svc object, port int) map[string]any {
	t.Helper()
	for _, p := range list(svc.obj, "spec", "ports") {
		if p := p.(map[string]any); num(p, "port") == port {
			return p
		}
	}
	t.Fatalf("Service %s has no port %d", svc.name(), port)
	return nil
}

func containerPort(t *testing.T, d object, name string) int {
	t.Helper()
	for _, c := range list(d.obj, "spec", "template", "spec", "containers") {
		for _, p := range list(c.(map[string]any), "ports") {
			if p := p.(map[string]any); str(p, "name") == name {
				return num(p, "containerPort")
			}
		}
	}
	t.Fatalf("Deployment %s has no container port %s", d.name(), name)
	return 0
}

func get(m map[string]any, path ...string) map[string]any {
	for _, k := range path {
		m, _ = m[k].(map[string]any)
	}
	return m
}

func str(m map[string]any, path ...string) string {
	s, _ := get(m, path[:len(path)-1]...)[path[len(path)-1]].(string)
	return s
}

func num(m map[string]any, key string) int {
	f, _ := m[key].(float64)
	return int(f)
}

func list(m map[string]any, path ...string) []any {
	l, _ := get(m, path[:len(path)-1]...)[path[len(path)-1]].([]any)
	return l
}

func equalJSON(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return len(a.(map[string]any)) > 0 && bytes.Equal(x, y)
}
