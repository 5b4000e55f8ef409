package workload

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/lab/emulator"
)

// generate returns the first n conversations of cfg.
func generate(t *testing.T, cfg Config, n int) []Conversation {
	t.Helper()
	g, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	out := make([]Conversation, n)
	for i := range out {
		out[i] = g.Next()
	}
	return out
}

// short shortens the texts of cfg: the kinds, apps and identities are drawn
// before the texts, so the shares of the mix do not change, and long
// documents make large counts slow.
func short(cfg Config) Config {
	cfg.LongTokens, cfg.SingleTokens, cfg.TurnTokens = Range{20, 40}, Range{5, 10}, Range{5, 10}
	return cfg
}

// within reports whether got is within tol of want.
func within(got, want, tol float64) bool { return math.Abs(got-want) <= tol }

func TestMixProportions(t *testing.T) {
	const n = 20000
	// With n = 20000 the standard deviation of a share is at most 0.0036;
	// 0.015 is four of them. The seed is fixed, so the test is deterministic.
	const tol = 0.015
	tests := []struct {
		name  string
		cfg   Config
		kinds map[Kind]float64
		ids   map[IdentityKind]float64
	}{
		{
			name:  "defaults",
			cfg:   Config{Seed: 1},
			kinds: map[Kind]float64{KindLong: 0.3, KindMultiTurn: 0.2, KindSingle: 0.5},
			ids:   map[IdentityKind]float64{IdentitySession: 0.55, IdentityToken: 0.2, IdentityDevice: 0.15, IdentityAnonymous: 0.1},
		},
		{
			name:  "custom",
			cfg:   Config{Seed: 7, Mix: Mix{Long: 0.1, MultiTurn: 0.8, Single: 0.1}, Identities: IdentityMix{Session: 1}},
			kinds: map[Kind]float64{KindLong: 0.1, KindMultiTurn: 0.8, KindSingle: 0.1},
			ids:   map[IdentityKind]float64{IdentitySession: 1},
		},
		{
			name:  "only single, only anonymous",
			cfg:   Config{Seed: 3, Mix: Mix{Single: 1}, Identities: IdentityMix{Anonymous: 1}},
			kinds: map[Kind]float64{KindSingle: 1},
			ids:   map[IdentityKind]float64{IdentityAnonymous: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.cfg = short(tt.cfg)
			kinds := map[Kind]int{}
			ids := map[IdentityKind]int{}
			for _, c := range generate(t, tt.cfg, n) {
				kinds[c.Kind]++
				ids[c.Identity.Kind]++
			}
			for _, k := range Kinds() {
				if got := float64(kinds[k]) / n; !within(got, tt.kinds[k], tol) {
					t.Errorf("kind %s: share %.4f, want %.2f ± %.3f", k, got, tt.kinds[k], tol)
				}
			}
			for _, k := range IdentityKinds() {
				if got := float64(ids[k]) / n; !within(got, tt.ids[k], tol) {
					t.Errorf("identity %s: share %.4f, want %.2f ± %.3f", k, got, tt.ids[k], tol)
				}
			}
		})
	}
}

func TestAppWeights(t *testing.T) {
	const n = 20000
	apps := []App{{Name: "a", SystemTokens: 100, Weight: 3}, {Name: "b", SystemTokens: 100, Weight: 1}, {Name: "c", SystemTokens: 100}}
	counts := map[string]int{}
	for _, c := range generate(t, short(Config{Seed: 5, Apps: apps}), n) {
		counts[c.App]++
	}
	// Weight 0 means 1: 3/5, 1/5, 1/5.
	for app, want := range map[string]float64{"a": 0.6, "b": 0.2, "c": 0.2} {
		if got := float64(counts[app]) / n; !within(got, want, 0.015) {
			t.Errorf("app %s: share %.4f, want %.2f", app, got, want)
		}
	}
}

