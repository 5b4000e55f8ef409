//go:build e2e

package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tetherproxy/tether/config"
)

// clusters returns the names of the clusters Envoy has, from its admin
// /clusters page.
func (p *proxy) clusters(t *testing.T) map[string]bool {
	t.Helper()
	resp, err := http.Get(p.admin + "/clusters")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]bool{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if name, _, ok := strings.Cut(sc.Text(), "::"); ok {
			out[name] = true
		}
	}
	return out
}

// stat returns one counter or gauge from Envoy's /stats.
func (p *proxy) stat(t *testing.T, name string) int {
	t.Helper()
	resp, err := http.Get(p.admin + "/stats?filter=^" + name + "$")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ": "); ok && k == name {
			var n int
			if _, err := fmt.Sscan(v, &n); err != nil {
				t.Fatalf("Envoy stat %s = %q: %v", name, v, err)
			}
			return n
		}
	}
	return 0
}

// xdsState is tether's GET /v1/xds.
type xdsState struct {
	Version string `json:"version"`
	Nodes   []struct {
		ID       string            `json:"id"`
		Acked    map[string]string `json:"acked"`
		LastNACK *struct {
			Detail string `json:"detail"`
		} `json:"last_nack"`
	} `json:"nodes"`
}

func (p *tether) xdsState(t *testing.T) xdsState {
	t.Helper()
	var s xdsState
	getJSON(t, "http://"+p.admin+"/v1/xds", &s)
	return s
}

// startXDS runs tether on cfg with its ADS server, and an Envoy that has
// only the ADS bootstrap.
func startXDS(t *testing.T, cfg config.Config) (*tether, *proxy) {
	t.Helper()
	tt := startTether(t, cfg)
	if tt.xds == "" {
		t.Fatal("tether started without its ADS server")
	}
	return tt, startEnvoyADS(t, tt.xds)
}

func TestXDSDeliversEveryCluster(t *testing.T) {
	inst := startFleet(t, 8)
	tt, px := startXDS(t, baseConfig("embedded", inst))
	have := px.clusters(t)
	for _, in := range inst {
		if !have["inst-"+in.Name] {
			t.Errorf("envoy lacks cluster inst-%s; has %v", in.Name, have)
		}
	}
	for _, c := range []string{"pool-v1", "tether-extproc"} {
		if !have[c] {
			t.Errorf("envoy lacks cluster %s", c)
		}
	}
	// Traffic flows through tether, and Envoy acknowledged what it got.
	if a := chat(t, px, map[string]string{"x-session-id": "s"}); a.status != 200 || a.decision != "bind" {
		t.Fatalf("request through the ADS-configured Envoy: %+v", a)
	}
	st := tt.xdsState(t)
	if len(st.Nodes) != 1 || st.Version == "" {
		t.Fatalf("xds state: %+v", st)
	}
	for typ, v := range st.Nodes[0].Acked {
		if v != st.Version {
			t.Errorf("%s acknowledged %s, published %s", typ, v, st.Version)
		}
	}
	if len(st.Nodes[0].Acked) < 4 {
		t.Errorf("acknowledged types %v, want listeners, routes, clusters and endpoints", st.Nodes[0].Acked)
	}
}

func TestXDSAddAndRemoveInstances(t *testing.T) {
	all := startFleet(t, 9)
	cfg := baseConfig("embedded", all[:8])
	tt, px := startXDS(t, cfg)

	// 100 sessions on the first eight instances.
	bound := map[string]string{}
	for i := 0; i < 100; i++ {
		s := fmt.Sprintf("before-%d", i)
		a := chat(t, px, map[string]string{"x-session-id": s})
		if a.status != 200 || a.decision != "bind" {
			t.Fatalf("%s: %+v", s, a)
		}
		bound[s] = a.instance
	}

	// Add the ninth instance to the file. While the change lands, new
	// sessions keep arriving: none may fail (tether must not name a
	// cluster Envoy does not have yet).
	added := all[8]
	cfg.Instances = append(cfg.Instances, added)
	stop := make(chan struct{})
	var mu sync.Mutex
	var failures []answer
	onNew := 0
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			a, err := tryChat(px, map[string]string{"x-session-id": fmt.Sprintf("during-%d", i)})
			mu.Lock()
			if err != nil || a.status != 200 {
				failures = append(failures, a)
			}
			if a.instance == added.Name {
				onNew++
			}
			mu.Unlock()
		}
	}()
	start := time.Now()
	writeConfig(t, tt.path, cfg)
	waitFor(t, 10*time.Second, "envoy to show the new cluster", func() bool { return px.clusters(t)["inst-"+added.Name] })
	took := time.Since(start)
	t.Logf("new instance's cluster visible in Envoy %v after the file changed", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("cluster appeared after %v, want within 2s", took)
	}
	waitFor(t, 10*time.Second, "a new session on the new instance", func() bool { mu.Lock(); defer mu.Unlock(); return onNew > 0 })
	close(stop)
	wg.Wait()
	if len(failures) > 0 {
		t.Fatalf("%d requests failed while the instance was added: %+v", len(failures), failures[0])
	}
	for s, inst := range bound {
		if a := chat(t, px, map[string]string{"x-session-id": s}); a.instance != inst || a.decision != "hit" {
			t.Fatalf("%s moved from %s to %+v when an instance was added", s, inst, a)
		}
	}

	// Remove an instance that holds sessions: only those move.
	victim := bound["before-0"]
	var kept []config.Instance
	for _, in := range cfg.Instances {
		if in.Name != victim {
			kept = append(kept, in)
		}
	}
	cfg.Instances = kept
	writeConfig(t, tt.path, cfg)
	waitFor(t, 10*time.Second, "envoy to drop the removed cluster", func() bool { return !px.clusters(t)["inst-"+victim] })
	moved := 0
	for s, inst := range bound {
		a := chat(t, px, map[string]string{"x-session-id": s})
		switch {
		case a.status != 200:
			t.Fatalf("%s after removal: %+v", s, a)
		case inst == victim && (a.instance == victim || a.decision != "moved"):
			t.Fatalf("%s was on removed %s: %+v, want moved", s, victim, a)
		case inst == victim:
			moved++
		case a.instance != inst || a.decision != "hit":
			t.Fatalf("%s moved from %s to %+v, though its instance stayed", s, inst, a)
		}
	}
	t.Logf("removing %s moved its %d sessions and no other", victim, moved)
}

