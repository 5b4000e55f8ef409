package workload

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/tetherproxy/tether/lab/emulator"
)

// Kind is the kind of a conversation.
type Kind string

const (
	// KindLong is one request carrying a long document (summaries,
	// extraction): the bulk of the prompt tokens.
	KindLong Kind = "long"
	// KindMultiTurn is a chat of several turns, each carrying the whole
	// history: the traffic session affinity is for.
	KindMultiTurn Kind = "multiturn"
	// KindSingle is one short query.
	KindSingle Kind = "single"
	// KindDocs is a few short questions about one of a set of long
	// documents shared by many callers (Config.Docs): the first user
	// message carries the document, then the question. Conversations on
	// the same document (and application) share its KV blocks.
	KindDocs Kind = "docs"
)

// Kinds lists the kinds in the order of Mix's fields.
func Kinds() []Kind { return []Kind{KindLong, KindMultiTurn, KindSingle, KindDocs} }

// IdentityKind says which identifiers a conversation's requests carry.
type IdentityKind string

const (
	// IdentitySession means an application session id (SessionHeader).
	IdentitySession IdentityKind = "session"
	// IdentityToken means a bearer token only (AuthHeader).
	IdentityToken IdentityKind = "token"
	// IdentityDevice means a device id and a user id (DeviceHeader, UserHeader),
	// as callers without login send.
	IdentityDevice IdentityKind = "device"
	// IdentityAnonymous means no identifier at all.
	IdentityAnonymous IdentityKind = "anonymous"
)

// IdentityKinds lists the identity kinds in the order of IdentityMix's
// fields.
func IdentityKinds() []IdentityKind {
	return []IdentityKind{IdentitySession, IdentityToken, IdentityDevice, IdentityAnonymous}
}

// The request headers of the identities: tether's defaults (its identity
// header names are configurable; these are what it reads out of the box).
const (
	SessionHeader = "x-session-id"
	AuthHeader    = "authorization"
	DeviceHeader  = "x-device-id"
	UserHeader    = "x-user-id"
)

// Limits that Validate enforces.
const (
	// MaxMessageTokens bounds one generated user message or system prompt.
	MaxMessageTokens = 1 << 20
	// MaxTurns bounds the turns of a multi-turn conversation.
	MaxTurns = 1000
	// MaxThinkTime bounds the mean think time.
	MaxThinkTime = time.Hour
	// MaxApps bounds the number of applications.
	MaxApps = 64
	// MaxDocs bounds the number of shared documents (Docs.Count).
	MaxDocs = 100000
	// MinSystemTokens is the shortest system prompt: the preamble that names
	// the application plus a few words.
	MinSystemTokens = 16
	// MaxOutputTokens bounds max_tokens: the emulator (emulator.MaxTokensLimit)
	// lowers larger values, which would break ignore_eos's exact length.
	MaxOutputTokens = emulator.MaxTokensLimit
)

// Config describes the traffic. The zero value of every field but Seed
// means its default (DefaultConfig lists them), so Config{Seed: 1} is the
// field's mix.
type Config struct {
	// Seed makes the stream: the same Config gives the same conversations,
	// word for word. Conversations of different seeds share nothing but the
	// application names and the shape of their system prompts.
	Seed uint64

	// Mix is the share of each kind of conversation. Zero: DefaultMix.
	Mix Mix

	// Identities is the share of each identity kind. Zero:
	// DefaultIdentityMix.
	Identities IdentityMix

	// Apps are the applications whose system prompt opens every request,
	// each chosen with a probability proportional to its Weight. Nil:
	// DefaultApps.
	Apps []App

	// LongTokens is the length of a long-text request's user message (an
	// instruction and the document), uniform in the range.
	LongTokens Range
	// SingleTokens is the length of a single query's user message.
	SingleTokens Range
	// TurnTokens is the length of each user message of a multi-turn
	// conversation.
	TurnTokens Range
	// Turns is the number of turns of a multi-turn conversation (at least
	// 2).
	Turns Range

	// ThinkTime is the mean time a user takes between an answer and the
	// next turn: exponentially distributed, cut at 10 times the mean.
	// Zero: DefaultThinkTime. (A replay scales it; loadgen's ThinkScale 0
	// removes it.)
	ThinkTime time.Duration

	// LongOutput, MultiTurnOutput and SingleOutput are the answer lengths
	// (max_tokens, sent with ignore_eos so the answer is exactly that long)
	// of each kind, uniform in the range, at most MaxOutputTokens.
	LongOutput      Range
	MultiTurnOutput Range
	SingleOutput    Range

	// Docs shapes the KindDocs conversations (only drawn when Mix.Docs is
	// above zero). Zero fields: DefaultDocs's.
	Docs Docs
}

