package engine

import (
	"bytes"
	"strings"
)

// An exposition of vLLM runs to ~900 lines. Nearly all are histogram buckets
// and families tether does not read. expfmt's parser spends ~30 allocations
// on each line. So before parsing, the lines of families certainly not read
// are dropped:
//
//   - A line whose first token names a metric is kept when the kind reads
//     that name. Such a line is a sample, a # HELP or a # TYPE line.
//   - A line the filter is not sure of is kept for expfmt to judge. Examples
//     are a line not starting with a plain metric name, or a quoted name.
//   - Comments other than HELP and TYPE are dropped. expfmt ignores them.
//
// The filter decides only what is parsed, never how. expfmt parses what is
// kept.

// readNames is the set of names whose lines are kept:
//
//   - the sample names a spec reads;
//   - their bare counter names, for OpenMetrics' # TYPE lines and for
//     counters exposed without the suffix;
//   - the _bucket, _sum and _count series a wrongly typed family would have.
//     They are kept so that such a family is refused.
type readNames map[string]bool

func namesOf(sp *spec, prefixNames ...string) readNames {
	return nameSet(append([]string{sp.running, sp.waiting, sp.preemptions}, append(sp.usage, prefixNames...)...)...)
}

// nameSet is the readNames of the families named.
func nameSet(names ...string) readNames {
	n := readNames{}
	for _, name := range names {
		n[name] = true
		if bare, ok := strings.CutSuffix(name, "_total"); ok {
			n[bare] = true
		}
	}
	for name := range n {
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			n[name+suffix] = true
		}
	}
	return n
}

// relevant appends to dst the lines of b that names keeps.
func (names readNames) relevant(b, dst []byte) []byte {
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i+1], b[i+1:]
		} else {
			b = nil
		}
		if names.keep(line) {
			dst = append(dst, line...)
		}
	}
	return dst
}

func (names readNames) keep(line []byte) bool {
	s := trimBlank(line)
	switch {
	case len(s) == 0 || s[0] == '\n':
		return false
	case s[0] == '#':
		s = trimBlank(s[1:])
		kw, rest := token(s)
		if string(kw) != "HELP" && string(kw) != "TYPE" {
			return false // a comment
		}
		if len(rest) == 0 || (rest[0] != ' ' && rest[0] != '\t') {
			return true
		}
		name, next := metricName(trimBlank(rest))
		if len(name) == 0 || (next != ' ' && next != '\t' && next != '\n') {
			return true
		}
		return names[string(name)]
	}
	name, next := metricName(s)
	if len(name) == 0 || (next != '{' && next != ' ' && next != '\t') {
		return true
	}
	return names[string(name)]
}

func trimBlank(s []byte) []byte {
	for len(s) > 0 && (s[0] == ' ' || s[0] == '\t') {
		s = s[1:]
	}
	return s
}

// token is s up to the first blank or newline, and the rest.
func token(s []byte) (tok, rest []byte) {
	i := 0
	for i < len(s) && s[i] != ' ' && s[i] != '\t' && s[i] != '\n' {
		i++
	}
	return s[:i], s[i:]
}

// metricName is the unquoted metric name s starts with, and the byte after
// it. That byte is 0 at the end of s.
func metricName(s []byte) (name []byte, next byte) {
	i := 0
	for i < len(s) {
		c := s[i]
		if c == '_' || c == ':' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (i > 0 && c >= '0' && c <= '9') {
			i++
			continue
		}
		break
	}
	if i < len(s) {
		next = s[i]
	}
	return s[:i], next
}
