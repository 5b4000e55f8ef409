package affinity_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/prefix"
	"github.com/tetherproxy/tether/store/memory"
)

// contentPolicy is cache-aware placement with 16-token blocks and the
// product's load costs.
var contentPolicy = affinity.Content{Enabled: true, MinBlocks: 2, BlockTokens: 16, QueuedTokens: 1024, RunningTokens: 128}

func contentDecider(t *testing.T, n int) (*affinity.Decider, *prefix.Index, *memory.Store, *clock) {
	t.Helper()
	return contentDeciderOn(t, instances(n))
}

func contentDeciderOn(t *testing.T, insts []fleet.Instance) (*affinity.Decider, *prefix.Index, *memory.Store, *clock) {
	t.Helper()
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	st := memory.New()
	x := prefix.NewIndex(1 << 20)
	d := affinity.New(st, fleet.New(insts), affinity.Policy{
		Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25, Content: contentPolicy,
	}, affinity.WithClock(clk.now), affinity.WithPrefixIndex(x))
	return d, x, st, clk
}

func chainOf(doc uint64, n int) []uint64 {
	c := make([]uint64, n)
	for i := range c {
		c[i] = doc<<32 | uint64(i)
	}
	return c
}

func TestRefinePlacesANewSessionWhereItsPromptIs(t *testing.T) {
	ctx := context.Background()
	d, x, st, clk := contentDecider(t, 8)
	x.Record("gpu-5", chainOf(1, 40), clk.now())
	dec, err := d.Decide(ctx, session("s1"))
	if err != nil {
		t.Fatal(err)
	}
	if !dec.Open || dec.Kind != affinity.KindBind {
		t.Fatalf("a new session's decision: kind %s, content %v", dec.Kind, dec.Open)
	}
	got := d.Refine(ctx, dec, chainOf(1, 50))
	if got.Instance.Name != "gpu-5" || !got.ByContent || got.Matched != 40 {
		t.Fatalf("refined to %s (by content %v, %d blocks), want gpu-5 by 40 blocks", got.Instance.Name, got.ByContent, got.Matched)
	}
	// The binding followed: the next turn is a hit there, header-only.
	next, err := d.Decide(ctx, session("s1"))
	if err != nil || next.Kind != affinity.KindHit || next.Instance.Name != "gpu-5" || next.Open {
		t.Fatalf("next turn: %s on %s (content %v, %v)", next.Kind, next.Instance.Name, next.Open, err)
	}
	if s, ok, _ := st.Show(ctx, got.Key, clk.now()); !ok || s.Binding.Instance != "gpu-5" {
		t.Errorf("store holds %+v", s)
	}
	d.Finish(got, fleet.Outcome{Answered: true})
	d.Finish(next, fleet.Outcome{Answered: true})
	for _, in := range instances(8) {
		if f := d.Load().InFlight(in.Name); f != 0 {
			t.Errorf("%s: %d in flight after every request finished", in.Name, f)
		}
	}
	// The prompt's blocks are recorded where it went.
	depth := make([]int, 1)
	if x.Match(chainOf(1, 50), []string{"gpu-5"}, depth); depth[0] != 50 {
		t.Errorf("gpu-5 holds %d blocks of the prompt after it went there, want 50", depth[0])
	}
}

func TestRefineKeepsIdentityWhenTheIndexSaysNothing(t *testing.T) {
	ctx := context.Background()
	d, x, _, clk := contentDecider(t, 8)
	x.Record("gpu-5", chainOf(1, 1), clk.now()) // under MinBlocks
	dec, _ := d.Decide(ctx, session("s2"))
	got := d.Refine(ctx, dec, chainOf(1, 10))
	if got.Instance.Name != dec.Instance.Name || got.ByContent {
		t.Errorf("moved to %s with a one-block match (min 2)", got.Instance.Name)
	}
	// A hit is never content's to decide.
	hit, _ := d.Decide(ctx, session("s2"))
	if hit.Open {
		t.Error("a hit asks for content")
	}
	if r := d.Refine(ctx, hit, chainOf(2, 10)); r.Instance.Name != hit.Instance.Name || r.ByContent {
		t.Error("Refine moved a hit")
	}
}

