package simulator

import (
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tetherproxy/tether/lab/workload"
)

func TestSkipPCG(t *testing.T) {
	for _, n := range []uint64{0, 1, 2, 3, 7, 64, 1000, 12345} {
		a, b := rand.NewPCG(1, 2), rand.NewPCG(1, 2)
		for range n {
			a.Uint64()
		}
		skipPCG(b, n)
		for i := range 3 {
			if x, y := a.Uint64(), b.Uint64(); x != y {
				t.Fatalf("skip %d: draw %d after the skip is %x, want %x", n, i, y, x)
			}
		}
	}
}

// TestShapesMatchWorkload checks shapes.at against workload.Generator.At:
// the fast path prices the same conversations as the text path and loadgen.
func TestShapesMatchWorkload(t *testing.T) {
	small := workload.Config{Seed: 3, LongTokens: workload.Range{Min: 5, Max: 400}}
	tests := []struct {
		name string
		cfg  workload.Config
		n    int
	}{
		{"defaults", workload.Config{Seed: 1}, 300},
		{"seed 0", workload.Config{}, 100},
		{"short long texts", small, 2000},
		{"custom", workload.Config{
			Seed:       9,
			Mix:        workload.Mix{Long: 0.1, MultiTurn: 0.8, Single: 0.1},
			Identities: workload.IdentityMix{Session: 0.25, Token: 0.25, Device: 0.25, Anonymous: 0.25},
			Apps:       []workload.App{{Name: "a", SystemTokens: 16}, {Name: "b", SystemTokens: 33, Weight: 3}},
			LongTokens: workload.Range{Min: 1, Max: 20}, SingleTokens: workload.Range{Min: 1, Max: 3},
			TurnTokens: workload.Range{Min: 1, Max: 5}, Turns: workload.Range{Min: 2, Max: 30},
		}, 2000},
		{"docs", workload.Config{
			Seed: 5, Mix: workload.Mix{MultiTurn: 0.3, Single: 0.2, Docs: 0.5},
			Docs: workload.Docs{Count: 30, Tokens: workload.Range{Min: 20, Max: 300}, Skew: 0.8},
		}, 1000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g, err := workload.New(tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			s := newShapes(tt.cfg)
			apps := g.Config().Apps
			for n := range uint64(tt.n) {
				c := g.At(n)
				want := shape{index: n, kind: c.Kind, identity: c.Identity, doc: c.Document}
				for i, a := range apps {
					if a.Name == c.App {
						want.app = i
					}
				}
				for _, tu := range c.Turns {
					want.turns = append(want.turns, turnShape{userTokens: tu.UserTokens, maxTokens: tu.MaxTokens, think: tu.Think})
				}
				got := s.at(n)
				if diff := cmp.Diff(want, got, cmp.AllowUnexported(shape{}, turnShape{})); diff != "" {
					t.Fatalf("conversation %d (-At +shape):\n%s", n, diff)
				}
			}
		})
	}
}
