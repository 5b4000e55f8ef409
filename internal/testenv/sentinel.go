package testenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/launch"
)

// SentinelMaster is the name the sentinel of RedisSentinel monitors.
const SentinelMaster = "mymaster"

// Sentinel is one Redis master watched by one sentinel, both on loopback
// TCP ports and private to one test. RedisSentinel's has no replica. It
// tests finding the master through Sentinel, not failover.
// RedisSentinelWithReplica's has one, which Failover promotes.
type Sentinel struct {
	sentinel string
	password string

	mu              sync.Mutex
	master, replica string // replica is "" without one
}

// RedisSentinel starts a master and a sentinel monitoring it as
// SentinelMaster. The master has requirepass password, unless password is
// empty. Both run redis-server: $REDIS_SERVER_BIN, else taken from PATH.
// The sentinel runs it with --sentinel, as Debian's redis-sentinel does.
// RedisSentinel waits until the sentinel names the master. It stops both
// when the test ends. It skips or fails the test (see Require) when
// redis-server is missing.
//
// A sentinel reaches its master over TCP. So both take random ports as
// RedisCluster's nodes do, each proving it is the one started.
func RedisSentinel(t testing.TB, password string) *Sentinel {
	t.Helper()
	return startSentinel(t, password, false)
}

// RedisSentinelWithReplica is RedisSentinel with a replica of the master
// too, with masterauth password. It also waits until the replica is in
// sync and the sentinel knows it as one it could promote. So Failover can
// run at once.
//
// The sentinel's down-after-milliseconds is one second. It reads its
// instances' INFO every 200 ms (SENTINEL DEBUG info-period). So a failover
// takes about a second. Its hello period is Redis's default, two seconds.
// After a failover the sentinel reconfigures the old master as a replica
// of the new one about eight seconds later, as it would in production
// (WaitDemoted).
func RedisSentinelWithReplica(t testing.TB, password string) *Sentinel {
	t.Helper()
	return startSentinel(t, password, true)
}

func startSentinel(t testing.TB, password string, withReplica bool) *Sentinel {
	t.Helper()
	server := redisBin(t, "redis-server", "REDIS_SERVER_BIN")
	dir, err := os.MkdirTemp("", "trs")
	if err != nil {
		t.Fatalf("redis sentinel: %v", err)
	}
	var procs []*launch.Proc
	t.Cleanup(func() {
		// The sentinel first, so it does not see its master go down.
		for i := len(procs) - 1; i >= 0; i-- {
			procs[i].Stop(stopTimeout)
		}
		_ = os.RemoveAll(dir)
	})
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()

	s := &Sentinel{password: password}
	mp, master, err := startOnFreePort(ctx, server, drawClusterPort, goredis.Options{Password: password}, sentinelNode(dir, "master", password, ""))
	if err != nil {
		t.Fatalf("redis sentinel: master: %v", err)
	}
	procs = append(procs, mp)
	s.master = master
	var rp *launch.Proc
	if withReplica {
		rp, s.replica, err = startOnFreePort(ctx, server, drawClusterPort, goredis.Options{Password: password}, sentinelNode(dir, "replica", password, master))
		if err != nil {
			t.Fatalf("redis sentinel: replica: %v", err)
		}
		procs = append(procs, rp)
	}
	_, mport, _ := net.SplitHostPort(master)
	sp, sentinel, err := startOnFreePort(ctx, server, drawClusterPort, goredis.Options{}, sentinelConf(dir, password, mport, withReplica))
	if err != nil {
		t.Fatalf("redis sentinel: sentinel: %v", err)
	}
	procs = append(procs, sp)
	s.sentinel = sentinel

	output := func() string {
		out := "--- sentinel\n" + sp.Output() + "--- master\n" + mp.Output()
		if rp != nil {
			out += "--- replica\n" + rp.Output()
		}
		return out
	}
	if err := waitSentinel(ctx, sentinel, master); err != nil {
		t.Fatalf("redis sentinel: %v\n%s", err, output())
	}
	if withReplica {
		// A plain client: SentinelClient has no Do.
		c := goredis.NewClient(&goredis.Options{Addr: sentinel, ContextTimeoutEnabled: true})
		err := c.Do(ctx, "SENTINEL", "DEBUG", "info-period", 200).Err()
		_ = c.Close()
		if err != nil {
			t.Fatalf("redis sentinel: SENTINEL DEBUG (Redis 7.0 or later): %v", err)
		}
		if err := s.waitReplica(ctx, s.replica, master); err != nil {
			t.Fatalf("redis sentinel: %v\n%s", err, output())
		}
	}
	return s
}

