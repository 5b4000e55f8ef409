package redis

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	goredis "github.com/redis/go-redis/v9"
)

// Requests returns the request count of each session key's binding, its
// n field. A key without a binding gives 0. That is a session that ended,
// was never bound, or was stored before counts were kept. keys are session
// keys (Result.Key). An alias link is not followed.
//
// It reads the bindings with HGET in pipelines of markBatch. Each is bounded
// like the other calls off the request path. A pipeline may span slots on a
// Cluster. The client splits it per node. now is unused, as Redis expires
// bindings on its own clock.
func (s *Store) Requests(ctx context.Context, keys []string, _ time.Time) ([]int, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("redis requests: %w", err)
	}
	if len(keys) == 0 {
		return []int{}, nil
	}
	s.flushCache(ctx, keys...) // theirs only: the metrics read counts every 15 s
	out := make([]int, 0, len(keys))
	for chunk := range slices.Chunk(keys, markBatch) {
		counts, err := s.requests(ctx, chunk)
		if err != nil {
			return nil, fmt.Errorf("redis requests: %w", err)
		}
		out = append(out, counts...)
	}
	return out, nil
}

// requests reads the counts of one pipeline's worth of keys.
func (s *Store) requests(ctx context.Context, keys []string) ([]int, error) {
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	pipe := s.client.Pipeline()
	cmds := make([]*goredis.StringCmd, len(keys))
	for i, k := range keys {
		cmds[i] = pipe.HGet(ctx, s.bindingKey(k), "n")
	}
	_, _ = pipe.Exec(ctx) // each command keeps its own error
	out := make([]int, len(keys))
	for i, c := range cmds {
		v, err := c.Result()
		switch {
		case errors.Is(err, goredis.Nil), goredis.HasErrorPrefix(err, "WRONGTYPE"):
			// No binding, one without a count, or a key that is no
			// binding (GetOrBind fails on it too).
		case err != nil:
			return nil, fmt.Errorf("read %q: %w", keys[i], err)
		default:
			// A damaged count counts as 0, as the scripts read it.
			if n, err := strconv.Atoi(v); err == nil && n > 0 {
				out[i] = n
			}
		}
	}
	return out, nil
}
