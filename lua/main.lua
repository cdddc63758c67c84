-- The entry point, appended after the five algorithm files into ONE script, so that every
-- tier of every policy that applies to a request is decided in one atomic call.
--
-- KEYS: one per tier (tiers of one sliding-log policy share their log key), then the ban keys
--       of the policies that have a penalty, then each sliding log's hash of costs (read by
--       the name sliding_log.lua gives it; declared so that a cluster routes the call).
-- ARGV: [1] op: H hit, P peek, R refund (for an in-flight tier: give its slots back), X reset,
--           B book (reserve), C cancel a booking, N renew in-flight leases, F charge
--           (a hit recorded whether or not it is admitted: a settled cost's overshoot),
--           Z pause (start each policy's ban for [4] ms from now without a refusal: an
--           upstream's 429; a ban that ends later stays; the reply is {1, its end in ms})
--       [2] now in microseconds, or "" to read Redis TIME (the normal case)
--       [3] a token unique to this call (sliding-log members; for C, the booking's token;
--           for R, the refunded hit's token, or "" for the newest entries); for a batch of
--           give-backs or renewals (R, N) of several hits, each tier's token, separated by
--           spaces
--       [4] the booking time in ms for B; the pause in ms for Z; for R, when what is given
--           back was charged: "<us>:<estimate>" (a settle's: the store's clock when the charge
--           was decided, and what it charged), "<us>" (a whole hit's: it charged the tier's
--           cost) or "-" (not known: from the window as it is now); one for every tier, or
--           for a batch one per tier, separated by spaces. Each tier then gives back only
--           within the window it was charged in; "" as "-"
--       [5] the number of tiers n
--       then 7 values per tier: algorithm (fw, sl, sw, gc, cc), limit, period ms, cost,
--       ban key index in KEYS (0: no penalty), ban end ("" none, "d<ms>" a duration from the
--       refusal, "a<ms>" an absolute end), a time zone's UTC-offset schedule for the whole-day
--       tiers of a fixed-window policy with tz= ("" otherwise; see fixed_window.lua)
-- Reply to R, C, X: {1}; to N: {1} when the hit holds every slot after it (its ended leases
--       taken again where there was room), {0} when one has gone to someone else.
-- Reply: integers only (Redis truncates Lua floats and stops a table at a nil):
--       { all admitted 0/1, then per tier: admitted 0/1, remaining, retry ms (-1: never),
--         reset ms, banned 0/1 }; an admitted call (H, P, B) appends the store's now in
--         microseconds (a Ticket gives back in the window it was charged in, by the store's
--         clock); a refused hit (H) appends three values per tier for the
--         client's deny cache, in microseconds from now: how long every number of the reply
--         stays as it is or counts down with the clock (0: do not reuse the reply; -1: until
--         something writes), then the exact retry (-1: never) and reset that it rounds to ms.
-- Phase 1 reads every tier; phase 2 writes only if every tier admits. A refused hit writes
-- nothing but the ban of a policy with a penalty.
--
-- This runs on every request, so it is written for Redis's time: tiers are read straight from
-- ARGV (no table per tier), the algorithms' functions are built only for the algorithms a call
-- uses, and one MGET reads the state of every fw/sw/gc tier and every ban.

-- On the hot path numbers from ARGV and TIME (always well formed) are converted with `+ 0`:
-- one strtod, where Lua 5.1's tonumber() runs two.
local argv, keys = ARGV, KEYS
local op = argv[1]
local now_us
local own_clock = argv[2] == ''  -- Redis's clock, not a test clock
if not own_clock then
  now_us = argv[2] + 0
else
  local t = redis.call('TIME')
  now_us = t[1] * 1000000 + t[2]
end
local now = math.floor(now_us / 1000)
local token = argv[3]
local n = argv[5] + 0
-- Tier i's seven values are argv[7 * i - 1] .. argv[7 * i + 5].

local fw_check, sw_check, gc_check, sl_check, sl_commit, cc_check, cc_take, cc_reset, _  -- on use
local sl_longest  -- per sliding-log key, the longest period of this call's tiers reading it
local values  -- MGET of every key (false where none): fw/sw/gc state and bans, read once

-- The common shape first: a hit on one tier without a penalty, admitted, decided without the
-- loop's bookkeeping (the tables of a reply that may be refused, ban lookups) and without a
-- call: each algorithm's check is written out here by scripts.py from the algorithm's own file
-- (`--@inline`), since a Lua call costs more than the check (docs/performance.md, "Why the
-- code is shaped so"); tests/test_lua_fast_path.py holds the path to the loop. (A sliding
-- log's hit of a cost above one, and a fixed window of local days, call the algorithm's
-- check.) A refusal, or a booking ahead in a sliding log, goes on to the general path below
-- with what was read here (`values`, the built checks), so it reads nothing twice but the
-- sliding log's counts.
if n == 1 and op == 'H' and argv[10] == '0' and argv[6] ~= 'cc' then
  local algo, key = argv[6], keys[1]
  local limit, period, cost = argv[7] + 0, argv[8] + 0, argv[9] + 0
  local ok, before, retry, reset_now, reset_hit, value, px, _
  if algo == 'sl' and cost == 1 then
    -- The usual hit on a sliding log: one entry at `now`, nothing booked ahead (the log's
    -- newest entry then does not matter, and the log lives one period from now). Building
    -- sliding_log()'s closures and per-log table costs more than the two steps; anything else
    -- (a booking ahead, a refusal) goes on to the loop below, which counts again.
    local seen, later
    --@inline sliding_log.sliding_log_count(key, period, now) -> seen, later
    if later == 0 and seen < limit then
      --@inline sliding_log.sliding_log_record(key, now, token, period, now, now)
      return {1, 1, limit - seen - 1, 0, period, 0, now_us}
    end
  elseif algo == 'sl' then
    sl_check, sl_commit = sliding_log()
    ok, before, retry, _, reset_hit = sl_check(key, limit, period, cost, now, now, true, period)
    if ok then
      sl_commit(key, now, cost, token, now)
      return {1, 1, before - cost, retry, reset_hit, 0, now_us}
    end
  else
    local v = redis.call('GET', key)
    values = {v}
    if algo == 'fw' and argv[12] == '' then
      --@inline fixed_window.check(v, limit, period, cost, '', now, own_clock) -> ok, before, retry, reset_now, reset_hit, value, px
    elseif algo == 'gc' then
      --@inline gcra.check(v, limit, period, cost, now_us) -> ok, before, retry, reset_now, reset_hit, value, px
    elseif algo == 'sw' then
      --@inline sliding_window.check(v, limit, period, cost, now, own_clock) -> ok, before, retry, reset_now, reset_hit, value, px
    else  -- a fixed window of local days
      fw_check = fixed_window()
      ok, before, retry, reset_now, reset_hit, value, px =
        fw_check(v, limit, period, cost, argv[12], now, own_clock)
    end
    if ok then
      -- As in phase 2 below.
      if px then
        redis.call('SET', key, value, 'PX', string.format('%d', px))
      else
        redis.call('SET', key, value, 'KEEPTTL')
      end
      return {1, 1, before - cost, retry, reset_hit, 0, now_us}
    end
  end
end

-- The common shape of several tiers, or of an in-flight limit: a hit on epoch-aligned fixed
-- windows ("10/second;100/minute;1000/hour") and in-flight slots, without a penalty: each
-- check written out once per tier (fixed_window.lua's, concurrency.lua's), every string key
-- read by one MGET, the writes made only once every tier admits. A refusal goes on to the
-- loop below with what was read here.
if op == 'H' and (n > 1 or argv[6] == 'cc') then
  local plain = true
  for i = 1, n do
    local b = 7 * i - 2
    local algo = argv[b + 1]
    if (algo ~= 'fw' and algo ~= 'cc') or argv[b + 5] ~= '0' or argv[b + 7] ~= '' then
      plain = false
      break
    end
  end
  if plain then
    values = redis.call('MGET', unpack(keys))  -- a slots key reads as false
    -- Sized up front for up to three tiers, as the loop's tables below.
    local reply = {1, 0, 0, 0, 0, 0, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}
    local writes = {nil, nil, nil, nil, nil, nil}  -- per tier: the value (true: slots), PX
    for i = 1, n do
      local b = 7 * i - 2
      local limit, period, cost = argv[b + 2] + 0, argv[b + 3] + 0, argv[b + 4] + 0
      local ok, before, retry, reset_now, reset_hit, value, px
      if argv[b + 1] == 'cc' then
        --@inline concurrency.check(keys[i], limit, period, cost, now, true) -> ok, before, retry, reset_now, reset_hit
        value = true
      else
        --@inline fixed_window.check(values[i], limit, period, cost, '', now, own_clock) -> ok, before, retry, reset_now, reset_hit, value, px
      end
      if not ok then
        plain = false
        break
      end
      local k, j = 5 * i - 4, 2 * i - 1
      reply[k + 1], reply[k + 2], reply[k + 3], reply[k + 4], reply[k + 5] =
        1, before - cost, retry, reset_hit, 0
      writes[j], writes[j + 1] = value, px
    end
    if plain then
      for i = 1, n do
        local j = 2 * i - 1
        if writes[j] == true then
          --@inline concurrency.take(keys[i], argv[7 * i + 1] + 0, argv[7 * i + 2] + 0, token, now)
        elseif writes[j + 1] then
          redis.call('SET', keys[i], writes[j], 'PX', string.format('%d', writes[j + 1]))
        else
          redis.call('SET', keys[i], writes[j], 'KEEPTTL')
        end
      end
      reply[5 * n + 2] = now_us
      return reply
    end
  end
end

if op == 'X' then
  for i = 1, #keys do redis.call('DEL', keys[i]) end
  return {1}
end

if op == 'Z' then
  -- The ban keys follow the n tier keys; each holds its ban's end in ms, as a penalty's.
  -- Reply: {1, the latest end of them now, in ms}.
  local stop = now + tonumber(argv[4])
  local latest = stop
  for i = n + 1, #keys do
    local current = tonumber(redis.call('GET', keys[i]) or '0')
    if stop > current then
      redis.call('SET', keys[i], stop, 'PX', stop - now)
    elseif current > latest then
      latest = current
    end
  end
  return {1, latest}
end

if op == 'R' or op == 'C' or op == 'N' then
  -- A batch names each tier's token: the responses that ended in one turn of a client's
  -- event loop give back their slots in one call.
  local tokens
  if op ~= 'C' and string.find(token, ' ', 1, true) then
    tokens = {}
    for each in string.gmatch(token, '%S+') do tokens[#tokens + 1] = each end
  end
  -- A log shrinks, so its expiry is recomputed from the longest tier that reads it.
  local longest = {}
  for i = 1, n do
    local b = 7 * i - 2
    local key, period = keys[i], tonumber(argv[b + 3])
    if argv[b + 1] == 'sl' and (longest[key] or 0) < period then longest[key] = period end
  end
  -- A give-back's charge: when it was decided and what it charged (see ARGV[4]).
  local charges
  if op == 'R' and argv[4] ~= '' then
    charges = {}
    for each in string.gmatch(argv[4], '%S+') do charges[#charges + 1] = each end
  end
  -- A set two in-flight limits of one name share holds the larger cost's members: given
  -- back (or renewed) whole, with that cost; a renewal takes them again where every one of
  -- those limits has room for its own cost beside the others' members.
  local most, room = {}, {}
  for i = 1, n do
    local b = 7 * i - 2
    if argv[b + 1] == 'cc' then
      local mark = keys[i] .. ' ' .. (tokens and tokens[i] or token)
      local limit, cost = tonumber(argv[b + 2]), tonumber(argv[b + 4])
      if (most[mark] or 0) < cost then most[mark] = cost end
      if room[mark] == nil or limit - cost < room[mark] then room[mark] = limit - cost end
    end
  end
  local charged_us, estimate
  local done = {}
  local held = 1  -- N: every slot still the hit's
  local cc_release, cc_renew, _
  for i = 1, n do
    local b = 7 * i - 2
    local algo, key = argv[b + 1], keys[i]
    if tokens then token = tokens[i] end
    -- Once per key and hit (tiers of one sliding log share their key).
    local mark = key .. ' ' .. token
    if not done[mark] then
      done[mark] = true
      local limit, period, cost = tonumber(argv[b + 2]), tonumber(argv[b + 3]),
        tonumber(argv[b + 4])
      if charges then
        local t, e = string.match(charges[i] or charges[1], '^(%d+):?(%d*)$')
        charged_us, estimate = tonumber(t), tonumber(e) or cost
      end
      if op == 'C' then
        if algo == 'sl' then
          local _, cancel = sliding_log_upkeep()
          cancel(key, token, cost, longest[key], now)
        end
      elseif algo == 'cc' then
        if cc_release == nil then _, _, cc_release, cc_renew = concurrency() end
        if op == 'N' then
          if not cc_renew(key, most[mark] + room[mark], period, most[mark], token, now) then
            held = 0
          end
        else
          cc_release(key, most[mark], token)
        end
      elseif op == 'N' then  -- leases are in-flight tiers' only
      elseif algo == 'fw' then
        local _, refund = fixed_window()
        refund(key, period, cost, argv[b + 7], now, charged_us)
      elseif algo == 'sw' then
        local _, refund = sliding_window()
        refund(key, period, cost, now, charged_us)
      elseif algo == 'gc' then
        local _, refund = gcra()
        refund(key, limit, period, cost, now_us, charged_us, estimate)
      else
        local refund = sliding_log_upkeep()
        refund(key, cost, token, longest[key], now, estimate)
      end
    end
  end
  return {held}
end

local at = now
if op == 'B' then
  at = tonumber(argv[4])
  -- A booking in the past is a booking now: the log no longer holds what it would need.
  if at < now then at = now end
end

-- Phase 1: decide every tier, writing nothing. The reply is filled as if the hit will be
-- recorded (remaining and reset after it; a peek records nothing), and `other` keeps per tier
-- what the reply says instead if it is not, then the value and PX a commit SETs (value false:
-- a sliding log, whose commit writes itself; PX false: keep the key's TTL).
local tied = false  -- a sliding log has entries ahead of `at` (see the joint retry below)
local bans    -- ban index -> ms left (0: none)
-- Both tables are sized up front, for one tier or for up to three: a table grows by
-- reallocating at 1, 2, 4, 8, ... slots, and Lua 5.1 has no table.new, but a constructor's nils
-- reserve slots. The reply still ends at its last value: Redis stops reading at the first nil.
local other, reply
if n == 1 then
  other, reply = {false, false, false, false}, {0, 0, 0, 0, 0, 0}
else
  other = {nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}
  reply = {0, 0, 0, 0, 0, 0, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}
end
local hit = op ~= 'P'
local all_ok = true
for i = 1, n do
  local b = 7 * i - 2
  local algo = argv[b + 1]
  local limit, period, cost = argv[b + 2] + 0, argv[b + 3] + 0, argv[b + 4] + 0
  local ban = 0
  if argv[b + 5] ~= '0' then ban = argv[b + 5] + 0 end  -- "0" (no penalty) is usual
  local ok, before, retry, reset_now, reset_hit, value, px
  local banned = 0
  if ban > 0 then
    if values == nil then values = redis.call('MGET', unpack(keys)) end
    if bans == nil then bans = {} end
    local left = bans[ban]
    if left == nil then
      local v = values[ban]
      left = 0
      if v and tonumber(v) > now then left = tonumber(v) - now end
      bans[ban] = left
    end
    -- Banned: the tier is still checked (reading only: a refused hit writes nothing), since
    -- a retry is admitted only once both the ban and the tier's own wait are over; the
    -- refusal below turns its answer into the ban's (see "bans" after phase 1).
    if left > 0 then banned = 1 end
  end
  if algo == 'sl' then
    if sl_check == nil then sl_check, sl_commit = sliding_log() end
    if sl_longest == nil then
      -- The longest period reading each log: what no window of this call sees is trimmed.
      sl_longest = {}
      for t = 1, n do
        local p = argv[7 * t + 1] + 0
        if argv[7 * t - 1] == 'sl' and (sl_longest[keys[t]] or 0) < p then
          sl_longest[keys[t]] = p
        end
      end
    end
    local ahead
    ok, before, retry, reset_now, reset_hit, ahead =
      sl_check(keys[i], limit, period, cost, at, now, false, sl_longest[keys[i]])
    if ahead then tied = true end
    value = false
  elseif algo == 'cc' then
    if cc_check == nil then cc_check, cc_take, _, _, cc_reset = concurrency() end
    ok, before, retry, reset_now, reset_hit = cc_check(keys[i], limit, period, cost, now, hit)
    value = true
  else
    local v
    if values ~= nil then
      v = values[i]
    elseif n == 1 then
      v = redis.call('GET', keys[1])  -- the one key: a plain GET is a little cheaper
    else
      values = redis.call('MGET', unpack(keys))
      v = values[i]
    end
    if algo == 'gc' then
      if gc_check == nil then gc_check = gcra() end
      ok, before, retry, reset_now, reset_hit, value, px = gc_check(v, limit, period, cost, now_us)
    elseif algo == 'fw' then
      if fw_check == nil then fw_check = fixed_window() end
      ok, before, retry, reset_now, reset_hit, value, px =
        fw_check(v, limit, period, cost, argv[b + 7], now, own_clock)
    else
      if sw_check == nil then sw_check = sliding_window() end
      ok, before, retry, reset_now, reset_hit, value, px =
        sw_check(v, limit, period, cost, now, own_clock)
    end
  end
  if banned == 1 then ok = false end
  local k = 5 * i - 4  -- tier i's five reply values are reply[k + 1] .. reply[k + 5]
  local j = 4 * i - 4
  reply[k + 1] = ok and 1 or 0
  reply[k + 3] = retry
  reply[k + 5] = banned
  if hit then
    reply[k + 2] = before - cost
    reply[k + 4] = reset_hit
    other[j + 1] = before
    other[j + 2] = reset_now
    other[j + 3] = value
    other[j + 4] = px
  else
    reply[k + 2] = before
    reply[k + 4] = reset_now
  end
  if not ok then all_ok = false end
end

if all_ok or op == 'F' then
  if hit then
    -- Phase 2: every tier admits (or the cost is charged regardless), so record the hit in
    -- each.
    for i = 1, n do
      local j = 4 * i - 4
      local value, px = other[j + 3], other[j + 4]
      if not value then
        sl_commit(keys[i], at, argv[7 * i + 2] + 0, token, now)
      elseif value == true then
        cc_take(keys[i], argv[7 * i + 1] + 0, argv[7 * i + 2] + 0, token, now)
      elseif px then
        -- Numbers given to redis.call go through "%.17g" in Redis; "%d" here is cheaper.
        -- (Not PSETEX: fakeredis rounds its expiry down to whole seconds.)
        redis.call('SET', keys[i], value, 'PX', string.format('%d', px))
      else
        -- The key's TTL already ends where this write needs it (fixed_window.lua).
        redis.call('SET', keys[i], value, 'KEEPTTL')
      end
    end
    if op == 'F' then return {1} end  -- charged: nothing to decide
  end
  reply[1] = 1
  reply[5 * n + 2] = now_us
  return reply
end

-- Refused: the reply describes the state as it stands.
if hit then
  for i = 1, n do
    local k, j = 5 * i - 4, 4 * i - 4
    reply[k + 2] = other[j + 1]
    local reset_now = other[j + 2]
    if reset_now == false then reset_now = cc_reset(keys[i], now) end  -- left by cc_check
    reply[k + 4] = reset_now
  end
end

-- A refusal by a tier whose policy has a penalty starts that policy's ban.
if op == 'H' and bans ~= nil then
  for i = 1, n do
    local b, k = 7 * i - 2, 5 * i - 4
    local ban, ban_end = tonumber(argv[b + 5]), argv[b + 6]
    if reply[k + 1] == 0 and ban > 0 and bans[ban] == 0 and ban_end ~= '' then
      local amount = tonumber(string.sub(ban_end, 2))
      local stop = amount
      if string.sub(ban_end, 1, 1) == 'd' then stop = now + amount end
      if stop > now then
        redis.call('SET', keys[ban], stop, 'PX', stop - now)
        bans[ban] = stop - now
      end
    end
  end
end

-- Every tier of a banned policy is refused, with nothing left. A retry is admitted only once
-- the ban has ended AND the tier's own check admits it, so its retry is the later of the two
-- (a penalty shorter than the window's wait must not send the client back into a refusal
-- that starts a new ban), and its reset the later of the ban's end and its own. A cost above
-- the limit stays "never" (-1): waiting out the ban would not admit it.
if bans ~= nil then
  for i = 1, n do
    local ban, k = tonumber(argv[7 * i + 3]), 5 * i - 4
    if ban > 0 and bans[ban] > 0 then
      local left = bans[ban]
      reply[k + 1] = 0
      reply[k + 2] = 0
      if reply[k + 3] ~= -1 and reply[k + 3] < left then reply[k + 3] = left end
      if reply[k + 4] < left then reply[k + 4] = left end
      reply[k + 5] = 1
    end
  end
end

if tied then
  -- Bookings ahead tie the retries of one log's tiers together (sliding_log.lua); with none,
  -- each tier's own retry stands. A banned tier's retry is the first time from the ban's end
  -- that fits (with bookings ahead a log may refuse again later, so the later of the two
  -- waits would not do).
  local tiers = {}
  for i = 1, n do
    local b, k = 7 * i - 2, 5 * i - 4
    if argv[b + 1] == 'sl' then
      local from, ban = at, argv[b + 5] + 0
      if ban > 0 and bans[ban] > 0 and now + bans[ban] > at then from = now + bans[ban] end
      tiers[#tiers + 1] = {
        i = i, key = keys[i], ok = reply[k + 1] == 1, retry = reply[k + 3],
        limit = tonumber(argv[b + 2]), period = tonumber(argv[b + 3]),
        cost = tonumber(argv[b + 4]), from = from,
      }
    end
  end
  sliding_log_ahead().joint_retry(tiers, at)
  for _, t in ipairs(tiers) do reply[5 * t.i - 1] = t.retry end
end

if op == 'H' then
  -- What the deny cache needs to answer repeats of this refusal exactly (see the reply above).
  -- Values in ms from `now` become exact microseconds with the clock's phase within its ms.
  local phase = now_us - now * 1000
  local function us(ms) if ms > 0 then return ms * 1000 - phase end return ms end
  local w = 5 * n + 1
  for i = 1, n do
    local b, k = 7 * i - 2, 5 * i - 4
    local algo, key = argv[b + 1], keys[i]
    local limit, period, cost = argv[b + 2] + 0, argv[b + 3] + 0, argv[b + 4] + 0
    local stable, retry, reset
    if reply[k + 5] == 1 then
      -- Banned: every number holds until the ban ends (nothing is written meanwhile, so the
      -- retry and reset, the later of the ban's end and the tier's own, count down).
      local left = us(bans[argv[b + 5] + 0])
      stable = left
      if algo == 'gc' then
        -- The exact retry and reset are the later of the ban's end and GCRA's own, in µs.
        local v
        if values ~= nil then v = values[i] else v = redis.call('GET', key) end
        local _, _, gc_stable = gcra()
        local _, own_retry, own_reset = gc_stable(v, limit, period, cost, now_us)
        retry, reset = own_retry, own_reset
        if retry ~= -1 and retry < left then retry = left end
        if reset < left then reset = left end
      end
    elseif reply[k + 1] == 0 and argv[b + 5] ~= '0' then
      stable = 0  -- refused under a penalty that started no ban: a later hit may start one
    elseif algo == 'cc' then
      stable = 0  -- a slot frees whenever a response ends
    elseif algo == 'sl' then
      stable = 0  -- entries ahead (bookings) make the peak rise and fall
      if not tied then
        local _, _, sl_stable = sliding_log_upkeep()
        stable = us(sl_stable(key, period, now))
      end
    elseif algo == 'fw' then
      local _, _, fw_stable = fixed_window()
      stable = us(fw_stable(period, argv[b + 7], now))
    else
      local v
      if values ~= nil then v = values[i] else v = redis.call('GET', key) end
      if algo == 'gc' then
        local _, _, gc_stable = gcra()
        stable, retry, reset = gc_stable(v, limit, period, cost, now_us)
      else
        local _, _, sw_stable = sliding_window()
        stable = us(sw_stable(v, period, now))
      end
    end
    if retry == nil then retry, reset = us(reply[k + 3]), us(reply[k + 4]) end
    reply[w + 1], reply[w + 2], reply[w + 3] = stable, retry, reset
    w = w + 3
  end
end
return reply
