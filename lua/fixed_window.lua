-- fixed-window: one counter per window; windows aligned to the epoch, or, for the whole-day
-- tiers of a policy with a time zone, to local midnight by the zone's UTC-offset schedule
-- (core/wire.py): "o0,t1,o1,t2,o2,..." in ms, offset o0 until the instant t1, then o1 until t2,
-- and so on. Redis's clock picks the window in both cases.
-- KEYS: the tier's key, value "<window start ms>:<count>" (the start makes a stale value
--       harmless, so expiry is only garbage collection).
-- ARGV (per tier, read by main.lua): limit, period ms, cost, the schedule or "".
-- Reply (to main.lua): fixed_window() builds check and refund. main.lua calls it only when a
--       call has a fixed-window tier: a script run creates a closure for each function it
--       defines, so calls of other algorithms never pay for these. check(value, ...) takes the
--       key's value as main.lua read it (false: none) and returns ok, remaining before the hit,
--       retry ms (-1: never), reset ms now, reset ms after the hit, then the value and PX ms
--       main.lua SETs if every tier admits (PX false: keep the key's TTL, already right).
--       refund(key, ...) gives a hit back.

local function fixed_window()
  local DAY = 86400000

  -- The first instant whose local date is local day `day` (days since 1970-01-01) or later:
  -- local midnight, or the end of a gap that skips it. `s` is the parsed schedule; in the
  -- segment of offset s[k] (from s[k - 1], up to s[k + 1]) local time is utc + s[k].
  local function day_start(s, day)
    local m = day * DAY
    local k = 1
    while true do
      local t, stop = m - s[k], s[k + 1]
      if stop == nil or t < stop then
        if k > 1 and t < s[k - 1] then t = s[k - 1] end
        return t
      end
      k = k + 2
    end
  end

  local function window(period, cal, now)
    if cal ~= '' then
      local s = {}
      for v in string.gmatch(cal, '[^,]+') do s[#s + 1] = v + 0 end
      local k = 1
      while s[k + 1] ~= nil and s[k + 1] <= now do k = k + 2 end
      local days = period / DAY
      local origin = 0  -- 1970-01-01; weeks start on Monday 1969-12-29
      if days % 7 == 0 then origin = -3 end
      local day = math.floor((now + s[k]) / DAY)
      day = day - (day - origin) % days
      local start, stop = day_start(s, day), day_start(s, day + days)
      -- A clock set back over midnight can leave the local date behind a day already begun.
      if stop <= now then start, stop = stop, day_start(s, day + 2 * days) end
      return start, stop
    end
    local start = now - (now % period)
    return start, start + period
  end

  -- own_clock: `now` is Redis's clock (not a test clock), the one keys expire by.
  local function check(v, limit, period, cost, cal, now, own_clock)
    local start, stop
    if cal == '' then
      start = now - (now % period)
      stop = start + period
    else
      start, stop = window(period, cal, now)
    end
    local count = 0
    -- PX for the write: none (keep the TTL, a cheaper SET) when the key already holds this
    -- epoch-aligned window, whose first write made it expire at the window's end. Not under a
    -- test clock: Redis expires by its own clock, so there each write recomputes the TTL.
    local px = stop - now
    if v then
      -- The pattern admits only digits, so `+ 0` (one strtod; tonumber() runs two) is safe.
      local s, c = string.match(v, '^(%-?%d+):(%d+)$')
      if s and s + 0 == start then
        count = c + 0
        if cal == '' and own_clock then px = false end
      end
    end
    local before = limit - count
    if before < 0 then before = 0 end
    local reset_now = 0
    if count > 0 then reset_now = stop - now end
    local total = count + cost
    local ok = total <= limit
    -- A window charged past 2^53 - 1 (settles in debt) holds that many: doubles count exactly
    -- up to there, and it refuses until it ends either way.
    if total > 9007199254740991 then total = 9007199254740991 end
    local retry = 0
    if cost > limit then retry = -1 elseif not ok then retry = stop - now end
    -- %d formats integers faster than `..` (which goes through %.14g).
    return ok, before, retry, reset_now, stop - now, string.format('%d:%d', start, total), px
  end

  -- charged_us: when the hit given back was charged (a settle), else nil. A give-back belongs
  -- to the window it was charged in: once that window has ended there is nothing to give.
  local function refund(key, period, cost, cal, now, charged_us)
    local start = window(period, cal, now)
    if charged_us and window(period, cal, math.floor(charged_us / 1000)) ~= start then return end
    local v = redis.call('GET', key)
    if not v then return end
    local s, c = string.match(v, '^(%-?%d+):(%d+)$')
    if s and tonumber(s) == start then
      local count = tonumber(c) - cost
      if count < 0 then count = 0 end
      redis.call('SET', key, string.format('%d:%d', start, count), 'KEEPTTL')
    end
  end

  -- For the client's deny cache (main.lua): ms from now during which this tier's numbers stay
  -- as they are (the count holds to the window's end; retry and reset count down).
  local function stable(period, cal, now)
    local _, stop = window(period, cal, now)
    return stop - now
  end

  return check, refund, stable
end
