// Package k8s_test checks the Kubernetes manifests in deploy/k8s: every
// document decodes strictly into its Kubernetes API type (an unknown or
// misspelt field fails, naming the file and the field), the objects agree
// with each other and with the tether.toml they carry, and the Istio
// EnvoyFilter's patches parse as the Envoy messages they stand for and say
// what tether's own xDS server gives a standalone Envoy (xds.Build).
package k8s_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/anypb"
	istionet "istio.io/api/networking/v1alpha3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	// The Any types the patches name, so protojson can resolve them.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/http/early_header_mutation/header_mutation/v3"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/plan"
	"github.com/tetherproxy/tether/store"
	"github.com/tetherproxy/tether/xds"
)

const (
	namespace     = "tether"
	configKey     = "tether.toml"
	configMount   = "/etc/tether"
	gatewayLabel  = "ingressgateway"
	extProcFilter = "envoy.filters.http.ext_proc"
)

// object is one decoded document.
type object struct {
	file string
	obj  any // *appsv1.Deployment, *corev1.Service, …, *envoyFilter
}

// envoyFilter is an Istio EnvoyFilter: its spec is decoded by the Istio API's
// own protobuf type (istio.io/api), and each patch value by the Envoy
// message it patches.
type envoyFilter struct {
	metav1.TypeMeta
	Metadata metav1.ObjectMeta
	Spec     *istionet.EnvoyFilter
	Patches  []patch
}

type patch struct {
	applyTo istionet.EnvoyFilter_ApplyTo
	op      istionet.EnvoyFilter_Patch_Operation
	msg     proto.Message // *clusterv3.Cluster, *hcmv3.HttpFilter or *listenerv3.Filter
}

// kinds are the Kubernetes types the manifests may hold.
var kinds = map[string]func() any{
	"v1/Namespace":                             func() any { return &corev1.Namespace{} },
	"v1/ConfigMap":                             func() any { return &corev1.ConfigMap{} },
	"v1/Service":                               func() any { return &corev1.Service{} },
	"v1/Secret":                                func() any { return &corev1.Secret{} },
	"apps/v1/Deployment":                       func() any { return &appsv1.Deployment{} },
	"policy/v1/PodDisruptionBudget":            func() any { return &policyv1.PodDisruptionBudget{} },
	"networking.k8s.io/v1/NetworkPolicy":       func() any { return &networkingv1.NetworkPolicy{} },
	"networking.istio.io/v1alpha3/EnvoyFilter": nil, // decodeEnvoyFilter
}

var docSep = regexp.MustCompile(`(?m)^---[ \t]*$`)

// decodeFile decodes every document of a manifest file.
func decodeFile(file string, data []byte) ([]object, error) {
	var out []object
	for i, doc := range docSep.Split(string(data), -1) {
		where := file
		if i > 0 {
			where = fmt.Sprintf("%s (document %d)", file, i+1)
		}
		obj, err := decodeDoc([]byte(doc))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if obj != nil {
			out = append(out, object{file: where, obj: obj})
		}
	}
	return out, nil
}

// decodeDoc decodes one YAML document strictly; an empty one gives nil.
func decodeDoc(doc []byte) (any, error) {
	js, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return nil, fmt.Errorf("yaml: %w", err)
	}
	if t := bytes.TrimSpace(js); len(t) == 0 || string(t) == "null" {
		return nil, nil
	}
	var tm metav1.TypeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return nil, fmt.Errorf("not a Kubernetes object: %w", err)
	}
	key := tm.APIVersion + "/" + tm.Kind
	mk, known := kinds[key]
	if !known {
		return nil, fmt.Errorf("apiVersion %q kind %q: not a kind this test knows (add it to kinds)", tm.APIVersion, tm.Kind)
	}
	if mk == nil {
		return decodeEnvoyFilter(js)
	}
	obj := mk()
	if err := strictJSON(js, obj); err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	return obj, nil
}

// strictJSON decodes js into v refusing unknown fields, and names the path
// of the field that failed. encoding/json matches field names without
// regard to case, so a field the decoder took under another case
// ("Replicas") is refused too: every key of the input must come back when v
// is encoded again, unless its value is empty (and so left out).
func strictJSON(js []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
			name, _ = strconv.Unquote(name)
			return fmt.Errorf("unknown field %s", strings.Join(pathsOf(js, name), ", "))
		}
		return err
	}
	if dec.More() {
		return errors.New("trailing data after the object")
	}
	back, err := json.Marshal(v)
	if err != nil {
		return err
	}
	var in, out any
	if err := json.Unmarshal(js, &in); err != nil {
		return err
	}
	if err := json.Unmarshal(back, &out); err != nil {
		return err
	}
	var lost []string
	droppedKeys(in, out, "", &lost)
	if len(lost) > 0 {
		return fmt.Errorf("unknown field %s (the field names are case-sensitive)", strings.Join(lost, ", "))
	}
	return nil
}

// pathsOf returns the paths in js of every key called name.
func pathsOf(js []byte, name string) []string {
	var v any
	if json.Unmarshal(js, &v) != nil {
		return []string{strconv.Quote(name)}
	}
	var paths []string
	var walk func(v any, path string)
	walk = func(v any, path string) {
		switch v := v.(type) {
		case map[string]any:
			for _, k := range sortedKeys(v) {
				p := join(path, k)
				if k == name {
					paths = append(paths, strconv.Quote(p))
				}
				walk(v[k], p)
			}
		case []any:
			for i, e := range v {
				walk(e, fmt.Sprintf("%s[%d]", path, i))
			}
		}
	}
	walk(v, "")
	if len(paths) == 0 {
		return []string{strconv.Quote(name)}
	}
	return paths
}

