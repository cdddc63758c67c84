-- sliding-log: the exact sliding window. A sorted set of admitted hits and bookings, scored by
-- their time in ms, members "<token>:<n>" (the client's unique token, one member per unit of
-- cost). All tiers of one policy share one log; it is trimmed to the longest tier's period.
-- A hit at `now` (or a booking at `at`) is admitted when EVERY window [s, s + period) that
-- contains it holds at most limit - cost entries. With no entries after `at` that is simply
-- the count in (at - period, at]; bookings in the future make the later windows matter too.
-- KEYS: the policy's log.
-- ARGV (per tier, read by main.lua): limit, period ms, cost.
-- Reply (to main.lua): sliding_log() builds check and commit. check's reply is as in
--       fixed_window.lua up to the reset after the hit, then whether entries lie ahead of
--       `at` (the joint retry then applies); commit writes the log itself, once per log.
--       What only bookings ahead need, and refund and cancel, are built apart, on demand:
--       a script run pays for every closure it creates.

-- The two steps of the request's usual hit, top-level so that main.lua's one-tier path writes
-- them out in place (`--@inline`) and sliding_log()'s check and commit call them: one source.

-- The count of the window (at - period, at] and how many entries lie after `at` (bookings).
-- One ZCOUNT of everything after the window's start answers an empty window alone; a second
-- counts what lies ahead: cheaper than a ZREVRANGE WITHSCORES and a ZCOUNT.
local function sliding_log_count(key, period, at)
  local seen = redis.call('ZCOUNT', key, string.format('(%d', at - period), '+inf')
  local later = 0
  if seen > 0 then later = redis.call('ZCOUNT', key, string.format('(%d', at), '+inf') end
  return seen, later
end

-- Record `cost` entries at `at`, trim what the longest window can no longer see, and keep the
-- log alive until its newest entry (`newest`: this one, or a booking further ahead) has left
-- that window. Numbers are formatted with "%d": Redis would format them with the slower "%.17g".
local function sliding_log_record(key, at, cost, token, longest, newest, now)
  local score = string.format('%d', at)
  if cost == 1 then
    redis.call('ZADD', key, score, token .. ':1')
  else
    local args = {}
    for j = 1, cost do
      args[#args + 1] = score
      args[#args + 1] = token .. ':' .. j
      if #args >= 200 then
        redis.call('ZADD', key, unpack(args))
        args = {}
      end
    end
    if #args > 0 then redis.call('ZADD', key, unpack(args)) end
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - longest))
  redis.call('PEXPIRE', key, string.format('%d', newest + longest - now))
end

