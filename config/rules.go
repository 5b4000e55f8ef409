package config

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
)

// Rule is one [[routing.rules]] entry: it matches requests and overrides the
// routing policy for them. Every match field that is set must match; the
// first matching rule wins.
type Rule struct {
	Name string `toml:"name"`

	// Match fields.
	PathPrefix string `toml:"path_prefix"`
	// Header alone matches when the header is present. With Value, its
	// value must be exactly Value. With Regex, it must match Regex, an
	// unanchored RE2.
	Header string   `toml:"header"`
	Value  string   `toml:"value"`
	Regex  string   `toml:"regex"`
	Tiers  []string `toml:"tiers"` // the value of routing.tier_header is one of these
	// Hours is "HH:MM-HH:MM" on a 24-hour clock. An end before the start
	// wraps past midnight. Days are mon … sun. Both are read in Timezone,
	// UTC by default.
	Hours    string   `toml:"hours"`
	Days     []string `toml:"days"`
	Timezone string   `toml:"timezone"`

	// What the rule overrides.
	Mode        string   `toml:"mode"`         // "" (keep), sticky, random or adaptive
	IdleTimeout Duration `toml:"idle_timeout"` // 0 keeps routing.idle_timeout
	Priority    string   `toml:"priority"`     // "" (normal), normal or high
	Version     string   `toml:"version"`      // new sessions start on this model version

	// What the match keys resolve to, filled in by Validate: the compiled
	// regex and the time window. Nil means none.
	Pattern *regexp.Regexp `toml:"-" json:"-"`
	Window  *Window        `toml:"-" json:"-"`
}

// Window is a rule's parsed time window.
type Window struct {
	From, To time.Duration  // since local midnight; To < From wraps past midnight
	Days     []time.Weekday // empty: every day
	Location *time.Location
}

// Priorities of a rule.
const (
	PriorityNormal = "normal"
	PriorityHigh   = "high"
)

// DefaultTimezone is the time zone of a rule's window when it names none.
const DefaultTimezone = "UTC"

// setDefaults fills in the rule's time zone when it has a window: an
// entry of [[routing.rules]] starts from zero, not from a default.
func (r *Rule) setDefaults() {
	if (r.Hours != "" || len(r.Days) > 0) && r.Timezone == "" {
		r.Timezone = DefaultTimezone
	}
}

// compile compiles the rule's regex; nil when it has none.
func (r Rule) compile() (*regexp.Regexp, error) {
	if r.Regex == "" {
		return nil, nil
	}
	re, err := regexp.Compile(r.Regex)
	if err != nil {
		return nil, fmt.Errorf("invalid regex: %w", err)
	}
	return re, nil
}

// window parses the rule's time window; nil when it sets neither hours nor
// days. Days alone cover the whole day.
func (r Rule) window() (*Window, error) {
	if r.Hours == "" && len(r.Days) == 0 {
		return nil, nil
	}
	w := &Window{To: 24 * time.Hour}
	var err error
	if r.Hours != "" {
		if w.From, w.To, err = parseHours(r.Hours); err != nil {
			return nil, fmt.Errorf("hours %q: %w", r.Hours, err)
		}
	}
	for i, d := range r.Days {
		wd, err := parseDay(d, r.Days[:i])
		if err != nil {
			return nil, fmt.Errorf("days[%d] %q: %w", i, d, err)
		}
		w.Days = append(w.Days, wd)
	}
	if w.Location, err = loadZone(r.Timezone); err != nil {
		return nil, fmt.Errorf("timezone %q: %w", r.Timezone, err)
	}
	return w, nil
}

// parseHours reads "HH:MM-HH:MM". The end may be 24:00; equal ends are
// refused (empty, or every hour: say which by leaving hours out).
func parseHours(s string) (from, to time.Duration, err error) {
	a, b, ok := strings.Cut(s, "-")
	if !ok {
		return 0, 0, errors.New(`want "HH:MM-HH:MM" on a 24-hour clock`)
	}
	if from, ok = parseClock(a, false); !ok {
		return 0, 0, errors.New(`want "HH:MM-HH:MM" on a 24-hour clock`)
	}
	if to, ok = parseClock(b, true); !ok {
		return 0, 0, errors.New(`want "HH:MM-HH:MM" on a 24-hour clock`)
	}
	if from == to || from == 0 && to == 24*time.Hour {
		return 0, 0, errors.New("the window must not start and end at the same time (leave hours out for all day)")
	}
	return from, to, nil
}

// parseClock reads "HH:MM"; end allows "24:00".
func parseClock(s string, end bool) (time.Duration, bool) {
	if len(s) != 5 || s[2] != ':' {
		return 0, false
	}
	for _, i := range []int{0, 1, 3, 4} {
		if s[i] < '0' || s[i] > '9' {
			return 0, false
		}
	}
	h := int(s[0]-'0')*10 + int(s[1]-'0')
	m := int(s[3]-'0')*10 + int(s[4]-'0')
	if h == 24 && m == 0 && end {
		return 24 * time.Hour, true
	}
	if h > 23 || m > 59 {
		return 0, false
	}
	return time.Duration(h)*time.Hour + time.Duration(m)*time.Minute, true
}

