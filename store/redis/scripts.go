package redis

// The Lua scripts. Each touches the keys of ONE hash slot only, so every
// script runs on Redis Cluster. Those are the keys it is given. syncLoadSrc
// also names other {fleet} keys itself. Times are unix milliseconds on the
// caller's clock: "now" is an argument. TTLs are real PEXPIREs on the
// server's clock.
//
// Binding hash fields:
//
//	i   instance
//	v   version
//	s   since
//	f   failovers: the fallback ladder's stage, absent for 0
//	n   the session's request count: 1 on a bind, +1 on every hit and
//	    renewal, kept by a replace
//	mv  move-to-version
//	mo  move-off-instance
//	x   when the session's index entry was last written
//	e   that entry's expiry, its score
//	l   the expiry of the alias links last written for the session
//	u   the session's last use: a request, or a hit written back
//
// s, x, e, l and u are unix milliseconds on the callers' clock.
//
// A binding without an instance or an integer s is damaged. It counts as
// absent and is overwritten, so a bad record heals instead of failing
// forever. A missing or non-integer x, e or l makes the refresh it guards
// due, which rewrites it. A missing or non-integer n counts as 0. Bindings
// stored before counts were kept have none.
//
// getOrBindSrc and replaceSrc share the refresh rule. A use at now with idle
// timeout idle keeps the binding until now + idle. The index entry must
// outlive that, whatever idle each request carries. So it is rewritten when
// now + idle + margin would pass e. It is also rewritten when x is a refresh
// period old, the request's idle/4, which heals a lost entry. It is then
// written to expire at max(e, now + idle*5/4), never earlier than it was. So
// a short-idle request cannot cut short the entry of a session a long-idle
// request keeps alive. Alias links follow the same rule with l. They are
// written along with any index write, but only by a request that has links
// to write. The caller says so.

// getOrBindSrc gets the binding of a session, or binds it.
//
//	KEYS[1]  binding
//	KEYS[2]  alias link of the same key
//	ARGV[1]  candidate instance
//	ARGV[2]  candidate version
//	ARGV[3]  now
//	ARGV[4]  idle ms
//	ARGV[5]  max ms; 0 is none
//	ARGV[6]  '1' to follow an alias link
//	ARGV[7]  now + idle*5/4, a new entry or link expiry
//	ARGV[8]  refresh period ms
//	ARGV[9]  margin ms
//	ARGV[10] '1' when the request has alias links to write
//	ARGV[11] the invalidation channel; empty when the deployment does not
//	         cache hits
//	ARGV[12] the calling store's origin
//
// A message is "<origin> <binding key>". A replica skips its own, as it has
// already dropped or stored the entry.
//
// A bind, created or renewed, publishes KEYS[1] on the channel, in the
// script. So every replica drops what it cached of the session before any
// other command sees the new binding. A hit publishes nothing.
//
// When KEYS[2] links the key to another session, it writes nothing and
// replies {0, linked key}. Otherwise it replies with 18 values. requests
// and unused are integers. The others are strings.
//
//	outcome              affinity.Origin: 1 found, 2 created, 3 renewed
//	instance, since, version
//	move-to-version, move-off
//	previous instance, previous since, previous version
//	                     the binding a bind replaced, empty if none.
//	                     A created binding may replace a damaged record's
//	                     instance. The entry leaves that instance's index.
//	index expiry         empty unless the caller must write the index entry
//	                     with that score
//	link expiry          empty unless the caller must write the request's
//	                     alias links to expire then
//	failovers, previous failovers
//	requests             the count n with this request
//	index written, index expiry now, links expiry now
//	                     the binding's x, e and l after the call, empty when
//	                     absent. The hit cache serves a hit only while none
//	                     would be due.
//	unused               on a hit, how long the session had gone unused, in
//	                     ms: now less u, the last use. It is -1 when u is
//	                     absent or later, and -1 on a bind.
const getOrBindSrc = `
if ARGV[6] == '1' then
  local to = redis.call('GET', KEYS[2])
  if to and to ~= '' then
    return {0, to}
  end
end
local function int(v)
  if v and string.match(v, '^%d+$') then return tonumber(v) end
  return nil
end
local now, reach = tonumber(ARGV[3]), tonumber(ARGV[3]) + tonumber(ARGV[4]) + tonumber(ARGV[9])
local cur = redis.call('HMGET', KEYS[1], 'i', 's', 'v', 'x', 'e', 'l', 'mv', 'mo', 'f', 'n', 'u')
local s = int(cur[2])
-- Up to 15 digits: HINCRBY fails past 2^63, and Lua numbers are exact to 2^53.
local n = nil
if cur[10] and string.match(cur[10], '^%d+$') and #cur[10] <= 15 then n = tonumber(cur[10]) end
local outcome = 2
if cur[1] and cur[1] ~= '' and s then
  local max = tonumber(ARGV[5])
  if max == 0 or now - s < max then
    local idle = -1
    local u = int(cur[11])
    if u and now >= u then idle = now - u end
    redis.call('HSET', KEYS[1], 'u', ARGV[3])
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    if n then
      n = redis.call('HINCRBY', KEYS[1], 'n', 1)
    else
      n = 1
      redis.call('HSET', KEYS[1], 'n', n)
    end
    local x, e, l = int(cur[4]), int(cur[5]), int(cur[6])
    local ie, le = '', ''
    if not x or not e or now - x >= tonumber(ARGV[8]) or reach > e then
      ie = ARGV[7]
      if e and e > tonumber(ARGV[7]) then ie = cur[5] end
      redis.call('HSET', KEYS[1], 'x', ARGV[3], 'e', ie)
    end
    if ARGV[10] == '1' and (ie ~= '' or not l or reach > l) then
      le = ARGV[7]
      if l and l > tonumber(ARGV[7]) then le = cur[6] end
      redis.call('HSET', KEYS[1], 'l', le)
    end
    local nx, ne, nl = cur[4] or '', cur[5] or '', cur[6] or ''
    if ie ~= '' then nx, ne = ARGV[3], ie end
    if le ~= '' then nl = le end
    return {1, cur[1], cur[2], cur[3] or '', cur[7] or '', cur[8] or '', '', '', '', ie, le, cur[9] or '', '', n, nx, ne, nl, idle}
  end
  outcome = 3
end
-- A renewal places the same conversation again: it keeps counting.
if outcome == 3 then n = (n or 0) + 1 else n = 1 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'i', ARGV[1], 's', ARGV[3], 'v', ARGV[2], 'x', ARGV[3], 'e', ARGV[7], 'n', n, 'u', ARGV[3])
local le = ''
if ARGV[10] == '1' then
  le = ARGV[7]
  redis.call('HSET', KEYS[1], 'l', le)
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if ARGV[11] ~= '' then
  redis.call('PUBLISH', ARGV[11], ARGV[12] .. ' ' .. KEYS[1])
end
local prev = {cur[1] or '', '', '', ''}
if outcome == 3 then
  prev = {cur[1], cur[2], cur[3] or '', cur[9] or ''}
end
return {outcome, ARGV[1], ARGV[3], ARGV[2], '', '', prev[1], prev[2], prev[3], ARGV[7], le, '', prev[4], n, ARGV[3], ARGV[7], le, -1}
`

