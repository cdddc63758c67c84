-- concurrency: requests in flight. A slot is held while a response runs, then given back;
-- a holder that dies without giving it back loses it when its lease ends.
-- KEYS: the tier's key, a sorted set: members "<token>:<n>" (the holder's token, one member
--       per slot it holds), scored by the ms its lease ends. Lease ends in the past are
--       slots already free (removed on the next take).
-- ARGV (per tier, read by main.lua): limit (slots), period ms (the lease), cost (slots).
-- Reply (to main.lua): concurrency() builds check, take, release, renew and reset.

local function concurrency()
  -- As the other checks: admitted, free before the hit, retry ms (-1: never), reset ms now
  -- and after the hit. A slot frees when some response ends, which nobody can foresee: a
  -- refusal's retry is the first lease end, at most a second away. Ended leases are free
  -- slots already, so they go first (nothing any reply says changes) and what is left is
  -- held. `lazy`: a hit, whose reset now only a refusal reads; false then, for `reset`.
  local function check(key, limit, lease, cost, now, lazy)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    local held = redis.call('ZCARD', key)
    local ok = held + cost <= limit
    local before = limit - held
    if before < 0 then before = 0 end
    local retry, reset_now = 0, 0
    if held > 0 then
      if lazy and ok then
        reset_now = false
      else
        reset_now = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2] - now
      end
    end
    if cost > limit then
      retry = -1
    elseif not ok then
      retry = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2] - now
      if retry > 1000 then retry = 1000 end
    end
    return ok, before, retry, reset_now, lease
  end

  -- The reset now that `check` left to a refusal: when the last lease ends.
  local function reset(key, now)
    return redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2] - now
  end

  local function members(token, cost)
    local out = {}
    for j = 1, cost do out[j] = token .. ':' .. j end
    return out
  end

  -- Hold `cost` slots until now + lease (`check` has dropped the ended ones); the key lives
  -- as long as its latest lease.
  local function take(key, lease, cost, token, now)
    local args = {}
    for j = 1, cost do
      args[2 * j - 1] = now + lease
      args[2 * j] = token .. ':' .. j
    end
    redis.call('ZADD', key, unpack(args))
    redis.call('PEXPIRE', key, lease)
  end

  local function release(key, cost, token)
    if token ~= '' then redis.call('ZREM', key, unpack(members(token, cost))) end
  end

  -- Push a holder's leases to now + lease; true when it holds every slot afterwards. A lease
  -- already ended may be someone else's slot by now: it is taken again only if the tier has
  -- room for every ended one (the holder was paused past its lease and its slot is still
  -- free), else it stays ended and the holder is told (false).
  local function renew(key, limit, lease, cost, token, now)
    local ended = {}
    local renewed = false
    for _, member in ipairs(members(token, cost)) do
      local ends = redis.call('ZSCORE', key, member)
      if ends and ends + 0 > now then
        redis.call('ZADD', key, now + lease, member)
        renewed = true
      else
        ended[#ended + 1] = member
      end
    end
    local held = #ended == 0
    if not held then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
      if redis.call('ZCARD', key) + #ended <= limit then
        for _, member in ipairs(ended) do redis.call('ZADD', key, now + lease, member) end
        renewed, held = true, true
      end
    end
    if renewed then redis.call('PEXPIRE', key, lease) end
    return held
  end

  return check, take, release, renew, reset
end
