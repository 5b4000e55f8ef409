package redis

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/alicebob/miniredis/v2"
	goredis "github.com/redis/go-redis/v9"
)

// Embedded is the Open URL of an in-process miniredis: the local stack and
// demos run without a Redis server. Bindings live only as long as the
// process and are not shared with other replicas.
const Embedded = "embedded"

const wantURL = "want embedded, redis://host:port/db, rediss://host:port/db or unix:///path/to/sock"

// Open connects to the Redis named by rawURL and returns a store that owns
// the connection. See Embedded; other URLs are those of go-redis ParseURL.
// Errors name the problem and show the URL with its password hidden.
func Open(ctx context.Context, rawURL string, opts Options) (*Store, error) {
	if rawURL == Embedded {
		return openEmbedded(ctx, opts)
	}
	ropts, err := parseURL(rawURL)
	if err != nil {
		return nil, err
	}
	// Without this go-redis ignores context deadlines, and Options.Timeout
	// would not bound the network wait.
	ropts.ContextTimeoutEnabled = true
	client, err := newClient(ropts)
	if err != nil {
		return nil, fmt.Errorf("redis open %q: %w", redact(rawURL), err)
	}
	s, err := newStore(ctx, client, opts)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("redis open %q: %w", redact(rawURL), safeErr(err, rawURL))
	}
	s.ownClient = true
	return s, nil
}

func openEmbedded(ctx context.Context, opts Options) (*Store, error) {
	e, err := startEmbedded()
	if err != nil {
		return nil, fmt.Errorf("redis open embedded: %w", err)
	}
	client := goredis.NewClient(&goredis.Options{Addr: e.m.Addr(), ContextTimeoutEnabled: true})
	s, err := newStore(ctx, client, opts)
	if err != nil {
		_ = client.Close()
		e.Close()
		return nil, fmt.Errorf("redis open embedded: %w", err)
	}
	s.ownClient = true
	s.embedded = e
	return s, nil
}

// embeddedTick is how often the embedded server's TTLs advance: a binding
// may outlive its idle timeout by up to this much.
const embeddedTick = 500 * time.Millisecond

// embeddedServer is an in-process miniredis whose TTLs follow the wall
// clock. miniredis expires keys only when its clock is advanced, and every
// advance walks all keys; advancing on each command (its ClockTTL mode)
// made a decision cost grow with the number of live sessions, so a ticker
// advances it twice a second instead.
type embeddedServer struct {
	m    *miniredis.Miniredis
	stop chan struct{}
	done chan struct{}
}

func startEmbedded() (*embeddedServer, error) {
	m := miniredis.NewMiniRedis()
	if err := m.StartAddr("127.0.0.1:0"); err != nil {
		return nil, err
	}
	e := &embeddedServer{m: m, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(e.done)
		t := time.NewTicker(embeddedTick)
		defer t.Stop()
		last := time.Now()
		for {
			select {
			case <-e.stop:
				return
			case now := <-t.C:
				m.FastForward(now.Sub(last))
				last = now
			}
		}
	}()
	return e, nil
}

// Close stops the ticker and the server.
func (e *embeddedServer) Close() {
	close(e.stop)
	<-e.done
	e.m.Close()
}

// parseURL checks the scheme itself, so the error for a typo is clear, and
// keeps url.Parse's messages out of the result: they quote the raw URL,
// password included.
func parseURL(rawURL string) (*goredis.Options, error) {
	if rawURL == "" {
		return nil, fmt.Errorf("redis open: empty URL (%s)", wantURL)
	}
	if !strings.Contains(rawURL, "://") {
		return nil, fmt.Errorf("redis open %q: missing URL scheme (%s)", redact(rawURL), wantURL)
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		// url.Parse quotes the raw URL, and its detail can quote part of the
		// userinfo: take the detail from parsing the redacted URL instead.
		detail := "malformed user info"
		var uerr *url.Error
		if _, rerr := url.Parse(redact(rawURL)); errors.As(rerr, &uerr) {
			detail = uerr.Err.Error()
		}
		return nil, fmt.Errorf("redis open %q: malformed URL: %s (%s)", redact(rawURL), detail, wantURL)
	}
	switch u.Scheme {
	case "redis", "rediss", "unix":
	default:
		return nil, fmt.Errorf("redis open %q: unsupported URL scheme %q (%s)", redact(rawURL), u.Scheme, wantURL)
	}
	if u.Scheme == "unix" && u.Path == "" {
		return nil, fmt.Errorf("redis open %q: unix URL without a socket path (%s)", redact(rawURL), wantURL)
	}
	o, err := goredis.ParseURL(rawURL)
	if err != nil {
		return nil, fmt.Errorf("redis open %q: %w", redact(rawURL), safeErr(err, rawURL))
	}
	return o, nil
}

// newClient turns a go-redis construction panic (it panics on some option
// combinations a URL query can set) into an error.
func newClient(o *goredis.Options) (c *goredis.Client, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("create client: %v", r)
		}
	}()
	return goredis.NewClient(o), nil
}

const hidden = "xxxxx"

// redact hides the userinfo (everything before the last '@') and any
// password query parameter. It works on the raw string, so it also covers
// URLs that do not parse.
func redact(rawURL string) string {
	s := rawURL
	if at := strings.LastIndex(s, "@"); at >= 0 {
		start := 0
		if i := strings.Index(s, "://"); i >= 0 && i < at {
			start = i + len("://")
		}
		s = s[:start] + hidden + s[at:]
	}
	base, query, ok := strings.Cut(s, "?")
	if !ok {
		return s
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return base + "?" + hidden
	}
	for k := range q {
		if strings.Contains(strings.ToLower(k), "pass") {
			q.Set(k, hidden)
		}
	}
	return base + "?" + q.Encode()
}

// safeErr returns err, or a plain error with the URL's secrets removed
// when its message quotes them; wrapping is kept whenever it is safe.
func safeErr(err error, rawURL string) error {
	if msg := scrub(err.Error(), rawURL); msg != err.Error() {
		return errors.New(msg)
	}
	return err
}

// scrub removes the URL's secrets from a message that may quote them
// (go-redis errors, server replies such as WRONGPASS).
func scrub(msg, rawURL string) string {
	var secrets []string
	if u, err := url.Parse(rawURL); err == nil {
		if u.User != nil {
			if p, ok := u.User.Password(); ok {
				secrets = append(secrets, p, url.QueryEscape(p), url.PathEscape(p))
			}
		}
		for k, vs := range u.Query() {
			if strings.Contains(strings.ToLower(k), "pass") {
				secrets = append(secrets, vs...)
			}
		}
	}
	for _, sec := range secrets {
		if sec != "" {
			msg = strings.ReplaceAll(msg, sec, hidden)
		}
	}
	return msg
}
