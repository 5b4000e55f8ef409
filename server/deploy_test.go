package server

// Checks of the deployment artifacts against what tether exports: the
// Grafana dashboard (deploy/grafana/tether.json) and the Prometheus rules
// (deploy/prometheus/alerts.yml) may name only metrics, and labels of
// them, that some collector Run registers; promtool must accept the rules
// and pass their unit tests (deploy/prometheus/alerts_test.yml).
//
// The exported names and labels come from the collectors' descriptors,
// gathered through Options.WrapRegisterer while Run is up, so a metric
// counts whether or not it has a value yet. Expressions are read by a
// small PromQL tokenizer (parsePromQL) rather than Prometheus's parser,
// whose module would pull the Prometheus server's dependencies into
// go.mod for a test; promtool, which has the real parser, checks the
// rules file on top.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"sigs.k8s.io/yaml"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/testenv"
)

const (
	dashboardFile  = "deploy/grafana/tether.json"
	rulesFile      = "deploy/prometheus/alerts.yml"
	rulesTestFile  = "deploy/prometheus/alerts_test.yml"
	metricsDocFile = "docs/metrics.md"
)

// TestDeployReferencesExportedMetrics: every metric the dashboard and the
// rules name is one tether exports (or, in the rules, one they record),
// and every label they select or group on is one of its labels.
func TestDeployReferencesExportedMetrics(t *testing.T) {
	exported := exportedMetrics(t)
	t.Run("no target labels", func(t *testing.T) {
		// Prometheus sets job and instance on every series it scrapes: a
		// metric of tether's own with either would lose it (renamed
		// exported_instance), and max by (instance) would group by the
		// tether replica. tether names a GPU instance upstream.
		for name, labels := range exported {
			for l := range targetLabels {
				if labels[l] {
					t.Errorf("%s has a label %s, which Prometheus overwrites with the scrape target's: name the GPU instance upstream", name, l)
				}
			}
		}
	})
	if err := checkEngineMetrics(exported); err != nil {
		t.Error(err)
	}
	for _, name := range []string{
		"tether_requests_total", "tether_decision_duration_seconds_bucket", "tether_instance_available",
		"tether_xds_connected_streams", "tether_audit_records_total", "go_goroutines", "process_cpu_seconds_total",
	} {
		if _, ok := exported[name]; !ok {
			t.Fatalf("%s not among the %d exported names: the registerer hook missed collectors", name, len(exported))
		}
	}
	root := repoRoot(t)

	t.Run("dashboard", func(t *testing.T) {
		data, err := os.ReadFile(filepath.Join(root, dashboardFile))
		if err != nil {
			t.Fatal(err)
		}
		if err := checkDashboard(data, exported); err != nil {
			t.Errorf("%s:\n%v", dashboardFile, err)
		}
	})
	t.Run("rules", func(t *testing.T) {
		data, err := os.ReadFile(filepath.Join(root, rulesFile))
		if err != nil {
			t.Fatal(err)
		}
		doc, err := os.ReadFile(filepath.Join(root, metricsDocFile))
		if err != nil {
			t.Fatal(err)
		}
		if err := checkRules(data, exported, doc); err != nil {
			t.Errorf("%s:\n%v", rulesFile, err)
		}
	})
}

