package redis

// The Lua scripts. Each touches the keys of ONE hash slot only (the keys it
// is given and, for syncLoadSrc, other {fleet} keys it names itself), so
// every script runs on Redis Cluster. Times are unix milliseconds on the
// caller's clock ("now" is an argument); TTLs are real PEXPIREs on the
// server's clock.
//
// Binding hash fields: i instance, v version, s since, x when the session's
// index entry was last written, mv move-to-version, mo move-off-instance.
// A binding without an instance or an integer s is damaged: it counts as
// absent and is overwritten, so a bad record heals instead of failing
// forever.

// getOrBindSrc: KEYS[1] binding, KEYS[2] alias link of the same key.
// ARGV[1] candidate instance, [2] candidate version, [3] now, [4] idle ms,
// [5] max ms (0: none), [6] '1' to follow an alias link, [7] index refresh
// period ms.
//
// Replies {0, linked key} when KEYS[2] links the key to another session
// (nothing else is done, except refreshing the link), otherwise
// {outcome, instance, since, version, move-to-version, move-off, refresh,
// previous instance}: outcome is affinity.Outcome (1 found, 2 created,
// 3 renewed); refresh is 1 when the caller must write the index entry (on a
// bind, or when x is at least a refresh period old); previous instance is
// the one a bind replaced (empty if none).
const getOrBindSrc = `
if ARGV[6] == '1' then
  local to = redis.call('GET', KEYS[2])
  if to and to ~= '' then
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
    return {0, to}
  end
end
local now = tonumber(ARGV[3])
local cur = redis.call('HMGET', KEYS[1], 'i', 's', 'v', 'x', 'mv', 'mo')
local s = cur[2] and string.match(cur[2], '^%d+$') and tonumber(cur[2])
local outcome = 2
if cur[1] and cur[1] ~= '' and s then
  local max = tonumber(ARGV[5])
  if max == 0 or now - s < max then
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    local x = tonumber(cur[4])
    local refresh = 0
    if not x or now - x >= tonumber(ARGV[7]) then
      redis.call('HSET', KEYS[1], 'x', ARGV[3])
      refresh = 1
    end
    return {1, cur[1], cur[2], cur[3] or '', cur[5] or '', cur[6] or '', refresh, ''}
  end
  outcome = 3
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'i', ARGV[1], 's', ARGV[3], 'v', ARGV[2], 'x', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {outcome, ARGV[1], ARGV[3], ARGV[2], '', '', 1, cur[1] or ''}
`

// replaceSrc: KEYS[1] binding. ARGV[1] old instance, [2] next instance,
// [3] next version, [4] now (next.Since), [5] idle ms, [6] index refresh
// period ms.
//
// Replies {replaced, instance, since, version, refresh, previous instance}:
// replaced is 1 when next was stored (the binding was absent, damaged or
// still on old), 0 when another caller's binding was kept; its idle timeout
// is refreshed too, the caller is using the session. A stored next has no
// pending move.
const replaceSrc = `
local cur = redis.call('HMGET', KEYS[1], 'i', 's', 'v', 'x')
if cur[1] and cur[1] ~= '' and cur[2] and string.match(cur[2], '^%d+$') and cur[1] ~= ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  local x = tonumber(cur[4])
  local refresh = 0
  if not x or tonumber(ARGV[4]) - x >= tonumber(ARGV[6]) then
    redis.call('HSET', KEYS[1], 'x', ARGV[4])
    refresh = 1
  end
  return {0, cur[1], cur[2], cur[3] or '', refresh, ''}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'i', ARGV[2], 's', ARGV[4], 'v', ARGV[3], 'x', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {1, ARGV[2], ARGV[4], ARGV[3], 1, cur[1] or ''}
`

// unlinkSrc: KEYS[1] alias link. ARGV[1] the key it must still lead to.
// Deletes the link only if it does, so a newer link survives.
const unlinkSrc = `
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
`

