package identity

import (
	"strings"
	"testing"
)

var secret = []byte("0123456789abcdef0123456789abcdef")

func newExtractor(t testing.TB) *Extractor {
	t.Helper()
	e, err := New(Config{Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestExtract(t *testing.T) {
	e := newExtractor(t)
	long := strings.Repeat("a", DefaultMaxValueBytes+1)
	// A JWT bearer token of 1.4 KB, as an OIDC provider issues with a few
	// dozen claims: header.payload.signature in base64url.
	jwt := "eyJhbGciOiJSUzI1NiIsImtpZCI6ImsxIn0." + strings.Repeat("eyJzdWIiOiJ1c2VyLTEyMyJ9", 50) + ".c2lnbmF0dXJl"
	tests := []struct {
		name     string
		h        Map
		source   Source
		prefix   string
		rejected Reason
		header   string
	}{
		{"session id", Map{"x-session-id": "conv-1"}, SourceSession, "s:", "", ""},
		{"session beats token", Map{"x-session-id": "conv-1", "authorization": "Bearer abc"}, SourceSession, "s:", "", ""},
		{"bearer token", Map{"authorization": "Bearer abc.def-ghi_~+/=="}, SourceToken, "t:", "", ""},
		{"bearer lower-case scheme", Map{"authorization": "bearer abc"}, SourceToken, "t:", "", ""},
		{"token beats device", Map{"authorization": "Bearer abc", "x-device-id": "d", "x-user-id": "u"}, SourceToken, "t:", "", ""},
		{"basic auth is not an identity, device is", Map{"authorization": "Basic dXNlcjpwYXNz", "x-device-id": "d", "x-user-id": "u"}, SourceDevice, "d:", "", ""},
		{"device id and user", Map{"x-device-id": "dev-9", "x-user-id": "u1"}, SourceDevice, "d:", "", ""},
		{"device id alone", Map{"x-device-id": "dev-9"}, SourceDevice, "d:", "", ""},
		{"fingerprint and user", Map{"user-agent": "curl/8", "accept-language": "en", "x-forwarded-for": "203.0.113.9, 10.0.0.1", "x-user-id": "u1"}, SourceDevice, "d:", "", ""},
		{"fingerprint without user", Map{"user-agent": "curl/8", "accept-language": "en"}, SourceAnonymous, "", "", ""},
		{"nothing", Map{}, SourceAnonymous, "", "", ""},
		{"at the limit is fine", Map{"x-session-id": long[:DefaultMaxValueBytes]}, SourceSession, "s:", "", ""},
		{"a byte over the limit is too long", Map{"x-session-id": long}, SourceAnonymous, "", ReasonTooLong, "x-session-id"},
		{"JWT bearer token", Map{"authorization": "Bearer " + jwt}, SourceToken, "t:", "", ""},
		{"10 KB session id", Map{"x-session-id": strings.Repeat("x", 10<<10)}, SourceAnonymous, "", ReasonTooLong, "x-session-id"},
		{"control byte", Map{"x-session-id": "a\x01b"}, SourceAnonymous, "", ReasonControlChars, "x-session-id"},
		{"tab is a control character", Map{"x-session-id": "a\tb"}, SourceAnonymous, "", ReasonControlChars, "x-session-id"},
		{"DEL", Map{"x-session-id": "a\x7f"}, SourceAnonymous, "", ReasonControlChars, "x-session-id"},
		{"invalid session does not fall back to token", Map{"x-session-id": long, "authorization": "Bearer abc"}, SourceAnonymous, "", ReasonTooLong, "x-session-id"},
		{"bearer without token", Map{"authorization": "Bearer"}, SourceAnonymous, "", ReasonMalformedAuth, "authorization"},
		{"bearer with spaces only", Map{"authorization": "Bearer    "}, SourceAnonymous, "", ReasonMalformedAuth, "authorization"},
		{"bearer with two tokens", Map{"authorization": "Bearer a b"}, SourceAnonymous, "", ReasonMalformedAuth, "authorization"},
		{"bearer with bad characters", Map{"authorization": "Bearer a\"b"}, SourceAnonymous, "", ReasonMalformedAuth, "authorization"},
		{"bearer padding in the middle", Map{"authorization": "Bearer a=b"}, SourceAnonymous, "", ReasonMalformedAuth, "authorization"},
		{"auth too long", Map{"authorization": "Bearer " + long}, SourceAnonymous, "", ReasonTooLong, "authorization"},
		{"bad user id", Map{"x-device-id": "d", "x-user-id": "u\x00"}, SourceAnonymous, "", ReasonControlChars, "x-user-id"},
		{"bad device id", Map{"x-device-id": long, "x-user-id": "u"}, SourceAnonymous, "", ReasonTooLong, "x-device-id"},
		{"bad user agent in fingerprint", Map{"user-agent": "a\x02", "x-user-id": "u"}, SourceAnonymous, "", ReasonControlChars, "user-agent"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			id := e.Extract(tc.h)
			if id.Source != tc.source || id.Rejected != tc.rejected || id.Header != tc.header {
				t.Fatalf("got source=%s rejected=%q header=%q, want %s %q %q", id.Source, id.Rejected, id.Header, tc.source, tc.rejected, tc.header)
			}
			if !strings.HasPrefix(id.Key, tc.prefix) || (tc.prefix == "") != id.Anonymous() {
				t.Fatalf("key %q, want prefix %q", id.Key, tc.prefix)
			}
		})
	}
}

func TestKeysNeverHoldTheRawValue(t *testing.T) {
	e := newExtractor(t)
	for _, h := range []Map{
		{"x-session-id": "conversation-secret"},
		{"authorization": "Bearer sk-live-verysecrettoken"},
		{"x-device-id": "device-secret", "x-user-id": "alice@example.com"},
	} {
		id := e.Extract(h)
		for _, v := range h {
			for _, part := range strings.Fields(v) {
				if len(part) > 4 && strings.Contains(id.Key, part) {
					t.Errorf("key %q contains %q", id.Key, part)
				}
			}
		}
		if len(id.Key) != 2+22 {
			t.Errorf("key %q: want kind, colon and 22 base64 characters", id.Key)
		}
	}
}

func TestKeysAreStableAndDistinct(t *testing.T) {
	e := newExtractor(t)
	other, err := New(Config{Secret: []byte("another-secret-of-32-bytes-long!")})
	if err != nil {
		t.Fatal(err)
	}
	a := e.Extract(Map{"x-session-id": "s1"}).Key
	if b := e.Extract(Map{"x-session-id": "s1"}).Key; a != b {
		t.Fatalf("same session gave %q and %q", a, b)
	}
	if b := other.Extract(Map{"x-session-id": "s1"}).Key; a == b {
		t.Fatal("another secret gave the same key")
	}
	distinct := map[string]Map{
		"session s2":         {"x-session-id": "s2"},
		"token s1":           {"authorization": "Bearer s1"},
		"device ab/c":        {"x-device-id": "ab", "x-user-id": "c"},
		"device a/bc":        {"x-device-id": "a", "x-user-id": "bc"},
		"fingerprint ua a/u": {"user-agent": "a", "x-user-id": "u"},
		"fingerprint lang a": {"accept-language": "a", "x-user-id": "u"},
	}
	seen := map[string]string{a: "session s1"}
	for name, h := range distinct {
		k := e.Extract(h).Key
		if prev, dup := seen[k]; dup {
			t.Errorf("%s and %s share key %q", name, prev, k)
		}
		seen[k] = name
	}
}

func TestForwardedForUsesFirstHop(t *testing.T) {
	e := newExtractor(t)
	a := e.Extract(Map{"x-forwarded-for": "203.0.113.9, 10.0.0.1", "x-user-id": "u"}).Key
	b := e.Extract(Map{"x-forwarded-for": "203.0.113.9,10.0.0.7", "x-user-id": "u"}).Key
	if a != b {
		t.Fatal("later proxy hops changed the fingerprint")
	}
}

func TestCustomHeaderNames(t *testing.T) {
	e, err := New(Config{SessionHeader: "X-Conversation", Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	if id := e.Extract(Map{"x-conversation": "c"}); id.Source != SourceSession {
		t.Fatalf("custom session header not used: %+v", id)
	}
	if id := e.Extract(Map{"x-session-id": "c"}); id.Source != SourceAnonymous {
		t.Fatalf("default session header still used: %+v", id)
	}
}

func TestShortSecret(t *testing.T) {
	if _, err := New(Config{Secret: []byte("short")}); err == nil {
		t.Fatal("want an error for a short secret")
	}
}

func FuzzExtract(f *testing.F) {
	e := newExtractor(f)
	f.Add("s", "Bearer t", "d", "u", "ua")
	f.Add("", "Bearer", "", "", "")
	f.Add("", "", "", "u", "a\x00")
	f.Fuzz(func(t *testing.T, session, auth, device, user, ua string) {
		id := e.Extract(Map{"x-session-id": session, "authorization": auth, "x-device-id": device, "x-user-id": user, "user-agent": ua})
		if id.Anonymous() != (id.Source == SourceAnonymous) {
			t.Fatalf("inconsistent identity %+v", id)
		}
		if id.Rejected != ReasonNone && !id.Anonymous() {
			t.Fatalf("rejected but keyed: %+v", id)
		}
		for _, v := range []string{session, auth, device, user} {
			if len(v) >= 8 && strings.Contains(id.Key, v) {
				t.Fatalf("raw value in key %q", id.Key)
			}
		}
	})
}

func BenchmarkExtract(b *testing.B) {
	e := newExtractor(b)
	for _, bc := range []struct {
		name string
		h    Map
	}{
		{"session", Map{"x-session-id": "8f14e45f-ceea-467f-a0e6-6d5c3b1e7a2b"}},
		{"token", Map{"authorization": "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.abc"}},
		{"fingerprint", Map{"user-agent": "Mozilla/5.0", "accept-language": "en-GB", "x-forwarded-for": "203.0.113.9", "x-user-id": "u-42"}},
		{"anonymous", Map{"user-agent": "Mozilla/5.0"}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				e.Extract(bc.h)
			}
		})
	}
}

func TestAliasesAndCohort(t *testing.T) {
	e := newExtractor(t)
	tok := e.Extract(Map{"authorization": "Bearer abc"}).Key
	dev := e.Extract(Map{"x-device-id": "d1", "x-user-id": "u1"}).Key
	full := e.Extract(Map{"x-session-id": "conv-1", "authorization": "Bearer abc", "x-device-id": "d1", "x-user-id": "u1"})
	if full.Source != SourceSession || len(full.Aliases) != 2 || full.Aliases[0] != tok || full.Aliases[1] != dev {
		t.Errorf("session + token + device: %+v; want aliases [%s %s]", full, tok, dev)
	}
	if full.Cohort == "" || !strings.HasPrefix(full.Cohort, "u:") {
		t.Errorf("cohort = %q, want a u: key", full.Cohort)
	}
	if other := e.Extract(Map{"x-session-id": "conv-2", "x-user-id": "u1"}); other.Cohort != full.Cohort {
		t.Errorf("same user, another session: cohort %q, want %q", other.Cohort, full.Cohort)
	}
	if strings.Contains(full.Cohort, "u1") {
		t.Errorf("cohort %q holds the raw user id", full.Cohort)
	}
	tokDev := e.Extract(Map{"authorization": "Bearer abc", "x-device-id": "d1", "x-user-id": "u1"})
	if tokDev.Key != tok || len(tokDev.Aliases) != 1 || tokDev.Aliases[0] != dev {
		t.Errorf("token + device: %+v; want key %s alias %s", tokDev, tok, dev)
	}
	// A broken weaker identifier is left out, not a reason to reject.
	broken := e.Extract(Map{"x-session-id": "conv-1", "authorization": "Bearer a\"b", "x-device-id": "d\x01", "x-user-id": "u1"})
	if broken.Anonymous() || len(broken.Aliases) != 0 {
		t.Errorf("session with broken token and device: %+v; want the session, no aliases", broken)
	}
	if only := e.Extract(Map{"x-session-id": "conv-1"}); len(only.Aliases) != 0 || only.Cohort != "" {
		t.Errorf("session alone: %+v; want no aliases, no cohort", only)
	}
}