// TestDeployPromtool runs promtool's own checks of the rules and their
// unit tests.
func TestDeployPromtool(t *testing.T) {
	bin, err := exec.LookPath("promtool")
	testenv.Require(t, "promtool", err)
	root := repoRoot(t)
	for _, args := range [][]string{
		{"check", "rules", rulesFile},
		{"test", "rules", rulesTestFile},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Dir = root
		out, err := cmd.CombinedOutput()
		cancel()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// TestDeployCheckerRejects: the checks fail on what they are there to
// catch, so a broken dashboard or rules file cannot pass silently.
func TestDeployCheckerRejects(t *testing.T) {
	exported := metricSet{
		"tether_requests_total":                   labelSet("mode", "decision", "source"),
		"tether_redis_up":                         labelSet(),
		"tether_instance_available":               labelSet("upstream"),
		"tether_decision_duration_seconds_bucket": labelSet("le"),
	}
	panel := func(title, expr string) string {
		e, _ := json.Marshal(expr)
		return fmt.Sprintf(`{"panels": [{"id": 1, "title": %q, "targets": [{"refId": "A", "expr": %s}]}]}`, title, e)
	}
	for _, tc := range []struct {
		name, dashboard, want string
	}{
		{"unknown metric", panel("Hits", "sum(rate(tether_hits_total[5m]))"),
			`panel 1 "Hits" target A: tether_hits_total is not exported by tether`},
		{"unknown metric in a collapsed row", `{"panels": [{"id": 1, "type": "row", "title": "R", "panels": [
			{"id": 2, "title": "Up", "targets": [{"refId": "A", "expr": "tether_redis_up or tether_redis_down"}]}]}]}`,
			`panel 2 "Up" target A: tether_redis_down is not exported by tether`},
		{"unknown metric in a variable", `{"panels": [], "templating": {"list": [{"name": "upstream", "type": "query",
			"query": {"query": "label_values(tether_instance_up, upstream)"}}]}}`,
			`variable upstream: tether_instance_up is not exported by tether`},
		{"label the metric lacks", panel("Avail", `tether_instance_available{gpu=~"$upstream"}`),
			`panel 1 "Avail" target A: tether_instance_available has no label gpu`},
		{"grouping by a label no metric has", panel("Avail", `max by (gpu) (tether_instance_available)`),
			`panel 1 "Avail" target A: by/without/on/ignoring/group_* label gpu is on none of tether_instance_available`},
		{"quantile without le", panel("p99", `histogram_quantile(0.99, sum by (mode) (rate(tether_decision_duration_seconds_bucket[5m])))`),
			`label mode is on none of tether_decision_duration_seconds_bucket`},
		{"invalid JSON", `{"panels": [}`, "invalid JSON"},
		{"no targets", `{"panels": [{"id": 1, "title": "Empty", "type": "timeseries"}]}`, `panel 1 "Empty": no targets`},
		{"empty expr", panel("Blank", " "), `panel 1 "Blank" target A: empty expression`},
		{"duplicate id", `{"panels": [
			{"id": 1, "title": "A", "targets": [{"refId": "A", "expr": "tether_redis_up"}]},
			{"id": 1, "title": "B", "targets": [{"refId": "A", "expr": "tether_redis_up"}]}]}`,
			`panel 1 "B": id 1 also used by panel "A"`},
		{"unbalanced", panel("P", "sum(rate(tether_requests_total[5m])"), "unbalanced parentheses"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkDashboard([]byte(tc.dashboard), exported)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("checkDashboard: %v\nwant an error containing %q", err, tc.want)
			}
		})
	}
	good := `{"panels": [{"id": 1, "title": "Rate", "targets": [
			{"refId": "A", "expr": "sum by (mode, instance) (rate(tether_requests_total{mode=~\"$mode\", job=\"tether\"}[$__rate_interval]))"},
			{"refId": "B", "expr": "histogram_quantile(0.5, sum by (le) (rate(tether_decision_duration_seconds_bucket[5m])))"}]}],
		"templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"},
			{"name": "upstream", "type": "query", "query": "label_values(tether_instance_available, upstream)"}]}}`
	if err := checkDashboard([]byte(good), exported); err != nil {
		t.Errorf("a good dashboard: %v", err)
	}

	doc := []byte("# Metrics\n\n### TetherRedisDown\n")
	alert := func(expr string) string {
		return `groups:
  - name: g
    rules:
      - record: tether:redis_up:min
        expr: min by (job) (tether_redis_up)
      - alert: TetherRedisDown
        expr: ` + expr + `
        labels: {severity: critical}
        annotations: {summary: s, description: d, runbook_url: "https://x/docs/metrics.md#tetherredisdown"}
`
	}
	if err := checkRules([]byte(alert("tether:redis_up:min{job='tether'} == 0")), exported, doc); err != nil {
		t.Errorf("good rules: %v", err)
	}
	for _, tc := range []struct{ name, rules, want string }{
		{"unknown metric", alert("tether_redis_ok == 0"), `alert TetherRedisDown: tether_redis_ok is not exported by tether`},
		{"unknown recording", alert("tether:redis_up:max == 0"), `alert TetherRedisDown: tether:redis_up:max is not exported by tether`},
		{"label the metric lacks", alert("tether_redis_up{upstream='a'} == 0"), `alert TetherRedisDown: tether_redis_up has no label upstream`},
		{"runbook anchor missing", strings.Replace(alert("tether_redis_up == 0"), "#tetherredisdown", "#tetherredisgone", 1),
			`no heading in docs/metrics.md for its runbook anchor "tetherredisgone"`},
		{"no severity", strings.Replace(alert("tether_redis_up == 0"), "severity", "team", 1), `no severity label`},
		{"invalid YAML", "groups: [", "invalid YAML"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkRules([]byte(tc.rules), exported, doc)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("checkRules: %v\nwant an error containing %q", err, tc.want)
			}
		})
	}
}

// TestDeployEngineMetrics: the check of the engine metrics finds one
// missing and one labelled otherwise than the dashboard and the rules name
// them.
func TestDeployEngineMetrics(t *testing.T) {
	all := metricSet{}
	for name, labels := range engineMetrics {
		all[name] = labels
	}
	if err := checkEngineMetrics(all); err != nil {
		t.Errorf("every engine metric registered: %v", err)
	}
	partial := metricSet{
		"tether_engine_waiting_requests":     labelSet("instance"),
		"tether_engine_kv_cache_usage_ratio": labelSet("upstream"),
	}
	err := checkEngineMetrics(partial)
	for _, want := range []string{
		"tether_engine_waiting_requests has labels [instance], the dashboard and the rules expect [upstream]",
		"tether_engine_preemptions_total is not exported",
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("checkEngineMetrics: %v\nwant an error containing %q", err, want)
		}
	}
}

