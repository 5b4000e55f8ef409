package redis

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"

	goredis "github.com/redis/go-redis/v9"
)

const wantURL = "want redis://host:port/db, rediss://host:port/db, unix:///path/to/sock, " +
	"redis+cluster://host:port?addr=host:port or redis+sentinel://host:port?master_name=name&addr=host:port " +
	"(rediss+cluster, rediss+sentinel: TLS)"

// URLError is a store URL Open cannot use.
type URLError struct {
	// URL is the URL with its userinfo and password parameters hidden.
	URL string
	// Err says what is wrong; its message never shows a password.
	Err error
}

func (e *URLError) Error() string { return fmt.Sprintf("redis open %q: %v", e.URL, e.Err) }

func (e *URLError) Unwrap() error { return e.Err }

// CheckURL reports, without connecting, whether Open accepts rawURL; when
// not, the error is a *URLError. Configuration validation calls it, so a
// config file and Open agree on what a store URL is.
func CheckURL(rawURL string) error {
	_, err := parseURL(rawURL)
	return err
}

// Open connects to the Redis named by rawURL and returns a store that owns
// the connection. The URL is one of:
//
//   - a standalone server, in go-redis ParseURL's forms:
//     redis://[user:pass@]host:port/db, rediss://… (TLS), unix:///path?db=N;
//   - a Redis Cluster: redis+cluster://[user:pass@]host:port?addr=host:port&…
//     (rediss+cluster for TLS), read by go-redis ParseClusterURL. The
//     addresses are seeds: the client finds the other nodes itself. A
//     cluster has database 0 only, so the URL has no path;
//   - masters found through Sentinel:
//     redis+sentinel://[user:pass@]host:port?addr=host:port&master_name=name[&db=N]
//     (rediss+sentinel for TLS), read by go-redis ParseFailoverURL. As
//     there, the userinfo is the sentinels' credentials; the master's go in
//     the username and password parameters. Parameters that send commands
//     to replicas are refused: the store writes on every call.
//
// The cluster and sentinel forms need an explicit host:port in every
// address. Other query parameters are go-redis's client options;
// unknown ones are errors. Errors name the problem and show the URL with
// its password hidden.
//
// A URL Open cannot use fails it with a *URLError. A Redis that answers
// with an error, such as a wrong password, fails it too. A Redis that does
// not answer within a second does not fail it. Neither do every sentinel or
// every cluster seed not answering. Open then returns a store whose guard is
// open. The store recovers by itself once Redis answers (see New and the
// package comment). Open logs nothing. Store.Health says how it started.
func Open(ctx context.Context, rawURL string, opts Options) (*Store, error) {
	co, err := parseURL(rawURL)
	if err != nil {
		return nil, err
	}
	client, err := newClient(co)
	if err != nil {
		return nil, fmt.Errorf("redis open %q: %w", redact(rawURL), err)
	}
	var sentinels *sentinelWatch
	if co.failover != nil {
		sentinels = newSentinelWatch(co.failover)
	}
	s, err := newStore(ctx, client, opts, func(msg string) string { return scrub(msg, rawURL) }, sentinels)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("redis open %q: %w", redact(rawURL), safeErr(err, rawURL))
	}
	s.ownClient = true
	return s, nil
}

// clientOptions is what a URL asks for: exactly one field is set.
type clientOptions struct {
	standalone *goredis.Options
	cluster    *goredis.ClusterOptions
	failover   *goredis.FailoverOptions
}

// replicaOptions are the FailoverOptions parameters that send commands to
// replicas (NewFailoverClient panics on the last two).
var replicaOptions = []string{"replica_only", "route_by_latency", "route_randomly"}

// parseURL checks the scheme itself, so the error for a typo is clear, and
// keeps url.Parse's messages out of the result: they quote the raw URL,
// password included. Every error is a *URLError.
func parseURL(rawURL string) (clientOptions, error) {
	bad := func(err error) (clientOptions, error) {
		return clientOptions{}, &URLError{URL: redact(rawURL), Err: safeErr(err, rawURL)}
	}
	if rawURL == "" {
		return bad(fmt.Errorf("empty URL (%s)", wantURL))
	}
	if !strings.Contains(rawURL, "://") {
		return bad(fmt.Errorf("missing URL scheme (%s)", wantURL))
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
		return bad(fmt.Errorf("malformed URL: %s (%s)", detail, wantURL))
	}
	// go-redis's parsers take the plain scheme; the rest of the URL is
	// theirs as written. url.Parse lower-cases the scheme, which is ASCII,
	// so it is as long as in rawURL.
	base, kind, _ := strings.Cut(u.Scheme, "+")
	goURL := base + rawURL[len(u.Scheme):]
	switch u.Scheme {
	case "redis", "rediss", "unix":
		if u.Scheme == "unix" && u.Path == "" {
			return bad(fmt.Errorf("unix URL without a socket path (%s)", wantURL))
		}
		o, err := goredis.ParseURL(rawURL)
		if err != nil {
			return bad(err)
		}
		return clientOptions{standalone: o}, nil
	case "redis+cluster", "rediss+cluster":
		if err := checkAddrs(u, kind); err != nil {
			return bad(err)
		}
		if (u.Path != "" && u.Path != "/") || u.Query().Has("db") {
			return bad(errors.New("a cluster has database 0 only: remove the database from the URL"))
		}
		o, err := goredis.ParseClusterURL(goURL)
		if err != nil {
			return bad(err)
		}
		return clientOptions{cluster: o}, nil
	case "redis+sentinel", "rediss+sentinel":
		if err := checkAddrs(u, kind); err != nil {
			return bad(err)
		}
		q := u.Query()
		// go-redis takes the last value of a repeated parameter.
		if names := q["master_name"]; len(names) == 0 || names[len(names)-1] == "" {
			return bad(errors.New("sentinel URL without master_name: add ?master_name=<the name the sentinels monitor>"))
		}
		for _, k := range replicaOptions {
			if q.Has(k) {
				return bad(fmt.Errorf("option %s sends commands to replicas, but the store writes on every call", k))
			}
		}
		o, err := goredis.ParseFailoverURL(goURL)
		if err != nil {
			return bad(err)
		}
		return clientOptions{failover: o}, nil
	default:
		return bad(fmt.Errorf("unsupported URL scheme %q (%s)", u.Scheme, wantURL))
	}
}

