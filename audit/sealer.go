package audit

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
)

// KeySize is the length of every audit key: AES-256 and the HMAC key.
const KeySize = 32

// ErrUnknownKey is returned by Open for a key id the Sealer does not
// hold. The key may be retired, or the record from another deployment.
var ErrUnknownKey = errors.New("audit: unknown key id")

// ErrOpen is returned by Open when the ciphertext does not authenticate.
// It was tampered with, truncated, or sealed for another request id.
var ErrOpen = errors.New("audit: ciphertext does not authenticate")

// Key is one encryption key and its id. The id is stored with every
// ciphertext, so old records stay readable after the current key changes.
type Key struct {
	ID    string
	Bytes []byte
}

// ParseKey decodes a 32-byte key written as 64 hex digits or as base64.
// Base64 may use the standard or URL alphabet, padded or not. Its errors
// never contain the key.
func ParseKey(s string) ([]byte, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, errors.New("empty key")
	}
	// A string of hex digits only is hex. As base64 it would be a
	// coincidence. Anything else is tried as base64.
	if b, err := hex.DecodeString(s); err == nil {
		if len(b) != KeySize {
			return nil, fmt.Errorf("key decodes to %d bytes, want %d", len(b), KeySize)
		}
		return b, nil
	}
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		b, err := enc.DecodeString(s)
		if err != nil {
			continue
		}
		if len(b) != KeySize {
			return nil, fmt.Errorf("key decodes to %d bytes, want %d", len(b), KeySize)
		}
		return b, nil
	}
	return nil, fmt.Errorf("key is neither hex nor base64 (%d characters)", len(s))
}

// ParseKeyring parses "id=key" entries separated by commas or newlines.
// Blank lines and lines starting with '#' are skipped. The FIRST entry is
// the current key, which seals. The others only open. Ids are 1–32 of
// [A-Za-z0-9._-] and unique.
func ParseKeyring(text string) ([]Key, error) {
	var keys []Key
	seen := map[string]bool{}
	for _, line := range strings.FieldsFunc(text, func(r rune) bool { return r == ',' || r == '\n' || r == '\r' }) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		id, val, ok := strings.Cut(line, "=")
		id = strings.TrimSpace(id)
		if !ok {
			return nil, fmt.Errorf("audit keyring entry %d: want id=key", len(keys)+1)
		}
		if err := checkKeyID(id); err != nil {
			return nil, fmt.Errorf("audit keyring entry %d: %w", len(keys)+1, err)
		}
		if seen[id] {
			return nil, fmt.Errorf("audit keyring: key id %q appears twice", id)
		}
		b, err := ParseKey(val)
		if err != nil {
			return nil, fmt.Errorf("audit keyring key %q: %w", id, err)
		}
		seen[id] = true
		keys = append(keys, Key{ID: id, Bytes: b})
	}
	if len(keys) == 0 {
		return nil, errors.New("audit keyring: no keys")
	}
	return keys, nil
}

// checkKeyID never quotes a bad id. A key pasted without "id=" is cut at
// its padding, since padded base64 ends in '='. That key would then show
// up as the id.
func checkKeyID(id string) error {
	if id == "" || len(id) > 32 {
		return fmt.Errorf("key id of %d characters: want 1 to 32 (is the entry a bare key? write id=key)", len(id))
	}
	for _, r := range id {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return errors.New("key id: only letters, digits, '.', '_' and '-' (is the entry a bare key? write id=key)")
		}
	}
	return nil
}

// KeyConfig says where the keys come from. For each of the keyring and the
// pseudonym key, the file wins when both a file and a variable are named.
type KeyConfig struct {
	// KeysEnv / KeysFile hold a keyring (ParseKeyring), current key first.
	KeysEnv, KeysFile string
	// PseudonymEnv / PseudonymFile hold the single HMAC key (ParseKey).
	PseudonymEnv, PseudonymFile string
}

// read returns the text of file, else of the variable env.
func read(what, env, file string) (string, error) {
	switch {
	case file != "":
		b, err := os.ReadFile(file)
		if err != nil {
			return "", fmt.Errorf("audit %s file: %w", what, err)
		}
		return string(b), nil
	case env != "":
		v, ok := os.LookupEnv(env)
		if !ok || strings.TrimSpace(v) == "" {
			return "", fmt.Errorf("audit %s: environment variable %s is not set", what, env)
		}
		return v, nil
	}
	return "", fmt.Errorf("audit %s: neither a file nor an environment variable is configured", what)
}

// LoadSealer reads the keys cfg names and builds a Sealer.
func LoadSealer(cfg KeyConfig) (*Sealer, error) {
	text, err := read("keys", cfg.KeysEnv, cfg.KeysFile)
	if err != nil {
		return nil, err
	}
	keys, err := ParseKeyring(text)
	if err != nil {
		return nil, err
	}
	ptext, err := read("pseudonym key", cfg.PseudonymEnv, cfg.PseudonymFile)
	if err != nil {
		return nil, err
	}
	pk, err := ParseKey(ptext)
	if err != nil {
		return nil, fmt.Errorf("audit pseudonym key: %w", err)
	}
	return NewSealer(keys, pk)
}