func TestDeployParsePromQL(t *testing.T) {
	for _, tc := range []struct {
		expr string
		want promQLRefs
	}{
		{`tether_redis_up`, promQLRefs{metrics: []string{"tether_redis_up"}}},
		{`sum by (mode, decision) (rate(tether_requests_total{mode=~"sticky|adaptive", decision!="x{y}"}[$__rate_interval]))`,
			promQLRefs{metrics: []string{"tether_requests_total"}, matchers: map[string][]string{"tether_requests_total": {"mode", "decision"}},
				grouping: []string{"mode", "decision"}}},
		{`histogram_quantile(0.99, sum(rate(a_bucket[5m])) by (le))`, promQLRefs{metrics: []string{"a_bucket"}, grouping: []string{"le"}}},
		{"max by (upstream) (a) == 0\nor # a comment names_nothing\nmax by (upstream) (b) > 0",
			promQLRefs{metrics: []string{"a", "b"}, grouping: []string{"upstream", "upstream"}}},
		{`a / on(upstream) group_left(zone, version) b unless ignoring () c`,
			promQLRefs{metrics: []string{"a", "b", "c"}, grouping: []string{"upstream", "zone", "version"}}},
		{`SUM BY (le) (rate(x [1h:5m] offset 1h)) AND bool y @ 1.5e+3`,
			promQLRefs{metrics: []string{"x", "y"}, grouping: []string{"le"}}},
		{`label_replace(up{job='a'}, "dst", "$1", "src", "(.*)") * 2e-3 - .5`,
			promQLRefs{metrics: []string{"up"}, matchers: map[string][]string{"up": {"job"}}}},
		{"tether:continuity:ratio_rate5m < 0.9 and tether:followups:rate5m > 0.1",
			promQLRefs{metrics: []string{"tether:continuity:ratio_rate5m", "tether:followups:rate5m"}}},
		{"count_values(`v`, x) + topk(5, y) + vector(1) + Inf + NaN + 0x1F", promQLRefs{metrics: []string{"x", "y"}}},
		{`sum(rate(x {upstream=~"${upstream:regex}",}[${__rate_interval}])) / $scale`,
			promQLRefs{metrics: []string{"x"}, matchers: map[string][]string{"x": {"upstream"}}}},
	} {
		got, err := parsePromQL(tc.expr)
		if err != nil {
			t.Errorf("parsePromQL(%q): %v", tc.expr, err)
			continue
		}
		if diff := cmp.Diff(tc.want, got, cmp.AllowUnexported(promQLRefs{})); diff != "" {
			t.Errorf("parsePromQL(%q) (-want +got):\n%s", tc.expr, diff)
		}
	}
	for _, bad := range []string{
		``, `sum(x`, `x)`, `x{a="b"`, `x{a="b}`, `x{a}`, `x{a=b}`, `x{a="b" c="d"}`, `x[5m`, `{__name__="x"}`,
		`{job="x"}`, `x; y`, `'open`, `sum by (a b) (x)`,
	} {
		if refs, err := parsePromQL(bad); err == nil {
			t.Errorf("parsePromQL(%q) = %+v, want an error", bad, refs)
		}
	}
}

