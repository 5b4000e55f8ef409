package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/tetherproxy/tether/admin"
	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/progress"
)

// migrateStallBatches stops a migration that marks nothing this many
// batches in a row while sessions remain. It stops with an error instead
// of looping.
const migrateStallBatches = 3

func newSessionsCmd() *cobra.Command {
	var adminURL string
	cmd := &cobra.Command{
		Use:   "sessions",
		Short: "Inspect sessions, migrate them to another model version, drain an instance (through a running tether's admin API)",
		Long: `Inspect sessions and move them, through a running tether's admin API (the only way to reach the
embedded store). Moves are marks: each marked session moves at its next turn, so no request is
failed or cut. Every replica sharing the Redis sees them. When the admin API requires a token
(server.admin_token_env), put it in the same variable here: $TETHER_ADMIN_TOKEN by default,
--admin-token-env names another.`,
		Example: `  tether sessions stats
  tether sessions show s:3q2-7wZx0VxQe9bJ4kL0Ag
  tether sessions show --session-id conv-1234
  tether sessions migrate --from-version v1 --to-version v2 --batch 500 --interval 2s
  tether sessions drain --instance gpu-7
  tether sessions drain --instance gpu-7 --undo`,
	}
	var tokenEnv string
	cmd.PersistentFlags().StringVar(&adminURL, "admin", "http://"+config.DefaultAdminAddr, "base URL of tether's admin server (server.admin_addr)")
	cmd.PersistentFlags().StringVar(&tokenEnv, "admin-token-env", config.DefaultAdminTokenEnv, "environment variable holding the admin API's bearer token (sent when set)")
	client := func() (*admin.Client, error) {
		c, err := admin.NewClient(adminURL, os.Getenv(tokenEnv))
		if err != nil {
			return nil, fmt.Errorf("--admin %q: want http://host:port", adminURL)
		}
		return c, nil
	}
	cmd.AddCommand(
		newSessionsStatsCmd(client),
		newSessionsShowCmd(client),
		newSessionsMigrateCmd(client),
		newSessionsDrainCmd(client),
	)
	return cmd
}

func newSessionsStatsCmd(client func() (*admin.Client, error)) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Active sessions, requests in flight, queue depth and drained flag per instance, with totals by zone and version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := client()
			if err != nil {
				return err
			}
			st, err := c.Stats(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), st)
			}
			return writeStats(cmd.OutOrStdout(), st)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the stats document as JSON")
	return cmd
}

// writeStats prints the stats as tables: instances, then zones, then versions.
func writeStats(w io.Writer, st admin.SessionStats) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "INSTANCE\tZONE\tVERSION\tCAPACITY\tACTIVE\tIN FLIGHT\tQUEUE\tDRAINED")
	for _, in := range st.Instances {
		queue := "-"
		if in.Queue != nil {
			queue = fmt.Sprint(*in.Queue)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%s\t%s\n", in.Name, dash(in.Zone), dash(in.Version), dash(in.Capacity),
			in.Active, in.InFlight, queue, yesNo(in.Drained))
	}
	for _, g := range []struct {
		title  string
		groups []admin.GroupStats
	}{{"ZONE", st.Zones}, {"VERSION", st.Versions}} {
		fmt.Fprintf(tw, "\n%s\tINSTANCES\tDRAINED\tACTIVE\tIN FLIGHT\tQUEUE\n", g.title)
		for _, gs := range g.groups {
			writeGroup(tw, dash(gs.Name), gs.GroupTotals)
		}
	}
	t := st.Total
	fmt.Fprintf(tw, "\ntotal: %d instances (%d drained), %d active sessions, %d requests in flight, queue depth %d\n",
		t.Instances, t.Drained, t.Active, t.InFlight, t.Queue)
	return tw.Flush()
}

func writeGroup(w io.Writer, name string, g admin.GroupTotals) {
	fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%d\n", name, g.Instances, g.Drained, g.Active, g.InFlight, g.Queue)
}

