package simulator

import (
	"container/list"
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/workload"
)

// gieHashes is GIE's indexer in its own shape, one entry per block hash:
// a golang-lru cache of hashes per server, and a map from each hash to
// the servers holding it. It is the reference gieIndex is tested against.
type gieHashes struct {
	capacity int
	lrus     []*hashLRU
	holders  map[uint64][]int32 // hash → servers whose LRU holds it
}

// hashLRU is one server's LRU of block hashes.
type hashLRU struct {
	items map[uint64]*list.Element
	order list.List // of uint64; front is the most recent
}

func newGIEHashes(servers, capacity int) *gieHashes {
	return &gieHashes{capacity: capacity, lrus: make([]*hashLRU, servers), holders: map[uint64][]int32{}}
}

func (r *gieHashes) match(hashes []uint64, depth []int) {
	clear(depth)
	for _, h := range hashes {
		servers := r.holders[h]
		if len(servers) == 0 {
			break
		}
		for _, s := range servers {
			depth[s]++
		}
	}
}

func (r *gieHashes) add(hashes []uint64, i int) {
	l := r.lrus[i]
	if l == nil {
		l = &hashLRU{items: map[uint64]*list.Element{}}
		r.lrus[i] = l
	}
	for _, h := range hashes {
		if e, ok := l.items[h]; ok {
			l.order.MoveToFront(e)
			continue
		}
		l.items[h] = l.order.PushFront(h)
		r.holders[h] = append(r.holders[h], int32(i))
		if l.order.Len() > r.capacity {
			last := l.order.Back()
			old := last.Value.(uint64)
			l.order.Remove(last)
			delete(l.items, old)
			r.unhold(old, int32(i))
		}
	}
}

func (r *gieHashes) drop(i int) {
	if l := r.lrus[i]; l != nil {
		for e := l.order.Front(); e != nil; e = e.Next() {
			r.unhold(e.Value.(uint64), int32(i))
		}
		r.lrus[i] = nil
	}
}

func (r *gieHashes) size(i int) int {
	if r.lrus[i] == nil {
		return 0
	}
	return r.lrus[i].order.Len()
}

func (r *gieHashes) unhold(h uint64, i int32) {
	s := r.holders[h]
	for j, x := range s {
		if x == i {
			s[j] = s[len(s)-1]
			s = s[:len(s)-1]
			break
		}
	}
	if len(s) == 0 {
		delete(r.holders, h)
	} else {
		r.holders[h] = s
	}
}

// gieChecked routes as gie does and keeps ref beside its index, failing
// the test at the first request the two index differently.
type gieChecked struct {
	t        *testing.T
	gie      *gieRouter
	ref      *gieHashes
	requests int
}

func (g *gieChecked) prepare(c *conversation)               { g.gie.prepare(c) }
func (g *gieChecked) answered(k *call, at int64, queue int) { g.gie.answered(k, at, queue) }

func (g *gieChecked) update(f *fleetState) {
	g.gie.update(f)
	up := make([]bool, len(f.instances))
	for _, i := range f.live {
		up[i] = true
	}
	for i := range f.instances {
		if !up[i] {
			g.ref.drop(i)
		}
	}
	g.sizes("after a fleet change")
}

func (g *gieChecked) route(ctx context.Context, k *call) (int, affinity.Kind, error) {
	c := k.conv
	hashes := c.chain()
	hashes = hashes[:min(len(hashes), gieMaxPrefixBlocks)]
	n := min((c.history+c.shape.turns[c.turn].userTokens)/emulator.BlockSize, gieMaxPrefixBlocks)
	if n != len(hashes) {
		g.t.Fatalf("request %d: %d blocks from the token counts, %d hashes", g.requests, n, len(hashes))
	}
	want, got := make([]int, len(g.ref.lrus)), make([]int, len(g.ref.lrus))
	g.ref.match(hashes, want)
	g.gie.index.match(gieSpans(nil, c, n), got)
	if !slices.Equal(got, want) {
		g.t.Fatalf("request %d (conversation %d, turn %d, %d blocks): runs match %v, hashes %v", g.requests, c.shape.index, c.turn, n, got, want)
	}
	i, kind, err := g.gie.route(ctx, k)
	g.ref.add(hashes, i)
	g.requests++
	g.sizes(fmt.Sprintf("request %d", g.requests))
	return i, kind, err
}

func (g *gieChecked) sizes(when string) {
	for i, sv := range g.gie.index.servers {
		if sv.size != g.ref.size(i) {
			g.t.Fatalf("%s: server %d holds %d blocks in runs, %d hashes", when, i, sv.size, g.ref.size(i))
		}
	}
}

// TestGIEIndexMatchesHashes runs GIE's router on runs beside the per-hash
// indexer and wants the same match for every request and the same blocks
// held by every server: with evictions, with chains longer than the
// capacity, with shared documents and with instances leaving.
func TestGIEIndexMatchesHashes(t *testing.T) {
	failures, err := LookupRegime("failures")
	if err != nil {
		t.Fatal(err)
	}
	base := Options{Policy: GIEPrefix, Instances: 8, Rate: 20, Duration: 4 * time.Minute, ThinkScale: 1, Stream: true,
		Workload: workload.Config{Seed: 3}, Seed: 3}
	cases := []struct {
		name string
		opts func() Options
	}{
		{"evicting", func() Options {
			o := base
			o.Cache.CapacityTokens = 16 * 600
			return o
		}},
		{"capacity below a chain", func() Options {
			o := base
			o.Cache.CapacityTokens = 16 * 40
			return o
		}},
		{"shared documents", func() Options {
			o := sharedDocumentsSmall(GIEPrefix)
			o.Cache.CapacityTokens = 16 * 700
			return o
		}},
		{"instances failing", func() Options {
			o, err := failures.Apply(base)
			if err != nil {
				t.Fatal(err)
			}
			o.Duration, o.Scenario.Warmup, o.Scenario.Failures.Every = 12*time.Minute, time.Minute, 3*time.Minute
			o.Cache.CapacityTokens = 16 * 2000
			return o
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := newRunner(tc.opts())
			if err != nil {
				t.Fatal(err)
			}
			gie := r.router.(*gieRouter)
			g := &gieChecked{t: t, gie: gie, ref: newGIEHashes(len(r.instances), gie.index.capacity)}
			g.update(&r.fleet)
			r.router = g
			if _, err := r.run(t.Context()); err != nil {
				t.Fatal(err)
			}
			evicted := 0
			for i := range r.instances {
				if l := g.ref.lrus[i]; l != nil && l.order.Len() == g.ref.capacity {
					evicted++
				}
			}
			if g.requests < 500 || evicted == 0 {
				t.Errorf("%d requests, %d servers full: want hundreds, evicting", g.requests, evicted)
			}
		})
	}
}
