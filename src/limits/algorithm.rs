//! The five rate-limit algorithms as pure integer maths over an explicit `now`.
//!
//! Every function takes the time in milliseconds and never reads a clock.
//! Token balances are integer micro-tokens (a token is 1 000 000 units) so
//! that one millisecond of refill at any rate with millitoken-per-second
//! precision is an exact integer: nothing drifts, nothing is lost to
//! rounding, and the Redis scripts can reproduce every step with the exact
//! integers a Lua double holds (below 2^53).
//!
//! A decision is three steps on one key's [`State`]: [`Params::refresh`]
//! (refill or roll the window; stored time never moves backwards),
//! [`Params::check`] (would a cost fit, without spending) and
//! [`Params::spend`]. The store runs the first two for every limit of a
//! request and the third only when all of them admit.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Micro-units per token.
pub const MICRO: u64 = 1_000_000;

/// Parameters of one limit, in the integer units the maths uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Params {
    /// A balance that refills continuously up to its capacity.
    TokenBucket(Bucket),
    /// The same budget kept as a theoretical arrival time (one number).
    Gcra(Bucket),
    /// A counter per aligned window.
    FixedWindow(Window),
    /// The current window's counter plus the previous one's, weighted by
    /// how much of it the rolling window still covers.
    SlidingWindow(Window),
    /// One entry per admission: exact over the rolling window.
    SlidingLog(Window),
    /// A count per calendar period (UTC), with no refill.
    Quota(Quota),
    /// Requests in flight: one hold per admitted request until it ends.
    Concurrency(Concurrency),
}

/// The bound and hold lifetime of a concurrency limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Concurrency {
    /// Holds at once.
    pub max_in_flight: u64,
    /// A hold not renewed within this many ms is reclaimed.
    pub hold_ttl_ms: u64,
}

/// One request's hold on a concurrency limit: unique across the fleet
/// (the instance's random prefix in the high 64 bits, its request count in
/// the low ones).
pub type HoldId = u128;

/// The holds of one concurrency key: each hold's expiry, kept both ways so
/// that a hold is found by id and the expired ones by time, each in
/// O(log n).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holds {
    expiry: BTreeMap<HoldId, u64>,
    by_expiry: BTreeSet<(u64, HoldId)>,
}

impl Holds {
    /// Holds kept (expired ones not yet removed included).
    pub fn len(&self) -> u64 {
        self.expiry.len() as u64
    }

    /// Whether no hold is kept.
    pub fn is_empty(&self) -> bool {
        self.expiry.is_empty()
    }

    /// Whether hold `id` is kept.
    pub fn contains(&self, id: HoldId) -> bool {
        self.expiry.contains_key(&id)
    }

    /// Keeps hold `id` until `until` (taken, or renewed).
    fn put(&mut self, id: HoldId, until: u64) {
        if let Some(old) = self.expiry.insert(id, until) {
            self.by_expiry.remove(&(old, id));
        }
        self.by_expiry.insert((until, id));
    }

    /// Drops hold `id`; whether it was kept.
    fn remove(&mut self, id: HoldId) -> bool {
        match self.expiry.remove(&id) {
            Some(until) => self.by_expiry.remove(&(until, id)),
            None => false,
        }
    }

    /// Drops the holds expired at `now` (expiry at or before it); how many.
    fn expire(&mut self, now: u64) -> u64 {
        let mut dropped = 0;
        while let Some(&(until, id)) = self.by_expiry.first() {
            if until > now {
                break;
            }
            self.by_expiry.pop_first();
            self.expiry.remove(&id);
            dropped += 1;
        }
        dropped
    }

    /// The latest expiry kept.
    fn latest(&self) -> Option<u64> {
        self.by_expiry.last().map(|&(until, _)| until)
    }
}

/// Limit and period of a calendar quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    /// Admitted cost per period.
    pub limit: u64,
    /// The calendar period.
    pub period: Period,
}

/// A calendar period, in UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Period {
    /// From midnight to midnight.
    Day,
    /// From the first of the month to the first of the next.
    Month,
}

const DAY_MS: u64 = 86_400_000;

impl Period {
    /// Its number in the Redis script (`b` of a quota).
    pub fn code(self) -> u64 {
        match self {
            Period::Day => 1,
            Period::Month => 2,
        }
    }

