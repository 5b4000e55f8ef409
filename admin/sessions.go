package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
)

// Limits of the session operations.
const (
	// DefaultMigrateBatch is how many sessions one migrate call marks when
	// the request does not say.
	DefaultMigrateBatch = 100
	// MaxMigrateBatch bounds one migrate call.
	MaxMigrateBatch = 10000
	// MaxSessionKeyBytes bounds a session key in a request. tether's keys
	// are 24 bytes: "s:" and 22 base64url characters.
	MaxSessionKeyBytes = 64
)

// SessionOps serves the session operations on the admin server. It is the
// only way to reach sessions in the embedded store, and the API
// `tether sessions` is a client of:
//
//	GET    /v1/sessions/stats              sessions, requests in flight, queue depth and drained flag per instance, with totals
//	GET    /v1/sessions/{key}              one session by its key as tether logs it
//	POST   /v1/sessions/lookup             one session by the identifier the application knows
//	POST   /v1/sessions/migrate            ask a batch of one model version's sessions to move to another
//	POST   /v1/sessions/drain              drain an instance: no new sessions, its sessions move
//	DELETE /v1/sessions/drain/{instance}   stop draining an instance
//
// Moves take effect at each session's next turn. No request is failed or
// cut.
type SessionOps struct {
	index   SessionIndex
	drains  Drains
	load    LoadView
	fleet   *fleet.Fleet
	ids     *identity.Extractor
	headers identity.Config
	now     func() time.Time
	log     zerolog.Logger
}

// SessionIndex is what the session operations need of the binding store
// beyond the request path. It reads one session, counts the sessions per
// instance, and asks sessions to move. store/memory and store/redis
// implement it. store/storetest holds both to it.
type SessionIndex interface {
	// Show returns the session stored under key, following an alias link.
	// ok is false when there is none.
	Show(ctx context.Context, key string, now time.Time) (s bindings.Session, ok bool, err error)
	// Mark stores m as a pending move on the sessions selected by f that
	// have no pending move yet. It returns how many it marked, and how many
	// selected sessions are still unmarked after it. Both are 0 for an
	// instance without sessions.
	Mark(ctx context.Context, f bindings.MarkFilter, m bindings.Move, now time.Time) (marked, remaining int, err error)
	// Bound returns up to limit of the sessions bound to instance, read
	// from its index. A limit of 0 means all. Entries whose binding is gone
	// or elsewhere are left out. None gives an empty slice and no error.
	// TTL is each session's remaining idle lifetime.
	Bound(ctx context.Context, instance string, limit int, now time.Time) ([]bindings.Session, error)
}

// Drains keeps the set of drained instances every replica reads
// (replicas.LoadSyncer's SetDrained).
type Drains interface {
	SetDrained(ctx context.Context, instance string, drained bool) error
}

// LoadView is the decider's view of the fleet's load (affinity.Load).
type LoadView interface {
	Snapshot() fleet.LoadState
	Drained(instance string) bool
	Active(instance string) int
}

// SessionOpsConfig is what SessionOps works with.
type SessionOpsConfig struct {
	Index  SessionIndex
	Drains Drains
	// Load is the decider's view (affinity.Load). Stats read it. Migrate
	// reads which instances are drained from it.
	Load  LoadView
	Fleet *fleet.Fleet
	// Identity hashes the identifiers lookup is given. It uses the header
	// names of Headers, the configuration's identity section.
	Identity *identity.Extractor
	Headers  identity.Config
	Now      func() time.Time // default time.Now
	Logger   zerolog.Logger
}

// NewSessionOps returns the session operations over c.
func NewSessionOps(c SessionOpsConfig) *SessionOps {
	s := &SessionOps{index: c.Index, drains: c.Drains, load: c.Load, fleet: c.Fleet,
		ids: c.Identity, headers: c.Headers, now: c.Now, log: c.Logger}
	if s.now == nil {
		s.now = time.Now
	}
	return s
}

// Routes adds the session operations to mux.
func (s *SessionOps) Routes(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/sessions/stats", s.stats)
	mux.HandleFunc("GET /v1/sessions/{key}", s.show)
	mux.HandleFunc("POST /v1/sessions/lookup", s.lookup)
	mux.HandleFunc("POST /v1/sessions/migrate", s.migrate)
	mux.HandleFunc("POST /v1/sessions/drain", s.drain)
	mux.HandleFunc("DELETE /v1/sessions/drain/{instance}", s.undrain)
}