// Docs are the shared documents of KindDocs conversations and the
// questions asked about them.
type Docs struct {
	// Count is the number of documents; each is drawn from the seed and
	// its index alone, so every conversation on it carries the same text.
	Count int `json:"count"`
	// Tokens is the length of a document, drawn once per document.
	Tokens Range `json:"tokens"`
	// Skew is the exponent s of the documents' popularity: document k
	// (from 0) is picked with a weight 1/(k+1)^s (Zipf). 0 would mean
	// uniform, so the zero value means DefaultDocs's; set a tiny value
	// for nearly uniform.
	Skew float64 `json:"skew"`
	// Turns is the number of questions of a conversation (at least 1).
	Turns Range `json:"turns"`
	// QuestionTokens is the length of each question.
	QuestionTokens Range `json:"question_tokens"`
	// Output is the answer length of each question (max_tokens).
	Output Range `json:"output"`
}

// DefaultDocs are 200 documents of 4,000 to 8,000 tokens, Zipf-popular
// (s = 1: the ten most read take half the conversations), each read by
// conversations of 2 to 4 questions of 20 to 100 tokens.
func DefaultDocs() Docs {
	return Docs{
		Count: 200, Tokens: Range{4000, 8000}, Skew: 1,
		Turns: Range{2, 4}, QuestionTokens: Range{20, 100}, Output: Range{50, 200},
	}
}

// Mix gives the share of each kind of conversation; the shares are in
// [0, 1] and sum to 1.
type Mix struct {
	Long      float64 `json:"long"`
	MultiTurn float64 `json:"multiturn"`
	Single    float64 `json:"single"`
	// Docs is the share of KindDocs conversations (none in the field's
	// mix).
	Docs float64 `json:"docs,omitempty"`
}

// IdentityMix gives the share of each identity kind; the shares are in
// [0, 1] and sum to 1.
type IdentityMix struct {
	Session   float64 `json:"session"`
	Token     float64 `json:"token"`
	Device    float64 `json:"device"`
	Anonymous float64 `json:"anonymous"`
}

// Range is an inclusive range of integers, drawn uniformly.
type Range struct {
	Min int `json:"min"`
	Max int `json:"max"`
}

func (r Range) String() string { return fmt.Sprintf("%d-%d", r.Min, r.Max) }

// App is an application: all its users' requests open with its system
// prompt, which is what lets even random routing hit the KV cache.
type App struct {
	// Name is one word (no whitespace); the system prompt names it.
	Name string `json:"name"`
	// SystemTokens is the length of its system prompt, at least
	// MinSystemTokens.
	SystemTokens int `json:"system_tokens"`
	// Weight is the application's relative share of the conversations.
	// Zero means 1.
	Weight float64 `json:"weight"`
}

// DefaultThinkTime is the mean think time between turns.
const DefaultThinkTime = 5 * time.Second

// DefaultMix is the field's mix: 30% long text, 20% multi-turn, 50% single
// queries.
func DefaultMix() Mix { return Mix{Long: 0.3, MultiTurn: 0.2, Single: 0.5} }