    /// The start and end (ms since the epoch) of the period holding `now`.
    pub fn bounds(self, now: u64) -> (u64, u64) {
        let day = now / DAY_MS;
        match self {
            Period::Day => (day * DAY_MS, (day + 1) * DAY_MS),
            Period::Month => {
                let (y, m, _) = civil_from_days(day as i64);
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                let start = days_from_civil(y, m, 1) as u64 * DAY_MS;
                (start, days_from_civil(ny, nm, 1) as u64 * DAY_MS)
            }
        }
    }

    /// The period holding `now` as text: `2026-12-01` or `2026-12`.
    pub fn name(self, now: u64) -> String {
        let (y, m, d) = civil_from_days((now / DAY_MS) as i64);
        match self {
            Period::Day => format!("{y:04}-{m:02}-{d:02}"),
            Period::Month => format!("{y:04}-{m:02}"),
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
/// `days_from_civil`); `lua/limits.lua` has the same.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01: (year, month, day).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Capacity and refill of a token bucket or GCRA limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bucket {
    /// Capacity in micro-tokens.
    pub capacity: u64,
    /// Refill in micro-tokens per millisecond (= millitokens per second).
    pub per_ms: u64,
}

impl Bucket {
    /// A bucket of whole tokens refilling whole tokens per second.
    pub fn per_second(capacity: u64, per_second: u64) -> Self {
        Self {
            capacity: capacity * MICRO,
            per_ms: per_second * 1000,
        }
    }

    fn share(self, n: u64) -> Self {
        Self {
            capacity: (self.capacity / n).max(MICRO),
            per_ms: (self.per_ms / n).max(1),
        }
    }
}

/// Limit and length of a window-based limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Window {
    /// Admitted cost per window.
    pub limit: u64,
    /// Window length in milliseconds.
    pub window_ms: u64,
}

impl Window {
    /// A window of whole seconds.
    pub fn seconds(limit: u64, seconds: u64) -> Self {
        Self {
            limit,
            window_ms: seconds * 1000,
        }
    }

    fn share(self, n: u64) -> Self {
        Self {
            limit: (self.limit / n).max(1),
            ..self
        }
    }
}

/// Per-key state. Each variant belongs to the algorithm of the same name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Balance in micro-tokens as of `at`.
    Bucket {
        /// Micro-tokens available; below zero in debt (a delayed admission,
        /// or a cost charged after the response), at most the capacity.
        balance: i64,
        /// When the balance was last brought up to date (ms).
        at: u64,
    },
    /// Theoretical arrival time: `tat + frac / per_ms` milliseconds.
    Gcra {
        /// Whole milliseconds of the theoretical arrival time.
        tat: u64,
        /// The micro-tokens of a partial millisecond beyond `tat`.
        frac: u64,
    },
    /// Cost admitted in the window starting at `start`.
    Window {
        /// The window's start (ms, aligned to its length).
        start: u64,
        /// Cost admitted in it.
        count: u64,
    },
    /// Counters of the window starting at `start` and of the one before it.
    Sliding {
        /// The current window's start (ms, aligned to its length).
        start: u64,
        /// Cost admitted in the current window.
        curr: u64,
        /// Cost admitted in the window before it.
        prev: u64,
    },
    /// The holds of a concurrency limit.
    Holds(Holds),
    /// Admitted `(time, cost)` entries inside the window, oldest first.
    Log {
        /// `(time, cost)` of each admission, oldest first.
        entries: VecDeque<(u64, u64)>,
        /// The sum of their costs.
        total: u64,
    },
}

/// What one limit says about one cost at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    /// Whether the cost fits.
    pub allowed: bool,
    /// Whole units left: after this cost when allowed, as of now otherwise.
    pub remaining: u64,
    /// Milliseconds until the cost could be admitted: `Some(0)` when allowed,
    /// `None` when it can never fit.
    pub wait_ms: Option<u64>,
}

impl Check {
    fn deny(remaining: u64, wait_ms: Option<u64>) -> Self {
        Self {
            allowed: false,
            remaining,
            wait_ms,
        }
    }
}