// SessionStats is the session heat map: GET /v1/sessions/stats.
type SessionStats struct {
	Time      time.Time       `json:"time"`
	Instances []InstanceStats `json:"instances"` // every configured instance, in configuration order
	Zones     []GroupStats    `json:"zones"`     // by zone name ("" for instances without one)
	Versions  []GroupStats    `json:"versions"`  // by model version
	Total     GroupTotals     `json:"total"`
}

// InstanceStats is one instance's load as this replica last synced it,
// with its own placements since. Replicas sync once a second.
type InstanceStats struct {
	Name     string `json:"name"`
	Zone     string `json:"zone,omitempty"`
	Version  string `json:"version"`
	Capacity string `json:"capacity,omitempty"`
	Active   int    `json:"active"`    // sessions bound to it
	InFlight int    `json:"in_flight"` // requests in flight to it, over every replica
	Queue    *int   `json:"queue"`     // the queue depth it last reported; null when it never did
	Drained  bool   `json:"drained"`
}

// GroupTotals sums instances.
type GroupTotals struct {
	Instances int `json:"instances"`
	Drained   int `json:"drained"` // instances drained
	Active    int `json:"active"`
	InFlight  int `json:"in_flight"`
	Queue     int `json:"queue"` // sum of the reported queue depths
}

// GroupStats sums the instances of one zone or one version.
type GroupStats struct {
	Name string `json:"name"`
	GroupTotals
}

// buildStats lays st out over the configured instances.
func buildStats(all []fleet.Instance, st fleet.LoadState, now time.Time) SessionStats {
	out := SessionStats{Time: now, Instances: make([]InstanceStats, 0, len(all))}
	zones, versions := map[string]*GroupTotals{}, map[string]*GroupTotals{}
	for _, in := range all {
		is := InstanceStats{Name: in.Name, Zone: in.Zone, Version: in.Version, Capacity: in.Capacity,
			Active: st.Active[in.Name], InFlight: st.InFlight[in.Name], Drained: st.Drained[in.Name]}
		if q, ok := st.Queue[in.Name]; ok {
			is.Queue = &q
		}
		out.Instances = append(out.Instances, is)
		for _, g := range []*GroupTotals{group(zones, in.Zone), group(versions, in.Version), &out.Total} {
			g.add(is)
		}
	}
	out.Zones, out.Versions = sortedGroups(zones), sortedGroups(versions)
	return out
}

func group(m map[string]*GroupTotals, name string) *GroupTotals {
	g, ok := m[name]
	if !ok {
		g = &GroupTotals{}
		m[name] = g
	}
	return g
}

func (g *GroupTotals) add(is InstanceStats) {
	g.Instances++
	if is.Drained {
		g.Drained++
	}
	g.Active += is.Active
	g.InFlight += is.InFlight
	if is.Queue != nil {
		g.Queue += *is.Queue
	}
}

func sortedGroups(m map[string]*GroupTotals) []GroupStats {
	out := make([]GroupStats, 0, len(m))
	for name, g := range m {
		out = append(out, GroupStats{Name: name, GroupTotals: *g})
	}
	slices.SortFunc(out, func(a, b GroupStats) int { return strings.Compare(a.Name, b.Name) })
	return out
}

func (s *SessionOps) stats(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, buildStats(s.fleet.All(), s.load.Snapshot(), s.now()))
}

// SessionInfo is one session: GET /v1/sessions/{key} and POST
// /v1/sessions/lookup.
type SessionInfo struct {
	Key string `json:"key"` // the session key the binding is stored under
	// Alias is the key asked for when it is an alias linked to Key. An
	// alias is a token or device that came with a session id.
	Alias string `json:"alias,omitempty"`
	// Source is the kind of identifier lookup was given: session, token or
	// device. It is empty for a lookup by key.
	Source   string    `json:"source,omitempty"`
	Instance string    `json:"instance"`
	Version  string    `json:"version,omitempty"`
	Since    time.Time `json:"since"`  // when the session was (last) placed
	TTLMs    int64     `json:"ttl_ms"` // until the binding expires if unused
	// Move is the pending operator move, if any.
	Move *MoveInfo `json:"move,omitempty"`
}

