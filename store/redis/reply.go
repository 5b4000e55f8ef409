package redis

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
)

// The parsers below decode script replies without trusting their shape: a
// reply we did not expect is an error, never a panic.

// bindReply is a decoded getOrBindSrc reply.
type bindReply struct {
	link string // the key is an alias of this session key; nothing else is set
	out  bindings.Origin
	b    bindings.Binding
	move bindings.Move
	prev bindings.Binding // the binding a renewal replaced (zero otherwise)
	// prevInstance is the instance a bind replaced, damaged records
	// included ("" if none): the index entry leaves its index.
	prevInstance string
	index        int64 // write the index entry with this score (0: not due)
	links        int64 // write the request's alias links to expire then (0: not due)
	requests     int   // the session's request count with this request
	// x, e, l are the binding's refresh bookkeeping after the call (0:
	// absent or damaged), for the hit cache.
	x, e, l int64
	// idle is, on a hit, how long the session had gone unused (ms; -1
	// unknown).
	idle int64
}

func parseBindReply(res []any) (bindReply, error) {
	bad := func() (bindReply, error) { return bindReply{}, fmt.Errorf("unexpected get-or-bind reply %v", res) }
	if len(res) == 2 {
		if code, ok := res[0].(int64); ok && code == 0 {
			if to, ok := res[1].(string); ok && to != "" {
				return bindReply{link: to}, nil
			}
		}
		return bad()
	}
	if len(res) != 18 {
		return bad()
	}
	out, ok := res[0].(int64)
	if !ok || out < int64(bindings.Found) || out > int64(bindings.Renewed) {
		return bad()
	}
	var str [12]string
	for i := range str {
		if str[i], ok = res[i+1].(string); !ok {
			return bad()
		}
	}
	b, ok := binding(str[0], str[1], str[2])
	if !ok {
		return bad()
	}
	b.Failovers = failovers(str[10])
	r := bindReply{out: bindings.Origin(out), b: b, move: bindings.Move{Version: str[3], Off: str[4]}, prevInstance: str[5]}
	if r.out == bindings.Renewed {
		if r.prev, ok = binding(str[5], str[6], str[7]); !ok {
			return bad()
		}
		r.prev.Failovers = failovers(str[11])
	}
	if r.index, ok = expiry(str[8]); !ok {
		return bad()
	}
	if r.links, ok = expiry(str[9]); !ok {
		return bad()
	}
	if r.out != bindings.Found && r.index == 0 {
		return bad() // a bind always writes the index
	}
	n, ok := res[13].(int64)
	if !ok || n < 1 {
		return bad() // every request is counted
	}
	r.requests = int(n)
	var fields [3]int64
	for i := range fields {
		v, ok := res[14+i].(string)
		if !ok {
			return bad()
		}
		fields[i], _ = strconv.ParseInt(v, 10, 64) // damaged: 0, due
	}
	r.x, r.e, r.l = fields[0], fields[1], fields[2]
	if r.idle, ok = res[17].(int64); !ok {
		return bad()
	}
	return r, nil
}

// replaceReply is a decoded replaceSrc reply.
type replaceReply struct {
	b     bindings.Binding
	index int64 // as in bindReply
	prev  string
}

func parseReplaceReply(res []any) (replaceReply, error) {
	bad := func() (replaceReply, error) { return replaceReply{}, fmt.Errorf("unexpected replace reply %v", res) }
	if len(res) != 7 {
		return bad()
	}
	replaced, ok1 := res[0].(int64)
	inst, ok2 := res[1].(string)
	since, ok3 := res[2].(string)
	version, ok4 := res[3].(string)
	ie, ok5 := res[4].(string)
	prev, ok6 := res[5].(string)
	f, ok8 := res[6].(string)
	if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 || !ok6 || !ok8 || (replaced != 0 && replaced != 1) {
		return bad()
	}
	b, ok := binding(inst, since, version)
	b.Failovers = failovers(f)
	index, ok7 := expiry(ie)
	if !ok || !ok7 || (replaced == 1 && index == 0) {
		return bad()
	}
	return replaceReply{b: b, index: index, prev: prev}, nil
}

