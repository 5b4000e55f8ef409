package config

import (
	"fmt"
	"net/url"
	"time"
)

// Engines says how tether reads the serving engines' own metrics
// ([engines]). Each instance whose engine is vllm or sglang has its
// /metrics scraped. One replica scrapes for the whole fleet of replicas.
type Engines struct {
	// Default is the engine of instances that name none: "vllm", "sglang"
	// or "generic". A generic engine is not scraped. Adaptive routing then
	// sees only tether's in-flight counts and the optional response
	// headers.
	Default string `toml:"default" reload:"live"`
	// ScrapeInterval is how often each instance is scraped. ScrapeTimeout
	// bounds one scrape.
	ScrapeInterval Duration `toml:"scrape_interval"`
	ScrapeTimeout  Duration `toml:"scrape_timeout"`
	// Staleness is the age past which a reading is no longer used.
	Staleness Duration `toml:"staleness"`
	// MaxBodyBytes bounds a /metrics answer. A larger one is refused.
	MaxBodyBytes int64 `toml:"max_body_bytes"`
}

// Engine kinds.
const (
	EngineGeneric = "generic"
	EngineVLLM    = "vllm"
	EngineSGLang  = "sglang"
)

// Defaults and bounds of [engines].
const (
	DefaultEngine         = EngineGeneric
	DefaultScrapeInterval = time.Second
	DefaultScrapeTimeout  = 500 * time.Millisecond
	DefaultStaleness      = 5 * time.Second
	DefaultMaxBodyBytes   = 4 << 20
	MaxMaxBodyBytes       = 256 << 20
)

func defaultEngines() Engines {
	return Engines{
		Default:        DefaultEngine,
		ScrapeInterval: Dur(DefaultScrapeInterval),
		ScrapeTimeout:  Dur(DefaultScrapeTimeout),
		Staleness:      Dur(DefaultStaleness),
		MaxBodyBytes:   DefaultMaxBodyBytes,
	}
}

func validEngine(e string) bool {
	return e == EngineGeneric || e == EngineVLLM || e == EngineSGLang
}

const engineKinds = `want "vllm", "sglang" or "generic"`

func (c *Config) validateEngines(bad reporter) {
	e := c.Engines
	if !validEngine(e.Default) {
		bad("engines.default", e.Default, engineKinds)
	}
	if e.ScrapeInterval.D < 100*time.Millisecond {
		bad("engines.scrape_interval", e.ScrapeInterval, "want at least 100ms")
	}
	if e.ScrapeTimeout.D < 10*time.Millisecond || e.ScrapeTimeout.D > e.ScrapeInterval.D {
		bad("engines.scrape_timeout", e.ScrapeTimeout, "want at least 10ms and at most engines.scrape_interval")
	}
	if e.Staleness.D < e.ScrapeInterval.D {
		bad("engines.staleness", e.Staleness, fmt.Sprintf("must be at least engines.scrape_interval (%v): a reading would expire before the next", e.ScrapeInterval))
	}
	if e.MaxBodyBytes < 4096 || e.MaxBodyBytes > MaxMaxBodyBytes {
		bad("engines.max_body_bytes", e.MaxBodyBytes, fmt.Sprintf("want 4096 to %d", MaxMaxBodyBytes))
	}
}

// engineOf is the instance's engine: its own, or engines.default.
func (c *Config) engineOf(in Instance) string {
	if in.Engine != "" {
		return in.Engine
	}
	return c.Engines.Default
}

// checkMetricsURL reports what is wrong with a metrics_url.
func checkMetricsURL(s string) string {
	u, err := url.Parse(s)
	switch {
	case err != nil:
		return "not a URL (want such as http://10.0.0.1:8000/metrics): " + err.Error()
	case u.Scheme != "http" && u.Scheme != "https":
		return "want an http:// or https:// URL with a host, such as http://10.0.0.1:8000/metrics"
	case u.Host == "" || u.Hostname() == "":
		return "has no host; want such as http://10.0.0.1:8000/metrics"
	case u.User != nil:
		return "must not carry credentials (they would show in logs)"
	}
	return ""
}
