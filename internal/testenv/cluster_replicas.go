package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/launch"
)

// DefaultNodeTimeout is the cluster-node-timeout of
// RedisClusterWithReplicas when its options leave it zero. It is short, so
// a killed master is replaced in two to three seconds.
const DefaultNodeTimeout = time.Second

// ReplicatedClusterOptions tunes RedisClusterWithReplicas.
type ReplicatedClusterOptions struct {
	// NodeTimeout is every node's cluster-node-timeout. It is how long a
	// master may be silent before the others mark it failed and its
	// replica takes over. Zero means DefaultNodeTimeout.
	NodeTimeout time.Duration
}

// ReplicatedCluster is a Redis Cluster of three masters with one replica
// each, on loopback TCP ports. It is private to one test. Unlike Cluster,
// a master can fail. KillMaster kills one and waits for its replica to
// take over. Failover hands a master's slots to its replica without data
// loss.
type ReplicatedCluster struct {
	client *goredis.ClusterClient

	mu    sync.Mutex
	nodes []*replicatedNode // in start order; a killed node keeps its entry
}

type replicatedNode struct {
	addr string
	proc *launch.Proc // nil once killed
}

// RedisClusterWithReplicas starts six cluster-mode redis-server processes.
// It joins them with `redis-cli --cluster create … --cluster-replicas 1`.
// It waits until every node reports cluster_state:ok and every replica is
// in sync with its master. It stops them when the test ends. It skips or
// fails the test (see Require) when redis-server or redis-cli is missing.
func RedisClusterWithReplicas(t testing.TB, opts ReplicatedClusterOptions) *ReplicatedCluster {
	t.Helper()
	if opts.NodeTimeout == 0 {
		opts.NodeTimeout = DefaultNodeTimeout
	}
	server := redisBin(t, "redis-server", "REDIS_SERVER_BIN")
	cli := redisBin(t, "redis-cli", "REDIS_CLI_BIN")
	dir, err := os.MkdirTemp("", "trr")
	if err != nil {
		t.Fatalf("redis cluster: %v", err)
	}
	c := &ReplicatedCluster{}
	t.Cleanup(func() {
		if c.client != nil {
			_ = c.client.Close()
		}
		c.mu.Lock()
		nodes := c.nodes
		c.mu.Unlock()
		for _, n := range nodes {
			if n.proc != nil {
				n.proc.Stop(stopTimeout)
			}
		}
		_ = os.RemoveAll(dir)
	})
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()

	const nodes = 2 * clusterMasters
	addrs := make([]string, 0, nodes)
	for i := range nodes {
		ndir := filepath.Join(dir, strconv.Itoa(i))
		if err := os.Mkdir(ndir, 0o700); err != nil {
			t.Fatalf("redis cluster: %v", err)
		}
		p, addr, err := startClusterNode(ctx, server, ndir, opts.NodeTimeout)
		if err != nil {
			t.Fatalf("redis cluster node %d: %v", i, err)
		}
		c.nodes = append(c.nodes, &replicatedNode{addr: addr, proc: p})
		addrs = append(addrs, addr)
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	if out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	if err := waitClusterOK(ctx, addrs); err != nil {
		t.Fatalf("redis cluster did not form: %v\n%s", err, c.logs())
	}
	if err := c.waitReplicasInSync(ctx); err != nil {
		t.Fatalf("redis cluster replicas: %v\n%s", err, c.logs())
	}
	c.client = goredis.NewClusterClient(&goredis.ClusterOptions{Addrs: addrs, ContextTimeoutEnabled: true})
	return c
}

// Addrs are every node's address, masters and replicas, in start order.
// Killed nodes are included. They serve as seeds for a cluster client.
func (c *ReplicatedCluster) Addrs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		out[i] = n.addr
	}
	return out
}

// URL is the cluster as a tether store URL, with every node a seed:
// "redis+cluster://first?addr=second&addr=…".
func (c *ReplicatedCluster) URL() string {
	a := c.Addrs()
	return "redis+cluster://" + a[0] + "?addr=" + strings.Join(a[1:], "&addr=")
}

// Client is a cluster client, closed when the test ends.
func (c *ReplicatedCluster) Client() *goredis.ClusterClient { return c.client }

