package affinity

import (
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/identity"
)

// Mode is how requests are routed: the policy's mode for the requests no
// rule matches, a rule's for those it matches, and a decision's. plan maps
// the configuration's keys onto it (routing.mode, sticky_enabled,
// adaptive_sticky and the rules' modes), in one place.
type Mode string

const (
	// Sticky means the session's binding decides; a new session is placed.
	Sticky Mode = "sticky"
	// Adaptive means sticky, but a session whose instance is saturated moves to
	// its next choice unless it is high-priority.
	Adaptive Mode = "adaptive"
	// Random means each request at random, by weight; nothing is bound.
	Random Mode = "random"
	// Hybrid means rules decide; a request no rule matches is routed at random
	// (core traffic sticky, edge traffic random, as the rules say). A
	// policy's mode only.
	Hybrid Mode = "hybrid"
)

// VersionAffinity says whether a session may change model version.
type VersionAffinity string

const (
	// Strict means a session never changes version; with no healthy instance of
	// its version it gets no instance (ErrNoVersion) until an operator
	// migrates it.
	Strict VersionAffinity = "strict"
	// Prefer means a session changes version only when no instance of its
	// version is healthy.
	Prefer VersionAffinity = "prefer"
	// AnyVersion means versions do not constrain moves.
	AnyVersion VersionAffinity = "none"
)

// Priority is a request's priority under adaptive routing.
type Priority string

// The priorities.
const (
	Normal Priority = "normal"
	High   Priority = "high" // never moved off a saturated instance
)

// Policy is the part of the configuration the decision reads. It is
// immutable once handed to a Decider; SetPolicy swaps it whole.
type Policy struct {
	// Mode for requests no rule matches: Sticky, Adaptive, Random or
	// Hybrid.
	Mode     Mode
	Lifetime bindings.Lifetime
	Rules    []Rule
	// Versions split new sessions between model versions. Empty: a new
	// session takes the version of the instance it is placed on.
	Versions        []VersionWeight
	VersionAffinity VersionAffinity
	// CanaryHeader, when set, names the request header whose value
	// "always" or "never" forces or excludes the canary versions.
	CanaryHeader string
	// Epsilon is the bounded-load slack: a new session skips an instance
	// whose active sessions reach (1+Epsilon) × its weighted share.
	Epsilon float64
	// Saturation says when an instance counts as saturated (adaptive).
	Saturation Saturation
	// Content is cache-aware placement (content.go).
	Content Content
	// TierHeader names the request header carrying the user tier that
	// rules match with Rule.Tiers. It must come from a trusted layer (an
	// authenticating filter in front of Envoy), not from the client.
	TierHeader string
	// Fallback is fallback_policy: what a session whose instance is out
	// does. "" is Gradual.
	Fallback Fallback

	draws versionDraws // filled by SetPolicy
}

// Headers are the request headers the decision reads by policy (besides
// the identity's and the fail-open pool's hash, which are the decider's
// inputs, and the path): the canary header, each rule's header, and the
// tier header when a rule matches on tiers. What Envoy must send for it
// (forward_rules).
func (p *Policy) Headers() []string {
	var out []string
	if p.CanaryHeader != "" {
		out = append(out, p.CanaryHeader)
	}
	tiers := false
	for _, r := range p.Rules {
		if r.Header != "" {
			out = append(out, r.Header)
		}
		tiers = tiers || len(r.Tiers) > 0
	}
	if tiers && p.TierHeader != "" {
		out = append(out, p.TierHeader)
	}
	return out
}

// OpensPlacement reports whether a decision under p may leave its
// placement open to the request's body (Decision.Open). It may when
// content placement is on and the policy's mode or a rule's binds
// sessions.
func (p *Policy) OpensPlacement() bool {
	binds := func(m Mode) bool { return m == Sticky || m == Adaptive }
	return p.Content.Enabled && (binds(p.Mode) || slices.ContainsFunc(p.Rules, func(r Rule) bool { return binds(r.Mode) }))
}

