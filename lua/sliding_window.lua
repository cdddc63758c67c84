-- sliding-window: Cloudflare's two-counter approximation of a sliding window.
-- The estimate prev * (1 - elapsed/period) + curr is compared in integers:
--   prev * (period - elapsed) + (curr + cost) * period <= limit * period
-- (Rate() keeps limit * period below 2^53, so every product here is exact in a double.)
-- KEYS: the tier's key, value "<current window start ms>:<curr>:<prev>"; it lives two periods
--       because the previous window still weighs on the current one.
-- ARGV (per tier, read by main.lua): limit, period ms, cost.
-- Reply (to main.lua): as fixed_window.lua: sliding_window() builds check and refund;
--       check(value, ...) returns the value and PX to write (false: keep the TTL).

-- The window containing `now`, the counts that still weigh on it, from the key's value, and
-- whether the value already is this window's (then its TTL already ends two periods after
-- the window's start, where every write of this window puts it).
local function sliding_window_state(v, period, now)
  local start = now - (now % period)
  local curr, prev, current = 0, 0, false
  if v then
    -- The pattern admits only digits, so `+ 0` (one strtod; tonumber() runs two) is safe.
    local s, c, p = string.match(v, '^(%d+):(%d+):(%d+)$')
    if s then
      s = s + 0
      if s == start then
        curr = c + 0
        prev = p + 0
        current = true
      elseif s == start - period then
        prev = c + 0
      end
    end
  end
  return start, now - start, curr, prev, current
end

local function sliding_window()
  -- own_clock: as in fixed_window.lua.
  local function check(v, limit, period, cost, now, own_clock)
    local start, elapsed, curr, prev, current = sliding_window_state(v, period, now)
    local budget = limit * period - prev * (period - elapsed)
    local before = math.floor(budget / period) - curr
    if before < 0 then before = 0 end
    local ok = (curr + cost) * period <= budget
    local reset_now = 0
    if curr > 0 then
      reset_now = 2 * period - elapsed
    elseif prev > 0 then
      reset_now = period - elapsed
    end
    local retry = 0
    if cost > limit then
      retry = -1
    elseif not ok then
      if curr + cost <= limit then
        -- Only the previous window's weight is in the way: wait until it has decayed enough.
        retry = period - math.floor((limit - curr - cost) * period / prev) - elapsed
      else
        -- This window is full: wait for the next one, where today's count becomes the weight.
        local later = period - math.floor((limit - cost) * period / curr)
        if later < 0 then later = 0 end
        retry = period - elapsed + later
      end
    end
    -- PX false: keep the TTL (a cheaper SET), already right for this window (not under a test
    -- clock: see fixed_window.lua).
    local px = 2 * period - elapsed
    if current and own_clock then px = false end
    -- A window charged deep in debt (settles) holds at most 2^52 / period (and never less
    -- than the limit), so that count x period stays exact in a double: it refuses until it
    -- has decayed either way. (The quotient is made exact: a double may round it up.)
    local total = curr + cost
    if total > limit then
      local most = math.floor(4503599627370496 / period)
      if most * period > 4503599627370496 then most = most - 1 end
      if most < limit then most = limit end
      if total > most then total = most end
    end
    return ok, before, retry, reset_now, 2 * period - elapsed,
      string.format('%d:%d:%d', start, total, prev), px
  end

  -- charged_us: when the hit given back was charged (a settle), else nil: then the give-back
  -- comes out of the count of the window it was charged in (the previous one still weighs on
  -- this one), and out of nothing once that window no longer weighs.
  local function refund(key, period, cost, now, charged_us)
    local start, elapsed, curr, prev = sliding_window_state(redis.call('GET', key), period, now)
    if curr == 0 and prev == 0 then return end
    local back = cost
    if charged_us then
      local charged = math.floor(charged_us / 1000)
      local from = charged - (charged % period)
      if from == start then
        if curr >= back then curr = curr - back else curr = 0 end
      elseif from == start - period then
        if prev >= back then prev = prev - back else prev = 0 end
      else
        return
      end
      back = 0
    end
    if curr >= back then curr = curr - back; back = 0 else back = back - curr; curr = 0 end
    if back > 0 then prev = prev - back; if prev < 0 then prev = 0 end end
    redis.call('SET', key, string.format('%d:%d:%d', start, curr, prev), 'PX',
      2 * period - elapsed)
  end

  -- For the client's deny cache (main.lua): ms from now during which this tier's numbers stay
  -- as they are (retry and reset count down): to the window's end, or sooner to when the
  -- fading weight of the previous window lets the estimate's floor, the remaining, grow.
  local function stable(v, period, now)
    local _, elapsed, _, prev = sliding_window_state(v, period, now)
    -- ceil(prev * (period - elapsed) / period): the whole hits the previous window still takes
    local weight = math.floor((prev * (period - elapsed) + period - 1) / period)
    if weight < 1 then return period - elapsed end
    return period - math.floor((weight - 1) * period / prev) - elapsed
  end

  return check, refund, stable
end