// FuzzParsePromQL: the tokenizer never panics and returns only valid
// metric and label names.
func FuzzParsePromQL(f *testing.F) {
	for _, s := range []string{
		`sum by (le) (rate(x_bucket{a="b"}[5m]))`, `a / on(x) group_left b`, "`raw` 'q' \"d\\\"\"", `${v:regex} $__interval`,
		`x[1h:5m] offset -1h @ start()`, `1e-3 + .5 + 0x1f`, "# comment\nx", `x{a=~"b",c!~'d',}`,
	} {
		f.Add(s)
	}
	metric := regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*$`)
	label := regexp.MustCompile(`^[a-zA-Z_][a-zA-Z0-9_]*$`)
	f.Fuzz(func(t *testing.T, expr string) {
		refs, err := parsePromQL(expr)
		if err != nil {
			return
		}
		for _, n := range refs.metrics {
			if !metric.MatchString(n) {
				t.Fatalf("parsePromQL(%q): metric %q", expr, n)
			}
		}
		for m, ls := range refs.matchers {
			if !slices.Contains(refs.metrics, m) {
				t.Fatalf("parsePromQL(%q): matchers of %q, not a metric found", expr, m)
			}
			for _, l := range ls {
				if !label.MatchString(l) {
					t.Fatalf("parsePromQL(%q): label %q", expr, l)
				}
			}
		}
		for _, l := range refs.grouping {
			if !label.MatchString(l) {
				t.Fatalf("parsePromQL(%q): grouping label %q", expr, l)
			}
		}
	})
}

// engineMetrics are the engine signals tether exports per GPU instance
// from the engines' scraped /metrics, as the dashboard and the rules name
// them (they are registered whether or not any instance is scraped, so a
// per-instance series can be checked without one).
var engineMetrics = metricSet{
	"tether_engine_waiting_requests":                labelSet("upstream"),
	"tether_engine_running_requests":                labelSet("upstream"),
	"tether_engine_kv_cache_usage_ratio":            labelSet("upstream"),
	"tether_engine_prefix_cache_hit_tokens_total":   labelSet("upstream"),
	"tether_engine_prefix_cache_query_tokens_total": labelSet("upstream"),
	"tether_engine_preemptions_total":               labelSet("upstream"),
	"tether_engine_reading_age_seconds":             labelSet("upstream"),
	"tether_engine_scrapes_total":                   labelSet(),
	"tether_engine_scrape_errors_total":             labelSet("reason"),
	"tether_engine_scrape_duration_seconds":         labelSet(),
	"tether_engine_scrape_duration_seconds_bucket":  labelSet("le"),
	"tether_engine_scrape_duration_seconds_sum":     labelSet(),
	"tether_engine_scrape_duration_seconds_count":   labelSet(),
}

// checkEngineMetrics reports every engine metric exported lacks or labels
// otherwise than engineMetrics.
func checkEngineMetrics(exported metricSet) error {
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(engineMetrics)) {
		want := engineMetrics[name]
		got, ok := exported[name]
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("%s is not exported: the dashboard and the rules name it", name))
		case !maps.Equal(got, want):
			errs = append(errs, fmt.Errorf("%s has labels %v, the dashboard and the rules expect %v",
				name, slices.Sorted(maps.Keys(got)), slices.Sorted(maps.Keys(want))))
		}
	}
	return errors.Join(errs...)
}

// metricSet maps each metric name to its label names. A nil set (the
// output of a recording rule) is not checked.
type metricSet map[string]map[string]bool

func labelSet(names ...string) map[string]bool {
	m := make(map[string]bool, len(names))
	for _, n := range names {
		m[n] = true
	}
	return m
}

// targetLabels are the labels Prometheus adds to every scraped series:
// the scrape job and the target, here a tether replica.
var targetLabels = labelSet("job", "instance")

// exportedMetrics starts Run, with every optional part on (the ADS
// server, the routing audit) so their collectors register too, and
// returns every metric its collectors describe, with its labels.
func exportedMetrics(t *testing.T) metricSet {
	t.Helper()
	rec := &recordingRegisterer{}
	cfg := testConfig()
	dir := t.TempDir()
	cfg.Audit.Enabled = true
	cfg.Audit.Sink = config.AuditSinkFile
	cfg.Audit.FileDir = filepath.Join(dir, "audit")
	cfg.Audit.KeyringFile = filepath.Join(dir, "keyring")
	cfg.Audit.PseudonymKeyFile = filepath.Join(dir, "pseudonym")
	for file, text := range map[string]string{
		cfg.Audit.KeyringFile:      "k1=" + strings.Repeat("ab", 32),
		cfg.Audit.PseudonymKeyFile: strings.Repeat("cd", 32),
	} {
		if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	w := logWatcher{lines: make(chan map[string]any, 64)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, cfg, Options{Logger: zerolog.New(w), WrapRegisterer: func(reg prometheus.Registerer) prometheus.Registerer {
			rec.Registerer = reg
			return rec
		}})
	}()
	deadline := time.After(10 * time.Second)
	for ready := false; !ready; {
		select {
		case m := <-w.lines:
			ready = m["message"] == "tether ready"
		case err := <-done:
			cancel()
			t.Fatalf("Run returned before ready: %v", err)
		case <-deadline:
			cancel()
			_ = <-done
			t.Fatal("not ready within 10s")
		}
	}
	metrics, err := rec.metrics()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return metrics
}

// recordingRegisterer registers with the registry Run serves and keeps
// the collectors.
type recordingRegisterer struct {
	prometheus.Registerer
	mu         sync.Mutex
	collectors []prometheus.Collector
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	if err := r.Registerer.Register(c); err != nil {
		return err
	}
	r.mu.Lock()
	r.collectors = append(r.collectors, c)
	r.mu.Unlock()
	return nil
}

func (r *recordingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

func (r *recordingRegisterer) Unregister(c prometheus.Collector) bool {
	r.mu.Lock()
	r.collectors = slices.DeleteFunc(r.collectors, func(x prometheus.Collector) bool { return x == c })
	r.mu.Unlock()
	return r.Registerer.Unregister(c)
}

// metrics describes every collector registered so far. A histogram
// counts as name, name_bucket (with le), name_sum and name_count; a
// summary as name (with quantile), name_sum and name_count. Which
// descriptors are histograms or summaries is known from the collector's
// type, or, for custom collectors (the Go collector's summary), from what
// it collects.
func (r *recordingRegisterer) metrics() (metricSet, error) {
	r.mu.Lock()
	cs := slices.Clone(r.collectors)
	r.mu.Unlock()
	out := metricSet{}
	add := func(name string, labels []string, extra ...string) {
		if out[name] == nil {
			out[name] = labelSet()
		}
		for _, l := range append(labels, extra...) {
			out[name][l] = true
		}
	}
	for _, c := range cs {
		// A vector with no child yet gathers nothing, so its kind comes
		// from its type; a plain histogram or summary gathers its kind.
		// (prometheus.Histogram and prometheus.Summary have the same
		// methods: a type switch on them cannot tell them apart.)
		kind := map[string]string{}
		switch c.(type) {
		case *prometheus.HistogramVec:
			kind[""] = "HISTOGRAM"
		case *prometheus.SummaryVec:
			kind[""] = "SUMMARY"
		}
		alone := prometheus.NewRegistry()
		if err := alone.Register(c); err != nil {
			return nil, fmt.Errorf("%T: %w", c, err)
		}
		mfs, err := alone.Gather()
		if err != nil {
			return nil, fmt.Errorf("%T: gather: %w", c, err)
		}
		for _, mf := range mfs {
			kind[mf.GetName()] = mf.GetType().String()
		}
		descs := make(chan *prometheus.Desc)
		go func() { c.Describe(descs); close(descs) }()
		var errs []error
		for d := range descs {
			name, labels, err := parseDesc(d.String())
			if err != nil {
				errs = append(errs, fmt.Errorf("%T: %w", c, err))
				continue
			}
			k, ok := kind[name]
			if !ok {
				k = kind[""]
			}
			switch k {
			case "HISTOGRAM":
				add(name, labels)
				add(name+"_bucket", labels, "le")
				add(name+"_sum", labels)
				add(name+"_count", labels)
			case "SUMMARY":
				add(name, labels, "quantile")
				add(name+"_sum", labels)
				add(name+"_count", labels)
			default:
				add(name, labels)
			}
		}
		if err := errors.Join(errs...); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// parseDesc reads a metric's name and label names (constant and
// variable) out of Desc.String:
//
//	Desc{fqName: "name", help: "…", unit: "…", constLabels: {k="v",…}, variableLabels: {a,c(b),…}}
//
// with the name, help, unit and constant values Go-quoted and a
// constrained variable label written c(name). The unit is left out by
// client_golang before 1.21.
func parseDesc(s string) (name string, labels []string, err error) {
	fail := func(what string) (string, []string, error) {
		return "", nil, fmt.Errorf("descriptor %s: %s", s, what)
	}
	rest, ok := strings.CutPrefix(s, "Desc{fqName: ")
	if !ok {
		return fail("no fqName")
	}
	quoted := func(field string) (string, bool) {
		if field != "" {
			if rest, ok = strings.CutPrefix(rest, ", "+field+": "); !ok {
				return "", false
			}
		}
		q, err := strconv.QuotedPrefix(rest)
		if err != nil {
			return "", false
		}
		rest = rest[len(q):]
		v, err := strconv.Unquote(q)
		return v, err == nil
	}
	if name, ok = quoted(""); !ok || name == "" {
		return fail("fqName unreadable")
	}
	if _, ok = quoted("help"); !ok {
		return fail("help unreadable")
	}
	if strings.HasPrefix(rest, ", unit: ") {
		if _, ok = quoted("unit"); !ok {
			return fail("unit unreadable")
		}
	}
	if rest, ok = strings.CutPrefix(rest, ", constLabels: {"); !ok {
		return fail("no constLabels")
	}
	for !strings.HasPrefix(rest, "}") {
		label, after, ok := strings.Cut(rest, "=")
		if !ok {
			return fail("constLabels unreadable")
		}
		labels = append(labels, label)
		rest = after
		if _, ok = quoted(""); !ok {
			return fail("constLabels value unreadable")
		}
		rest = strings.TrimPrefix(rest, ",")
	}
	vars, ok := strings.CutPrefix(rest, "}, variableLabels: {")
	if !ok || !strings.HasSuffix(vars, "}}") {
		return fail("variableLabels unreadable")
	}
	if vars = strings.TrimSuffix(vars, "}}"); vars != "" {
		for _, l := range strings.Split(vars, ",") {
			if c, ok := strings.CutPrefix(l, "c("); ok {
				l = strings.TrimSuffix(c, ")")
			}
			labels = append(labels, l)
		}
	}
	return name, labels, nil
}

// checkDashboard checks a Grafana dashboard: valid JSON, unique panel
// ids, every panel (rows aside) with targets, and every expression of a
// target or query variable naming only exported metrics and their labels.
// It reports every problem.
func checkDashboard(data []byte, exported metricSet) error {
	var dash struct {
		Panels     []dashPanel `json:"panels"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		return fmt.Errorf("invalid JSON: %w", err)
	}
	var errs []error
	ids := map[int]string{}
	var walk func([]dashPanel)
	walk = func(panels []dashPanel) {
		for _, p := range panels {
			where := fmt.Sprintf("panel %d %q", p.ID, p.Title)
			if other, dup := ids[p.ID]; dup {
				errs = append(errs, fmt.Errorf("%s: id %d also used by panel %q", where, p.ID, other))
			}
			ids[p.ID] = p.Title
			if p.Type == "row" {
				walk(p.Panels)
				continue
			}
			if len(p.Targets) == 0 {
				errs = append(errs, fmt.Errorf("%s: no targets", where))
			}
			for _, tg := range p.Targets {
				errs = append(errs, checkExpr(fmt.Sprintf("%s target %s", where, tg.RefID), tg.Expr, exported))
			}
		}
	}
	walk(dash.Panels)
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		where := "variable " + v.Name
		expr, err := variableExpr(v.Query)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", where, err))
			continue
		}
		if expr != "" {
			errs = append(errs, checkExpr(where, expr, exported))
		}
	}
	return errors.Join(errs...)
}

