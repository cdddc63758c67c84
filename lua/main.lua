-- The entry point, appended after the four algorithm files into ONE script, so that every
-- tier of every policy that applies to a request is decided in one atomic call.
--
-- KEYS: one per tier (tiers of one sliding-log policy share their log key), then the ban keys
--       of the policies that have a penalty.
-- ARGV: [1] op: H hit, P peek, R refund, X reset, B book (reserve), C cancel a booking
--       [2] now in microseconds, or "" to read Redis TIME (the normal case)
--       [3] a token unique to this call (sliding-log members; for C, the booking's token;
--           for R, the refunded hit's token, or "" for the newest entries)
--       [4] the booking time in ms for B, else ""
--       [5] the number of tiers n
--       then 7 values per tier: algorithm (fw, sl, sw, gc), limit, period ms, cost,
--       ban key index in KEYS (0: no penalty), ban end ("" none, "d<ms>" a duration from the
--       refusal, "a<ms>" an absolute end), calendar boundaries ("" or "b0,b1,b2,b3" for fw)
-- Reply: integers only (Redis truncates Lua floats and stops a table at a nil):
--       { all admitted 0/1, then per tier: admitted 0/1, remaining, retry ms (-1: never),
--         reset ms, banned 0/1 }
-- Phase 1 reads every tier; phase 2 writes only if every tier admits. A refused hit writes
-- nothing but the ban of a policy with a penalty.

local op = ARGV[1]
local now_us
if ARGV[2] ~= '' then
  now_us = tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local now = math.floor(now_us / 1000)
local token = ARGV[3]
local n = tonumber(ARGV[5])

local tiers = {}
for i = 1, n do
  local b = 5 + (i - 1) * 7
  tiers[i] = {
    algo = ARGV[b + 1], limit = tonumber(ARGV[b + 2]), period = tonumber(ARGV[b + 3]),
    cost = tonumber(ARGV[b + 4]), ban = tonumber(ARGV[b + 5]), ban_end = ARGV[b + 6],
    cal = ARGV[b + 7], key = KEYS[i],
  }
end

if op == 'X' then
  for i = 1, #KEYS do redis.call('DEL', KEYS[i]) end
  return {1}
end

if op == 'R' or op == 'C' then
  -- A log shrinks, so its expiry is recomputed from the longest tier that reads it.
  local longest = {}
  for i = 1, n do
    local t = tiers[i]
    if t.algo == 'sl' and (longest[t.key] or 0) < t.period then longest[t.key] = t.period end
  end
  local done = {}
  for i = 1, n do
    local t = tiers[i]
    if not done[t.key] then
      done[t.key] = true
      if op == 'C' then
        if t.algo == 'sl' then sl_cancel(t.key, token, t.cost, longest[t.key], now) end
      elseif t.algo == 'fw' then fw_refund(t.key, t.period, t.cost, t.cal, now)
      elseif t.algo == 'sw' then sw_refund(t.key, t.period, t.cost, now)
      elseif t.algo == 'gc' then gc_refund(t.key, t.limit, t.period, t.cost, now_us)
      else sl_refund(t.key, t.cost, token, longest[t.key], now) end
    end
  end
  return {1}
end

local at = now
if op == 'B' then
  at = tonumber(ARGV[4])
  -- A booking in the past is a booking now: the log no longer holds what it would need.
  if at < now then at = now end
end

-- Phase 1: decide every tier, writing nothing.
local bans = {}
local sl_memo = {}  -- per log key: facts every tier of that log shares (sliding_log.lua)
local all_ok = true
local reply = {0}
for i = 1, n do
  local t = tiers[i]
  local ok, before, retry, reset_now, reset_hit
  local banned = 0
  if t.ban > 0 then
    if bans[t.ban] == nil then
      local v = redis.call('GET', KEYS[t.ban])
      bans[t.ban] = 0
      if v and tonumber(v) > now then bans[t.ban] = tonumber(v) - now end
    end
    if bans[t.ban] > 0 then banned = 1 end
  end
  if banned == 1 then
    local left = bans[t.ban]
    -- A cost above the limit stays "never" under a ban: waiting it out would not admit it.
    local wait = left
    if t.cost > t.limit then wait = -1 end
    ok, before, retry, reset_now, reset_hit = false, 0, wait, left, left
  elseif t.algo == 'fw' then
    ok, before, retry, reset_now, reset_hit, t.s1, t.s2, t.s3 =
      fw_check(t.key, t.limit, t.period, t.cost, t.cal, now)
  elseif t.algo == 'sw' then
    ok, before, retry, reset_now, reset_hit, t.s1, t.s2, t.s3 =
      sw_check(t.key, t.limit, t.period, t.cost, now)
  elseif t.algo == 'gc' then
    ok, before, retry, reset_now, reset_hit, t.s1 = gc_check(t.key, t.limit, t.period, t.cost, now_us)
  else
    ok, before, retry, reset_now, reset_hit =
      sl_check(t.key, t.limit, t.period, t.cost, at, now, sl_memo)
  end
  t.ok, t.before, t.retry, t.reset_now, t.reset_hit, t.banned =
    ok, before, retry, reset_now, reset_hit, banned
  if not ok then all_ok = false end
end
if not all_ok then sl_joint_retry(tiers, at) end

-- Remaining and reset describe the state after this call: after the hit if it was recorded.
for i = 1, n do
  local t = tiers[i]
  local remaining, reset = t.before, t.reset_now
  if all_ok and op ~= 'P' then
    remaining = t.before - t.cost
    reset = t.reset_hit
  end
  reply[#reply + 1] = t.ok and 1 or 0
  reply[#reply + 1] = remaining
  reply[#reply + 1] = t.retry
  reply[#reply + 1] = reset
  reply[#reply + 1] = t.banned
end

if op == 'P' then
  if all_ok then reply[1] = 1 end
  return reply
end

if all_ok then
  -- Phase 2: every tier admits, so record the hit in each.
  local longest, logged = {}, {}
  for i = 1, n do
    local t = tiers[i]
    if t.algo == 'sl' and (longest[t.key] or 0) < t.period then longest[t.key] = t.period end
  end
  for i = 1, n do
    local t = tiers[i]
    if t.algo == 'fw' then fw_commit(t.key, now, t.s1, t.s2, t.s3)
    elseif t.algo == 'sw' then sw_commit(t.key, now, t.s1, t.s2, t.s3, t.period)
    elseif t.algo == 'gc' then gc_commit(t.key, now_us, t.s1)
    elseif not logged[t.key] then
      logged[t.key] = true
      sl_commit(t.key, at, t.cost, token, longest[t.key], now, sl_memo[t.key])
    end
  end
  reply[1] = 1
  return reply
end

-- Refused: a refusal by a tier whose policy has a penalty starts that policy's ban.
if op == 'H' then
  for i = 1, n do
    local t = tiers[i]
    if not t.ok and t.ban > 0 and bans[t.ban] == 0 and t.ban_end ~= '' then
      local amount = tonumber(string.sub(t.ban_end, 2))
      local stop = amount
      if string.sub(t.ban_end, 1, 1) == 'd' then stop = now + amount end
      if stop > now then
        redis.call('SET', KEYS[t.ban], stop, 'PX', stop - now)
        bans[t.ban] = stop - now
      end
    end
  end
  for i = 1, n do
    local t = tiers[i]
    if t.ban > 0 and bans[t.ban] > 0 then
      local base = 1 + (i - 1) * 5
      reply[base + 1] = 0
      reply[base + 2] = 0
      -- A cost above the limit stays "never": waiting out the ban would not admit it.
      if t.retry ~= -1 then reply[base + 3] = bans[t.ban] end
      reply[base + 4] = bans[t.ban]
      reply[base + 5] = 1
    end
  end
end
return reply