func TestRefineSendsPastALoadedHolder(t *testing.T) {
	ctx := context.Background()
	d, x, _, clk := contentDecider(t, 4)
	x.Record("gpu-2", chainOf(3, 30), clk.now())
	x.Record("gpu-1", chainOf(3, 10), clk.now())
	// Six requests wait on gpu-2: 6 × 1,024 tokens of waiting cost more
	// than the 20 blocks (320 tokens) it holds beyond gpu-1.
	for range 6 {
		d.Load().Begin("gpu-2", clk.now())
	}
	anon := affinity.Request{ID: identity.Identity{}}
	dec, err := d.Decide(ctx, anon)
	if err != nil || dec.Kind != affinity.KindAnonymous || !dec.Open {
		t.Fatalf("anonymous: %s content %v (%v)", dec.Kind, dec.Open, err)
	}
	got := d.Refine(ctx, dec, chainOf(3, 30))
	if got.Instance.Name != "gpu-1" || got.Matched != 10 {
		t.Errorf("went to %s (%d blocks), want gpu-1, the next longest prefix, idle", got.Instance.Name, got.Matched)
	}
}

func TestContentOffAsksForNothing(t *testing.T) {
	d := affinity.New(memory.New(), fleet.New(instances(4)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime},
		affinity.WithPrefixIndex(prefix.NewIndex(10)))
	dec, _ := d.Decide(context.Background(), session("s"))
	if dec.Open {
		t.Error("content asked for with Content off")
	}
}

func TestSessionPastItsInstanceHorizonIsPlacedAgain(t *testing.T) {
	ctx := context.Background()
	d, x, _, clk := contentDecider(t, 4)
	dec, err := d.Decide(ctx, session("h1"))
	if err != nil {
		t.Fatal(err)
	}
	dec = d.Refine(ctx, dec, chainOf(9, 20))
	d.Finish(dec, fleet.Outcome{Answered: true})
	home := dec.Instance.Name
	if h, ok := d.Horizon(home); ok {
		t.Fatalf("a horizon (%v) before any reading or eviction", h)
	}
	// Its engine holds 1,000 tokens and computes 100 new ones a second:
	// an idle prefix survives 10 s there.
	d.Load().SetEngine(home, fleet.EngineReading{CacheTokens: 1000, QueryRate: 110, HitRate: 10, RatesKnown: true, At: clk.now()})
	if h, ok := d.Horizon(home); !ok || h != 10*time.Second {
		t.Fatalf("horizon %v (%v), want 10s", h, ok)
	}
	clk.add(5 * time.Second)
	d.Load().SetEngine(home, fleet.EngineReading{CacheTokens: 1000, QueryRate: 110, HitRate: 10, RatesKnown: true, At: clk.now()})
	hit, _ := d.Decide(ctx, session("h1"))
	if hit.Kind != affinity.KindHit || hit.Open {
		t.Fatalf("5 s idle, within the horizon: %s (content %v)", hit.Kind, hit.Open)
	}
	d.Finish(hit, fleet.Outcome{Answered: true})
	clk.add(20 * time.Second)
	d.Load().SetEngine(home, fleet.EngineReading{CacheTokens: 1000, QueryRate: 110, HitRate: 10, RatesKnown: true, At: clk.now()})
	exp, _ := d.Decide(ctx, session("h1"))
	if exp.Kind != affinity.KindExpired || !exp.Open || exp.Instance.Name != home {
		t.Fatalf("20 s idle, past the horizon: %s on %s (content %v), want expired on %s", exp.Kind, exp.Instance.Name, exp.Open, home)
	}
	// The index still holds its prompt on its instance: it stays.
	if got := d.Refine(ctx, exp, chainOf(9, 25)); got.Instance.Name != home || !got.ByContent {
		t.Errorf("refined to %s (by content %v), want its own instance, which the index says holds it", got.Instance.Name, got.ByContent)
	}
	_ = x
}

// refineNew places a new session s by prompt: its headers' decision, then
// Refine with chain, as extproc does with the body. The request stays in
// flight.
func refineNew(t *testing.T, d *affinity.Decider, s string, chain []uint64) affinity.Decision {
	t.Helper()
	dec, err := d.Decide(context.Background(), session(s))
	if err != nil {
		t.Fatal(err)
	}
	return d.Refine(context.Background(), dec, chain)
}