// replaceSrc moves a session from old to next.
//
//	KEYS[1]  binding
//	ARGV[1]  old instance
//	ARGV[2]  next instance
//	ARGV[3]  next version
//	ARGV[4]  now, next.Since
//	ARGV[5]  idle ms
//	ARGV[6]  now + idle*5/4
//	ARGV[7]  refresh period ms
//	ARGV[8]  margin ms
//	ARGV[9]  next failovers
//	ARGV[10] the invalidation channel; empty when the deployment does not
//	         cache hits. A stored next, such as a failover or a rebind, is
//	         published on it.
//	ARGV[11] the calling store's origin
//
// Replies {replaced, instance, since, version, index expiry, previous
// instance, failovers}.
//
//   - replaced is 1 when next was stored. The binding was absent, damaged or
//     still on old.
//   - replaced is 0 when another caller's binding was kept. Its idle timeout
//     is refreshed too, as the caller is using the session.
//   - index expiry is empty unless the caller must write the index entry
//     with that score. It is always set after a store.
//
// A stored next has no pending move. It keeps l, as the session's links
// still lead to it. It keeps n, as it is the same session.
const replaceSrc = `
local function int(v)
  if v and string.match(v, '^%d+$') then return tonumber(v) end
  return nil
end
local now = tonumber(ARGV[4])
local cur = redis.call('HMGET', KEYS[1], 'i', 's', 'v', 'x', 'e', 'l', 'f', 'n')
if cur[1] and cur[1] ~= '' and int(cur[2]) and cur[1] ~= ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  local x, e = int(cur[4]), int(cur[5])
  local ie = ''
  if not x or not e or now - x >= tonumber(ARGV[7]) or now + tonumber(ARGV[5]) + tonumber(ARGV[8]) > e then
    ie = ARGV[6]
    if e and e > tonumber(ARGV[6]) then ie = cur[5] end
    redis.call('HSET', KEYS[1], 'x', ARGV[4], 'e', ie)
  end
  return {0, cur[1], cur[2], cur[3] or '', ie, '', cur[7] or ''}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'i', ARGV[2], 's', ARGV[4], 'v', ARGV[3], 'x', ARGV[4], 'e', ARGV[6], 'u', ARGV[4])
if ARGV[9] ~= '0' then
  redis.call('HSET', KEYS[1], 'f', ARGV[9])
end
if int(cur[6]) then
  redis.call('HSET', KEYS[1], 'l', cur[6])
end
if int(cur[8]) then
  redis.call('HSET', KEYS[1], 'n', cur[8])
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if ARGV[10] ~= '' then
  redis.call('PUBLISH', ARGV[10], ARGV[11] .. ' ' .. KEYS[1])
end
return {1, ARGV[2], ARGV[4], ARGV[3], ARGV[6], cur[1] or '', ARGV[9]}
`