func TestIdentityHeaders(t *testing.T) {
	want := map[IdentityKind][]string{
		IdentitySession:   {SessionHeader},
		IdentityToken:     {AuthHeader},
		IdentityDevice:    {DeviceHeader, UserHeader},
		IdentityAnonymous: nil,
	}
	seen := map[string]bool{}
	for _, c := range generate(t, short(Config{Seed: 11}), 2000) {
		var names []string
		for _, h := range c.Identity.Headers {
			names = append(names, h.Name)
			if h.Value == "" {
				t.Fatalf("%s: header %s is empty", c.ID, h.Name)
			}
			if seen[h.Value] {
				t.Fatalf("%s: header value %q used by two conversations", c.ID, h.Value)
			}
			seen[h.Value] = true
		}
		if diff := cmp.Diff(want[c.Identity.Kind], names); diff != "" {
			t.Fatalf("%s (%s): header names (-want +got):\n%s", c.ID, c.Identity.Kind, diff)
		}
		if c.Identity.Kind == IdentityToken && !strings.HasPrefix(c.Identity.Headers[0].Value, "Bearer ") {
			t.Fatalf("%s: authorization %q is not a bearer token", c.ID, c.Identity.Headers[0].Value)
		}
	}
}

func TestTokenCountsPerKind(t *testing.T) {
	cfgs := []Config{
		{Seed: 2},
		{Seed: 9, LongTokens: Range{100, 120}, SingleTokens: Range{1, 3}, TurnTokens: Range{1, 1}, Turns: Range{2, 2},
			LongOutput: Range{7, 7}, MultiTurnOutput: Range{1, 4}, SingleOutput: Range{4096, 4096}},
	}
	for _, cfg := range cfgs {
		t.Run(fmt.Sprint("seed ", cfg.Seed), func(t *testing.T) {
			full := cfg.WithDefaults()
			users := map[Kind]Range{KindLong: full.LongTokens, KindSingle: full.SingleTokens, KindMultiTurn: full.TurnTokens}
			outputs := map[Kind]Range{KindLong: full.LongOutput, KindSingle: full.SingleOutput, KindMultiTurn: full.MultiTurnOutput}
			apps := map[string]int{}
			for _, a := range full.Apps {
				apps[a.Name] = a.SystemTokens
			}
			var thinks []time.Duration
			for _, c := range generate(t, cfg, 1500) {
				if got := emulator.CountTokens(c.System); got != c.SystemTokens || got != apps[c.App] {
					t.Fatalf("%s: system prompt of %s has %d tokens, SystemTokens %d, app %d", c.ID, c.App, got, c.SystemTokens, apps[c.App])
				}
				turns := Range{1, 1}
				if c.Kind == KindMultiTurn {
					turns = full.Turns
				}
				if !in(len(c.Turns), turns) {
					t.Fatalf("%s (%s): %d turns, want %v", c.ID, c.Kind, len(c.Turns), turns)
				}
				for i, turn := range c.Turns {
					if got := emulator.CountTokens(turn.User); got != turn.UserTokens {
						t.Fatalf("%s turn %d: %d tokens, UserTokens %d", c.ID, i, got, turn.UserTokens)
					}
					if !in(turn.UserTokens, users[c.Kind]) {
						t.Fatalf("%s (%s) turn %d: %d user tokens, want %v", c.ID, c.Kind, i, turn.UserTokens, users[c.Kind])
					}
					if !in(turn.MaxTokens, outputs[c.Kind]) {
						t.Fatalf("%s (%s) turn %d: max_tokens %d, want %v", c.ID, c.Kind, i, turn.MaxTokens, outputs[c.Kind])
					}
					switch {
					case i == 0 && turn.Think != 0:
						t.Fatalf("%s: first turn thinks %v", c.ID, turn.Think)
					case turn.Think < 0 || turn.Think > 10*full.ThinkTime:
						t.Fatalf("%s turn %d: think %v, want 0 to %v", c.ID, i, turn.Think, 10*full.ThinkTime)
					case i > 0:
						thinks = append(thinks, turn.Think)
					}
				}
			}
			var total time.Duration
			for _, d := range thinks {
				total += d
			}
			if mean := total / time.Duration(len(thinks)); !within(mean.Seconds(), full.ThinkTime.Seconds(), 0.1*full.ThinkTime.Seconds()) {
				t.Errorf("mean think time %v over %d turns, want %v ± 10%%", mean, len(thinks), full.ThinkTime)
			}
		})
	}
}

func in(n int, r Range) bool { return n >= r.Min && n <= r.Max }