// droppedKeys lists the keys of in, with a non-empty value, that out lacks.
func droppedKeys(in, out any, path string, lost *[]string) {
	switch in := in.(type) {
	case map[string]any:
		o, _ := out.(map[string]any)
		for _, k := range sortedKeys(in) {
			p := join(path, k)
			ov, ok := o[k]
			if !ok {
				if !empty(in[k]) {
					*lost = append(*lost, strconv.Quote(p))
				}
				continue
			}
			droppedKeys(in[k], ov, p, lost)
		}
	case []any:
		o, _ := out.([]any)
		for i, e := range in {
			if i < len(o) {
				droppedKeys(e, o[i], fmt.Sprintf("%s[%d]", path, i), lost)
			}
		}
	}
}

func empty(v any) bool {
	switch v := v.(type) {
	case nil:
		return true
	case bool:
		return !v
	case float64:
		return v == 0
	case string:
		return v == ""
	case []any:
		return len(v) == 0
	case map[string]any:
		return len(v) == 0
	}
	return false
}

func join(path, k string) string {
	if path == "" {
		return k
	}
	return path + "." + k
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// decodeEnvoyFilter decodes an EnvoyFilter: the object strictly, its spec
// with the Istio API's type (protojson refuses unknown fields), and each
// patch value as the Envoy message of its applyTo.
func decodeEnvoyFilter(js []byte) (*envoyFilter, error) {
	var raw struct {
		metav1.TypeMeta `json:",inline"`
		Metadata        metav1.ObjectMeta `json:"metadata"`
		Spec            json.RawMessage   `json:"spec"`
	}
	if err := strictJSON(js, &raw); err != nil {
		return nil, fmt.Errorf("EnvoyFilter: %w", err)
	}
	ef := &envoyFilter{TypeMeta: raw.TypeMeta, Metadata: raw.Metadata, Spec: &istionet.EnvoyFilter{}}
	if err := protojson.Unmarshal(raw.Spec, ef.Spec); err != nil {
		return nil, fmt.Errorf("EnvoyFilter spec: %w", err)
	}
	for i, cp := range ef.Spec.GetConfigPatches() {
		var msg proto.Message
		switch cp.GetApplyTo() {
		case istionet.EnvoyFilter_CLUSTER:
			msg = &clusterv3.Cluster{}
		case istionet.EnvoyFilter_HTTP_FILTER:
			msg = &hcmv3.HttpFilter{}
		case istionet.EnvoyFilter_NETWORK_FILTER:
			msg = &listenerv3.Filter{}
		default:
			return nil, fmt.Errorf("EnvoyFilter spec.configPatches[%d]: applyTo %s: not a patch this test knows", i, cp.GetApplyTo())
		}
		value, err := protojson.Marshal(cp.GetPatch().GetValue())
		if err != nil {
			return nil, fmt.Errorf("EnvoyFilter spec.configPatches[%d].patch.value: %w", i, err)
		}
		if err := (protojson.UnmarshalOptions{DiscardUnknown: false}).Unmarshal(value, msg); err != nil {
			return nil, fmt.Errorf("EnvoyFilter spec.configPatches[%d].patch.value (%s as %s): %w",
				i, cp.GetApplyTo(), msg.ProtoReflect().Descriptor().FullName(), err)
		}
		ef.Patches = append(ef.Patches, patch{applyTo: cp.GetApplyTo(), op: cp.GetPatch().GetOperation(), msg: msg})
	}
	return ef, nil
}

// manifests holds every object of deploy/k8s, decoded.
type manifests struct {
	all        []object
	deployment *appsv1.Deployment
	configMap  *corev1.ConfigMap
	services   []*corev1.Service
	pdb        *policyv1.PodDisruptionBudget
	netpol     *networkingv1.NetworkPolicy
	namespace  *corev1.Namespace
	filter     *envoyFilter
}

func load(t *testing.T) *manifests {
	t.Helper()
	files, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	yml, _ := filepath.Glob("*.yml")
	files = append(files, yml...)
	if len(files) == 0 {
		t.Fatal("no manifests in deploy/k8s")
	}
	m := &manifests{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		objs, err := decodeFile(f, data)
		if err != nil {
			t.Fatal(err)
		}
		m.all = append(m.all, objs...)
	}
	for _, o := range m.all {
		switch v := o.obj.(type) {
		case *appsv1.Deployment:
			setOnce(t, &m.deployment, v, o.file)
		case *corev1.ConfigMap:
			setOnce(t, &m.configMap, v, o.file)
		case *policyv1.PodDisruptionBudget:
			setOnce(t, &m.pdb, v, o.file)
		case *networkingv1.NetworkPolicy:
			setOnce(t, &m.netpol, v, o.file)
		case *corev1.Namespace:
			setOnce(t, &m.namespace, v, o.file)
		case *envoyFilter:
			setOnce(t, &m.filter, v, o.file)
		case *corev1.Service:
			m.services = append(m.services, v)
		}
	}
	for name, missing := range map[string]bool{
		"Deployment": m.deployment == nil, "ConfigMap": m.configMap == nil, "PodDisruptionBudget": m.pdb == nil,
		"Service": len(m.services) == 0, "EnvoyFilter": m.filter == nil, "NetworkPolicy": m.netpol == nil,
	} {
		if missing {
			t.Fatalf("deploy/k8s has no %s", name)
		}
	}
	return m
}

// setOnce sets *dst to v, failing when the manifests hold a second one.
func setOnce[T any](t *testing.T, dst **T, v *T, file string) {
	t.Helper()
	if *dst != nil {
		t.Fatalf("%s: a second %T", file, v)
	}
	*dst = v
}

// tetherConfig parses the ConfigMap's tether.toml as tether does, and as
// `tether config validate` does (the Redis URL past its scheme too).
func (m *manifests) tetherConfig(t *testing.T) config.Config {
	t.Helper()
	data, ok := m.configMap.Data[configKey]
	if !ok {
		t.Fatalf("ConfigMap %s has no %s", m.configMap.Name, configKey)
	}
	cfg, err := config.Parse([]byte(data))
	if err != nil {
		t.Fatalf("ConfigMap %s: %s: %v", m.configMap.Name, configKey, err)
	}
	if err := store.CheckURL(cfg.Redis.URL); err != nil {
		t.Fatalf("ConfigMap %s: %s: redis.url: %v", m.configMap.Name, configKey, err)
	}
	return cfg
}

func port(t *testing.T, key, hostport string) int32 {
	t.Helper()
	host, p, err := net.SplitHostPort(hostport)
	if err != nil {
		t.Fatalf("%s = %q: %v", key, hostport, err)
	}
	// The kubelet probes, Envoy and Prometheus reach the pod on its IP.
	if ip := net.ParseIP(host); host == "localhost" || (ip != nil && ip.IsLoopback()) {
		t.Errorf("%s = %q: a loopback address cannot be reached from outside the pod", key, hostport)
	}
	n, err := strconv.Atoi(p)
	if err != nil || n <= 0 || n > 65535 {
		t.Fatalf("%s = %q: want a port from 1 to 65535", key, hostport)
	}
	return int32(n)
}

// TestManifestsDecodeStrictly: every document in deploy/k8s is an object
// of a known kind, with no field its type lacks.
func TestManifestsDecodeStrictly(t *testing.T) {
	m := load(t)
	for _, o := range m.all {
		var ns string
		switch v := o.obj.(type) {
		case *corev1.Namespace:
			continue
		case *envoyFilter:
			continue // beside the gateway, in istio-system
		case metav1.Object:
			ns = v.GetNamespace()
		}
		if ns != namespace {
			t.Errorf("%s: namespace %q, want %q", o.file, ns, namespace)
		}
	}
	if m.namespace != nil && m.namespace.Name != namespace {
		t.Errorf("Namespace %q, want %q", m.namespace.Name, namespace)
	}
}

func TestDeployment(t *testing.T) {
	m := load(t)
	cfg := m.tetherConfig(t)
	d := m.deployment
	if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
		t.Errorf("Deployment %s: replicas %v, want at least 2", d.Name, d.Spec.Replicas)
	}
	sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
	if err != nil || sel.Empty() {
		t.Fatalf("Deployment %s: selector %v: %v", d.Name, d.Spec.Selector, err)
	}
	pod := d.Spec.Template
	if !sel.Matches(labels.Set(pod.Labels)) {
		t.Errorf("Deployment %s: selector %s does not match the pod labels %v", d.Name, sel, pod.Labels)
	}
	if len(pod.Spec.Containers) != 1 {
		t.Fatalf("Deployment %s: %d containers, want 1", d.Name, len(pod.Spec.Containers))
	}
	c := pod.Spec.Containers[0]

	// The container ports are the configuration's.
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	for _, p := range []struct{ name, key, addr string }{
		{"extproc", "server.extproc_addr", cfg.Server.ExtProcAddr},
		{"admin", "server.admin_addr", cfg.Server.AdminAddr},
		{"xds", "xds.addr", cfg.XDS.Addr},
	} {
		if p.addr == "" { // off
			if n, ok := ports[p.name]; ok {
				t.Errorf("container port %q = %d, but %s is off (empty) in %s", p.name, n, p.key, configKey)
			}
			continue
		}
		if want := port(t, p.key, p.addr); ports[p.name] != want {
			t.Errorf("container port %q = %d, want %d (%s in %s)", p.name, ports[p.name], want, p.key, configKey)
		}
	}
	if len(ports) != len(c.Ports) {
		t.Errorf("container ports %v: two share a name", c.Ports)
	}

	// Probes: /healthz for liveness, /readyz for readiness, on the admin port.
	probe := func(kind string, pr *corev1.Probe, path string) {
		t.Helper()
		if pr == nil || pr.HTTPGet == nil {
			t.Errorf("%s: want an httpGet probe on %s", kind, path)
			return
		}
		if pr.HTTPGet.Path != path {
			t.Errorf("%s: path %q, want %q", kind, pr.HTTPGet.Path, path)
		}
		got := pr.HTTPGet.Port.IntVal
		if pr.HTTPGet.Port.StrVal != "" {
			got = ports[pr.HTTPGet.Port.StrVal]
		}
		if got == 0 || got != ports["admin"] {
			t.Errorf("%s: port %s, want the admin port %d", kind, pr.HTTPGet.Port.String(), ports["admin"])
		}
	}
	probe("livenessProbe", c.LivenessProbe, "/healthz")
	probe("readinessProbe", c.ReadinessProbe, "/readyz")

	for _, res := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if q, ok := c.Resources.Requests[res]; !ok || q.IsZero() {
			t.Errorf("resources.requests.%s not set", res)
		}
		if q, ok := c.Resources.Limits[res]; !ok || q.IsZero() {
			t.Errorf("resources.limits.%s not set", res)
		}
	}

	// Security: non-root, read-only root, no privilege escalation, no capabilities.
	nonRoot := func(p *bool) bool { return p != nil && *p }
	sc := c.SecurityContext
	if sc == nil {
		t.Fatal("container securityContext not set")
	}
	if !nonRoot(sc.RunAsNonRoot) && (pod.Spec.SecurityContext == nil || !nonRoot(pod.Spec.SecurityContext.RunAsNonRoot)) {
		t.Error("runAsNonRoot not set")
	}
	if !nonRoot(sc.ReadOnlyRootFilesystem) {
		t.Error("readOnlyRootFilesystem not set")
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Error("allowPrivilegeEscalation not false")
	}
	if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) > 0 {
		t.Errorf("capabilities %v, want drop ALL and add none", sc.Capabilities)
	}

	// Replicas on different nodes.
	spread := false
	for _, tsc := range pod.Spec.TopologySpreadConstraints {
		s, err := metav1.LabelSelectorAsSelector(tsc.LabelSelector)
		spread = spread || (err == nil && tsc.TopologyKey == "kubernetes.io/hostname" && s.Matches(labels.Set(pod.Labels)))
	}
	if a := pod.Spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		for _, term := range a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution {
			spread = spread || term.TopologyKey == "kubernetes.io/hostname"
		}
		for _, w := range a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
			spread = spread || w.PodAffinityTerm.TopologyKey == "kubernetes.io/hostname"
		}
	}
	if !spread {
		t.Error("no topology spread or pod anti-affinity across kubernetes.io/hostname")
	}

	// SIGTERM keeps deciding for server.drain_delay, then drains for
	// server.drain_timeout, after the preStop pause: the grace period must
	// cover all three, or the kubelet kills open streams.
	var preStop time.Duration
	if lc := c.Lifecycle; lc != nil && lc.PreStop != nil && lc.PreStop.Sleep != nil {
		preStop = time.Duration(lc.PreStop.Sleep.Seconds) * time.Second
	}
	grace := 30 * time.Second // Kubernetes' default
	if pod.Spec.TerminationGracePeriodSeconds != nil {
		grace = time.Duration(*pod.Spec.TerminationGracePeriodSeconds) * time.Second
	}
	rest := 2 * time.Second // the admin server's shutdown
	if cfg.XDS.Addr != "" {
		rest += time.Second // and the ADS server's streams
	}
	if need := preStop + cfg.Server.DrainDelay.D + cfg.Server.DrainTimeout.D + rest; grace <= need {
		t.Errorf("terminationGracePeriodSeconds %v, want above preStop %v + server.drain_delay %v + server.drain_timeout %v + %v for the ADS and admin servers",
			grace, preStop, cfg.Server.DrainDelay.D, cfg.Server.DrainTimeout.D, rest)
	}

	// The identity secret comes from a Secret, in the variable the config names.
	secret := false
	for _, e := range c.Env {
		if e.Name == cfg.Identity.SecretEnv {
			secret = e.Value == "" && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil &&
				e.ValueFrom.SecretKeyRef.Name != "" && e.ValueFrom.SecretKeyRef.Key != ""
		}
	}
	if !secret {
		t.Errorf("env %s: want it from a secretKeyRef, never a literal value", cfg.Identity.SecretEnv)
	}

	// The admin token too, in the variable the config names; optional, so
	// the pods start before anyone created that Secret.
	token := false
	for _, e := range c.Env {
		if e.Name == cfg.Server.AdminTokenEnv {
			ref := e.ValueFrom
			token = e.Value == "" && ref != nil && ref.SecretKeyRef != nil && ref.SecretKeyRef.Name != "" && ref.SecretKeyRef.Key != "" &&
				ref.SecretKeyRef.Optional != nil && *ref.SecretKeyRef.Optional
		}
	}
	if !token {
		t.Errorf("env %s (server.admin_token_env): want it from a secretKeyRef with optional: true, never a literal value", cfg.Server.AdminTokenEnv)
	}

	// The ConfigMap is mounted where the image's ENTRYPOINT reads it.
	volume := ""
	for _, v := range pod.Spec.Volumes {
		if v.ConfigMap != nil && v.ConfigMap.Name == m.configMap.Name {
			volume = v.Name
		}
	}
	if volume == "" {
		t.Fatalf("no volume from ConfigMap %s", m.configMap.Name)
	}
	mounted := false
	for _, vm := range c.VolumeMounts {
		mounted = mounted || (vm.Name == volume && vm.MountPath == configMount && vm.SubPath == "")
	}
	if !mounted {
		t.Errorf("ConfigMap %s not mounted at %s (a whole-volume mount: a subPath mount never sees edits)", m.configMap.Name, configMount)
	}
}

