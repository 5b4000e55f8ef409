package config

// Content is cache-aware placement ([content]). It covers the requests
// whose placement is open: a new session, one placed again, or an
// anonymous request. Each is placed by what the instances' KV caches hold
// of its prompt. The prompt is read from the request's body, which Envoy
// sends only for these requests.
type Content struct {
	// Enabled turns it on (the default).
	Enabled bool `toml:"enabled"`
	// BlockBytes is the size of a prompt block the index keeps.
	BlockBytes int `toml:"block_bytes" reload:"restart"`
	// MinMatchBytes is the shortest prefix match that decides.
	MinMatchBytes int `toml:"min_match_bytes"`
	// QueuedTokens is what one request waiting for its prefill on an
	// instance costs a prompt placed there, in prompt tokens.
	// RunningTokens is what one request running there costs it.
	QueuedTokens  int `toml:"queued_tokens"`
	RunningTokens int `toml:"running_tokens"`
	// MaxBodyBytes is the most of a body Envoy buffers for tether. A
	// longer body is placed by identity.
	MaxBodyBytes int `toml:"max_body_bytes"`
	// CacheTokens is an instance's KV-cache capacity in tokens when its
	// engine publishes none.
	CacheTokens int `toml:"cache_tokens"`
}

// Defaults and bounds of [content].
const (
	DefaultBlockBytes    = 256
	DefaultMinMatchBytes = 1024
	// DefaultQueuedTokens is about a prompt's worth of prefill. That is
	// what a request ahead in the queue makes the next one wait.
	DefaultQueuedTokens = 1024
	// DefaultRunningTokens is what one more sequence in a decode batch
	// costs, in prefill tokens. ../shared/calibration puts it at about
	// 0.1 ms a step on an H200, over a few hundred steps. The value was
	// chosen in the simulator (BENCHMARKS.md).
	DefaultRunningTokens = 224
	// MaxLoadTokens bounds queued_tokens and running_tokens.
	MaxLoadTokens = 1 << 20
	// DefaultContentBodyBytes is Envoy's own default buffer, a
	// connection's per_connection_buffer_limit_bytes.
	DefaultContentBodyBytes = 1 << 20
	MaxContentBodyBytes     = 64 << 20
	// DefaultCacheTokens is arithmetic, not a measurement. It is for a
	// Llama 3.1 8B engine on one 80 GB GPU with vLLM's default
	// gpu_memory_utilization of 0.9. That gives about 0.5 million tokens at
	// 128 KiB each, rounded down.
	DefaultCacheTokens = 400_000
	// CharsPerToken turns an engine's capacity in tokens into bytes of
	// prompt. The tokenizers of current models take about four characters
	// a token of English text.
	CharsPerToken = 4
)

func defaultContent() Content {
	return Content{Enabled: true, BlockBytes: DefaultBlockBytes, MinMatchBytes: DefaultMinMatchBytes,
		QueuedTokens: DefaultQueuedTokens, RunningTokens: DefaultRunningTokens,
		MaxBodyBytes: DefaultContentBodyBytes, CacheTokens: DefaultCacheTokens}
}

func (c *Config) validateContent(bad reporter) {
	ct := c.Content
	if n := ct.BlockBytes; n < 16 || n > 1<<16 {
		bad("content.block_bytes", n, "want 16 to 65536")
	}
	if n := ct.MinMatchBytes; n < 0 || n > MaxContentBodyBytes {
		bad("content.min_match_bytes", n, "want 0 to 67108864")
	}
	if n := ct.QueuedTokens; n < 0 || n > MaxLoadTokens {
		bad("content.queued_tokens", n, "want 0 to 1048576")
	}
	if n := ct.RunningTokens; n < 0 || n > MaxLoadTokens {
		bad("content.running_tokens", n, "want 0 to 1048576")
	}
	if n := ct.MaxBodyBytes; n < 1024 || n > MaxContentBodyBytes {
		bad("content.max_body_bytes", n, "want 1024 to 67108864")
	}
	if n := ct.CacheTokens; n < 1 || n > 1<<40 {
		bad("content.cache_tokens", n, "want 1 to 1099511627776")
	}
}