// prompt is sys blocks of a shared prefix followed by n blocks of the
// request's own (own).
func prompt(sys int, own uint64, n int) []uint64 {
	return append(chainOf(1, sys), chainOf(own, n)...)
}

func TestRefineWeighsTheSavingAgainstTheWork(t *testing.T) {
	reading := func(running int, at time.Time) fleet.EngineReading {
		return fleet.EngineReading{Running: running, At: at}
	}
	t.Run("every instance holds the prompt: identity keeps it", func(t *testing.T) {
		d, x, _, clk := contentDecider(t, 4)
		for _, in := range instances(4) {
			x.Record(in.Name, chainOf(1, 40), clk.now())
		}
		for i := range 20 {
			dec, _ := d.Decide(context.Background(), session(fmt.Sprint("all-", i)))
			got := d.Refine(context.Background(), dec, prompt(40, uint64(100+i), 5))
			if got.Instance.Name != dec.Instance.Name || !got.ByContent || got.Matched != 40 {
				t.Fatalf("session %d: moved from %s to %s (by content %v, %d blocks): an equal match everywhere must stay where the fail-open pool sends it",
					i, dec.Instance.Name, got.Instance.Name, got.ByContent, got.Matched)
			}
			d.Finish(got, fleet.Outcome{Answered: true})
		}
	})
	t.Run("a busy holder of a short shared prefix: the new work goes to an idle instance", func(t *testing.T) {
		d, x, _, clk := contentDecider(t, 4)
		dec, _ := d.Decide(context.Background(), session("long"))
		holder := "gpu-0"
		if dec.Instance.Name == holder {
			holder = "gpu-1"
		}
		// The holder serves six requests; 20 blocks of system prompt save
		// 320 tokens, less than six running requests cost (768).
		x.Record(holder, chainOf(1, 20), clk.now())
		d.Load().SetEngine(holder, reading(6, clk.now()))
		got := d.Refine(context.Background(), dec, prompt(20, 2, 300))
		if got.Instance.Name != dec.Instance.Name {
			t.Errorf("a 320-block prompt with 20 blocks held on a busy %s went there, not to idle %s", holder, dec.Instance.Name)
		}
		// A prompt it holds nearly all of goes there all the same: 300
		// blocks (4,800 tokens) saved outweigh the six requests.
		x.Record(holder, prompt(20, 3, 280), clk.now())
		dec2, _ := d.Decide(context.Background(), session("follow"))
		if got := d.Refine(context.Background(), dec2, prompt(20, 3, 290)); got.Instance.Name != holder {
			t.Errorf("a prompt %s holds 300 of 310 blocks of went to %s", holder, got.Instance.Name)
		}
	})
	t.Run("weights 1, 1, 8: the large instance's work counts for less", func(t *testing.T) {
		insts := instances(3)
		insts[2].Weight = 8
		d, x, _, clk := contentDeciderOn(t, insts)
		for _, in := range insts {
			x.Record(in.Name, chainOf(1, 40), clk.now())
			d.Load().SetEngine(in.Name, reading(4, clk.now()))
		}
		// With equal readings, the weight-8 instance is the cheapest for
		// a prompt whose identity choice is elsewhere.
		var dec affinity.Decision
		for i := 0; i == 0 || dec.Instance.Name == "gpu-2"; i++ {
			dec, _ = d.Decide(context.Background(), session(fmt.Sprint("w-", i)))
		}
		if got := d.Refine(context.Background(), dec, prompt(40, 999, 40)); got.Instance.Name != "gpu-2" {
			t.Errorf("with 4 running on each, went to %s, not the weight-8 gpu-2", got.Instance.Name)
		}
	})
	t.Run("every instance saturated: the request stays where identity placed it", func(t *testing.T) {
		d, x, _, clk := contentDecider(t, 4)
		p := d.Policy()
		p.Saturation = affinity.Saturation{Waiting: 2}
		d.SetPolicy(p)
		for _, in := range instances(4) {
			d.Load().SetEngine(in.Name, fleet.EngineReading{Waiting: 5, At: clk.now()})
		}
		x.Record("gpu-3", chainOf(1, 40), clk.now())
		dec, _ := d.Decide(context.Background(), session("sat"))
		if got := d.Refine(context.Background(), dec, prompt(40, 5, 2)); got.Instance.Name != dec.Instance.Name {
			t.Errorf("moved from %s to saturated %s", dec.Instance.Name, got.Instance.Name)
		}
	})
	t.Run("an engine reading gone stale counts for nothing", func(t *testing.T) {
		d, x, _, clk := contentDecider(t, 4)
		p := d.Policy()
		p.Saturation.Stale = 5 * time.Second
		d.SetPolicy(p)
		dec, _ := d.Decide(context.Background(), session("stale"))
		clk.add(6 * time.Second)
		dec2, _ := d.Decide(context.Background(), session("stale-2"))
		holder := ""
		for _, in := range instances(4) {
			if in.Name != dec.Instance.Name && in.Name != dec2.Instance.Name {
				holder = in.Name
				break
			}
		}
		clk.add(-6 * time.Second)
		x.Record(holder, chainOf(1, 40), clk.now())
		d.Load().SetEngine(holder, reading(50, clk.now()))
		if got := d.Refine(context.Background(), dec, prompt(40, 6, 4)); got.Instance.Name == holder {
			t.Fatalf("went to %s, which runs 50 requests", holder)
		}
		// The reading ages past the staleness bound: the holder is idle as
		// far as tether knows, and its 40 blocks pull the next prompt.
		clk.add(6 * time.Second)
		if got := d.Refine(context.Background(), dec2, prompt(40, 7, 4)); got.Instance.Name != holder {
			t.Errorf("went to %s; %s's only reading is stale and it holds the prompt", got.Instance.Name, holder)
		}
	})
}

