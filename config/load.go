package config

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
)

// Load reads, defaults and validates a file, then checks the files it
// names (CheckFiles). Parse alone touches no file.
func Load(path string) (Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("read config: %w", err)
	}
	c, err := Parse(data)
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	if err := c.CheckFiles(time.Now()); err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Parse decodes TOML onto Default(), fills in the defaults of each
// [[instances]] and [[routing.rules]] entry, and validates. A key the file
// leaves out keeps its default; a key it sets wins, even set to 0, "" or
// false (xds.addr = "" turns the ADS server off). Unknown keys are an
// error: a misspelt key silently ignored is a production incident later.
//
// A Config written by BurntSushi/toml's encoder parses back to itself, so
// tests and the lab build a Config in code and hand tether the file.
func Parse(data []byte) (Config, error) {
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
		return Config{}, fmt.Errorf("unknown key %s", strings.Join(keys, ", "))
	}
	// An entry of an array of tables starts from zero, not from a
	// default, so its defaults are filled in after decoding.
	for i := range c.Instances {
		c.Instances[i].SetDefaults()
	}
	for i := range c.Routing.Rules {
		c.Routing.Rules[i].setDefaults()
	}
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}
