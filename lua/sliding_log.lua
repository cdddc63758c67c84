-- sliding-log: the exact sliding window. A sorted set of admitted hits and bookings, scored by
-- their time in ms, members "<token>:<n>" (the client's unique token, one member per unit of
-- cost). All tiers of one policy share one log; it is trimmed to the longest tier's period.
-- A hit at `now` (or a booking at `at`) is admitted when EVERY window [s, s + period) that
-- contains it holds at most limit - cost entries. With no entries after `at` that is simply
-- the count in (at - period, at]; bookings in the future make the later windows matter too.
-- KEYS: the policy's log.
-- ARGV (per tier, read by main.lua): limit, period ms, cost.
-- Reply (to main.lua): as fixed_window.lua.

local function sl_times(key, from)
  local raw = redis.call('ZRANGEBYSCORE', key, '(' .. from, '+inf', 'WITHSCORES')
  local ts = {}
  for i = 2, #raw, 2 do ts[#ts + 1] = tonumber(raw[i]) end
  return ts
end

-- The fullest window [s, s + period) containing `at` (s in (at - period, at]), over the
-- ascending times `ts` (none at or before at - period). Sliding s to the right only loses
-- entries until the window's end reaches a new one, so the candidates are the window ending
-- at `at` and the windows ending at each entry in (at, at + period).
local function sl_peak(ts, period, at)
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
local function sl_blocked(ts, limit, period, cost, out)
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

-- The earliest time from `at` on that no interval of `blocked` covers.
local function sl_first_free(blocked, at)
  table.sort(blocked, function(p, q) return p[1] < q[1] end)
  for k = 1, #blocked do
    local b = blocked[k]
    if b[1] > at then break end
    if b[2] >= at then at = b[2] + 1 end
  end
  return at
end

-- What every tier reading one log shares, read once per call: how many entries lie after
-- `at` (bookings ahead), and the newest entry's time (nil when the log is empty).
local function sl_facts(memo, key, at)
  local facts = memo[key]
  if facts == nil then
    local newest = redis.call('ZREVRANGE', key, 0, 0, 'WITHSCORES')
    local later = 0
    if newest[2] and tonumber(newest[2]) > at then
      later = redis.call('ZCOUNT', key, '(' .. at, '+inf')
    end
    facts = {later = later, newest = newest[2] and tonumber(newest[2])}
    memo[key] = facts
  end
  return facts
end

local function sl_check(key, limit, period, cost, at, now, memo)
  local floor = at - period
  local facts = sl_facts(memo, key, at)
  local later = facts.later
  local peak, ts
  if later == 0 then
    peak = redis.call('ZCOUNT', key, '(' .. floor, '+inf')
  else
    ts = sl_times(key, floor)
    peak = sl_peak(ts, period, at)
  end
  local before = limit - peak
  if before < 0 then before = 0 end
  local ok = peak + cost <= limit
  local reset_now, last = 0, at
  if facts.newest and facts.newest > floor then
    last = facts.newest
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
      local old = redis.call('ZRANGEBYSCORE', key, '(' .. floor, '+inf', 'WITHSCORES', 'LIMIT', k, 1)
      retry = tonumber(old[2]) + period - at
    else
      -- Bookings ahead make the peak rise and fall: take the first time no full window covers.
      retry = sl_first_free(sl_blocked(ts, limit, period, cost, {}), at) - at
    end
  end
  return ok, before, retry, reset_now, last + period - now
end

-- Record `cost` entries at `at`, trim what no tier can see any more, and keep the log alive
-- until the last entry has left the longest window.
local function sl_commit(key, at, cost, token, longest, now, facts)
  local args = {}
  for j = 1, cost do
    args[#args + 1] = at
    args[#args + 1] = token .. ':' .. j
    if #args >= 200 then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', key, unpack(args)) end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - longest)
  -- The log lives until its newest entry has left the longest window: this one, unless a
  -- booking lies further ahead.
  local newest = at
  if facts and facts.newest and facts.newest > at then newest = facts.newest end
  redis.call('PEXPIRE', key, newest + longest - now)
end

-- After entries leave the log, keep it only as long as its newest entry needs (an empty
-- sorted set is already gone).
local function sl_expire(key, longest, now)
  local newest = redis.call('ZREVRANGE', key, 0, 0, 'WITHSCORES')
  if newest[2] then redis.call('PEXPIRE', key, tonumber(newest[2]) + longest - now) end
end

-- Remove the members "<token>:1" .. "<token>:<cost>" of one call.
local function sl_remove(key, token, cost)
  local members = {}
  for j = 1, cost do members[#members + 1] = token .. ':' .. j end
  redis.call('ZREM', key, unpack(members))
end

-- Give back a hit: exactly its own entries when its token is known (the core compensating a
-- refused multi-slot request), else the newest `cost` entries already in the past (never a
-- future booking).
local function sl_refund(key, cost, token, longest, now)
  if token ~= '' then
    sl_remove(key, token, cost)
  else
    local gone = redis.call('ZREVRANGEBYSCORE', key, now, '-inf', 'LIMIT', 0, cost)
    if #gone > 0 then redis.call('ZREM', key, unpack(gone)) end
  end
  sl_expire(key, longest, now)
end

-- Cancel one booking (its token and cost come from the Booking the client kept).
local function sl_cancel(key, token, cost, longest, now)
  sl_remove(key, token, cost)
  sl_expire(key, longest, now)
end

-- Tiers of one log are not independent once entries lie ahead of `at`: each tier alone may
-- fit again at a different time, and at the latest of those another tier may refuse again.
-- For such logs the retry of every refusing tier becomes the first time that fits them all.
-- (With nothing ahead each tier's wait only shrinks with time, and the longest one fits all.)
local function sl_joint_retry(tiers, at)
  local groups, order = {}, {}
  for i = 1, #tiers do
    local t = tiers[i]
    if t.algo == 'sl' and t.banned == 0 then
      if groups[t.key] == nil then
        groups[t.key] = {}
        order[#order + 1] = t.key
      end
      local g = groups[t.key]
      g[#g + 1] = t
    end
  end
  for _, key in ipairs(order) do
    local g = groups[key]
    local refused, never, longest = false, false, 0
    for _, t in ipairs(g) do
      if not t.ok then refused = true end
      if t.retry < 0 then never = true end
      if t.period > longest then longest = t.period end
    end
    if refused and not never and #g > 1 and redis.call('ZCOUNT', key, '(' .. at, '+inf') > 0 then
      local ts = sl_times(key, at - longest)
      local blocked = {}
      for _, t in ipairs(g) do sl_blocked(ts, t.limit, t.period, t.cost, blocked) end
      local retry = sl_first_free(blocked, at) - at
      for _, t in ipairs(g) do
        if not t.ok then t.retry = retry end
      end
    end
  end
end
