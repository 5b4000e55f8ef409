package simulator

import (
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/lab/emulator"
	"github.com/tetherproxy/tether/lab/workload"
)

// TestOracleBounds: on seeded workloads (the field's mix on 8 and on 16
// instances; session chats under the emulator's cap of 20 conversations
// per cache, and in a 20k-token cache that evicts) the oracle's hit rate is
// at least every other policy's and strictly above random's, its load
// stays spread, and the infinite-cache bound is at least the oracle's (and
// every policy's on its own requests).
func TestOracleBounds(t *testing.T) {
	wide := small("")
	wide.Instances, wide.Rate = 16, 12
	tight := chats("", workload.IdentityMix{})
	tight.Cache = emulator.CacheConfig{CapacityTokens: 20_000, MaxConversations: -1}
	cases := map[string]Options{
		"field mix": small(""), "16 instances": wide,
		"chats, conversation cap": chats("", workload.IdentityMix{}), "chats, small cache": tight,
	}
	for name, base := range cases {
		t.Run(name, func(t *testing.T) {
			hit := map[Policy]float64{}
			for _, p := range Policies() {
				o := base
				o.Policy = p
				res := run(t, o)
				hit[p] = res.Summary.KVHitRate
				if res.InfiniteCacheBound < res.Summary.KVHitRate || res.InfiniteCacheBound >= 1 {
					t.Errorf("%s: infinite-cache bound %.4f, hit rate %.4f: want hit rate ≤ bound < 1", p, res.InfiniteCacheBound, res.Summary.KVHitRate)
				}
				if p == Oracle && res.Summary.LoadImbalance > 1.5 {
					t.Errorf("oracle: load imbalance %.2f, want it spread", res.Summary.LoadImbalance)
				}
			}
			// The oracle is greedy, the best choice for each request with the
			// caches as they are: a policy that leaves a cache for a later
			// turn can pass it by a hair (sticky and ring hash did by 0.05
			// points under the conversation cap), never by more.
			//
			// Not so against the content-reading routers (tether
			// cache-aware and the peers'): they send a new conversation where
			// its system prompt was sent, where the oracle ranks a cached
			// system prompt after the load (see oracleRouter), and under the
			// conversation cap a system prompt no kept conversation holds is
			// freed. On 8 instances GIE's scorer hit 44.2%, SGLang's 41.5%
			// and tether cache-aware 44.5% against the oracle's 41.2% (16
			// instances: 45.2%, 43.9%, 45.7%, 43.3%); with the chats,
			// tether cache-aware passed it by 0.4 and 1.4 points. They are
			// held to the infinite-cache bound above.
			for p, h := range hit {
				if p == GIEPrefix || p == SGLangCacheAware || p == CacheAware {
					continue
				}
				if h > hit[Oracle]+0.002 {
					t.Errorf("%s: hit rate %.4f above the oracle's %.4f by more than 0.2 points", p, h, hit[Oracle])
				}
			}
			if hit[Oracle] <= hit[Random] {
				t.Errorf("oracle %.4f, random %.4f: want the oracle strictly above", hit[Oracle], hit[Random])
			}
		})
	}
}

// TestBoundSameForAllPolicies: the bound depends on the requests, not on
// where they went: two policies whose runs send the same requests (the
// same prompt tokens) have the same bound, and every run's is close (a
// faster run sends a few more turns before the end).
func TestBoundSameForAllPolicies(t *testing.T) {
	bound := map[int64]float64{}
	lo, hi := 1.0, 0.0
	for _, p := range Policies() {
		res := run(t, small(p))
		b, tokens := res.InfiniteCacheBound, res.Summary.PromptTokens
		if want, ok := bound[tokens]; ok && b != want {
			t.Errorf("%s: bound %.6f on %d prompt tokens, another policy's on as many %.6f", p, b, tokens, want)
		}
		bound[tokens] = b
		lo, hi = min(lo, b), max(hi, b)
	}
	if lo <= 0 || hi-lo > 0.02 {
		t.Errorf("bounds %.4f to %.4f: want above 0 and within 2 points", lo, hi)
	}
}

// TestOracleFollowsCache: in steady chats every follow-up has its
// conversation's prefix on the instance that served it, so the oracle
// keeps conversations together without knowing their identity.
func TestOracleFollowsCache(t *testing.T) {
	o := chats(Oracle, workload.IdentityMix{Anonymous: 1})
	s := run(t, o).Summary
	if s.Continuity < 0.95 {
		t.Errorf("oracle on anonymous chats: continuity %.3f, want above 0.95", s.Continuity)
	}
}

// TestLeastRequestSpreads: the power of two choices keeps the requests
// per instance close to the mean.
func TestLeastRequestSpreads(t *testing.T) {
	o := small(LeastRequest)
	o.Duration = 2 * time.Minute
	s := run(t, o).Summary
	if s.LoadImbalance > 1.1 {
		t.Errorf("least request: load imbalance %.3f, want close to 1", s.LoadImbalance)
	}
	if s.Continuity > 0.4 {
		t.Errorf("least request: continuity %.3f, want low (it ignores identity)", s.Continuity)
	}
}

// TestBadOptionsRefused: out-of-range options are refused with an error
// naming the option.
func TestBadOptionsRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Options)
		want string
	}{
		{"negative rate", func(o *Options) { o.Rate = -5 }, "rate -5"},
		{"negative kv capacity", func(o *Options) { o.Cache.CapacityTokens = -16 }, "kv capacity -16"},
		{"kv capacity below a block", func(o *Options) { o.Cache.CapacityTokens = 8 }, "capacity_tokens 8"},
		{"unknown policy", func(o *Options) { o.Policy = "least-loaded" }, "unknown policy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := small(Oracle)
			tc.edit(&o)
			_, err := Run(t.Context(), o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Run: %v, want an error with %q", err, tc.want)
			}
		})
	}
	for _, p := range []string{"oracle", "Least-Request"} {
		if _, err := ParsePolicy(p); err != nil {
			t.Errorf("ParsePolicy(%q): %v", p, err)
		}
	}
}