func TestSystemPromptSharedPerApp(t *testing.T) {
	convs := generate(t, Config{Seed: 4}, 400)
	byApp := map[string]string{}
	for _, c := range convs {
		if prev, ok := byApp[c.App]; ok && prev != c.System {
			t.Fatalf("%s: app %s has two system prompts", c.ID, c.App)
		}
		byApp[c.App] = c.System
		if !strings.HasPrefix(c.System, "You are the "+c.App+" assistant.") {
			t.Fatalf("%s: system prompt starts %q", c.ID, c.System[:40])
		}
	}
	if len(byApp) != len(DefaultApps()) {
		t.Fatalf("%d apps seen, want %d", len(byApp), len(DefaultApps()))
	}
	prompts := map[string]string{}
	for app, p := range byApp {
		if other, ok := prompts[p]; ok {
			t.Fatalf("apps %s and %s share a system prompt", app, other)
		}
		prompts[p] = app
	}
	g, _ := New(Config{Seed: 4})
	for app, p := range byApp {
		if got, ok := g.SystemPrompt(app); !ok || got != p {
			t.Errorf("SystemPrompt(%s) differs from the conversations'", app)
		}
	}
	if _, ok := g.SystemPrompt("nope"); ok {
		t.Error("SystemPrompt(nope) found an app")
	}
	other, _ := New(Config{Seed: 5})
	if p, _ := other.SystemPrompt("finance"); p == byApp["finance"] {
		t.Error("seeds 4 and 5 give the same finance system prompt")
	}
}

// answer is what the emulator answers with ignore_eos: max words.
func answer(instance string, max int) string {
	w := strings.Fields("served by " + instance)
	out := make([]string, max)
	for i := range out {
		out[i] = w[i%3]
	}
	return strings.Join(out, " ")
}

// blocks returns the KV block hashes of a chat prompt the way the emulator
// computes them: the message contents joined by "\n", then the answer.
func blocks(msgs []Message, answer string) []emulator.BlockHash {
	var h emulator.BlockHasher
	var out []emulator.BlockHash
	for _, m := range msgs {
		out = h.Append(out, m.Content)
	}
	return h.Append(out, answer)
}

func TestMultiTurnPromptsArePrefixes(t *testing.T) {
	n := 0
	for _, c := range generate(t, Config{Seed: 6, Mix: Mix{MultiTurn: 1}}, 50) {
		var answers []string
		var prev []Message
		for k, turn := range c.Turns {
			msgs, err := c.Messages(k, answers)
			if err != nil {
				t.Fatal(err)
			}
			if want := 2 + 2*k; len(msgs) != want {
				t.Fatalf("%s turn %d: %d messages, want %d", c.ID, k, len(msgs), want)
			}
			if msgs[0] != (Message{"system", c.System}) || msgs[len(msgs)-1] != (Message{"user", turn.User}) {
				t.Fatalf("%s turn %d: messages do not open with the system prompt and end with the user message", c.ID, k)
			}
			if k > 0 {
				// The previous prompt, plus its answer, opens this one.
				want := append(append([]Message(nil), prev...), Message{"assistant", answers[k-1]})
				if diff := cmp.Diff(want, msgs[:len(want)]); diff != "" {
					t.Fatalf("%s turn %d: the previous prompt and answer are not a prefix (-want +got):\n%s", c.ID, k, diff)
				}
				// So, for the KV cache, every block the previous request stored
				// (prompt and answer) is a block of this prompt.
				stored := blocks(prev, answers[k-1])
				now := blocks(msgs, "")
				if len(stored) > len(now) || !cmp.Equal(stored, now[:len(stored)]) {
					t.Fatalf("%s turn %d: the %d stored blocks of turn %d are not a prefix of its %d blocks", c.ID, k, len(stored), k-1, len(now))
				}
				n++
			}
			answers = append(answers, answer("gpu-a", turn.MaxTokens))
			prev = msgs
		}
	}
	if n == 0 {
		t.Fatal("no follow-up turn checked")
	}
}