type dashPanel struct {
	ID      int         `json:"id"`
	Title   string      `json:"title"`
	Type    string      `json:"type"`
	Panels  []dashPanel `json:"panels"` // a collapsed row's
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
}

// variableExpr returns the PromQL inside a Prometheus query variable's
// query, a string or (Grafana 10) an object holding it:
// label_values(selector, label) and query_result(expr) have some;
// label_values(label), label_names() and metrics(regex) name no metric.
func variableExpr(raw json.RawMessage) (string, error) {
	var q string
	if json.Unmarshal(raw, &q) != nil {
		var o struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(raw, &o); err != nil {
			return "", fmt.Errorf("query: %w", err)
		}
		q = o.Query
	}
	q = strings.TrimSpace(q)
	fn, rest, ok := strings.Cut(q, "(")
	args, closed := strings.CutSuffix(rest, ")")
	if ok && closed {
		switch strings.TrimSpace(fn) {
		case "label_values":
			if i := strings.LastIndex(args, ","); i >= 0 {
				return args[:i], nil
			}
			return "", nil
		case "query_result":
			return args, nil
		case "label_names", "metrics":
			return "", nil
		}
	}
	return "", fmt.Errorf("query %q: want label_values(…), query_result(…), label_names(…) or metrics(…)", q)
}