// servicePort resolves a Service port's targetPort to the container port.
func servicePort(c corev1.Container, sp corev1.ServicePort) int32 {
	if sp.TargetPort.StrVal != "" {
		for _, p := range c.Ports {
			if p.Name == sp.TargetPort.StrVal {
				return p.ContainerPort
			}
		}
		return 0
	}
	if sp.TargetPort.IntVal != 0 {
		return sp.TargetPort.IntVal
	}
	return sp.Port
}

// listening maps each port tether listens on to what it serves.
func listening(t *testing.T, cfg config.Config) map[int32]string {
	t.Helper()
	out := map[int32]string{
		port(t, "server.extproc_addr", cfg.Server.ExtProcAddr): "extproc",
		port(t, "server.admin_addr", cfg.Server.AdminAddr):     "admin",
	}
	if cfg.XDS.Addr != "" {
		out[port(t, "xds.addr", cfg.XDS.Addr)] = "xds"
	}
	return out
}

// TestADSServer: an ADS server would tell Envoy to call ext_proc at
// envoy.extproc_endpoints, or at server.extproc_addr when none is set,
// which in a pod is 0.0.0.0, an address no other pod can use. The Istio
// gateway takes its configuration from istiod, so these manifests turn
// the ADS server off; one that turns it on must name endpoints.
func TestADSServer(t *testing.T) {
	cfg := load(t).tetherConfig(t)
	if cfg.XDS.Addr == "" {
		return
	}
	eps := cfg.Envoy.ExtProcEndpoints
	if len(eps) == 0 {
		eps = []string{cfg.Server.ExtProcAddr}
	}
	for _, ep := range eps {
		host, _, err := net.SplitHostPort(ep)
		if ip := net.ParseIP(host); err != nil || host == "localhost" || (ip != nil && (ip.IsUnspecified() || ip.IsLoopback())) {
			t.Errorf("xds.addr = %q serves Envoy the ext_proc endpoint %q, which no other pod can call: "+
				"set envoy.extproc_endpoints, or turn the ADS server off (xds.addr = \"\") as the Istio gateway does not use it", cfg.XDS.Addr, ep)
		}
	}
}