func TestOutlierDetectionEjectsAFailingInstance(t *testing.T) {
	inst, broken := startFaultyFleet(t, 8)
	tt, px := startXDS(t, baseConfig("embedded", inst))
	_ = tt

	// Find sessions that tether binds to the first instance.
	victim := inst[0].Name
	var sessions []string
	for i := 0; len(sessions) < 5 && i < 500; i++ {
		s := fmt.Sprintf("od-%d", i)
		if a := chat(t, px, map[string]string{"x-session-id": s}); a.instance == victim {
			sessions = append(sessions, s)
		}
	}
	if len(sessions) == 0 {
		t.Fatal("no session landed on the victim")
	}
	broken[victim].Store(true)
	for i := 0; i < 30; i++ {
		a := chat(t, px, map[string]string{"x-session-id": sessions[i%len(sessions)]})
		if a.status != 200 {
			resp, _ := http.Get(px.admin + "/stats?filter=inst-" + victim)
			b, _ := io.ReadAll(resp.Body)
			t.Fatalf("request %d to a session of the failing instance: %+v\n%s", i, a, b)
		}
		if a.instance == victim {
			t.Fatalf("request %d was answered by the failing instance", i)
		}
	}
	ejected := px.stat(t, "cluster.inst-"+victim+".outlier_detection.ejections_enforced_total")
	if ejected < 1 {
		t.Fatalf("envoy did not eject %s (ejections_enforced_total %d)", victim, ejected)
	}
	t.Logf("%s ejected by Envoy (%d enforced ejections); its sessions were served by same-zone peers", victim, ejected)
}

func TestXDSRefusesBadConfig(t *testing.T) {
	inst := startFleet(t, 8)
	cfg := baseConfig("embedded", inst)
	tt, px := startXDS(t, cfg)
	good := tt.xdsState(t).Version
	if good == "" {
		t.Fatal("no version published")
	}

	dup := cfg
	dup.Instances = append(append([]config.Instance{}, cfg.Instances...), cfg.Instances[0])
	unknown := cfg
	unknown.OutlierDetection.Instances = map[string]config.OutlierSettings{"gpu-404": {}}
	negative := cfg
	neg := config.Dur(-30 * time.Second)
	negative.OutlierDetection.BaseEjectionTime = &neg
	noPort := cfg
	noPort.Instances = append([]config.Instance{}, cfg.Instances...)
	noPort.Instances[1].Address = "127.0.0.1"

	tests := []struct {
		name string
		cfg  config.Config
		want string
	}{
		{"duplicate instance names", dup, "duplicate of instances[0]"},
		{"override for an unknown instance", unknown, "outlier_detection.instances.gpu-404"},
		{"negative duration", negative, "outlier_detection.base_ejection_time"},
		{"address without a port", noPort, "instances[1].address"},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			refusedBefore := tt.metric(t, "tether_config_reloads_total", `result="invalid"`)
			writeConfig(t, tt.path, tc.cfg)
			// Wait for the refusal that names this file's fault (a late event
			// of the previous write may reload first).
			waitFor(t, 10*time.Second, "a refusal naming "+tc.want, func() bool {
				return strings.Contains(tt.logs.String(), tc.want)
			})
			if n := tt.metric(t, "tether_config_reloads_total", `result="invalid"`); n <= refusedBefore {
				t.Fatalf("refusals counted: %v, before %v", n, refusedBefore)
			}
			if v := tt.xdsState(t).Version; v != good {
				t.Fatalf("version changed to %s after a refused config", v)
			}
			if a := chat(t, px, map[string]string{"x-session-id": fmt.Sprintf("still-%d", i)}); a.status != 200 || a.decision != "bind" {
				t.Fatalf("routing after a refused config: %+v", a)
			}
		})
	}

	// The admin API refuses the same way.
	body := `{"name":"` + inst[0].Name + `x","address":"127.0.0.1"}`
	resp, err := http.Post("http://"+tt.admin+"/v1/instances", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var apiErr struct{ Error string }
	_ = json.NewDecoder(resp.Body).Decode(&apiErr)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(apiErr.Error, "address") {
		t.Fatalf("POST /v1/instances with no port: %d %q", resp.StatusCode, apiErr.Error)
	}
	if v := tt.xdsState(t).Version; v != good {
		t.Fatalf("version changed to %s after a refused admin call", v)
	}
}