// checkRules checks a Prometheus rules file: every expression names only
// exported metrics and their labels, or the file's own recording rules;
// every alert has a severity label, summary and description, and a
// runbook_url whose anchor is a heading of doc (docs/metrics.md).
func checkRules(data []byte, exported metricSet, doc []byte) error {
	var file struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Record      string            `json:"record"`
				Alert       string            `json:"alert"`
				Expr        string            `json:"expr"`
				Labels      map[string]string `json:"labels"`
				Annotations map[string]string `json:"annotations"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(data, &file); err != nil {
		return fmt.Errorf("invalid YAML: %w", err)
	}
	known := metricSet{}
	for name, labels := range exported {
		known[name] = labels
	}
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			if r.Record != "" {
				known[r.Record] = nil // its labels are its expression's: not checked
			}
		}
	}
	anchors := docAnchors(doc)
	var errs []error
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			where := fmt.Sprintf("group %s: record %s", g.Name, r.Record)
			if r.Alert != "" {
				where = fmt.Sprintf("group %s: alert %s", g.Name, r.Alert)
				if r.Labels["severity"] == "" {
					errs = append(errs, fmt.Errorf("%s: no severity label", where))
				}
				for _, a := range []string{"summary", "description", "runbook_url"} {
					if r.Annotations[a] == "" {
						errs = append(errs, fmt.Errorf("%s: no %s annotation", where, a))
					}
				}
				if u := r.Annotations["runbook_url"]; u != "" {
					page, anchor, _ := strings.Cut(u, "#")
					if !strings.HasSuffix(page, metricsDocFile) || !anchors[anchor] {
						errs = append(errs, fmt.Errorf("%s: no heading in %s for its runbook anchor %q", where, metricsDocFile, anchor))
					}
				}
			}
			errs = append(errs, checkExpr(where, r.Expr, known))
		}
	}
	return errors.Join(errs...)
}

// docAnchors are the GitHub anchors of a Markdown file's headings: lower
// case, spaces as hyphens, other punctuation dropped.
func docAnchors(doc []byte) map[string]bool {
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		var b strings.Builder
		for _, r := range strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#"))) {
			switch {
			case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '-', r == '_':
				b.WriteRune(r)
			case r == ' ':
				b.WriteByte('-')
			}
		}
		anchors[b.String()] = true
	}
	return anchors
}

// checkExpr reports the metrics expr names that are not known, labels
// its selectors match that their metric lacks, and labels it groups or
// matches on (by, without, on, ignoring, group_left, group_right) that
// none of its metrics has. The labels Prometheus adds (job, instance)
// are on every metric; a recording rule's output is not checked.
func checkExpr(where, expr string, known metricSet) error {
	refs, err := parsePromQL(expr)
	if err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	var errs []error
	all, checkable := labelSet(), true
	for _, m := range refs.metrics {
		labels, ok := known[m]
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("%s: %s is not exported by tether", where, m))
			checkable = false
			continue
		case labels == nil:
			checkable = false
			continue
		}
		for l := range labels {
			all[l] = true
		}
		for _, l := range refs.matchers[m] {
			if !labels[l] && !targetLabels[l] {
				errs = append(errs, fmt.Errorf("%s: %s has no label %s", where, m, l))
			}
		}
	}
	if checkable {
		for _, l := range refs.grouping {
			if !all[l] && !targetLabels[l] {
				errs = append(errs, fmt.Errorf("%s: by/without/on/ignoring/group_* label %s is on none of %s",
					where, l, strings.Join(refs.metrics, ", ")))
			}
		}
	}
	return errors.Join(errs...)
}

// promQLRefs is what a PromQL expression refers to.
type promQLRefs struct {
	metrics  []string            // selected, in order of first appearance
	matchers map[string][]string // per metric, the labels its selectors match on
	grouping []string            // labels of by, without, on, ignoring, group_left, group_right
}

// parsePromQL tokenizes a PromQL expression (or a Grafana one: $var and
// ${var} are skipped) and returns the metrics it selects and the labels it
// names. It skips strings, comments, ranges and subqueries ([…]),
// numbers and durations, keywords and aggregation operators; an
// identifier followed by "(" is a function; any other identifier is a
// metric name, and a {…} after it its label matchers. It fails on
// unterminated strings or brackets, unbalanced parentheses, malformed
// matchers, characters PromQL does not use, and selectors without a
// metric name (by __name__, or none), which it cannot check.
func parsePromQL(expr string) (promQLRefs, error) {
	var refs promQLRefs
	if strings.TrimSpace(expr) == "" {
		return refs, errors.New("empty expression")
	}
	seen := map[string]bool{}
	depth := 0
	s := expr
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == '#':
			for i < len(s) && s[i] != '\n' {
				i++
			}
		case c == '"' || c == '\'' || c == '`':
			end, err := skipString(s, i)
			if err != nil {
				return refs, err
			}
			i = end
		case c == '{':
			return refs, fmt.Errorf("selector without a metric name at offset %d: name the metric", i)
		case c == '[':
			end, err := skipUntil(s, i, ']')
			if err != nil {
				return refs, err
			}
			i = end
		case c == '$':
			i++
			if i < len(s) && s[i] == '{' {
				end, err := skipUntil(s, i, '}')
				if err != nil {
					return refs, err
				}
				i = end
				break
			}
			for i < len(s) && isLabelChar(s[i]) {
				i++
			}
		case isDigit(c) || c == '.' && i+1 < len(s) && isDigit(s[i+1]):
			// A number or a duration: 0.99, 1e-3, 0x1f, 5m, 1h30m.
			hex := strings.HasPrefix(strings.ToLower(s[i:]), "0x")
			for i++; i < len(s); i++ {
				d := s[i]
				exp := (d == '+' || d == '-') && (s[i-1] == 'e' || s[i-1] == 'E') && !hex
				if !exp && d != '.' && !isLabelChar(d) {
					break
				}
			}
		case isMetricStart(c):
			j := i + 1
			for j < len(s) && (isLabelChar(s[j]) || s[j] == ':') {
				j++
			}
			word := s[i:j]
			i = skipSpace(s, j)
			lower := strings.ToLower(word)
			switch {
			case labelListKeywords[lower]:
				if i < len(s) && s[i] == '(' {
					labels, end, err := labelList(s, i)
					if err != nil {
						return refs, err
					}
					refs.grouping = append(refs.grouping, labels...)
					i = end
				}
			case keywords[lower] || aggregators[lower]:
			case i < len(s) && s[i] == '(':
				// a function call
			default:
				if !seen[word] {
					seen[word] = true
					refs.metrics = append(refs.metrics, word)
				}
				if i < len(s) && s[i] == '{' {
					labels, end, err := matcherLabels(s, i)
					if err != nil {
						return refs, err
					}
					for _, l := range labels {
						if l == "__name__" {
							return refs, fmt.Errorf("selector %s: matches __name__, which is not checked; name the metric", s[i:end])
						}
						if refs.matchers == nil {
							refs.matchers = map[string][]string{}
						}
						refs.matchers[word] = append(refs.matchers[word], l)
					}
					i = end
				}
			}
		case c == '(':
			depth++
			i++
		case c == ')':
			if depth--; depth < 0 {
				return refs, errors.New("unbalanced parentheses")
			}
			i++
		case strings.IndexByte("+-*/%^=!<>~,@", c) >= 0:
			i++
		default:
			return refs, fmt.Errorf("unexpected %q at offset %d", c, i)
		}
	}
	if depth != 0 {
		return refs, errors.New("unbalanced parentheses")
	}
	return refs, nil
}