var weekdays = map[string]time.Weekday{
	"sun": time.Sunday, "mon": time.Monday, "tue": time.Tuesday, "wed": time.Wednesday,
	"thu": time.Thursday, "fri": time.Friday, "sat": time.Saturday,
}

// parseDay reads one of mon … sun that is not among before.
func parseDay(s string, before []string) (time.Weekday, error) {
	d, ok := weekdays[s]
	if !ok {
		return 0, errors.New("want mon, tue, wed, thu, fri, sat or sun")
	}
	for _, b := range before {
		if b == s {
			return 0, errors.New("listed twice")
		}
	}
	return d, nil
}

// loadZone loads an IANA time zone; "" is UTC. "Local" is refused: a rule
// would then mean different hours on differently configured hosts.
func loadZone(name string) (*time.Location, error) {
	if name == "" {
		return time.UTC, nil
	}
	if name == "Local" {
		return nil, errors.New("name a zone such as Europe/Paris; Local depends on the host")
	}
	loc, err := time.LoadLocation(name)
	if err != nil {
		return nil, errors.New("unknown time zone (want an IANA name such as Europe/Paris)")
	}
	return loc, nil
}

// validateRules checks [[routing.rules]]; versions are the instances'
// (instanceVersions).
func (c *Config) validateRules(bad reporter, versions map[string]bool, unknownVersion string) {
	r := c.Routing
	names := map[string]int{}
	for i, rule := range r.Rules {
		key := fmt.Sprintf("routing.rules[%d]", i)
		switch {
		case rule.Name == "":
			bad(key+".name", rule.Name, "every rule needs a name")
		case !instanceName.MatchString(rule.Name):
			bad(key+".name", rule.Name, "want 1-63 lower-case letters, digits, '.', '_' or '-', starting and ending with a letter or digit")
		default:
			if j, dup := names[rule.Name]; dup {
				bad(key+".name", rule.Name, fmt.Sprintf("duplicate of routing.rules[%d]", j))
			} else {
				names[rule.Name] = i
			}
		}
		r.validateRuleMatch(bad, key, rule)
		validateRuleSchedule(bad, key, rule)
		switch rule.Mode {
		case "", ModeSticky, ModeRandom:
		case ModeAdaptive:
			if !r.saturable() {
				bad(key+".mode", rule.Mode, noThreshold)
			}
		default:
			bad(key+".mode", rule.Mode, `want "sticky", "random" or "adaptive" (or leave it out)`)
		}
		if d := rule.IdleTimeout.D; d != 0 && d < time.Second {
			bad(key+".idle_timeout", rule.IdleTimeout, "want 0 (routing.idle_timeout) or at least 1s")
		}
		switch rule.Priority {
		case "", PriorityNormal, PriorityHigh:
		default:
			bad(key+".priority", rule.Priority, `want "normal" or "high"`)
		}
		if rule.Version != "" && !versions[rule.Version] {
			bad(key+".version", rule.Version, unknownVersion)
		}
	}
}

// validateRuleMatch checks what a rule matches: its path, its header and
// the value or regex it wants there, and the tiers.
func (r Routing) validateRuleMatch(bad reporter, key string, rule Rule) {
	if rule.PathPrefix != "" && !strings.HasPrefix(rule.PathPrefix, "/") {
		bad(key+".path_prefix", rule.PathPrefix, `must start with "/"`)
	}
	switch {
	case rule.Header == "":
	case !headerName.MatchString(rule.Header):
		bad(key+".header", rule.Header, "want a lower-case header name")
	case rule.Header == r.ClusterHeader:
		bad(key+".header", rule.Header, "is routing.cluster_header, which Envoy strips from client requests")
	}
	if rule.Value != "" && rule.Regex != "" {
		bad(key+".regex", rule.Regex, "set value or regex, not both")
	}
	if rule.Header == "" {
		if rule.Value != "" {
			bad(key+".value", rule.Value, "needs header")
		}
		if rule.Regex != "" {
			bad(key+".regex", rule.Regex, "needs header")
		}
	}
	if _, err := rule.compile(); err != nil {
		bad(key+".regex", rule.Regex, err.Error())
	}
	for j, t := range rule.Tiers {
		if t == "" {
			bad(fmt.Sprintf("%s.tiers[%d]", key, j), t, "must not be empty")
		}
	}
}

// validateRuleSchedule checks when a rule applies: its hours, its days
// and their time zone.
func validateRuleSchedule(bad reporter, key string, rule Rule) {
	if rule.Hours != "" {
		if _, _, err := parseHours(rule.Hours); err != nil {
			bad(key+".hours", rule.Hours, err.Error())
		}
	}
	for j, d := range rule.Days {
		if _, err := parseDay(d, rule.Days[:j]); err != nil {
			bad(fmt.Sprintf("%s.days[%d]", key, j), d, err.Error())
		}
	}
	if rule.Timezone != "" {
		if rule.Hours == "" && len(rule.Days) == 0 {
			bad(key+".timezone", rule.Timezone, "needs hours or days")
		} else if _, err := loadZone(rule.Timezone); err != nil {
			bad(key+".timezone", rule.Timezone, err.Error())
		}
	}
}