// MoveInfo is a pending move. Migrate moves to a model version. Drain
// moves off an instance.
type MoveInfo struct {
	Version string `json:"version,omitempty"`
	Off     string `json:"off,omitempty"`
}

// checkSessionKey refuses what cannot be a session key, before it reaches
// the store.
func checkSessionKey(key string) error {
	if key == "" || len(key) > MaxSessionKeyBytes {
		return fmt.Errorf("session key: want 1 to %d bytes, got %d", MaxSessionKeyBytes, len(key))
	}
	for i := 0; i < len(key); i++ {
		if b := key[i]; !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == ':' || b == '_' || b == '-') {
			return errors.New("session key: want only letters, digits, ':', '_' and '-'")
		}
	}
	return nil
}

func (s *SessionOps) show(w http.ResponseWriter, req *http.Request) {
	key := req.PathValue("key")
	if err := checkSessionKey(key); err != nil {
		writeJSON(w, http.StatusBadRequest, apiError{err.Error()})
		return
	}
	s.respondSession(w, req.Context(), key, "")
}

// respondSession shows the session under key.
func (s *SessionOps) respondSession(w http.ResponseWriter, ctx context.Context, key string, source identity.Source) {
	sess, ok, err := s.index.Show(ctx, key, s.now())
	if err != nil {
		storeFailed(w, err)
		return
	}
	if !ok {
		writeJSON(w, http.StatusNotFound, apiError{fmt.Sprintf("no session %s", key)})
		return
	}
	info := SessionInfo{Key: sess.Key, Source: string(source), Instance: sess.Binding.Instance,
		Version: sess.Binding.Version, Since: sess.Binding.Since, TTLMs: sess.TTL.Milliseconds()}
	if sess.Key != key {
		info.Alias = key
	}
	if sess.Move.Pending() {
		info.Move = &MoveInfo{Version: sess.Move.Version, Off: sess.Move.Off}
	}
	writeJSON(w, http.StatusOK, info)
}

// LookupRequest names a session by the identifier the application knows.
// That is one of a session id, a bearer token, or a device id. A device id
// comes with the user id when the application sends one. The value is
// hashed like a request's header and never logged or echoed.
type LookupRequest struct {
	SessionID string `json:"session_id,omitempty"`
	Token     string `json:"token,omitempty"`
	DeviceID  string `json:"device_id,omitempty"`
	UserID    string `json:"user_id,omitempty"`
}

// headers builds the request headers that carry r's identifier.
func (r LookupRequest) headers(names identity.Config) (identity.Map, error) {
	given := 0
	for _, v := range []string{r.SessionID, r.Token, r.DeviceID} {
		if v != "" {
			given++
		}
	}
	switch {
	case given == 0 && r.UserID != "":
		return nil, errors.New("user_id needs device_id (a device fingerprint cannot be rebuilt from the user id alone)")
	case given != 1:
		return nil, errors.New(`want exactly one of "session_id", "token" or "device_id" (with "user_id")`)
	case r.UserID != "" && r.DeviceID == "":
		return nil, errors.New("user_id goes with device_id only")
	}
	h := identity.Map{}
	switch {
	case r.SessionID != "":
		h[strings.ToLower(names.SessionHeader)] = r.SessionID
	case r.Token != "":
		tok := r.Token
		if scheme, _, ok := strings.Cut(tok, " "); !ok || !strings.EqualFold(scheme, "bearer") {
			tok = "Bearer " + tok
		}
		h[strings.ToLower(names.AuthHeader)] = tok
	default:
		h[strings.ToLower(names.DeviceHeader)] = r.DeviceID
		if r.UserID != "" {
			h[strings.ToLower(names.UserHeader)] = r.UserID
		}
	}
	return h, nil
}