// fallback is p.Fallback with its default.
func (p *Policy) fallback() Fallback {
	if p.Fallback == "" {
		return Gradual
	}
	return p.Fallback
}

// VersionWeight is one [[versions]] entry.
type VersionWeight struct {
	Name   string
	Weight float64
	Canary bool
}

// Saturation thresholds; 0 disables one.
type Saturation struct {
	InFlight   int // requests in flight to the instance, across replicas
	QueueDepth int // queue depth the instance last reported in a response header
	// From the instance's engine (fleet.EngineReading): requests waiting, and the
	// share of its KV cache in use, at which it counts as saturated. A new
	// session also skips an instance at KVUsage when another has room.
	Waiting int
	KVUsage float64
	// Stale is the age past which an engine reading is not used; 0: any age.
	Stale time.Duration
}

// Rule matches requests and overrides the policy for them. Every set match
// field must match; the first matching rule wins.
type Rule struct {
	Name       string
	PathPrefix string
	Header     string         // header name, lower case
	Value      string         // exact value of Header
	Regex      *regexp.Regexp // or a pattern the value of Header matches
	Tiers      []string       // the request's tier (Policy.TierHeader) is one of these
	Window     *Window        // the request arrives within this time window

	Mode     Mode          // Sticky, Adaptive or Random; "" keeps the policy's mode
	Idle     time.Duration // 0 keeps the policy's idle timeout
	Priority Priority      // "" is Normal
	Version  string        // "" lets Versions decide; else new sessions of this rule start on it
}

// Window is a daily time window, for example peak hours.
type Window struct {
	From, To time.Duration  // since local midnight; To < From wraps past midnight
	Days     []time.Weekday // empty: every day
	Location *time.Location
}

// Contains reports whether t falls inside the window.
func (w *Window) Contains(t time.Time) bool {
	loc := w.Location
	if loc == nil {
		loc = time.UTC
	}
	t = t.In(loc)
	day := t.Weekday()
	h, m, s := t.Clock()
	tod := time.Duration(h)*time.Hour + time.Duration(m)*time.Minute + time.Duration(s)*time.Second
	if w.To < w.From && tod < w.To {
		// The part after midnight belongs to the window that began the day before.
		day = (day + 6) % 7
	}
	if len(w.Days) > 0 && !slices.Contains(w.Days, day) {
		return false
	}
	if w.From <= w.To {
		return tod >= w.From && tod < w.To
	}
	return tod >= w.From || tod < w.To
}

// Request is what the decision knows of one HTTP request.
type Request struct {
	ID      identity.Identity
	Path    string
	Headers identity.Headers // may be nil
	// Subset, when not empty, names the only instances the request may go
	// to (a gateway's subset hint): a session bound elsewhere moves into
	// it, and none eligible in it is ErrNoEligible.
	Subset []string
	// Fallbacks is how many instances the decision names after its own,
	// for a gateway to retry on (Decision.Fallbacks). 0 names none.
	Fallbacks int
}

func (r Request) header(name string) string {
	if r.Headers == nil || name == "" {
		return ""
	}
	return r.Headers.Get(name)
}

// matches reports whether rule applies to req at now.
func (rule *Rule) matches(req Request, tierHeader string, now time.Time) bool {
	if rule.PathPrefix != "" && !strings.HasPrefix(req.Path, rule.PathPrefix) {
		return false
	}
	if rule.Header != "" {
		v := req.header(rule.Header)
		switch {
		case rule.Regex != nil:
			if !rule.Regex.MatchString(v) {
				return false
			}
		case rule.Value != "":
			if v != rule.Value {
				return false
			}
		default:
			if v == "" {
				return false
			}
		}
	}
	if len(rule.Tiers) > 0 && !slices.Contains(rule.Tiers, req.header(tierHeader)) {
		return false
	}
	if rule.Window != nil && !rule.Window.Contains(now) {
		return false
	}
	return true
}