var (
	keywords = labelSet("and", "or", "unless", "bool", "offset", "inf", "nan", "atan2")
	// labelListKeywords are followed by a parenthesised list of labels
	// (group_left and group_right may stand alone).
	labelListKeywords = labelSet("by", "without", "on", "ignoring", "group_left", "group_right")
	aggregators       = labelSet("sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
		"bottomk", "topk", "quantile", "limitk", "limit_ratio")
)

// labelList reads the label list in parentheses at s[i] ("(a, b)",
// possibly empty or with a trailing comma) and returns its labels and
// the offset past it.
func labelList(s string, i int) (labels []string, end int, err error) {
	i = skipSpace(s, i+1)
	for {
		if i < len(s) && s[i] == ')' {
			return labels, i + 1, nil
		}
		j := i
		for j < len(s) && isLabelChar(s[j]) {
			j++
		}
		if j == i || isDigit(s[i]) {
			return nil, 0, fmt.Errorf("label list at offset %d: want a label name", i)
		}
		labels = append(labels, s[i:j])
		i = skipSpace(s, j)
		switch {
		case i < len(s) && s[i] == ',':
			i = skipSpace(s, i+1)
		case i < len(s) && s[i] == ')':
		default:
			return nil, 0, fmt.Errorf("label list at offset %d: want ',' or ')'", i)
		}
	}
}