func (s *SessionOps) lookup(w http.ResponseWriter, req *http.Request) {
	var lr LookupRequest
	if err := decodeBody(w, req, &lr); err != nil {
		writeJSON(w, http.StatusBadRequest, apiError{fmt.Sprintf("lookup: %v", err)})
		return
	}
	h, err := lr.headers(s.headers)
	if err != nil {
		writeJSON(w, http.StatusBadRequest, apiError{fmt.Sprintf("lookup: %v", err)})
		return
	}
	id := s.ids.Extract(h)
	if id.Rejected != identity.ReasonNone {
		writeJSON(w, http.StatusBadRequest, apiError{fmt.Sprintf("lookup: tether does not use this identifier (%s): requests carrying it are routed as anonymous", id.Rejected)})
		return
	}
	if id.Anonymous() {
		writeJSON(w, http.StatusBadRequest, apiError{"lookup: the identifier gives no session key"})
		return
	}
	s.respondSession(w, req.Context(), id.Key, id.Source)
}

// MigrateRequest asks sessions of one model version to move to another.
type MigrateRequest struct {
	FromVersion string `json:"from_version"`
	ToVersion   string `json:"to_version"`
	// Batch is how many sessions to mark at most. 0 means
	// DefaultMigrateBatch. It may not exceed MaxMigrateBatch.
	Batch int `json:"batch,omitempty"`
}

// MarkResult says what a migrate or drain call did. Marked sessions move
// at their next turn.
type MarkResult struct {
	Marked int `json:"marked"`
	// Remaining is how many selected sessions are still unmarked.
	Remaining int `json:"remaining"`
	// Estimated is set when the batch ran out before every instance was
	// read. Remaining then counts all the active sessions of the instances
	// left, marked ones included, so it may be too high. It is exact when
	// it is 0.
	Estimated bool `json:"estimated,omitempty"`
}

// migrateError is a refused migrate request.
type migrateError struct {
	code int
	msg  string
}

// checkMigrate refuses a migration that cannot proceed and returns the
// instances whose sessions it reads.
func (s *SessionOps) checkMigrate(mr *MigrateRequest) ([]fleet.Instance, *migrateError) {
	bad := func(format string, a ...any) *migrateError {
		return &migrateError{http.StatusBadRequest, fmt.Sprintf(format, a...)}
	}
	switch {
	case mr.FromVersion == "" || mr.ToVersion == "":
		return nil, bad("migrate: from_version and to_version are required")
	case mr.FromVersion == mr.ToVersion:
		return nil, bad("migrate: from_version and to_version are both %q", mr.FromVersion)
	case mr.Batch < 0 || mr.Batch > MaxMigrateBatch:
		return nil, bad("migrate: batch %d: want 1 to %d (0 or absent: %d)", mr.Batch, MaxMigrateBatch, DefaultMigrateBatch)
	}
	if mr.Batch == 0 {
		mr.Batch = DefaultMigrateBatch
	}
	var from []fleet.Instance
	to := false
	for _, in := range s.fleet.All() {
		switch in.Version {
		case mr.FromVersion:
			from = append(from, in)
		case mr.ToVersion:
			to = true
		}
	}
	for _, v := range []struct {
		name  string
		known bool
	}{{mr.FromVersion, len(from) > 0}, {mr.ToVersion, to}} {
		if !v.known {
			return nil, &migrateError{http.StatusNotFound, fmt.Sprintf("migrate: no instance of version %q in the fleet", v.name)}
		}
	}
	up := false
	for _, in := range s.fleet.All() {
		if in.Version == mr.ToVersion && !s.load.Drained(in.Name) {
			up = true
			break
		}
	}
	if !up {
		return nil, &migrateError{http.StatusConflict, fmt.Sprintf("migrate: no healthy, undrained instance of version %q to move sessions to", mr.ToVersion)}
	}
	return from, nil
}

