package launch

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/syncbuf"
)

// RedisOptions describe a redis-server on a unix socket.
type RedisOptions struct {
	Bin string // the redis-server binary
	// Dir holds the socket, r.sock, and the append-only file. Keep its
	// path short: a unix socket path is limited to about 100 bytes.
	Dir string
	// Durable keeps an append-only file, fsynced on every write, and loads
	// it at start. Otherwise persistence is off and the data set starts
	// empty.
	Durable bool
	Log     *syncbuf.Buffer // where the output goes; nil means a buffer of its own
}

// Redis is a running redis-server.
type Redis struct {
	*Proc
	Socket string // the unix socket it listens on (no TCP port)
}

// URL is the server as a store URL ("unix:///…/r.sock").
func (r *Redis) URL() string { return "unix://" + r.Socket }

// RedisSocket is the socket path of a server StartRedis starts in dir.
func RedisSocket(dir string) string { return filepath.Join(dir, "r.sock") }

// StartRedis starts redis-server on a unix socket in o.Dir. It waits,
// bounded by ctx, until the server on the socket proves it is the one
// started (RedisProof). A socket left by a killed server is removed first,
// so a restart can reuse the directory.
func StartRedis(ctx context.Context, o RedisOptions) (*Redis, error) {
	if o.Bin == "" || o.Dir == "" {
		return nil, errors.New("start redis-server: RedisOptions needs Bin and Dir")
	}
	sock := RedisSocket(o.Dir)
	_ = os.Remove(sock)
	aof := "no"
	if o.Durable {
		aof = "yes"
	}
	p, err := StartProven(ctx, "redis-server", exec.Command(o.Bin,
		"--port", "0",
		"--unixsocket", sock,
		"--unixsocketperm", "700",
		"--dir", o.Dir,
		"--save", "",
		"--appendonly", aof,
		"--appendfsync", "always",
		"--daemonize", "no",
		"--logfile", "",
	), o.Log, "INFO on "+sock, RedisProof(goredis.Options{Network: "unix", Addr: sock}))
	if err != nil {
		return nil, err
	}
	return &Redis{Proc: p, Socket: sock}, nil
}

// RedisProof is the proof of a redis-server, or a sentinel, at the address
// o names with its credentials (see StartProven). The process_id that INFO
// reports must be the process's. Another id means another process holds
// the address.
func RedisProof(o goredis.Options) func(context.Context, *Proc) error {
	o.MaxRetries = -1 // the poll is the retry
	o.DialerRetries = 1
	o.DialTimeout = time.Second
	o.ContextTimeoutEnabled = true
	return func(ctx context.Context, p *Proc) error {
		if o.Network == "unix" {
			// No dial before the socket exists. go-redis logs every failed
			// dial.
			if _, err := os.Stat(o.Addr); err != nil {
				return err
			}
		}
		c := goredis.NewClient(&o)
		defer func() { _ = c.Close() }()
		info, err := c.Info(ctx, "server").Result()
		if err != nil {
			return fmt.Errorf("info server: %w", err)
		}
		pid, err := strconv.Atoi(infoField(info, "process_id"))
		if err != nil {
			return fmt.Errorf("info server: process_id: %w", err)
		}
		if pid != p.Pid() {
			return fmt.Errorf("%s answers as process %d, not %s's %d: %w", o.Addr, pid, p.Name(), p.Pid(), ErrPortTaken)
		}
		return nil
	}
}

// infoField is the value of key in INFO's "key:value" lines, or "" if
// none.
func infoField(info, key string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimRight(line, "\r"), key+":"); ok {
			return v
		}
	}
	return ""
}
