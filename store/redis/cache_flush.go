package redis

// The hit cache's flush: the loop that sends the write backs due, the
// touch script that writes them, and what its reply does to the cache.

import (
	"context"
	"errors"
	"slices"
	"time"

	goredis "github.com/redis/go-redis/v9"
)

// touchBatch is the most sessions one touch script call writes back. A
// call holds Redis for about 6 µs a session, so a batch holds it for under
// a millisecond (BenchmarkWriteBackBatch).
const touchBatch = 128

// flushLoop sends the write backs due, every FlushInterval, until ctx ends.
func (c *hitCache) flushLoop(ctx context.Context) {
	tick := time.NewTicker(c.opts.FlushInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			fctx, cancel := context.WithTimeout(ctx, max(c.opts.FlushInterval, OpTimeout))
			c.flush(fctx, c.takeDue)
			cancel()
		}
	}
}

// flush writes back, in one pipeline, the sessions take picks: those due,
// those a caller is about to read, or all on close. Then it writes the
// index entries and alias links found due.
func (c *hitCache) flush(ctx context.Context, take func(now time.Time) map[string]*touch) {
	c.flushMu.Lock()
	defer c.flushMu.Unlock()
	sent := time.Now()
	c.qmu.Lock()
	q := take(sent)
	if len(q) == 0 {
		c.qmu.Unlock()
		return
	}
	c.inflight, c.done = q, make(chan struct{})
	done := c.done
	c.qmu.Unlock()
	defer func() {
		c.qmu.Lock()
		c.inflight = nil
		c.qmu.Unlock()
		close(done)
	}()
	ts := make([]*touch, 0, len(q))
	for _, t := range q {
		ts = append(ts, t)
	}
	per := c.s.touchPer()
	calls := c.s.touchCalls(ts, per)
	c.s.exec(ctx, calls, nil)
	failed := false
	for i, call := range calls {
		batch := ts[i*per : min((i+1)*per, len(ts))]
		res, err := call.cmd.Slice()
		var rs []touchReply
		if err == nil {
			rs, err = parseTouchReply(res, len(batch))
		}
		if err != nil {
			failed = true
			continue
		}
		for j, t := range batch {
			c.writeBacks.Add(1)
			c.written(t, rs[j], sent)
			aliases := t.aliases
			if rs[j].links == 0 {
				aliases = nil
			}
			if rs[j].same && (rs[j].index != 0 || len(aliases) > 0) {
				c.s.refresh(ctx, t.key, t.instance, "", t.now, rs[j].index, aliases, rs[j].links)
			}
		}
	}
	if failed {
		c.writeBackErrors.Add(1)
		c.s.indexError(errors.New("redis cache write back: some sessions' refreshes failed"))
	}
}