// checkAddrs checks the addresses of a cluster or sentinel URL. The host
// and every addr parameter must be host:port with a port go-redis can
// dial. Otherwise go-redis would default a missing host to localhost. It
// would default a missing port to 6379, but a sentinel listens on 26379.
// It would accept any port text. checkAddrs also refuses a query that does
// not parse, which go-redis would silently cut short.
func checkAddrs(u *url.URL, kind string) error {
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return fmt.Errorf("malformed query: %w", err)
	}
	if u.Hostname() == "" || u.Port() == "" {
		return fmt.Errorf("%s URL without host:port after the scheme", kind)
	}
	if err := checkPort(u.Port()); err != nil {
		return fmt.Errorf("address %q: %w", u.Host, err)
	}
	for _, a := range q["addr"] {
		h, p, err := net.SplitHostPort(a)
		if err != nil || h == "" {
			return fmt.Errorf("addr %q: want host:port", a)
		}
		if err := checkPort(p); err != nil {
			return fmt.Errorf("addr %q: %w", a, err)
		}
	}
	return nil
}

func checkPort(p string) error {
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("invalid port %q", p)
	}
	return nil
}

// newClient builds the client co asks for, with ContextTimeoutEnabled:
// without it go-redis ignores context deadlines, and Options.Timeout would
// not bound the network wait. It turns a go-redis construction panic (it
// panics on some option combinations a URL query can set) into an error.
func newClient(co clientOptions) (c goredis.UniversalClient, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("create client: %v", r)
		}
	}()
	switch {
	case co.cluster != nil:
		co.cluster.ContextTimeoutEnabled = true
		return goredis.NewClusterClient(co.cluster), nil
	case co.failover != nil:
		co.failover.ContextTimeoutEnabled = true
		return goredis.NewFailoverClient(co.failover), nil
	case co.standalone != nil:
		co.standalone.ContextTimeoutEnabled = true
		return goredis.NewClient(co.standalone), nil
	}
	return nil, errors.New("create client: no options")
}

// sentinelWatch is what the hit cache needs to hear a Sentinel's
// failovers (hitCache.watchSentinel). It holds the master's name. It holds
// a client's options for each sentinel the URL names. Those carry the
// sentinels' credentials and TLS, as go-redis's failover client has them.
type sentinelWatch struct {
	master    string
	sentinels []*goredis.Options
}

func newSentinelWatch(o *goredis.FailoverOptions) *sentinelWatch {
	w := &sentinelWatch{master: o.MasterName}
	var seen []string
	for _, addr := range o.SentinelAddrs {
		if slices.Contains(seen, addr) {
			continue
		}
		seen = append(seen, addr)
		w.sentinels = append(w.sentinels, &goredis.Options{
			Addr:                  addr,
			ClientName:            o.ClientName,
			Dialer:                o.Dialer,
			Username:              o.SentinelUsername,
			Password:              o.SentinelPassword,
			DialTimeout:           o.DialTimeout,
			ReadTimeout:           o.ReadTimeout,
			WriteTimeout:          o.WriteTimeout,
			TLSConfig:             o.TLSConfig,
			ContextTimeoutEnabled: true,
		})
	}
	return w
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
	if _, err := url.ParseQuery(query); err != nil {
		return base + "?" + hidden
	}
	// Hide values in place, so the rest reads as written.
	pairs := strings.Split(query, "&")
	for i, p := range pairs {
		k, _, _ := strings.Cut(p, "=")
		if uk, _ := url.QueryUnescape(k); strings.Contains(strings.ToLower(uk), "pass") {
			pairs[i] = k + "=" + hidden
		}
	}
	return base + "?" + strings.Join(pairs, "&")
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
