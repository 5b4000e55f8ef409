package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/audit/sinks"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/store"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

// auditStoreTimeout bounds each Redis round trip of `tether audit`. The
// command is off the request path, and a forget may pipeline hundreds of
// keys.
const auditStoreTimeout = 5 * time.Second

func newAuditCmd() *cobra.Command {
	var o auditOptions
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "Export or forget one user's routing audit records (forget also removes their session bindings)",
		Long: `Work on the routing audit ([audit] in the configuration): the records tether wrote, one per
decision, with the user id encrypted. Both subcommands read the same configuration file and
environment as tether serve (the keys, the sink, the Redis), find the user's records by their
keyed pseudonym, and never log the user id. --user - reads the user id from the first line of
standard input, which keeps it out of the process list and the shell history.`,
		Example: `  tether audit export --user alice@example.org --config tether.toml > alice.jsonl
  printf '%s\n' "$USER_ID" | tether audit forget --user - --config tether.toml`,
	}
	f := cmd.PersistentFlags()
	f.StringVar(&o.config, "config", "", "TOML configuration file (the one tether serve reads)")
	f.StringVar(&o.user, "user", "", `the user id, as requests carry it in identity.user_header ("-": read it from standard input)`)
	_ = cmd.MarkPersistentFlagRequired("user")
	cmd.AddCommand(newAuditExportCmd(&o), newAuditForgetCmd(&o))
	return cmd
}

// auditOptions are the flags both subcommands share.
type auditOptions struct {
	config, user string
}

func newAuditExportCmd(o *auditOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "export --user ID",
		Short: "Print the user's records as JSON lines, oldest first, with the user id decrypted",
		Long: `Print every stored record of the user as one JSON object per line on standard output, oldest
first, with the decrypted user_id (for a subject access request). A record sealed with a key the
keyring no longer holds is printed without user_id, and the command then fails after printing.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			a, err := openAudit(ctx, cmd, o, false)
			if err != nil {
				return err
			}
			defer a.close()
			recs, err := a.sink.Export(ctx, a.pseudonym)
			if err != nil {
				return fmt.Errorf("export: %w", err)
			}
			return writeExport(cmd.OutOrStdout(), a.sealer, recs)
		},
	}
}

// exported is one line of `tether audit export`. It is the record with
// the user id opened. It leaves out the ciphertext, its key id and the
// pseudonym.
type exported struct {
	audit.Record
	UserID string `json:"user_id,omitempty"`
}

func writeExport(w io.Writer, sealer *audit.Sealer, recs []audit.Record) error {
	sort.SliceStable(recs, func(i, j int) bool { return recs[i].DecisionTime.Before(recs[j].DecisionTime) })
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	failed := 0
	var firstErr error
	for _, r := range recs {
		u, err := sealer.UserID(r)
		if err != nil {
			if failed++; firstErr == nil {
				firstErr = err
			}
		}
		r.UserCiphertext, r.KeyID, r.UserPseudonym = nil, "", ""
		if err := enc.Encode(exported{Record: r, UserID: u}); err != nil {
			return fmt.Errorf("export: %w", err)
		}
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("export: %w", err)
	}
	if failed > 0 {
		return fmt.Errorf("export: %d of %d records printed without user_id: %w", failed, len(recs), firstErr)
	}
	return nil
}

// forgetResult is what `tether audit forget` removed.
type forgetResult struct {
	Records  int `json:"records"`
	Bindings int `json:"bindings"`
}

func newAuditForgetCmd(o *auditOptions) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "forget --user ID",
		Short: "Delete the user's records and the session bindings they name, and print how many",
		Long: `Delete the user's session bindings from the binding store (every session key their records
name: bindings, alias links, index entries), then their records from the sink. Decisions that
make or change a binding are always recorded, so every binding made while the audit was on is
found. Bindings go first: if that fails, the records (and the keys they hold) are kept, and the
command can be run again. A second run finds nothing and prints zeros. Sessions the user is
still sending requests to can be bound again at once: forget a user whose traffic has stopped.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			a, err := openAudit(ctx, cmd, o, true)
			if err != nil {
				return err
			}
			defer a.close()
			res, err := forget(ctx, a)
			if err != nil {
				return err
			}
			if asJSON {
				return json.NewEncoder(cmd.OutOrStdout()).Encode(res)
			}
			_, err = fmt.Fprintf(cmd.OutOrStdout(), "forgot %d audit records and %d session bindings\n", res.Records, res.Bindings)
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, `print {"records": N, "bindings": M}`)
	return cmd
}

