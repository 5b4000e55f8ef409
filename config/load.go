package config

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
)

// Load reads, defaults and validates a file. Then it checks the files it
// names (CheckFiles). edits, from command-line flags, apply before the one
// validation. Path "" loads the defaults with the edits. Parse alone
// touches no file.
func Load(path string, edits ...func(*Config)) (Config, error) {
	var data []byte
	if path != "" {
		var err error
		if data, err = os.ReadFile(path); err != nil {
			return Config{}, fmt.Errorf("read config: %w", err)
		}
	} else {
		path = "the defaults"
	}
	c, err := Parse(data, edits...)
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	if err := c.CheckFiles(time.Now()); err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Parse decodes TOML onto Default(), applies edits, and validates.
// Validation fills in the defaults of each [[instances]] and
// [[routing.rules]] entry. It also resolves what the keys leave to be
// derived.
//
// A key the file leaves out keeps its default. A key it sets wins, even
// set to 0, "" or false: xds.addr = "" turns the ADS server off. Unknown
// keys are an error. A misspelt key silently ignored is a production
// incident later.
//
// A Config written by BurntSushi/toml's encoder parses back to itself, so
// tests and the lab build a Config in code and hand tether the file.
func Parse(data []byte, edits ...func(*Config)) (Config, error) {
	c := Default()
	md, err := toml.Decode(string(data), &c)
	if err != nil {
		var perr toml.ParseError
		if errors.As(err, &perr) {
			if perr.LastKey != "" {
				return Config{}, fmt.Errorf("line %d: %s: %s", perr.Position.Line, perr.LastKey, perr.Message)
			}
			return Config{}, fmt.Errorf("line %d: %s", perr.Position.Line, perr.Message)
		}
		return Config{}, fmt.Errorf("parse: %w", err)
	}
	if und := md.Undecoded(); len(und) > 0 {
		keys := make([]string, len(und))
		for i, k := range und {
			keys[i] = k.String()
		}
		if slices.Contains(keys, "content.slack") {
			return Config{}, errors.New("content.slack: replaced by content.queued_tokens and content.running_tokens, what waiting behind an instance's work costs a prompt (docs/content.md); remove it")
		}
		return Config{}, fmt.Errorf("unknown key %s", strings.Join(keys, ", "))
	}
	for _, edit := range edits {
		edit(&c)
	}
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}