func TestServicesAndPDB(t *testing.T) {
	m := load(t)
	cfg := m.tetherConfig(t)
	pod := m.deployment.Spec.Template
	c := pod.Spec.Containers[0]
	want := listening(t, cfg)
	served := map[string]bool{}
	for _, s := range m.services {
		if len(s.Spec.Selector) == 0 || !labels.SelectorFromSet(s.Spec.Selector).Matches(labels.Set(pod.Labels)) {
			t.Errorf("Service %s: selector %v does not match the pod labels %v", s.Name, s.Spec.Selector, pod.Labels)
		}
		for _, sp := range s.Spec.Ports {
			target := servicePort(c, sp)
			what, ok := want[target]
			if !ok {
				t.Errorf("Service %s port %s: targetPort %s is no port tether listens on", s.Name, sp.Name, sp.TargetPort.String())
				continue
			}
			served[what] = true
			if what == "extproc" || what == "xds" {
				if sp.AppProtocol == nil || *sp.AppProtocol != "grpc" {
					t.Errorf("Service %s port %s: appProtocol %v, want grpc", s.Name, sp.Name, sp.AppProtocol)
				}
			}
		}
	}
	for _, what := range want {
		if !served[what] {
			t.Errorf("no Service port for %s", what)
		}
	}

	pdb := m.pdb
	sel, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector)
	if err != nil || sel.Empty() || !sel.Matches(labels.Set(pod.Labels)) {
		t.Errorf("PodDisruptionBudget %s: selector %v does not match the pod labels %v (%v)", pdb.Name, pdb.Spec.Selector, pod.Labels, err)
	}
	if ma := pdb.Spec.MinAvailable; ma == nil || ma.IntVal < 1 || ma.IntVal >= *m.deployment.Spec.Replicas {
		t.Errorf("PodDisruptionBudget %s: minAvailable %v, want at least 1 and below the replicas", pdb.Name, ma)
	}
}

