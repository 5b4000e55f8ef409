package config

import (
	"strings"
	"testing"
)

// TestEmbeddedTakesNoSettings: redis.url = "embedded" with what only a
// real Redis has is refused, naming redis.url and what does not apply,
// and never showing the value's secrets.
func TestEmbeddedTakesNoSettings(t *testing.T) {
	const secret = "hunter2"
	tests := []struct {
		url  string
		want []string // every string must appear in the error
	}{
		{"embedded?addr=10.0.0.2:7000&addr=10.0.0.3:7000", []string{`"embedded…"`, "seed list (addr=)", "in-process memory store"}},
		{"embedded+cluster://10.0.0.1:7000?addr=10.0.0.2:7000", []string{`"embedded+cluster://…"`, "Cluster scheme", "seed list", "address"}},
		{"rediss+embedded://10.0.0.1:6380", []string{`"rediss+embedded://…"`, "TLS", "address"}},
		{"embedded://user:" + secret + "@10.0.0.1:6379", []string{`"embedded://…"`, "credentials", "address"}},
		{"embedded://:" + secret + "@/", []string{"credentials"}},
		{"embedded?password=" + secret, []string{`"embedded…"`, "credentials"}},
		{"embedded/3", []string{"database"}},
		{"embedded?db=3", []string{"database"}},
		{"embedded://localhost/3", []string{"address", "database"}},
		{"embedded+sentinel://10.0.0.1:26379?master_name=m", []string{"Sentinel options", "address"}},
		{"embedded?master_name=m&sentinel_password=" + secret, []string{"Sentinel options", "credentials"}},
		{"embedded?tls=true", []string{"TLS"}},
		{"embedded:6379", []string{"address"}},
		{"embedded?pool_size=3", []string{"options"}},
		{"EMBEDDED+CLUSTER://h:1", []string{"Cluster scheme"}},
		{"Embedded", []string{`"Embedded"`, `want exactly "embedded"`}},
		{" embedded", []string{`" embedded"`, `want exactly "embedded"`}},
		{"embedded\n", []string{`want exactly "embedded"`}},
		{"embeddedd", []string{`"embedded…"`, `want exactly "embedded"`}},
		{"embedded://", []string{`want exactly "embedded"`}},
	}
	for _, tc := range tests {
		t.Run(tc.url, func(t *testing.T) {
			c := Default()
			c.Redis.URL = tc.url
			err := c.Validate()
			if err == nil {
				t.Fatal("want an error")
			}
			msg := err.Error()
			for _, w := range append([]string{"redis.url"}, tc.want...) {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q does not mention %q", msg, w)
				}
			}
			for _, s := range []string{secret, "10.0.0", "localhost", "master_name=m"} {
				if strings.Contains(msg, s) {
					t.Errorf("error %q shows part of the value (%q)", msg, s)
				}
			}
		})
	}
}

// TestEmbeddedLookalikesAreRedisURLs: a Redis URL whose host or path says
// embedded is a Redis URL, not the embedded store.
func TestEmbeddedLookalikesAreRedisURLs(t *testing.T) {
	for _, u := range []string{
		"embedded",
		"redis://embedded:6379/0",
		"rediss://u:hunter2@embedded.internal:6380",
		"unix:///run/embedded.sock",
		"redis+cluster://embedded-0:7000?addr=embedded-1:7000",
	} {
		c := Default()
		c.Redis.URL = u
		c.Identity.Secret = "0123456789abcdef"
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", u, err)
		}
	}
}

// FuzzRedisURL: whatever redis.url holds, validation never panics and its
// error never shows the password of the value's userinfo.
func FuzzRedisURL(f *testing.F) {
	for _, s := range []string{"embedded", "embedded+cluster", "rediss+embedded", "redis", "Embedded", "embedded?addr=h:1&"} {
		f.Add(s, "h:1", "db=1")
	}
	f.Fuzz(func(t *testing.T, scheme, rest, query string) {
		const secret = "s3cr3tPW"
		for _, u := range []string{scheme + "://u:" + secret + "@" + rest + "?" + query, scheme + "?password=" + secret + "&" + query} {
			c := Default()
			c.Redis.URL = u
			err := c.Validate()
			if err != nil && strings.Contains(err.Error(), secret) && !strings.Contains(scheme, secret) {
				t.Fatalf("redis.url %q: error %q shows the password", u, err)
			}
		}
	})
}
