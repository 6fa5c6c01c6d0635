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
--          kind     B   TOKEN_BUCKET, GCRA  (a = capacity in micro-tokens,
--                                            b = micro-tokens per ms)
--                       FIXED_WINDOW, SLIDING_WINDOW, SLIDING_LOG
--                                           (a = limit, b = window in ms)
--                       QUOTA               (a = limit, b = 1 for a UTC
--                                            day, 2 for a UTC month)
--          a, b     i8  as above
--          cost     i8  whole units
--          flags    B   bit 0: enforced (else shadow); bit 1: the group;
--                       bit 2: a take follows; bit 3: a delay follows;
--                       bit 4: forced
--          take     i8  only with flag bit 2: units to take beyond the cost,
--                       as many as fit, when the charge is spent (a lease)
--          delay    i8  only with flag bit 3: a cost that fits within this
--                       many ms is admitted after that wait, charged now
--                       (a bucket goes into debt, a GCRA's TAT moves ahead)
--
-- A forced charge (a cost learnt after the response) is charged whatever
-- the state, into debt of at most one more capacity or limit, and gates
-- nothing.
--
-- Reply: one string of little-endian 64-bit integers (struct.pack '<i8'),
-- which the gateway reads without a general RESP parser: for each request,
-- for each of its limits, five integers: allowed (1, 0, or 2 when admitted
-- after a delay), remaining (whole units), wait in ms until the cost fits
-- (0 when allowed, -1 when it never can; the delay when allowed is 2), ms
-- until the key is back to its initial state, units taken beyond the cost;
-- then the time used.
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
-- State records what wrote it. A string key is binary: the algorithm (B),
-- the number that gives the state its meaning (i8: a GCRA's rate, a
-- window's length, 0 for a token bucket), then the state's numbers (i8
-- each): token_bucket balance, at; gcra tat, frac; fixed_window start,
-- count; sliding_window start, curr, prev; quota period start, count. State of another algorithm or
-- meaning, of another length or of an older format is not read: the key
-- starts afresh, as in the in-process store.
--
-- A sliding_log is a sorted set scored by admission time, each member the
-- binary (big-endian i8 each, so that members of one instant sort by it)
-- running total of the log up to and including it, its cost and the
-- window it was written under. The total inside the window
-- is the newest running total minus the one before the oldest entry still
-- inside, found with one range query; expired entries are pruned a bounded
-- number at a time. So a decision reads O(log n) of the set however many
-- entries it holds; only a denial's retry time searches it, in O(log² n).

local MICRO = 1000000
local SLACK = 1000
-- Expired log entries removed per decision, at most.
local PRUNE = 64
-- Algorithm numbers (kind), as src/limits/redis/codec.rs sends them.
local TOKEN_BUCKET, GCRA, FIXED_WINDOW, SLIDING_WINDOW, SLIDING_LOG, QUOTA = 1, 2, 3, 4, 5, 6
-- Binary state: format and length by algorithm.
local FORMAT = { '<Bi8i8i8', '<Bi8i8i8', '<Bi8i8i8', '<Bi8i8i8i8', nil, '<Bi8i8i8' }
local LENGTH = { 25, 25, 25, 33, nil, 25 }
local DAY_MS = 86400000
-- Big-endian, so that entries of one instant sort by running total.
local ENTRY = '>i8i8i8'

-- Set per call: a function library cannot reach them while it loads.
local floor, max, min, pack, unpack_, call

-- The call's inputs and state, set by `decide` at the start of each call:
-- its keys, its time, the keys' string values, and their loaded state.
local keys, now, raw, S

local function align(t, w) return t - t % w end
-- A whole number as an argument of redis.call: below 10^14 Redis writes a
-- Lua number exactly itself (with "%.14g"), which costs less than
-- formatting it here.
local function int(n)
  if n < 1e14 then return n end
  return string.format('%d', n)
end

-- Days since 1970-01-01 of a date, and back (H. Hinnant's algorithms, as
-- in src/limits/algorithm.rs).
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local mp = m - 3
  if m <= 2 then mp = m + 9 end
  local doy = floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function civil_from_days(z)
  z = z + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local m = mp + 3
  if mp >= 10 then m = mp - 9 end
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- The start and end (ms) of the calendar period (1 day, 2 month) holding t.
local function period(t, code)
  local day = floor(t / DAY_MS)
  if code == 1 then return day * DAY_MS, (day + 1) * DAY_MS end
  local y, m = civil_from_days(day)
  local ny, nm = y, m + 1
  if m == 12 then ny, nm = y + 1, 1 end
  return days_from_civil(y, m, 1) * DAY_MS, days_from_civil(ny, nm, 1) * DAY_MS
end

-- The check of a bucket holding `balance`: allowed, remaining, wait.
-- (A balance below zero is a debt: a delayed admission, a forced charge.)
local function check_bucket(cap, per_ms, balance, cost)
  local need = cost * MICRO
  local left = floor(max(0, balance) / MICRO)
  if need > cap then return false, left, -1 end
  if balance >= need then return true, floor((balance - need) / MICRO), 0 end
  return false, left, math.ceil((need - balance) / per_ms)
end

local function check_counter(limit, count, cost, until_next)
  local left = max(0, limit - count)
  if cost > limit then return false, left, -1 end
  if cost <= left then return true, left - cost, 0 end
  return false, left, until_next
end

local function check_sliding(limit, len, curr, prev, cost, elapsed)
  local used = prev * (len - elapsed) + curr * len
  local budget = limit * len
  local left = floor(max(0, budget - used) / len)
  if cost > limit then return false, left, -1 end
  if used + cost * len <= budget then
    return true, floor((budget - used - cost * len) / len), 0
  end
  local to_roll = len - elapsed
  local wait
  if curr + cost <= limit then
    wait = max(0, to_roll - floor((limit - curr - cost) * len / prev))
  else
    wait = to_roll + max(0, len - floor((limit - cost) * len / curr))
  end
  return false, left, max(1, wait)
end

-- A log entry: running total, cost, window; nil when it is not one.
local function entry(member)
  if not member or #member ~= 24 then return nil end
  return unpack_(ENTRY, member)
end

-- The time of the first stored entry whose running total reaches `target`
-- (entries are stored in time order, so running totals rise with rank):
-- a binary search by rank between `lo` and `hi`; nil when none does.
local function first_reaching(key, lo, hi, target)
  local found
  while lo <= hi do
    local mid = floor((lo + hi) / 2)
    local got = call('ZRANGE', key, mid, mid, 'WITHSCORES')
    local run = entry(got[1])
    if run and run >= target then
      found, hi = tonumber(got[2]), mid - 1
    else
      lo = mid + 1
    end
  end
  return found
end

local function check_log(limit, len, s, cost)
  local total = s.run - s.base
  local left = max(0, limit - total)
  if cost > limit then return false, left, -1 end
  if cost <= left then return true, left - cost, 0 end
  -- The oldest entries leave first: the first whose leaving makes room.
  local target = s.run + cost - limit
  local at
  if s.stored_run >= target then
    at = first_reaching(s.key, s.first_rank, s.last_rank, target)
  end
  -- Entries of this batch were all admitted at s.t.
  if not at then at = s.t end
  return false, left, max(1, at + len - s.t)
end

-- Loads a sliding log: its newest entry, the oldest inside the window, and
-- a bounded pruning of expired ones.
local function load_log(s, k, b)
  local key = keys[k]
  -- MGET saw a string here: the limit used another algorithm before.
  if raw[k] then call('DEL', key) end
  s.key, s.len, s.t, s.run, s.base, s.stored_run = key, b, now, 0, 0, 0
  s.first_rank, s.last_rank = 0, -1
  s.added = {}
  local last = call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  local run, _, window = entry(last[1])
  if not run or window ~= b then
    -- Written under another window, or in an older format: afresh.
    call('DEL', key)
    return
  end
  s.newest = tonumber(last[2])
  s.t = max(now, s.newest)
  s.run, s.base, s.stored_run = run, run, run
  local first = call('ZRANGEBYSCORE', key, '(' .. int(s.t - b), '+inf', 'LIMIT', 0, 1)
  if #first == 0 then
    -- Everything expired: the set goes as a whole.
    call('UNLINK', key)
    return
  end
  local frun, fcost = entry(first[1])
  s.base = frun - fcost
  local rank = call('ZRANK', key, first[1])
  local removed = min(rank, PRUNE)
  if removed > 0 then call('ZREMRANGEBYRANK', key, 0, removed - 1) end
  s.first_rank = rank - removed
  s.last_rank = call('ZCARD', key) - 1
end

-- Loads and refreshes the state of key k; every later use in the batch
-- sees the same table (refreshing again at the same instant changes
-- nothing).
local function state(k, kind, a, b)
  local s = S[k]
  if s then return s end
  s = { kind = kind }
  S[k] = s
  if kind == SLIDING_LOG then
    load_log(s, k, b)
    return s
  end
  local fmt = FORMAT[kind]
  if not fmt then error('decide.lua: unknown algorithm ' .. tostring(kind)) end
  local meaning = 0
  if kind ~= TOKEN_BUCKET then meaning = b end
  s.meaning = meaning
  local v, x, y, z = raw[k]
  if v and #v == LENGTH[kind] then
    local kk, m
    kk, m, x, y, z = unpack_(fmt, v)
    if kk ~= kind or m ~= meaning then x = nil end
  end
  if kind == TOKEN_BUCKET then
    if not x then x, y = a, now end
    local t = max(now, y)
    s.x, s.y = min(a, x + (t - y) * b), t
  elseif kind == GCRA then
    if not x or x < now then x, y = now, 0 end
    s.x, s.y = x, y
  elseif kind == FIXED_WINDOW then
    if not x or now >= x + b then x, y = align(now, b), 0 end
    s.x, s.y = x, y
  elseif kind == QUOTA then
    -- The period's end is kept beside its start: read by every check.
    local finish
    if x then finish = select(2, period(x, b)) end
    if not x or now >= finish then
      x, finish = period(now, b)
      y = 0
    end
    s.x, s.y, s.finish = x, y, finish
  else
    if not x or now >= x + 2 * b then
      x, y, z = align(now, b), 0, 0
    elseif now >= x + b then
      x, y, z = x + b, 0, y
    end
    s.x, s.y, s.z = x, y, z
  end
  return s
end

-- A GCRA state's debt in micro-tokens: how far its theoretical arrival
-- time lies ahead of now.
local function debt(s, b) return (s.x - now) * b + s.y end

local function check(s, a, b, cost)
  local k = s.kind
  if k == TOKEN_BUCKET then return check_bucket(a, b, s.x, cost) end
  if k == GCRA then return check_bucket(a, b, a - debt(s, b), cost) end
  if k == FIXED_WINDOW then return check_counter(a, s.y, cost, s.x + b - max(now, s.x)) end
  if k == QUOTA then return check_counter(a, s.y, cost, s.finish - max(now, s.x)) end
  if k == SLIDING_WINDOW then
    return check_sliding(a, b, s.y, s.z, cost, max(now, s.x) - s.x)
  end
  return check_log(a, b, s, cost)
end

local function spend(s, b, cost)
  local k = s.kind
  if k == TOKEN_BUCKET then
    s.x = s.x - cost * MICRO
  elseif k == GCRA then
    local owed = s.y + cost * MICRO
    local whole = floor(owed / b)
    s.x, s.y = s.x + whole, owed - whole * b
  elseif k == FIXED_WINDOW or k == SLIDING_WINDOW or k == QUOTA then
    s.y = s.y + cost
  else
    s.run = s.run + cost
    s.added[#s.added + 1] = pack(ENTRY, s.run, cost, s.len)
  end
end

-- Charges `cost` whatever the state, into debt of at most one more
-- capacity or limit; a state deeper than that already (a delay schedules
-- further ahead) is left as it is, never lifted.
local function force(s, a, b, cost)
  local k = s.kind
  if k == TOKEN_BUCKET then
    s.x = min(s.x, max(s.x - cost * MICRO, -a))
  elseif k == GCRA then
    local owed = debt(s, b)
    local charged = min(owed + cost * MICRO, 2 * a)
    if charged > owed then
      local whole = floor(charged / b)
      s.x, s.y = now + whole, charged - whole * b
    end
  elseif k == SLIDING_LOG then
    local room = 2 * a - (s.run - s.base)
    if room > 0 then spend(s, b, min(cost, room)) end
  else
    s.y = max(s.y, min(s.y + cost, 2 * a))
  end
end

-- Spends up to `want` more units, as many as fit now; returns how many.
local function take(s, a, b, want)
  if want <= 0 or s.kind == SLIDING_LOG then return 0 end
  local _, rem = check(s, a, b, 0)
  local granted = min(want, rem)
  if granted > 0 then spend(s, b, granted) end
  return granted
end

-- Gives back a log entry admitted at `spent_at` for `cost`, the newest
-- such; the running totals after it come down by its cost.
local function refund_log(s, cost, spent_at)
  local at = int(spent_at)
  local found, found_run
  for _, m in ipairs(call('ZRANGEBYSCORE', s.key, at, at)) do
    local run, c = entry(m)
    if run and c == cost and run > s.base and (not found_run or run > found_run) then
      found, found_run = m, run
    end
  end
  if not found then return end
  -- The entries after it: those admitted since spent_at, a handful.
  local later = call('ZRANGEBYSCORE', s.key, at, '+inf', 'WITHSCORES')
  call('ZREM', s.key, found)
  for i = 1, #later, 2 do
    local r2, c2, w2 = entry(later[i])
    if r2 and r2 > found_run then
      call('ZREM', s.key, later[i])
      call('ZADD', s.key, later[i + 1], pack(ENTRY, r2 - cost, c2, w2))
    end
  end
  s.run, s.stored_run, s.last_rank = s.run - cost, s.stored_run - cost, s.last_rank - 1
  local last = call('ZRANGE', s.key, -1, -1, 'WITHSCORES')
  s.newest = tonumber(last[2])
end

local function refund(s, a, b, cost, spent_at)
  local k = s.kind
  if k == TOKEN_BUCKET then
    s.x = min(a, s.x + cost * MICRO)
  elseif k == GCRA then
    local owed = max(0, debt(s, b) - cost * MICRO)
    local whole = floor(owed / b)
    s.x, s.y = now + whole, owed - whole * b
  elseif k == FIXED_WINDOW then
    if spent_at >= s.x and spent_at < s.x + b then s.y = max(0, s.y - cost) end
  elseif k == QUOTA then
    if spent_at >= s.x and spent_at < s.finish then s.y = max(0, s.y - cost) end
  elseif k == SLIDING_WINDOW then
    if spent_at >= s.x then
      s.y = max(0, s.y - cost)
    elseif spent_at + b >= s.x then
      s.z = max(0, s.z - cost)
    end
  else
    refund_log(s, cost, spent_at)
  end
end

-- Milliseconds until the key is back to its initial state.
local function reset(s, a, b)
  local k = s.kind
  if k == TOKEN_BUCKET then return math.ceil((a - s.x) / b) end
  if k == GCRA then return math.ceil(debt(s, b) / b) end
  if k == FIXED_WINDOW then
    if s.y > 0 then return max(0, s.x + b - now) end
    return 0
  end
  if k == QUOTA then
    if s.y > 0 then return max(0, s.finish - now) end
    return 0
  end
  if k == SLIDING_WINDOW then
    local windows = 0
    if s.y > 0 then windows = 2 elseif s.z > 0 then windows = 1 end
    return max(0, s.x + windows * b - now)
  end
  if s.run > s.base then
    -- The newest entry: of this batch, or the stored newest.
    local newest = s.t
    if #s.added == 0 then newest = s.newest or s.t end
    return max(0, newest + b - now)
  end
  return 0
end

-- Decides a batch: KEYS and ARGV as described at the top.
local function decide(call_keys, args)
  floor, max, min = math.floor, math.max, math.min
  pack, unpack_, call = struct.pack, struct.unpack, redis.call
  keys, S = call_keys, {}
  now = tonumber(args[1])
  if now == 0 then
    local t = call('TIME')
    now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
  end
  -- A call for no requests (a connection warming up) reads nothing.
  raw = #keys > 0 and call('MGET', unpack(keys)) or {}
  local reply = {}
  local requests, pos = args[3], 1
  -- Per limit of the current request, flat: state, a, b, cost, group, ok,
  -- remaining, wait, take, mode (no table per limit).
  local L = {}
  for _ = 1, tonumber(args[2]) do
    local blocked, n, refunding
    blocked, n, refunding, pos = unpack_('<BI2i8', requests, pos)
    local gate = blocked
    if refunding > 0 then gate = -1 end
    for j = 0, n - 1 do
      local k, kind, a, b, cost, flags
      k, kind, a, b, cost, flags, pos = unpack_('<I4Bi8i8i8B', requests, pos)
      -- Most limits carry no take, delay or force: one comparison.
      local want, longest, forced = 0, 0, false
      if flags >= 4 then
        if flags >= 16 then forced, flags = true, flags - 16 end
        local delays = flags >= 8
        if delays then flags = flags - 8 end
        if flags >= 4 then
          want, pos = unpack_('<i8', requests, pos)
          flags = flags - 4
        end
        if delays then longest, pos = unpack_('<i8', requests, pos) end
      end
      local s = state(k, kind, a, b)
      if refunding > 0 then refund(s, a, b, cost, refunding) end
      local ok, rem, wait = check(s, a, b, cost)
      -- How it is admitted: 0 as checked, -1 forced, > 0 after that delay.
      local mode = 0
      if forced then
        ok, mode = true, -1
      elseif not ok and longest > 0 and wait >= 0 and wait <= longest then
        ok, rem, wait, mode = true, 0, 0, wait
      end
      local group = floor(flags / 2)
      if flags % 2 == 1 and not ok and group < gate then gate = group end
      local o = j * 10
      L[o + 1], L[o + 2], L[o + 3], L[o + 4], L[o + 5] = s, a, b, cost, group
      L[o + 6], L[o + 7], L[o + 8], L[o + 9], L[o + 10] = ok, rem, wait, want, mode
    end
    for j = 0, n - 1 do
      local o = j * 10
      local s, a, b, cost, ok, rem = L[o + 1], L[o + 2], L[o + 3], L[o + 4], L[o + 6], L[o + 7]
      local mode = L[o + 10]
      local spent = ok and L[o + 5] < gate
      local granted = 0
      if mode < 0 then
        force(s, a, b, cost)
        local _, left = check(s, a, b, 0)
        rem = left
      elseif spent then
        spend(s, b, cost)
        granted = take(s, a, b, L[o + 9])
        rem = rem - granted
      elseif ok and refunding == 0 and mode == 0 then
        rem = rem + cost
      end
      s.a, s.b = a, b
      local admitted, wait = 0, L[o + 8]
      if mode > 0 then admitted, wait = 2, mode elseif ok then admitted = 1 end
      reply[#reply + 1] = pack('<i8i8i8i8i8', admitted, rem, wait, reset(s, a, b), granted)
    end
  end

  -- One write per key, with the state the whole batch left.
  for k, s in pairs(S) do
    local key = keys[k]
    local ttl = int(reset(s, s.a, s.b) + SLACK)
    if s.kind == SLIDING_WINDOW then
      call('SET', key, pack(FORMAT[SLIDING_WINDOW], s.kind, s.meaning, s.x, s.y, s.z), 'PX', ttl)
    elseif s.kind ~= SLIDING_LOG then
      call('SET', key, pack(FORMAT[s.kind], s.kind, s.meaning, s.x, s.y), 'PX', ttl)
    else
      if #s.added > 0 then
        local args = {}
        local at = int(s.t)
        for _, m in ipairs(s.added) do
          args[#args + 1] = at
          args[#args + 1] = m
        end
        call('ZADD', key, unpack(args))
      end
      if s.run > s.base then call('PEXPIRE', key, ttl) end
    end
  end
  reply[#reply + 1] = pack('<i8', now)
  return table.concat(reply)
end

-- Loaded as a function library (FUNCTION LOAD, Redis >= 7), the helpers
-- above are made once and each call is only `decide`; run as a script
-- (EVALSHA), the whole file runs on every call.
if redis.register_function then
  redis.register_function(FUNCTION_NAME, decide)
else
  return decide(KEYS, ARGV)
end
