package redis

import (
	"context"
	"fmt"
	"slices"

	goredis "github.com/redis/go-redis/v9"
)

// forgetSrc deletes a binding and its alias link. Both are in one slot.
//
//	KEYS[1]  binding
//	KEYS[2]  alias link of the same key
//	ARGV[1]  the invalidation channel; empty when the deployment does not
//	         cache hits. A deleted binding is published on it.
//	ARGV[2]  the calling store's origin
//
// It replies with four values:
//
//	binding deleted   0 or 1
//	link deleted      0 or 1
//	instance          the binding's instance, or an empty string
//	linked key        the key the link led to, or an empty string
//
// A key of another type than the layout's is deleted without being read.
const forgetSrc = `
local inst, to = '', ''
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  inst = redis.call('HGET', KEYS[1], 'i') or ''
end
if redis.call('TYPE', KEYS[2]).ok == 'string' then
  to = redis.call('GET', KEYS[2]) or ''
end
local b = redis.call('DEL', KEYS[1])
if b == 1 and ARGV[1] ~= '' then
  redis.call('PUBLISH', ARGV[1], ARGV[2] .. ' ' .. KEYS[1])
end
return {b, redis.call('DEL', KEYS[2]), inst, to}
`

// forgetScript is immutable: its source and hash. exec loads it into a
// server's script cache on first use, by NOSCRIPT then EVAL.
var forgetScript = goredis.NewScript(forgetSrc)

// zremBatch is the most members one ZREM of Forget names.
const zremBatch = 1000

// forgotten is what forgetting one key found.
type forgotten struct {
	binding   bool   // a binding was deleted
	instance  string // the deleted binding's instance
	linkedKey string // the key the deleted alias link led to
}

// Forget deletes everything the store holds for the given session keys,
// for "forget this user". The keys come from the routing audit's records.
// It deletes:
//
//   - each key's binding and alias link;
//   - when a key was an alias, the session its link led to, with that
//     session's own link: one hop, as a request follows it;
//   - each deleted session's entry in its instance's index;
//   - the entries of every key and linked key in the indexes of
//     instances, the instances the user's decisions went to. An entry
//     outlives its binding by up to Idle/4, and once the binding has
//     expired only the index knows the instance.
//
// It returns how many bindings it deleted. Alias links and index entries
// are not counted. Empty and repeated keys are skipped.
//
// Each script touches one session's keys, in one slot. The index removals
// are one pipeline on the {fleet} slot. So it works on Redis Cluster. Each
// round trip gets at least OpTimeout. A request carrying one of the keys
// while Forget runs may bind the session again. So forget a user whose
// traffic has stopped.
func (s *Store) Forget(ctx context.Context, keys []string, instances ...string) (int, error) {
	f := forgetting{seen: make(map[string]bool, len(keys)), indexed: map[string][]string{}}
	var todo, all []string
	for _, k := range keys {
		if k != "" && !f.seen[k] {
			f.seen[k] = true
			todo = append(todo, k)
		}
	}
	// Round 0: the keys given; round 1: the keys their links led to.
	for round := 0; round < 2 && len(todo) > 0; round++ {
		all = append(all, todo...)
		next, err := s.forgetRound(ctx, &f, todo, round == 0)
		if err != nil {
			return f.deleted, fmt.Errorf("redis forget: %w", err)
		}
		todo = next
	}
	for _, in := range instances {
		if in != "" {
			f.indexed[in] = append(f.indexed[in], all...)
		}
	}
	if err := s.unindex(ctx, f.indexed); err != nil {
		return f.deleted, fmt.Errorf("redis forget: %w", err)
	}
	return f.deleted, nil
}

// forgetting is what a Forget has done so far.
type forgetting struct {
	seen    map[string]bool     // keys forgotten or due in the next round
	indexed map[string][]string // instance → session keys to remove from its index
	deleted int                 // bindings deleted
}

// forgetRound forgets keys in pipelines of markBatch. When follow is true
// it returns the keys their links led to, those not seen before.
func (s *Store) forgetRound(ctx context.Context, f *forgetting, keys []string, follow bool) ([]string, error) {
	var next []string
	for chunk := range slices.Chunk(keys, markBatch) {
		got, err := s.forgetChunk(ctx, chunk)
		for i, g := range got {
			next = f.add(chunk[i], g, follow, next)
		}
		if err != nil {
			return next, err
		}
	}
	return next, nil
}

// add records what forgetting key found. When follow is true and key was
// a link to a session not seen before, it appends that session to next.
func (f *forgetting) add(key string, g forgotten, follow bool, next []string) []string {
	if g.binding {
		f.deleted++
		if g.instance != "" {
			f.indexed[g.instance] = append(f.indexed[g.instance], key)
		}
	}
	if follow && g.linkedKey != "" && !f.seen[g.linkedKey] {
		f.seen[g.linkedKey] = true
		next = append(next, g.linkedKey)
	}
	return next
}

// forgetChunk runs the forget script on each key in one pipeline. It
// returns what it learnt of the keys before the first failed one.
func (s *Store) forgetChunk(ctx context.Context, keys []string) ([]forgotten, error) {
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	calls := make([]*scriptCall, len(keys))
	for i, k := range keys {
		calls[i] = &scriptCall{sc: forgetScript, keys: []string{s.bindingKey(k), s.linkKey(k)}, args: []any{s.channel, s.origin}}
	}
	s.exec(ctx, calls, nil)
	if s.cache != nil {
		for _, k := range keys {
			s.cache.drop(k)
		}
	}
	out := make([]forgotten, 0, len(keys))
	for i, c := range calls {
		res, err := c.cmd.Slice()
		if err != nil {
			return out, err
		}
		f, err := parseForgetReply(res)
		if err != nil {
			return out, fmt.Errorf("key %q: %w", keys[i], err)
		}
		out = append(out, f)
	}
	return out, nil
}

func parseForgetReply(res []any) (forgotten, error) {
	if len(res) != 4 {
		return forgotten{}, fmt.Errorf("unexpected forget reply of %d elements", len(res))
	}
	b, ok1 := res[0].(int64)
	inst, ok2 := res[2].(string)
	to, ok3 := res[3].(string)
	if !ok1 || !ok2 || !ok3 {
		return forgotten{}, fmt.Errorf("unexpected forget reply %v", res)
	}
	return forgotten{binding: b == 1, instance: inst, linkedKey: to}, nil
}

// unindex removes the members from each instance's index, in one
// pipeline (every index is in the {fleet} slot).
func (s *Store) unindex(ctx context.Context, members map[string][]string) error {
	if len(members) == 0 {
		return nil
	}
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	pipe := s.client.Pipeline()
	for in, keys := range members {
		slices.Sort(keys)
		keys = slices.Compact(keys)
		for chunk := range slices.Chunk(keys, zremBatch) {
			args := make([]any, len(chunk))
			for i, k := range chunk {
				args[i] = k
			}
			pipe.ZRem(ctx, s.indexKey(in), args...)
		}
	}
	if pipe.Len() == 0 {
		return nil
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("index: %w", err)
	}
	return nil
}
