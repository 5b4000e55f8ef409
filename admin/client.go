package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// ClientTimeout bounds one call. A migrate batch of MaxMigrateBatch
// sessions takes well under it.
const ClientTimeout = time.Minute

// maxAnswer bounds an answer's body.
const maxAnswer = 16 << 20

// Client calls a tether's admin API.
type Client struct {
	base  string
	hc    *http.Client
	token string // bearer token, "" none
}

// NewClient returns a client of the admin API at base. base is a URL such
// as http://host:port or https://host:port/prefix, or host:port for http.
// token, when set, is sent as the bearer token the API may require.
func NewClient(base, token string) (*Client, error) {
	raw := base
	if !strings.Contains(raw, "://") {
		raw = "http://" + raw
	}
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("admin API address %q: want http://host:port", base)
	}
	return &Client{base: strings.TrimRight(u.String(), "/"), hc: &http.Client{Timeout: ClientTimeout}, token: token}, nil
}

// Error is a refusal the admin API answered with.
type Error struct {
	Status  int    // the HTTP status
	Message string // the API's message
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s (%d %s)", e.Message, e.Status, http.StatusText(e.Status))
}

// Stats is GET /v1/sessions/stats.
func (c *Client) Stats(ctx context.Context) (SessionStats, error) {
	var st SessionStats
	return st, c.do(ctx, http.MethodGet, "/v1/sessions/stats", nil, &st)
}

// Session is GET /v1/sessions/{key}.
func (c *Client) Session(ctx context.Context, key string) (SessionInfo, error) {
	var s SessionInfo
	return s, c.do(ctx, http.MethodGet, "/v1/sessions/"+url.PathEscape(key), nil, &s)
}

// Lookup is POST /v1/sessions/lookup.
func (c *Client) Lookup(ctx context.Context, lr LookupRequest) (SessionInfo, error) {
	var s SessionInfo
	return s, c.do(ctx, http.MethodPost, "/v1/sessions/lookup", lr, &s)
}

// Migrate is POST /v1/sessions/migrate: one batch.
func (c *Client) Migrate(ctx context.Context, mr MigrateRequest) (MarkResult, error) {
	var res MarkResult
	return res, c.do(ctx, http.MethodPost, "/v1/sessions/migrate", mr, &res)
}

// Drain is POST /v1/sessions/drain.
func (c *Client) Drain(ctx context.Context, instance string) (DrainResult, error) {
	var res DrainResult
	return res, c.do(ctx, http.MethodPost, "/v1/sessions/drain", DrainRequest{Instance: instance}, &res)
}

// Undrain is DELETE /v1/sessions/drain/{instance}.
func (c *Client) Undrain(ctx context.Context, instance string) (DrainResult, error) {
	var res DrainResult
	return res, c.do(ctx, http.MethodDelete, "/v1/sessions/drain/"+url.PathEscape(instance), nil, &res)
}

// do sends in as JSON, when not nil, and decodes the answer into out. An
// answer other than 2xx is an *Error with the server's message.
func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("admin API: %w", err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return fmt.Errorf("admin API: %w", err)
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("admin API: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
	if err != nil {
		return fmt.Errorf("admin API %s %s: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		var e apiError
		if json.Unmarshal(data, &e) != nil || e.Error == "" {
			e.Error = fmt.Sprintf("admin API %s %s", method, path)
		}
		return &Error{Status: resp.StatusCode, Message: e.Error}
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("admin API %s %s: %w", method, path, err)
	}
	return nil
}
