package loadgen

import (
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/tetherproxy/tether/lab/workload"
)

// WriteTable writes the summary of res as aligned text tables: the run, the
// totals, the figures per kind, the requests per instance and tether's
// decisions.
func (res *Result) WriteTable(w io.Writer) error {
	s, set := res.Summary, res.Settings
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(cells ...any) {
		for i, c := range cells {
			if i > 0 {
				fmt.Fprint(tw, "\t")
			}
			fmt.Fprint(tw, c)
		}
		fmt.Fprintln(tw)
	}
	row("target", set.Target)
	row("load", fmt.Sprintf("%g requests/s (%.3g new conversations/s, %.2f requests each), %v, drain %v, think scale %g, max in flight %d, seed %d",
		set.Rate, set.ConversationRate, set.MeanRequestsPerConversation, set.Duration, set.Drain, set.ThinkScale, set.MaxInFlight, set.Seed))
	row("mix", fmt.Sprintf("%v; identities %v", set.Mix, set.Identities))
	elapsed := res.Elapsed.Round(time.Millisecond).String()
	if res.Interrupted {
		elapsed += " (interrupted)"
	}
	row("elapsed", elapsed)
	row("requests", fmt.Sprintf("%d: ok %d (%.1f/s), failed %d, dropped %d, cancelled %d", s.Requests, s.OK, res.OKPerSecond, s.Failed, s.Dropped, s.Cancelled))
	row("conversations", fmt.Sprintf("%d: completed %d, turns not sent %d", s.Conversations, s.ConversationsCompleted, s.TurnsNotSent))
	row("KV hit rate", fmt.Sprintf("%s (%d of %d prompt tokens cached; %d completion tokens)", percent(s.KVHitRate), s.CachedTokens, s.PromptTokens, s.CompletionTokens))
	row("latency", durations(s.Latency))
	ttfb := "ttfb"
	if set.Stream {
		ttfb = "ttfb (first token)"
	}
	row(ttfb, durations(s.TTFB))
	row("continuity", fmt.Sprintf("%s (%d of %d follow-up turns on the instance of the turn before)", percent(s.Continuity), s.FollowUpsSameInstance, s.FollowUps))
	row("load imbalance", fmt.Sprintf("%.2f (max / mean requests per instance, %d instances)", s.LoadImbalance, len(s.RequestsPerInstance)))
	row()

	row("kind", "requests", "ok", "KV hit rate", "continuity", "p50", "p90", "p99")
	for _, k := range workload.Kinds() {
		ks, ok := s.ByKind[k]
		if !ok {
			continue
		}
		cont := "-"
		if k == workload.KindMultiTurn {
			cont = percent(ks.Continuity)
		}
		row(k, ks.Requests, ks.OK, percent(ks.KVHitRate), cont, ms(ks.Latency.P50), ms(ks.Latency.P90), ms(ks.Latency.P99))
	}

	if len(s.RequestsPerInstance) > 0 {
		row()
		row("instance", "requests")
		for _, name := range sortedKeys(s.RequestsPerInstance) {
			row(name, s.RequestsPerInstance[name])
		}
	}
	if len(s.Errors) > 0 {
		row()
		row("error", "requests")
		for _, msg := range byCount(s.Errors) {
			row(msg, s.Errors[msg])
		}
	}
	if len(s.Decisions) > 0 {
		row()
		row("tether decision", "requests")
		for _, name := range sortedKeys(s.Decisions) {
			row(name, s.Decisions[name])
		}
	}
	return tw.Flush()
}

func sortedKeys(m map[string]int) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// byCount returns the keys of m, the largest count first.
func byCount(m map[string]int) []string {
	keys := sortedKeys(m)
	slices.SortStableFunc(keys, func(a, b string) int { return m[b] - m[a] })
	return keys
}

func percent(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) }

func ms(d time.Duration) string { return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond)) }

func durations(p Percentiles) string {
	return fmt.Sprintf("p50 %s  p90 %s  p99 %s  max %s  mean %s", ms(p.P50), ms(p.P90), ms(p.P99), ms(p.Max), ms(p.Mean))
}
