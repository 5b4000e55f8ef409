package launch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/tetherproxy/tether/internal/syncbuf"
)

// EnvoyOptions describe an Envoy process.
type EnvoyOptions struct {
	Bin string // the envoy binary
	// Dir receives the bootstrap file (envoy.yaml) and the file Envoy
	// writes its admin address to (admin.addr).
	Dir string
	// Bootstrap is the bootstrap configuration as YAML. Its admin and
	// listener addresses should take port 0. StartEnvoy learns the admin
	// address from --admin-address-path. WaitServing learns the listener's
	// from the admin API.
	Bootstrap   []byte
	Concurrency int             // worker threads; 0 means 1
	LogLevel    string          // Envoy's --log-level; "" means warn
	Log         *syncbuf.Buffer // where the output goes; nil means a buffer of its own
}

// Envoy is a running Envoy.
type Envoy struct {
	*Proc
	Admin    string // the admin API, http://host:port
	Listener string // the one listener's host:port, once WaitServing returned
}

// URL is the listener as http://host:port (after WaitServing).
func (e *Envoy) URL() string { return "http://" + e.Listener }

// adminClient calls Envoy's admin API. A hung call fails one poll, not the
// wait.
var adminClient = &http.Client{Timeout: 2 * time.Second}

// StartEnvoy writes o.Bootstrap to o.Dir and starts Envoy on it, with hot
// restart off. It waits, bounded by ctx, until Envoy has written its admin
// address. The admin API there must prove it is this Envoy: its
// /server_info names the bootstrap file of o.Dir. Use WaitServing to wait
// for the listener.
func StartEnvoy(ctx context.Context, o EnvoyOptions) (*Envoy, error) {
	if o.Bin == "" || o.Dir == "" {
		return nil, errors.New("start envoy: EnvoyOptions needs Bin and Dir")
	}
	if o.Concurrency == 0 {
		o.Concurrency = 1
	}
	if o.LogLevel == "" {
		o.LogLevel = "warn"
	}
	cfgPath, adminPath := filepath.Join(o.Dir, "envoy.yaml"), filepath.Join(o.Dir, "admin.addr")
	_ = os.Remove(adminPath) // a restart must not read its predecessor's
	if err := os.WriteFile(cfgPath, o.Bootstrap, 0o600); err != nil {
		return nil, fmt.Errorf("start envoy: %w", err)
	}
	var admin string
	p, err := StartProven(ctx, "envoy", exec.Command(o.Bin, "-c", cfgPath, "--admin-address-path", adminPath,
		"--disable-hot-restart", "--concurrency", strconv.Itoa(o.Concurrency), "--log-level", o.LogLevel), o.Log,
		"its admin API", func(ctx context.Context, _ *Proc) error {
			b, err := os.ReadFile(adminPath)
			if err != nil {
				return err
			}
			if len(b) == 0 {
				return errors.New("admin address file is empty")
			}
			admin = "http://" + strings.TrimSpace(string(b))
			return proveEnvoy(ctx, admin, cfgPath)
		})
	if err != nil {
		return nil, err
	}
	return &Envoy{Proc: p, Admin: admin}, nil
}

// proveEnvoy checks that the Envoy whose admin API is at admin runs on the
// bootstrap file cfgPath. Another file means another Envoy holds the
// admin address.
func proveEnvoy(ctx context.Context, admin, cfgPath string) error {
	body, err := getAdmin(ctx, admin, "/server_info")
	if err != nil {
		return err
	}
	var info struct {
		Options struct {
			ConfigPath string `json:"config_path"`
		} `json:"command_line_options"`
	}
	if err := json.Unmarshal(body, &info); err != nil {
		return fmt.Errorf("GET /server_info: %w", err)
	}
	if info.Options.ConfigPath != cfgPath {
		return fmt.Errorf("the admin API at %s is an Envoy on %q, not on %q: %w", admin, info.Options.ConfigPath, cfgPath, ErrPortTaken)
	}
	return nil
}

// WaitServing waits, bounded by ctx, until Envoy's admin API says ready
// and its one listener is bound. Ready means its initial configuration is
// in. WaitServing records the listener's address. That address is the one
// this Envoy bound, since its own admin API reports it. StartEnvoy proved
// that API is this Envoy's.
func (e *Envoy) WaitServing(ctx context.Context) error {
	return e.Poll(ctx, "its listener", func(ctx context.Context) error {
		if _, err := getAdmin(ctx, e.Admin, "/ready"); err != nil {
			return err
		}
		var ls struct {
			ListenerStatuses []struct {
				LocalAddress struct {
					SocketAddress struct {
						Address   string `json:"address"`
						PortValue int    `json:"port_value"`
					} `json:"socket_address"`
				} `json:"local_address"`
			} `json:"listener_statuses"`
		}
		body, err := getAdmin(ctx, e.Admin, "/listeners?format=json")
		if err != nil {
			return err
		}
		if err := json.Unmarshal(body, &ls); err != nil {
			return fmt.Errorf("GET /listeners: %w", err)
		}
		if n := len(ls.ListenerStatuses); n != 1 {
			return fmt.Errorf("%d listeners, want 1", n)
		}
		sa := ls.ListenerStatuses[0].LocalAddress.SocketAddress
		if sa.PortValue == 0 {
			return errors.New("the listener is not bound yet")
		}
		e.Listener = net.JoinHostPort(sa.Address, strconv.Itoa(sa.PortValue))
		return nil
	})
}

// getAdmin calls the admin API at admin, http://host:port, on path. It
// returns the body of its 200 answer.
func getAdmin(ctx context.Context, admin, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, admin+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := adminClient.Do(req)
	if err != nil {
		return nil, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	switch {
	case err != nil:
		return nil, fmt.Errorf("GET %s: %w", path, err)
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	return body, nil
}