// TestManyConversationsOnOneDocument: a thousand conversations open with
// the same 200 KB document (800 blocks of 256 bytes, 51,200 tokens). Its
// holders take them while the work there costs less than computing the
// document again: with 30 requests in flight, the sessions' bound spreads
// them over copies of it, none past its bound; with 400 in flight, the
// queues outweigh the document and every instance takes a share.
func TestManyConversationsOnOneDocument(t *testing.T) {
	for _, c := range []struct {
		inFlight int
		least    int // conversations the emptiest instance takes at least
	}{{30, 0}, {400, 1}} {
		t.Run(fmt.Sprint(c.inFlight, " in flight"), func(t *testing.T) {
			d, _, _, _ := contentDecider(t, 8)
			p := d.Policy()
			p.Content.BlockTokens = 64 // 256-byte blocks
			d.SetPolicy(p)
			doc := chainOf(1, 800)
			var live []affinity.Decision
			counts := map[string]int{}
			for i := range 1000 {
				got := refineNew(t, d, fmt.Sprint("doc-", i), append(slices.Clone(doc), chainOf(uint64(10+i), 2)...))
				counts[got.Instance.Name]++
				live = append(live, got)
				if len(live) > c.inFlight {
					d.Finish(live[0], fleet.Outcome{Answered: true})
					live = live[1:]
				}
			}
			t.Logf("conversations per instance: %v", counts)
			for _, in := range instances(8) {
				if n := counts[in.Name]; n > 157 {
					t.Errorf("%s took %d conversations, past its bound ⌈1.25 × 125⌉", in.Name, n)
				}
				if n := counts[in.Name]; n < c.least {
					t.Errorf("%s took %d conversations with %d requests in flight on the others", in.Name, n, c.inFlight)
				}
			}
		})
	}
}