impl Params {
    /// The most a single request can ever cost under this limit.
    pub fn quota(&self) -> u64 {
        match self {
            Params::TokenBucket(b) | Params::Gcra(b) => b.capacity / MICRO,
            Params::FixedWindow(w) | Params::SlidingWindow(w) | Params::SlidingLog(w) => w.limit,
            Params::Quota(q) => q.limit,
            Params::Concurrency(c) => c.max_in_flight,
        }
    }

    /// Milliseconds a bucket takes to refill `units`; 0 for windows, whose
    /// wait already runs until a window frees its whole limit.
    pub fn refill_ms(&self, units: u64) -> u64 {
        match self {
            Params::TokenBucket(b) | Params::Gcra(b) => ceil_div(units * MICRO, b.per_ms),
            _ => 0,
        }
    }

    /// A window algorithm's window length; `None` for buckets.
    pub fn window_ms(&self) -> Option<u64> {
        match self {
            Params::FixedWindow(w) | Params::SlidingWindow(w) | Params::SlidingLog(w) => {
                Some(w.window_ms)
            }
            Params::TokenBucket(_)
            | Params::Gcra(_)
            | Params::Quota(_)
            | Params::Concurrency(_) => None,
        }
    }

    /// The period the quota refers to, in whole seconds (at least 1): the
    /// time a bucket takes to refill from empty, or the window length.
    pub fn period_secs(&self) -> u64 {
        match self {
            Params::TokenBucket(b) | Params::Gcra(b) => {
                ceil_div(b.capacity, b.per_ms).div_ceil(1000).max(1)
            }
            Params::FixedWindow(w) | Params::SlidingWindow(w) | Params::SlidingLog(w) => {
                w.window_ms.div_ceil(1000).max(1)
            }
            Params::Quota(q) => match q.period {
                Period::Day => 86_400,
                Period::Month => 30 * 86_400,
            },
            Params::Concurrency(c) => c.hold_ttl_ms.div_ceil(1000).max(1),
        }
    }

    /// Whether the limit counts requests in flight rather than a rate.
    pub fn is_concurrency(&self) -> bool {
        matches!(self, Params::Concurrency(_))
    }

    /// This instance's share of the budget when `instances` gateways each
    /// enforce it alone (the local fallback while the store is failing).
    /// Never less than one token, one request per window.
    pub fn share(&self, instances: u32) -> Params {
        let n = u64::from(instances.max(1));
        match *self {
            Params::TokenBucket(b) => Params::TokenBucket(b.share(n)),
            Params::Gcra(b) => Params::Gcra(b.share(n)),
            Params::FixedWindow(w) => Params::FixedWindow(w.share(n)),
            Params::SlidingWindow(w) => Params::SlidingWindow(w.share(n)),
            Params::SlidingLog(w) => Params::SlidingLog(w.share(n)),
            Params::Quota(q) => Params::Quota(Quota {
                limit: (q.limit / n).max(1),
                ..q
            }),
            Params::Concurrency(c) => Params::Concurrency(Concurrency {
                max_in_flight: (c.max_in_flight / n).max(1),
                ..c
            }),
        }
    }

    /// A key that was never seen (or has expired): buckets full, windows empty.
    pub fn fresh(&self, now: u64) -> State {
        match self {
            Params::TokenBucket(b) => State::Bucket {
                balance: b.capacity as i64,
                at: now,
            },
            Params::Gcra(_) => State::Gcra { tat: now, frac: 0 },
            Params::FixedWindow(w) => State::Window {
                start: align(now, w.window_ms),
                count: 0,
            },
            Params::SlidingWindow(w) => State::Sliding {
                start: align(now, w.window_ms),
                curr: 0,
                prev: 0,
            },
            Params::SlidingLog(_) => State::Log {
                entries: VecDeque::new(),
                total: 0,
            },
            Params::Quota(q) => State::Window {
                start: q.period.bounds(now).0,
                count: 0,
            },
            Params::Concurrency(_) => State::Holds(Holds::default()),
        }
    }

    /// The number that gives this algorithm's state its meaning, beside
    /// the algorithm itself: a GCRA's rate (its schedule is kept in time at
    /// that rate), a window's length (its counts belong to windows of that
    /// length). A bucket's balance means the same at any capacity or rate.
    /// The Redis script records it in each key's state, as the algorithm.
    pub fn meaning(&self) -> u64 {
        match self {
            Params::TokenBucket(_) => 0,
            Params::Gcra(b) => b.per_ms,
            Params::FixedWindow(w) | Params::SlidingWindow(w) | Params::SlidingLog(w) => {
                w.window_ms
            }
            Params::Quota(q) => q.period.code(),
            Params::Concurrency(_) => 0,
        }
    }

