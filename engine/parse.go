package engine

import (
	"bytes"
	"fmt"
	"io"
	"math"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// maxCount bounds the waiting and running requests of one instance. No
// engine holds a billion requests, so a larger count is garbage, not load.
const maxCount = 1e9

// Parse reads one exposition in the Prometheus text format and returns what
// it says. vLLM and SGLang serve that format on /metrics. The requests
// waiting and running are rounded to whole requests.
//
// Every failure is an *Error:
//
//   - ReasonParse: r is not the text format, or fails to read.
//   - ReasonMissing: the kind's queue gauges are absent.
//   - ReasonBadValue: a value tether reads is NaN, infinite, negative, or a
//     usage above 1. The whole sample is refused.
//
// The KV cache's capacity never refuses a sample. What cannot be read of it
// leaves Sample.CacheTokens 0. The generic kind, or an unknown one, is an
// error.
//
// Parse reads r to its end, so bound it. Scrape bounds it to its MaxBody.
func Parse(kind Kind, r io.Reader) (Sample, error) {
	sp, err := specOf(kind)
	if err != nil {
		return Sample{}, err
	}
	b, err := io.ReadAll(r)
	if err != nil {
		return Sample{}, &Error{Reason: ReasonParse, Err: err}
	}
	return sp.parse(b)
}

// families are the metric families of one exposition, by name.
type families map[string]*dto.MetricFamily

// spec is how the exposition of one kind of engine is read.
type spec struct {
	// running and waiting are the queue gauges. Both are required.
	// usage lists the candidate KV-cache usage gauges. The first present
	// wins.
	running, waiting string
	usage            []string
	// engine is how the engine's own series, the scheduler's, combine.
	engine fold
	// prefix reads the cumulative prefix-cache token counters.
	prefix func(families) (hits, queries float64, known bool, err error)
	// preemptions is the sample name of the cumulative preemption counter.
	preemptions string
	// names are the names whose lines are parsed. See lines.go.
	names readNames
	// capacity reads the KV cache's capacity in tokens, 0 when unknown.
	// It reads the lines of capacityNames, parsed apart. See capacity.go.
	capacity      func(families) int
	capacityNames readNames
}

func init() {
	vllmSpec.names = namesOf(&vllmSpec,
		"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
		"vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total")
	sglangSpec.names = namesOf(&sglangSpec,
		"sglang:realtime_tokens_total", "sglang:prompt_tokens_total", "sglang:cached_tokens_total")
	vllmSpec.capacity, vllmSpec.capacityNames = vllmCapacity, nameSet("vllm:cache_config_info")
	sglangSpec.capacity, sglangSpec.capacityNames = sglangCapacity, nameSet("sglang:max_total_num_tokens")
}

func specOf(kind Kind) (*spec, error) {
	switch kind {
	case VLLM:
		return &vllmSpec, nil
	case SGLang:
		return &sglangSpec, nil
	case Generic:
		return nil, errNotScraped
	}
	return nil, fmt.Errorf("engine: unknown engine %q", string(kind))
}

// parse parses the lines of b that sp reads. See lines.go.
//
// Every line of the text format ends in a newline. A body that does not end
// in one, blanks aside, was cut short. It is refused, whatever family the cut
// fell in.
//
// When the queue gauges are missing, the whole of b is parsed. That tells an
// exposition without them (ReasonMissing) from something that is no
// exposition at all (ReasonParse).
func (sp *spec) parse(b []byte) (Sample, error) {
	if len(trimBlank(b[bytes.LastIndexByte(b, '\n')+1:])) > 0 {
		return Sample{}, errorf(ReasonParse, "the exposition ends inside a line (%d bytes)", len(b))
	}
	fams, err := textParse(sp.names.relevant(b, make([]byte, 0, min(len(b), 8<<10))))
	if err != nil {
		return Sample{}, &Error{Reason: ReasonParse, Err: fmt.Errorf("in the lines of the families read: %w", err)}
	}
	s, err := sp.sample(fams)
	if Reason(err) == ReasonMissing {
		if _, perr := textParse(b); perr != nil {
			return Sample{}, &Error{Reason: ReasonParse, Err: perr}
		}
	}
	if err != nil {
		return s, err
	}
	// The capacity's lines, parsed apart: whatever is wrong with them leaves
	// the capacity unknown and the sample as it is.
	if lines := sp.capacityNames.relevant(b, nil); len(lines) > 0 {
		if capFams, cerr := textParse(lines); cerr == nil {
			s.CacheTokens = sp.capacity(capFams)
		}
	}
	return s, nil
}

func textParse(b []byte) (families, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(bytes.NewReader(b))
}

// sample reads the load of fams. Waiting and Running are rounded.
func (sp *spec) sample(fams families) (Sample, error) {
	var s Sample
	var runs float64
	var buf [8]engineValue // each fold's result is used up before the next one reuses buf

	running, err := sp.engine.of(fams, sp.running, false, buf[:0])
	if err != nil {
		return Sample{}, err
	}
	if len(running) == 0 {
		return Sample{}, errorf(ReasonMissing, "no %s in the exposition", sp.running)
	}
	runs, s.Engines = sum(running), len(running)

	waiting, err := sp.engine.of(fams, sp.waiting, false, buf[:0])
	if err != nil {
		return Sample{}, err
	}
	if len(waiting) == 0 {
		return Sample{}, errorf(ReasonMissing, "no %s in the exposition", sp.waiting)
	}
	waits := sum(waiting)
	if runs > maxCount || waits > maxCount {
		return Sample{}, errorf(ReasonBadValue, "%v running and %v waiting requests: more than any engine holds", runs, waits)
	}
	s.Running, s.Waiting = count(runs), count(waits)

	for _, name := range sp.usage {
		usage, err := sp.engine.of(fams, name, true, buf[:0])
		if err != nil {
			return Sample{}, err
		}
		if len(usage) > 0 {
			s.KVUsage, s.KVKnown = mean(usage), true
			break
		}
	}

	if s.PrefixHits, s.PrefixQueries, s.PrefixKnown, err = sp.prefix(fams); err != nil {
		return Sample{}, err
	}

	pre, err := sp.engine.of(fams, sp.preemptions, false, buf[:0])
	if err != nil {
		return Sample{}, err
	}
	s.Preemptions = sum(pre)
	// Finite values can add up to infinity.
	for _, v := range [...]float64{s.PrefixHits, s.PrefixQueries, s.Preemptions} {
		if math.IsInf(v, 0) {
			return Sample{}, errorf(ReasonBadValue, "the engines' counts add up to %v", v)
		}
	}
	return s, nil
}

// engineValue is one engine's value of a metric.
type engineValue struct {
	engine string
	v      float64
}

// fold says how the series of one family become one value per engine.
type fold struct {
	// label groups the series by engine. Its value names the engine. A
	// series without it belongs to the engine "". An empty label means
	// one engine.
	label string
	// copies says the series of one engine that differ in other labels
	// are copies of one view. SGLang's TP, PP and EP ranks each report
	// their scheduler's state. The largest then stands for the engine.
	// Otherwise the series add up.
	copies bool
	// keep, when set, drops the series it refuses before anything is
	// checked. A per-priority breakdown of a total is one such series.
	keep func(*dto.Metric) bool
}

// of folds the family whose samples are named name into dst, one value per
// engine. It adds nothing when the family is absent. ratio says the values
// are shares, 0 to 1.
func (f fold) of(fams families, name string, ratio bool, dst []engineValue) ([]engineValue, error) {
	mf := lookup(fams, name)
	if mf == nil {
		return dst, nil
	}
	for _, m := range mf.GetMetric() {
		if f.keep != nil && !f.keep(m) {
			continue
		}
		v, ok := number(mf.GetType(), m)
		if !ok {
			return nil, errorf(ReasonBadValue, "%s is a %s, not a number", name, strings.ToLower(mf.GetType().String()))
		}
		switch {
		case math.IsNaN(v) || math.IsInf(v, 0):
			return nil, errorf(ReasonBadValue, "%s%s is %v", name, labelString(m), v)
		case v < 0:
			return nil, errorf(ReasonBadValue, "%s%s is %v: negative", name, labelString(m), v)
		case ratio && v > 1:
			return nil, errorf(ReasonBadValue, "%s%s is %v: a usage above 1", name, labelString(m), v)
		}
		e := ""
		if f.label != "" {
			e = labelValue(m, f.label)
		}
		i := 0
		for i < len(dst) && dst[i].engine != e {
			i++
		}
		switch {
		case i == len(dst):
			dst = append(dst, engineValue{engine: e, v: v})
		case f.copies:
			dst[i].v = math.Max(dst[i].v, v)
		default:
			dst[i].v += v
		}
	}
	return dst, nil
}

// lookup finds the family whose samples are named name.
//
// The text format names a family as its # TYPE line does. client_python
// writes that line with the sample's name. A counter vllm:prefix_cache_hits
// becomes vllm:prefix_cache_hits_total. Its _created series becomes a gauge
// family of its own.
//
// OpenMetrics writes the bare name: # TYPE vllm:prefix_cache_hits counter,
// over vllm:prefix_cache_hits_total samples. expfmt's text parser turns that
// into an untyped family named after the samples.
//
// Both are found by the sample name. A counter family that also drops the
// suffix from its samples is found by the bare name.
func lookup(fams families, name string) *dto.MetricFamily {
	if mf := fams[name]; mf != nil {
		return mf
	}
	if bare, ok := strings.CutSuffix(name, "_total"); ok {
		if mf := fams[bare]; mf != nil && mf.GetType() == dto.MetricType_COUNTER {
			return mf
		}
	}
	return nil
}

// number is the value of a counter, gauge or untyped sample. A histogram or
// summary has none.
func number(t dto.MetricType, m *dto.Metric) (float64, bool) {
	switch t {
	case dto.MetricType_COUNTER:
		return m.GetCounter().GetValue(), m.Counter != nil
	case dto.MetricType_GAUGE:
		return m.GetGauge().GetValue(), m.Gauge != nil
	case dto.MetricType_UNTYPED:
		return m.GetUntyped().GetValue(), m.Untyped != nil
	}
	return 0, false
}

func labelValue(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func labelString(m *dto.Metric) string {
	if len(m.GetLabel()) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteByte('{')
	for i, l := range m.GetLabel() {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s=%q", l.GetName(), l.GetValue())
	}
	b.WriteByte('}')
	return b.String()
}

func sum(vs []engineValue) float64 {
	t := 0.0
	for _, v := range vs {
		t += v.v
	}
	return t
}

func mean(vs []engineValue) float64 {
	if len(vs) == 0 {
		return 0
	}
	return sum(vs) / float64(len(vs))
}

// count rounds a sum of requests, held within 0 and maxCount.
func count(v float64) int {
	switch {
	case !(v > 0): // and NaN
		return 0
	case v > maxCount:
		return maxCount
	}
	return int(math.Round(v))
}
