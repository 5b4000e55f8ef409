package audit

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

func randKey(t testing.TB) []byte {
	t.Helper()
	b := make([]byte, KeySize)
	_, _ = rand.Read(b)
	return b
}

func testSealer(t testing.TB) *Sealer {
	t.Helper()
	s, err := NewSealer([]Key{{ID: "k2", Bytes: randKey(t)}}, randKey(t))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestNewRequestID(t *testing.T) {
	re := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	a, b := NewRequestID(), NewRequestID()
	if !re.MatchString(a) || a == b {
		t.Fatalf("NewRequestID: %q, %q", a, b)
	}
}

func TestSealerRoundTrip(t *testing.T) {
	s := testSealer(t)
	ct, kid := s.Seal("req-1", "alice@example.com")
	if kid != "k2" || bytes.Contains(ct, []byte("alice")) {
		t.Fatalf("Seal: key %q, ciphertext %x", kid, ct)
	}
	ct2, _ := s.Seal("req-1", "alice@example.com")
	if bytes.Equal(ct, ct2) {
		t.Fatal("two seals of one value are equal: nonce reused")
	}
	got, err := s.Open("req-1", ct, kid)
	if err != nil || got != "alice@example.com" {
		t.Fatalf("Open = %q, %v", got, err)
	}
	if p := s.Pseudonym("alice@example.com"); len(p) != 64 || p != s.Pseudonym("alice@example.com") || p == s.Pseudonym("bob") {
		t.Fatalf("Pseudonym %q", p)
	}
}

func TestSealerOpenErrors(t *testing.T) {
	s := testSealer(t)
	ct, kid := s.Seal("req-1", "alice")
	tampered := append([]byte(nil), ct...)
	tampered[len(tampered)-1] ^= 1
	other := testSealer(t) // same key id "k2", another key
	for _, tc := range []struct {
		name string
		s    *Sealer
		req  string
		ct   []byte
		kid  string
		want error
	}{
		{"unknown key id", s, "req-1", ct, "k9", ErrUnknownKey},
		{"tampered", s, "req-1", tampered, kid, ErrOpen},
		{"truncated", s, "req-1", ct[:10], kid, ErrOpen},
		{"swapped request id", s, "req-2", ct, kid, ErrOpen},
		{"other key same id", other, "req-1", ct, kid, ErrOpen},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.s.Open(tc.req, tc.ct, tc.kid)
			if !errors.Is(err, tc.want) || got != "" {
				t.Fatalf("Open = %q, %v; want %v", got, err, tc.want)
			}
			if strings.Contains(err.Error(), "alice") {
				t.Fatalf("error leaks the plaintext: %v", err)
			}
		})
	}
}

func TestSealerRotation(t *testing.T) {
	oldK, newK, pk := randKey(t), randKey(t), randKey(t)
	before, err := NewSealer([]Key{{ID: "old", Bytes: oldK}}, pk)
	if err != nil {
		t.Fatal(err)
	}
	var r Record
	r.RequestID = "req-1"
	before.Attach(&r, "alice")
	after, err := NewSealer([]Key{{ID: "new", Bytes: newK}, {ID: "old", Bytes: oldK}}, pk)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := after.UserID(r); err != nil || got != "alice" {
		t.Fatalf("old record after rotation: %q, %v", got, err)
	}
	if after.Pseudonym("alice") != r.UserPseudonym {
		t.Fatal("pseudonym changed with the encryption key")
	}
	if _, kid := after.Seal("req-2", "alice"); kid != "new" {
		t.Fatalf("seals with %q, want the first key", kid)
	}
}