    /// Whether state written under `other` means the same under `self`:
    /// the same algorithm and the same [`Params::meaning`].
    pub fn same_meaning(&self, other: &Params) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
            && self.meaning() == other.meaning()
    }

    /// Makes a state written under `old` usable with these parameters: kept
    /// when it means the same (a bucket is clamped to a smaller capacity),
    /// fresh otherwise, exactly as the Redis script does. Used when a reload
    /// or a plan changes a limit's numbers.
    pub fn adopt(&self, old: &Params, state: State, now: u64) -> State {
        if !self.same_meaning(old) {
            return self.fresh(now);
        }
        match (self, state) {
            (Params::TokenBucket(b), State::Bucket { balance, at }) => State::Bucket {
                balance: balance.min(b.capacity as i64),
                at,
            },
            (_, state) => state,
        }
    }

    /// Brings a state up to `now`: refills buckets, rolls windows, drops
    /// expired log entries. A `now` earlier than the stored time is treated
    /// as the stored time, so a clock stepping back never mints capacity.
    pub fn refresh(&self, state: &mut State, now: u64) {
        match (self, state) {
            (Params::TokenBucket(b), State::Bucket { balance, at }) => {
                let now = now.max(*at);
                let refill = (now - *at).saturating_mul(b.per_ms).min(i64::MAX as u64) as i64;
                *balance = balance.saturating_add(refill).min(b.capacity as i64);
                *at = now;
            }
            (Params::Gcra(_), State::Gcra { tat, frac }) => {
                if *tat < now {
                    *tat = now;
                    *frac = 0;
                }
            }
            (Params::FixedWindow(w), State::Window { start, count }) => {
                if now >= *start + w.window_ms {
                    *start = align(now, w.window_ms);
                    *count = 0;
                }
            }
            (Params::Quota(q), State::Window { start, count }) => {
                if now >= q.period.bounds(*start).1 {
                    *start = q.period.bounds(now).0;
                    *count = 0;
                }
            }
            (Params::SlidingWindow(w), State::Sliding { start, curr, prev }) => {
                if now >= *start + 2 * w.window_ms {
                    *start = align(now, w.window_ms);
                    (*prev, *curr) = (0, 0);
                } else if now >= *start + w.window_ms {
                    *start += w.window_ms;
                    (*prev, *curr) = (*curr, 0);
                }
            }
            (Params::Concurrency(_), State::Holds(holds)) => {
                holds.expire(now);
            }
            (Params::SlidingLog(w), State::Log { entries, total }) => {
                let now = log_now(entries, now);
                while let Some(&(at, cost)) = entries.front() {
                    if at + w.window_ms > now {
                        break;
                    }
                    entries.pop_front();
                    *total -= cost;
                }
            }
            (params, state) => *state = params.fresh(now),
        }
    }

    /// Whether `cost` fits now. The state must have been refreshed to `now`.
    pub fn check(&self, state: &State, cost: u64, now: u64) -> Check {
        match (self, state) {
            (Params::TokenBucket(b), State::Bucket { balance, .. }) => {
                check_bucket(b, *balance, cost)
            }
            (Params::Gcra(b), State::Gcra { tat, frac }) => check_bucket(
                b,
                b.capacity as i64 - gcra_debt(b, *tat, *frac, now) as i64,
                cost,
            ),
            (Params::FixedWindow(w), State::Window { start, count }) => check_counter(
                w.limit,
                *count,
                cost,
                *start + w.window_ms - now.max(*start),
            ),
            (Params::Quota(q), State::Window { start, count }) => {
                let end = q.period.bounds(*start).1;
                check_counter(q.limit, *count, cost, end - now.max(*start))
            }
            (Params::SlidingWindow(w), State::Sliding { start, curr, prev }) => {
                check_sliding(w, *curr, *prev, cost, now.max(*start) - *start)
            }
            (Params::SlidingLog(w), State::Log { entries, total }) => {
                check_log(w, entries, *total, cost, log_now(entries, now))
            }
            (Params::Concurrency(c), State::Holds(holds)) => {
                check_counter(c.max_in_flight, holds.len(), cost, HOLD_RETRY_MS)
            }
            (params, _) => params.check(&params.fresh(now), cost, now),
        }
    }

    /// Charges `cost`. Only called after [`Params::check`] allowed it.
    pub fn spend(&self, state: &mut State, cost: u64, now: u64) {
        match (self, state) {
            (Params::TokenBucket(_), State::Bucket { balance, .. }) => {
                *balance -= (cost * MICRO) as i64;
            }
            (Params::Gcra(b), State::Gcra { tat, frac }) => {
                let owed = *frac + cost * MICRO;
                *tat += owed / b.per_ms;
                *frac = owed % b.per_ms;
            }
            (Params::FixedWindow(_) | Params::Quota(_), State::Window { count, .. })
            | (Params::SlidingWindow(_), State::Sliding { curr: count, .. }) => *count += cost,
            (Params::SlidingLog(_), State::Log { entries, total }) => {
                entries.push_back((log_now(entries, now), cost));
                *total += cost;
            }
            _ => {}
        }
    }

    /// Charges `cost` whatever the state, into debt of at most `max_debt`
    /// units (a balance that far below empty, a count that far above its
    /// limit): a cost learnt after the response, which later requests then
    /// wait for. Returns the units that did not fit above that floor,
    /// which are not charged.
    pub fn force(&self, state: &mut State, cost: u64, max_debt: u64, now: u64) -> u64 {
        if let (Params::SlidingLog(w), State::Log { total, .. }) = (self, &*state) {
            let room = (w.limit + max_debt).saturating_sub(*total).min(cost);
            if room > 0 {
                self.spend(state, room, now);
            }
            return cost - room;
        }
        match (self, state) {
            // Deeper than the floor already (a delay schedules further
            // ahead): left as it is, never lifted.
            (Params::TokenBucket(_), State::Bucket { balance, .. }) => {
                let floor = -((max_debt * MICRO) as i64);
                let before = *balance;
                *balance = before.min((before - (cost * MICRO) as i64).max(floor));
                uncharged_micro(cost, (before - *balance) as u64)
            }
            (Params::Gcra(b), State::Gcra { tat, frac }) => {
                let owed = gcra_debt(b, *tat, *frac, now);
                let charged = (owed + cost * MICRO).min(b.capacity + max_debt * MICRO);
                if charged > owed {
                    *tat = now + charged / b.per_ms;
                    *frac = charged % b.per_ms;
                }
                uncharged_micro(cost, charged.saturating_sub(owed))
            }
            (Params::FixedWindow(Window { limit, .. }), State::Window { count, .. })
            | (Params::Quota(Quota { limit, .. }), State::Window { count, .. })
            | (Params::SlidingWindow(Window { limit, .. }), State::Sliding { curr: count, .. }) => {
                let before = *count;
                *count = before.max((before + cost).min(limit + max_debt));
                cost - (*count - before)
            }
            _ => cost,
        }
    }

    /// Spends up to `want` more units, as many as fit now, and returns how
    /// many: a lease's top-up after its request's own cost was spent. A
    /// sliding log grants nothing (each entry is an admission's time).
    pub fn take(&self, state: &mut State, want: u64, now: u64) -> u64 {
        if want == 0 || matches!(self, Params::SlidingLog(_) | Params::Concurrency(_)) {
            return 0;
        }
        let granted = want.min(self.check(state, 0, now).remaining);
        if granted > 0 {
            self.spend(state, granted, now);
        }
        granted
    }

    /// Gives back `cost` charged at `spent_at` by a decision that was then
    /// undone (another part of the same all-or-nothing decision denied).
    /// Nothing grows beyond its initial state; a window that has rolled
    /// since the charge is left alone.
    pub fn refund(&self, state: &mut State, cost: u64, spent_at: u64, now: u64) {
        self.refresh(state, now);
        match (self, state) {
            (Params::TokenBucket(b), State::Bucket { balance, .. }) => {
                *balance = (*balance + (cost * MICRO) as i64).min(b.capacity as i64);
            }
            (Params::Gcra(b), State::Gcra { tat, frac }) => {
                let debt = gcra_debt(b, *tat, *frac, now).saturating_sub(cost * MICRO);
                *tat = now + debt / b.per_ms;
                *frac = debt % b.per_ms;
            }
            (Params::FixedWindow(w), State::Window { start, count })
                if (*start..*start + w.window_ms).contains(&spent_at) =>
            {
                *count = count.saturating_sub(cost);
            }
            (Params::Quota(q), State::Window { start, count })
                if (*start..q.period.bounds(*start).1).contains(&spent_at) =>
            {
                *count = count.saturating_sub(cost);
            }
            (Params::SlidingWindow(w), State::Sliding { start, curr, prev }) => {
                if spent_at >= *start {
                    *curr = curr.saturating_sub(cost);
                } else if spent_at + w.window_ms >= *start {
                    *prev = prev.saturating_sub(cost);
                }
            }
            (Params::SlidingLog(_), State::Log { entries, total }) => {
                if let Some(i) = entries.iter().rposition(|&e| e == (spent_at, cost)) {
                    entries.remove(i);
                    *total -= cost;
                }
            }
            _ => {}
        }
    }

    /// Gives `units` back now, capped at the limit's initial state (an
    /// operator's credit): a bucket refills, a window's or quota's count
    /// goes down, a sliding log drops its newest entries while their costs
    /// fit in `units`.
    pub fn credit(&self, state: &mut State, units: u64, now: u64) {
        if let State::Log { entries, total } = state {
            let mut left = units;
            while let Some(&(_, cost)) = entries.back().filter(|&&(_, c)| c <= left) {
                entries.pop_back();
                *total -= cost;
                left -= cost;
            }
            return;
        }
        self.refund(state, units, now, now);
    }

    /// Milliseconds until the state is back to [`Params::fresh`] if left alone.
    pub fn reset_ms(&self, state: &State, now: u64) -> u64 {
        match (self, state) {
            (Params::TokenBucket(b), State::Bucket { balance, .. }) => {
                ceil_div((b.capacity as i64 - balance) as u64, b.per_ms)
            }
            (Params::Gcra(b), State::Gcra { tat, frac }) => {
                ceil_div(gcra_debt(b, *tat, *frac, now), b.per_ms)
            }
            (Params::FixedWindow(w), State::Window { start, count }) if *count > 0 => {
                (*start + w.window_ms).saturating_sub(now)
            }
            (Params::Quota(q), State::Window { start, count }) if *count > 0 => {
                q.period.bounds(*start).1.saturating_sub(now)
            }
            (Params::SlidingWindow(w), State::Sliding { start, curr, prev }) => {
                let windows = if *curr > 0 { 2 } else { u64::from(*prev > 0) };
                (*start + windows * w.window_ms).saturating_sub(now)
            }
            (Params::SlidingLog(w), State::Log { entries, .. }) => entries
                .back()
                .map_or(0, |&(at, _)| (at + w.window_ms).saturating_sub(now)),
            (Params::Concurrency(_), State::Holds(holds)) => {
                holds.latest().map_or(0, |until| until.saturating_sub(now))
            }
            _ => 0,
        }
    }

    /// Takes hold `id` of a concurrency limit until `hold_ttl_ms` from
    /// `now`. Other algorithms have no holds.
    pub fn hold(&self, state: &mut State, id: HoldId, now: u64) {
        if let (Params::Concurrency(c), State::Holds(holds)) = (self, state) {
            holds.put(id, now + c.hold_ttl_ms);
        }
    }

    /// Keeps hold `id` until `hold_ttl_ms` from `now` if it is still held
    /// (the state refreshed to `now`). A hold reclaimed meanwhile is not
    /// taken again, even though its request still runs: the bound holds,
    /// and that request runs uncounted. Whether it was held.
    pub fn renew(&self, state: &mut State, id: HoldId, now: u64) -> bool {
        match (self, state) {
            (Params::Concurrency(c), State::Holds(holds)) if holds.contains(id) => {
                holds.put(id, now + c.hold_ttl_ms);
                true
            }
            _ => false,
        }
    }

    /// Releases hold `id`; whether it was kept.
    pub fn release(&self, state: &mut State, id: HoldId) -> bool {
        match state {
            State::Holds(holds) => holds.remove(id),
            _ => false,
        }
    }

    /// Drops the holds of a concurrency limit that expired unrenewed by
    /// `now` (their instance died, or could not reach the store): how
    /// many. [`Params::refresh`] drops them too, uncounted.
    pub fn reclaim(&self, state: &mut State, now: u64) -> u64 {
        match (self, state) {
            (Params::Concurrency(_), State::Holds(holds)) => holds.expire(now),
            _ => 0,
        }
    }
}