// sentinelNode is the args of a node in dir/name: the master when
// replicaOf is "", else a replica of that address.
func sentinelNode(dir, name, password, replicaOf string) func(port int) ([]string, error) {
	return func(port int) ([]string, error) {
		ndir := filepath.Join(dir, name)
		args := []string{
			"--port", strconv.Itoa(port),
			"--bind", "127.0.0.1",
			"--dir", ndir,
			"--save", "",
			"--appendonly", "no",
			"--daemonize", "no",
			"--logfile", "",
			// A replica's first sync, after Failover too, starts at once.
			"--repl-diskless-sync-delay", "0",
		}
		if password != "" {
			// masterauth too. After a failover the old master replicates
			// from the new one.
			args = append(args, "--requirepass", password, "--masterauth", password)
		}
		if replicaOf != "" {
			host, port, _ := net.SplitHostPort(replicaOf)
			args = append(args, "--replicaof", host, port)
		}
		return args, os.MkdirAll(ndir, 0o700)
	}
}

// sentinelConf writes the sentinel's config file and returns its args. The
// sentinel must be able to rewrite the file. A sentinel with a replica to
// promote calls its master down after one second.
func sentinelConf(dir, password, masterPort string, withReplica bool) func(port int) ([]string, error) {
	return func(port int) ([]string, error) {
		conf := filepath.Join(dir, "sentinel.conf")
		down := 5000
		if withReplica {
			down = 1000
		}
		text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nlogfile \"\"\n"+
			"sentinel monitor %s 127.0.0.1 %s 1\n"+
			"sentinel down-after-milliseconds %s %d\n",
			port, dir, SentinelMaster, masterPort, SentinelMaster, down)
		if withReplica {
			text += fmt.Sprintf("sentinel failover-timeout %s 10000\n", SentinelMaster)
		}
		if password != "" {
			text += fmt.Sprintf("sentinel auth-pass %s %s\n", SentinelMaster, password)
		}
		return []string{conf, "--sentinel"}, os.WriteFile(conf, []byte(text), 0o600)
	}
}

// Addr is the sentinel's host:port.
func (s *Sentinel) Addr() string { return s.sentinel }

// MasterAddr is the master's host:port. After Failover it is the
// replica's.
func (s *Sentinel) MasterAddr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.master
}

// ReplicaAddr is the replica's host:port. After Failover it is the old
// master's. It is "" from RedisSentinel, which has no replica.
func (s *Sentinel) ReplicaAddr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.replica
}

// URL is the store URL that finds the master through the sentinel:
// redis+sentinel://host:port?master_name=mymaster[&password=…].
func (s *Sentinel) URL() string {
	q := url.Values{"master_name": {SentinelMaster}}
	if s.password != "" {
		q.Set("password", s.password)
	}
	return "redis+sentinel://" + s.sentinel + "?" + q.Encode()
}

// Failover has the sentinel promote the replica with SENTINEL FAILOVER, as
// for maintenance. The master is left running. Failover first waits, with
// WAIT, until the replica has every write the master took, so nothing is
// lost. Then it waits until the sentinel names the replica as the master.
//
// The old master is still a master when Failover returns. The sentinel
// reconfigures it as a replica of the new one seconds later (WaitDemoted).
// MasterAddr and ReplicaAddr swap. Failover returns the new master's
// address.
func (s *Sentinel) Failover(ctx context.Context) (string, error) {
	s.mu.Lock()
	old, next := s.master, s.replica
	s.mu.Unlock()
	if next == "" {
		return "", fmt.Errorf("sentinel failover: no replica (RedisSentinelWithReplica has one)")
	}
	m := s.nodeClient(old)
	err := m.Do(ctx, "WAIT", 1, 5000).Err()
	_ = m.Close()
	if err != nil {
		return "", fmt.Errorf("sentinel failover: WAIT on the master: %w", err)
	}
	c := s.sentinelClient()
	defer c.Close()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	// NOGOODSLAVE: the sentinel has not read the replica's INFO lately
	// enough. It will.
	for {
		err := c.Failover(ctx, SentinelMaster).Err()
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "NOGOODSLAVE") {
			return "", fmt.Errorf("sentinel failover: %w", err)
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("sentinel failover: %w (last: %w)", ctx.Err(), err)
		case <-tick.C:
		}
	}
	if err := waitSentinel(ctx, s.sentinel, next); err != nil {
		return "", fmt.Errorf("sentinel failover: %w", err)
	}
	s.mu.Lock()
	s.master, s.replica = next, old
	s.mu.Unlock()
	return next, nil
}