func newSessionsShowCmd(client func() (*admin.Client, error)) *cobra.Command {
	var (
		asJSON bool
		lr     admin.LookupRequest
	)
	cmd := &cobra.Command{
		Use:   "show {KEY | --session-id ID | --device-id ID [--user-id ID]}",
		Short: "Show one session: its instance, model version, age, expiry and pending move",
		Long: `Show one session, by its key as tether logs it ("s:…", "t:…", "d:…"), or by the identifier the
application knows: the session id, or the device id (with the user id when requests carry one).
tether hashes the identifier with its own secret; the raw value is neither logged nor echoed.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			byID := lr != (admin.LookupRequest{})
			if byID == (len(args) == 1) {
				return errors.New("show: give a session key or --session-id (or --device-id), not both")
			}
			c, err := client()
			if err != nil {
				return err
			}
			var s admin.SessionInfo
			if byID {
				s, err = c.Lookup(cmd.Context(), lr)
			} else {
				s, err = c.Session(cmd.Context(), args[0])
			}
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), s)
			}
			return writeSession(cmd.OutOrStdout(), s, time.Now())
		},
	}
	f := cmd.Flags()
	f.StringVar(&lr.SessionID, "session-id", "", "find the session by the application's session id")
	f.StringVar(&lr.DeviceID, "device-id", "", "find the session by device id")
	f.StringVar(&lr.UserID, "user-id", "", "with --device-id: the user id the requests carry")
	f.BoolVar(&asJSON, "json", false, "print the session as JSON")
	return cmd
}

func writeSession(w io.Writer, s admin.SessionInfo, now time.Time) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "key\t%s\n", s.Key)
	if s.Alias != "" {
		fmt.Fprintf(tw, "alias\t%s (linked to the key)\n", s.Alias)
	}
	if s.Source != "" {
		fmt.Fprintf(tw, "found by\t%s\n", s.Source)
	}
	fmt.Fprintf(tw, "instance\t%s\n", s.Instance)
	fmt.Fprintf(tw, "version\t%s\n", dash(s.Version))
	fmt.Fprintf(tw, "since\t%s (%s ago)\n", s.Since.Local().Format(time.RFC3339), now.Sub(s.Since).Round(time.Second))
	fmt.Fprintf(tw, "expires\tin %s if unused\n", (time.Duration(s.TTLMs) * time.Millisecond).Round(time.Second))
	move := "none"
	switch {
	case s.Move == nil:
	case s.Move.Version != "":
		move = fmt.Sprintf("to version %s at its next turn", s.Move.Version)
	case s.Move.Off != "":
		move = fmt.Sprintf("off %s at its next turn (drain)", s.Move.Off)
	}
	fmt.Fprintf(tw, "move\t%s\n", move)
	return tw.Flush()
}

// migrateOptions are the flags of `tether sessions migrate`.
type migrateOptions struct {
	req      admin.MigrateRequest
	interval time.Duration
	quiet    bool
	asJSON   bool
}

// migrateSummary is what `tether sessions migrate` did.
type migrateSummary struct {
	FromVersion string  `json:"from_version"`
	ToVersion   string  `json:"to_version"`
	Batches     int     `json:"batches"`
	Marked      int     `json:"marked"`
	Remaining   int     `json:"remaining"`
	Interrupted bool    `json:"interrupted,omitempty"`
	Seconds     float64 `json:"seconds"`
}

func newSessionsMigrateCmd(client func() (*admin.Client, error)) *cobra.Command {
	var o migrateOptions
	cmd := &cobra.Command{
		Use:   "migrate --from-version V1 --to-version V2",
		Short: "Move the sessions of one model version to another, a batch at a time, each at its next turn",
		Long: `Mark the sessions bound to --from-version, --batch at a time every --interval, to move to
--to-version at their next turn, until none is left (or Ctrl-C). Moving the version weights first
([[versions]]) stops new sessions from starting on the old version; otherwise they keep arriving
and the migration keeps going. A progress bar on standard error counts the sessions marked.`,
		Example: `  tether sessions migrate --from-version v1 --to-version v2
  tether sessions migrate --from-version v1 --to-version v2 --batch 1000 --interval 5s --quiet`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch {
			case o.req.Batch < 1 || o.req.Batch > admin.MaxMigrateBatch:
				return fmt.Errorf("--batch %d: want 1 to %d", o.req.Batch, admin.MaxMigrateBatch)
			case o.interval < 0:
				return fmt.Errorf("--interval %v: must not be negative", o.interval)
			}
			c, err := client()
			if err != nil {
				return err
			}
			var barTo io.Writer
			if !o.quiet {
				barTo = progress.Terminal(cmd.ErrOrStderr())
			}
			sum, runErr := runMigrate(cmd.Context(), c, o.req, o.interval, barTo)
			if sum.Batches > 0 || sum.Interrupted {
				var err error
				if o.asJSON {
					err = printJSON(cmd.OutOrStdout(), sum)
				} else {
					err = writemigrateSummary(cmd.OutOrStdout(), sum)
				}
				if err != nil {
					return err
				}
			}
			if runErr == nil && sum.Interrupted {
				runErr = fmt.Errorf("interrupted with %d sessions of %s left unmarked; run it again to go on", sum.Remaining, sum.FromVersion)
			}
			return runErr
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.req.FromVersion, "from-version", "", "the model version the sessions leave")
	f.StringVar(&o.req.ToVersion, "to-version", "", "the model version they move to (it needs a healthy, undrained instance)")
	f.IntVar(&o.req.Batch, "batch", admin.DefaultMigrateBatch, fmt.Sprintf("sessions marked per call, at most %d", admin.MaxMigrateBatch))
	f.DurationVar(&o.interval, "interval", time.Second, "pause between batches, so the sessions' new instances warm up gradually")
	f.BoolVar(&o.quiet, "quiet", false, "no progress bar")
	f.BoolVar(&o.asJSON, "json", false, "print the summary as JSON")
	_ = cmd.MarkFlagRequired("from-version")
	_ = cmd.MarkFlagRequired("to-version")
	return cmd
}

// runMigrate calls migrate until no session is left, ctx ends or a call
// fails. When ctx ends, the summary says Interrupted. barTo, when not nil,
// gets a progress bar.
func runMigrate(ctx context.Context, c *admin.Client, req admin.MigrateRequest, interval time.Duration, barTo io.Writer) (sum migrateSummary, err error) {
	start := time.Now()
	sum = migrateSummary{FromVersion: req.FromVersion, ToVersion: req.ToVersion}
	var bar *progress.Bar // drawn once the first answer gives a total
	defer func() {
		sum.Seconds = time.Since(start).Seconds()
		bar.End()
	}()
	stalled := 0
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		res, err := c.Migrate(ctx, req)
		if err != nil {
			if ctx.Err() != nil {
				sum.Interrupted = true
				return sum, nil
			}
			return sum, err
		}
		sum.Batches++
		sum.Marked += res.Marked
		sum.Remaining = res.Remaining
		if barTo != nil && sum.Marked+res.Remaining > 0 {
			total := int64(sum.Marked + res.Remaining)
			switch {
			case bar == nil:
				bar = progress.New(barTo, progress.Options{Total: total, Description: "sessions marked", Count: true, Predict: true})
			case res.Remaining == 0:
				bar.SetTotal(total) // the first total may have been an estimate
			case total > bar.Total():
				bar.SetTotal(total) // new sessions keep starting on the old version
			}
			bar.Set(int64(sum.Marked))
		}
		if res.Remaining == 0 {
			return sum, nil
		}
		if stalled = stalled + 1; res.Marked > 0 {
			stalled = 0
		}
		if stalled >= migrateStallBatches {
			return sum, fmt.Errorf("migrate: %d batches in a row marked nothing while %d sessions remain", stalled, res.Remaining)
		}
		timer.Reset(interval)
		select {
		case <-ctx.Done():
			sum.Interrupted = true
			return sum, nil
		case <-timer.C:
		}
	}
}

func writemigrateSummary(w io.Writer, s migrateSummary) error {
	state := "done"
	if s.Interrupted {
		state = "interrupted"
	}
	batches := "batches"
	if s.Batches == 1 {
		batches = "batch"
	}
	_, err := fmt.Fprintf(w, "%s: marked %d sessions of %s to move to %s at their next turn (%d %s, %.1fs); %d left unmarked\n",
		state, s.Marked, s.FromVersion, s.ToVersion, s.Batches, batches, s.Seconds, s.Remaining)
	return err
}

func newSessionsDrainCmd(client func() (*admin.Client, error)) *cobra.Command {
	var (
		instance string
		undo     bool
		asJSON   bool
	)
	cmd := &cobra.Command{
		Use:   "drain --instance NAME",
		Short: "Drain an instance: it takes no new session, and its sessions move at their next turn",
		Long: `Drain an instance: every replica stops placing new sessions on it within a second, and each of
its sessions moves to another instance at its next turn. --undo lets it take new sessions again;
sessions the drain already marked still move at their next turn.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := client()
			if err != nil {
				return err
			}
			var res admin.DrainResult
			if undo {
				res, err = c.Undrain(cmd.Context(), instance)
			} else {
				res, err = c.Drain(cmd.Context(), instance)
			}
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), res)
			}
			if undo {
				_, err = fmt.Fprintf(cmd.OutOrStdout(), "%s takes new sessions again (sessions the drain marked still move at their next turn)\n", res.Instance)
			} else {
				_, err = fmt.Fprintf(cmd.OutOrStdout(), "%s drained: no new sessions; %d sessions marked to move at their next turn, %d left unmarked\n",
					res.Instance, res.Marked, res.Remaining)
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&instance, "instance", "", "the instance's name")
	f.BoolVar(&undo, "undo", false, "stop draining the instance")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	_ = cmd.MarkFlagRequired("instance")
	return cmd
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// printJSON writes v to w as indented JSON, for the --json flags.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
