package redis

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/tetherproxy/tether/affinity"
)

// The parsers below decode script replies without trusting their shape: a
// reply we did not expect is an error, never a panic.

// bindReply is a decoded getOrBindSrc reply.
type bindReply struct {
	link    string // the key is an alias of this session key; nothing else is set
	out     affinity.Outcome
	b       affinity.Binding
	move    affinity.Move
	refresh bool   // the index entry must be written
	prev    string // the instance a bind replaced ("" if none)
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
	if len(res) != 8 {
		return bad()
	}
	out, ok1 := res[0].(int64)
	str, ok2 := strings5(res[1:6])
	refresh, ok3 := res[6].(int64)
	prev, ok4 := res[7].(string)
	if !ok1 || !ok2 || !ok3 || !ok4 || out < int64(affinity.Found) || out > int64(affinity.Renewed) || (refresh != 0 && refresh != 1) {
		return bad()
	}
	b, ok := binding(str[0], str[1], str[2])
	if !ok {
		return bad()
	}
	return bindReply{
		out:     affinity.Outcome(out),
		b:       b,
		move:    affinity.Move{Version: str[3], Off: str[4]},
		refresh: refresh == 1,
		prev:    prev,
	}, nil
}

// replaceReply is a decoded replaceSrc reply.
type replaceReply struct {
	b       affinity.Binding
	refresh bool
	prev    string
}

func parseReplaceReply(res []any) (replaceReply, error) {
	bad := func() (replaceReply, error) { return replaceReply{}, fmt.Errorf("unexpected replace reply %v", res) }
	if len(res) != 6 {
		return bad()
	}
	replaced, ok1 := res[0].(int64)
	inst, ok2 := res[1].(string)
	since, ok3 := res[2].(string)
	version, ok4 := res[3].(string)
	refresh, ok5 := res[4].(int64)
	prev, ok6 := res[5].(string)
	if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 || !ok6 || (replaced != 0 && replaced != 1) || (refresh != 0 && refresh != 1) {
		return bad()
	}
	b, ok := binding(inst, since, version)
	if !ok {
		return bad()
	}
	return replaceReply{b: b, refresh: refresh == 1, prev: prev}, nil
}

// parseShowReply decodes a showSrc reply: the linked key, or the session
// (ok false when there is none).
func parseShowReply(res []any) (s affinity.Session, link string, ok bool, err error) {
	bad := fmt.Errorf("unexpected show reply %v", res)
	if len(res) == 0 {
		return affinity.Session{}, "", false, bad
	}
	code, isInt := res[0].(int64)
	switch {
	case !isInt:
	case code == 2 && len(res) == 1:
		return affinity.Session{}, "", false, nil
	case code == 0 && len(res) == 2:
		if to, isStr := res[1].(string); isStr && to != "" {
			return affinity.Session{}, to, false, nil
		}
	case code == 1 && len(res) == 7:
		str, ok1 := strings5(res[1:6])
		pttl, ok2 := res[6].(int64)
		b, ok3 := binding(str[0], str[1], str[2])
		if ok1 && ok2 && ok3 {
			return affinity.Session{
				Binding: b,
				Move:    affinity.Move{Version: str[3], Off: str[4]},
				TTL:     time.Duration(max(pttl, 0)) * time.Millisecond,
			}, "", true, nil
		}
	}
	return affinity.Session{}, "", false, bad
}

// parseLoadReply decodes a syncLoadSrc reply into the load of instances,
// adding r's own queue depths.
func parseLoadReply(res []any, r affinity.LoadReport, instances []string) (affinity.LoadState, error) {
	st := affinity.LoadState{Active: map[string]int{}, InFlight: map[string]int{}, Queue: map[string]int{}, Drained: map[string]bool{}}
	bad := func(what string) (affinity.LoadState, error) {
		return affinity.LoadState{}, fmt.Errorf("unexpected sync-load reply (%s): %v", what, res)
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
	listed := make(map[string]bool, len(instances))
	for i, in := range instances {
		n, ok := active[i].(int64)
		if !ok {
			return bad("active count")
		}
		st.Active[in] = int(n)
		listed[in] = true
	}
	queue := func(in string, q int) {
		if cur, seen := st.Queue[in]; listed[in] && (!seen || q > cur) {
			st.Queue[in] = q
		}
	}
	for in, q := range r.Queue {
		queue(in, q)
	}
	for i := 0; i < len(others); i += 2 {
		fields, ok := others[i+1].([]any)
		if _, isStr := others[i].(string); !isStr || !ok || len(fields)%2 != 0 {
			return bad("report")
		}
		for j := 0; j < len(fields); j += 2 {
			field, ok := fields[j].(string)
			if !ok {
				return bad("report field")
			}
			kind, in, _ := strings.Cut(field, ":")
			if kind != "f" && kind != "q" {
				continue // a newer replica's field: not ours to read
			}
			val, ok := fields[j+1].(string)
			n, err := strconv.Atoi(val)
			if !ok || err != nil {
				return bad("report value")
			}
			if kind == "f" && listed[in] {
				st.InFlight[in] += n
			} else if kind == "q" {
				queue(in, n)
			}
		}
	}
	for _, d := range drained {
		in, ok := d.(string)
		if !ok {
			return bad("drained member")
		}
		st.Drained[in] = true
	}
	return st, nil
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

// binding builds a Binding from stored fields; since is unix milliseconds.
func binding(instance, since, version string) (affinity.Binding, bool) {
	ms, err := strconv.ParseInt(since, 10, 64)
	if err != nil || instance == "" {
		return affinity.Binding{}, false
	}
	return affinity.Binding{Instance: instance, Version: version, Since: time.UnixMilli(ms)}, true
}