// TestNetworkPolicy: the policy selects tether's pods and admits, on
// ports that are tether's container and Service ports, ext_proc from the
// gateway the EnvoyFilter attaches tether to and the admin port from the
// monitoring namespace only; nothing else, and no rule open to all.
func TestNetworkPolicy(t *testing.T) {
	m := load(t)
	cfg := m.tetherConfig(t)
	np := m.netpol
	pod := m.deployment.Spec.Template
	c := pod.Spec.Containers[0]
	sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
	if err != nil || sel.Empty() || !sel.Matches(labels.Set(pod.Labels)) {
		t.Errorf("NetworkPolicy %s: podSelector %v does not select the tether pods %v (%v)", np.Name, np.Spec.PodSelector, pod.Labels, err)
	}
	if !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) {
		t.Errorf("NetworkPolicy %s: policyTypes %v, want Ingress", np.Name, np.Spec.PolicyTypes)
	}

	want := listening(t, cfg)
	serviced := map[int32]bool{} // container ports a Service leads to
	for _, s := range m.services {
		for _, sp := range s.Spec.Ports {
			serviced[servicePort(c, sp)] = true
		}
	}
	gateway := map[string]string{"kubernetes.io/metadata.name": m.filter.Metadata.Namespace}
	gatewayPods := m.filter.Spec.GetWorkloadSelector().GetLabels()
	admitted := map[string]int{} // what → rules
	for i, rule := range np.Spec.Ingress {
		where := fmt.Sprintf("NetworkPolicy %s ingress[%d]", np.Name, i)
		if len(rule.From) == 0 || len(rule.Ports) == 0 {
			t.Errorf("%s: from %v, ports %v: a rule without peers or ports admits everyone or every port", where, rule.From, rule.Ports)
			continue
		}
		for _, p := range rule.Ports {
			if p.Protocol == nil || *p.Protocol != corev1.ProtocolTCP || p.Port == nil || p.EndPort != nil {
				t.Errorf("%s: port %v, want one TCP port", where, p)
				continue
			}
			// A named port is the container port of that name.
			n := p.Port.IntVal
			if p.Port.StrVal != "" {
				n = 0
				for _, cp := range c.Ports {
					if cp.Name == p.Port.StrVal {
						n = cp.ContainerPort
					}
				}
			}
			what, ok := want[n]
			if !ok {
				t.Errorf("%s: port %s is no port tether listens on (%v)", where, p.Port.String(), want)
				continue
			}
			if !serviced[n] {
				t.Errorf("%s: port %s (%d) is no Service's target port", where, p.Port.String(), n)
			}
			admitted[what]++
			for j, peer := range rule.From {
				pw := fmt.Sprintf("%s from[%d]", where, j)
				if peer.IPBlock != nil || peer.NamespaceSelector == nil || len(peer.NamespaceSelector.MatchExpressions) > 0 {
					t.Errorf("%s: %v, want a namespaceSelector by matchLabels only", pw, peer)
					continue
				}
				ns := peer.NamespaceSelector.MatchLabels
				switch what {
				case "extproc":
					if !maps.Equal(ns, gateway) || peer.PodSelector == nil || !maps.Equal(peer.PodSelector.MatchLabels, gatewayPods) {
						t.Errorf("%s: ext_proc from namespace %v pods %v, want the gateway's: namespace %v pods %v",
							pw, ns, peer.PodSelector, gateway, gatewayPods)
					}
				case "admin":
					if !maps.Equal(ns, map[string]string{"kubernetes.io/metadata.name": "monitoring"}) {
						t.Errorf("%s: admin from namespace %v, want the monitoring namespace only", pw, ns)
					}
				default:
					t.Errorf("%s: %s admitted; only ext_proc and admin are", pw, what)
				}
			}
		}
	}
	for _, what := range []string{"extproc", "admin"} {
		if admitted[what] == 0 {
			t.Errorf("NetworkPolicy %s admits no one to %s", np.Name, what)
		}
	}
}

