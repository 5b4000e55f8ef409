//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"sync"
	"testing"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/testenv"
)

// TestClusterThroughEnvoy runs tether on a real 3-master Redis Cluster,
// given as redis.url = "redis+cluster://…": sessions stay on one instance
// through real Envoy, and their bindings are spread over the masters.
func TestClusterThroughEnvoy(t *testing.T) {
	c := testenv.RedisCluster(t)
	a := c.Addrs()
	url := "redis+cluster://" + a[0] + "?addr=" + a[1] + "&addr=" + a[2]
	inst := startFleet(t, 8)
	cfg := baseConfig(url, inst)
	tt := startTether(t, cfg)
	px := startEnvoy(t, cfg, tt.extproc)

	const sessions, turns = 100, 3
	header := func(s int) map[string]string { return map[string]string{"x-session-id": fmt.Sprintf("cluster-%d", s)} }
	served := make([]string, sessions) // session → the instance of its first turn
	parallel(sessions, 16, func(s int) {
		for turn := range turns {
			ans, err := tryChat(px, header(s))
			if err != nil {
				t.Errorf("session %d turn %d: %v", s, turn, err)
				return
			}
			want := "hit"
			if turn == 0 {
				served[s], want = ans.instance, "bind"
			}
			if ans.status != 200 || ans.instance == "" || ans.instance != ans.tethered ||
				ans.instance != served[s] || ans.decision != want {
				t.Errorf("session %d turn %d: %+v; want %s on %s", s, turn, ans, want, served[s])
				return
			}
		}
	})
	if t.Failed() {
		return
	}

	// Each session's binding names the instance that served it.
	ctx := context.Background()
	ids := extractor(t)
	for s, inst := range served {
		key := ids.Extract(mapHeaders(header(s))).Key
		bound, err := c.Client().HGet(ctx, "tether:{"+key+"}:b", "i").Result()
		if err != nil || bound != inst {
			t.Errorf("session %d served by %s, bound to %q (%v)", s, inst, bound, err)
		}
	}

	// The bindings are spread over the three masters: each holds a fair
	// share (a third is 33; 15 is more than four standard deviations
	// below).
	var mu sync.Mutex
	perMaster := map[string]int{}
	err := c.Client().ForEachMaster(ctx, func(ctx context.Context, m *goredis.Client) error {
		n := 0
		iter := m.Scan(ctx, 0, "tether:{*}:b", 100).Iterator()
		for iter.Next(ctx) {
			n++
		}
		mu.Lock()
		perMaster[m.Options().Addr] = n
		mu.Unlock()
		return iter.Err()
	})
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for addr, n := range perMaster {
		total += n
		if n < 15 {
			t.Errorf("master %s holds %d of %d bindings: %v", addr, n, sessions, perMaster)
		}
	}
	if len(perMaster) != 3 || total != sessions {
		t.Errorf("bindings per master %v: want %d over 3 masters", perMaster, sessions)
	}
	t.Logf("%d sessions x %d turns through Envoy; bindings per master: %v", sessions, turns, perMaster)
}
