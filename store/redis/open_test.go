package redis

import (
	"context"
	cryptotls "crypto/tls"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	goredis "github.com/redis/go-redis/v9"
)

const secret = "hunter2"

func TestOpenBadURLs(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		url  string
		want string // in the error
	}{
		{"empty", "", "empty URL"},
		{"wrong scheme", "http://user:" + secret + "@127.0.0.1:6379", `unsupported URL scheme "http"`},
		{"scheme typo", "reddis://:" + secret + "@127.0.0.1:6379/0", `unsupported URL scheme "reddis"`},
		{"no scheme", "127.0.0.1:6379", "URL scheme"},
		{"no scheme with password", "redis//:" + secret + "@host", "missing URL scheme"},
		{"bad port", "redis://user:" + secret + "@127.0.0.1:port", `malformed URL: invalid port ":port" after host`},
		{"bad escape in password", "redis://user:" + secret + "%zz@127.0.0.1:6379", "malformed URL: malformed user info"},
		{"bad host", "redis://user:" + secret + "@127.0.0.1:6379%zz", `malformed URL: invalid port ":6379%zz" after host`},
		{"control character", "redis://127.0.0.1:6379/\x00", "malformed URL: net/url: invalid control character"},
		{"bad db", "redis://:" + secret + "@127.0.0.1:6379/zero", "invalid database number"},
		{"bad path", "rediss://:" + secret + "@127.0.0.1:6379/0/1", "invalid URL path"},
		{"unknown option", "redis://:" + secret + "@127.0.0.1:6379/0?pool=1", "unexpected option"},
		{"unix without path", "unix://", "without a socket path"},
		{"unix bad db", "unix:///tmp/r.sock?db=x&password=" + secret, "invalid"},

		{"cluster without host", "redis+cluster://:" + secret + "@?addr=127.0.0.1:7001", "cluster URL without host:port"},
		{"cluster without port", "redis+cluster://:" + secret + "@127.0.0.1?addr=127.0.0.1:7001", "cluster URL without host:port"},
		{"cluster bad port", "redis+cluster://:" + secret + "@127.0.0.1:70000", `address "127.0.0.1:70000": invalid port "70000"`},
		{"cluster port not a number", "redis+cluster://:" + secret + "@127.0.0.1:port", `malformed URL: invalid port ":port" after host`},
		{"cluster bad addr port", "redis+cluster://:" + secret + "@127.0.0.1:7000?addr=127.0.0.1:x", `addr "127.0.0.1:x": invalid port "x"`},
		{"cluster addr without port", "redis+cluster://:" + secret + "@127.0.0.1:7000?addr=127.0.0.1", `addr "127.0.0.1": want host:port`},
		{"cluster addr without host", "redis+cluster://:" + secret + "@127.0.0.1:7000?addr=:7001", `addr ":7001": want host:port`},
		{"cluster unknown option", "redis+cluster://:" + secret + "@127.0.0.1:7000?pool=1", "unexpected option: pool"},
		{"cluster password option", "redis+cluster://127.0.0.1:7000?password=" + secret, "unexpected option: password"},
		{"cluster bad option value", "rediss+cluster://:" + secret + "@127.0.0.1:7000?max_retries=many", "invalid max_retries number"},
		{"cluster database", "redis+cluster://:" + secret + "@127.0.0.1:7000/1", "database 0 only"},
		{"cluster db option", "redis+cluster://:" + secret + "@127.0.0.1:7000?db=1", "database 0 only"},
		{"cluster bad query", "redis+cluster://:" + secret + "@127.0.0.1:7000?addr=%zz", "malformed query"},
		{"cluster typo", "redis+clster://:" + secret + "@127.0.0.1:7000", `unsupported URL scheme "redis+clster"`},

		{"sentinel without master_name", "redis+sentinel://:" + secret + "@127.0.0.1:26379?addr=127.0.0.1:26380", "without master_name"},
		{"sentinel empty master_name", "redis+sentinel://127.0.0.1:26379?master_name=&password=" + secret, "without master_name"},
		{"sentinel last master_name empty", "redis+sentinel://:" + secret + "@127.0.0.1:26379?master_name=m&master_name=", "without master_name"},
		{"sentinel without port", "redis+sentinel://:" + secret + "@127.0.0.1?master_name=m", "sentinel URL without host:port"},
		{"sentinel bad port", "redis+sentinel://:" + secret + "@127.0.0.1:0?master_name=m", `invalid port "0"`},
		{"sentinel bad addr", "redis+sentinel://:" + secret + "@127.0.0.1:26379?master_name=m&addr=127.0.0.1:99999", `addr "127.0.0.1:99999": invalid port "99999"`},
		{"sentinel unknown option", "redis+sentinel://:" + secret + "@127.0.0.1:26379?master_name=m&mastername=m", "unexpected option: mastername"},
		{"sentinel bad db", "redis+sentinel://127.0.0.1:26379/x?master_name=m&password=" + secret, "invalid database number"},
		{"sentinel bad db option", "rediss+sentinel://:" + secret + "@127.0.0.1:26379?master_name=m&db=one", "invalid database number"},
		{"sentinel replica reads", "redis+sentinel://:" + secret + "@127.0.0.1:26379?master_name=m&replica_only=true", "option replica_only sends commands to replicas"},
		{"sentinel route by latency", "redis+sentinel://:" + secret + "@127.0.0.1:26379?master_name=m&route_by_latency=true", "option route_by_latency"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			s, err := Open(ctx, tt.url, defaultOptions())
			if err == nil {
				_ = s.Close()
				t.Fatalf("Open(%q) succeeded, want an error", tt.url)
			}
			msg := err.Error()
			t.Log(msg)
			if !strings.Contains(msg, tt.want) {
				t.Errorf("Open(%q) error %q, want it to contain %q", tt.url, msg, tt.want)
			}
			if strings.Contains(msg, secret) {
				t.Errorf("Open(%q) error %q shows the password", tt.url, msg)
			}
			if !strings.HasPrefix(msg, "redis open") {
				t.Errorf("Open(%q) error %q does not start with the operation", tt.url, msg)
			}
		})
	}
}