func TestParseKey(t *testing.T) {
	k := randKey(t)
	for _, tc := range []struct {
		name, in, wantErr string
	}{
		{"hex", hex.EncodeToString(k), ""},
		{"hex upper", strings.ToUpper(hex.EncodeToString(k)), ""},
		{"base64", base64.StdEncoding.EncodeToString(k), ""},
		{"base64 raw url", base64.RawURLEncoding.EncodeToString(k), ""},
		{"spaces", "  " + hex.EncodeToString(k) + "\n", ""},
		{"empty", "", "empty key"},
		{"short hex", hex.EncodeToString(k[:16]), "16 bytes, want 32"},
		{"long base64", base64.StdEncoding.EncodeToString(append(k, 1)), "33 bytes, want 32"},
		{"bad encoding", "not a key at all!!", "neither hex nor base64"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseKey(tc.in)
			if tc.wantErr == "" {
				if err != nil || !bytes.Equal(got, k) {
					t.Fatalf("ParseKey = %x, %v", got, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("ParseKey error %v, want %q", err, tc.wantErr)
			}
			if tc.in != "" && strings.Contains(err.Error(), strings.TrimSpace(tc.in)) {
				t.Fatalf("error leaks the key: %v", err)
			}
		})
	}
}

func TestParseKeyringErrors(t *testing.T) {
	k := hex.EncodeToString(randKey(t))
	for _, tc := range []struct{ name, in, want string }{
		{"empty", "# nothing\n", "no keys"},
		{"no id", k, "want id=key"},
		{"bad id", "a b=" + k, "only letters"},
		{"duplicate", "a=" + k + ",a=" + k, "appears twice"},
		{"bad key", "a=zz", `key "a"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseKeyring(tc.in)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
			if strings.Contains(err.Error(), k) {
				t.Fatalf("error leaks a key: %v", err)
			}
		})
	}
	// A bare padded base64 key (openssl rand -base64 32) is cut at its
	// '=' padding: the part before it must not be quoted as an id.
	for _, bare := range []string{"Dt0dm+o45hwkLJxcJfeFSqaCfr6yx4ltVd/kTC/ISfM=", "Dt0dm-o45hwkLJxcJfeFSqaCfr6yx4ltVd_kTC_ISfMab="} {
		_, err := ParseKeyring(bare)
		if err == nil || strings.Contains(err.Error(), bare[:20]) {
			t.Fatalf("bare key %q: error %v; want one that does not quote it", bare[:6], err)
		}
	}
}

func TestLoadSealer(t *testing.T) {
	k1, k2, pk := hex.EncodeToString(randKey(t)), base64.StdEncoding.EncodeToString(randKey(t)), hex.EncodeToString(randKey(t))
	dir := t.TempDir()
	file := filepath.Join(dir, "keys")
	if err := os.WriteFile(file, []byte("# current first\nk2="+k2+"\nk1="+k1+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TEST_AUDIT_PSEUDONYM", pk)
	t.Setenv("TEST_AUDIT_KEYS", "k1="+k1)
	s, err := LoadSealer(KeyConfig{KeysFile: file, KeysEnv: "TEST_AUDIT_KEYS", PseudonymEnv: "TEST_AUDIT_PSEUDONYM"})
	if err != nil {
		t.Fatal(err)
	}
	if s.CurrentKeyID() != "k2" {
		t.Fatalf("current key %q, want k2 (the file wins, first entry)", s.CurrentKeyID())
	}
	s, err = LoadSealer(KeyConfig{KeysEnv: "TEST_AUDIT_KEYS", PseudonymEnv: "TEST_AUDIT_PSEUDONYM"})
	if err != nil || s.CurrentKeyID() != "k1" {
		t.Fatalf("from env: %v", err)
	}
	for _, tc := range []struct {
		name string
		cfg  KeyConfig
		want string
	}{
		{"missing env", KeyConfig{KeysEnv: "TEST_AUDIT_UNSET", PseudonymEnv: "TEST_AUDIT_PSEUDONYM"}, "TEST_AUDIT_UNSET is not set"},
		{"missing file", KeyConfig{KeysFile: filepath.Join(dir, "nope"), PseudonymEnv: "TEST_AUDIT_PSEUDONYM"}, "no such file"},
		{"nothing", KeyConfig{PseudonymEnv: "TEST_AUDIT_PSEUDONYM"}, "neither a file nor"},
		{"no pseudonym key", KeyConfig{KeysEnv: "TEST_AUDIT_KEYS"}, "pseudonym key"},
		{"pseudonym key reused", KeyConfig{KeysEnv: "TEST_AUDIT_KEYS", PseudonymEnv: "TEST_AUDIT_SAME"}, "use separate keys"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("TEST_AUDIT_SAME", k1)
			_, err := LoadSealer(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
			for _, k := range []string{k1, k2, pk} {
				if strings.Contains(err.Error(), k) {
					t.Fatalf("error leaks a key: %v", err)
				}
			}
		})
	}
}