// migrate marks up to a batch of the sessions bound to from_version, one
// instance after the other, to move to to_version at their next turn.
func (s *SessionOps) migrate(w http.ResponseWriter, req *http.Request) {
	var mr MigrateRequest
	if err := decodeBody(w, req, &mr); err != nil {
		writeJSON(w, http.StatusBadRequest, apiError{fmt.Sprintf("migrate: %v", err)})
		return
	}
	from, merr := s.checkMigrate(&mr)
	if merr != nil {
		writeJSON(w, merr.code, apiError{merr.msg})
		return
	}
	var res MarkResult
	now := s.now()
	left := mr.Batch
	for _, in := range from {
		if left == 0 {
			// SessionIndex.Mark cannot count without marking, since Limit
			// 0 means all. What the batch did not reach is estimated.
			res.Remaining += s.load.Active(in.Name)
			res.Estimated = true
			continue
		}
		f := bindings.MarkFilter{Instance: in.Name, Version: mr.FromVersion, Limit: left}
		marked, remaining, err := s.index.Mark(req.Context(), f, bindings.Move{Version: mr.ToVersion}, now)
		res.Marked += marked
		left -= marked
		if err != nil {
			s.log.Warn().Err(err).Str("from", mr.FromVersion).Str("to", mr.ToVersion).Int("marked", res.Marked).Msg("session migration stopped by a store error")
			storeFailed(w, fmt.Errorf("after marking %d sessions: %w", res.Marked, err))
			return
		}
		res.Remaining += remaining
	}
	s.log.Info().Str("from", mr.FromVersion).Str("to", mr.ToVersion).Int("marked", res.Marked).
		Int("remaining", res.Remaining).Msg("sessions marked to migrate at their next turn")
	writeJSON(w, http.StatusOK, res)
}

// DrainRequest names the instance to drain.
type DrainRequest struct {
	Instance string `json:"instance"`
}

// DrainResult says what a drain or undrain call did.
type DrainResult struct {
	Instance string `json:"instance"`
	Drained  bool   `json:"drained"`
	MarkResult
}

// drain stops new sessions on an instance and marks its sessions to move
// off it at their next turn. Every replica sees the drain at its next load
// sync, within a second.
func (s *SessionOps) drain(w http.ResponseWriter, req *http.Request) {
	var dr DrainRequest
	if err := decodeBody(w, req, &dr); err != nil {
		writeJSON(w, http.StatusBadRequest, apiError{fmt.Sprintf("drain: %v", err)})
		return
	}
	if dr.Instance == "" {
		writeJSON(w, http.StatusBadRequest, apiError{"drain: instance is required"})
		return
	}
	if _, ok := s.fleet.Lookup(dr.Instance); !ok {
		writeJSON(w, http.StatusNotFound, apiError{fmt.Sprintf("drain: no instance %q", dr.Instance)})
		return
	}
	if err := s.drains.SetDrained(req.Context(), dr.Instance, true); err != nil {
		storeFailed(w, err)
		return
	}
	res := DrainResult{Instance: dr.Instance, Drained: true}
	var err error
	res.Marked, res.Remaining, err = s.index.Mark(req.Context(), bindings.MarkFilter{Instance: dr.Instance},
		bindings.Move{Off: dr.Instance}, s.now())
	if err != nil {
		// Drained all the same. Its sessions leave at their next turn,
		// counted as "moved" rather than "drained".
		s.log.Warn().Err(err).Str("instance", dr.Instance).Int("marked", res.Marked).Msg("instance drained; marking its sessions failed")
		storeFailed(w, fmt.Errorf("instance drained, but marking its sessions failed after %d: %w", res.Marked, err))
		return
	}
	s.log.Info().Str("instance", dr.Instance).Int("marked", res.Marked).Int("remaining", res.Remaining).Msg("instance drained")
	writeJSON(w, http.StatusOK, res)
}

// undrain lets an instance take new sessions again. An instance that has
// left the fleet while drained can still be undrained, so that it does not
// come back drained under the same name.
func (s *SessionOps) undrain(w http.ResponseWriter, req *http.Request) {
	name := req.PathValue("instance")
	if _, ok := s.fleet.Lookup(name); !ok && !s.load.Drained(name) {
		writeJSON(w, http.StatusNotFound, apiError{fmt.Sprintf("undrain: no instance %q", name)})
		return
	}
	if err := s.drains.SetDrained(req.Context(), name, false); err != nil {
		storeFailed(w, err)
		return
	}
	s.log.Info().Str("instance", name).Msg("instance undrained")
	writeJSON(w, http.StatusOK, DrainResult{Instance: name, Drained: false})
}

// decodeBody reads one JSON object, with no unknown field and nothing after it.
func decodeBody(w http.ResponseWriter, req *http.Request, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(w, req.Body, 64<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			return errors.New("empty body, want a JSON object")
		}
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("unexpected data after the JSON object")
	}
	return nil
}

// storeFailed answers a request the session store could not serve.
func storeFailed(w http.ResponseWriter, err error) {
	writeJSON(w, http.StatusServiceUnavailable, apiError{fmt.Sprintf("session store: %v", err)})
}
