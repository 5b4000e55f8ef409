package config

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// docsFile documents every key of the file; TestDocsListEveryKey keeps it
// complete.
var docsFile = filepath.Join("..", "docs", "config.md")

// docKey is one key of the file: its section ("" at the top level, dotted
// for nested tables such as tls.envoy, the array's name for arrays of
// tables such as instances and routing.rules) and its name.
type docKey struct{ section, key string }

func (k docKey) String() string {
	if k.section == "" {
		return k.key
	}
	return k.section + "." + k.key
}

// configKeys walks t's toml tags: a struct field is a table whose keys are
// listed under their own section, a slice of structs an array of tables
// (listed the same way), an embedded struct without a tag adds its keys to
// the enclosing section, and a map is one key (its entries are tables
// named by the user, such as outlier_detection.instances.NAME, and take
// the section's own keys). Types that decode themselves (Duration) are
// values.
func configKeys(t reflect.Type, section string) []docKey {
	var keys []docKey
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if f.Anonymous && name == "" && ft.Kind() == reflect.Struct {
			keys = append(keys, configKeys(ft, section)...)
			continue
		}
		if name == "" || name == "-" {
			continue
		}
		sub := name
		if section != "" {
			sub = section + "." + name
		}
		switch {
		case isTable(ft):
			keys = append(keys, configKeys(ft, sub)...)
		case ft.Kind() == reflect.Slice && isTable(deref(ft.Elem())):
			keys = append(keys, configKeys(deref(ft.Elem()), sub)...)
		default:
			keys = append(keys, docKey{section, name})
		}
	}
	return keys
}

func deref(t reflect.Type) reflect.Type {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

var (
	heading    = regexp.MustCompile(`^(#+)\s+(.*)$`)
	sectionRef = regexp.MustCompile(`\[\[?([a-z0-9_]+(?:\.[a-z0-9_]+)*)\]\]?`)
	codeSpan   = regexp.MustCompile("`([^`]+)`")
)

// docIndex is what docs/config.md says: every code span anywhere, the
// code spans under each section's heading, and the keys named in the
// first column of each section's tables.
type docIndex struct {
	anywhere map[string]bool
	under    map[string]map[string]bool
	rows     map[string][]string
}

// token is a code span as a key: `key`, `key = value` and `section.key`
// all name the key.
func token(span string) string {
	s := strings.TrimSpace(span)
	if i := strings.IndexAny(s, " ="); i >= 0 {
		s = s[:i]
	}
	return s
}

// eachLine calls fn with every line of md but headings and code fences,
// with the section it is under ("" for none) and whether it is in a code
// block. A heading that names a section ([server], [[routing.rules]],
// [tls.envoy]) starts it; a heading that names none ends it when it is at
// the section heading's level or above, and is a part of it when deeper.
// Headings in code blocks are not headings.
func eachLine(md string, fn func(section, line string, fenced bool)) {
	section, level := "", 0
	fence := false
	for _, line := range strings.Split(md, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fence = !fence
			continue
		}
		if !fence {
			if m := heading.FindStringSubmatch(line); m != nil {
				if s := sectionRef.FindStringSubmatch(m[2]); s != nil {
					section, level = s[1], len(m[1])
				} else if len(m[1]) <= level {
					section, level = "", 0
				}
				continue
			}
		}
		fn(section, line, fence)
	}
}

// indexDoc reads every code span of md, the code spans under each
// section and the keys in the first column of each section's tables.
func indexDoc(md string) docIndex {
	ix := docIndex{anywhere: map[string]bool{}, under: map[string]map[string]bool{}, rows: map[string][]string{}}
	eachLine(md, func(section, line string, fenced bool) {
		for _, m := range codeSpan.FindAllStringSubmatch(line, -1) {
			tok := token(m[1])
			ix.anywhere[tok] = true
			if section != "" {
				if ix.under[section] == nil {
					ix.under[section] = map[string]bool{}
				}
				ix.under[section][tok] = true
			}
		}
		if !fenced && section != "" && strings.HasPrefix(line, "|") {
			cells := strings.Split(line, "|")
			if len(cells) > 2 {
				for _, m := range codeSpan.FindAllStringSubmatch(cells[1], -1) {
					ix.rows[section] = append(ix.rows[section], token(m[1]))
				}
			}
		}
	})
	return ix
}

