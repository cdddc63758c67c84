-- gcra: the generic cell rate algorithm (one theoretical arrival time per identity).
-- Computed in integer microseconds: the emission interval T = ceil(period_us / limit) and the
-- tolerance is limit * T, so a burst of exactly `limit` is admitted and the sustained rate never
-- exceeds limit/period (rounding T up costs less than a microsecond per hit).
-- KEYS: the tier's key, value the TAT in microseconds (written with %d: tostring would keep
--       only 14 digits).
-- ARGV (per tier, read by main.lua): limit, period ms, cost.
-- Reply (to main.lua): as fixed_window.lua.

local function gc_ms(us)
  if us <= 0 then return 0 end
  return math.ceil(us / 1000)
end

local function gc_tat(key, now_us)
  local v = redis.call('GET', key)
  if v then
    local tat = tonumber(v)
    if tat and tat > now_us then return tat end
  end
  return now_us
end

local function gc_check(key, limit, period, cost, now_us)
  local interval = math.ceil(period * 1000 / limit)
  local tolerance = limit * interval
  local tat = gc_tat(key, now_us)
  local new_tat = tat + cost * interval
  local ok = new_tat - now_us <= tolerance
  local before = math.floor((tolerance - (tat - now_us)) / interval)
  if before < 0 then before = 0 end
  local retry = 0
  if cost > limit then retry = -1 elseif not ok then retry = gc_ms(new_tat - now_us - tolerance) end
  return ok, before, retry, gc_ms(tat - now_us), gc_ms(new_tat - now_us), new_tat
end

local function gc_commit(key, now_us, new_tat)
  -- One ms more than the TAT needs: Redis expires at ms granularity, and the key must
  -- never vanish while its TAT is still (sub-millisecond) ahead of the clock.
  redis.call('SET', key, string.format('%d', new_tat), 'PX', gc_ms(new_tat - now_us) + 1)
end

local function gc_refund(key, limit, period, cost, now_us)
  local interval = math.ceil(period * 1000 / limit)
  local tat = gc_tat(key, now_us) - cost * interval
  if tat <= now_us then
    redis.call('DEL', key)
  else
    redis.call('SET', key, string.format('%d', tat), 'PX', gc_ms(tat - now_us) + 1)
  end
end
