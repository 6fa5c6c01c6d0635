-- decide.lua: all-or-nothing decisions over the shared limits of a batch of
-- requests, in one script call.
--
-- The twin of src/limits/algorithm.rs: the same integer maths, step by step,
-- so that the in-process store and this script agree on every decision.
-- Every number stays an integer below 2^53, exact in a Lua double.
--
-- The requests of a batch are decided one after the other at the same
-- instant, exactly as if each had made its own call; each key is read once
-- (one MGET) and written once (one SET with expiry) however many requests
-- of the batch touch it, so the work per request falls as batches grow.
--
-- KEYS     the distinct state keys of the batch
-- ARGV[1]  time in ms; "0" means the server's TIME (only tests pass a time)
-- ARGV[2]  number of requests R
-- ARGV[3]  the requests, one after the other, as little-endian binary
--          (struct.unpack), so that no number is sent or parsed as text:
--          blocked  B   first blocked group: charges of this group and later
--                       ones are checked but never spent (an earlier part
--                       of the request's decision already denied them)
--          n        I2  number of limits
--          refund   i8  0 to decide; otherwise the time (ms) at which these
--                       charges were spent by a decision since undone (on a
--                       cluster, another slot denied): give them back
--          then per limit:
--          key      I4  index into KEYS
--          kind     B   1 token_bucket, 2 gcra   (a = capacity in
--                                                 micro-tokens, b =
--                                                 micro-tokens per ms)
--                       3 fixed_window, 4 sliding_window, 5 sliding_log
--                                                (a = limit, b = window in ms)
--          a, b     i8  as above
--          cost     i8  whole units
--          flags    B   group * 2 + 1 for enforce, group * 2 for shadow
--
-- Reply: one string of little-endian 64-bit integers (struct.pack '<i8'),
-- which the gateway reads without a general RESP parser: for each request,
-- for each of its limits, four integers: allowed (1 or 0), remaining
-- (whole units), wait in ms until the cost fits (0 when allowed, -1 when it
-- never can), ms until the key is back to its initial state; then the time
-- used.
--
-- A refund gives each charge's cost back to its state as the in-process
-- store does (never beyond the initial state; a window that has rolled
-- since is left alone), spends nothing, and answers each charge's check
-- after it.
--
-- Group g of a request is charged only if every enforced limit of its
-- groups 0..g admits and g is below `blocked`; shadow limits are charged
-- when they admit and their group is charged. Refreshed state is written
-- back whatever the outcome. Keys expire one second after they would be
-- back to their initial state.
--
-- State: token_bucket "balance:at", gcra "tat:frac", fixed_window
-- "start:count", sliding_window "start:curr:prev" (strings); sliding_log a
-- sorted set of "time:cost:total" scored by time.

local MICRO = 1000000
local SLACK = 1000
-- Algorithm numbers (kind), as src/limits/redis/codec.rs sends them.
local TOKEN_BUCKET, GCRA, FIXED_WINDOW, SLIDING_WINDOW, SLIDING_LOG = 1, 2, 3, 4, 5

local now = tonumber(ARGV[1])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
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

local function check_log(limit, len, s, cost)
  local total, t = s.total, s.t
  local left = math.max(0, limit - total)
  if cost > limit then return false, left, -1 end
  if cost <= left then return true, left - cost, 0 end
  local still = total
  for j = s.first, #s.entries do
    local e = s.entries[j]
    still = still - e[2]
    if still + cost <= limit then
      return false, left, math.max(1, math.max(0, e[1] + len - t))
    end
  end
  return false, left, len
end

-- Loads and refreshes the state of key k; every later use in the batch
-- sees the same table (refreshing again at the same instant changes
-- nothing).
local S = {}
local function state(k, kind, a, b)
  local s = S[k]
  if not s then
    s = { kind = kind }
    S[k] = s
    if kind == TOKEN_BUCKET then
      local bal, at = fields(raw[k])
      if not bal then bal, at = a, now end
      local t = math.max(now, at)
      s.x, s.y = math.min(a, bal + (t - at) * b), t
    elseif kind == GCRA then
      local tat, frac = fields(raw[k])
      if not tat or tat < now then tat, frac = now, 0 end
      s.x, s.y = tat, frac
    elseif kind == FIXED_WINDOW then
      local start, count = fields(raw[k])
      if not start or now >= start + b then start, count = align(now, b), 0 end
      s.x, s.y = start, count
    elseif kind == SLIDING_WINDOW then
      local start, curr, prev = fields(raw[k])
      if not start or now >= start + 2 * b then
        start, curr, prev = align(now, b), 0, 0
      elseif now >= start + b then
        start, prev, curr = start + b, curr, 0
      end
      s.x, s.y, s.z = start, curr, prev
    elseif kind == SLIDING_LOG then
      -- MGET saw a string here: the limit used another algorithm before.
      if raw[k] then redis.call('DEL', KEYS[k]) end
      local flat = redis.call('ZRANGE', KEYS[k], 0, -1, 'WITHSCORES')
      local entries = {}
      for j = 1, #flat, 2 do
        local _, c = fields(flat[j])
        entries[#entries + 1] = { tonumber(flat[j + 1]), c, flat[j] }
      end
      local t = now
      if #entries > 0 then t = math.max(now, entries[#entries][1]) end
      local first, total = #entries + 1, 0
      for j = 1, #entries do
        if entries[j][1] + b > t then
          if j < first then first = j end
          total = total + entries[j][2]
        end
      end
      s.entries, s.first, s.total, s.t, s.len = entries, first, total, t, b
      s.expired = first > 1
      s.added = {}
      s.removed = {}
    else
      error('decide.lua: unknown algorithm ' .. tostring(kind))
    end
  end
  return s
end

-- A GCRA state's debt in micro-tokens: how far its theoretical arrival
-- time lies ahead of now.
local function debt(s, b) return (s.x - now) * b + s.y end

local function check(s, a, b, cost)
  local k = s.kind
  if k == TOKEN_BUCKET then return check_bucket(a, b, s.x, cost) end
  if k == GCRA then return check_bucket(a, b, math.max(0, a - debt(s, b)), cost) end
  if k == FIXED_WINDOW then return check_counter(a, s.y, cost, s.x + b - math.max(now, s.x)) end
  if k == SLIDING_WINDOW then
    return check_sliding(a, b, s.y, s.z, cost, math.max(now, s.x) - s.x)
  end
  return check_log(a, b, s, cost)
end

local function spend(s, b, cost)
  local k = s.kind
  if k == TOKEN_BUCKET then
    s.x = s.x - cost * MICRO
  elseif k == GCRA then
    local owed = s.y + cost * MICRO
    local whole = math.floor(owed / b)
    s.x, s.y = s.x + whole, owed - whole * b
  elseif k == FIXED_WINDOW or k == SLIDING_WINDOW then
    s.y = s.y + cost
  else
    s.total = s.total + cost
    s.entries[#s.entries + 1] = { s.t, cost }
    s.added[#s.added + 1] = string.format('%d:%d:%d', s.t, cost, s.total)
  end
end

local function refund(s, a, b, cost, spent_at)
  local k = s.kind
  if k == TOKEN_BUCKET then
    s.x = math.min(a, s.x + cost * MICRO)
  elseif k == GCRA then
    local owed = math.max(0, debt(s, b) - cost * MICRO)
    local whole = math.floor(owed / b)
    s.x, s.y = now + whole, owed - whole * b
  elseif k == FIXED_WINDOW then
    if spent_at >= s.x and spent_at < s.x + b then s.y = math.max(0, s.y - cost) end
  elseif k == SLIDING_WINDOW then
    if spent_at >= s.x then
      s.y = math.max(0, s.y - cost)
    elseif spent_at + b >= s.x then
      s.z = math.max(0, s.z - cost)
    end
  else
    for j = #s.entries, s.first, -1 do
      local e = s.entries[j]
      if e[1] == spent_at and e[2] == cost then
        if e[3] then s.removed[#s.removed + 1] = e[3] end
        table.remove(s.entries, j)
        s.total = s.total - cost
        break
      end
    end
  end
end

-- Milliseconds until the key is back to its initial state.
local function reset(s, a, b)
  local k = s.kind
  if k == TOKEN_BUCKET then return math.ceil((a - s.x) / b) end
  if k == GCRA then return math.ceil(debt(s, b) / b) end
  if k == FIXED_WINDOW then
    if s.y > 0 then return math.max(0, s.x + b - now) end
    return 0
  end
  if k == SLIDING_WINDOW then
    local windows = 0
    if s.y > 0 then windows = 2 elseif s.z > 0 then windows = 1 end
    return math.max(0, s.x + windows * b - now)
  end
  if #s.entries >= s.first then return math.max(0, s.entries[#s.entries][1] + b - now) end
  return 0
end

local reply = {}
local requests, pos = ARGV[3], 1
-- Per limit of the current request, flat: state, a, b, cost, group, ok,
-- remaining, wait (no table per limit).
local L = {}
for _ = 1, tonumber(ARGV[2]) do
  local blocked, n, refunding
  blocked, n, refunding, pos = struct.unpack('<BI2i8', requests, pos)
  local gate = blocked
  if refunding > 0 then gate = -1 end
  for j = 0, n - 1 do
    local k, kind, a, b, cost, flags
    k, kind, a, b, cost, flags, pos = struct.unpack('<I4Bi8i8i8B', requests, pos)
    local s = state(k, kind, a, b)
    if refunding > 0 then refund(s, a, b, cost, refunding) end
    local ok, rem, wait = check(s, a, b, cost)
    local group = math.floor(flags / 2)
    if flags % 2 == 1 and not ok and group < gate then gate = group end
    local o = j * 8
    L[o + 1], L[o + 2], L[o + 3], L[o + 4] = s, a, b, cost
    L[o + 5], L[o + 6], L[o + 7], L[o + 8] = group, ok, rem, wait
  end
  for j = 0, n - 1 do
    local o = j * 8
    local s, a, b, cost, ok, rem = L[o + 1], L[o + 2], L[o + 3], L[o + 4], L[o + 6], L[o + 7]
    local spent = ok and L[o + 5] < gate
    if spent then spend(s, b, cost) elseif ok and refunding == 0 then rem = rem + cost end
    s.a, s.b = a, b
    reply[#reply + 1] = struct.pack('<i8i8i8i8', ok and 1 or 0, rem, L[o + 8], reset(s, a, b))
  end
end

-- One write per key, with the state the whole batch left.
for k, s in pairs(S) do
  local key = KEYS[k]
  local ttl = string.format('%d', reset(s, s.a, s.b) + SLACK)
  if s.kind == TOKEN_BUCKET or s.kind == GCRA or s.kind == FIXED_WINDOW then
    redis.call('SET', key, string.format('%d:%d', s.x, s.y), 'PX', ttl)
  elseif s.kind == SLIDING_WINDOW then
    redis.call('SET', key, string.format('%d:%d:%d', s.x, s.y, s.z), 'PX', ttl)
  else
    if s.expired then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', s.t - s.len))
    end
    if #s.removed > 0 then redis.call('ZREM', key, unpack(s.removed)) end
    if #s.added > 0 then
      local args = {}
      for _, m in ipairs(s.added) do
        args[#args + 1] = string.format('%d', s.t)
        args[#args + 1] = m
      end
      redis.call('ZADD', key, unpack(args))
    end
    if #s.entries >= s.first then redis.call('PEXPIRE', key, ttl) end
  end
end
reply[#reply + 1] = struct.pack('<i8', now)
return table.concat(reply)
