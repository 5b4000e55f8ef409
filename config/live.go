package config

import (
	"encoding"
	"reflect"
	"slices"
	"strings"

	"github.com/BurntSushi/toml"
)

// Live or restart: every key says once, in its `reload` tag, whether a
// running tether applies it. A key without a tag follows its section's. A
// table's tag covers every key in it. A section without a tag is live.
//
//	reload:"restart"  the key takes effect only when tether restarts
//	reload:"live"     the key takes effect at once (inside a restart table)
//
// Everything that depends on this derives from the tags:
//   - what a running tether keeps from its start (Running);
//   - which edits the reload warns about (RestartChanges);
//   - the **restart** marks of docs/config.md. docs_test.go holds the page
//     to the tags.
//
// A restart-only key is restart-only for the Envoy configuration tether
// serves too. Envoy must keep speaking to the tether that runs. That means
// its routing header, the identity headers it hashes on, and the [tls]
// tether's servers started with.
const reloadTag = "reload"

// RestartChanges lists the restart-only keys whose values differ between
// a and b.
func RestartChanges(a, b Config) []string {
	var keys []string
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	walkKeys(va.Type(), "", false, func(key string, index []int, restart bool) {
		if restart && !reflect.DeepEqual(va.FieldByIndex(index).Interface(), vb.FieldByIndex(index).Interface()) {
			keys = append(keys, key)
		}
	})
	return keys
}

// Running is what a running tether runs when it accepts next, having
// started with start. It takes next's live keys, and every restart-only
// key as it was at the start.
//
// [tls.envoy] is live only while it fits the [tls] tether's servers run
// with. TLS must be neither turned on nor off, and nothing Envoy needs may
// be left out. Otherwise the Envoy side in force, current's, stays, and
// held says why.
//
// An error means next does not validate with what tether keeps until a
// restart. For example, an edit gave a rule's header the name of the
// routing header tether still runs with. The change is refused.
func Running(start, current, next Config) (run Config, held string, err error) {
	run = next
	rv, sv := reflect.ValueOf(&run).Elem(), reflect.ValueOf(start)
	walkKeys(rv.Type(), "", false, func(_ string, index []int, restart bool) {
		if restart {
			rv.FieldByIndex(index).Set(sv.FieldByIndex(index))
		}
	})
	if run.TLS.Envoy != current.TLS.Envoy {
		if next.TLS.Enabled() != start.TLS.Enabled() {
			held = "TLS was turned on or off, which takes a restart"
		} else if err := run.validateEnvoyTLS(); err != nil {
			held = err.Error()
		}
		if held != "" {
			run.TLS.Envoy = current.TLS.Envoy
		}
	}
	if !reflect.DeepEqual(run, next) {
		if err := run.Validate(); err != nil {
			return Config{}, "", err
		}
	}
	return run, held, nil
}

// walkKeys calls fn for every key of the table t. fn gets the key's name,
// its index for reflect.Value.FieldByIndex and whether it is
// restart-only. restart is the enclosing table's mode.
func walkKeys(t reflect.Type, section string, restart bool, fn func(key string, index []int, restart bool)) {
	walkFields(t, nil, section, restart, fn)
}

func walkFields(t reflect.Type, index []int, section string, restart bool, fn func(string, []int, bool)) {
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		idx := append(slices.Clone(index), i)
		mode := restart
		switch f.Tag.Get(reloadTag) {
		case "restart":
			mode = true
		case "live":
			mode = false
		}
		name, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
		if f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct {
			walkFields(f.Type, idx, section, mode, fn) // an embedded table's keys are the section's
			continue
		}
		if name == "" || name == "-" {
			continue
		}
		key := name
		if section != "" {
			key = section + "." + name
		}
		if isTable(f.Type) {
			walkFields(f.Type, idx, key, mode, fn)
			continue
		}
		fn(key, idx, mode)
	}
}

// isTable reports whether t is a struct the file spells as a table. A
// value that decodes itself, such as Duration, is not one.
func isTable(t reflect.Type) bool {
	if t.Kind() != reflect.Struct {
		return false
	}
	switch reflect.New(t).Interface().(type) {
	case toml.Unmarshaler, encoding.TextUnmarshaler:
		return false
	}
	return true
}