// TestSubset: a caller's subset narrows every placement; one that leaves
// no instance is refused before anything is bound.
func TestSubset(t *testing.T) {
	ctx := context.Background()
	st := memory.New()
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	d := affinity.New(st, fleet.New(instances(4)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25},
		affinity.WithClock(clk.now), affinity.WithBreaker(fleet.NewBreaker(fleet.BreakerConfig{Threshold: 3, Window: time.Minute, Cooldown: time.Minute}, clk.now, nil)))
	for i := range 40 {
		req := session(fmt.Sprint("sub-", i))
		req.Subset = []string{"gpu-1", "gpu-3"}
		got, err := d.Decide(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if n := got.Instance.Name; n != "gpu-1" && n != "gpu-3" {
			t.Fatalf("placed on %s outside the subset", n)
		}
	}
	// A session bound outside a later subset moves into it.
	first := decide(t, d, session("moving"))
	req := session("moving")
	req.Subset = []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3"}
	for _, n := range req.Subset {
		if n != first.Instance.Name {
			req.Subset = []string{n}
			break
		}
	}
	got, err := d.Decide(ctx, req)
	if err != nil || got.Instance.Name != req.Subset[0] || got.Kind != affinity.KindMoved {
		t.Errorf("bound to %s, subset %v: %s on %s (%v)", first.Instance.Name, req.Subset, got.Kind, got.Instance.Name, err)
	}
	// Nothing eligible: a clear error, nothing bound.
	req = session("nowhere")
	req.Subset = []string{"gpu-9", "not-an-instance"}
	if _, err := d.Decide(ctx, req); !errors.Is(err, affinity.ErrNoEligible) {
		t.Errorf("subset of unknown instances: %v, want ErrNoEligible", err)
	}
	if _, ok, _ := st.Show(ctx, "s:nowhere", time.Now()); ok {
		t.Error("a session was bound for a request refused for its subset")
	}
}

// TestFallbacks: a request that asks for fallbacks gets the next instances
// of its session's ranking, never its own, alike on every call, within its
// subset; a request Refine moves keeps the one it left as its first.
func TestFallbacks(t *testing.T) {
	ctx := context.Background()
	d := affinity.New(memory.New(), fleet.New(instances(4)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25})
	names := func(in []fleet.Instance) []string {
		var out []string
		for _, i := range in {
			out = append(out, i.Name)
		}
		return out
	}
	for i := range 20 {
		req := session(fmt.Sprint("fb-", i))
		req.Fallbacks = 2
		first, err := d.Decide(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		again, err := d.Decide(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		got := names(first.Fallbacks)
		if len(got) != 2 || slices.Contains(got, first.Instance.Name) || got[0] == got[1] {
			t.Fatalf("session on %s: fallbacks %v", first.Instance.Name, got)
		}
		if !slices.Equal(got, names(again.Fallbacks)) {
			t.Errorf("the same session's fallbacks differ: %v, then %v", got, names(again.Fallbacks))
		}
	}
	req := session("fb-subset")
	req.Fallbacks, req.Subset = 3, []string{"gpu-0", "gpu-2"}
	got, err := d.Decide(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if fb := names(got.Fallbacks); len(fb) != 1 || !slices.Contains(req.Subset, fb[0]) || fb[0] == got.Instance.Name {
		t.Errorf("subset %v, placed on %s: fallbacks %v", req.Subset, got.Instance.Name, fb)
	}
	if plain := decide(t, d, session("fb-none")); plain.Fallbacks != nil {
		t.Errorf("a request that asked for none got fallbacks %v", names(plain.Fallbacks))
	}
}

// TestFallbacksFollowTheLadder: the fallbacks are the failover ladder's
// order, the chosen instance's zone first, then the others.
func TestFallbacksFollowTheLadder(t *testing.T) {
	fl := []fleet.Instance{
		{Name: "a0", Zone: "a", Weight: 1}, {Name: "a1", Zone: "a", Weight: 1},
		{Name: "b0", Zone: "b", Weight: 1}, {Name: "b1", Zone: "b", Weight: 1}, {Name: "b2", Zone: "b", Weight: 1},
	}
	d := affinity.New(memory.New(), fleet.New(fl), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime, Epsilon: 0.25})
	for i := range 30 {
		req := session(fmt.Sprint("ladder-", i))
		req.Fallbacks = 3
		got, err := d.Decide(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		zone := got.Instance.Zone
		same := map[string]int{"a": 1, "b": 2}[zone] // the others in its zone
		if len(got.Fallbacks) != 3 {
			t.Fatalf("on %s: %d fallbacks", got.Instance.Name, len(got.Fallbacks))
		}
		for j, fb := range got.Fallbacks {
			if (j < same) != (fb.Zone == zone) || fb.Name == got.Instance.Name {
				t.Fatalf("on %s: fallbacks %v, want its zone's %d first", got.Instance.Name, got.Fallbacks, same)
			}
		}
	}
}