func forget(ctx context.Context, a *auditEnv) (forgetResult, error) {
	recs, err := a.sink.Export(ctx, a.pseudonym)
	if err != nil {
		return forgetResult{}, fmt.Errorf("forget: read the records: %w", err)
	}
	var keys, instances []string
	for _, r := range recs {
		keys = append(keys, r.SessionKeys...)
		instances = append(instances, r.Instance)
	}
	slices.Sort(instances)
	instances = slices.Compact(instances)
	var res forgetResult
	if res.Bindings, err = a.store.Forget(ctx, keys, instances...); err != nil {
		return res, fmt.Errorf("forget: session bindings (the records are kept; run it again): %w", err)
	}
	if res.Records, err = a.sink.Delete(ctx, a.pseudonym); err != nil {
		return res, fmt.Errorf("forget: %d session bindings deleted, but the records: %w", res.Bindings, err)
	}
	return res, nil
}

// auditEnv is what a subcommand works with.
type auditEnv struct {
	sealer    *audit.Sealer
	pseudonym string
	sink      audit.Sink
	store     *redisstore.Store // nil unless needed
	closers   []func() error
}

func (a *auditEnv) close() {
	for _, c := range slices.Backward(a.closers) {
		_ = c()
	}
}

// openAudit reads the configuration, the user id and the keys, and opens
// the sink. It also opens the binding store when withStore is set, or when
// the sink is the store's Redis.
func openAudit(ctx context.Context, cmd *cobra.Command, o *auditOptions, withStore bool) (*auditEnv, error) {
	cfg := config.Default()
	if o.config != "" {
		var err error
		if cfg, err = config.Load(o.config); err != nil {
			return nil, err
		}
	}
	user, err := readUser(o.user, cmd.InOrStdin(), cfg.Identity.MaxValueBytes)
	if err != nil {
		return nil, err
	}
	sealer, err := audit.LoadSealer(sinks.Keys(cfg.Audit))
	if err != nil {
		return nil, err
	}
	a := &auditEnv{sealer: sealer, pseudonym: sealer.Pseudonym(user)}
	storeSink := cfg.Audit.Sink == config.AuditSinkRedis && cfg.Audit.RedisURL == ""
	if withStore || storeSink {
		if cfg.Redis.URL == store.Embedded {
			return nil, errors.New(`redis.url = "embedded": the bindings (and a Redis sink's records) live inside the tether process, ` +
				"out of reach of this command; set redis.url to the Redis tether uses")
		}
		st, err := redisstore.Open(ctx, cfg.Redis.URL, redisstore.Options{Timeout: auditStoreTimeout})
		if err != nil {
			return nil, fmt.Errorf("binding store: %w", err)
		}
		a.store = st
		a.closers = append(a.closers, st.Close)
		if err := st.Ping(ctx); err != nil {
			a.close()
			return nil, fmt.Errorf("binding store: %w", err)
		}
	}
	sink, closeSink, err := sinks.Open(ctx, cfg.Audit, a.store)
	if err != nil {
		a.close()
		return nil, err
	}
	a.sink = sink
	a.closers = append(a.closers, closeSink)
	return a, nil
}

// readUser checks the --user value. "-" reads the first line of in. Its
// errors never show the user id.
func readUser(flag string, in io.Reader, maxBytes int) (string, error) {
	user := flag
	if flag == "-" {
		line, err := bufio.NewReader(io.LimitReader(in, int64(maxBytes)+2)).ReadString('\n')
		if err != nil && !errors.Is(err, io.EOF) {
			return "", fmt.Errorf("--user -: read standard input: %w", err)
		}
		user = strings.TrimSuffix(strings.TrimSuffix(line, "\n"), "\r")
	}
	switch {
	case user == "":
		return "", errors.New("--user: empty user id")
	case len(user) > maxBytes:
		return "", fmt.Errorf("--user: the user id is longer than identity.max_value_bytes (%d bytes): tether records none that long", maxBytes)
	}
	for i := 0; i < len(user); i++ {
		if b := user[i]; b < 0x20 || b == 0x7f {
			return "", errors.New("--user: the user id has control characters: tether records none such")
		}
	}
	return user, nil
}