// DefaultIdentityMix is the field's callers: 55% session id, 20% bearer token only, 15% device and
// user id, 10% anonymous.
func DefaultIdentityMix() IdentityMix {
	return IdentityMix{Session: 0.55, Token: 0.2, Device: 0.15, Anonymous: 0.1}
}

// DefaultApps are four applications with system prompts of 500 to 2,000
// tokens, equally likely.
func DefaultApps() []App {
	return []App{
		{Name: "customer-service", SystemTokens: 1200, Weight: 1},
		{Name: "coding-assistant", SystemTokens: 2000, Weight: 1},
		{Name: "finance", SystemTokens: 800, Weight: 1},
		{Name: "general", SystemTokens: 500, Weight: 1},
	}
}

// DefaultConfig is the configuration a zero Config (with the given seed)
// stands for.
func DefaultConfig(seed uint64) Config {
	return Config{
		Seed:            seed,
		Mix:             DefaultMix(),
		Identities:      DefaultIdentityMix(),
		Apps:            DefaultApps(),
		LongTokens:      Range{4000, 16000},
		SingleTokens:    Range{20, 300},
		TurnTokens:      Range{20, 200},
		Turns:           Range{3, 12},
		ThinkTime:       DefaultThinkTime,
		LongOutput:      Range{100, 400},
		MultiTurnOutput: Range{50, 300},
		SingleOutput:    Range{50, 200},
	}
}

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	d := DefaultConfig(c.Seed)
	if c.Mix == (Mix{}) {
		c.Mix = d.Mix
	}
	if c.Identities == (IdentityMix{}) {
		c.Identities = d.Identities
	}
	if c.Apps == nil {
		c.Apps = d.Apps
	} else {
		c.Apps = append([]App(nil), c.Apps...)
		for i := range c.Apps {
			if c.Apps[i].Weight == 0 {
				c.Apps[i].Weight = 1
			}
		}
	}
	for _, r := range []struct{ got, def *Range }{
		{&c.LongTokens, &d.LongTokens}, {&c.SingleTokens, &d.SingleTokens},
		{&c.TurnTokens, &d.TurnTokens}, {&c.Turns, &d.Turns},
		{&c.LongOutput, &d.LongOutput}, {&c.MultiTurnOutput, &d.MultiTurnOutput},
		{&c.SingleOutput, &d.SingleOutput},
	} {
		if *r.got == (Range{}) {
			*r.got = *r.def
		}
	}
	if c.ThinkTime == 0 {
		c.ThinkTime = d.ThinkTime
	}
	dd := DefaultDocs()
	if c.Docs.Count == 0 {
		c.Docs.Count = dd.Count
	}
	if c.Docs.Skew == 0 {
		c.Docs.Skew = dd.Skew
	}
	for _, r := range []struct{ got, def *Range }{
		{&c.Docs.Tokens, &dd.Tokens}, {&c.Docs.Turns, &dd.Turns},
		{&c.Docs.QuestionTokens, &dd.QuestionTokens}, {&c.Docs.Output, &dd.Output},
	} {
		if *r.got == (Range{}) {
			*r.got = *r.def
		}
	}
	return c
}