// matcherLabels reads the label matchers in braces at s[i]
// ({a="x", b=~'y'}, possibly empty or with a trailing comma) and returns
// their label names and the offset past the closing brace.
func matcherLabels(s string, i int) (labels []string, end int, err error) {
	i = skipSpace(s, i+1)
	for {
		if i < len(s) && s[i] == '}' {
			return labels, i + 1, nil
		}
		j := i
		for j < len(s) && isLabelChar(s[j]) {
			j++
		}
		if j == i || isDigit(s[i]) {
			return nil, 0, fmt.Errorf("label matcher at offset %d: want a label name", i)
		}
		labels = append(labels, s[i:j])
		i = skipSpace(s, j)
		op := ""
		for _, o := range []string{"=~", "!~", "!=", "="} {
			if strings.HasPrefix(s[i:], o) {
				op = o
				break
			}
		}
		if op == "" {
			return nil, 0, fmt.Errorf("label matcher at offset %d: want =, !=, =~ or !~", i)
		}
		i = skipSpace(s, i+len(op))
		if i >= len(s) || strings.IndexByte("\"'`", s[i]) < 0 {
			return nil, 0, fmt.Errorf("label matcher at offset %d: want a quoted value", i)
		}
		if i, err = skipString(s, i); err != nil {
			return nil, 0, err
		}
		i = skipSpace(s, i)
		switch {
		case i < len(s) && s[i] == ',':
			i = skipSpace(s, i+1)
		case i < len(s) && s[i] == '}':
		default:
			return nil, 0, fmt.Errorf("label matcher at offset %d: want ',' or '}'", i)
		}
	}
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }
func isMetricStart(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '_' || c == ':'
}
func isLabelChar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '_' || isDigit(c)
}

func skipSpace(s string, i int) int {
	for i < len(s) && strings.IndexByte(" \t\r\n", s[i]) >= 0 {
		i++
	}
	return i
}

// skipString returns the offset past the string literal at s[i]. Go-style
// escapes are honoured in "…" and '…'; `…` is raw.
func skipString(s string, i int) (int, error) {
	quote := s[i]
	for j := i + 1; j < len(s); j++ {
		switch {
		case s[j] == '\\' && quote != '`':
			j++
		case s[j] == quote:
			return j + 1, nil
		}
	}
	return 0, fmt.Errorf("unterminated string at offset %d", i)
}

// skipUntil returns the offset past the first close after s[i] that is
// outside a string literal.
func skipUntil(s string, i int, close byte) (int, error) {
	for j := i + 1; j < len(s); {
		switch s[j] {
		case close:
			return j + 1, nil
		case '"', '\'', '`':
			end, err := skipString(s, j)
			if err != nil {
				return 0, err
			}
			j = end
		default:
			j++
		}
	}
	return 0, fmt.Errorf("unterminated %q at offset %d", s[i], i)
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return root
}
