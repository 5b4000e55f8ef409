package loadgen

import (
	"cmp"
	"math"
	"slices"
	"time"

	"github.com/tetherproxy/tether/lab/workload"
)

// Fate is what became of a request, as the load generator (the client) saw it.
type Fate string

const (
	// OK means a 2xx answer, read to the end.
	OK Fate = "ok"
	// Failed means no answer (connection refused, reset), a non-2xx status, or
	// an answer that could not be read.
	Failed Fate = "failed"
	// Dropped means not sent, because MaxInFlight requests were in flight.
	Dropped Fate = "dropped"
	// Cancelled means still running at the drain deadline (or when the run's
	// context ended), and cancelled.
	Cancelled Fate = "cancelled"
)

// Record is one request (or one request that was dropped).
type Record struct {
	// Conversation is the workload's conversation ID; Kind, App and
	// Identity describe it, Turn is the request's turn (from 0) and Turns
	// the turns the conversation has in all.
	Conversation string                `json:"conversation"`
	Kind         workload.Kind         `json:"kind"`
	App          string                `json:"app"`
	Identity     workload.IdentityKind `json:"identity"`
	Turn         int                   `json:"turn"`
	Turns        int                   `json:"turns"`

	// Start is when the request was sent (or dropped), from the start of
	// the run.
	Start time.Duration `json:"start_ns"`
	Fate  Fate          `json:"fate"`
	// Status is the HTTP status; 0 when no answer came.
	Status int    `json:"status,omitempty"`
	Error  string `json:"error,omitempty"`
	// Latency is from sending the request to the end of the answer's body;
	// TTFB from sending it to the first byte of the body (with streaming,
	// the first token's event). Both are 0 for dropped requests.
	Latency time.Duration `json:"latency_ns"`
	TTFB    time.Duration `json:"ttfb_ns"`

	// The usage of the answer: usage.prompt_tokens,
	// usage.prompt_tokens_details.cached_tokens, usage.completion_tokens.
	PromptTokens     int `json:"prompt_tokens"`
	CachedTokens     int `json:"cached_tokens"`
	CompletionTokens int `json:"completion_tokens"`

	// Instance is the x-instance response header: the instance that
	// served the request. TetherDecision and TetherInstance are tether's
	// debug headers, when present.
	Instance       string `json:"instance,omitempty"`
	TetherDecision string `json:"tether_decision,omitempty"`
	TetherInstance string `json:"tether_instance,omitempty"`
}

// Summary condenses records. The definitions:
//
//   - KVHitRate = Σ cached tokens / Σ prompt tokens over the OK requests.
//   - Latency and TTFB percentiles are over the OK requests, by nearest
//     rank (p99 of 100 values is the 99th smallest).
//   - A follow-up is an OK request of turn k ≥ 1 whose turn k-1 is OK, both
//     naming their instance (x-instance). Continuity = follow-ups served by
//     the instance that served turn k-1 / follow-ups.
//   - RequestsPerInstance counts the requests each instance answered
//     (x-instance; failed ones included), LoadImbalance = max / mean of
//     those counts over the instances seen and the instances named in
//     Options.Instances (which count 0 when they served nothing).
//
// A ratio whose denominator is 0 is 0.
type Summary struct {
	Conversations int `json:"conversations"`
	// ConversationsCompleted had every turn answered OK.
	ConversationsCompleted int `json:"conversations_completed"`
	// Requests counts the records: OK + Failed + Dropped + Cancelled.
	Requests  int `json:"requests"`
	OK        int `json:"ok"`
	Failed    int `json:"failed"`
	Dropped   int `json:"dropped"`
	Cancelled int `json:"cancelled"`
	// TurnsNotSent counts the turns of the conversations that were never
	// sent: after a turn that did not end OK (the conversation ends there),
	// or because the run stopped starting requests.
	TurnsNotSent int `json:"turns_not_sent"`

	PromptTokens     int64   `json:"prompt_tokens"`
	CachedTokens     int64   `json:"cached_tokens"`
	CompletionTokens int64   `json:"completion_tokens"`
	KVHitRate        float64 `json:"kv_hit_rate"`

	Latency Percentiles `json:"latency"`
	TTFB    Percentiles `json:"ttfb"`

	FollowUps             int     `json:"follow_ups"`
	FollowUpsSameInstance int     `json:"follow_ups_same_instance"`
	Continuity            float64 `json:"continuity"`

	RequestsPerInstance map[string]int `json:"requests_per_instance"`
	LoadImbalance       float64        `json:"load_imbalance"`

	// Decisions counts the x-tether-decision values of the answers (absent
	// when tether is not in the path or its debug headers are off).
	Decisions map[string]int `json:"decisions,omitempty"`

	// Errors counts the error messages of the requests that did not end
	// OK, at most MaxErrorKinds different ones; the rest are counted under
	// OtherErrors.
	Errors map[string]int `json:"errors,omitempty"`

	// ByKind gives the figures per kind of conversation.
	ByKind map[workload.Kind]KindSummary `json:"by_kind"`
}

// KindSummary gives the figures of one kind of conversation, defined as in
// Summary.
type KindSummary struct {
	Requests   int         `json:"requests"`
	OK         int         `json:"ok"`
	KVHitRate  float64     `json:"kv_hit_rate"`
	Continuity float64     `json:"continuity"`
	Latency    Percentiles `json:"latency"`
}

// MaxErrorKinds bounds the different messages Summary.Errors keeps.
const MaxErrorKinds = 20

// OtherErrors is the key of Summary.Errors that counts the errors beyond
// MaxErrorKinds different ones.
const OtherErrors = "(other errors)"