// expiry decodes an expiry field of a reply: "" is 0 (nothing to write),
// otherwise a positive unix millisecond time.
func expiry(v string) (int64, bool) {
	if v == "" {
		return 0, true
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	return ms, err == nil && ms > 0
}

// parseShowReply decodes a showSrc reply: the linked key, or the session
// (ok false when there is none).
func parseShowReply(res []any) (s bindings.Session, link string, ok bool, err error) {
	bad := fmt.Errorf("unexpected show reply %v", res)
	if len(res) == 0 {
		return bindings.Session{}, "", false, bad
	}
	code, isInt := res[0].(int64)
	switch {
	case !isInt:
	case code == 2 && len(res) == 1:
		return bindings.Session{}, "", false, nil
	case code == 0 && len(res) == 2:
		if to, isStr := res[1].(string); isStr && to != "" {
			return bindings.Session{}, to, false, nil
		}
	case code == 1 && len(res) == 8:
		str, ok1 := strings5(res[1:6])
		pttl, ok2 := res[6].(int64)
		b, ok3 := binding(str[0], str[1], str[2])
		f, ok4 := res[7].(string)
		b.Failovers = failovers(f)
		if ok1 && ok2 && ok3 && ok4 {
			return bindings.Session{
				Binding: b,
				Move:    bindings.Move{Version: str[3], Off: str[4]},
				TTL:     time.Duration(max(pttl, 0)) * time.Millisecond,
			}, "", true, nil
		}
	}
	return bindings.Session{}, "", false, bad
}

// parseLoadReply decodes a syncLoadSrc reply. It merges the other
// replicas' reports with r, this replica's own (fleet.MergeLoad). A reply
// of the wrong shape is an error. A report value may not be an integer or
// a reading, from another replica's bug or a damaged key. It is skipped
// and described in skipped. One bad field must not stop every replica's
// load sync.
func parseLoadReply(res []any, r fleet.LoadReport, instances []string) (st fleet.LoadState, skipped []string, err error) {
	bad := func(what string) (fleet.LoadState, []string, error) {
		return fleet.LoadState{}, nil, fmt.Errorf("unexpected sync-load reply (%s): %v", what, res)
	}
	if len(res) != 3 {
		return bad("length")
	}
	active, ok1 := res[0].([]any)
	others, ok2 := res[1].([]any)
	drained, ok3 := res[2].([]any)
	if !ok1 || !ok2 || !ok3 || len(active) != len(instances) || len(others)%2 != 0 {
		return bad("shape")
	}
	reports := make([]fleet.LoadReport, 1, 1+len(others)/2)
	reports[0] = r
	for i := 0; i < len(others); i += 2 {
		rep, what := parseReport(others[i], others[i+1], &skipped)
		if what != "" {
			return bad(what)
		}
		reports = append(reports, rep)
	}
	st = fleet.MergeLoad(r.Replica, instances, reports)
	for i, in := range instances {
		n, ok := active[i].(int64)
		if !ok {
			return bad("active count")
		}
		st.Active[in] = int(n)
	}
	for _, d := range drained {
		in, ok := d.(string)
		if !ok {
			return bad("drained member")
		}
		st.Drained[in] = true
	}
	return st, skipped, nil
}

// parseReport decodes one replica's report: its name, and the HGETALL of
// its report key. what names the part of the wrong shape ("" when none).
// A value that does not decode is described in skipped and left out.
func parseReport(name, hash any, skipped *[]string) (r fleet.LoadReport, what string) {
	replica, ok1 := name.(string)
	fields, ok2 := hash.([]any)
	if !ok1 || !ok2 || len(fields)%2 != 0 {
		return r, "report"
	}
	r = fleet.LoadReport{Replica: replica, InFlight: map[string]int{}, Queue: map[string]int{}, Engine: map[string]fleet.EngineReading{}}
	for j := 0; j < len(fields); j += 2 {
		field, ok := fields[j].(string)
		if !ok {
			return r, "report field"
		}
		kind, in, _ := strings.Cut(field, ":")
		if kind != "f" && kind != "q" && kind != "e" {
			continue // a newer replica's field: not ours to read
		}
		val, ok := fields[j+1].(string)
		if !ok {
			return r, "report value"
		}
		if kind == "e" {
			e, err := decodeReading(val)
			if err != nil {
				*skipped = append(*skipped, fmt.Sprintf("replica %q field %q: %v", replica, field, err))
				continue
			}
			r.Engine[in] = e
			continue
		}
		n, err := strconv.Atoi(val)
		if err != nil {
			*skipped = append(*skipped, fmt.Sprintf("replica %q field %q = %q", replica, field, val))
			continue
		}
		if kind == "f" {
			r.InFlight[in] = n
		} else {
			r.Queue[in] = n
		}
	}
	return r, ""
}

// strings5 returns the five elements of v as strings.
func strings5(v []any) ([5]string, bool) {
	var out [5]string
	if len(v) != 5 {
		return out, false
	}
	for i, x := range v {
		s, ok := x.(string)
		if !ok {
			return out, false
		}
		out[i] = s
	}
	return out, true
}

// failovers decodes the f field. It only steers the fallback ladder, so a
// damaged value counts as 0 rather than failing the request.
func failovers(v string) int {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 || n > bindings.MaxFailovers {
		return 0
	}
	return n
}

// binding builds a Binding from stored fields; since is unix milliseconds.
func binding(instance, since, version string) (bindings.Binding, bool) {
	ms, err := strconv.ParseInt(since, 10, 64)
	if err != nil || instance == "" {
		return bindings.Binding{}, false
	}
	return bindings.Binding{Instance: instance, Version: version, Since: time.UnixMilli(ms)}, true
}

// wireReading is an engine reading as a report field holds it (JSON, short
// names: a report carries one per scraped instance every second).
type wireReading struct {
	W, R       int
	KV         *float64 `json:",omitempty"`
	H, Q       *float64 `json:",omitempty"` // prefix-cache hits, queries (tokens)
	P          float64
	HR, QR, PR *float64 `json:",omitempty"` // rates, when known
	C          int      `json:",omitempty"` // KV-cache capacity (tokens), when published
	At         int64    // Unix milliseconds
}

func encodeReading(e fleet.EngineReading) string {
	w := wireReading{W: e.Waiting, R: e.Running, P: e.Preemptions, C: e.CacheTokens, At: e.At.UnixMilli()}
	if e.KVKnown {
		w.KV = &e.KVUsage
	}
	if e.PrefixKnown {
		w.H, w.Q = &e.PrefixHits, &e.PrefixQueries
	}
	if e.RatesKnown {
		w.HR, w.QR, w.PR = &e.HitRate, &e.QueryRate, &e.PreemptionRate
	}
	b, _ := json.Marshal(w) // never fails: the scraper refuses NaN and infinities
	return string(b)
}

// decodeReading reads a report field back; one that is not a reading with
// sane values (another replica's bug, a damaged key) is an error.
func decodeReading(s string) (fleet.EngineReading, error) {
	var w wireReading
	if err := json.Unmarshal([]byte(s), &w); err != nil {
		return fleet.EngineReading{}, fmt.Errorf("not an engine reading: %w", err)
	}
	e := fleet.EngineReading{Waiting: w.W, Running: w.R, Preemptions: w.P, CacheTokens: w.C, At: time.UnixMilli(w.At)}
	if w.KV != nil {
		e.KVUsage, e.KVKnown = *w.KV, true
	}
	if w.H != nil && w.Q != nil {
		e.PrefixHits, e.PrefixQueries, e.PrefixKnown = *w.H, *w.Q, true
	}
	if w.HR != nil && w.QR != nil && w.PR != nil {
		e.HitRate, e.QueryRate, e.PreemptionRate, e.RatesKnown = *w.HR, *w.QR, *w.PR, true
	}
	if e.Waiting < 0 || e.Running < 0 || e.KVUsage < 0 || e.KVUsage > 1 || e.PrefixHits < 0 || e.PrefixQueries < 0 ||
		e.Preemptions < 0 || e.HitRate < 0 || e.QueryRate < 0 || e.PreemptionRate < 0 || e.CacheTokens < 0 || w.At <= 0 {
		return fleet.EngineReading{}, fmt.Errorf("engine reading out of range: %s", s)
	}
	return e, nil
}

// touchReply is one session's part of a touchSrc reply.
type touchReply struct {
	same, moving bool  // the binding written back is still there; it has a move pending
	index, links int64 // as in bindReply
	requests     int   // the session's count, these hits included
	lastUse      int64 // the last use Redis knew of before (ms; -1 none)
}

// parseTouchReply decodes the reply of a touch call for n sessions.
func parseTouchReply(res []any, n int) ([]touchReply, error) {
	bad := func() ([]touchReply, error) { return nil, fmt.Errorf("unexpected touch reply %v", res) }
	if len(res) != 5*n {
		return bad()
	}
	out := make([]touchReply, n)
	for i := range out {
		v := res[5*i : 5*i+5]
		st, ok1 := v[0].(int64)
		ie, ok2 := v[1].(string)
		le, ok3 := v[2].(string)
		reqs, ok4 := v[3].(int64)
		u, ok5 := v[4].(int64)
		if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 || st < 0 || st > 2 {
			return bad()
		}
		if st == 0 {
			continue
		}
		r := touchReply{same: true, moving: st == 2, requests: int(reqs), lastUse: u}
		if r.index, ok1 = expiry(ie); !ok1 {
			return bad()
		}
		if r.links, ok1 = expiry(le); !ok1 {
			return bad()
		}
		out[i] = r
	}
	return out, nil
}
