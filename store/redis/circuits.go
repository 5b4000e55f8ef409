package redis

import (
	"context"
	"fmt"
	"strconv"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/replicas"
)

// The instance breaker's shared state lives in the {fleet} slot:
//
//   - per instance, a sorted set of recent failures. The score is when; the
//     member is unique per report.
//   - one hash of the circuits that are open or half-open. The field is the
//     instance; the value is the end of its cooldown, unix ms.
//
// An instance absent from the hash is closed. A circuit whose cooldown has
// ended stays in the hash, half-open. A probe's answer then closes it
// (ReportRecovered) or opens it again (ReportFailure).

// circuitFailSrc counts a failure of an instance.
//
//	KEYS[1]  the instance's failures
//	KEYS[2]  the circuits hash
//	ARGV[1]  instance
//	ARGV[2]  now ms
//	ARGV[3]  window ms
//	ARGV[4]  threshold
//	ARGV[5]  cooldown ms
//	ARGV[6]  member
//
// It replies {opened, cooldown end}. opened is 1 when this failure opened
// the circuit, or re-opened a half-open one. cooldown end is the circuit's,
// empty when closed. A failure while the circuit is open is not counted. It
// was in flight when the circuit opened.
const circuitFailSrc = `
local now = tonumber(ARGV[2])
local till = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '')
if till and till > now then
  return {0, tostring(till)}
end
local function open()
  till = now + tonumber(ARGV[5])
  redis.call('HSET', KEYS[2], ARGV[1], till)
  redis.call('DEL', KEYS[1])
  return {1, tostring(till)}
end
if till then
  return open()
end
redis.call('ZADD', KEYS[1], now, ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[4]) then
  return open()
end
return {0, ''}
`

// circuitRecoverSrc: KEYS[1] the instance's failures, KEYS[2] the
// circuits hash. ARGV[1] instance, [2] now ms. Closes a half-open circuit;
// replies 1 when it did, 0 when the circuit was closed already or is open
// again (another replica's probe failed meanwhile).
const circuitRecoverSrc = `
local till = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '')
if till and till <= tonumber(ARGV[2]) then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
`

// The scripts are values (source and digest) shared by every Store; exec
// sends them with EVALSHA and falls back to EVAL once per server.
var (
	circuitFail    = goredis.NewScript(circuitFailSrc)
	circuitRecover = goredis.NewScript(circuitRecoverSrc)
)

func (s *Store) failuresKey(instance string) string { return s.fleet + "f:" + instance }
func (s *Store) circuitsKey() string                { return s.fleet + "circuits" }

// ReportFailure implements replicas.Circuits: one EVALSHA on the {fleet}
// slot.
func (s *Store) ReportFailure(ctx context.Context, instance string, at time.Time, member string, cfg fleet.BreakerConfig) (opened bool, until time.Time, err error) {
	if err := replicas.CheckFailure(instance, member, cfg); err != nil {
		return false, time.Time{}, fmt.Errorf("redis report failure: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return false, time.Time{}, fmt.Errorf("redis report failure: %w", err)
	}
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	c := &scriptCall{sc: circuitFail, keys: []string{s.failuresKey(instance), s.circuitsKey()},
		args: []any{instance, at.UnixMilli(), millis(cfg.Window), cfg.Threshold, millis(cfg.Cooldown), member}}
	s.exec(ctx, []*scriptCall{c}, nil)
	res, err := c.cmd.Slice()
	if err != nil {
		return false, time.Time{}, fmt.Errorf("redis report failure: %w", err)
	}
	if len(res) != 2 {
		return false, time.Time{}, fmt.Errorf("redis report failure: unexpected reply %v", res)
	}
	flag, ok1 := res[0].(int64)
	end, ok2 := res[1].(string)
	ms, ok3 := expiry(end)
	if !ok1 || !ok2 || !ok3 {
		return false, time.Time{}, fmt.Errorf("redis report failure: unexpected reply %v", res)
	}
	if ms != 0 {
		until = time.UnixMilli(ms)
	}
	return flag == 1, until, nil
}

// ReportRecovered implements replicas.Circuits: one EVALSHA on the
// {fleet} slot.
func (s *Store) ReportRecovered(ctx context.Context, instance string, at time.Time) (bool, error) {
	if instance == "" {
		return false, fmt.Errorf("redis report recovered: empty instance")
	}
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("redis report recovered: %w", err)
	}
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	c := &scriptCall{sc: circuitRecover, keys: []string{s.failuresKey(instance), s.circuitsKey()}, args: []any{instance, at.UnixMilli()}}
	s.exec(ctx, []*scriptCall{c}, nil)
	n, err := c.cmd.Int64()
	if err != nil {
		return false, fmt.Errorf("redis report recovered: %w", err)
	}
	return n == 1, nil
}

// Circuits implements replicas.Circuits with one HGETALL. A value that is
// not a time (a damaged field) is skipped; a stale circuit is deleted.
func (s *Store) Circuits(ctx context.Context, now time.Time) (map[string]time.Time, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("redis circuits: %w", err)
	}
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	all, err := s.client.HGetAll(ctx, s.circuitsKey()).Result()
	if err != nil {
		return nil, fmt.Errorf("redis circuits: %w", err)
	}
	out := make(map[string]time.Time, len(all))
	for in, v := range all {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil || ms <= 0 {
			continue
		}
		until := time.UnixMilli(ms)
		if now.Sub(until) > replicas.StaleCircuit {
			_ = s.client.HDel(ctx, s.circuitsKey(), in).Err() // garbage; a failure here is harmless
			continue
		}
		out[in] = until
	}
	return out, nil
}