// Validate reports the first problem with the configuration after
// defaults, naming the field and the bad value.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if err := c.Mix.Validate(); err != nil {
		return err
	}
	if err := c.Identities.Validate(); err != nil {
		return err
	}
	if err := validateApps(c.Apps); err != nil {
		return err
	}
	for _, r := range []struct {
		name     string
		r        Range
		min, max int
	}{
		{"long_tokens", c.LongTokens, 1, MaxMessageTokens},
		{"single_tokens", c.SingleTokens, 1, MaxMessageTokens},
		{"turn_tokens", c.TurnTokens, 1, MaxMessageTokens},
		{"turns", c.Turns, 2, MaxTurns},
		{"long_output", c.LongOutput, 1, MaxOutputTokens},
		{"multiturn_output", c.MultiTurnOutput, 1, MaxOutputTokens},
		{"single_output", c.SingleOutput, 1, MaxOutputTokens},
		{"docs.tokens", c.Docs.Tokens, 1, MaxMessageTokens},
		{"docs.turns", c.Docs.Turns, 1, MaxTurns},
		{"docs.question_tokens", c.Docs.QuestionTokens, 1, MaxMessageTokens},
		{"docs.output", c.Docs.Output, 1, MaxOutputTokens},
	} {
		if err := r.r.check(r.min, r.max); err != nil {
			return fmt.Errorf("workload: %s %v: %w", r.name, r.r, err)
		}
	}
	if c.Docs.Count < 1 || c.Docs.Count > MaxDocs {
		return fmt.Errorf("workload: docs.count %d: want 1 to %d", c.Docs.Count, MaxDocs)
	}
	if s := c.Docs.Skew; math.IsNaN(s) || math.IsInf(s, 0) || s < 0 || s > 10 {
		return fmt.Errorf("workload: docs.skew %v: want 0 (the default, %v) up to 10", s, DefaultDocs().Skew)
	}
	if c.ThinkTime < 0 || c.ThinkTime > MaxThinkTime {
		return fmt.Errorf("workload: think_time %v: want 0 (the default, %v) up to %v", c.ThinkTime, DefaultThinkTime, MaxThinkTime)
	}
	return nil
}

func (r Range) check(lo, hi int) error {
	switch {
	case r.Min < lo:
		return fmt.Errorf("min must be at least %d", lo)
	case r.Max < r.Min:
		return errors.New("max is below min")
	case r.Max > hi:
		return fmt.Errorf("max must be at most %d", hi)
	}
	return nil
}

func validateApps(apps []App) error {
	if len(apps) == 0 {
		return errors.New("workload: apps: empty list (leave it nil for the defaults)")
	}
	if len(apps) > MaxApps {
		return fmt.Errorf("workload: apps: %d applications, at most %d", len(apps), MaxApps)
	}
	seen := make(map[string]bool, len(apps))
	for i, a := range apps {
		switch {
		case a.Name == "":
			return fmt.Errorf("workload: apps[%d]: name is empty", i)
		case strings.IndexFunc(a.Name, unicode.IsSpace) >= 0:
			return fmt.Errorf("workload: apps[%d]: name %q: must be one word, without whitespace", i, a.Name)
		case seen[a.Name]:
			return fmt.Errorf("workload: apps[%d]: name %q: used twice", i, a.Name)
		case a.SystemTokens < MinSystemTokens || a.SystemTokens > MaxMessageTokens:
			return fmt.Errorf("workload: apps[%d] (%s): system_tokens %d: want %d to %d", i, a.Name, a.SystemTokens, MinSystemTokens, MaxMessageTokens)
		case math.IsNaN(a.Weight) || math.IsInf(a.Weight, 0) || a.Weight <= 0:
			return fmt.Errorf("workload: apps[%d] (%s): weight %v: want a finite number > 0", i, a.Name, a.Weight)
		}
		seen[a.Name] = true
	}
	return nil
}

// shareTolerance is how far from 1 a sum of shares may be (decimal
// fractions such as 0.3+0.2+0.5 do not add up to 1 exactly in binary).
const shareTolerance = 1e-6

// checkShares checks that every share is in [0, 1] and that they sum to 1.
func checkShares(what string, names []string, shares []float64) error {
	sum := 0.0
	for i, s := range shares {
		if math.IsNaN(s) || s < 0 || s > 1 {
			return fmt.Errorf("workload: %s: %s=%v: want a share from 0 to 1", what, names[i], s)
		}
		sum += s
	}
	if math.Abs(sum-1) > shareTolerance {
		return fmt.Errorf("workload: %s: shares %s sum to %v, want 1", what, formatShares(names, shares), sum)
	}
	return nil
}

func formatShares(names []string, shares []float64) string {
	parts := make([]string, len(names))
	for i := range names {
		parts[i] = names[i] + "=" + strconv.FormatFloat(shares[i], 'g', -1, 64)
	}
	return strings.Join(parts, ",")
}

