-- limits.lua: what every script of tollgate shares. A script is this file
-- and the file of its concern, then serve.lua:
--   decide.lua   all-or-nothing decisions (the request path)
--   settle.lua   giving back what decisions spent (a lease's unused units,
--                a cost settled lower, a cluster slot's undone part, a
--                request's hold at its end)
--   inspect.lua  peeks, resets and credits (operators, never the request
--                path; a credit gives back as settle.lua does)
-- On a server with functions the four files are one library, each concern
-- a function of its own; elsewhere each concern is a script of its own.
--
-- The twin of src/limits/algorithm.rs: the same integer maths, step by step,
-- so that the in-process store and these scripts agree on every decision.
-- Every number stays an integer below 2^53, exact in a Lua double.
--
-- The requests of a call are handled one after the other at the same
-- instant, exactly as if each had made its own call; each key is read once
-- (one MGET) and written once (one SET with expiry) however many requests
-- of the call touch it, so the work per request falls as batches grow.
-- One call carries requests of one concern.
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
--          refund   i8  0 to decide; -1 to peek, -2 to reset, -3 to credit
--                       (inspect.lua); otherwise the time (ms) at which
--                       these charges were spent by a decision since undone
--                       (settle.lua)
--          then per limit:
--          key      I4  index into KEYS
--          kind     B   the algorithm (ALGORITHMS below)
--          a, b     i8  its two parameters, named by the algorithm:
--                       token_bucket, gcra: capacity in micro-tokens,
--                         micro-tokens per ms
--                       fixed_window, sliding_window, sliding_log: limit,
--                         window in ms
--                       quota: limit, calendar (1 a UTC day, 2 a UTC month)
--                       concurrency: max_in_flight, hold_ttl_ms
--          cost     i8  whole units
--          flags    B   ENFORCED (else shadow), GROUP (the request group,
--                       else pre-auth), TAKES, DELAYS, FORCED, HOLDS (below)
--          take     i8  only with TAKES: units to take beyond the cost, as
--                       many as fit, when the charge is spent (a lease)
--          delay    i8  only with DELAYS: a cost that fits within this many
--                       ms is admitted after that wait, charged now (a
--                       bucket goes into debt, a GCRA's TAT moves ahead)
--          debt     i8  only with FORCED: the deepest debt, in units
--          hold     c16 only with HOLDS: a concurrency limit's hold, the
--                       request's member of its sorted set
--          A request may instead be the one byte SAME (254): the request
--          before it again, byte for byte (a busy caller's requests of one
--          batch usually are), so that it is neither sent nor read twice.
--
-- Reply: one string of little-endian 64-bit integers (struct.pack '<i8'),
-- which the gateway reads without a general RESP parser: for each request,
-- for each of its limits, five integers: admitted (1, 0, or 2 when after a
-- delay), remaining (whole units), wait in ms until the cost fits (0 when
-- admitted, -1 when it never can; the delay when admitted is 2), ms until
-- the key is back to its initial state, units taken beyond the cost (for a
-- forced charge, units not charged; for a hold, expired holds reclaimed);
-- then the time used.
--
-- A concurrency limit holds one unit per request in flight: spending a
-- charge with a hold takes it (until hold_ttl_ms from now), forcing one
-- renews it if it is still held, giving one back releases it.
--
-- State records what wrote it. A string key is binary: the algorithm (B),
-- the number that gives the state its meaning (i8: a GCRA's rate, a
-- window's length, a quota's calendar, 0 for a token bucket), then the
-- state's numbers (i8 each, named by each algorithm's `fields`). State of
-- another algorithm or meaning, of another length or of an older format is
-- not read: the key starts afresh, as in the in-process store.
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
local DAY_MS = 86400000
local DAY, MONTH = 1, 2
-- Big-endian, so that entries of one instant sort by running total.
local ENTRY = '>i8i8i8'
-- A limit's flags, as src/limits/redis/codec.rs sets them.
local ENFORCED, GROUP, TAKES, DELAYS, FORCED, HOLDS = 1, 2, 4, 8, 16, 32
-- A request that repeats the one before it.
local SAME = 254
-- Bytes of a hold, the member of a concurrency limit's sorted set.
local HOLD = 16
-- A full concurrency limit's wait: a second (Retry-After: 1).
local HOLD_RETRY_MS = 1000
-- Each flags byte by name, decoded on first use (in a function library
-- once for all calls; a script, which runs its whole text on every call,
-- decodes only the few bytes its call holds).
local FLAGS = {}
local function flags_of(f)
  if f < 0 or f >= 2 * HOLDS or f % 1 ~= 0 then return nil end
  local function set(bit) return (f - f % bit) / bit % 2 == 1 end
  local flags = {
    enforced = set(ENFORCED), group = set(GROUP) and 1 or 0,
    takes = set(TAKES), delays = set(DELAYS), forced = set(FORCED),
    holds = set(HOLDS),
  }
  FLAGS[f] = flags
  return flags
end

-- Set per call: a function library cannot reach them while it loads.
local floor, max, min, ceil, pack, unpack_, call, byte

-- The call's inputs and state, set by `decide` at the start of each call:
-- its keys, its time, the keys' string values, and their loaded state by
-- key index.
local keys, now, raw, S
-- The request being decided (read below).
local R
-- True while a peek loads state: nothing may be written then.
local reading = false

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

-- The start and end (ms) of the calendar period (DAY or MONTH) holding t.
local function period(t, calendar)
  local day = floor(t / DAY_MS)
  if calendar == DAY then return day * DAY_MS, (day + 1) * DAY_MS end
  local y, m = civil_from_days(day)
  local ny, nm = y, m + 1
  if m == 12 then ny, nm = y + 1, 1 end
  return days_from_civil(y, m, 1) * DAY_MS, days_from_civil(ny, nm, 1) * DAY_MS
end

-- The checks, shared by the algorithms below. Each answers: admitted,
-- remaining whole units, and the wait in ms until the cost fits (0 when
-- admitted, -1 when it never can).

-- A bucket of `capacity` micro-tokens holding `balance`. (A balance below
-- zero is a debt: a delayed admission, a forced charge.) Whole quotients
-- are taken with `%`, an operator, rather than math.floor and math.ceil,
-- and an admission computes only what it answers: a call out of Lua
-- costs more than the arithmetic around it. (The quotient of a multiple
-- is exact.)
local function check_bucket(capacity, per_ms, balance, cost)
  local need = cost * MICRO
  if balance >= need and need <= capacity then
    local after = balance - need
    return true, (after - after % MICRO) / MICRO, 0
  end
  local left = balance > 0 and (balance - balance % MICRO) / MICRO or 0
  if need > capacity then return false, left, -1 end
  local short = need - balance
  return false, left, (short + (-short) % per_ms) / per_ms
end

-- A counter of `count` against `limit` that starts over in `until_next` ms.
local function check_counter(limit, count, cost, until_next)
  local left = max(0, limit - count)
  if cost > limit then return false, left, -1 end
  if cost <= left then return true, left - cost, 0 end
  return false, left, until_next
end

-- Counts over the sliding window's span: in micro-windows, no division
-- until the answer.
local function check_sliding(limit, window, count, prev, cost, elapsed)
  local used = prev * (window - elapsed) + count * window
  local budget = limit * window
  local left = floor(max(0, budget - used) / window)
  if cost > limit then return false, left, -1 end
  if used + cost * window <= budget then
    return true, floor((budget - used - cost * window) / window), 0
  end
  local to_roll = window - elapsed
  local wait
  if count + cost <= limit then
    wait = max(0, to_roll - floor((limit - count - cost) * window / prev))
  else
    wait = to_roll + max(0, window - floor((limit - cost) * window / count))
  end
  return false, left, max(1, wait)
end

-- The algorithms. Each is a table of the same functions over a key's
-- state `s`, which holds the parameters of the limit that last used it by
-- name (`params`: capacity and per_ms, limit and window, or limit and
-- calendar) beside the numbers of its state:
--   params(s, a, b)      names the two parameters a limit sent
--   meaning(s)           the parameter stored beside the state
--   load(s, ...)         the state from its stored numbers (nil: fresh),
--                        refreshed to now
--   fields(s)            the stored numbers, in `format`'s order
--   check(s, cost)       admitted, remaining, wait
--   spend(s, cost)       charges an admitted cost
--   force(s, cost, debt) charges whatever the state, into debt of at most
--                        `debt` units; a deeper debt (a delay schedules
--                        further ahead) is never lifted. Returns the units
--                        not charged
--   reset(s)             ms until the key is back to its initial state
-- and, defined by the concern that uses them: refund(s, cost, at), which
-- gives back a cost spent at `at` (settle.lua); credit(s, units) and
-- clear(s) where an algorithm has its own (inspect.lua).
-- A string state is `format` packed, `length` bytes: the algorithm, the
-- meaning and the numbers. A sliding log lives in a sorted set and has
-- `open` and `write` instead of `load` and `fields`.

local function bucket_params(s, a, b) s.capacity, s.per_ms = a, b end
local function window_params(s, a, b) s.limit, s.window = a, b end

-- token_bucket: balance (micro-tokens), at (ms, when it was refilled to).
local token_bucket = { kind = 1, format = '<Bi8i8i8', length = 25, params = bucket_params }

function token_bucket.meaning() return 0 end

function token_bucket.load(s, balance, at)
  if not balance then balance, at = s.capacity, now end
  -- (Compared here rather than with math.max and math.min: a call out
  -- of Lua costs more than the comparison.)
  local t = now > at and now or at
  local full, filled = s.capacity, balance + (t - at) * s.per_ms
  s.balance, s.at = filled < full and filled or full, t
end

function token_bucket.fields(s) return s.balance, s.at end

function token_bucket.check(s, cost)
  return check_bucket(s.capacity, s.per_ms, s.balance, cost)
end

function token_bucket.spend(s, cost) s.balance = s.balance - cost * MICRO end

-- Whole units of a forced cost not charged when `charged` micro-units
-- were (a part of a unit counts as one).
local function uncharged(cost, charged) return ceil(max(0, cost * MICRO - charged) / MICRO) end

function token_bucket.force(s, cost, debt)
  local before = s.balance
  s.balance = min(before, max(before - cost * MICRO, -debt * MICRO))
  return uncharged(cost, before - s.balance)
end

function token_bucket.reset(s)
  local empty, per_ms = s.capacity - s.balance, s.per_ms
  return (empty + (-empty) % per_ms) / per_ms
end

-- gcra: tat (ms, the theoretical arrival time), frac (micro-tokens owed
-- beyond the whole ms of tat).
local gcra = { kind = 2, format = '<Bi8i8i8', length = 25, params = bucket_params }

function gcra.meaning(s) return s.per_ms end

function gcra.load(s, tat, frac)
  if not tat or tat < now then tat, frac = now, 0 end
  s.tat, s.frac = tat, frac
end

function gcra.fields(s) return s.tat, s.frac end

-- Micro-tokens owed: how far the theoretical arrival time lies ahead.
local function owed(s) return (s.tat - now) * s.per_ms + s.frac end

-- Sets what is owed, as whole ms of tat and the rest.
local function owe(s, debt)
  local whole = floor(debt / s.per_ms)
  s.tat, s.frac = now + whole, debt - whole * s.per_ms
end

function gcra.check(s, cost)
  return check_bucket(s.capacity, s.per_ms, s.capacity - owed(s), cost)
end

function gcra.spend(s, cost) owe(s, owed(s) + cost * MICRO) end

function gcra.force(s, cost, debt)
  local before = owed(s)
  local after = min(before + cost * MICRO, s.capacity + debt * MICRO)
  if after > before then owe(s, after) end
  return uncharged(cost, max(0, after - before))
end

function gcra.reset(s) return ceil(owed(s) / s.per_ms) end

-- Counters (windows and quotas) are spent and forced alike.
local function spend_count(s, cost) s.count = s.count + cost end

local function force_count(s, cost, debt)
  local before = s.count
  s.count = max(before, min(before + cost, s.limit + debt))
  return cost - (s.count - before)
end

-- fixed_window: start (ms), count.
local fixed_window = {
  kind = 3, format = '<Bi8i8i8', length = 25, params = window_params,
  spend = spend_count, force = force_count,
}

function fixed_window.meaning(s) return s.window end

function fixed_window.load(s, start, count)
  if not start or now >= start + s.window then start, count = align(now, s.window), 0 end
  s.start, s.count = start, count
end

function fixed_window.fields(s) return s.start, s.count end

function fixed_window.check(s, cost)
  return check_counter(s.limit, s.count, cost, s.start + s.window - max(now, s.start))
end

function fixed_window.reset(s)
  if s.count > 0 then return max(0, s.start + s.window - now) end
  return 0
end

-- quota: start (ms, of the calendar period), count; the period's end is
-- kept beside its start, read by every check.
local quota = {
  kind = 6, format = '<Bi8i8i8', length = 25, spend = spend_count, force = force_count,
}

function quota.params(s, a, b) s.limit, s.calendar = a, b end

function quota.meaning(s) return s.calendar end

function quota.load(s, start, count)
  local finish
  if start then finish = select(2, period(start, s.calendar)) end
  if not start or now >= finish then
    start, finish = period(now, s.calendar)
    count = 0
  end
  s.start, s.count, s.finish = start, count, finish
end

quota.fields = fixed_window.fields

function quota.check(s, cost)
  return check_counter(s.limit, s.count, cost, s.finish - max(now, s.start))
end

function quota.reset(s)
  if s.count > 0 then return max(0, s.finish - now) end
  return 0
end

-- sliding_window: start (ms, of the current window), count (of the
-- current window), prev (the previous window's count).
local sliding_window = {
  kind = 4, format = '<Bi8i8i8i8', length = 33, params = window_params,
  spend = spend_count, force = force_count,
}

function sliding_window.meaning(s) return s.window end

function sliding_window.load(s, start, count, prev)
  local w = s.window
  if not start or now >= start + 2 * w then
    start, count, prev = align(now, w), 0, 0
  elseif now >= start + w then
    start, count, prev = start + w, 0, count
  end
  s.start, s.count, s.prev = start, count, prev
end

function sliding_window.fields(s) return s.start, s.count, s.prev end

function sliding_window.check(s, cost)
  return check_sliding(s.limit, s.window, s.count, s.prev, cost, max(now, s.start) - s.start)
end

function sliding_window.reset(s)
  local windows = 0
  if s.count > 0 then windows = 2 elseif s.prev > 0 then windows = 1 end
  return max(0, s.start + windows * s.window - now)
end

-- sliding_log: a sorted set. Its state: key, t (the instant of this
-- batch's entries), run (running total, with this batch's entries), base
-- (running total before the oldest entry inside the window), stored_run
-- (the newest stored entry's running total), first_rank and last_rank (of
-- the entries inside the window), newest (the stored newest entry's time)
-- and added (this batch's entries).
local sliding_log = { kind = 5, params = window_params }

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

-- Opens the log of key index k: its newest entry, the oldest inside the
-- window, and a bounded pruning of expired ones.
-- Drops what the key holds: now, or (when a peek opened it, which writes
-- nothing) before a decision of this call first writes the log.
local function discard(s)
  if reading then s.stale = true else call('UNLINK', s.key) end
end

function sliding_log.open(s, k)
  local key, w = keys[k], s.window
  s.key, s.window, s.t, s.run, s.base, s.stored_run = key, w, now, 0, 0, 0
  s.first_rank, s.last_rank = 0, -1
  s.added = {}
  -- MGET saw a string here: the limit used another algorithm before.
  if raw[k] then return discard(s) end
  local last = call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  local run, _, window = entry(last[1])
  if not run or window ~= w then
    -- Written under another window, or in an older format: afresh.
    return discard(s)
  end
  s.newest = tonumber(last[2])
  s.t = max(now, s.newest)
  s.run, s.base, s.stored_run = run, run, run
  local first = call('ZRANGEBYSCORE', key, '(' .. int(s.t - w), '+inf', 'LIMIT', 0, 1)
  if #first == 0 then
    -- Everything expired: the set goes as a whole.
    return discard(s)
  end
  local first_run, first_cost = entry(first[1])
  s.base = first_run - first_cost
  local rank = call('ZRANK', key, first[1])
  local removed = min(rank, PRUNE)
  if reading then removed = 0 end
  if removed > 0 then call('ZREMRANGEBYRANK', key, 0, removed - 1) end
  s.first_rank = rank - removed
  s.last_rank = call('ZCARD', key) - 1
end

function sliding_log.check(s, cost)
  local limit = s.limit
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
  return false, left, max(1, at + s.window - s.t)
end

function sliding_log.spend(s, cost)
  s.run = s.run + cost
  s.added[#s.added + 1] = pack(ENTRY, s.run, cost, s.window)
end

function sliding_log.force(s, cost, debt)
  local room = min(cost, max(0, s.limit + debt - (s.run - s.base)))
  if room > 0 then sliding_log.spend(s, room) end
  return cost - room
end

function sliding_log.reset(s)
  if s.run > s.base then
    -- The newest entry: of this batch, or the stored newest.
    local newest = s.t
    if #s.added == 0 then newest = s.newest or s.t end
    return max(0, newest + s.window - now)
  end
  return 0
end

-- Adds this batch's entries, all at one instant, and keeps the set while
-- it counts.
function sliding_log.write(s, ttl)
  if s.stale then
    call('UNLINK', s.key)
    s.stale = nil
  end
  if #s.added > 0 then
    local args = {}
    local at = int(s.t)
    for _, m in ipairs(s.added) do
      args[#args + 1] = at
      args[#args + 1] = m
    end
    call('ZADD', s.key, unpack(args))
  end
  if s.run > s.base then call('PEXPIRE', s.key, ttl) end
end

-- concurrency: a sorted set of holds, each member a request's hold (its
-- instance and request, HOLD bytes), scored by its expiry in ms. Its
-- state: key, limit, ttl, count (holds expiring after now, with this
-- call's), latest (the latest expiry), reclaimed (expired holds this call
-- dropped) and added (this call's holds: member -> expiry). Expired holds
-- are dropped a bounded number at a time and the live ones counted with
-- one ZCOUNT, so a decision reads O(log n) of the set however many holds
-- it keeps.
local concurrency = { kind = 7 }

function concurrency.params(s, a, b) s.limit, s.ttl = a, b end

-- State of another algorithm: dropped by a decision, left alone by a
-- release (a hold given back after a reload changed the limit's algorithm
-- has nothing left to release, and the new state is not its to clear).
local function foreign(s)
  if R.refund_at > 0 then s.foreign = true else discard(s) end
end

function concurrency.open(s, k)
  local key = keys[k]
  s.key, s.count, s.latest, s.reclaimed, s.added = key, 0, 0, 0, {}
  -- MGET saw a string here: the limit used another algorithm before.
  if raw[k] then return foreign(s) end
  local last = call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  -- A sliding log's entries: another algorithm's.
  if #last[1] ~= HOLD then return foreign(s) end
  s.latest = tonumber(last[2])
  -- Only a decision drops expired holds, and tells how many.
  local expired = call('ZCOUNT', key, '-inf', int(now))
  if expired > 0 and not reading and R.refund_at == 0 then
    local removed = min(expired, PRUNE)
    call('ZREMRANGEBYRANK', key, 0, removed - 1)
    s.reclaimed = removed
  end
  -- The live holds: all of them but the expired ones still kept.
  s.count = call('ZCARD', key) - (expired - s.reclaimed)
end

function concurrency.check(s, cost)
  return check_counter(s.limit, s.count, cost, HOLD_RETRY_MS)
end

-- Keeps hold m until hold_ttl_ms from now; `before`, its expiry until
-- then, when it was held.
local function hold(s, m, before)
  local expiry = now + s.ttl
  s.added[m] = expiry
  -- Brought forward (hold_ttl_ms is shorter since): the latest expiry may
  -- be earlier than `latest` says.
  if before and before > expiry then s.shrunk = true end
  s.latest = max(s.latest, expiry)
end

-- Takes a request's hold: a new member, never seen before.
function concurrency.spend(s, _, l)
  if not (l and l.member) then return end
  s.count = s.count + 1
  hold(s, l.member)
end

-- Renews a hold still held. One reclaimed meanwhile (expired) is not taken
-- again, though its request still runs: the bound holds, and that request
-- runs uncounted.
function concurrency.force(s, _, _, l)
  local m = l and l.member
  if not m then return 0 end
  local held = s.added[m]
  if not held and not s.stale then
    local stored = call('ZSCORE', s.key, m)
    stored = stored and tonumber(stored)
    held = stored and stored > now and stored
  end
  if held then hold(s, m, held) end
  return 0
end

function concurrency.reset(s)
  if s.shrunk then
    -- The latest of the holds this call took or renewed, and of the
    -- stored ones it did not (a renewed one's stored expiry is its old
    -- one): one of the n + 1 latest stored is not renewed, if any is.
    s.shrunk = nil
    local latest, n = 0, 0
    for _, expiry in pairs(s.added) do
      latest, n = max(latest, expiry), n + 1
    end
    if not s.stale then
      local top = call('ZREVRANGE', s.key, 0, n, 'WITHSCORES')
      for i = 1, #top, 2 do
        if not s.added[top[i]] then
          latest = max(latest, tonumber(top[i + 1]))
          break
        end
      end
    end
    s.latest = latest
  end
  return max(0, s.latest - now)
end

function concurrency.write(s, ttl)
  if s.foreign then return end
  if s.stale then
    call('UNLINK', s.key)
    s.stale = nil
  end
  local args = {}
  for m, expiry in pairs(s.added) do
    args[#args + 1] = int(expiry)
    args[#args + 1] = m
  end
  if #args > 0 then call('ZADD', s.key, unpack(args)) end
  call('PEXPIRE', s.key, ttl)
end

-- By the algorithm numbers src/limits/redis/codec.rs sends.
local ALGORITHMS = {
  token_bucket, gcra, fixed_window, sliding_window, sliding_log, quota, concurrency,
}

-- The request being decided, read from the call's bytes: its gate
-- (`blocked`), its refund time (0 to decide), its number of limits `n` and
-- its limits. A limit: its key's index, algorithm, two parameters as sent
-- (`a`, `b`: the algorithm names them on the key's state), cost, group (0
-- pre-auth, 1 the request), whether it is enforced or forced, the units
-- to take and the longest delay; then what it was judged: admitted, the
-- remaining units, the wait and the delay it is admitted after (0: none).
-- The records are made once and reused for every request (in a function
-- library, for every call): deciding allocates no table per limit.
R = { limits = {} }

-- Tables for string states, reused call after call, and how many this
-- call has taken.
local POOL, pooled = {}, 0

-- The state of limit l's key, loaded and refreshed on first use in the
-- call; every later use in the call sees the same table (refreshing again
-- at the same instant changes nothing), named by l's parameters.
-- Names l's parameters on its key's state (`sent` keeps them as sent, so
-- that the same numbers are not named again: the common case).
local function use(s, l)
  local a, b = l.a, l.b
  if s.sent_a ~= a or s.sent_b ~= b then
    s.sent_a, s.sent_b = a, b
    s.algo.params(s, a, b)
  end
end

local function state(l)
  local k = l.key
  local s = S[k]
  if s then
    use(s, l)
    return s
  end
  local algo = l.algo
  if algo.open then
    s = { algo = algo }
    S[k] = s
    use(s, l)
    algo.open(s, k)
    return s
  end
  -- A string state's table is one that calls before this one used (in a
  -- function library; a script's calls start with none), made over by
  -- `params` and `load`: making a table costs more than a decision.
  pooled = pooled + 1
  s = POOL[pooled]
  if s then
    s.algo, s.touched, s.unless_absent = algo, nil, nil
  else
    s = { algo = algo }
    POOL[pooled] = s
  end
  S[k] = s
  local a, b = l.a, l.b
  s.sent_a, s.sent_b = a, b
  algo.params(s, a, b)
  local v, x, y, z = raw[k]
  if v and #v == algo.length then
    local kind, meaning
    kind, meaning, x, y, z = unpack_(algo.format, v)
    if kind ~= algo.kind or meaning ~= algo.meaning(s) then x = nil end
  end
  algo.load(s, x, y, z)
  -- No state of this algorithm read: if the decision charges nothing,
  -- the key is left as it is (absent, it stays absent).
  s.fresh = x == nil
  return s
end

-- Reads the limit at `pos` of the packed requests into record l.
local function read_limit(requests, pos, l)
  local kind, byte
  l.key, kind, l.a, l.b, l.cost, byte, pos = unpack_('<I4Bi8i8i8B', requests, pos)
  local algo, flags = ALGORITHMS[kind], FLAGS[byte] or flags_of(byte)
  if not algo then error('tollgate: unknown algorithm ' .. tostring(kind)) end
  if not flags then error('tollgate: unknown flags ' .. tostring(byte)) end
  l.algo, l.group, l.enforced, l.forced = algo, flags.group, flags.enforced, flags.forced
  l.take, l.delay, l.debt, l.member = 0, 0, 0, nil
  if flags.takes then l.take, pos = unpack_('<i8', requests, pos) end
  if flags.delays then l.delay, pos = unpack_('<i8', requests, pos) end
  if flags.forced then l.debt, pos = unpack_('<i8', requests, pos) end
  if flags.holds then l.member, pos = unpack_('c16', requests, pos) end
  return pos
end

-- Reads the request at `pos` into R (a repeat leaves R as it is).
local function read_request(requests, pos, first)
  if byte(requests, pos) == SAME then
    if first then error('tollgate: a repeat with no request before it') end
    return pos + 1
  end
  R.blocked, R.n, R.refund_at, pos = unpack_('<BI2i8', requests, pos)
  local limits = R.limits
  for j = 1, R.n do
    local l = limits[j]
    if not l then
      l = {}
      limits[j] = l
    end
    pos = read_limit(requests, pos, l)
  end
  return pos
end

-- A limit's verdict, appended to the reply.
local VERDICT = '<i8i8i8i8i8'
local function answer(reply, s, admitted, remaining, wait, taken)
  reply[#reply + 1] = pack(VERDICT, admitted, remaining, wait, s.algo.reset(s), taken)
end

-- One write per key a decision or refund touched, with the state the whole
-- call left (keys only peeked at are left as they are).
local function write_back()
  -- (By index: KEYS are 1..#keys, and `pairs` is a call out of Lua per
  -- key.)
  for k = 1, #keys do
    local s = S[k]
    if s and (s.touched or (s.unless_absent and call('EXISTS', keys[k]) == 1)) then
      local algo = s.algo
      local ttl = algo.reset(s) + SLACK
      if ttl >= 1e14 then ttl = int(ttl) end
      if algo.write then
        algo.write(s, ttl)
      else
        call('SET', keys[k], pack(algo.format, algo.kind, algo.meaning(s), algo.fields(s)), 'PX', ttl)
      end
    end
  end
end

-- Whatever the concern, `now` and KEYS' values are set first; then
-- `handle(reply)` answers each request once read into R, and every key it
-- touched is written back once.
local function run(call_keys, args, handle)
  if not call then
    floor, max, min, ceil = math.floor, math.max, math.min, math.ceil
    pack, unpack_, call, byte = struct.pack, struct.unpack, redis.call, string.byte
  end
  keys, S, reading, pooled = call_keys, {}, false, 0
  now = tonumber(args[1])
  if now == 0 then
    local t = call('TIME')
    now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
  end
  -- A call for no requests (a connection warming up) reads nothing.
  raw = #keys > 0 and call('MGET', unpack(keys)) or {}
  local reply = {}
  local requests, pos = args[3], 1
  for i = 1, tonumber(args[2]) do
    pos = read_request(requests, pos, i == 1)
    handle(reply)
  end
  write_back()
  reply[#reply + 1] = pack('<i8', now)
  return table.concat(reply)
end

-- Each concern's file names its handler here; serve.lua makes them
-- functions or runs the script's own.
local HANDLERS = {}
