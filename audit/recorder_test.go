package audit

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
)

// newRecorderT returns a recorder on a writer to sink; close stops the
// writer (flushing it) so the sink can be read.
func newRecorderT(t testing.TB, sink Sink, rate float64, cfg RecorderConfig) (rec *Recorder, sealer *Sealer, close func()) {
	t.Helper()
	w, err := NewWriter(sink, WriterConfig{SampleRate: rate, Buffer: 10000})
	if err != nil {
		t.Fatal(err)
	}
	closeW := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := w.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(closeW)
	sealer = testSealer(t)
	rec, err = NewRecorder(w, sealer, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return rec, sealer, closeW
}

var (
	gpu  = fleet.Instance{Name: "gpu-a", Version: "v2"}
	sess = identity.Identity{Key: "s:abc", Source: identity.SourceSession, Aliases: []string{"t:def", "", "d:ghi"}}
)

func decision(k affinity.Kind) affinity.Decision {
	return affinity.Decision{Instance: gpu, Mode: affinity.Sticky, Kind: k}
}

func TestRecorderRecord(t *testing.T) {
	sink := &memSink{}
	rec, sealer, closeW := newRecorderT(t, sink, 1, RecorderConfig{})
	at := time.Date(2026, 3, 1, 13, 0, 0, 5, time.FixedZone("CET", 3600))
	const rid = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
	bind := decision(affinity.KindBind)
	bind.Key = "s:linked" // s:abc is an alias of the session stored under s:linked
	rec.Audit(rid, "alice@example.org", sess, bind, at)
	rec.Audit(strings.ToUpper(rid), "", identity.Identity{Source: identity.SourceAnonymous},
		affinity.Decision{Instance: fleet.Instance{Name: "gpu-b"}, Mode: affinity.Random, Kind: affinity.KindAnonymous}, at)
	closeW()
	if len(sink.recs) != 2 {
		t.Fatalf("%d records, want 2", len(sink.recs))
	}
	r := sink.recs[0]
	want := Record{RequestID: rid, ModelVersion: "v2", DecisionTime: at.UTC(), Instance: "gpu-a", Mode: "sticky",
		Decision: "bind", IdentitySource: "session", KeyID: sealer.CurrentKeyID(), UserPseudonym: sealer.Pseudonym("alice@example.org"),
		SessionKeys: []string{"s:abc", "s:linked", "t:def", "d:ghi"}}
	got := r
	got.UserCiphertext = nil
	if !equalRecords(got, want) || got.DecisionTime.Location() != time.UTC {
		t.Fatalf("record\n got %+v\nwant %+v", got, want)
	}
	if u, err := sealer.UserID(r); err != nil || u != "alice@example.org" {
		t.Fatalf("user id opens to %q, %v", u, err)
	}
	b, _ := json.Marshal(r)
	if strings.Contains(string(b), "alice") {
		t.Fatalf("plaintext user id in %s", b)
	}
	// An upper-case request id is kept, lower-cased; no user, no user fields;
	// an empty model version is fine.
	r = sink.recs[1]
	if r.RequestID != rid || r.UserCiphertext != nil || r.KeyID != "" || r.UserPseudonym != "" ||
		r.SessionKeys != nil || r.ModelVersion != "" || r.Mode != "random" || r.Decision != "anonymous" || r.IdentitySource != "anonymous" {
		t.Fatalf("second record %+v", r)
	}
	if rec.RequestIDsGenerated() != 0 || rec.UserIDsRejected() != 0 {
		t.Fatalf("generated %d, rejected %d", rec.RequestIDsGenerated(), rec.UserIDsRejected())
	}
}

// equalRecords compares the fields a test sets (times with Equal).
func equalRecords(a, b Record) bool {
	at, bt := a.DecisionTime, b.DecisionTime
	a.DecisionTime, b.DecisionTime = time.Time{}, time.Time{}
	ab, _ := json.Marshal(a)
	bb, _ := json.Marshal(b)
	return at.Equal(bt) && string(ab) == string(bb)
}

func TestRecorderRequestIDs(t *testing.T) {
	v4 := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	for _, tc := range []struct {
		in   string
		keep bool
	}{
		{"0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d", true},
		{"0A1B2C3D-4E5F-1A6B-8C7D-9E0F1A2B3C4D", true}, // version 1, upper case
		{"01890a5d-ac96-774b-bcce-b302099a8057", true}, // version 7
		{"00000000-0000-0000-0000-000000000000", true},
		{"", false},
		{"req-1", false},
		{"0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4", false},   // 35
		{"0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d0", false}, // 37
		{"0a1b2c3d4e5f-4a6b-8c7d-9e0f1a2b3c4d-", false},  // hyphens moved
		{"0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4g", false},
		{"{a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d", false},
		{"0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c\x00d", false},
		{"0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3cé", false}, // 36 bytes, not hex
		{strings.Repeat("a", 100000), false},
	} {
		sink := &memSink{}
		rec, _, closeW := newRecorderT(t, sink, 1, RecorderConfig{})
		rec.Audit(tc.in, "", sess, decision(affinity.KindHit), time.Now())
		closeW()
		got := sink.recs[0].RequestID
		switch {
		case tc.keep && (got != strings.ToLower(tc.in) || rec.RequestIDsGenerated() != 0):
			t.Errorf("%q: recorded as %q (generated %d), want it kept", tc.in, got, rec.RequestIDsGenerated())
		case !tc.keep && (!v4.MatchString(got) || rec.RequestIDsGenerated() != 1):
			t.Errorf("%.40q: recorded as %q (generated %d), want a new UUIDv4, counted", tc.in, got, rec.RequestIDsGenerated())
		}
	}
}

// TestRecorderSampling: at a rate that keeps nothing, decisions that make
// or change a binding are still all recorded.
func TestRecorderSampling(t *testing.T) {
	kinds := map[affinity.Kind]bool{ // recorded whatever the rate
		affinity.KindBind: true, affinity.KindRebind: true, affinity.KindMoved: true, affinity.KindMigrated: true,
		affinity.KindDrained: true, affinity.KindSpilled: true, affinity.KindFailover: true,
		affinity.KindHit: false, affinity.KindRandom: false, affinity.KindAnonymous: false,
		affinity.KindFallback: false, affinity.KindDegraded: false,
		"some-future-kind": true,
	}
	sink := &memSink{}
	rec, _, closeW := newRecorderT(t, sink, 1e-12, RecorderConfig{})
	const per = 50
	for k := range kinds {
		for range per {
			rec.Audit(NewRequestID(), "", sess, decision(k), time.Now())
		}
	}
	closeW()
	got := map[string]int{}
	for _, r := range sink.recs {
		got[r.Decision]++
	}
	for k, always := range kinds {
		if AlwaysRecorded(k) != always {
			t.Errorf("AlwaysRecorded(%s) = %v", k, !always)
		}
		if want := map[bool]int{true: per, false: 0}[always]; got[string(k)] != want {
			t.Errorf("%s: %d records, want %d", k, got[string(k)], want)
		}
	}
	if rec.w.Skipped() != 5*per {
		t.Errorf("skipped %d, want %d", rec.w.Skipped(), 5*per)
	}
}

func TestRecorderUserIDs(t *testing.T) {
	for _, tc := range []struct {
		name, user string
		max        int
		sealed     bool
	}{
		{"plain", "bob", 0, true},
		{"at the default limit", strings.Repeat("u", DefaultMaxUserIDBytes), 0, true},
		{"over the default limit", strings.Repeat("u", DefaultMaxUserIDBytes+1), 0, false},
		{"over a configured limit", strings.Repeat("u", 17), 16, false},
		{"under a configured limit", strings.Repeat("u", 500), 512, true},
		{"control character", "bob\nadmin", 0, false},
		{"DEL", "bob\x7f", 0, false},
		{"NUL", "\x00", 0, false},
		{"utf-8", "zoë", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := &memSink{}
			rec, sealer, closeW := newRecorderT(t, sink, 1, RecorderConfig{MaxUserIDBytes: tc.max})
			rec.Audit("", tc.user, sess, decision(affinity.KindBind), time.Now())
			closeW()
			r := sink.recs[0]
			if u, err := sealer.UserID(r); err != nil || (u == tc.user) != tc.sealed || (r.UserPseudonym != "") != tc.sealed {
				t.Fatalf("user id opens to %.20q, %v; pseudonym %q; want sealed %v", u, err, r.UserPseudonym, tc.sealed)
			}
			if want := map[bool]uint64{true: 0, false: 1}[tc.sealed]; rec.UserIDsRejected() != want {
				t.Fatalf("rejected %d, want %d", rec.UserIDsRejected(), want)
			}
		})
	}
}

