package affinity

import "time"

// EngineReading is what an instance's serving engine (vLLM, SGLang) last
// said on its /metrics, summed over its data-parallel engines. One replica
// scrapes each instance and the others learn the reading through the load
// sync; a reading older than the staleness bound is not used.
type EngineReading struct {
	// Waiting and Running are the requests queued and being served.
	Waiting, Running int
	// KVUsage is the share of KV-cache blocks in use, 0 to 1 (the mean over
	// data-parallel engines); KVKnown is false when the engine gave none.
	KVUsage float64
	KVKnown bool
	// PrefixHits and PrefixQueries are the engine's own cumulative counters
	// of prompt tokens served from the prefix cache and looked up in it;
	// Preemptions its cumulative preemptions. PrefixKnown is false when the
	// engine publishes no prefix-cache counters.
	PrefixHits, PrefixQueries float64
	PrefixKnown               bool
	Preemptions               float64
	// HitRate, QueryRate and PreemptionRate are per second between this
	// reading and the one before it; RatesKnown is false for the first
	// reading and after a counter went backwards (an engine restart).
	HitRate, QueryRate, PreemptionRate float64
	RatesKnown                         bool
	// At is when the reading was taken, by the scraping replica's clock.
	At time.Time
}
