-- inspect.lua: what operators ask of the shared limits (/admin/explain,
-- resets and credits), never the request path. Follows limits.lua and
-- settle.lua, whose refunds give a credit back where an algorithm has no
-- credit of its own.
--
-- A peek reads each limit as a decision would, charges nothing and writes
-- no state (a sliding log may still drop entries that have expired):
-- admitted when its cost fits, the whole units left before it, the wait
-- until it fits. A reset starts each limit's key afresh; a credit gives its
-- cost back now, capped at the initial state (a sliding log drops its
-- newest entries while their costs fit); both answer what is left after.
-- For operators, never on the request path.

-- Drops the newest entries, this call's first, while their costs fit in
-- `units`.
function sliding_log.credit(s, units)
  local left = units
  while #s.added > 0 do
    local _, cost = unpack_(ENTRY, s.added[#s.added])
    if cost > left then return end
    s.added[#s.added] = nil
    s.run, left = s.run - cost, left - cost
  end
  while not s.stale and s.last_rank >= s.first_rank do
    local last = call('ZRANGE', s.key, -1, -1)
    local run, cost = entry(last[1])
    if not run or run <= s.base or cost > left then break end
    call('ZREM', s.key, last[1])
    s.run, s.stored_run, s.last_rank = s.run - cost, s.stored_run - cost, s.last_rank - 1
    left = left - cost
  end
  if not s.stale then
    local newest = call('ZRANGE', s.key, -1, -1, 'WITHSCORES')
    s.newest = tonumber(newest[2])
  end
end

-- Empties the log.
function sliding_log.clear(s)
  call('DEL', s.key)
  s.stale = nil
  s.run, s.base, s.stored_run, s.first_rank, s.last_rank = 0, 0, 0, 0, -1
  s.added, s.newest, s.t = {}, nil, now
end

-- An operator's credit has no unit to give: holds go when requests end.
function concurrency.credit() end

function concurrency.clear(s)
  call('DEL', s.key)
  s.stale = nil
  s.count, s.latest, s.reclaimed, s.added = 0, 0, 0, {}
end

-- Reads R's limits without charging or writing: each one's check of its
-- cost, with the units left before it.
local function peek_request(reply)
  local limits = R.limits
  for j = 1, R.n do
    local l = limits[j]
    reading = true
    local s = state(l)
    reading = false
    local ok, remaining, wait = s.algo.check(s, l.cost)
    if ok then remaining = remaining + l.cost end
    answer(reply, s, ok and 1 or 0, remaining, wait, 0)
  end
end

-- Starts each of R's limits' keys afresh (`fresh`), or gives each its
-- cost back now; answers what each holds then.
local function reset_or_credit(reply, fresh)
  local limits = R.limits
  for j = 1, R.n do
    local l = limits[j]
    local s = state(l)
    local algo = s.algo
    s.touched = true
    if fresh then
      if algo.clear then algo.clear(s) else algo.load(s) end
    elseif algo.credit then
      algo.credit(s, l.cost)
    else
      algo.refund(s, l.cost, now)
    end
    local _, remaining = algo.check(s, 0)
    answer(reply, s, 1, remaining, 0, 0)
  end
end

-- Peeks (-1), resets (-2) and credits (-3), as the request's refund field
-- says.
HANDLERS.inspect = function(reply)
  local mode = R.refund_at
  if mode == -1 then
    peek_request(reply)
  elseif mode == -2 then
    reset_or_credit(reply, true)
  elseif mode == -3 then
    reset_or_credit(reply, false)
  else
    error('inspect.lua: unknown mode ' .. tostring(mode))
  end
end
