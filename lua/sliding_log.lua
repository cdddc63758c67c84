-- sliding-log: the exact sliding window. A sorted set of admitted hits and bookings, scored by
-- their time in ms, one member per hit named by the call's unique token: "<token>" for a cost
-- of one, "<token>#<cost>" above, and, while it holds any of those, the member "+" scored
-- minus their running total above one apiece (below every time: no window sees it). So a hit
-- is O(log n) whatever its cost, and memory O(hits). A log written before costs were kept
-- (members "<token>:<n>", one per unit of cost) has no "+": each of its members weighs one,
-- as they did, and it is read as it is. All tiers of one policy share one log; it is trimmed
-- to the longest tier's period.
-- A hit at `now` (or a booking at `at`) is admitted when EVERY window [s, s + period) that
-- contains it holds at most limit - cost units. With no entries after `at` that is simply
-- the units in (at - period, at]; bookings in the future make the later windows matter too.
-- KEYS: the policy's log.
-- ARGV (per tier, read by main.lua): limit, period ms, cost.
-- Reply (to main.lua): sliding_log() builds check and commit. check's reply is as in
--       fixed_window.lua up to the reset after the hit, then whether entries lie ahead of
--       `at` (the joint retry then applies); commit writes the log itself, once per log.
--       What only bookings ahead need, and refund and cancel, are built apart, on demand:
--       a script run pays for every closure it creates.

-- The two steps of the request's usual hit, top-level so that main.lua's one-tier path writes
-- them out in place (`--@inline`) and sliding_log()'s check and commit call them: one source.

-- The count of the window (at - period, at] and how many entries lie after `at` (bookings),
-- for a log whose members weigh one each; `later` is -1 for a log with costs (counted by the
-- general path). One ZCOUNT of everything after the window's start answers an empty window
-- alone; a second counts what lies ahead: cheaper than a ZREVRANGE WITHSCORES and a ZCOUNT.
local function sliding_log_count(key, period, at)
  local seen = redis.call('ZCOUNT', key, string.format('(%d', at - period), '+inf')
  local later = 0
  if seen > 0 then
    later = redis.call('ZCOUNT', key, string.format('(%d', at), '+inf')
    if later == 0 and redis.call('ZSCORE', key, '+') then later = -1 end
  end
  return seen, later
end

-- Record one hit of cost one at `at` in a log without costs (or one whose window is empty:
-- the trim then takes "+" too), trim what the longest window can no longer see, and keep the
-- log alive until its newest entry (`newest`: this one, or a booking further ahead) has left
-- that window. Numbers are formatted with "%d": Redis would format them with the slower
-- "%.17g".
local function sliding_log_record(key, at, token, longest, newest, now)
  redis.call('ZADD', key, string.format('%d', at), token)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - longest))
  redis.call('PEXPIRE', key, string.format('%d', newest + longest - now))
end

-- What a member weighs: the cost in its name, else one.
local function sliding_log_weight(member)
  local cost = string.match(member, '#(%d+)$')
  if cost then return tonumber(cost) end
  return 1
end

-- A hit's member: its token, and its cost above one.
local function sliding_log_member(token, cost)
  if cost == 1 then return token end
  return token .. '#' .. string.format('%d', cost)
end

-- Store a log's running total above one ("+", scored minus it; none left: no "+").
local function sliding_log_extra(key, extra)
  if extra > 0 then
    redis.call('ZADD', key, string.format('%d', -extra), '+')
  else
    redis.call('ZREM', key, '+')
  end
end

-- Drop the entries at or before `upto` (no window of this call can see them) from a log with
-- costs, and their costs from the running total `extra`; returns the total left.
local function sliding_log_trim(key, upto, extra)
  local bound = string.format('%d', upto)
  local gone = redis.call('ZRANGEBYSCORE', key, 0, bound)
  if #gone == 0 then return extra end
  for k = 1, #gone do extra = extra - sliding_log_weight(gone[k]) + 1 end
  redis.call('ZREMRANGEBYSCORE', key, 0, bound)
  sliding_log_extra(key, extra)
  return extra