// Percentiles describe a set of durations.
type Percentiles struct {
	P50  time.Duration `json:"p50_ns"`
	P90  time.Duration `json:"p90_ns"`
	P99  time.Duration `json:"p99_ns"`
	Max  time.Duration `json:"max_ns"`
	Mean time.Duration `json:"mean_ns"`
}

// Summarize computes the summary of records. instances, optional, names
// the instances that count in LoadImbalance even when they served nothing.
func Summarize(records []Record, instances []string) Summary {
	s := Summary{
		Requests:            len(records),
		RequestsPerInstance: map[string]int{},
		ByKind:              map[workload.Kind]KindSummary{},
	}
	for _, name := range instances {
		s.RequestsPerInstance[name] += 0
	}
	type kindAcc struct {
		tally
		requests, ok int
		latency      []time.Duration
	}
	kinds := map[workload.Kind]*kindAcc{}
	var all tally
	var latency, ttfb []time.Duration
	for _, r := range records {
		k := kinds[r.Kind]
		if k == nil {
			k = &kindAcc{}
			kinds[r.Kind] = k
		}
		k.requests++
		switch r.Fate {
		case OK:
			s.OK++
			k.ok++
			all.add(r)
			k.add(r)
			latency = append(latency, r.Latency)
			ttfb = append(ttfb, r.TTFB)
			k.latency = append(k.latency, r.Latency)
		case Failed:
			s.Failed++
		case Dropped:
			s.Dropped++
		case Cancelled:
			s.Cancelled++
		}
		if r.Fate != OK && r.Error != "" {
			if s.Errors == nil {
				s.Errors = map[string]int{}
			}
			if _, ok := s.Errors[r.Error]; ok || len(s.Errors) < MaxErrorKinds {
				s.Errors[r.Error]++
			} else {
				s.Errors[OtherErrors]++
			}
		}
		if r.Instance != "" {
			s.RequestsPerInstance[r.Instance]++
		}
		if r.TetherDecision != "" {
			if s.Decisions == nil {
				s.Decisions = map[string]int{}
			}
			s.Decisions[r.TetherDecision]++
		}
	}
	s.PromptTokens, s.CachedTokens, s.CompletionTokens = all.prompt, all.cached, all.completion
	s.KVHitRate = ratio(float64(all.cached), float64(all.prompt))
	s.Latency, s.TTFB = percentiles(latency), percentiles(ttfb)

	convs := conversations(records)
	s.Conversations = len(convs)
	follow := map[workload.Kind]*[2]int{} // follow-ups, same instance
	for _, turns := range convs {
		last := turns[len(turns)-1]
		if last.Fate == OK && last.Turn == last.Turns-1 && len(turns) == last.Turns {
			s.ConversationsCompleted++
		}
		s.TurnsNotSent += max(last.Turns-len(turns), 0)
		for i := 1; i < len(turns); i++ {
			prev, cur := turns[i-1], turns[i]
			if prev.Turn != cur.Turn-1 || prev.Fate != OK || cur.Fate != OK || prev.Instance == "" || cur.Instance == "" {
				continue
			}
			f := follow[cur.Kind]
			if f == nil {
				f = &[2]int{}
				follow[cur.Kind] = f
			}
			f[0]++
			s.FollowUps++
			if prev.Instance == cur.Instance {
				f[1]++
				s.FollowUpsSameInstance++
			}
		}
	}
	s.Continuity = ratio(float64(s.FollowUpsSameInstance), float64(s.FollowUps))

	if len(s.RequestsPerInstance) > 0 {
		most, total := 0, 0
		for _, n := range s.RequestsPerInstance {
			most = max(most, n)
			total += n
		}
		s.LoadImbalance = ratio(float64(most), float64(total)/float64(len(s.RequestsPerInstance)))
	}

	for kind, k := range kinds {
		ks := KindSummary{
			Requests:  k.requests,
			OK:        k.ok,
			KVHitRate: ratio(float64(k.cached), float64(k.prompt)),
			Latency:   percentiles(k.latency),
		}
		if f := follow[kind]; f != nil {
			ks.Continuity = ratio(float64(f[1]), float64(f[0]))
		}
		s.ByKind[kind] = ks
	}
	return s
}

// tally adds up token counts.
type tally struct{ prompt, cached, completion int64 }

func (t *tally) add(r Record) {
	t.prompt += int64(r.PromptTokens)
	t.cached += int64(r.CachedTokens)
	t.completion += int64(r.CompletionTokens)
}

// conversations groups records by conversation, each group sorted by turn.
func conversations(records []Record) map[string][]Record {
	convs := map[string][]Record{}
	for _, r := range records {
		convs[r.Conversation] = append(convs[r.Conversation], r)
	}
	for _, turns := range convs {
		slices.SortStableFunc(turns, func(a, b Record) int { return cmp.Compare(a.Turn, b.Turn) })
	}
	return convs
}

// percentiles of ds by nearest rank; ds is sorted in place.
func percentiles(ds []time.Duration) Percentiles {
	if len(ds) == 0 {
		return Percentiles{}
	}
	slices.Sort(ds)
	var total time.Duration
	for _, d := range ds {
		total += d
	}
	rank := func(p float64) time.Duration {
		i := int(math.Ceil(p*float64(len(ds)))) - 1
		return ds[min(max(i, 0), len(ds)-1)]
	}
	return Percentiles{
		P50:  rank(0.50),
		P90:  rank(0.90),
		P99:  rank(0.99),
		Max:  ds[len(ds)-1],
		Mean: total / time.Duration(len(ds)),
	}
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