// parseShares parses NAME=SHARE[,NAME=SHARE...] into shares indexed like
// names. Names left out are 0.
func parseShares(what, s string, names []string) ([]float64, error) {
	shares := make([]float64, len(names))
	seen := make([]bool, len(names))
	if strings.TrimSpace(s) == "" {
		return nil, fmt.Errorf("workload: %s: empty; want for example %s", what, formatShares(names, evenShares(len(names))))
	}
	for item := range strings.SplitSeq(s, ",") {
		name, val, ok := strings.Cut(strings.TrimSpace(item), "=")
		if !ok {
			return nil, fmt.Errorf("workload: %s: %q: want NAME=SHARE", what, item)
		}
		i := indexOf(names, strings.ToLower(strings.TrimSpace(name)))
		if i < 0 {
			return nil, fmt.Errorf("workload: %s: unknown name %q: want %s", what, name, strings.Join(names, ", "))
		}
		if seen[i] {
			return nil, fmt.Errorf("workload: %s: %s given twice", what, names[i])
		}
		seen[i] = true
		v, err := strconv.ParseFloat(strings.TrimSpace(val), 64)
		if err != nil {
			return nil, fmt.Errorf("workload: %s: %s=%q: not a number", what, names[i], val)
		}
		shares[i] = v
	}
	if err := checkShares(what, names, shares); err != nil {
		return nil, err
	}
	return shares, nil
}

func evenShares(n int) []float64 {
	s := make([]float64, n)
	for i := range s {
		s[i] = 1 / float64(n)
	}
	return s
}

func indexOf(names []string, name string) int {
	for i, n := range names {
		if n == name {
			return i
		}
	}
	return -1
}

func (Mix) names() []string { return []string{"long", "multiturn", "single", "docs"} }

func (m Mix) shares() []float64 { return []float64{m.Long, m.MultiTurn, m.Single, m.Docs} }

// String gives the mix in the form ParseMix reads (without docs when it
// has none, as before the kind existed).
func (m Mix) String() string {
	if m.Docs == 0 {
		return formatShares(m.names()[:3], m.shares()[:3])
	}
	return formatShares(m.names(), m.shares())
}

// Validate checks that every share is in [0, 1] and that they sum to 1.
func (m Mix) Validate() error {
	if m.Docs == 0 {
		return checkShares("mix", m.names()[:3], m.shares()[:3])
	}
	return checkShares("mix", m.names(), m.shares())
}

func (IdentityMix) names() []string { return []string{"session", "token", "device", "anonymous"} }

func (m IdentityMix) shares() []float64 { return []float64{m.Session, m.Token, m.Device, m.Anonymous} }

// String gives the mix in the form ParseIdentityMix reads.
func (m IdentityMix) String() string { return formatShares(m.names(), m.shares()) }

// Validate checks that every share is in [0, 1] and that they sum to 1.
func (m IdentityMix) Validate() error { return checkShares("identities", m.names(), m.shares()) }

// ParseMix parses the form of tether-lab loadgen's --mix flag,
// "long=0.3,multiturn=0.2,single=0.5": names left out get 0 and the shares
// must sum to 1.
func ParseMix(s string) (Mix, error) {
	v, err := parseShares("mix", s, Mix{}.names())
	if err != nil {
		return Mix{}, err
	}
	return Mix{Long: v[0], MultiTurn: v[1], Single: v[2], Docs: v[3]}, nil
}

// ParseIdentityMix parses "session=0.55,token=0.2,device=0.15,anonymous=0.1"
// the way ParseMix does.
func ParseIdentityMix(s string) (IdentityMix, error) {
	v, err := parseShares("identities", s, IdentityMix{}.names())
	if err != nil {
		return IdentityMix{}, err
	}
	return IdentityMix{Session: v[0], Token: v[1], Device: v[2], Anonymous: v[3]}, nil
}