// checkDoc returns the keys the doc does not mention (as `section.key`
// anywhere, or as `key` under the section's heading) and the keys its
// tables list that the file does not have (a row may also name a table
// inside the section, such as envoy under [tls]).
func checkDoc(md string, keys []docKey) (missing, unknown []string) {
	ix := indexDoc(md)
	known := map[string]bool{} // keys, and the tables they are in
	for _, k := range keys {
		known[k.String()] = true
		for s := k.section; s != ""; {
			known[s] = true
			i := strings.LastIndex(s, ".")
			if i < 0 {
				break
			}
			s = s[:i]
		}
		if !ix.anywhere[k.String()] && !ix.under[k.section][k.key] {
			missing = append(missing, k.String())
		}
	}
	for section, toks := range ix.rows {
		for _, tok := range toks {
			if !known[section+"."+tok] && !known[tok] {
				unknown = append(unknown, fmt.Sprintf("%s (a row under [%s])", tok, section))
			}
		}
	}
	sort.Strings(missing)
	sort.Strings(unknown)
	return missing, unknown
}

// TestDocsListEveryKey: docs/config.md names every key the file accepts,
// and its tables name no key the file does not accept.
func TestDocsListEveryKey(t *testing.T) {
	data, err := os.ReadFile(docsFile)
	if err != nil {
		t.Fatal(err)
	}
	missing, unknown := checkDoc(string(data), configKeys(reflect.TypeFor[Config](), ""))
	for _, k := range missing {
		t.Errorf("%s does not document %s: add it (as `%s`, or as its key in a table under the section's heading) with its default and why", docsFile, k, k)
	}
	for _, k := range unknown {
		t.Errorf("%s documents %s, which the config file does not accept", docsFile, k)
	}
}

// TestDocsKeysWalk: the walk finds the kinds of key the file has (plain,
// nested table, array of tables, array inside a table, embedded struct,
// map of tables) and takes Duration as a value.
func TestDocsKeysWalk(t *testing.T) {
	got := map[string]bool{}
	for _, k := range configKeys(reflect.TypeFor[Config](), "") {
		if got[k.String()] {
			t.Errorf("%s listed twice", k)
		}
		got[k.String()] = true
	}
	for _, want := range []string{
		"server.extproc_addr", "server.drain_timeout", "redis.timeout", "tls.envoy.ca_file",
		"instances.name", "versions.canary", "routing.rules.hours", "routing.rules.idle_timeout",
		"outlier_detection.consecutive_5xx", "outlier_detection.instances", "circuit_breakers.max_retries",
		"circuit_breakers.instances", "audit.sample_rate", "envoy.extproc_endpoints",
	} {
		if !got[want] {
			t.Errorf("the walk misses %s", want)
		}
	}
	for _, not := range []string{"server.drain_timeout.D", "outlier_detection.instances.consecutive_5xx", "tls.envoy", "routing.rules", "xdsSet"} {
		if got[not] {
			t.Errorf("the walk lists %s, which is not a key", not)
		}
	}
}

