package plan

import (
	"fmt"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
)

// Instances turns the configured instances into the fleet's; an instance
// served by vllm or sglang gets its engine and metrics URL (a generic one
// is not scraped).
func Instances(cfg config.Config) []fleet.Instance {
	out := make([]fleet.Instance, len(cfg.Instances))
	for i, in := range cfg.Instances {
		out[i] = fleet.Instance{
			Name: in.Name, Address: in.Address, Zone: in.Zone, Version: in.Version, Weight: in.Weight,
			KVSessions: in.KVSessions, Capacity: in.Capacity,
		}
		if in.Engine != config.EngineGeneric {
			out[i].Engine, out[i].MetricsURL = in.Engine, in.MetricsURL
		}
	}
	return out
}

// policy turns the routing section and [[versions]] into the decision
// policy. A rule config.Validate did not resolve is an error rather than
// a rule that matches more (or less) than the operator wrote.
func policy(cfg config.Config) (affinity.Policy, error) {
	r := cfg.Routing
	p := affinity.Policy{
		Mode: Mode(r),
		Lifetime: bindings.Lifetime{
			Idle: r.IdleTimeout.D,
			Max:  r.MaxStickyDuration.D,
		},
		VersionAffinity: versionAffinity[r.VersionAffinity],
		CanaryHeader:    r.CanaryByHeader,
		Epsilon:         r.BoundedLoadEpsilon,
		Saturation: affinity.Saturation{
			InFlight: r.SaturationInFlight, QueueDepth: r.SaturationQueueDepth,
			Waiting: r.SaturationWaiting, KVUsage: r.SaturationKVUsage, Stale: cfg.Engines.Staleness.D,
		},
		TierHeader: r.TierHeader,
		Fallback:   affinity.Fallback(r.FallbackPolicy),
		Content:    contentPolicy(cfg.Content),
	}
	for _, v := range cfg.Versions {
		p.Versions = append(p.Versions, affinity.VersionWeight{Name: v.Name, Weight: v.Weight, Canary: v.Canary})
	}
	for i, rule := range r.Rules {
		if rule.Regex != "" && rule.Pattern == nil || (rule.Hours != "" || len(rule.Days) > 0) && rule.Window == nil {
			return affinity.Policy{}, fmt.Errorf("routing.rules[%d] (%s): not resolved: the configuration did not pass config.Validate", i, rule.Name)
		}
		var win *affinity.Window
		if w := rule.Window; w != nil {
			win = &affinity.Window{From: w.From, To: w.To, Days: w.Days, Location: w.Location}
		}
		mode := ruleMode(r, rule.Mode)
		p.Rules = append(p.Rules, affinity.Rule{
			Name:       rule.Name,
			PathPrefix: rule.PathPrefix,
			Header:     rule.Header,
			Value:      rule.Value,
			Regex:      rule.Pattern,
			Tiers:      append([]string(nil), rule.Tiers...),
			Window:     win,
			Mode:       mode,
			Idle:       rule.IdleTimeout.D,
			Priority:   priority[rule.Priority],
			Version:    rule.Version,
		})
	}
	return p, nil
}

// Mode is the routing mode of the requests no rule matches. It is the one
// place the configuration's three mode keys meet:
//   - routing.sticky_enabled = 0 is the global switch to random. No
//     request is bound, whatever routing.mode and the rules say. A mode
//     Validate would refuse is random too: binding nothing is the safe way
//     to be wrong.
//   - routing.adaptive_sticky = 1 makes sticky routing adaptive: the
//     default mode, and every rule whose mode is sticky.
//   - routing.mode is sticky, random, or hybrid. Under hybrid the rules
//     decide, and the requests they leave are random.
//
// `tether config validate` prints it.
func Mode(r config.Routing) affinity.Mode {
	switch {
	case r.StickyEnabled == 0:
		return affinity.Random
	case r.Mode == config.ModeSticky && r.AdaptiveSticky == 1:
		return affinity.Adaptive
	case r.Mode == config.ModeSticky:
		return affinity.Sticky
	case r.Mode == config.ModeHybrid:
		return affinity.Hybrid
	}
	return affinity.Random
}

// ruleMode is the mode of a rule whose mode key is m ("" keeps the
// policy's), under the same switches as Mode.
func ruleMode(r config.Routing, m string) affinity.Mode {
	switch {
	case m == "":
		return ""
	case r.StickyEnabled == 0:
		return affinity.Random
	case m == config.ModeSticky && r.AdaptiveSticky == 1:
		return affinity.Adaptive
	}
	return ruleModes[m]
}

// The configuration's spellings and the policy's, side by side; the
// configuration validated every key, so a lookup always finds one.
var (
	ruleModes = map[string]affinity.Mode{
		config.ModeSticky: affinity.Sticky, config.ModeRandom: affinity.Random, config.ModeAdaptive: affinity.Adaptive,
	}
	versionAffinity = map[string]affinity.VersionAffinity{
		config.VersionStrict: affinity.Strict, config.VersionPrefer: affinity.Prefer, config.VersionNone: affinity.AnyVersion,
	}
	priority = map[string]affinity.Priority{
		"": "", config.PriorityNormal: affinity.Normal, config.PriorityHigh: affinity.High,
	}
)

// contentPolicy is [content]'s part of the decision: the shortest match
// in whole blocks (at least one), and a block in prompt tokens.
func contentPolicy(c config.Content) affinity.Content {
	return affinity.Content{
		Enabled:       c.Enabled,
		MinBlocks:     max((c.MinMatchBytes+c.BlockBytes-1)/c.BlockBytes, 1),
		BlockTokens:   float64(c.BlockBytes) / config.CharsPerToken,
		QueuedTokens:  float64(c.QueuedTokens),
		RunningTokens: float64(c.RunningTokens),
	}
}
