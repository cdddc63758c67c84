-- fixed-window: one counter per window; windows aligned to the epoch, or to the calendar
-- boundaries the client computed for a time zone ("b0,b1,b2,b3" in ms, ascending).
-- KEYS: the tier's key, value "<window start ms>:<count>" (the start makes a stale value
--       harmless, so expiry is only garbage collection).
-- ARGV (per tier, read by main.lua): limit, period ms, cost, calendar boundaries or "".
-- Reply (to main.lua): fixed_window() builds check and refund. main.lua calls it only when a
--       call has a fixed-window tier: a script run creates a closure for each function it
--       defines, so calls of other algorithms never pay for these. check(value, ...) takes the
--       key's value as main.lua read it (false: none) and returns ok, remaining before the hit,
--       retry ms (-1: never), reset ms now, reset ms after the hit, then the value and PX ms
--       main.lua SETs if every tier admits (PX false: keep the key's TTL, already right).
--       refund(key, ...) gives a hit back.

local function fixed_window()
  local function window(period, cal, now)
    if cal ~= '' then
      local prev
      for b in string.gmatch(cal, '[^,]+') do
        b = tonumber(b)
        if prev and prev <= now and now < b then return prev, b end
        prev = b
      end
    end
    -- No calendar, or the clocks disagree by more than the boundaries cover: stay epoch aligned.
    local start = now - (now % period)
    return start, start + period
  end

  -- own_clock: `now` is Redis's clock (not a test clock), the one keys expire by.
  local function check(v, limit, period, cost, cal, now, own_clock)
    local start, stop = window(period, cal, now)
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
    local ok = count + cost <= limit
    local retry = 0
    if cost > limit then retry = -1 elseif not ok then retry = stop - now end
    -- %d formats integers faster than `..` (which goes through %.14g).
    return ok, before, retry, reset_now, stop - now, string.format('%d:%d', start, count + cost), px
  end

  local function refund(key, period, cost, cal, now)
    local start = window(period, cal, now)
    local v = redis.call('GET', key)
    if not v then return end
    local s, c = string.match(v, '^(%-?%d+):(%d+)$')
    if s and tonumber(s) == start then
      local count = tonumber(c) - cost
      if count < 0 then count = 0 end
      redis.call('SET', key, string.format('%d:%d', start, count), 'KEEPTTL')
    end
  end

  return check, refund
end