func TestConversationsShareOnlyTheSystemPrompt(t *testing.T) {
	// Same app, so the same system prompt: their blocks agree on the
	// system prompt's full blocks and on nothing after them.
	apps := []App{{Name: "only", SystemTokens: 100}}
	convs := generate(t, Config{Seed: 8, Apps: apps}, 200)
	seen := map[emulator.BlockHash]string{}
	shared := 100 / emulator.BlockSize
	for _, c := range convs {
		msgs, err := c.Messages(0, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i, b := range blocks(msgs, "") {
			if other, ok := seen[b]; ok && i >= shared {
				t.Fatalf("%s and %s share block %d", c.ID, other, i)
			}
			seen[b] = c.ID
		}
	}
}

func TestDeterminism(t *testing.T) {
	cfg := Config{Seed: 42, LongTokens: Range{50, 60}}
	a, b := generate(t, cfg, 300), generate(t, cfg, 300)
	if diff := cmp.Diff(a, b); diff != "" {
		t.Fatalf("same config, different conversations (-first +second):\n%s", diff)
	}
	g, _ := New(cfg)
	for _, n := range []uint64{299, 0, 17} {
		if diff := cmp.Diff(a[n], g.At(n)); diff != "" {
			t.Fatalf("At(%d) differs from the %dth Next (-next +at):\n%s", n, n, diff)
		}
	}
	c := generate(t, Config{Seed: 43, LongTokens: Range{50, 60}}, 300)
	same := 0
	for i := range a {
		if a[i].Turns[0].User == c[i].Turns[0].User {
			same++
		}
	}
	if same > 0 {
		t.Fatalf("seeds 42 and 43 share %d first messages", same)
	}
}

func TestMeanRequestsPerConversation(t *testing.T) {
	tests := []struct {
		cfg  Config
		want float64
	}{
		{Config{}, 0.3 + 0.5 + 0.2*7.5},
		{Config{Mix: Mix{MultiTurn: 1}, Turns: Range{2, 4}}, 3},
		{Config{Mix: Mix{Single: 1}}, 1},
	}
	for _, tt := range tests {
		g, err := New(tt.cfg)
		if err != nil {
			t.Fatal(err)
		}
		if got := g.MeanRequestsPerConversation(); !within(got, tt.want, 1e-9) {
			t.Errorf("%v: %v, want %v", tt.cfg.Mix, got, tt.want)
		}
	}
}

func TestMessagesErrors(t *testing.T) {
	c := generate(t, Config{Seed: 1, Mix: Mix{MultiTurn: 1}, Turns: Range{3, 3}}, 1)[0]
	tests := []struct {
		k       int
		answers []string
		want    string
	}{
		{-1, nil, "turn -1: want 0 to 2"},
		{3, []string{"a", "b", "c"}, "turn 3: want 0 to 2"},
		{2, []string{"a"}, "needs the answers of the 2 turns before it, got 1"},
	}
	for _, tt := range tests {
		_, err := c.Messages(tt.k, tt.answers)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Messages(%d, %d answers): %v, want %q", tt.k, len(tt.answers), err, tt.want)
		}
	}
}