func TestOpenAuth(t *testing.T) {
	m := miniredis.RunT(t)
	m.RequireAuth(secret)
	ctx := t.Context()

	_, err := Open(ctx, "redis://:wrong-"+secret+"@"+m.Addr()+"/0", defaultOptions())
	if err == nil || strings.Contains(err.Error(), secret) {
		t.Fatalf("Open with a wrong password: err = %v, want an error without the password", err)
	}

	s, err := Open(ctx, "redis://:"+secret+"@"+m.Addr()+"/0", defaultOptions())
	if err != nil {
		t.Fatalf("Open with the right password: %v", err)
	}
	defer s.Close()
	if err := s.Ping(ctx); err != nil {
		t.Errorf("Ping: %v", err)
	}
}

func TestRedact(t *testing.T) {
	tests := []struct{ in, want string }{
		{"redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"},
		{"redis://u:p@h:1/0", "redis://xxxxx@h:1/0"},
		{"redis://:p@ss@h:1", "redis://xxxxx@h:1"},
		{"rediss://u:p?x@h", "rediss://xxxxx@h"},
		{"p@redis://h", "xxxxx@redis://h"},
		{"unix:///s.sock?db=1&password=p", "unix:///s.sock?db=1&password=xxxxx"},
		{"unix:///s.sock?%zz", "unix:///s.sock?xxxxx"},
		{"redis+sentinel://h:1?master_name=m&addr=h:2&Password=p&db=1", "redis+sentinel://h:1?master_name=m&addr=h:2&Password=xxxxx&db=1"},
		{"redis+sentinel://h:1?pass%77ord=p&x", "redis+sentinel://h:1?pass%77ord=xxxxx&x"},
	}
	for _, tt := range tests {
		if got := redact(tt.in); got != tt.want {
			t.Errorf("redact(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

// TestParseURL checks what each URL form asks go-redis for.
func TestParseURL(t *testing.T) {
	tls := &cryptotls.Config{} // only its presence is compared
	tests := []struct {
		url  string
		want clientOptions
	}{
		{"redis://u:" + secret + "@10.0.0.1:6380/2", clientOptions{standalone: &goredis.Options{
			Network: "tcp", Addr: "10.0.0.1:6380", DB: 2, Username: "u", Password: secret,
		}}},
		{"unix:///run/redis.sock?db=3", clientOptions{standalone: &goredis.Options{
			Network: "unix", Addr: "/run/redis.sock", DB: 3,
		}}},
		{"redis+cluster://10.0.0.1:7000", clientOptions{cluster: &goredis.ClusterOptions{
			Addrs: []string{"10.0.0.1:7000"},
		}}},
		{"REDIS+Cluster://u:" + secret + "@10.0.0.1:7000/?addr=10.0.0.2:7001&addr=[::1]:7002&dial_timeout=2s", clientOptions{cluster: &goredis.ClusterOptions{
			Addrs: []string{"10.0.0.1:7000", "10.0.0.2:7001", "[::1]:7002"}, Username: "u", Password: secret, DialTimeout: 2 * time.Second,
		}}},
		{"rediss+cluster://:" + secret + "@redis-0.internal:6379?addr=redis-1.internal:6379", clientOptions{cluster: &goredis.ClusterOptions{
			Addrs: []string{"redis-0.internal:6379", "redis-1.internal:6379"}, Password: secret, TLSConfig: tls,
		}}},
		{"redis+sentinel://10.0.0.1:26379?master_name=mymaster", clientOptions{failover: &goredis.FailoverOptions{
			SentinelAddrs: []string{"10.0.0.1:26379"}, MasterName: "mymaster",
		}}},
		{"redis+sentinel://su:" + secret + "@10.0.0.1:26379/1?addr=10.0.0.2:26379&addr=10.0.0.3:26379&master_name=mymaster&username=mu&password=" + secret + "-master", clientOptions{failover: &goredis.FailoverOptions{
			SentinelAddrs: []string{"10.0.0.1:26379", "10.0.0.2:26379", "10.0.0.3:26379"}, MasterName: "mymaster", DB: 1,
			SentinelUsername: "su", SentinelPassword: secret, Username: "mu", Password: secret + "-master",
		}}},
		{"rediss+sentinel://10.0.0.1:26379?master_name=m&db=4", clientOptions{failover: &goredis.FailoverOptions{
			SentinelAddrs: []string{"10.0.0.1:26379"}, MasterName: "m", DB: 4, TLSConfig: tls,
		}}},
	}
	// Compare what the URL sets; a TLS config only by whether there is one.
	opt := cmp.Options{
		cmp.AllowUnexported(clientOptions{}),
		cmpopts.IgnoreUnexported(goredis.Options{}, goredis.ClusterOptions{}, goredis.FailoverOptions{}),
		cmp.Comparer(func(a, b *cryptotls.Config) bool { return (a == nil) == (b == nil) }),
	}
	for _, tt := range tests {
		t.Run(tt.url, func(t *testing.T) {
			got, err := parseURL(tt.url)
			if err != nil {
				t.Fatalf("parseURL: %v", err)
			}
			if diff := cmp.Diff(tt.want, got, opt); diff != "" {
				t.Errorf("parseURL (-want +got):\n%s", diff)
			}
			if err := CheckURL(tt.url); err != nil {
				t.Errorf("CheckURL: %v", err)
			}
		})
	}
}

func TestCheckURL(t *testing.T) {
	raw := "redis+sentinel://u:" + secret + "@10.0.0.1:26379?password=" + secret
	err := CheckURL(raw)
	var ue *URLError
	if !errors.As(err, &ue) {
		t.Fatalf("CheckURL(%q) = %v, want a *URLError", raw, err)
	}
	if want := "redis+sentinel://xxxxx@10.0.0.1:26379?password=xxxxx"; ue.URL != want {
		t.Errorf("URLError.URL = %q, want %q", ue.URL, want)
	}
	if !strings.Contains(ue.Err.Error(), "master_name") || strings.Contains(err.Error(), secret) {
		t.Errorf("CheckURL error %q: want it to name master_name and hide the password", err)
	}
}

// FuzzParseURL: parseURL never panics, every error is a *URLError, and no
// error shows the password of the URL's userinfo.
func FuzzParseURL(f *testing.F) {
	f.Add("redis", "h:1/0", "")
	f.Add("unix", "/s.sock", "db=1")
	f.Add("redis+cluster", "h:1", "addr=h:2&addr=[::1]:3")
	f.Add("rediss+sentinel", "h:26379/1", "master_name=m&addr=h:26380")
	f.Add("redis+sentinel", "h:x", "master_name=m")
	f.Fuzz(func(t *testing.T, scheme, rest, query string) {
		raw := scheme + "://u:" + secret + "@" + rest + "?" + query
		_, err := parseURL(raw)
		if err == nil {
			return
		}
		var ue *URLError
		if !errors.As(err, &ue) {
			t.Fatalf("parseURL(%q) error %v is not a *URLError", raw, err)
		}
		if strings.Contains(err.Error(), secret) && !strings.Contains(scheme+rest+query, secret) {
			t.Fatalf("parseURL(%q) error %q shows the password", raw, err)
		}
	})
}
