// Package file is the routing audit's JSON-lines sink, audit.sink = "file".
// It writes one 0600 file per UTC day in a directory, pruned past the
// retention.
package file

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tetherproxy/tether/audit"
)

// Config configures a Sink.
type Config struct {
	// Dir holds the files (created 0700 if missing).
	Dir string
	// Retention is at least 24h, since files are per day, and at most
	// MaxRetention.
	Retention time.Duration
	// Now is the clock, time.Now by default. Files are named by its UTC
	// day.
	Now func() time.Time
}

// Validate checks the configuration.
func (c Config) Validate() error {
	if c.Dir == "" {
		return errors.New("audit file sink: dir is empty")
	}
	if err := audit.CheckRetention(c.Retention); err != nil {
		return fmt.Errorf("audit file sink: %w", err)
	}
	if c.Retention < 24*time.Hour {
		return fmt.Errorf("audit file sink: retention %v: files are per day, want at least 24h", c.Retention)
	}
	return nil
}

const (
	filePrefix = "audit-"
	fileSuffix = ".jsonl"
	dayLayout  = "2006-01-02"
)

// Sink writes JSON lines, one file per UTC day, named
// audit-YYYY-MM-DD.jsonl, mode 0600. The file of day D is removed once
// D + Retention has passed. So no record is older than Retention, and the
// oldest kept are at least Retention − 24h old. Removal happens when the
// sink opens, when it moves to a new day's file, and on Prune.
type Sink struct {
	cfg Config

	mu   sync.Mutex
	f    *os.File
	day  string   // the day f belongs to
	lock *os.File // the directory's lock file (see locked)
}

var (
	_ audit.Sink   = (*Sink)(nil)
	_ audit.Pruner = (*Sink)(nil)
)

// New validates cfg, creates the directory, removes expired files
// and files left behind by an interrupted Delete.
func New(cfg Config) (*Sink, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("audit file sink: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(cfg.Dir, lockName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("audit file sink: %w", err)
	}
	s := &Sink{cfg: cfg, lock: lock}
	err = s.locked(func() error {
		tmps, _ := filepath.Glob(filepath.Join(cfg.Dir, ".audit-*.tmp"))
		for _, t := range tmps {
			_ = os.Remove(t)
		}
		return s.prune()
	})
	if err != nil {
		_ = lock.Close()
		return nil, err
	}
	return s, nil
}

// lockName is the file every Sink on a directory locks while it changes
// the directory. The serving tether appends while `tether audit forget`,
// another process, rewrites files.
const lockName = ".audit.lock"