// ClusterNode is one line of CLUSTER NODES.
type ClusterNode struct {
	ID, Addr string
	Master   bool   // flags hold "master"
	Failed   bool   // flags hold "fail" (not "fail?")
	MasterID string // the master a replica follows; "" for a master
	Slots    int    // how many slots a master serves
}

// Nodes is the cluster as the node at addr sees it.
func (c *ReplicatedCluster) Nodes(ctx context.Context, addr string) ([]ClusterNode, error) {
	node := goredis.NewClient(&goredis.Options{Addr: addr, ContextTimeoutEnabled: true, DialerRetries: 1, MaxRetries: -1})
	defer node.Close()
	text, err := node.ClusterNodes(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("cluster nodes on %s: %w", addr, err)
	}
	return parseClusterNodes(text)
}

// parseClusterNodes reads CLUSTER NODES output:
// <id> <ip:port@cport[,host]> <flags> <master|-> <ping> <pong> <epoch> <link> [slot…].
func parseClusterNodes(text string) ([]ClusterNode, error) {
	var out []ClusterNode
	for _, line := range strings.Split(strings.TrimSpace(text), "\n") {
		f := strings.Fields(line)
		if len(f) < 8 {
			return nil, fmt.Errorf("cluster nodes: short line %q", line)
		}
		addr, _, _ := strings.Cut(f[1], "@")
		n := ClusterNode{ID: f[0], Addr: addr}
		for _, flag := range strings.Split(f[2], ",") {
			switch flag {
			case "master":
				n.Master = true
			case "fail":
				n.Failed = true
			}
		}
		if f[3] != "-" {
			n.MasterID = f[3]
		}
		for _, r := range f[8:] {
			if strings.HasPrefix(r, "[") { // a slot being migrated
				continue
			}
			lo, hi, ok := strings.Cut(r, "-")
			if !ok {
				hi = lo
			}
			a, err1 := strconv.Atoi(lo)
			b, err2 := strconv.Atoi(hi)
			if err1 != nil || err2 != nil || b < a {
				return nil, fmt.Errorf("cluster nodes: bad slot range %q in %q", r, line)
			}
			n.Slots += b - a + 1
		}
		out = append(out, n)
	}
	return out, nil
}

// Masters are the addresses of the masters serving slots, as a live node
// sees them, sorted by address.
func (c *ReplicatedCluster) Masters(ctx context.Context) ([]string, error) {
	nodes, err := c.Nodes(ctx, c.liveAddr(""))
	if err != nil {
		return nil, err
	}
	var out []string
	for _, n := range nodes {
		if n.Master && !n.Failed && n.Slots > 0 {
			out = append(out, n.Addr)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("cluster has no master serving slots")
	}
	slices.Sort(out)
	return out, nil
}

// KillMaster kills the master at addr with SIGKILL, as a crash would. It
// waits until its replica has taken over its slots and every live node
// reports cluster_state:ok. Then it has Client reload the slot map.
// Otherwise go-redis keeps sending a dead master's slots to it until a
// MOVED reply or its periodic reload. KillMaster returns the promoted
// replica's address. Writes the master acknowledged but had not yet sent
// to its replica are lost. Replication is asynchronous, so production
// loses them too.
func (c *ReplicatedCluster) KillMaster(ctx context.Context, addr string) (string, error) {
	replica, err := c.replicaOf(ctx, addr)
	if err != nil {
		return "", err
	}
	c.mu.Lock()
	var victim *replicatedNode
	for _, n := range c.nodes {
		if n.addr == addr {
			victim = n
		}
	}
	var p *launch.Proc
	if victim != nil {
		p, victim.proc = victim.proc, nil
	}
	c.mu.Unlock()
	if p == nil {
		return "", fmt.Errorf("kill master: no running node at %s", addr)
	}
	p.Kill()
	if err := c.waitPromoted(ctx, replica); err != nil {
		return "", fmt.Errorf("kill master %s: %w", addr, err)
	}
	c.client.ReloadState(ctx)
	return replica, nil
}

// Failover runs CLUSTER FAILOVER on the replica of the master at addr. The
// master stops taking writes. The replica catches up and takes over its
// slots, so nothing is lost. Failover waits as KillMaster does and returns
// the promoted replica's address. The old master becomes its replica.
func (c *ReplicatedCluster) Failover(ctx context.Context, addr string) (string, error) {
	replica, err := c.replicaOf(ctx, addr)
	if err != nil {
		return "", err
	}
	node := goredis.NewClient(&goredis.Options{Addr: replica, ContextTimeoutEnabled: true})
	defer node.Close()
	if err := node.ClusterFailover(ctx).Err(); err != nil {
		return "", fmt.Errorf("cluster failover on %s: %w", replica, err)
	}
	if err := c.waitPromoted(ctx, replica); err != nil {
		return "", fmt.Errorf("failover of %s: %w", addr, err)
	}
	c.client.ReloadState(ctx)
	return replica, nil
}

// replicaOf is the address of the replica following the master at addr.
func (c *ReplicatedCluster) replicaOf(ctx context.Context, addr string) (string, error) {
	nodes, err := c.Nodes(ctx, c.liveAddr(addr))
	if err != nil {
		return "", err
	}
	var id string
	for _, n := range nodes {
		if n.Addr == addr && n.Master {
			id = n.ID
		}
	}
	if id == "" {
		return "", fmt.Errorf("%s is not a master", addr)
	}
	for _, n := range nodes {
		if n.MasterID == id && !n.Failed {
			return n.Addr, nil
		}
	}
	return "", fmt.Errorf("master %s has no live replica", addr)
}

// waitPromoted polls until every live node sees the node at replica as a
// master serving slots and reports cluster_state:ok.
func (c *ReplicatedCluster) waitPromoted(ctx context.Context, replica string) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		why := c.promoted(ctx, replica)
		if why == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not promoted: %w (last: %s)", replica, ctx.Err(), why)
		case <-tick.C:
		}
	}
}

