package extproc

import (
	"errors"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
)

// TestTicketRoundTrip: a ticket reads back as the decision it was issued
// for, in the documented layout, issued from several goroutines at once
// (the MAC and its buffer are pooled); a changed byte or another
// deployment's key is refused.
func TestTicketRoundTrip(t *testing.T) {
	k := NewTickets([]byte("0123456789abcdef"))
	at := time.UnixMilli(1_790_000_000_123)
	layout := regexp.MustCompile(`^1\|1790000000123\|[0-9a-f]{8}-[0-9a-z]+\|(-|r|p|rp)\|[a-z-]+\|[a-z-]*\|[A-Za-z0-9_-]{12}$`)
	tests := []struct {
		name string
		d    affinity.Decision
	}{
		{"sticky", affinity.Decision{Instance: fleet.Instance{Name: "gpu-a"}, Mode: affinity.Sticky, Previous: "gpu-b", At: at}},
		{"random", affinity.Decision{Instance: fleet.Instance{Name: "gpu-a"}, Mode: affinity.Random, At: at}},
		{"probe", affinity.Decision{Instance: fleet.Instance{Name: "gpu-a"}, Mode: affinity.Sticky, Probe: true, At: at}},
		{"random probe", affinity.Decision{Instance: fleet.Instance{Name: "gpu-a"}, Mode: affinity.Random, Probe: true, At: at}},
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 50 {
				for _, tc := range tests {
					s := k.Issue(tc.d)
					if !layout.MatchString(s) {
						t.Errorf("%s: ticket %q not in the layout", tc.name, s)
						continue
					}
					got, err := k.read(s)
					if err != nil {
						t.Errorf("%s: read %q: %v", tc.name, s, err)
						continue
					}
					in := fleet.Instance{Name: got.instance}
					if d := got.decision(in); d.Instance.Name != tc.d.Instance.Name || d.Mode != tc.d.Mode ||
						d.Previous != tc.d.Previous || d.Probe != tc.d.Probe || !d.At.Equal(at) {
						t.Errorf("%s: read back %+v, want %+v", tc.name, d, tc.d)
					}
				}
			}
		})
	}
	wg.Wait()
	s := k.Issue(tests[0].d)
	for i := range len(s) {
		b := []byte(s)
		b[i] ^= 1
		if _, err := k.read(string(b)); err == nil {
			t.Errorf("ticket with byte %d changed (%q) accepted", i, b)
		}
	}
	other := NewTickets([]byte("another secret.."))
	if _, err := other.read(s); !errors.Is(err, errForged) {
		t.Errorf("another key: err = %v, want errForged", err)
	}
}
