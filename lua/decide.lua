-- decide.lua: one all-or-nothing decision over every shared limit of a request.
--
-- The twin of src/limits/algorithm.rs: the same integer maths, step by step,
-- so that the in-process store and this script agree on every decision.
-- Every number stays an integer below 2^53, exact in a Lua double.
--
-- KEYS[i]  state key of limit i (i = 1..n)
-- ARGV[1]  time in ms; "0" means the server's TIME (only tests pass a time)
-- ARGV[2]  first blocked group: charges of this group and later ones are
--          checked but never spent (an earlier part of the decision denied)
-- ARGV[3 + 5(i-1) ...] five numbers per limit i:
--          kind   1 token_bucket, 2 gcra   (a = capacity in micro-tokens,
--                                           b = micro-tokens per ms)
--                 3 fixed_window, 4 sliding_window, 5 sliding_log
--                                          (a = limit, b = window in ms)
--          a, b   as above
--          cost   whole units
--          flags  group * 2 + 1 for enforce, group * 2 for shadow
--
-- Reply: four integers per limit, then the time used:
--   allowed (1 or 0), remaining (whole units), wait in ms until the cost
--   fits (0 when allowed, -1 when it never can), ms until the key is back to
--   its initial state.
--
-- Group g is charged only if every enforced limit of groups 0..g admits and
-- g is below ARGV[2]; shadow limits are charged when they admit and their
-- group is charged. Refreshed state is written back whatever the outcome.
-- Keys expire one second after they would be back to their initial state.
--
-- State: token_bucket "balance:at", gcra "tat:frac", fixed_window
-- "start:count", sliding_window "start:curr:prev" (strings, read with one
-- MGET); sliding_log a sorted set of "time:cost:total" scored by time.

local MICRO = 1000000
local SLACK = 1000

local now = tonumber(ARGV[1])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local blocked = tonumber(ARGV[2])
local n = #KEYS
local raw = redis.call('MGET', unpack(KEYS))

local function align(t, w) return t - t % w end

local function fields(v)
  local x, y, z = string.match(v or '', '^(%d+):(%d+):?(%d*)$')
  return tonumber(x), tonumber(y), tonumber(z)
end

-- The check of a bucket holding `balance`: allowed, remaining, wait.
local function check_bucket(cap, per_ms, balance, cost)
  local need = cost * MICRO
  if need > cap then return false, math.floor(balance / MICRO), -1 end
  if balance >= need then return true, math.floor((balance - need) / MICRO), 0 end
  return false, math.floor(balance / MICRO), math.ceil((need - balance) / per_ms)
end

local function check_counter(limit, count, cost, until_next)
  local left = math.max(0, limit - count)
  if cost > limit then return false, left, -1 end
  if cost <= left then return true, left - cost, 0 end
  return false, left, until_next
end

local function check_sliding(limit, len, curr, prev, cost, elapsed)
  local used = prev * (len - elapsed) + curr * len
  local budget = limit * len
  local left = math.floor(math.max(0, budget - used) / len)
  if cost > limit then return false, left, -1 end
  if used + cost * len <= budget then
    return true, math.floor((budget - used - cost * len) / len), 0
  end
  local to_roll = len - elapsed
  local wait
  if curr + cost <= limit then
    wait = math.max(0, to_roll - math.floor((limit - curr - cost) * len / prev))
  else
    wait = to_roll + math.max(0, len - math.floor((limit - cost) * len / curr))
  end
  return false, left, math.max(1, wait)
end

local function check_log(limit, len, entries, total, cost, t)
  local left = math.max(0, limit - total)
  if cost > limit then return false, left, -1 end
  if cost <= left then return true, left - cost, 0 end
  local still = total
  for _, e in ipairs(entries) do
    still = still - e[2]
    if still + cost <= limit then
      return false, left, math.max(1, math.max(0, e[1] + len - t))
    end
  end
  return false, left, len
end