// TestEnvoyFilter: the patches parse as Envoy's messages and are what
// tether's xDS builder gives a standalone Envoy for the same configuration.
func TestEnvoyFilter(t *testing.T) {
	m := load(t)
	cfg := m.tetherConfig(t)
	ef := m.filter
	if ef.APIVersion != "networking.istio.io/v1alpha3" || ef.Kind != "EnvoyFilter" {
		t.Errorf("%s %s", ef.APIVersion, ef.Kind)
	}
	if got := ef.Spec.GetWorkloadSelector().GetLabels()["istio"]; got != gatewayLabel {
		t.Errorf("workloadSelector.labels.istio = %q, want %q", got, gatewayLabel)
	}
	for i, cp := range ef.Spec.GetConfigPatches() {
		if ctx := cp.GetMatch().GetContext(); ctx != istionet.EnvoyFilter_GATEWAY {
			t.Errorf("configPatches[%d]: match.context %s, want GATEWAY", i, ctx)
		}
	}

	// What tether's xDS server would send, for this configuration.
	p, err := plan.FromConfig(cfg, plan.Options{ExtProc: []string{"127.0.0.1:50051"}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := xds.Build(p.Envoy, xds.Static)
	if err != nil {
		t.Fatal(err)
	}
	hcm := &hcmv3.HttpConnectionManager{}
	if err := res.Listener.GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(hcm); err != nil {
		t.Fatal(err)
	}
	wantProc := &extprocv3.ExternalProcessor{}
	for _, f := range hcm.GetHttpFilters() {
		if f.GetName() == extProcFilter {
			if err := f.GetTypedConfig().UnmarshalTo(wantProc); err != nil {
				t.Fatal(err)
			}
		}
	}
	var wantCluster *clusterv3.Cluster
	for _, c := range res.Clusters {
		if c.GetName() == xds.ExtProcCluster {
			wantCluster = c
		}
	}

	var cluster *clusterv3.Cluster
	var proc *extprocv3.ExternalProcessor
	var mergedHCM *hcmv3.HttpConnectionManager
	for i, p := range ef.Patches {
		where := fmt.Sprintf("configPatches[%d] (%s)", i, p.applyTo)
		if dep := deprecated(p.msg); len(dep) > 0 {
			t.Errorf("%s: deprecated Envoy fields %v", where, dep)
		}
		switch msg := p.msg.(type) {
		case *clusterv3.Cluster:
			if p.op != istionet.EnvoyFilter_Patch_ADD {
				t.Errorf("%s: operation %s, want ADD", where, p.op)
			}
			cluster = msg
		case *hcmv3.HttpFilter:
			sub := cp(ef, i).GetMatch().GetListener().GetFilterChain().GetFilter().GetSubFilter().GetName()
			if p.op != istionet.EnvoyFilter_Patch_INSERT_BEFORE || sub != "envoy.filters.http.router" {
				t.Errorf("%s: %s %q, want INSERT_BEFORE envoy.filters.http.router", where, p.op, sub)
			}
			if msg.GetName() != extProcFilter {
				t.Errorf("%s: filter %q, want %s", where, msg.GetName(), extProcFilter)
			}
			proc = &extprocv3.ExternalProcessor{}
			if err := msg.GetTypedConfig().UnmarshalTo(proc); err != nil {
				t.Fatalf("%s: typed_config is %s, want ExternalProcessor: %v", where, msg.GetTypedConfig().GetTypeUrl(), err)
			}
		case *listenerv3.Filter:
			if p.op != istionet.EnvoyFilter_Patch_MERGE {
				t.Errorf("%s: operation %s, want MERGE", where, p.op)
			}
			mergedHCM = &hcmv3.HttpConnectionManager{}
			if err := msg.GetTypedConfig().UnmarshalTo(mergedHCM); err != nil {
				t.Fatalf("%s: typed_config is %s, want HttpConnectionManager: %v", where, msg.GetTypedConfig().GetTypeUrl(), err)
			}
		}
	}
	if cluster == nil || proc == nil || mergedHCM == nil {
		t.Fatalf("want a CLUSTER, an HTTP_FILTER and a NETWORK_FILTER patch; got cluster %v, ext_proc %v, HCM merge %v",
			cluster != nil, proc != nil, mergedHCM != nil)
	}

	// The ext_proc filter: exactly what xds builds (phases, timeout,
	// failure_mode_allow, attributes, the cluster it calls).
	if diff := cmp.Diff(wantProc, proc, protocmp.Transform()); diff != "" {
		t.Errorf("ext_proc filter differs from xds.Build's (-xds +EnvoyFilter):\n%s", diff)
	}
	if got := proc.GetGrpcService().GetEnvoyGrpc().GetClusterName(); got != cluster.GetName() {
		t.Errorf("ext_proc calls cluster %q, the CLUSTER patch adds %q", got, cluster.GetName())
	}

	// The routing-header guard: what xds puts in its own listener.
	if diff := cmp.Diff(hcm.GetEarlyHeaderMutationExtensions(), mergedHCM.GetEarlyHeaderMutationExtensions(), protocmp.Transform()); diff != "" {
		t.Errorf("early header mutation differs from xds.Build's (-xds +EnvoyFilter):\n%s", diff)
	}
	if mergedHCM.GetHttpFilters() != nil || mergedHCM.GetRouteSpecifier() != nil {
		t.Error("the HCM MERGE patch must add the header guard only")
	}

	// The cluster: xds's ext_proc cluster (timeouts, health checks, HTTP/2),
	// but found by DNS.
	if cluster.GetType() != clusterv3.Cluster_STRICT_DNS {
		t.Errorf("cluster type %s, want STRICT_DNS", cluster.GetType())
	}
	opts := &upstreamhttpv3.HttpProtocolOptions{}
	if err := cluster.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].UnmarshalTo(opts); err != nil ||
		opts.GetExplicitHttpConfig().GetHttp2ProtocolOptions() == nil {
		t.Errorf("cluster does not speak HTTP/2 upstream (explicit_http_config.http2_protocol_options): %v", err)
	}
	strip := func(c *clusterv3.Cluster) *clusterv3.Cluster {
		c = proto.Clone(c).(*clusterv3.Cluster)
		c.ClusterDiscoveryType, c.LoadAssignment, c.EdsClusterConfig = nil, nil, nil
		return c
	}
	if diff := cmp.Diff(strip(wantCluster), strip(cluster), protocmp.Transform()); diff != "" {
		t.Errorf("cluster differs from xds.Build's (-xds +EnvoyFilter), endpoints aside:\n%s", diff)
	}

	// Its one endpoint is the headless tether Service, on the ext_proc port.
	la := cluster.GetLoadAssignment()
	if la.GetClusterName() != cluster.GetName() || len(la.GetEndpoints()) != 1 || len(la.GetEndpoints()[0].GetLbEndpoints()) != 1 {
		t.Fatalf("cluster load_assignment: want one endpoint for %s, got %v", cluster.GetName(), la)
	}
	sa := la.GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress()
	extPort := port(t, "server.extproc_addr", cfg.Server.ExtProcAddr)
	found := false
	for _, s := range m.services {
		dns := s.Name + "." + s.Namespace + ".svc.cluster.local"
		if sa.GetAddress() != dns {
			continue
		}
		found = true
		if s.Spec.ClusterIP != corev1.ClusterIPNone {
			t.Errorf("Service %s: clusterIP %q; STRICT_DNS needs a headless Service (None) to see each replica", s.Name, s.Spec.ClusterIP)
		}
		ok := false
		for _, sp := range s.Spec.Ports {
			ok = ok || (uint32(sp.Port) == sa.GetPortValue() && servicePort(m.deployment.Spec.Template.Spec.Containers[0], sp) == extPort)
		}
		if !ok {
			t.Errorf("cluster endpoint port %d: no port of Service %s leads to ext_proc (%d)", sa.GetPortValue(), s.Name, extPort)
		}
	}
	if !found {
		t.Errorf("cluster endpoint %s:%d is no tether Service's DNS name", sa.GetAddress(), sa.GetPortValue())
	}
	if sa.GetProtocol() != corev3.SocketAddress_TCP {
		t.Errorf("cluster endpoint protocol %s", sa.GetProtocol())
	}
}

func cp(ef *envoyFilter, i int) *istionet.EnvoyFilter_EnvoyConfigObjectPatch {
	return ef.Spec.GetConfigPatches()[i]
}

// deprecated lists the set fields of m, and of the messages inside it and
// inside its Any values, that Envoy marks deprecated.
func deprecated(m proto.Message) []string {
	var out []string
	var walk func(m protoreflect.Message, path string)
	walk = func(m protoreflect.Message, path string) {
		if a, ok := m.Interface().(*anypb.Any); ok {
			if inner, err := a.UnmarshalNew(); err == nil {
				walk(inner.ProtoReflect(), path)
			}
			return
		}
		m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			p := join(path, string(fd.Name()))
			if o, ok := fd.Options().(*descriptorpb.FieldOptions); ok && o.GetDeprecated() {
				out = append(out, p)
			}
			switch {
			case fd.IsList() && fd.Message() != nil:
				for i := 0; i < v.List().Len(); i++ {
					walk(v.List().Get(i).Message(), fmt.Sprintf("%s[%d]", p, i))
				}
			case fd.IsMap() && fd.MapValue().Message() != nil:
				v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
					walk(mv.Message(), p+"."+k.String())
					return true
				})
			case !fd.IsList() && !fd.IsMap() && fd.Message() != nil:
				walk(v.Message(), p)
			}
			return true
		})
	}
	walk(m.ProtoReflect(), "")
	return out
}