// indexSrc writes a session's index entry.
//
//	KEYS[1]  index of the session's instance
//	KEYS[2]  index of the instance it leaves; KEYS[1] again when none
//	ARGV[1]  session key
//	ARGV[2]  entry expiry, the score
//	ARGV[3]  minimum key TTL ms
//
// An entry's score is only ever raised. Index writes of one session can
// arrive out of order, as they follow their script in a second round trip.
// A late write of a short-idle request must not cut short the entry a
// long-idle one extended. The index key's own TTL only collects the index of
// an instance that no longer takes sessions. It is only ever extended,
// because sessions with different idle lifetimes share the key. Members
// expire by their score.
const indexSrc = `
local cur = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not cur or tonumber(cur) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
end
if KEYS[2] ~= KEYS[1] then
  redis.call('ZREM', KEYS[2], ARGV[1])
end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
`

// showSrc reads a session. It writes nothing.
//
//	KEYS[1]  binding
//	KEYS[2]  alias link of the same key
//	ARGV[1]  '1' to follow an alias link
//
// It replies one of:
//
//	{0, linked key}
//	{2}  no undamaged binding
//	{1, instance, since, version, move-to-version, move-off, pttl ms, failovers}
const showSrc = `
if ARGV[1] == '1' then
  local to = redis.call('GET', KEYS[2])
  if to and to ~= '' then
    return {0, to}
  end
end
local cur = redis.call('HMGET', KEYS[1], 'i', 's', 'v', 'mv', 'mo', 'f')
if not (cur[1] and cur[1] ~= '' and cur[2] and string.match(cur[2], '^%d+$')) then
  return {2}
end
return {1, cur[1], cur[2], cur[3] or '', cur[4] or '', cur[5] or '', redis.call('PTTL', KEYS[1]), cur[6] or ''}
`

// Replies of markSrc.
const (
	markGone     = 0 // no binding, or bound to another instance: prune from the index
	markOther    = 1 // another version: not selected
	markPending  = 2 // already has a pending move
	markDone     = 3 // marked now
	markUnmarked = 4 // selected and unmarked (check only)
)

// markSrc checks a session of an instance's index, and marks it with a move.
//
//	KEYS[1]  binding
//	ARGV[1]  instance
//	ARGV[2]  version; empty is any
//	ARGV[3]  '1' to mark, '0' to check only
//	ARGV[4]  move-to-version
//	ARGV[5]  move-off
//	ARGV[6]  the invalidation channel; empty when the deployment does not
//	         cache hits. A mark, for a migration, a drain or an evacuation,
//	         is published on it.
//	ARGV[7]  the calling store's origin
//
// It replies one of the mark* values. HSET keeps the binding's TTL, so the
// mark expires with the session.
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
  if ARGV[6] ~= '' then
    redis.call('PUBLISH', ARGV[6], ARGV[7] .. ' ' .. KEYS[1])
  end
  return 3
end
return 4
`

// pruneSrc prunes an index.
//
//	KEYS[1]  an index
//	ARGV     pairs of session key and the score read earlier
//
// It removes each member whose score is still the one read. So a session
// re-added meanwhile, with a new score, stays.
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

// syncLoadSrc exchanges the replicas' load reports.
//
//	KEYS[1]    replicas zset
//	KEYS[2]    drained set
//	KEYS[3]    this replica's report
//	KEYS[4..]  the index of each listed instance
//	ARGV[1]    now
//	ARGV[2]    this report's expiry, its score
//	ARGV[3]    report key TTL ms
//	ARGV[4]    replica name
//	ARGV[5]    report key prefix
//	ARGV[6..]  report hash field/value pairs
//
// It publishes the report. It drops the reports of replicas whose expiry has
// passed. It prunes expired index members. It replies with three values:
//
//   - the active counts, in KEYS order;
//   - {replica, HGETALL of its report, ...} for the other live replicas;
//   - the drained members.
//
// The other replicas' report keys are not in KEYS, as their names are only
// known inside the script. They share the {fleet} hash tag, so they are in
// the same slot.
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
