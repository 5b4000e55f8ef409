package affinity_test

import (
	"context"
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
var contentPolicy = affinity.ContentPolicy{Enabled: true, MinBlocks: 2, BlockTokens: 16, QueuedTokens: 1024, RunningTokens: 128}

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
	}, affinity.WithClock(clk.now), affinity.WithContents(x))
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
	if !dec.Content || dec.Kind != affinity.KindBind {
		t.Fatalf("a new session's decision: kind %s, content %v", dec.Kind, dec.Content)
	}
	got := d.Refine(ctx, dec, chainOf(1, 50))
	if got.Instance.Name != "gpu-5" || !got.ByContent || got.Matched != 40 {
		t.Fatalf("refined to %s (by content %v, %d blocks), want gpu-5 by 40 blocks", got.Instance.Name, got.ByContent, got.Matched)
	}
	// The binding followed: the next turn is a hit there, header-only.
	next, err := d.Decide(ctx, session("s1"))
	if err != nil || next.Kind != affinity.KindHit || next.Instance.Name != "gpu-5" || next.Content {
		t.Fatalf("next turn: %s on %s (content %v, %v)", next.Kind, next.Instance.Name, next.Content, err)
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
	if hit.Content {
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
	if err != nil || dec.Kind != affinity.KindAnonymous || !dec.Content {
		t.Fatalf("anonymous: %s content %v (%v)", dec.Kind, dec.Content, err)
	}
	got := d.Refine(ctx, dec, chainOf(3, 30))
	if got.Instance.Name != "gpu-1" || got.Matched != 10 {
		t.Errorf("went to %s (%d blocks), want gpu-1, the next longest prefix, idle", got.Instance.Name, got.Matched)
	}
}

func TestContentOffAsksForNothing(t *testing.T) {
	d := affinity.New(memory.New(), fleet.New(instances(4)), affinity.Policy{Mode: affinity.Sticky, Lifetime: lifetime},
		affinity.WithContents(prefix.NewIndex(10)))
	dec, _ := d.Decide(context.Background(), session("s"))
	if dec.Content {
		t.Error("content asked for with ContentPolicy off")
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
	if hit.Kind != affinity.KindHit || hit.Content {
		t.Fatalf("5 s idle, within the horizon: %s (content %v)", hit.Kind, hit.Content)
	}
	d.Finish(hit, fleet.Outcome{Answered: true})
	clk.add(20 * time.Second)
	d.Load().SetEngine(home, fleet.EngineReading{CacheTokens: 1000, QueryRate: 110, HitRate: 10, RatesKnown: true, At: clk.now()})
	exp, _ := d.Decide(ctx, session("h1"))
	if exp.Kind != affinity.KindExpired || !exp.Content || exp.Instance.Name != home {
		t.Fatalf("20 s idle, past the horizon: %s on %s (content %v), want expired on %s", exp.Kind, exp.Instance.Name, exp.Content, home)
	}
	// The index still holds its prompt on its instance: it stays.
	if got := d.Refine(ctx, exp, chainOf(9, 25)); got.Instance.Name != home || !got.ByContent {
		t.Errorf("refined to %s (by content %v), want its own instance, which the index says holds it", got.Instance.Name, got.ByContent)
	}
	_ = x
}