-- What entries ahead of `at` (bookings) call for: built only when a call meets them.
local function sliding_log_ahead()
  local function times(key, from)
    local raw = redis.call('ZRANGEBYSCORE', key, '(' .. from, '+inf', 'WITHSCORES')
    local ts = {}
    for i = 2, #raw, 2 do ts[#ts + 1] = tonumber(raw[i]) end
    return ts
  end

  -- The fullest window [s, s + period) containing `at` (s in (at - period, at]), over the
  -- ascending times `ts` (none at or before at - period). Sliding s to the right only loses
  -- entries until the window's end reaches a new one, so the candidates are the window ending
  -- at `at` and the windows ending at each entry in (at, at + period).
  local function peak(ts, period, at)
    local n = #ts
    local best, lo, hi = 0, 1, 0
    local stop = at
    while true do
      while hi < n and ts[hi + 1] <= stop do hi = hi + 1 end
      while lo <= hi and ts[lo] <= stop - period do lo = lo + 1 end
      if hi - lo + 1 > best then best = hi - lo + 1 end
      if hi >= n or ts[hi + 1] >= at + period then return best end
      stop = ts[hi + 1]
    end
  end

  -- Append to `out` the intervals {first, last} of booking times at which `cost` more entries
  -- would NOT fit this tier, over the ascending times `ts`. A window starting at s holds the
  -- entries t with s <= t < s + period, so each entry counts for s in [t - period + 1, t]; a
  -- sweep over those edges finds the starts s whose window has no room, and a booking is
  -- refused exactly when some such window contains it: at any time in [s, s + period - 1].
  local function blocked(ts, limit, period, cost, out)
    local full = limit - cost + 1
    local n = #ts
    local i, j, count, from = 1, 1, 0, nil
    while j <= n do
      local x = ts[j] + 1
      if i <= n and ts[i] - period + 1 < x then x = ts[i] - period + 1 end
      while i <= n and ts[i] - period + 1 == x do count = count + 1; i = i + 1 end
      while j <= n and ts[j] + 1 == x do count = count - 1; j = j + 1 end
      if from == nil and count >= full then
        from = x
      elseif from ~= nil and count < full then
        out[#out + 1] = {from, x + period - 2}
        from = nil
      end
    end
    return out
  end

  -- The earliest time from `at` on that no interval of `spans` covers.
  local function first_free(spans, at)
    table.sort(spans, function(p, q) return p[1] < q[1] end)
    for k = 1, #spans do
      local b = spans[k]
      if b[1] > at then break end
      if b[2] >= at then at = b[2] + 1 end
    end
    return at
  end

  -- Tiers of one log are not independent once entries lie ahead of `at`: each tier alone may
  -- fit again at a different time, and at the latest of those another tier may refuse again.
  -- For such logs the retry of every refusing tier becomes the first time that fits them all.
  -- (With nothing ahead each tier's wait only shrinks with time, and the longest one fits all.)
  -- A banned tier cannot be admitted before its ban ends, so its search starts there, for a
  -- log of one tier too.
  -- `tiers`: the sliding-log tiers of a call, {key, ok, retry, limit, period, cost, from}
  -- each, in order (from: `at`, or the end of the tier's ban); the retry of each refusing
  -- tier is updated in place.
  local function joint_retry(tiers, at)
    local groups, order = {}, {}
    for i = 1, #tiers do
      local t = tiers[i]
      if groups[t.key] == nil then
        groups[t.key] = {}
        order[#order + 1] = t.key
      end
      local g = groups[t.key]
      g[#g + 1] = t
    end
    for _, key in ipairs(order) do
      local g = groups[key]
      local refused, never, longest, late = false, false, 0, false
      for _, t in ipairs(g) do
        if not t.ok then refused = true end
        if t.retry < 0 then never = true end
        if t.period > longest then longest = t.period end
        if t.from > at then late = true end
      end
      if refused and not never and (#g > 1 or late)
          and redis.call('ZCOUNT', key, '(' .. at, '+inf') > 0 then
        local ts = times(key, at - longest)
        local spans = {}
        for _, t in ipairs(g) do blocked(ts, t.limit, t.period, t.cost, spans) end
        for _, t in ipairs(g) do
          if not t.ok then t.retry = first_free(spans, t.from) - at end
        end
      end
    end
  end

  return {times = times, peak = peak, blocked = blocked, first_free = first_free,
    joint_retry = joint_retry}
end

-- Refund, cancel and the deny cache's stability: built only for those operations.
local function sliding_log_upkeep()
  -- After entries leave the log, keep it only as long as its newest entry needs (an empty
  -- sorted set is already gone).
  local function expire(key, longest, now)
    local newest = redis.call('ZREVRANGE', key, 0, 0, 'WITHSCORES')
    if newest[2] then redis.call('PEXPIRE', key, tonumber(newest[2]) + longest - now) end
  end

  -- ZREM of `members`, 200 at a time: Lua's unpack fails past about 8000 values, and a
  -- booking or refund of such a cost must still be given back (commit writes likewise).
  local function zrem(key, members)
    for first = 1, #members, 200 do
      redis.call('ZREM', key, unpack(members, first, math.min(first + 199, #members)))
    end
  end

  -- Remove the members "<token>:1" .. "<token>:<cost>" of one call.
  local function remove(key, token, cost)
    local members = {}
    for j = 1, cost do members[#members + 1] = token .. ':' .. j end
    zrem(key, members)
  end

  -- Give back a hit: exactly its own entries when its token is known (the core compensating a
  -- refused multi-slot request), else the newest `cost` entries already in the past (never a
  -- future booking).
  local function refund(key, cost, token, longest, now)
    if token ~= '' then
      remove(key, token, cost)
    else
      local gone = redis.call('ZREVRANGEBYSCORE', key, now, '-inf', 'LIMIT', 0, cost)
      zrem(key, gone)
    end
    expire(key, longest, now)
  end

  -- Cancel one booking (its token and cost come from the Booking the client kept).
  local function cancel(key, token, cost, longest, now)
    remove(key, token, cost)
    expire(key, longest, now)
  end

  -- For the client's deny cache (main.lua), when no entry lies ahead of now: ms from now until
  -- the oldest entry of the window (now - period, now] leaves it and the remaining grows (-1:
  -- the window is empty, so until a write).
  local function stable(key, period, now)
    local oldest = redis.call('ZRANGEBYSCORE', key, string.format('(%d', now - period), '+inf',
      'WITHSCORES', 'LIMIT', 0, 1)[2]
    if not oldest then return -1 end
    return tonumber(oldest) + period - now
  end

  return refund, cancel, stable
end

-- Check and commit: built when a call has a sliding-log tier.
local function sliding_log()
  -- Per log key, what every tier reading it shares, read once per call: how many entries lie
  -- after `at` (bookings ahead), the newest entry's time (nil: empty log), the longest period
  -- of its tiers (the commit trims to it), and whether this call's entries are in yet.
  local logs = {}
  local ahead  -- sliding_log_ahead(), built on first need

  local function newest_of(key)
    local newest = redis.call('ZREVRANGE', key, '0', '0', 'WITHSCORES')[2]
    if newest then return tonumber(newest) end
    return nil
  end

  -- lazy: the caller uses reset_now only if this tier refuses (main.lua's one-tier path).
  -- Then, with nothing ahead of `at`, the newest entry is not needed: the reset after the hit
  -- is at + period, and sliding_log_count answers.
  local function check(key, limit, period, cost, at, now, lazy)
    local floor = at - period
    local log = logs[key]
    if log == nil then
      -- known: whether `newest` is read (false only for a lazy call with nothing ahead; then
      -- `seen` is the window's count).
      local newest, later, known, seen = nil, 0, true, 0
      if lazy then
        seen, later = sliding_log_count(key, period, at)
        if later > 0 then newest = newest_of(key) else known = false end
      else
        newest = newest_of(key)
        if newest and newest > at then
          later = redis.call('ZCOUNT', key, string.format('(%d', at), '+inf')
        end
      end
      log = {later = later, newest = newest, known = known, seen = seen, longest = period,
        done = false}
      logs[key] = log
    elseif log.longest < period then
      log.longest = period
    end
    local later = log.later
    local peak, ts
    if later > 0 then
      if ahead == nil then ahead = sliding_log_ahead() end
      ts = ahead.times(key, floor)
      peak = ahead.peak(ts, period, at)
    elseif not log.known then
      peak = log.seen
    elseif log.newest and log.newest > floor then
      peak = redis.call('ZCOUNT', key, string.format('(%d', floor), '+inf')
    else
      -- Nothing after `floor`: the window is empty, no need to ask.
      peak = 0
    end
    local before = limit - peak
    if before < 0 then before = 0 end
    local ok = peak + cost <= limit
    if not ok and not log.known then
      -- A refusal replies with reset_now, which needs the newest entry after all.
      log.newest = newest_of(key)
      log.known = true
    end
    local newest = log.newest
    local reset_now, last = 0, at
    if not log.known then
      -- Admitted, nothing ahead: the newest entry is at or before `at`; reset_now is unused.
      reset_now = false
    elseif newest and newest > floor then
      last = newest
      reset_now = last + period - now
      if last < at then last = at end
    end
    local retry = 0
    if cost > limit then
      retry = -1
    elseif not ok then
      if later == 0 then
        -- The (peak + cost - limit)-th oldest hit must leave the window.
        local k = peak + cost - limit - 1
        local old = redis.call('ZRANGEBYSCORE', key, string.format('(%d', floor), '+inf',
          'WITHSCORES', 'LIMIT', k, 1)
        retry = tonumber(old[2]) + period - at
      else
        -- Bookings ahead make the peak rise and fall: take the first time no full window covers.
        retry = ahead.first_free(ahead.blocked(ts, limit, period, cost, {}), at) - at
      end
    end
    return ok, before, retry, reset_now, last + period - now, later > 0
  end

  -- Record this call's entries once per log (its other tiers call too).
  local function commit(key, at, cost, token, now)
    local log = logs[key]
    if log.done then return end
    log.done = true
    local newest = at
    if log.newest and log.newest > at then newest = log.newest end
    sliding_log_record(key, at, cost, token, log.longest, newest, now)
  end

  return check, commit
end
