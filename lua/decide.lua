-- decide.lua: all-or-nothing decisions over the shared limits of a batch
-- of requests, in one call: the request path. Follows limits.lua, which
-- reads the requests and holds the algorithms.
--
-- Group g of a request is charged only if every enforced limit of its
-- groups 0..g admits and g is below `blocked`; shadow limits are charged
-- when they admit and their group is charged. Refreshed state is written
-- back whatever the outcome, except a key that held nothing and was not
-- charged: a refused request creates no state, so the keys a client can
-- make are bounded by what it is admitted. Keys expire one second after
-- they would be back to their initial state.
--
-- A forced charge (a cost learnt after the response) is charged whatever
-- the state, into debt of at most `debt` units (a balance that far below
-- empty, a count that far above its limit), and gates nothing; what would
-- go deeper is not charged, and its reply's fifth number says how much.

-- Spends up to `want` more units of a spent limit, as many as fit now;
-- returns how many.
local function take(s, want)
  if want <= 0 or s.algo == sliding_log or s.algo == concurrency then return 0 end
  local _, remaining = s.algo.check(s, 0)
  local granted = min(want, remaining)
  if granted > 0 then s.algo.spend(s, granted) end
  return granted
end

-- Decides R: every limit is checked, then the groups every enforced limit
-- admits (below the request's gate) are charged.
local function decide_request(reply)
  if R.refund_at ~= 0 then error('decide.lua: a request that decides nothing') end
  local limits, stop = R.limits, R.blocked
  for j = 1, R.n do
    local l = limits[j]
    -- (A key already loaded under the same numbers, the common case,
    -- without a call.)
    local s = S[l.key]
    if not s or s.sent_a ~= l.a or s.sent_b ~= l.b then s = state(l) end
    -- A key read with nothing in it is written only if charged, or if it
    -- held another algorithm's state (which the write replaces).
    if s.fresh then s.unless_absent = true else s.touched = true end
    local ok, remaining, wait = s.algo.check(s, l.cost)
    -- A forced charge is admitted; a cost that fits within the limit's
    -- longest delay is admitted after that wait.
    local delayed = 0
    if l.forced then
      ok = true
    elseif not ok and l.delay > 0 and wait >= 0 and wait <= l.delay then
      ok, remaining, wait, delayed = true, 0, 0, wait
    end
    l.state, l.ok, l.remaining, l.wait, l.delayed = s, ok, remaining, wait, delayed
    if l.enforced and not ok and l.group < stop then stop = l.group end
  end
  for j = 1, R.n do
    local l = limits[j]
    local s = l.state
    local algo = s.algo
    -- The parameters this limit sent (another limit of the request may
    -- share its key).
    if s.sent_a ~= l.a or s.sent_b ~= l.b then use(s, l) end
    local remaining, taken = l.remaining, 0
    if l.forced then
      -- The fifth number of a forced charge's reply: units not charged.
      s.touched = true
      taken = algo.force(s, l.cost, l.debt, l)
      remaining = select(2, algo.check(s, 0))
    elseif l.ok and l.group < stop then
      s.touched = true
      algo.spend(s, l.cost, l)
      if l.take > 0 then
        taken = take(s, l.take)
        remaining = remaining - taken
      end
    elseif l.ok and l.delayed == 0 then
      -- Admitted, but its group is not charged: nothing was spent.
      remaining = remaining + l.cost
    end
    if l.member then
      -- A hold's fifth number: the expired holds its key's opening
      -- dropped, told once per call.
      taken, s.reclaimed = s.reclaimed, 0
    end
    -- (`answer`, written out: this is the one path of every request.)
    local admitted, wait = 0, l.wait
    if l.delayed > 0 then
      admitted, wait = 2, l.delayed
    elseif l.ok then
      admitted = 1
    end
    reply[#reply + 1] = pack(VERDICT, admitted, remaining, wait, algo.reset(s), taken)
  end
end

HANDLERS.decide = decide_request