// indexSrc: KEYS[1] index of the session's instance, KEYS[2] index of the
// instance it leaves (KEYS[1] again when none). ARGV[1] session key,
// [2] entry expiry (score), [3] minimum key TTL ms.
//
// The index key's own TTL only collects the index of an instance that no
// longer takes sessions; it is only ever extended, because sessions with
// different idle lifetimes share the key. Members expire by their score.
const indexSrc = `
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if KEYS[2] ~= KEYS[1] then
  redis.call('ZREM', KEYS[2], ARGV[1])
end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
`

// showSrc: KEYS[1] binding, KEYS[2] alias link of the same key. ARGV[1]
// '1' to follow an alias link. Read-only.
//
// Replies {0, linked key}, {2} when there is no (undamaged) binding, or
// {1, instance, since, version, move-to-version, move-off, pttl ms}.
const showSrc = `
if ARGV[1] == '1' then
  local to = redis.call('GET', KEYS[2])
  if to and to ~= '' then
    return {0, to}
  end
end
local cur = redis.call('HMGET', KEYS[1], 'i', 's', 'v', 'mv', 'mo')
if not (cur[1] and cur[1] ~= '' and cur[2] and string.match(cur[2], '^%d+$')) then
  return {2}
end
return {1, cur[1], cur[2], cur[3] or '', cur[4] or '', cur[5] or '', redis.call('PTTL', KEYS[1])}
`

// Replies of markSrc.
const (
	markGone     = 0 // no binding, or bound to another instance: prune from the index
	markOther    = 1 // another version: not selected
	markPending  = 2 // already has a pending move
	markDone     = 3 // marked now
	markUnmarked = 4 // selected and unmarked (check only)
)

// markSrc: KEYS[1] binding. ARGV[1] instance, [2] version (empty: any),
// [3] '1' to mark, '0' to check only, [4] move-to-version, [5] move-off.
// Replies one of the mark* values. HSET keeps the binding's TTL, so the mark
// expires with the session.
const markSrc = `
local cur = redis.call('HMGET', KEYS[1], 'i', 's', 'v', 'mv', 'mo')
if not (cur[2] and string.match(cur[2], '^%d+$')) or cur[1] ~= ARGV[1] then
  return 0
end
if ARGV[2] ~= '' and cur[3] ~= ARGV[2] then
  return 1
end
if (cur[4] and cur[4] ~= '') or (cur[5] and cur[5] ~= '') then
  return 2
end
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[1], 'mv', ARGV[4], 'mo', ARGV[5])
  return 3
end
return 4
`

// pruneSrc: KEYS[1] an index. ARGV pairs of (session key, score read
// earlier). Removes each member whose score is still the one read, so a
// session re-added meanwhile (a new score) stays.
const pruneSrc = `
local n = 0
for i = 1, #ARGV, 2 do
  local sc = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if sc and tonumber(sc) == tonumber(ARGV[i + 1]) then
    n = n + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return n
`

// syncLoadSrc: KEYS[1] replicas zset, KEYS[2] drained set, KEYS[3] this
// replica's report, KEYS[4..] the index of each listed instance. ARGV[1]
// now, [2] this report's expiry (score), [3] report key TTL ms, [4] replica
// name, [5] report key prefix, [6..] report hash field/value pairs.
//
// Publishes the report, drops the reports of replicas whose expiry has
// passed, prunes expired index members. Replies {active counts in KEYS
// order, {replica, HGETALL of its report, ...} for the other live replicas,
// drained members}. The other replicas' report keys are not in KEYS (their
// names are only known here); they share the {fleet} hash tag, so they are
// in the same slot.
const syncLoadSrc = `
redis.call('DEL', KEYS[3])
if #ARGV > 5 then
  for i = 6, #ARGV, 200 do
    redis.call('HSET', KEYS[3], unpack(ARGV, i, math.min(i + 199, #ARGV)))
  end
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])) do
  redis.call('DEL', ARGV[5] .. r)
  redis.call('ZREM', KEYS[1], r)
end
local others = {}
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf')) do
  if r ~= ARGV[4] then
    others[#others + 1] = r
    others[#others + 1] = redis.call('HGETALL', ARGV[5] .. r)
  end
end
local active = {}
for i = 4, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[1])
  active[#active + 1] = redis.call('ZCARD', KEYS[i])
end
return {active, others, redis.call('SMEMBERS', KEYS[2])}
`