-- Per limit: parameters, state and the check.
local L = {}
for i = 1, n do
  local base = 3 + (i - 1) * 5
  local flags = tonumber(ARGV[base + 4])
  local l = {
    kind = tonumber(ARGV[base]), a = tonumber(ARGV[base + 1]), b = tonumber(ARGV[base + 2]),
    cost = tonumber(ARGV[base + 3]), enforce = flags % 2 == 1, group = math.floor(flags / 2),
  }
  local k = l.kind
  if k == 1 then
    local bal, at = fields(raw[i])
    if not bal then bal, at = l.a, now end
    local t = math.max(now, at)
    l.x, l.y = math.min(l.a, bal + (t - at) * l.b), t
    l.ok, l.rem, l.wait = check_bucket(l.a, l.b, l.x, l.cost)
  elseif k == 2 then
    local tat, frac = fields(raw[i])
    if not tat or tat < now then tat, frac = now, 0 end
    l.x, l.y = tat, frac
    local debt = (tat - now) * l.b + frac
    l.ok, l.rem, l.wait = check_bucket(l.a, l.b, math.max(0, l.a - debt), l.cost)
  elseif k == 3 then
    local start, count = fields(raw[i])
    if not start or now >= start + l.b then start, count = align(now, l.b), 0 end
    l.x, l.y = start, count
    l.ok, l.rem, l.wait = check_counter(l.a, count, l.cost, start + l.b - math.max(now, start))
  elseif k == 4 then
    local start, curr, prev = fields(raw[i])
    if not start or now >= start + 2 * l.b then
      start, curr, prev = align(now, l.b), 0, 0
    elseif now >= start + l.b then
      start, prev, curr = start + l.b, curr, 0
    end
    l.x, l.y, l.z = start, curr, prev
    l.ok, l.rem, l.wait = check_sliding(l.a, l.b, curr, prev, l.cost, math.max(now, start) - start)
  else
    -- MGET saw a string here: the limit used another algorithm before.
    if raw[i] then redis.call('DEL', KEYS[i]) end
    local flat = redis.call('ZRANGE', KEYS[i], 0, -1, 'WITHSCORES')
    local entries, total = {}, 0
    for j = 1, #flat, 2 do
      local _, c = fields(flat[j])
      entries[#entries + 1] = { tonumber(flat[j + 1]), c }
    end
    local t = now
    if #entries > 0 then t = math.max(now, entries[#entries][1]) end
    local kept = {}
    for _, e in ipairs(entries) do
      if e[1] + l.b > t then
        kept[#kept + 1] = e
        total = total + e[2]
      end
    end
    if #kept < #entries then redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', string.format('%d', t - l.b)) end
    l.entries, l.total, l.t = kept, total, t
    l.ok, l.rem, l.wait = check_log(l.a, l.b, kept, total, l.cost, t)
  end
  L[i] = l
end

-- The gate: the lowest group with an enforced denial, or ARGV[2].
local gate = blocked
for i = 1, n do
  if L[i].enforce and not L[i].ok and L[i].group < gate then gate = L[i].group end
end

local reply = {}
for i = 1, n do
  local l, k, key = L[i], L[i].kind, KEYS[i]
  local spend = l.ok and l.group < gate
  local reset
  if k == 1 then
    if spend then l.x = l.x - l.cost * MICRO end
    reset = math.ceil((l.a - l.x) / l.b)
    redis.call('SET', key, string.format('%d:%d', l.x, l.y), 'PX', string.format('%d', reset + SLACK))
  elseif k == 2 then
    if spend then
      local owed = l.y + l.cost * MICRO
      local whole = math.floor(owed / l.b)
      l.x, l.y = l.x + whole, owed - whole * l.b
    end
    reset = math.ceil(((l.x - now) * l.b + l.y) / l.b)
    redis.call('SET', key, string.format('%d:%d', l.x, l.y), 'PX', string.format('%d', reset + SLACK))
  elseif k == 3 then
    if spend then l.y = l.y + l.cost end
    reset = 0
    if l.y > 0 then reset = math.max(0, l.x + l.b - now) end
    redis.call('SET', key, string.format('%d:%d', l.x, l.y), 'PX', string.format('%d', reset + SLACK))
  elseif k == 4 then
    if spend then l.y = l.y + l.cost end
    local windows = 0
    if l.y > 0 then windows = 2 elseif l.z > 0 then windows = 1 end
    reset = math.max(0, l.x + windows * l.b - now)
    redis.call('SET', key, string.format('%d:%d:%d', l.x, l.y, l.z), 'PX', string.format('%d', reset + SLACK))
  else
    local newest = nil
    if #l.entries > 0 then newest = l.entries[#l.entries][1] end
    if spend then
      local member = string.format('%d:%d:%d', l.t, l.cost, l.total + l.cost)
      redis.call('ZADD', key, string.format('%d', l.t), member)
      newest = l.t
    end
    reset = 0
    if newest then
      reset = math.max(0, newest + l.b - now)
      redis.call('PEXPIRE', key, string.format('%d', reset + SLACK))
    end
  end
  local rem = l.rem
  if l.ok and not spend then rem = rem + l.cost end
  local ok = 0
  if l.ok then ok = 1 end
  reply[#reply + 1] = ok
  reply[#reply + 1] = rem
  reply[#reply + 1] = l.wait
  reply[#reply + 1] = reset
end
reply[#reply + 1] = now
return reply