/// The wait a full concurrency limit answers: a hold is released when a
/// request ends, which no clock foretells, so a second (`Retry-After: 1`).
pub const HOLD_RETRY_MS: u64 = 1000;

/// The check of a bucket holding `balance` micro-tokens (below zero in
/// debt): a GCRA's as well, its balance being the capacity less its debt.
fn check_bucket(b: &Bucket, balance: i64, cost: u64) -> Check {
    let need = cost.saturating_mul(MICRO);
    let left = balance.max(0) as u64 / MICRO;
    if need > b.capacity {
        return Check::deny(left, None);
    }
    let need = need as i64;
    if balance >= need {
        return Check {
            allowed: true,
            remaining: (balance - need) as u64 / MICRO,
            wait_ms: Some(0),
        };
    }
    Check::deny(left, Some(ceil_div((need - balance) as u64, b.per_ms)))
}

/// Whole units of a forced `cost` not charged when `charged` micro-units
/// were (a part of a unit not charged counts as one).
fn uncharged_micro(cost: u64, charged: u64) -> u64 {
    (cost * MICRO).saturating_sub(charged).div_ceil(MICRO)
}

/// How far a GCRA schedule runs ahead of `now`, in micro-tokens.
fn gcra_debt(b: &Bucket, tat: u64, frac: u64, now: u64) -> u64 {
    tat.saturating_sub(now)
        .saturating_mul(b.per_ms)
        .saturating_add(frac)
}