func TestNewRecorderRefuses(t *testing.T) {
	w := newWriterT(t, &memSink{}, WriterConfig{})
	s := testSealer(t)
	for _, tc := range []struct {
		w   *Writer
		s   *Sealer
		cfg RecorderConfig
	}{{nil, s, RecorderConfig{}}, {w, nil, RecorderConfig{}}, {w, s, RecorderConfig{MaxUserIDBytes: -1}}} {
		if _, err := NewRecorder(tc.w, tc.s, tc.cfg); err == nil {
			t.Errorf("NewRecorder(%v, %v, %+v) accepted", tc.w != nil, tc.s != nil, tc.cfg)
		}
	}
}

// TestRecorderAllocations bounds what Audit allocates per request: a
// sampled-out hit with Envoy's request id allocates nothing; a recorded
// decision with a user id pays for sealing and the pseudonym.
func TestRecorderAllocations(t *testing.T) {
	rec, _, _ := newRecorderT(t, discard{}, 1e-12, RecorderConfig{})
	const rid = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
	if n := testing.AllocsPerRun(1000, func() { rec.Audit(rid, "alice", sess, decision(affinity.KindHit), time.Now()) }); n != 0 {
		t.Errorf("sampled-out hit: %v allocations, want 0", n)
	}
	rec, _, _ = newRecorderT(t, discard{}, 1, RecorderConfig{})
	n := testing.AllocsPerRun(1000, func() { rec.Audit(rid, "alice", sess, decision(affinity.KindHit), time.Now()) })
	t.Logf("recorded hit with a user id: %v allocations", n)
	if n > 20 {
		t.Errorf("recorded hit with a user id: %v allocations, want at most 20", n)
	}
}

// discard is a Sink that keeps nothing.
type discard struct{}

func (discard) Write(context.Context, []Record) error            { return nil }
func (discard) Delete(context.Context, string) (int, error)      { return 0, nil }
func (discard) Export(context.Context, string) ([]Record, error) { return nil, nil }
func (discard) Close() error                                     { return nil }

func BenchmarkRecorderAudit(b *testing.B) {
	const rid = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
	for _, bc := range []struct {
		name string
		rate float64
		user string
	}{{"sampled-out", 1e-12, "alice"}, {"recorded", 1, ""}, {"recorded+user", 1, "alice"}} {
		b.Run(bc.name, func(b *testing.B) {
			rec, _, _ := newRecorderT(b, discard{}, bc.rate, RecorderConfig{})
			b.ReportAllocs()
			for b.Loop() {
				rec.Audit(rid, bc.user, sess, decision(affinity.KindHit), time.Now())
			}
		})
	}
}