// WaitDemoted waits until the replica replicates from the master, in
// sync. After Failover the replica is the old master. It also waits until
// the sentinel knows it as a replica it could promote.
func (s *Sentinel) WaitDemoted(ctx context.Context) error {
	s.mu.Lock()
	master, replica := s.master, s.replica
	s.mu.Unlock()
	if replica == "" {
		return fmt.Errorf("sentinel: no replica (RedisSentinelWithReplica has one)")
	}
	return s.waitReplica(ctx, replica, master)
}

// waitReplica polls until the node at replica replicates from master with
// its link up. The sentinel must also list it as a replica of master that
// is not down, with its link to the master up.
func (s *Sentinel) waitReplica(ctx context.Context, replica, master string) error {
	node := s.nodeClient(replica)
	defer node.Close()
	c := s.sentinelClient()
	defer c.Close()
	mhost, mport, _ := net.SplitHostPort(master)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		why := ""
		info, err := node.Info(ctx, "replication").Result()
		switch {
		case err != nil:
			why = err.Error()
		case !strings.Contains(info, "role:slave\r\n") || !strings.Contains(info, "master_host:"+mhost+"\r\n") ||
			!strings.Contains(info, "master_port:"+mport+"\r\n") || !strings.Contains(info, "master_link_status:up\r\n"):
			why = "the node's INFO replication:\n" + info
		default:
			why = "the sentinel does not list it as a replica in sync"
			replicas, err := c.Replicas(ctx, SentinelMaster).Result()
			if err != nil {
				why = err.Error()
			}
			for _, r := range replicas {
				if net.JoinHostPort(r["ip"], r["port"]) == replica && r["flags"] == "slave" &&
					r["master-link-status"] == "ok" && net.JoinHostPort(r["master-host"], r["master-port"]) == master {
					return nil
				}
			}
			if err == nil {
				why = fmt.Sprintf("the sentinel's replicas: %v", replicas)
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not a replica of %s: %w; last: %s", replica, master, ctx.Err(), why)
		case <-tick.C:
		}
	}
}

func (s *Sentinel) sentinelClient() *goredis.SentinelClient {
	return goredis.NewSentinelClient(&goredis.Options{Addr: s.sentinel, ContextTimeoutEnabled: true})
}

func (s *Sentinel) nodeClient(addr string) *goredis.Client {
	return goredis.NewClient(&goredis.Options{Addr: addr, Password: s.password, ContextTimeoutEnabled: true})
}

// waitSentinel polls the sentinel until it names master as the master and
// has reached it. Then its flags no longer say it is down or unconnected.
func waitSentinel(ctx context.Context, sentinel, master string) error {
	c := goredis.NewSentinelClient(&goredis.Options{Addr: sentinel, ContextTimeoutEnabled: true})
	defer c.Close()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var last string
	for {
		addr, err := c.GetMasterAddrByName(ctx, SentinelMaster).Result()
		if err == nil && len(addr) == 2 && net.JoinHostPort(addr[0], addr[1]) == master {
			m, err := c.Master(ctx, SentinelMaster).Result()
			if err == nil && m["flags"] == "master" {
				return nil
			}
			last = fmt.Sprintf("master %v, err %v", m, err)
		} else {
			last = fmt.Sprintf("master address %v, err %v", addr, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("sentinel %s did not report master %s: %w; last: %s", sentinel, master, ctx.Err(), last)
		case <-tick.C:
		}
	}
}