func TestConfigValidation(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want string // "" for valid
	}{
		{"zero is the defaults", Config{}, ""},
		{"defaults", DefaultConfig(3), ""},
		{"mix sum", Config{Mix: Mix{Long: 0.3, MultiTurn: 0.2, Single: 0.4}}, "workload: mix: shares long=0.3,multiturn=0.2,single=0.4 sum to 0.9, want 1"},
		{"negative share", Config{Mix: Mix{Long: -0.5, Single: 1.5}}, "mix: long=-0.5: want a share from 0 to 1"},
		{"NaN share", Config{Mix: Mix{Long: math.NaN(), Single: 1}}, "mix: long=NaN"},
		{"identity sum", Config{Identities: IdentityMix{Session: 0.5}}, "identities: shares session=0.5,token=0,device=0,anonymous=0 sum to 0.5"},
		{"empty apps", Config{Apps: []App{}}, "apps: empty list"},
		{"app without name", Config{Apps: []App{{SystemTokens: 100}}}, "apps[0]: name is empty"},
		{"app name with space", Config{Apps: []App{{Name: "a b", SystemTokens: 100}}}, `apps[0]: name "a b": must be one word`},
		{"app twice", Config{Apps: []App{{Name: "a", SystemTokens: 100}, {Name: "a", SystemTokens: 100}}}, `apps[1]: name "a": used twice`},
		{"short system prompt", Config{Apps: []App{{Name: "a", SystemTokens: 3}}}, "apps[0] (a): system_tokens 3: want 16 to"},
		{"negative weight", Config{Apps: []App{{Name: "a", SystemTokens: 100, Weight: -1}}}, "apps[0] (a): weight -1"},
		{"range min", Config{SingleTokens: Range{0, 10}}, "single_tokens 0-10: min must be at least 1"},
		{"range inverted", Config{LongTokens: Range{500, 100}}, "long_tokens 500-100: max is below min"},
		{"one turn", Config{Turns: Range{1, 5}}, "turns 1-5: min must be at least 2"},
		{"too many turns", Config{Turns: Range{2, 5000}}, "turns 2-5000: max must be at most 1000"},
		{"output too long", Config{SingleOutput: Range{10, 5000}}, "single_output 10-5000: max must be at most 4096"},
		{"negative think", Config{ThinkTime: -time.Second}, "think_time -1s"},
		{"huge think", Config{ThinkTime: 2 * time.Hour}, "think_time 2h0m0s"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.cfg)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("New: %v", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("New: %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

func TestParseMix(t *testing.T) {
	tests := []struct {
		in   string
		want Mix
		err  string
	}{
		{in: "long=0.3,multiturn=0.2,single=0.5", want: DefaultMix()},
		{in: " Single = 1 ", want: Mix{Single: 1}},
		{in: "long=0.5,single=0.5", want: Mix{Long: 0.5, Single: 0.5}},
		{in: "", err: "mix: empty"},
		{in: "long", err: `mix: "long": want NAME=SHARE`},
		{in: "short=1", err: `unknown name "short": want long, multiturn, single`},
		{in: "long=1,long=0", err: "long given twice"},
		{in: "long=x", err: `long="x": not a number`},
		{in: "long=0.5", err: "sum to 0.5, want 1"},
		{in: "long=2,single=-1", err: "long=2: want a share from 0 to 1"},
	}
	for _, tt := range tests {
		got, err := ParseMix(tt.in)
		switch {
		case tt.err == "" && err != nil:
			t.Errorf("ParseMix(%q): %v", tt.in, err)
		case tt.err == "" && got != tt.want:
			t.Errorf("ParseMix(%q) = %+v, want %+v", tt.in, got, tt.want)
		case tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)):
			t.Errorf("ParseMix(%q): %v, want an error containing %q", tt.in, err, tt.err)
		}
	}
	ids, err := ParseIdentityMix("session=0.55,token=0.2,device=0.15,anonymous=0.1")
	if err != nil || ids != DefaultIdentityMix() {
		t.Errorf("ParseIdentityMix: %+v, %v", ids, err)
	}
	if _, err := ParseIdentityMix("session=0.5,cookie=0.5"); err == nil || !strings.Contains(err.Error(), `unknown name "cookie"`) {
		t.Errorf("ParseIdentityMix with an unknown name: %v", err)
	}
}

// TestDocsShareTheDocument checks KindDocs conversations: on the same
// document they share the system prompt's and the document's full blocks
// and nothing after them; on different documents only the system prompt's.
func TestDocsShareTheDocument(t *testing.T) {
	apps := []App{{Name: "only", SystemTokens: 100}}
	docs := Docs{Count: 5, Tokens: Range{50, 90}, Skew: 1, Turns: Range{1, 3}, QuestionTokens: Range{3, 9}, Output: Range{5, 10}}
	g, err := New(Config{Seed: 4, Apps: apps, Mix: Mix{Docs: 1}, Docs: docs})
	if err != nil {
		t.Fatal(err)
	}
	type owner struct {
		id  string
		doc int
	}
	seen := map[emulator.BlockHash]owner{}
	counts := make([]int, docs.Count)
	for n := range uint64(300) {
		c := g.At(n)
		if c.Kind != KindDocs || c.Document < 0 || c.Document >= docs.Count {
			t.Fatalf("%s: kind %s, document %d", c.ID, c.Kind, c.Document)
		}
		counts[c.Document]++
		text, tokens, ok := g.Document(c.Document)
		if !ok || !strings.HasPrefix(c.Turns[0].User, text+"\n["+c.ID+"]") {
			t.Fatalf("%s: first message does not open with document %d then the tag", c.ID, c.Document)
		}
		if got := emulator.CountTokens(c.Turns[0].User); got != c.Turns[0].UserTokens || got <= tokens {
			t.Fatalf("%s: first message has %d tokens, says %d, document %d", c.ID, got, c.Turns[0].UserTokens, tokens)
		}
		msgs, err := c.Messages(0, nil)
		if err != nil {
			t.Fatal(err)
		}
		sys, shared := 100/emulator.BlockSize, (100+tokens)/emulator.BlockSize
		for i, b := range blocks(msgs, "") {
			if o, ok := seen[b]; ok && i >= sys && (i >= shared || o.doc != c.Document) {
				t.Fatalf("%s (document %d) and %s (document %d) share block %d", c.ID, c.Document, o.id, o.doc, i)
			}
			seen[b] = owner{c.ID, c.Document}
		}
	}
	if counts[0] <= counts[docs.Count-1] {
		t.Errorf("document popularity %v: want the first more read than the last (Zipf)", counts)
	}
}
