-- gcra: the generic cell rate algorithm (one theoretical arrival time per identity).
-- Computed in integer microseconds: the emission interval T = ceil(period_us / limit) and the
-- tolerance is limit * T, so a burst of exactly `limit` is admitted and the sustained rate never
-- exceeds limit/period (rounding T up costs less than a microsecond per hit).
-- KEYS: the tier's key, value the TAT in microseconds (written with %d: tostring would keep
--       only 14 digits).
-- ARGV (per tier, read by main.lua): limit, period ms, cost.
-- Reply (to main.lua): as fixed_window.lua: gcra() builds check and refund; check(value, ...)
--       reads the key's value as main.lua fetched it and returns the value and PX to write
--       (main.lua's one-tier path writes check out in place: it must end with its only return).

-- Every time difference below is >= 0 (a TAT is never behind the clock), so its ms value,
-- rounded up, is math.ceil(us / 1000).
-- The emission interval, the tolerance, and how far the TAT stored in `v` is ahead of now.
local function gcra_state(v, limit, period, now_us)
  local interval = math.ceil(period * 1000 / limit)
  local ahead = 0  -- TAT - now
  if v then
    local stored = tonumber(v)
    if stored and stored > now_us then ahead = stored - now_us end
  end
  return interval, limit * interval, ahead
end

local function gcra()
  local function check(v, limit, period, cost, now_us)
    local interval, tolerance, ahead = gcra_state(v, limit, period, now_us)
    local new_ahead = ahead + cost * interval
    local ok = new_ahead <= tolerance
    local before = math.floor((tolerance - ahead) / interval)
    if before < 0 then before = 0 end
    local retry = 0
    if cost > limit then
      retry = -1
    elseif not ok then
      retry = math.ceil((new_ahead - tolerance) / 1000)
    end
    local reset_hit = math.ceil(new_ahead / 1000)
    -- Charged far ahead (settles in debt), the TAT runs at most 2^52 µs (142 years) ahead,
    -- so that it stays exact in a double (core/rates.py).
    local stored = new_ahead
    if stored > 4503599627370496 then stored = 4503599627370496 end
    -- PX: one ms more than the TAT needs: Redis expires at ms granularity, and the key must
    -- never vanish while its TAT is still (sub-millisecond) ahead of the clock.
    return ok, before, retry, math.ceil(ahead / 1000), reset_hit,
      string.format('%d', now_us + stored), math.ceil(stored / 1000) + 1
  end

  -- charged_us, estimate: when the hit given back was charged and its cost (a settle), else
  -- nil. Then the TAT moves back by no more than what of that charge's own emission still lies
  -- ahead of now, taking the charge to have started when it was made: [charged_us,
  -- charged_us + estimate x interval). What has already run out was spent, and a give-back
  -- never takes from hits made since (docs/settle.md).
  local function refund(key, limit, period, cost, now_us, charged_us, estimate)
    local interval = math.ceil(period * 1000 / limit)
    local tat = now_us
    local v = redis.call('GET', key)
    if v then
      local stored = tonumber(v)
      if stored and stored > now_us then tat = stored end
    end
    local back = cost * interval
    if charged_us then
      local left = charged_us + estimate * interval - now_us
      if left < back then back = left end
      if back <= 0 then return end
    end
    tat = tat - back
    if tat <= now_us then
      redis.call('DEL', key)
    else
      redis.call('SET', key, string.format('%d', tat), 'PX', math.ceil((tat - now_us) / 1000) + 1)
    end
  end

  -- For the client's deny cache (main.lua): in microseconds from now, how long the remaining
  -- this tier reports stays as it is (to the next emission step; -1: no TAT ahead, so until a
  -- write), then the exact retry (-1: never) and reset that its reply rounds up to ms.
  local function stable(v, limit, period, cost, now_us)
    local interval, tolerance, ahead = gcra_state(v, limit, period, now_us)
    local retry = 0
    if cost > limit then
      retry = -1
    elseif ahead + cost * interval > tolerance then
      retry = ahead + cost * interval - tolerance
    end
    if ahead == 0 then return -1, retry, 0 end
    local step = math.floor((tolerance - ahead) / interval) + 1
    return ahead - tolerance + step * interval, retry, ahead
  end

  return check, refund, stable
end
