package launch

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/internal/syncbuf"
)

// RedisOptions describe a redis-server on a unix socket.
type RedisOptions struct {
	Bin string // the redis-server binary
	// Dir holds the socket (r.sock) and the append-only file. Keep its path
	// short: a unix socket path is limited to about 100 bytes.
	Dir string
	// Durable keeps an append-only file, fsynced on every write, and loads
	// it at start; otherwise persistence is off and the data set starts
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

// StartRedis starts redis-server on a unix socket in o.Dir and waits,
// bounded by ctx, until it answers PING. A socket left by a killed server
// is removed first, so a restart can reuse the directory.
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
	p, err := Start("redis-server", exec.Command(o.Bin,
		"--port", "0",
		"--unixsocket", sock,
		"--unixsocketperm", "700",
		"--dir", o.Dir,
		"--save", "",
		"--appendonly", aof,
		"--appendfsync", "always",
		"--daemonize", "no",
		"--logfile", "",
	), o.Log)
	if err != nil {
		return nil, err
	}
	if err := WaitRedis(ctx, p, goredis.Options{Network: "unix", Addr: sock}); err != nil {
		p.Kill()
		return nil, err
	}
	return &Redis{Proc: p, Socket: sock}, nil
}

// WaitRedis polls PING on the server that o names (address and
// credentials) until it answers, p exits or ctx ends.
func WaitRedis(ctx context.Context, p *Proc, o goredis.Options) error {
	o.MaxRetries = -1 // the poll is the retry
	o.DialerRetries = 1
	o.DialTimeout = time.Second
	o.ContextTimeoutEnabled = true
	probe := goredis.NewClient(&o)
	defer func() { _ = probe.Close() }()
	return p.Poll(ctx, "PING on "+o.Addr, func(ctx context.Context) error {
		if o.Network == "unix" {
			// No dial before the socket exists: go-redis logs every
			// failed dial.
			if _, err := os.Stat(o.Addr); err != nil {
				return err
			}
		}
		return probe.Ping(ctx).Err()
	})
}