// Sealer encrypts user ids for audit records and derives their pseudonyms.
// It is safe for concurrent use.
type Sealer struct {
	current string
	aeads   map[string]cipher.AEAD
	pkey    []byte
}

// NewSealer builds a Sealer. keys[0] seals, and every key opens.
// pseudonymKey keys the HMAC and must differ from the encryption keys.
func NewSealer(keys []Key, pseudonymKey []byte) (*Sealer, error) {
	if len(keys) == 0 {
		return nil, errors.New("audit sealer: no keys")
	}
	if len(pseudonymKey) != KeySize {
		return nil, fmt.Errorf("audit sealer: pseudonym key is %d bytes, want %d", len(pseudonymKey), KeySize)
	}
	s := &Sealer{current: keys[0].ID, aeads: make(map[string]cipher.AEAD, len(keys)), pkey: append([]byte(nil), pseudonymKey...)}
	for _, k := range keys {
		if err := checkKeyID(k.ID); err != nil {
			return nil, fmt.Errorf("audit sealer: %w", err)
		}
		if _, dup := s.aeads[k.ID]; dup {
			return nil, fmt.Errorf("audit sealer: key id %q appears twice", k.ID)
		}
		if len(k.Bytes) != KeySize {
			return nil, fmt.Errorf("audit sealer: key %q is %d bytes, want %d", k.ID, len(k.Bytes), KeySize)
		}
		if hmac.Equal(k.Bytes, pseudonymKey) {
			return nil, fmt.Errorf("audit sealer: key %q is also the pseudonym key; use separate keys", k.ID)
		}
		block, err := aes.NewCipher(k.Bytes)
		if err != nil {
			return nil, fmt.Errorf("audit sealer: key %q: %w", k.ID, err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, fmt.Errorf("audit sealer: key %q: %w", k.ID, err)
		}
		s.aeads[k.ID] = aead
	}
	return s, nil
}

// CurrentKeyID is the id of the key Seal uses.
func (s *Sealer) CurrentKeyID() string { return s.current }

// additionalData binds a ciphertext to its record's request id and key id.
// A ciphertext copied into another record does not open.
func additionalData(requestID, keyID string) []byte {
	return []byte("tether-audit-v1\x00" + keyID + "\x00" + requestID)
}

// Seal encrypts userID with the current key under a fresh random 96-bit
// nonce, bound to requestID. It returns nonce || ciphertext and the key id.
func (s *Sealer) Seal(requestID, userID string) ([]byte, string) {
	aead := s.aeads[s.current]
	out := make([]byte, aead.NonceSize(), aead.NonceSize()+len(userID)+aead.Overhead())
	_, _ = rand.Read(out) // crypto/rand.Read never fails (Go ≥ 1.24)
	return aead.Seal(out, out, []byte(userID), additionalData(requestID, s.current)), s.current
}

// Open decrypts a ciphertext Seal made for requestID under keyID.
func (s *Sealer) Open(requestID string, ciphertext []byte, keyID string) (string, error) {
	aead, ok := s.aeads[keyID]
	if !ok {
		return "", fmt.Errorf("audit open (key %q): %w", keyID, ErrUnknownKey)
	}
	n := aead.NonceSize()
	if len(ciphertext) < n+aead.Overhead() {
		return "", fmt.Errorf("audit open: %d bytes is too short: %w", len(ciphertext), ErrOpen)
	}
	pt, err := aead.Open(nil, ciphertext[:n], ciphertext[n:], additionalData(requestID, keyID))
	if err != nil {
		return "", fmt.Errorf("audit open (key %q): %w", keyID, ErrOpen)
	}
	return string(pt), nil
}

// Pseudonym is HMAC-SHA256(pseudonym key, userID) in hex. It is the same
// for every record of one user, and useless without the key.
func (s *Sealer) Pseudonym(userID string) string {
	m := hmac.New(sha256.New, s.pkey)
	m.Write([]byte(userID))
	return hex.EncodeToString(m.Sum(nil))
}

// Attach seals userID into r and sets its pseudonym. The seal is bound to
// r.RequestID, which must be set first. An empty userID leaves the fields
// empty.
func (s *Sealer) Attach(r *Record, userID string) {
	if userID == "" {
		r.UserCiphertext, r.KeyID, r.UserPseudonym = nil, "", ""
		return
	}
	r.UserCiphertext, r.KeyID = s.Seal(r.RequestID, userID)
	r.UserPseudonym = s.Pseudonym(userID)
}

// UserID opens r's user id. It is "" when r has none.
func (s *Sealer) UserID(r Record) (string, error) {
	if len(r.UserCiphertext) == 0 {
		return "", nil
	}
	return s.Open(r.RequestID, r.UserCiphertext, r.KeyID)
}
