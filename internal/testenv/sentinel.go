package testenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/launch"
)

// SentinelMaster is the name the sentinel of RedisSentinel monitors.
const SentinelMaster = "mymaster"

// Sentinel is one Redis master watched by one sentinel, both on loopback
// TCP ports and private to one test. There is no replica: it tests finding
// the master through Sentinel, not failover.
type Sentinel struct {
	master, sentinel string
	password         string
}

// RedisSentinel starts a master (with requirepass password, unless
// password is empty) and a sentinel monitoring it as SentinelMaster, both
// with redis-server ($REDIS_SERVER_BIN, else from PATH; the sentinel runs
// it with --sentinel, as Debian's redis-sentinel does), waits until the
// sentinel names the master and stops both when the test ends. It skips or
// fails the test (see Require) when redis-server is missing.
//
// A sentinel reaches its master over TCP, so both take random ports as
// RedisCluster's nodes do.
func RedisSentinel(t testing.TB, password string) *Sentinel {
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
	mp, master, err := startOnFreePort(ctx, server, goredis.Options{Password: password}, func(port int) ([]string, error) {
		args := []string{
			"--port", strconv.Itoa(port),
			"--bind", "127.0.0.1",
			"--dir", dir,
			"--save", "",
			"--appendonly", "no",
			"--daemonize", "no",
			"--logfile", "",
		}
		if password != "" {
			args = append(args, "--requirepass", password)
		}
		return args, nil
	})
	if err != nil {
		t.Fatalf("redis sentinel: master: %v", err)
	}
	procs = append(procs, mp)
	s.master = master
	_, mport, _ := net.SplitHostPort(master)

	// A sentinel needs a config file it can rewrite.
	conf := filepath.Join(dir, "sentinel.conf")
	sp, sentinel, err := startOnFreePort(ctx, server, goredis.Options{}, func(port int) ([]string, error) {
		text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nlogfile \"\"\n"+
			"sentinel monitor %s 127.0.0.1 %s 1\n"+
			"sentinel down-after-milliseconds %s 5000\n",
			port, dir, SentinelMaster, mport, SentinelMaster)
		if password != "" {
			text += fmt.Sprintf("sentinel auth-pass %s %s\n", SentinelMaster, password)
		}
		return []string{conf, "--sentinel"}, os.WriteFile(conf, []byte(text), 0o600)
	})
	if err != nil {
		t.Fatalf("redis sentinel: sentinel: %v", err)
	}
	procs = append(procs, sp)
	s.sentinel = sentinel

	if err := waitSentinel(ctx, sentinel, master); err != nil {
		t.Fatalf("redis sentinel: %v\n--- sentinel\n%s--- master\n%s", err, sp.Output(), mp.Output())
	}
	return s
}

// Addr is the sentinel's host:port.
func (s *Sentinel) Addr() string { return s.sentinel }

// MasterAddr is the master's host:port.
func (s *Sentinel) MasterAddr() string { return s.master }

// URL is the store URL that finds the master through the sentinel:
// redis+sentinel://host:port?master_name=mymaster[&password=…].
func (s *Sentinel) URL() string {
	q := url.Values{"master_name": {SentinelMaster}}
	if s.password != "" {
		q.Set("password", s.password)
	}
	return "redis+sentinel://" + s.sentinel + "?" + q.Encode()
}

// waitSentinel polls the sentinel until it names master as the master and
// has reached it (its flags no longer say it is down or unconnected).
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
