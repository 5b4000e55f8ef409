package fleet

import "time"

// EngineReading is what an instance's serving engine (vLLM, SGLang) last
// said on its /metrics, summed over its data-parallel engines. One replica
// scrapes each instance (engine.Parse reads the exposition, engine.Tracker
// adds the time and the rates). The others learn the reading through the
// load sync. A reading older than the staleness bound is not used.
type EngineReading struct {
	// Waiting and Running are the requests queued and being served, in
	// whole requests.
	Waiting, Running int
	// KVUsage is the share of KV-cache blocks in use, 0 to 1: the mean over
	// the data-parallel engines. KVKnown is false when the engine gave none.
	KVUsage float64
	KVKnown bool
	// PrefixHits and PrefixQueries are the engine's cumulative counts of
	// prompt tokens served from the prefix cache and looked up in it.
	// PrefixKnown is false when the engine publishes no such counters.
	PrefixHits, PrefixQueries float64
	PrefixKnown               bool
	// Preemptions is the engine's cumulative count of preempted requests
	// (SGLang: retracted); 0 when it publishes none.
	Preemptions float64
	// CacheTokens is the KV cache's capacity in tokens, as the engine
	// publishes it. 0 means not published.
	//   - vLLM: num_gpu_blocks × block_size, from vllm:cache_config_info.
	//   - SGLang: sglang:max_total_num_tokens, summed over its data-parallel
	//     ranks.
	CacheTokens int
	// HitRate, QueryRate and PreemptionRate are per second between this
	// reading and the one before it. RatesKnown is false for the first
	// reading and after a counter went backwards (an engine restart).
	HitRate, QueryRate, PreemptionRate float64
	RatesKnown                         bool
	// At is when the reading was taken, by the scraping replica's clock.
	At time.Time
}

// LoadReport is what one tether replica tells the others about the
// requests it has in flight, the queue depth instances last reported to it
// and the engines it scrapes.
type LoadReport struct {
	Replica  string
	InFlight map[string]int // instance → requests this replica has in flight to it
	Queue    map[string]int // instance → queue depth it last reported (absent: none known)
	// Engine holds the readings of the engines this replica scrapes.
	Engine map[string]EngineReading
}

// LoadState is the fleet's load as all replicas see it together. MergeLoad
// merges the replicas' reports into one.
type LoadState struct {
	Active   map[string]int  // instance → active sessions (from the session index)
	InFlight map[string]int  // instance → requests in flight, summed over the other live replicas
	Queue    map[string]int  // instance → the highest queue depth any live replica last saw
	Drained  map[string]bool // instances an operator is draining
	// Engine is the newest engine reading of each instance any other live
	// replica reported (absent: none).
	Engine map[string]EngineReading
	// Replicas is how many other replicas are live (their reports stand).
	Replicas int
}

// MergeLoad merges the live replicas' load reports into the load that
// replica self sees. reports may hold self's own report. Only instances
// are merged:
//   - Queue: the highest depth any report gives, self's included.
//   - InFlight: the sum over the other replicas. The caller counts self's
//     own requests apart.
//   - Engine: the newest reading of the other replicas. Of two taken at
//     the same time, the reading of the replica whose name sorts first
//     wins, so the order of reports does not matter.
//
// Replicas counts the other replicas' reports. Active and Drained are
// empty and no map is nil: the store fills those two itself.
func MergeLoad(self string, instances []string, reports []LoadReport) LoadState {
	m := merge{
		st:   LoadState{Active: map[string]int{}, InFlight: map[string]int{}, Queue: map[string]int{}, Drained: map[string]bool{}, Engine: map[string]EngineReading{}},
		from: map[string]string{},
	}
	for _, r := range reports {
		own := r.Replica == self
		if !own {
			m.st.Replicas++
		}
		for _, in := range instances {
			m.add(in, r, own)
		}
	}
	return m.st
}

// merge is MergeLoad's state: from names the replica whose reading
// st.Engine holds for each instance.
type merge struct {
	st   LoadState
	from map[string]string
}

// add merges what r says of instance in.
func (m *merge) add(in string, r LoadReport, own bool) {
	if q, ok := r.Queue[in]; ok {
		if cur, seen := m.st.Queue[in]; !seen || q > cur {
			m.st.Queue[in] = q
		}
	}
	if own {
		return
	}
	if n, ok := r.InFlight[in]; ok {
		m.st.InFlight[in] += n
	}
	if e, ok := r.Engine[in]; ok && m.newer(in, e, r.Replica) {
		m.st.Engine[in], m.from[in] = e, r.Replica
	}
}

// newer reports whether e, from replica, beats the reading held for in.
func (m *merge) newer(in string, e EngineReading, replica string) bool {
	cur, seen := m.st.Engine[in]
	switch {
	case !seen:
		return true
	case e.At.Equal(cur.At):
		return replica < m.from[in]
	}
	return e.At.After(cur.At)
}