fn check_counter(limit: u64, count: u64, cost: u64, until_next_ms: u64) -> Check {
    let left = limit.saturating_sub(count);
    if cost > limit {
        return Check::deny(left, None);
    }
    if cost <= left {
        return Check {
            allowed: true,
            remaining: left - cost,
            wait_ms: Some(0),
        };
    }
    Check::deny(left, Some(until_next_ms))
}

/// Sliding-window counter: the previous window weighs by how much of it the
/// rolling window still covers. Compared multiplied out by the window length
/// so that everything stays an exact integer.
fn check_sliding(w: &Window, curr: u64, prev: u64, cost: u64, elapsed: u64) -> Check {
    let len = w.window_ms;
    let used = prev * (len - elapsed) + curr * len;
    let budget = w.limit * len;
    let left = budget.saturating_sub(used) / len;
    if cost > w.limit {
        return Check::deny(left, None);
    }
    if used + cost * len <= budget {
        return Check {
            allowed: true,
            remaining: (budget - used - cost * len) / len,
            wait_ms: Some(0),
        };
    }
    let to_roll = len - elapsed;
    let wait = if curr + cost <= w.limit {
        // Wait for the previous window's weight to fall far enough.
        let room = (w.limit - curr - cost) * len;
        to_roll.saturating_sub(room / prev)
    } else {
        // After the roll the current count becomes the weighted one.
        to_roll + len.saturating_sub((w.limit - cost) * len / curr)
    };
    Check::deny(left, Some(wait.max(1)))
}

fn check_log(w: &Window, entries: &VecDeque<(u64, u64)>, total: u64, cost: u64, now: u64) -> Check {
    let left = w.limit.saturating_sub(total);
    if cost > w.limit {
        return Check::deny(left, None);
    }
    if cost <= left {
        return Check {
            allowed: true,
            remaining: left - cost,
            wait_ms: Some(0),
        };
    }
    // The oldest entries leave the window first; find the one whose leaving
    // makes room.
    let mut still = total;
    for &(at, c) in entries {
        still -= c;
        if still + cost <= w.limit {
            return Check::deny(left, Some((at + w.window_ms).saturating_sub(now).max(1)));
        }
    }
    Check::deny(left, Some(w.window_ms))
}

/// A log's clock: never earlier than its newest entry.
fn log_now(entries: &VecDeque<(u64, u64)>, now: u64) -> u64 {
    entries.back().map_or(now, |&(at, _)| now.max(at))
}

fn align(now: u64, window_ms: u64) -> u64 {
    now - now % window_ms
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

#[cfg(test)]
mod tests;
