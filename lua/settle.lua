-- settle.lua: gives back what decisions spent, and nothing else: a
-- lease's unused units, the part of a cost settled lower after the
-- response, a cluster slot's part of a decision another slot denied, a
-- request's hold when it ends. Follows limits.lua.
--
-- A refund gives each charge's cost back to its state as the in-process
-- store does (never beyond the initial state; a window that has rolled
-- since is left alone), spends nothing, and answers each charge's check
-- after it.
--
-- Each algorithm's refund(s, cost, at, l).

function token_bucket.refund(s, cost)
  s.balance = min(s.capacity, s.balance + cost * MICRO)
end

function gcra.refund(s, cost) owe(s, max(0, owed(s) - cost * MICRO)) end

function fixed_window.refund(s, cost, at)
  if at >= s.start and at < s.start + s.window then s.count = max(0, s.count - cost) end
end

function quota.refund(s, cost, at)
  if at >= s.start and at < s.finish then s.count = max(0, s.count - cost) end
end

function sliding_window.refund(s, cost, at)
  if at >= s.start then
    s.count = max(0, s.count - cost)
  elseif at + s.window >= s.start then
    s.prev = max(0, s.prev - cost)
  end
end

-- Gives back the newest entry admitted at `at` for `cost`; the running
-- totals after it come down by its cost.
function sliding_log.refund(s, cost, at)
  local score = int(at)
  local found, found_run
  for _, m in ipairs(call('ZRANGEBYSCORE', s.key, score, score)) do
    local run, c = entry(m)
    if run and c == cost and run > s.base and (not found_run or run > found_run) then
      found, found_run = m, run
    end
  end
  if not found then return end
  -- The entries after it: those admitted since `at`, a handful.
  local later = call('ZRANGEBYSCORE', s.key, score, '+inf', 'WITHSCORES')
  call('ZREM', s.key, found)
  for i = 1, #later, 2 do
    local run, c, w = entry(later[i])
    if run and run > found_run then
      call('ZREM', s.key, later[i])
      call('ZADD', s.key, later[i + 1], pack(ENTRY, run - cost, c, w))
    end
  end
  s.run, s.stored_run, s.last_rank = s.run - cost, s.stored_run - cost, s.last_rank - 1
  local last = call('ZRANGE', s.key, -1, -1, 'WITHSCORES')
  s.newest = tonumber(last[2])
end

-- Releases the hold of l (a charge given back).
function concurrency.refund(s, _, _, l)
  local m = l and l.member
  if not m or s.foreign then return end
  local added = s.added[m]
  s.added[m] = nil
  -- (A release's answer is not read: the count may take an expired hold
  -- for a live one.)
  local removed = not s.stale and call('ZREM', s.key, m) == 1
  if added or removed then s.count = s.count - 1 end
  if not (added or removed) then return end
  -- The latest expiry, now that this hold's may have been it.
  s.latest = 0
  if not s.stale then
    local last = call('ZRANGE', s.key, -1, -1, 'WITHSCORES')
    if #last > 0 then s.latest = tonumber(last[2]) end
  end
  for _, expiry in pairs(s.added) do s.latest = max(s.latest, expiry) end
end

-- Gives back R's charges spent at its refund time, and answers each one's
-- check after it.
local function refund_request(reply)
  if R.refund_at <= 0 then error('settle.lua: a request that gives nothing back') end
  local limits = R.limits
  for j = 1, R.n do
    local l = limits[j]
    local s = state(l)
    s.touched = true
    s.algo.refund(s, l.cost, R.refund_at, l)
    local ok, remaining, wait = s.algo.check(s, l.cost)
    answer(reply, s, ok and 1 or 0, remaining, wait, 0)
  end
end

HANDLERS.settle = refund_request
