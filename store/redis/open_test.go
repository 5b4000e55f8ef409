package redis

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
)

const secret = "hunter2"

func TestOpenBadURLs(t *testing.T) {
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
		{"nothing listening", "redis://:" + secret + "@127.0.0.1:1/0", "load scripts"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			s, err := Open(ctx, tt.url, DefaultOptions())
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

	_, err := Open(ctx, "redis://:wrong-"+secret+"@"+m.Addr()+"/0", DefaultOptions())
	if err == nil || strings.Contains(err.Error(), secret) {
		t.Fatalf("Open with a wrong password: err = %v, want an error without the password", err)
	}

	s, err := Open(ctx, "redis://:"+secret+"@"+m.Addr()+"/0", DefaultOptions())
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
	}
	for _, tt := range tests {
		if got := redact(tt.in); got != tt.want {
			t.Errorf("redact(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}