// promoted says why the live nodes do not yet agree that replica is a
// master and the cluster ok. It returns "" when they do.
func (c *ReplicatedCluster) promoted(ctx context.Context, replica string) string {
	for _, addr := range c.liveAddrs() {
		nodes, err := c.Nodes(ctx, addr)
		if err != nil {
			return err.Error()
		}
		if i := slices.IndexFunc(nodes, func(n ClusterNode) bool { return n.Addr == replica }); i < 0 || !nodes[i].Master || nodes[i].Slots == 0 {
			return addr + " does not see " + replica + " as a master with slots"
		}
		node := goredis.NewClient(&goredis.Options{Addr: addr, ContextTimeoutEnabled: true})
		info, err := node.ClusterInfo(ctx).Result()
		_ = node.Close()
		if err != nil {
			return fmt.Sprintf("%s: %v", addr, err)
		}
		if !strings.Contains(info, "cluster_state:ok") {
			return addr + " reports the cluster not ok"
		}
	}
	return ""
}

// waitReplicasInSync polls until every replica reports its link to its
// master up. Then a failover can proceed, and writes reach both copies.
func (c *ReplicatedCluster) waitReplicasInSync(ctx context.Context) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		nodes, err := c.Nodes(ctx, c.liveAddr(""))
		pending := ""
		if err != nil {
			pending = err.Error()
		} else {
			replicas := 0
			for _, n := range nodes {
				if n.Master {
					continue
				}
				replicas++
				if !linkUp(ctx, n.Addr) {
					pending = n.Addr + " not in sync"
					break
				}
			}
			if pending == "" && replicas != clusterMasters {
				pending = fmt.Sprintf("%d replicas, want %d", replicas, clusterMasters)
			}
		}
		if pending == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %s", ctx.Err(), pending)
		case <-tick.C:
		}
	}
}

func linkUp(ctx context.Context, addr string) bool {
	node := goredis.NewClient(&goredis.Options{Addr: addr, ContextTimeoutEnabled: true})
	defer node.Close()
	info, err := node.Info(ctx, "replication").Result()
	return err == nil && strings.Contains(info, "master_link_status:up")
}

// liveAddr is the address of a running node other than except.
func (c *ReplicatedCluster) liveAddr(except string) string {
	for _, a := range c.liveAddrs() {
		if a != except {
			return a
		}
	}
	return ""
}

func (c *ReplicatedCluster) liveAddrs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, n := range c.nodes {
		if n.proc != nil {
			out = append(out, n.addr)
		}
	}
	return out
}

func (c *ReplicatedCluster) logs() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	for i, n := range c.nodes {
		if n.proc != nil {
			fmt.Fprintf(&b, "--- node %d (%s)\n%s", i, n.addr, n.proc.Output())
		}
	}
	return b.String()
}
