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
	// listener addresses should take port 0: StartEnvoy learns the admin
	// address from --admin-address-path and WaitServing the listener's from
	// the admin API.
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

// adminClient calls Envoy's admin API; a hung call fails one poll, not the
// wait.
var adminClient = &http.Client{Timeout: 2 * time.Second}

// StartEnvoy writes o.Bootstrap to o.Dir, starts Envoy on it (hot restart
// off) and waits, bounded by ctx, until Envoy has written its admin
// address. Use WaitServing to wait for the listener.
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
	p, err := Start("envoy", exec.Command(o.Bin, "-c", cfgPath, "--admin-address-path", adminPath,
		"--disable-hot-restart", "--concurrency", strconv.Itoa(o.Concurrency), "--log-level", o.LogLevel), o.Log)
	if err != nil {
		return nil, err
	}
	e := &Envoy{Proc: p}
	err = p.Poll(ctx, "its admin address", func(context.Context) error {
		b, err := os.ReadFile(adminPath)
		if err != nil {
			return err
		}
		if len(b) == 0 {
			return errors.New("admin address file is empty")
		}
		e.Admin = "http://" + strings.TrimSpace(string(b))
		return nil
	})
	if err != nil {
		p.Kill()
		return nil, err
	}
	return e, nil
}

// WaitServing waits, bounded by ctx, until Envoy's admin API says ready
// (its initial configuration is in) and its one listener is bound, and
// records the listener's address.
func (e *Envoy) WaitServing(ctx context.Context) error {
	return e.Poll(ctx, "its listener", func(ctx context.Context) error {
		if _, err := e.get(ctx, "/ready"); err != nil {
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
		body, err := e.get(ctx, "/listeners?format=json")
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

// get calls the admin API at path and returns the body of its 200 answer.
func (e *Envoy) get(ctx context.Context, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.Admin+path, nil)
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
