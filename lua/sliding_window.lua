-- sliding-window: Cloudflare's two-counter approximation of a sliding window.
-- The estimate prev * (1 - elapsed/period) + curr is compared in integers:
--   prev * (period - elapsed) + (curr + cost) * period <= limit * period
-- (Rate() keeps limit * period below 2^53, so every product here is exact in a double.)
-- KEYS: the tier's key, value "<current window start ms>:<curr>:<prev>"; it lives two periods
--       because the previous window still weighs on the current one.
-- ARGV (per tier, read by main.lua): limit, period ms, cost.
-- Reply (to main.lua): as fixed_window.lua.

local function sw_state(key, period, now)
  local start = now - (now % period)
  local curr, prev = 0, 0
  local v = redis.call('GET', key)
  if v then
    local s, c, p = string.match(v, '^(%d+):(%d+):(%d+)$')
    if s then
      s = tonumber(s)
      if s == start then
        curr = tonumber(c)
        prev = tonumber(p)
      elseif s == start - period then
        prev = tonumber(c)
      end
    end
  end
  return start, now - start, curr, prev
end

local function sw_check(key, limit, period, cost, now)
  local start, elapsed, curr, prev = sw_state(key, period, now)
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
  return ok, before, retry, reset_now, 2 * period - elapsed, start, curr + cost, prev
end

local function sw_commit(key, now, start, curr, prev, period)
  redis.call('SET', key, start .. ':' .. curr .. ':' .. prev, 'PX', 2 * period - (now - start))
end

local function sw_refund(key, period, cost, now)
  local start, _, curr, prev = sw_state(key, period, now)
  if curr == 0 and prev == 0 then return end
  local back = cost
  if curr >= back then curr = curr - back; back = 0 else back = back - curr; curr = 0 end
  if back > 0 then prev = prev - back; if prev < 0 then prev = 0 end end
  redis.call('SET', key, start .. ':' .. curr .. ':' .. prev, 'PX', 2 * period - (now - start))
end
