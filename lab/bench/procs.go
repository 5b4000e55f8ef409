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
	"os/exec"
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

// The processes of a stack: redis-server, tether, the ext_proc floor and
// Envoy, started and stopped through internal/launch.

// stopTimeout bounds each process's stop, SIGTERM to exit.
const stopTimeout = 10 * time.Second

// stack is tether (+ redis-server) and an Envoy configured by it.
type stack struct {
	redis  *launch.Redis
	rdb    *goredis.Client // a client of redis; nil without it
	tether *launch.Tether
	envoy  *launch.Envoy
	floor  *floorProc // nil unless the policy calls the ext_proc floor
}

// floorProc is a running `tether-lab bench floor` and the routes it was
// given.
type floorProc struct {
	*launch.Proc
	FloorReady
	routes FloorRoutes
}

// FloorReadyMessage is the message of the JSON line `tether-lab bench
// floor` logs on standard error once it listens, with FloorReady's
// fields.
const FloorReadyMessage = "ext_proc floor ready"

// startFloor runs `bin bench floor` (bin is tether-lab) for routes, on
// loopback, and returns once it listens.
func startFloor(ctx context.Context, bin string, routes FloorRoutes) (*floorProc, error) {
	if bin == "" {
		return nil, errors.New("ext_proc floor: Options needs LabBin, the tether-lab binary")
	}
	args := []string{"bench", "floor", "--session-header", routes.SessionHeader, "--cluster-header", routes.ClusterHeader}
	for _, c := range routes.Clusters {
		args = append(args, "--cluster", c)
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	f := &floorProc{routes: routes}
	var err error
	if f.Proc, err = launch.StartReady(ctx, "ext_proc floor", exec.Command(bin, args...), nil, FloorReadyMessage, &f.FloorReady); err != nil {
		return nil, err
	}
	return f, nil
}

// requests is how many request headers the floor has answered.
func (f *floorProc) requests(ctx context.Context) (int64, error) {
	var c FloorCount
	if err := getJSON(ctx, "http://"+f.Admin+"/requests", &c); err != nil {
		return 0, fmt.Errorf("ext_proc floor: %w", err)
	}
	return c.Requests, nil
}

func startStack(ctx context.Context, opts Options, dir string, p policy, instances []config.Instance) (*stack, error) {
	cfg := baseConfig(opts.Scale, instances)
	p.edit(&cfg)
	s := &stack{}
	var err error
	if p.floor {
		routes := FloorRoutes{SessionHeader: cfg.Identity.SessionHeader, ClusterHeader: cfg.Routing.ClusterHeader}
		for _, in := range cfg.Instances {
			routes.Clusters = append(routes.Clusters, fleet.Instance{Name: in.Name}.Cluster())
		}
		if s.floor, err = startFloor(ctx, opts.LabBin, routes); err != nil {
			return nil, err
		}
		cfg.Envoy.ExtProcEndpoints = []string{s.floor.Extproc}
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
// Redis is 0 without redis-server, Floor without the ext_proc floor.
type procCPU struct{ Envoy, Tether, Redis, Floor float64 }

func (c procCPU) sub(d procCPU) procCPU {
	return procCPU{Envoy: c.Envoy - d.Envoy, Tether: c.Tether - d.Tether, Redis: c.Redis - d.Redis, Floor: c.Floor - d.Floor}
}

// cpu reads the CPU time Envoy, tether, redis-server and the ext_proc
// floor (when there are) have used.
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
	if s.floor != nil {
		if c.Floor, err = cpuSeconds(s.floor.Pid()); err != nil {
			return c, fmt.Errorf("ext_proc floor cpu: %w", err)
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
		s.floor.Stop(stopTimeout)
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