// locked runs fn holding the directory's lock. It is a flock, so it holds
// across processes.
func (s *Sink) locked(fn func() error) error {
	if err := syscall.Flock(int(s.lock.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("audit file sink: lock %s: %w", s.cfg.Dir, err)
	}
	defer func() { _ = syscall.Flock(int(s.lock.Fd()), syscall.LOCK_UN) }()
	return fn()
}

// files lists the sink's files with their day, oldest first.
func (s *Sink) files() ([]string, error) {
	ents, err := os.ReadDir(s.cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("audit file sink: %w", err)
	}
	var out []string
	for _, e := range ents {
		if _, ok := fileDay(e.Name()); ok && e.Type().IsRegular() {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out) // the day layout sorts by time
	return out, nil
}

func fileDay(name string) (time.Time, bool) {
	d, ok := strings.CutPrefix(name, filePrefix)
	if !ok {
		return time.Time{}, false
	}
	d, ok = strings.CutSuffix(d, fileSuffix)
	if !ok {
		return time.Time{}, false
	}
	t, err := time.Parse(dayLayout, d)
	return t, err == nil
}

// Prune removes the files whose day began Retention ago or longer.
func (s *Sink) Prune(context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.locked(s.prune)
}

func (s *Sink) prune() error {
	names, err := s.files()
	if err != nil {
		return err
	}
	cutoff := s.cfg.Now().Add(-s.cfg.Retention)
	for _, n := range names {
		day, _ := fileDay(n)
		if day.After(cutoff) {
			continue
		}
		if s.f != nil && s.day == n {
			_ = s.f.Close()
			s.f, s.day = nil, ""
		}
		if err := os.Remove(filepath.Join(s.cfg.Dir, n)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("audit file sink: remove expired: %w", err)
		}
	}
	return nil
}

// Write appends recs to today's file and syncs it.
func (s *Sink) Write(_ context.Context, recs []audit.Record) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	for _, r := range recs {
		if err := enc.Encode(r); err != nil {
			return fmt.Errorf("audit file sink: encode: %w", err)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.locked(func() error { return s.append(buf.Bytes()) })
}

// append writes b to today's file. It opens the file anew when the day
// changed or another process replaced the file, as a forget does.
func (s *Sink) append(b []byte) error {
	name := filePrefix + s.cfg.Now().UTC().Format(dayLayout) + fileSuffix
	if s.f != nil && !s.current(name) {
		_ = s.f.Close()
		s.f, s.day = nil, ""
	}
	if s.f == nil || s.day != name {
		if s.f != nil {
			_ = s.f.Close()
			s.f, s.day = nil, ""
		}
		if err := s.prune(); err != nil { // rotation: a new day
			return err
		}
		f, err := os.OpenFile(filepath.Join(s.cfg.Dir, name), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err != nil {
			return fmt.Errorf("audit file sink: %w", err)
		}
		if err := f.Chmod(0o600); err != nil { // a file made by someone else
			_ = f.Close()
			return fmt.Errorf("audit file sink: %w", err)
		}
		s.f, s.day = f, name
	}
	if _, err := s.f.Write(b); err != nil {
		return fmt.Errorf("audit file sink: %w", err)
	}
	if err := s.f.Sync(); err != nil {
		return fmt.Errorf("audit file sink: %w", err)
	}
	return nil
}

// current reports whether the open file is still the one named name in
// the directory.
func (s *Sink) current(name string) bool {
	open, err1 := s.f.Stat()
	onDisk, err2 := os.Stat(filepath.Join(s.cfg.Dir, name))
	return err1 == nil && err2 == nil && os.SameFile(open, onDisk)
}

// pseudonymOf reads a line's pseudonym without decoding the whole record.
func pseudonymOf(line []byte) (string, bool) {
	var v struct {
		P string `json:"user_pseudonym"`
	}
	if err := json.Unmarshal(line, &v); err != nil {
		return "", false
	}
	return v.P, true
}

// each calls fn for every line of the file name.
func (s *Sink) each(name string, fn func(line []byte) error) error {
	f, err := os.Open(filepath.Join(s.cfg.Dir, name))
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }() // read only: a close error loses nothing
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		if err := fn(sc.Bytes()); err != nil {
			return err
		}
	}
	return sc.Err()
}

// Export returns the records of pseudonym from every unexpired file.
func (s *Sink) Export(ctx context.Context, pseudonym string) ([]audit.Record, error) {
	if pseudonym == "" {
		return nil, errors.New("audit file sink export: empty pseudonym")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []audit.Record
	err := s.locked(func() error {
		var err error
		out, err = s.export(ctx, pseudonym)
		return err
	})
	return out, err
}

func (s *Sink) export(ctx context.Context, pseudonym string) ([]audit.Record, error) {
	if err := s.prune(); err != nil {
		return nil, err
	}
	names, err := s.files()
	if err != nil {
		return nil, err
	}
	var out []audit.Record
	for _, n := range names {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		err := s.each(n, func(line []byte) error {
			if p, ok := pseudonymOf(line); !ok || p != pseudonym {
				return nil
			}
			var r audit.Record
			if err := json.Unmarshal(line, &r); err != nil {
				return err
			}
			out = append(out, r)
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("audit file sink export %s: %w", n, err)
		}
	}
	return out, nil
}

// Delete rewrites every file holding records of pseudonym without them.
// The kept lines go to a temporary 0600 file that is synced and renamed
// over the original. So a crash leaves either the old or the new file.
// Lines that do not parse are kept. Every file is read once.
func (s *Sink) Delete(ctx context.Context, pseudonym string) (int, error) {
	if pseudonym == "" {
		return 0, errors.New("audit file sink delete: empty pseudonym")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	total := 0
	err := s.locked(func() error {
		var err error
		total, err = s.delete(ctx, pseudonym)
		return err
	})
	return total, err
}

func (s *Sink) delete(ctx context.Context, pseudonym string) (int, error) {
	if s.f != nil { // reopened by the next Write, on the new inode
		_ = s.f.Close()
		s.f, s.day = nil, ""
	}
	names, err := s.files()
	if err != nil {
		return 0, err
	}
	total := 0
	for _, n := range names {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		k, err := s.rewrite(n, pseudonym)
		total += k
		if err != nil {
			return total, fmt.Errorf("audit file sink delete %s: %w", n, err)
		}
	}
	return total, nil
}

func (s *Sink) rewrite(name, pseudonym string) (int, error) {
	var kept bytes.Buffer
	removed := 0
	err := s.each(name, func(line []byte) error {
		if p, ok := pseudonymOf(line); ok && p == pseudonym {
			removed++
			return nil
		}
		kept.Write(line)
		kept.WriteByte('\n')
		return nil
	})
	if err != nil || removed == 0 {
		return 0, err
	}
	tmp, err := os.CreateTemp(s.cfg.Dir, ".audit-*.tmp") // CreateTemp makes it 0600
	if err != nil {
		return 0, err
	}
	defer func() { _ = os.Remove(tmp.Name()) }() // after a successful rename: nothing to remove
	if _, err := tmp.Write(kept.Bytes()); err != nil {
		_ = tmp.Close()
		return 0, err
	}
	if err := tmp.Sync(); err != nil {
		_ = tmp.Close()
		return 0, err
	}
	if err := tmp.Close(); err != nil {
		return 0, err
	}
	if err := os.Rename(tmp.Name(), filepath.Join(s.cfg.Dir, name)); err != nil {
		return 0, err
	}
	if d, err := os.Open(s.cfg.Dir); err == nil { // make the rename durable
		_ = d.Sync()
		_ = d.Close()
	}
	return removed, nil
}

// Close closes the current file.
func (s *Sink) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	_ = s.lock.Close()
	if s.f == nil {
		return nil
	}
	err := s.f.Close()
	s.f, s.day = nil, ""
	return err
}