// TestBadManifests: a misspelt field, a field in the wrong case, an unknown
// kind, and misspelt EnvoyFilter fields (Istio's and Envoy's) each fail,
// naming the file and the field.
func TestBadManifests(t *testing.T) {
	read := func(f string) string {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		return string(data)
	}
	deployment, filter, netpol := read("deployment.yaml"), read("istio-envoyfilter.yaml"), read("networkpolicy.yaml")
	for _, tc := range []struct {
		name, file, data string
		old, new         string
		want             []string
	}{
		{"replicas misspelt", "deployment.yaml", deployment, "  replicas: 2", "  replicaz: 2",
			[]string{"deployment.yaml", `unknown field "spec.replicaz"`}},
		{"probe path misspelt", "deployment.yaml", deployment, "path: /healthz", "paht: /healthz",
			[]string{"deployment.yaml", `unknown field "spec.template.spec.containers[0].livenessProbe.httpGet.paht"`}},
		{"field in the wrong case", "deployment.yaml", deployment, "  replicas: 2", "  Replicas: 2",
			[]string{"deployment.yaml", `"spec.Replicas"`, "case-sensitive"}},
		{"unknown kind", "deployment.yaml", deployment, "kind: Deployment", "kind: Deploymint",
			[]string{"deployment.yaml", `kind "Deploymint"`, "not a kind"}},
		{"duplicate key", "deployment.yaml", deployment, "  replicas: 2", "  replicas: 2\n  replicas: 3",
			[]string{"deployment.yaml", "replicas"}},
		{"network policy field misspelt", "networkpolicy.yaml", netpol, "  policyTypes:", "  policyTypez:",
			[]string{"networkpolicy.yaml", `unknown field "spec.policyTypez"`}},
		{"network policy peer misspelt", "networkpolicy.yaml", netpol, "- namespaceSelector:", "- namespaceSelektor:",
			[]string{"networkpolicy.yaml", `unknown field "spec.ingress[0].from[0].namespaceSelektor"`}},
		{"ext_proc field misspelt", "istio-envoyfilter.yaml", filter, "failure_mode_allow:", "failure_mode_alow:",
			[]string{"istio-envoyfilter.yaml", "configPatches[2]", "HttpFilter", "failure_mode_alow"}},
		{"cluster field misspelt", "istio-envoyfilter.yaml", filter, "connect_timeout:", "conect_timeout:",
			[]string{"istio-envoyfilter.yaml", "configPatches[0]", "envoy.config.cluster.v3.Cluster", "conect_timeout"}},
		{"ext_proc enum misspelt", "istio-envoyfilter.yaml", filter, "request_body_mode: NONE", "request_body_mode: NOPE",
			[]string{"istio-envoyfilter.yaml", "NOPE"}},
		{"istio field misspelt", "istio-envoyfilter.yaml", filter, "workloadSelector:", "workloadSelektor:",
			[]string{"istio-envoyfilter.yaml", "EnvoyFilter spec", "workloadSelektor"}},
		{"istio metadata misspelt", "istio-envoyfilter.yaml", filter, "  namespace: istio-system", "  namespaec: istio-system",
			[]string{"istio-envoyfilter.yaml", `unknown field "metadata.namespaec"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !strings.Contains(tc.data, tc.old) {
				t.Fatalf("%s does not contain %q", tc.file, tc.old)
			}
			_, err := decodeFile(tc.file, []byte(strings.Replace(tc.data, tc.old, tc.new, 1)))
			if err == nil {
				t.Fatalf("%s with %q decoded", tc.file, tc.new)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}
