package identity

import (
	"strings"
	"sync"
	"testing"
)

// TestKeysAreStable pins keys to the values of the first release: a key
// is what the store holds a session's binding under, so a change in how
// it is derived (its scratch buffers included) would unbind every session
// at the next deploy. Run concurrently, so pooled scratch space shared
// between goroutines would show as a wrong key.
func TestKeysAreStable(t *testing.T) {
	e := newExtractor(t)
	long := strings.Repeat("x", DefaultMaxValueBytes)
	tests := []struct {
		name string
		h    Map
		key  string
		more string // the cohort
	}{
		{"session", Map{"x-session-id": "conv-1"}, "s:eVSIqweSXFDAqjNzvgNfMg", ""},
		{"token", Map{"authorization": "Bearer abc.def"}, "t:LK9928jvYELmg1SLamaMRw", ""},
		{"device id and user", Map{"x-device-id": "dev-9", "x-user-id": "u1"}, "d:5_G6rwZSkOfwc4aoFEgDpA", "u:wOgepRKnYVIFC4EWG4SkxQ"},
		{"fingerprint", Map{"user-agent": "Mozilla/5.0", "accept-language": "en-GB", "x-forwarded-for": "203.0.113.9, 10.0.0.1", "x-user-id": "u-42"}, "d:BxBAHCeoQky5OV1C7pbOsg", "u:xtxOlnWmif209SY2GZX3fw"},
		{"longest session id", Map{"x-session-id": long}, "s:MmE9njoE8coQP7gApWRmnA", ""},
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 50 {
				for _, tc := range tests {
					id := e.Extract(tc.h)
					if id.Key != tc.key {
						t.Errorf("%s: key %q, want %q", tc.name, id.Key, tc.key)
					}
					more := id.Cohort
					if more != tc.more {
						t.Errorf("%s: cohort %q, want %q", tc.name, more, tc.more)
					}
				}
			}
		})
	}
	wg.Wait()
}