// TestDocsCheckerRejects: a key left out, or only mentioned under another
// section, is reported; a table row for a key that does not exist is too.
func TestDocsCheckerRejects(t *testing.T) {
	keys := []docKey{{"server", "extproc_addr"}, {"server", "drain_timeout"}, {"routing.rules", "name"}, {"tls.envoy", "sni"}}
	cases := []struct {
		name             string
		md               string
		missing, unknown []string
	}{
		{
			name: "all there",
			md: "## [server]\n\n| key | default |\n|---|---|\n| `extproc_addr` | x |\n| `drain_timeout` | y |\n\n" +
				"## [routing]\n\n| `rules` | the table below |\n\n" +
				"## [[routing.rules]]\n\n`name = \"peak\"` names the rule.\n\nAlso `tls.envoy.sni`.\n",
		},
		{
			name:    "key left out",
			md:      "## [server]\n\n| `extproc_addr` | x |\n\n## [[routing.rules]]\n\n`name`\n\n## [tls.envoy]\n\n`sni`\n",
			missing: []string{"server.drain_timeout"},
		},
		{
			name:    "key under the wrong section",
			md:      "## [server]\n\n`extproc_addr` `drain_timeout` `name`\n\n## [tls.envoy]\n\n`sni`\n",
			missing: []string{"routing.rules.name"},
		},
		{
			name: "a heading without a section ends the section",
			md: "## [server]\n\n`extproc_addr` `drain_timeout`\n\n## Reloading\n\n`name`\n\n" +
				"## [tls.envoy]\n\n### Why\n\n`sni`\n",
			missing: []string{"routing.rules.name"},
		},
		{
			name: "code blocks do not start sections",
			md: "## [server]\n\n```toml\n# [tls.envoy]\n```\n\n`extproc_addr` `drain_timeout` `sni`\n\n" +
				"## [[routing.rules]]\n\n`name`\n",
			missing: []string{"tls.envoy.sni"},
		},
		{
			name: "a row for a key that does not exist",
			md: "## [server]\n\n| `extproc_addr` | x |\n| `drain_timout` | y |\n\n`drain_timeout`\n\n" +
				"## [[routing.rules]]\n\n`name`\n\n## [tls.envoy]\n\n`sni`\n",
			unknown: []string{"drain_timout (a row under [server])"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			missing, unknown := checkDoc(tc.md, keys)
			if fmt.Sprint(missing) != fmt.Sprint(tc.missing) && (len(missing) > 0 || len(tc.missing) > 0) {
				t.Errorf("missing = %v, want %v", missing, tc.missing)
			}
			if fmt.Sprint(unknown) != fmt.Sprint(tc.unknown) && (len(unknown) > 0 || len(tc.unknown) > 0) {
				t.Errorf("unknown = %v, want %v", unknown, tc.unknown)
			}
		})
	}
}

// docMarks reads which keys docs/config.md marks restart-only: every key
// of a section whose text says "All **restart**", and every key whose
// table row says **restart**, unless its row says **live**.
func docMarks(md string) (restart func(k docKey) bool) {
	all := map[string]bool{}
	rows := map[string]string{} // section.key → "restart", "live" or ""
	eachLine(md, func(section, line string, fenced bool) {
		switch {
		case fenced || section == "":
		case !strings.HasPrefix(line, "|"):
			if strings.Contains(line, "All **restart**") {
				all[section] = true
			}
		default:
			cells := strings.Split(line, "|")
			if len(cells) < 3 {
				return
			}
			mark := ""
			switch {
			case strings.Contains(line, "**restart**"):
				mark = "restart"
			case strings.Contains(line, "**live**"):
				mark = "live"
			}
			for _, m := range codeSpan.FindAllStringSubmatch(cells[1], -1) {
				rows[section+"."+token(m[1])] = mark
			}
		}
	})
	return func(k docKey) bool {
		switch rows[k.String()] {
		case "restart":
			return true
		case "live":
			return false
		}
		return all[k.section]
	}
}

// TestDocsMarkRestartKeys: docs/config.md marks restart-only exactly the
// keys whose reload tag (or their section's) says so.
func TestDocsMarkRestartKeys(t *testing.T) {
	data, err := os.ReadFile(docsFile)
	if err != nil {
		t.Fatal(err)
	}
	marked := docMarks(string(data))
	restart := map[string]bool{}
	for _, k := range restartKeys() {
		restart[k] = true
	}
	for _, k := range configKeys(reflect.TypeFor[Config](), "") {
		// An array of tables is one key to the reload (walkKeys): its
		// tag covers every key of its entries.
		switch want := restart[k.String()] || restart[k.section]; {
		case want && !marked(k):
			t.Errorf("%s does not mark %s **restart** (its reload tag does): mark its row, or its section as All **restart**", docsFile, k)
		case !want && marked(k):
			t.Errorf("%s marks %s **restart**, but a running tether applies it live (its reload tag)", docsFile, k)
		}
	}
}

// TestDocMarks: a section's "All **restart**" covers its keys but those
// whose row says **live**; a row's **restart** marks its key alone.
func TestDocMarks(t *testing.T) {
	md := "## [server]\n\nAll **restart**.\n\n| `a` | x |\n| `b` | y **live** |\n\n" +
		"## [routing]\n\n| `c` | x **restart** |\n| `d` | y |\n\n## Elsewhere\n\nAll **restart**.\n"
	marked := docMarks(md)
	for k, want := range map[docKey]bool{
		{"server", "a"}: true, {"server", "b"}: false, {"routing", "c"}: true, {"routing", "d"}: false,
	} {
		if got := marked(k); got != want {
			t.Errorf("%s: marked %v, want %v", k, got, want)
		}
	}
}