end

-- The entries after `from` (ascending): their members, times and costs.
local function sliding_log_entries(key, from)
  local raw = redis.call('ZRANGEBYSCORE', key, string.format('(%d', from), '+inf', 'WITHSCORES')
  local members, ts, ws = {}, {}, {}
  for i = 1, #raw, 2 do
    members[#members + 1] = raw[i]
    ts[#ts + 1] = tonumber(raw[i + 1])
    ws[#ws + 1] = sliding_log_weight(raw[i])
  end
  return members, ts, ws
end

-- What entries ahead of `at` (bookings) call for: built only when a call meets them. Times
-- `ts` ascend; `ws` are their costs.
local function sliding_log_ahead()
  -- The fullest window [s, s + period) containing `at` (s in (at - period, at]), over the
  -- entries (none at or before at - period). Sliding s to the right only loses entries until
  -- the window's end reaches a new one, so the candidates are the window ending at `at` and
  -- the windows ending at each entry in (at, at + period).
  local function peak(ts, ws, period, at)
    local n = #ts
    local best, lo, hi, sum = 0, 1, 0, 0
    local stop = at
    while true do
      while hi < n and ts[hi + 1] <= stop do
        hi = hi + 1
        sum = sum + ws[hi]
      end
      while lo <= hi and ts[lo] <= stop - period do
        sum = sum - ws[lo]
        lo = lo + 1
      end
      if sum > best then best = sum end
      if hi >= n or ts[hi + 1] >= at + period then return best end
      stop = ts[hi + 1]
    end
  end

  -- Append to `out` the intervals {first, last} of booking times at which `cost` more units
  -- would NOT fit this tier. A window starting at s holds the entries t with s <= t < s +
  -- period, so each entry counts for s in [t - period + 1, t]; a sweep over those edges finds
  -- the starts s whose window has no room, and a booking is refused exactly when some such
  -- window contains it: at any time in [s, s + period - 1].
  local function blocked(ts, ws, limit, period, cost, out)
    local full = limit - cost + 1
    local n = #ts
    local i, j, count, from = 1, 1, 0, nil
    while j <= n do
      local x = ts[j] + 1
      if i <= n and ts[i] - period + 1 < x then x = ts[i] - period + 1 end
      while i <= n and ts[i] - period + 1 == x do count = count + ws[i]; i = i + 1 end
      while j <= n and ts[j] + 1 == x do count = count - ws[j]; j = j + 1 end
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
        local _, ts, ws = sliding_log_entries(key, at - longest)
        local spans = {}
        for _, t in ipairs(g) do blocked(ts, ws, t.limit, t.period, t.cost, spans) end
        for _, t in ipairs(g) do
          if not t.ok then t.retry = first_free(spans, t.from) - at end
        end
      end
    end
  end

  return {peak = peak, blocked = blocked, first_free = first_free, joint_retry = joint_retry}
end

-- Refund, cancel and the deny cache's stability: built only for those operations.
local function sliding_log_upkeep()
  -- After entries leave the log, keep it only as long as its newest entry needs (an empty
  -- sorted set is already gone; "+" goes with the last member of a cost above one).
  local function expire(key, longest, now)
    local newest = redis.call('ZREVRANGE', key, 0, 0, 'WITHSCORES')
    if newest[2] then redis.call('PEXPIRE', key, tonumber(newest[2]) + longest - now) end
  end

  -- Take up to `amount` units off the members `members` (scored `ts`), in order: a member
  -- given back whole leaves the log, one given back in part stays with the rest of its cost
  -- (renamed: its name carries its cost). Returns the running total left.
  local function take(key, members, ts, amount, extra)
    local gone = {}
    for k = 1, #members do
      if amount <= 0 then break end
      local w = sliding_log_weight(members[k])
      if amount >= w then
        gone[#gone + 1] = members[k]
        extra = extra - w + 1
        amount = amount - w
      else
        redis.call('ZREM', key, members[k])
        local token = string.match(members[k], '^(.*)#%d+$')
        redis.call('ZADD', key, string.format('%d', ts[k]),
          sliding_log_member(token, w - amount))
        extra = extra - amount
        amount = 0
      end
    end
    for first = 1, #gone, 200 do
      redis.call('ZREM', key, unpack(gone, first, math.min(first + 199, #gone)))
    end
    return extra
  end

  -- Give back `amount` of the hit (or booking) named `token`, which recorded `cost`: from its
  -- own member, which leaves once given back whole; a member no longer in the log has left
  -- every window, and there is nothing to give back. A log written before costs were kept
  -- holds the hit as members "<token>:1" .. "<token>:<cost>": the first `amount` leave.
  local function give_back(key, extra, token, cost, amount)
    local member = sliding_log_member(token, cost)
    local score = redis.call('ZSCORE', key, member)
    if score then return take(key, {member}, {tonumber(score)}, amount, extra) end
    local n = redis.call('ZCARD', key)
    if amount < n then n = amount end
    local old = {}
    for j = 1, n do old[#old + 1] = token .. ':' .. j end
    for first = 1, #old, 200 do
      redis.call('ZREM', key, unpack(old, first, math.min(first + 199, #old)))
    end
    return extra
  end

  -- Give back a hit: from its own member when its token is known (`cost`: what it recorded,
  -- e.g. a settle's estimate; the core compensating a refused multi-slot request), else
  -- `amount` units from the newest entries already in the past (never a future booking).
  local function refund(key, amount, token, longest, now, cost)
    local extra = -(tonumber(redis.call('ZSCORE', key, '+')) or 0)
    local before = extra
    if token ~= '' then
      extra = give_back(key, extra, token, cost or amount, amount)
    else
      -- Each member weighs one at least: `amount` members are enough.
      local raw = redis.call('ZREVRANGEBYSCORE', key, now, 0, 'WITHSCORES', 'LIMIT', 0,
        string.format('%d', amount))
      local members, ts = {}, {}
      for i = 1, #raw, 2 do
        members[#members + 1] = raw[i]
        ts[#ts + 1] = tonumber(raw[i + 1])
      end
      extra = take(key, members, ts, amount, extra)
    end
    if extra ~= before then sliding_log_extra(key, extra) end
    expire(key, longest, now)
  end

  -- Cancel one booking (its token and cost come from the Booking the client kept).
  local function cancel(key, token, cost, longest, now)
    local extra = -(tonumber(redis.call('ZSCORE', key, '+')) or 0)
    local left = give_back(key, extra, token, cost, cost)
    if left ~= extra then sliding_log_extra(key, left) end
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
  -- of its tiers (the commit trims to it), whether this call's entry is in yet, and `extra`,
  -- the running total above one apiece of its costs (0: none).
  local logs = {}
  local ahead  -- sliding_log_ahead(), built on first need

  local function newest_of(key)
    local newest = redis.call('ZREVRANGE', key, '0', '0', 'WITHSCORES')[2]
    if newest then return tonumber(newest) end
    return nil
  end

  -- The units in (floor, +inf) of a log with costs, trimmed to `trimmed`: the members there
  -- plus what their costs add, read from whichever side of `floor` holds fewer members (the
  -- running total covers both).
  local function units(key, log, floor)
    local inside = redis.call('ZCOUNT', key, string.format('(%d', floor), '+inf')
    if floor <= log.trimmed then return inside + log.extra end
    local outside = redis.call('ZCOUNT', key, 0, string.format('%d', floor))
    if outside == 0 then return inside + log.extra end
    local members
    if outside < inside then
      members = redis.call('ZRANGEBYSCORE', key, 0, string.format('%d', floor))
    else
      members = redis.call('ZRANGEBYSCORE', key, string.format('(%d', floor), '+inf')
    end
    local add = 0
    for k = 1, #members do add = add + sliding_log_weight(members[k]) - 1 end
    if outside < inside then return inside + log.extra - add end
    return inside + add
  end

  -- When the `need`-th oldest unit after `floor` leaves the window: its member's time.
  local function leaving(key, log, floor, need)
    if log.extra == 0 then
      return tonumber(redis.call('ZRANGEBYSCORE', key, string.format('(%d', floor), '+inf',
        'WITHSCORES', 'LIMIT', need - 1, 1)[2])
    end
    local offset = 0
    while true do
      local raw = redis.call('ZRANGEBYSCORE', key, string.format('(%d', floor), '+inf',
        'WITHSCORES', 'LIMIT', offset, 200)
      for i = 1, #raw, 2 do
        need = need - sliding_log_weight(raw[i])
        if need <= 0 then return tonumber(raw[i + 1]) end
      end
      offset = offset + 200
    end
  end

  -- lazy: the caller uses reset_now only if this tier refuses (main.lua's one-tier path).
  -- Then, with nothing ahead of `at`, the newest entry is not needed: the reset after the hit
  -- is at + period, and the window's count answers. `longest`: the longest period of the
  -- call's tiers reading this log (what no window of the call sees is trimmed first).
  local function check(key, limit, period, cost, at, now, lazy, longest)
    local floor = at - period
    local log = logs[key]
    if log == nil then
      local extra = -(tonumber(redis.call('ZSCORE', key, '+')) or 0)
      if extra > 0 then extra = sliding_log_trim(key, now - longest, extra) end
      -- known: whether `newest` is read (false only for a lazy call with nothing ahead; then
      -- `seen` is the window's count).
      local newest, later, known, seen = nil, 0, true, 0
      if lazy and extra == 0 then
        seen = redis.call('ZCOUNT', key, string.format('(%d', floor), '+inf')
        if seen > 0 then later = redis.call('ZCOUNT', key, string.format('(%d', at), '+inf') end
        if later > 0 then newest = newest_of(key) else known = false end
      else
        newest = newest_of(key)
        if newest and newest > at then
          later = redis.call('ZCOUNT', key, string.format('(%d', at), '+inf')
        end
      end
      log = {later = later, newest = newest, known = known, seen = seen, longest = longest,
        done = false, extra = extra, trimmed = now - longest}
      logs[key] = log
    end
    local later = log.later
    local peak, ts, ws
    if later > 0 then
      if ahead == nil then ahead = sliding_log_ahead() end
      local _m
      _m, ts, ws = sliding_log_entries(key, floor)
      peak = ahead.peak(ts, ws, period, at)
    elseif not log.known then
      peak = log.seen
    elseif log.newest and log.newest > floor then
      if log.extra > 0 then
        peak = units(key, log, floor)
      else
        peak = redis.call('ZCOUNT', key, string.format('(%d', floor), '+inf')
      end
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
        -- The (peak + cost - limit)-th oldest unit must leave the window.
        retry = leaving(key, log, floor, peak + cost - limit) + period - at
      else
        -- Bookings ahead make the peak rise and fall: take the first time no full window covers.
        retry = ahead.first_free(ahead.blocked(ts, ws, limit, period, cost, {}), at) - at
      end
    end
    return ok, before, retry, reset_now, last + period - now, later > 0
  end

  -- Record this call's hit once per log (its other tiers call too): one member, named by the
  -- call's token and its cost.
  local function commit(key, at, cost, token, now)
    local log = logs[key]
    if log.done then return end
    log.done = true
    local newest = at
    if log.newest and log.newest > at then newest = log.newest end
    if cost == 1 and log.extra == 0 then
      sliding_log_record(key, at, token, log.longest, newest, now)
      return
    end
    local extra = log.extra
    if extra == 0 then
      -- The first cost above one: what the trim drops weighs one apiece.
      redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - log.longest))
    end
    -- A log charged deep in debt (settles) holds at most 2^52 above one unit per hit, so that
    -- its count stays exact in a double: the hit records what fits.
    if extra + cost - 1 > 4503599627370496 then cost = 4503599627370496 - extra + 1 end
    redis.call('ZADD', key, string.format('%d', at), sliding_log_member(token, cost))
    if cost > 1 then sliding_log_extra(key, extra + cost - 1) end
    redis.call('PEXPIRE', key, string.format('%d', newest + log.longest - now))
  end

  return check, commit
end
