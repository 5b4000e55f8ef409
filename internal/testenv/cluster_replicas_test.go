package testenv

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
)

func TestParseClusterNodes(t *testing.T) {
	text := `07c3 127.0.0.1:30004@40004 slave e7d1 0 1426238317239 4 connected
67ed 127.0.0.1:30002@40002,host master - 0 1426238316232 2 connected 5461-10922
e7d1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460 [5461->-67ed]
6ec2 127.0.0.1:30003@40003 master,fail - 1426238316232 1426238315000 3 disconnected 10923 10924-16383
`
	got, err := parseClusterNodes(text)
	if err != nil {
		t.Fatal(err)
	}
	want := []ClusterNode{
		{ID: "07c3", Addr: "127.0.0.1:30004", MasterID: "e7d1"},
		{ID: "67ed", Addr: "127.0.0.1:30002", Master: true, Slots: 5462},
		{ID: "e7d1", Addr: "127.0.0.1:30001", Master: true, Slots: 5461},
		{ID: "6ec2", Addr: "127.0.0.1:30003", Master: true, Failed: true, Slots: 5461},
	}
	if !slices.Equal(got, want) {
		t.Errorf("parseClusterNodes:\n got %+v\nwant %+v", got, want)
	}
	for _, bad := range []string{"short line", "a b master - 0 0 1 connected 9-1", "a b master - 0 0 1 connected x"} {
		if _, err := parseClusterNodes(bad); err == nil {
			t.Errorf("parseClusterNodes(%q): no error", bad)
		}
	}
}

// TestRedisClusterWithReplicas forms a 3+3 cluster, then kills one master
// and fails another over by hand: each time the replica takes over, the
// cluster answers again and keeps every key (replicated before the kill).
func TestRedisClusterWithReplicas(t *testing.T) {
	start := time.Now()
	c := RedisClusterWithReplicas(t, ReplicatedClusterOptions{})
	t.Logf("cluster of %d nodes formed in %v", len(c.Addrs()), time.Since(start))
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	client := c.Client()
	masters, err := c.Masters(ctx)
	if err != nil || len(masters) != 3 || len(c.Addrs()) != 6 {
		t.Fatalf("Masters() = %v, %v of %d nodes; want 3 of 6", masters, err, len(c.Addrs()))
	}
	const keys = 200
	for i := range keys {
		if err := client.Set(ctx, fmt.Sprint("k", i), i, 0).Err(); err != nil {
			t.Fatalf("SET k%d: %v", i, err)
		}
	}
	// Every master's writes reached its replica.
	err = client.ForEachMaster(ctx, func(ctx context.Context, m *goredis.Client) error {
		n, err := m.Do(ctx, "WAIT", 1, 5000).Int()
		if err == nil && n != 1 {
			err = fmt.Errorf("WAIT on %s: %d replicas", m.Options().Addr, n)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	allKeys := func(when string) {
		t.Helper()
		for i := range keys {
			// The client learns the new topology from its first errors.
			var err error
			for range 20 {
				if err = client.Get(ctx, fmt.Sprint("k", i)).Err(); err == nil {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			if err != nil {
				t.Fatalf("%s: GET k%d: %v", when, i, err)
			}
		}
	}

	for _, tc := range []struct {
		name string
		do   func(context.Context, string) (string, error)
	}{{"kill", c.KillMaster}, {"failover", c.Failover}} {
		victim := masters[0]
		began := time.Now()
		promoted, err := tc.do(ctx, victim)
		if err != nil {
			t.Fatalf("%s %s: %v", tc.name, victim, err)
		}
		now, err := c.Masters(ctx)
		if err != nil || len(now) != 3 || slices.Contains(now, victim) || !slices.Contains(now, promoted) {
			t.Fatalf("after %s of %s: masters %v, %v; want 3 with %s in its place", tc.name, victim, now, err, promoted)
		}
		t.Logf("%s of master %s: replica %s serves its slots after %v", tc.name, victim, promoted, time.Since(began).Round(time.Millisecond))
		allKeys("after " + tc.name)
		masters = now
		// Fail over a master other than the one just promoted.
		for i, m := range masters {
			if m != promoted {
				masters[0], masters[i] = masters[i], masters[0]
				break
			}
		}
	}
	if _, err := c.Failover(ctx, "127.0.0.1:1"); err == nil {
		t.Error("Failover of an unknown address: no error")
	}
}
