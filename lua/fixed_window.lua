-- fixed-window: one counter per window; windows aligned to the epoch, or to the calendar
-- boundaries the client computed for a time zone ("b0,b1,b2,b3" in ms, ascending).
-- KEYS: the tier's key, value "<window start ms>:<count>" (the start makes a stale value
--       harmless, so expiry is only garbage collection).
-- ARGV (per tier, read by main.lua): limit, period ms, cost, calendar boundaries or "".
-- Reply (to main.lua): ok, remaining before the hit, retry ms (-1: never), reset ms now,
--       reset ms after the hit, then the state fw_commit needs.

local function fw_window(period, cal, now)
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

local function fw_check(key, limit, period, cost, cal, now)
  local start, stop = fw_window(period, cal, now)
  local count = 0
  local v = redis.call('GET', key)
  if v then
    local s, c = string.match(v, '^(%-?%d+):(%d+)$')
    if s and tonumber(s) == start then count = tonumber(c) end
  end
  local before = limit - count
  if before < 0 then before = 0 end
  local reset_now = 0
  if count > 0 then reset_now = stop - now end
  local ok = count + cost <= limit
  local retry = 0
  if cost > limit then retry = -1 elseif not ok then retry = stop - now end
  return ok, before, retry, reset_now, stop - now, start, count + cost, stop
end

local function fw_commit(key, now, start, count, stop)
  redis.call('SET', key, start .. ':' .. count, 'PX', stop - now)
end

local function fw_refund(key, period, cost, cal, now)
  local start = fw_window(period, cal, now)
  local v = redis.call('GET', key)
  if not v then return end
  local s, c = string.match(v, '^(%-?%d+):(%d+)$')
  if s and tonumber(s) == start then
    local count = tonumber(c) - cost
    if count < 0 then count = 0 end
    redis.call('SET', key, start .. ':' .. count, 'KEEPTTL')
  end
end
