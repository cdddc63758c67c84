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

-- The fullest window [s, s + period) containing `at`, over the ascending times `ts`.
local function sl_peak(ts, period, at)
  local n = #ts
  local best, lo, hi = 0, 1, 0
  local s = at - period + 1
  while true do
    while lo <= n and ts[lo] < s do lo = lo + 1 end
    while hi < n and ts[hi + 1] <= s + period - 1 do hi = hi + 1 end
    if hi - lo + 1 > best then best = hi - lo + 1 end
    local k = lo
    while k <= n and ts[k] <= s do k = k + 1 end
    if k > n or ts[k] > at then break end
    s = ts[k]
  end
  return best
end

local function sl_check(key, limit, period, cost, at, now)
  local floor = at - period
  local later = redis.call('ZCOUNT', key, '(' .. at, '+inf')
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
  local newest = redis.call('ZREVRANGEBYSCORE', key, '+inf', '(' .. floor, 'WITHSCORES', 'LIMIT', 0, 1)
  local reset_now, last = 0, at
  if newest[2] then
    last = tonumber(newest[2])
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
      -- The peak can only drop when an entry leaves a window: try those moments in order.
      retry = last + period - at
      for i = 1, #ts do
        local t = ts[i] + period
        if t > at and sl_peak(ts, period, t) + cost <= limit then
          retry = t - at
          break
        end
      end
    end
  end
  return ok, before, retry, reset_now, last + period - now
end

-- Record `cost` entries at `at`, trim what no tier can see any more, and keep the log alive
-- until the last entry has left the longest window.
local function sl_commit(key, at, cost, token, longest, now)
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
  local newest = redis.call('ZREVRANGE', key, 0, 0, 'WITHSCORES')
  redis.call('PEXPIRE', key, tonumber(newest[2]) + longest - now)
end

-- Give back the newest `cost` entries already in the past (never a future booking).
local function sl_refund(key, cost, now)
  local gone = redis.call('ZREVRANGEBYSCORE', key, now, '-inf', 'LIMIT', 0, cost)
  if #gone > 0 then redis.call('ZREM', key, unpack(gone)) end
end

-- Cancel one booking: its members are "<token>:1" .. "<token>:<cost>".
local function sl_cancel(key, token, cost)
  local members = {}
  for j = 1, cost do members[#members + 1] = token .. ':' .. j end
  redis.call('ZREM', key, unpack(members))
end
