package testenv

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/launch"
)

const (
	clusterMasters = 3
	// clusterTimeout bounds forming the cluster: the create, then every
	// node reporting cluster_state:ok.
	clusterTimeout = 20 * time.Second
)

// Cluster is a Redis Cluster of three masters, with no replicas, on
// loopback TCP ports. It is private to one test.
type Cluster struct {
	addrs  []string
	client *goredis.ClusterClient
}

// RedisCluster starts three redis-server processes with cluster mode on.
// It joins them with `redis-cli --cluster create` and waits until every
// node reports cluster_state:ok. It stops them when the test ends. It
// skips or fails the test (see Require) when redis-server or redis-cli is
// missing. redis-cli is $REDIS_CLI_BIN, else taken from PATH.
//
// Cluster mode needs TCP ports. redis-server cannot take a listener from
// the test. So each node draws a random port, and draws again if the port
// is taken (startOnFreePort).
func RedisCluster(t testing.TB) *Cluster {
	t.Helper()
	server := redisBin(t, "redis-server", "REDIS_SERVER_BIN")
	cli := redisBin(t, "redis-cli", "REDIS_CLI_BIN")
	dir, err := os.MkdirTemp("", "trc")
	if err != nil {
		t.Fatalf("redis cluster: %v", err)
	}
	c := &Cluster{}
	var nodes []*launch.Proc
	t.Cleanup(func() {
		if c.client != nil {
			_ = c.client.Close()
		}
		for _, p := range nodes {
			p.Stop(stopTimeout)
		}
		_ = os.RemoveAll(dir)
	})
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()

	for i := range clusterMasters {
		ndir := filepath.Join(dir, strconv.Itoa(i))
		if err := os.Mkdir(ndir, 0o700); err != nil {
			t.Fatalf("redis cluster: %v", err)
		}
		p, addr, err := startClusterNode(ctx, server, ndir, 5*time.Second)
		if err != nil {
			t.Fatalf("redis cluster node %d: %v", i, err)
		}
		nodes = append(nodes, p)
		c.addrs = append(c.addrs, addr)
	}

	args := append([]string{"--cluster", "create"}, c.addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	if err := waitClusterOK(ctx, c.addrs); err != nil {
		var logs strings.Builder
		for i, p := range nodes {
			fmt.Fprintf(&logs, "--- node %d (%s)\n%s", i, c.addrs[i], p.Output())
		}
		t.Fatalf("redis cluster did not form: %v\n%s", err, logs.String())
	}
	c.client = goredis.NewClusterClient(&goredis.ClusterOptions{Addrs: c.addrs, ContextTimeoutEnabled: true})
	return c
}

// Addrs are the masters' host:port addresses.
func (c *Cluster) Addrs() []string { return c.addrs }

// Client is a cluster client, closed when the test ends.
func (c *Cluster) Client() *goredis.ClusterClient { return c.client }

// startClusterNode starts one cluster-mode redis-server in dir on a free
// loopback port. It has the given node timeout, and its replicas sync at
// once. startClusterNode waits until it proves it is the one started.
func startClusterNode(ctx context.Context, bin, dir string, nodeTimeout time.Duration) (*launch.Proc, string, error) {
	conf := filepath.Join(dir, "nodes.conf")
	return startOnFreePort(ctx, bin, drawClusterPort, goredis.Options{}, func(port int) ([]string, error) {
		// A failed attempt may have left its node file behind.
		if err := os.Remove(conf); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		return []string{
			"--port", strconv.Itoa(port),
			"--bind", "127.0.0.1",
			"--cluster-enabled", "yes",
			"--cluster-config-file", conf,
			"--cluster-node-timeout", strconv.FormatInt(nodeTimeout.Milliseconds(), 10),
			"--repl-diskless-sync-delay", "0",
			"--dir", dir,
			"--save", "",
			"--appendonly", "no",
			"--daemonize", "no",
			"--logfile", "",
		}, nil
	})
}

// startOnFreePort starts bin with the arguments args returns for a
// loopback port from draw. It waits until the server there proves it is
// the one started: INFO's process_id must be its pid (launch.RedisProof).
// probe gives the credentials. When another process holds the port, the
// server exits or another answers for it. The server is then killed and
// another port drawn.
func startOnFreePort(ctx context.Context, bin string, draw func() (int, error), probe goredis.Options, args func(port int) ([]string, error)) (*launch.Proc, string, error) {
	var addr string
	p, err := onFreePort(draw, func(port int) (*launch.Proc, error) {
		a, err := args(port)
		if err != nil {
			return nil, err
		}
		addr = "127.0.0.1:" + strconv.Itoa(port)
		o := probe
		o.Addr = addr
		return launch.StartProven(ctx, "redis-server", exec.Command(bin, a...), nil, "INFO on "+addr, launch.RedisProof(o))
	})
	if err != nil {
		return nil, "", err
	}
	return p, addr, nil
}

// waitClusterOK polls CLUSTER INFO on every node until each reports the
// cluster ok, with all slots assigned and every master known.
func waitClusterOK(ctx context.Context, addrs []string) error {
	want := []string{
		"cluster_state:ok",
		"cluster_slots_assigned:16384",
		"cluster_known_nodes:" + strconv.Itoa(len(addrs)),
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for _, addr := range addrs {
		node := goredis.NewClient(&goredis.Options{Addr: addr, ContextTimeoutEnabled: true})
		var info string
		for {
			var err error
			info, err = node.ClusterInfo(ctx).Result()
			if err == nil && containsAll(info, want) {
				break
			}
			select {
			case <-ctx.Done():
				_ = node.Close()
				return fmt.Errorf("%s: %w; last CLUSTER INFO: %w %s", addr, ctx.Err(), err, info)
			case <-tick.C:
			}
		}
		_ = node.Close()
	}
	return nil
}

func containsAll(s string, subs []string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}