func TestAdminAPIAddsAndRemovesInstances(t *testing.T) {
	all := startFleet(t, 9)
	tt, px := startXDS(t, baseConfig("embedded", all[:8]))
	extra := all[8]
	body, _ := json.Marshal(extra)
	resp, err := http.Post("http://"+tt.admin+"/v1/instances", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("POST /v1/instances: %d", resp.StatusCode)
	}
	// The call returns after Envoy acknowledged: the cluster is there now.
	if !px.clusters(t)["inst-"+extra.Name] {
		t.Fatal("cluster missing right after the admin call returned")
	}
	req, _ := http.NewRequest(http.MethodDelete, "http://"+tt.admin+"/v1/instances/"+extra.Name, nil)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("DELETE: %d", resp.StatusCode)
	}
	waitFor(t, 10*time.Second, "the cluster to go", func() bool { return !px.clusters(t)["inst-"+extra.Name] })
	req, _ = http.NewRequest(http.MethodDelete, "http://"+tt.admin+"/v1/instances/nope", nil)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("DELETE of an unknown instance: %d, want 404", resp.StatusCode)
	}
}

// TestLoneInstanceHasNoFallback shows what docs/envoy.md says of a model
// version with a single instance: Envoy cannot route around it. With the
// default max_ejection_percent (50) it does not even eject it (the one host
// is 100% of the cluster: ejections_overflow); with 100 it ejects it, the
// cluster drops into panic mode and sends traffic to it anyway. So the
// session's requests fail until tether's own breaker opens (past
// failure_threshold) and moves the session to another instance (version
// affinity prefer: another version when its own has none left).
func TestLoneInstanceHasNoFallback(t *testing.T) {
	for _, tc := range []struct {
		name           string
		maxEjectionPct uint32
		stat           string
	}{
		{"default max_ejection_percent", 50, "outlier_detection.ejections_overflow"},
		{"max_ejection_percent 100", 100, "lb_healthy_panic"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inst, broken := startFaultyFleet(t, 8)
			inst[7].Version = "v2" // the only v2 instance
			lone := inst[7].Name
			cfg := baseConfig("embedded", inst)
			pct := tc.maxEjectionPct
			cfg.OutlierDetection.Instances = map[string]config.OutlierSettings{lone: {MaxEjectionPercent: &pct}}
			tt, px := startXDS(t, cfg)
			var session string
			for i := 0; session == "" && i < 500; i++ {
				s := fmt.Sprintf("lone-%d", i)
				if a := chat(t, px, map[string]string{"x-session-id": s}); a.instance == lone {
					session = s
				}
			}
			if session == "" {
				t.Fatal("no session landed on the lone instance")
			}
			broken[lone].Store(true)
			failed, failover := 0, ""
			reported := func() float64 { return tt.metric(t, "tether_outcomes_total") }
			for i := 0; i < 10; i++ {
				// Outcomes come back over the access log, after the
				// client has its answer: wait for each one to be counted,
				// so that the next request is decided knowing of it (a
				// client that retries at once may see one more failure).
				before := reported()
				a := chat(t, px, map[string]string{"x-session-id": session})
				waitFor(t, 5*time.Second, "the outcome reported", func() bool { return reported() > before })
				switch {
				case a.status != 200:
					failed++
				case failover == "":
					failover = a.instance
				}
			}
			n := px.stat(t, "cluster.inst-"+lone+"."+tc.stat)
			want := cfg.Routing.FailureThreshold + 1
			t.Logf("%d of 10 requests failed, then answered by %s; %s = %d", failed, failover, tc.stat, n)
			// The session moved at the breaker's opening (evacuated) or at
			// its next request (failover): either way, elsewhere.
			if failed != want || n < 1 || failover == "" || failover == lone {
				t.Fatalf("want the first %d requests failing (Envoy has no fallback), %s > 0, then answers from another instance; got %d failed, %d, then from %q",
					want, tc.stat, failed, n, failover)
			}
		})
	}
}