// written applies what Redis answered to a write back sent at sent. When
// the binding is no longer the one cached, or has a move pending, the
// entry goes: the change's message is on its way. Otherwise Redis has just
// answered for the binding, as a lookup would. The entry is then as fresh
// as a lookup's, with the session's count and last use as Redis keeps them
// (other replicas' hits included), plus this replica's hits since.
func (c *hitCache) written(t *touch, r touchReply, sent time.Time) {
	if !r.same || r.moving {
		c.drop(t.key)
		return
	}
	sh := c.shard(t.key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.entries[t.key]
	if e == nil || e.b.Instance != t.instance || e.b.Since.UnixMilli() != t.since || !sent.After(e.fetched) {
		return // gone, another binding, or fetched since: newer than this reply
	}
	e.fetched = sent
	c.qmu.Lock()
	since := 0 // hits queued since this write back was taken
	if p := c.queue[t.key]; p != nil {
		since = p.count
	}
	c.qmu.Unlock()
	e.requests = r.requests + since
	if u := time.UnixMilli(r.lastUse); r.lastUse > 0 && u.After(e.lastHit) {
		e.lastHit = u
	}
	if r.index != 0 {
		e.x, e.e = t.now, r.index
	}
	if r.links != 0 {
		e.l = r.links
	}
}

// touchSrc writes back cached hits. KEYS[k] is the binding of the k-th
// session written back. Each session has ten arguments, from
// ARGV[10(k-1)+1]:
//
//	[1]   instance
//	[2]   since, the cached binding's
//	[3]   hits to count
//	[4]   TTL ms left of the last hit's idle timeout
//	[5]   the last hit's now
//	[6]   now + idle*5/4
//	[7]   refresh period ms
//	[8]   margin ms
//	[9]   idle ms
//	[10]  '1' when the hits had alias links
//
// It writes each session's hits only to the binding they were served from.
// Another binding, or none, is left alone. It never shortens the TTL and
// never moves the last use back. It costs four commands a session. That is
// what a busy session costs Redis per write back.
//
// It replies five values a session. When the binding is another, they are 0
// and four empty strings. Otherwise they are:
//
//   - 1, or 2 when a move is pending;
//   - the index expiry to write, empty unless due, as getOrBindSrc says;
//   - the link expiry to write, likewise;
//   - the count n now;
//   - the last use u it had before, -1 when absent.
const touchSrc = `
local function int(v)
  if v and string.match(v, '^%d+$') then return tonumber(v) end
  return nil
end
local out = {}
for k = 1, #KEYS do
  local a = 10 * (k - 1)
  local cur = redis.call('HMGET', KEYS[k], 'i', 's', 'x', 'e', 'l', 'n', 'u', 'mv', 'mo')
  if cur[1] ~= ARGV[a + 1] or cur[2] ~= ARGV[a + 2] then
    for _, v in ipairs({0, '', '', 0, -1}) do out[#out + 1] = v end
  else
    local now = tonumber(ARGV[a + 5])
    local n = tonumber(ARGV[a + 3])
    -- Up to 15 digits, as getOrBindSrc: Lua numbers are exact to 2^53.
    if cur[6] and string.match(cur[6], '^%d+$') and #cur[6] <= 15 then n = n + tonumber(cur[6]) end
    local set = {'n', n}
    local u = int(cur[7])
    if not u or now > u then
      set[#set + 1] = 'u'
      set[#set + 1] = ARGV[a + 5]
    end
    local reach = now + tonumber(ARGV[a + 9]) + tonumber(ARGV[a + 8])
    local x, e, l = int(cur[3]), int(cur[4]), int(cur[5])
    local ie, le = '', ''
    if not x or not e or now - x >= tonumber(ARGV[a + 7]) or reach > e then
      ie = ARGV[a + 6]
      if e and e > tonumber(ARGV[a + 6]) then ie = cur[4] end
      for _, v in ipairs({'x', ARGV[a + 5], 'e', ie}) do set[#set + 1] = v end
    end
    if ARGV[a + 10] == '1' and (ie ~= '' or not l or reach > l) then
      le = ARGV[a + 6]
      if l and l > tonumber(ARGV[a + 6]) then le = cur[5] end
      set[#set + 1] = 'l'
      set[#set + 1] = le
    end
    redis.call('HSET', KEYS[k], unpack(set))
    if redis.call('PTTL', KEYS[k]) < tonumber(ARGV[a + 4]) then
      redis.call('PEXPIRE', KEYS[k], ARGV[a + 4])
    end
    local st = 1
    if (cur[8] and cur[8] ~= '') or (cur[9] and cur[9] ~= '') then st = 2 end
    for _, v in ipairs({st, ie, le, n, u or -1}) do out[#out + 1] = v end
  end
end
return out
`

var touchScript = goredis.NewScript(touchSrc)

// touchPer is how many sessions one touch call writes back: touchBatch,
// but one on a Cluster. There a script's keys must share a hash slot. Each
// session's binding has a slot of its own, from its key's hash tag.
func (s *Store) touchPer() int {
	if _, ok := s.client.(*goredis.ClusterClient); ok {
		return 1
	}
	return touchBatch
}

// touchCalls are the write backs of ts, per sessions a call (touchPer).
func (s *Store) touchCalls(ts []*touch, per int) []*scriptCall {
	calls := make([]*scriptCall, 0, (len(ts)+per-1)/per)
	for batch := range slices.Chunk(ts, per) {
		c := &scriptCall{sc: touchScript, keys: make([]string, 0, len(batch)), args: make([]any, 0, 10*len(batch))}
		for _, t := range batch {
			ttl := max(t.idle-time.Since(t.at), time.Millisecond)
			c.keys = append(c.keys, s.bindingKey(t.key))
			c.args = append(c.args, t.instance, t.since, t.count, millis(ttl), t.now, t.now+entryLifetime(t.idle),
				refreshPeriod(t.idle), refreshMargin(t.idle), millis(t.idle), boolArg(len(t.aliases) > 0))
		}
		calls = append(calls, c)
	}
	return calls
}
