package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/BurntSushi/toml"
	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/internal/launch"
	"github.com/tetherproxy/tether/xds"
)

// The processes of a stack: redis-server, tether and Envoy, started and
// stopped through internal/launch.

// stopTimeout bounds each process's stop, SIGTERM to exit.
const stopTimeout = 10 * time.Second

// stack is tether (+ redis-server) and an Envoy configured by it.
type stack struct {
	redis  *launch.Redis
	rdb    *goredis.Client // a client of redis; nil without it
	tether *launch.Tether
	envoy  *launch.Envoy
	floor  *floorServer // nil unless the policy calls the ext_proc floor
}

func startStack(ctx context.Context, opts Options, dir string, p policy, instances []config.Instance) (*stack, error) {
	cfg := baseConfig(opts.Scale, instances)
	p.edit(&cfg)
	s := &stack{}
	var err error
	if p.floor {
		routes := floorRoutes{SessionHeader: cfg.Identity.SessionHeader, ClusterHeader: cfg.Routing.ClusterHeader}
		for _, in := range cfg.Instances {
			routes.Clusters = append(routes.Clusters, fleet.Instance{Name: in.Name}.Cluster())
		}
		if s.floor, err = startFloor(routes); err != nil {
			return nil, err
		}
		cfg.Envoy.ExtProcEndpoints = []string{s.floor.addr}
	}
	if p.store {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		s.redis, err = launch.StartRedis(rctx, launch.RedisOptions{Bin: opts.RedisBin, Dir: dir})
		cancel()
		if err != nil {
			s.close()
			return nil, err
		}
		s.rdb = goredis.NewClient(&goredis.Options{Network: "unix", Addr: s.redis.Socket})
		cfg.Redis.URL = s.redis.URL()
	}
	var args []string
	if opts.CPUProfiles != "" {
		args = []string{"--cpuprofile", profilePath(opts.CPUProfiles, p.name)}
	}
	if s.tether, err = startTether(ctx, opts.TetherBin, dir, secret, cfg, args); err != nil {
		s.close()
		return nil, err
	}
	if s.envoy, err = startEnvoy(ctx, opts.EnvoyBin, dir, s.tether.XDS); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// procCPU is the CPU time, in seconds, each process of a stack has used;
// Redis is 0 without redis-server.
type procCPU struct{ Envoy, Tether, Redis float64 }

func (c procCPU) sub(d procCPU) procCPU {
	return procCPU{Envoy: c.Envoy - d.Envoy, Tether: c.Tether - d.Tether, Redis: c.Redis - d.Redis}
}

// cpu reads the CPU time Envoy, tether and redis-server (when there is
// one) have used.
func (s *stack) cpu() (procCPU, error) {
	var c procCPU
	var err error
	if c.Envoy, err = cpuSeconds(s.envoy.Pid()); err != nil {
		return c, fmt.Errorf("envoy cpu: %w", err)
	}
	if c.Tether, err = cpuSeconds(s.tether.Pid()); err != nil {
		return c, fmt.Errorf("tether cpu: %w", err)
	}
	if s.redis != nil {
		if c.Redis, err = cpuSeconds(s.redis.Pid()); err != nil {
			return c, fmt.Errorf("redis-server cpu: %w", err)
		}
	}
	return c, nil
}

func (s *stack) close() {
	if s.envoy != nil {
		s.envoy.Stop(stopTimeout)
	}
	if s.tether != nil {
		s.tether.Stop(stopTimeout)
	}
	if s.rdb != nil {
		_ = s.rdb.Close()
	}
	if s.redis != nil {
		s.redis.Stop(stopTimeout)
	}
	if s.floor != nil {
		s.floor.stop()
	}
}

// profilePath is a file in dir for the CPU profile of configuration name
// ("tether sticky" → tether-sticky.pprof), one not taken yet.
func profilePath(dir, name string) string {
	slug := strings.ToLower(strings.Join(strings.FieldsFunc(name, func(r rune) bool {
		return !unicode.IsLetter(r) && !unicode.IsDigit(r)
	}), "-"))
	path := filepath.Join(dir, slug+".pprof")
	for n := 2; ; n++ {
		if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
			return path
		}
		path = filepath.Join(dir, fmt.Sprintf("%s-%d.pprof", slug, n))
	}
}

// startTether writes cfg to dir and runs `tether serve` on it with args.
func startTether(ctx context.Context, bin, dir, secret string, cfg config.Config, args []string) (*launch.Tether, error) {
	path := filepath.Join(dir, "tether.toml")
	var b bytes.Buffer
	if err := toml.NewEncoder(&b).Encode(cfg); err != nil {
		return nil, err
	}
	if err := os.WriteFile(path, b.Bytes(), 0o600); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	return launch.StartTether(ctx, launch.TetherOptions{Bin: bin, Config: path, Env: []string{"TETHER_IDENTITY_SECRET=" + secret}, Args: args})
}

// startEnvoy runs Envoy on the ADS bootstrap for tether's xDS server at
// ads, and returns once its listener is bound.
func startEnvoy(ctx context.Context, bin, dir, ads string) (*launch.Envoy, error) {
	b, err := xds.ADSBootstrap("tether-bench", "127.0.0.1:0", ads)
	if err != nil {
		return nil, err
	}
	y, err := xds.YAML(b, "")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	e, err := launch.StartEnvoy(ctx, launch.EnvoyOptions{Bin: bin, Dir: dir, Bootstrap: y, LogLevel: "error"})
	if err != nil {
		return nil, err
	}
	if err := e.WaitServing(ctx); err != nil {
		e.Stop(stopTimeout)
		return nil, err
	}
	return e, nil
}

// cpuSeconds is the user+system CPU time process pid has used.
func cpuSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return parseStatCPU(string(b))
}

// userHZ is the unit of the times in /proc/<pid>/stat: USER_HZ, 100 on
// every Linux architecture Go builds for.
const userHZ = 100

// parseStatCPU is utime+stime, in seconds, from the text of a
// /proc/<pid>/stat (proc(5): fields 14 and 15, counted from the pid).
func parseStatCPU(stat string) (float64, error) {
	// The command name is in parentheses and may hold spaces and
	// parentheses of its own: the fields resume after the last ')'.
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, errors.New("/proc stat: no command name")
	}
	f := strings.Fields(stat[i+1:])
	// f[0] is field 3 (state): utime is field 14, stime 15.
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc stat: %d fields after the command name, want at least 13", len(f))
	}
	var ticks float64
	for _, v := range f[11:13] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc stat: cpu time %q: %w", v, err)
		}
		ticks += float64(n)
	}
	return ticks / userHZ, nil
}

// adminClient talks to admin endpoints (Envoy's, tether's, the
// instances'); a hung one fails the call instead of the run.
var adminClient = &http.Client{Timeout: 5 * time.Second}

func getJSON(ctx context.Context, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := adminClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

func postJSON(ctx context.Context, url string, body any) error {
	var b bytes.Buffer
	if body != nil {
		if err := json.NewEncoder(&b).Encode(body); err != nil {
			return err
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, &b)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := adminClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("POST %s: %s %s", url, resp.Status, msg)
	}
	return nil
}
