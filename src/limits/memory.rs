//! The in-process store: limit state in sharded hash maps, decided under
//! locks taken in shard order so that one request's charges are
//! all-or-nothing even when they span shards. Idle keys are swept once they
//! would be back to their initial state, which keeps the tables bounded by
//! the traffic of the last few refill periods.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;

use super::algorithm::{Check, Params, State};
use super::{Charge, Gate, LimitStore, RecordStore, StoreError, Verdict};
use crate::clock::{Clock, MonotonicClock};

const SHARDS: usize = 16;
/// Sweep a shard of expired keys every this many decisions on it.
const SWEEP_EVERY: u64 = 4096;
/// Keys outlive their return to the initial state by this much.
const EXPIRY_SLACK_MS: u64 = 1_000;

struct Slot {
    params: Params,
    state: State,
    expires_at: u64,
}

#[derive(Default)]
struct Shard {
    slots: HashMap<String, Slot, ahash::RandomState>,
    decisions: u64,
}

/// Limit state of this process.
pub struct MemoryStore<C: Clock = MonotonicClock> {
    shards: Vec<Mutex<Shard>>,
    hasher: ahash::RandomState,
    clock: C,
    keys: AtomicU64,
}

impl Default for MemoryStore<MonotonicClock> {
    fn default() -> Self {
        Self::new(MonotonicClock::new())
    }
}

impl<C: Clock> MemoryStore<C> {
    /// An empty store on `clock`.
    pub fn new(clock: C) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: Default::default(),
            clock,
            keys: AtomicU64::new(0),
        }
    }

    /// The store's clock, in ms.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Number of live keys (approximate between sweeps).
    pub fn len(&self) -> u64 {
        self.keys.load(Ordering::Relaxed)
    }

    /// Whether no key is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard_of(&self, key: &str) -> usize {
        (self.hasher.hash_one(key) as usize) % SHARDS
    }

    /// Decides one request's charges atomically (see [`LimitStore`]) and
    /// returns the verdicts with the time they were decided at, which a
    /// later [`MemoryStore::refund`] needs.
    pub fn decide_now<B: Borrow<Charge>>(
        &self,
        charges: &[B],
        blocked_from: Gate,
    ) -> (Vec<Verdict>, u64) {
        let now = self.clock.now_ms();
        let charges = || charges.iter().map(Borrow::borrow);
        let shard_ids: Vec<usize> = charges().map(|c| self.shard_of(&c.key)).collect();
        let mut guards = self.lock(&shard_ids);

        // Each charge's check, the delay it is admitted after (0: now) and
        // the expired holds it found.
        let mut checks = Vec::with_capacity(shard_ids.len());
        // The charges whose keys this decision made: dropped again unless
        // it charges them (empty, and so never allocated, for known keys).
        let mut made: Vec<usize> = Vec::new();
        for (i, (c, &s)) in charges().zip(&shard_ids).enumerate() {
            let (slot, new) = self.slot(locked(&mut guards, s), c, now);
            if new {
                made.push(i);
            }
            let reclaimed = c.params.reclaim(&mut slot.state, now);
            c.params.refresh(&mut slot.state, now);
            let (check, delay) = delayed(c, c.params.check(&slot.state, c.cost, now));
            checks.push((check, delay, reclaimed));
        }

        let admits = |i: usize| checks[i].0.allowed;
        let gate = super::gate(charges(), admits, blocked_from);
        let mut verdicts = Vec::with_capacity(shard_ids.len());
        let mut charged: Vec<&str> = Vec::new();
        for ((c, &s), &(check, delay_ms, reclaimed)) in charges().zip(&shard_ids).zip(&checks) {
            let slot = locked(&mut guards, s)
                .slots
                .get_mut(&c.key)
                .expect("the first pass made a slot for every charge");
            let spend = check.allowed && gate.admits(c.group);
            let (mut granted, mut uncharged) = (0, 0);
            match (c.hold, c.op.is_force()) {
                // A hold is taken when spent and renewed when forced.
                (Some(id), true) => {
                    c.params.renew(&mut slot.state, id, now);
                }
                (Some(id), false) if spend => c.params.hold(&mut slot.state, id, now),
                (None, true) => {
                    uncharged = c
                        .params
                        .force(&mut slot.state, c.cost, c.op.max_debt(), now);
                }
                (None, false) if spend => {
                    c.params.spend(&mut slot.state, c.cost, now);
                    granted = c.params.take(&mut slot.state, c.op.units(), now);
                }
                _ => {}
            }
            if !made.is_empty() && (spend || c.op.is_force()) {
                charged.push(&c.key);
            }
            let remaining = if c.op.is_force() {
                c.params.check(&slot.state, 0, now).remaining
            } else if spend || delay_ms > 0 {
                check.remaining - granted
            } else {
                // Admissible but not charged: what is left is untouched.
                check.remaining + if check.allowed { c.cost } else { 0 }
            };
            let reset_ms = c.params.reset_ms(&slot.state, now);
            slot.expires_at = now + reset_ms + EXPIRY_SLACK_MS;
            verdicts.push(
                Verdict::decided(check.allowed, remaining, check.wait_ms, reset_ms, now)
                    .with_granted(granted)
                    .with_delay(delay_ms)
                    .with_uncharged(uncharged)
                    .with_reclaimed(reclaimed),
            );
        }
        // A refused request leaves no key behind: the keys a client can
        // make are bounded by what it is admitted.
        for (i, c) in charges().enumerate().filter(|(i, _)| made.contains(i)) {
            if charged.contains(&c.key.as_str()) {
                continue;
            }
            if locked(&mut guards, shard_ids[i])
                .slots
                .remove(&c.key)
                .is_some()
            {
                self.keys.fetch_sub(1, Ordering::Relaxed);
            }
        }
        for (_, guard) in guards.iter_mut() {
            guard.decisions += 1;
            if guard.decisions % SWEEP_EVERY == 0 {
                self.sweep_shard(guard, now);
            }
        }
        (verdicts, now)
    }

    /// Gives back what [`MemoryStore::decide_now`] charged at `spent_at` for
    /// these charges (a later part of the same decision denied), and
    /// releases their holds.
    pub fn refund<B: Borrow<Charge>>(&self, charges: &[B], spent_at: u64) {
        let now = self.clock.now_ms();
        let charges = || charges.iter().map(Borrow::borrow);
        let shard_ids: Vec<usize> = charges().map(|c| self.shard_of(&c.key)).collect();
        let mut guards = self.lock(&shard_ids);
        for (c, &s) in charges().zip(&shard_ids) {
            if let Some(slot) = locked(&mut guards, s).slots.get_mut(&c.key) {
                match c.hold {
                    // Giving a hold back releases it.
                    Some(id) => {
                        c.params.release(&mut slot.state, id);
                    }
                    None => c.params.refund(&mut slot.state, c.cost, spent_at, now),
                }
            }
        }
    }

    /// Starts each charge's key afresh (an operator's reset).
    pub fn reset_now<B: Borrow<Charge>>(&self, charges: &[B]) {
        for c in charges.iter().map(Borrow::borrow) {
            self.shards[self.shard_of(&c.key)]
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .slots
                .remove(&c.key);
        }
    }

    /// Gives each charge's cost back to its key now (an operator's
    /// credit), as [`Params::credit`] says; what each holds after.
    pub fn credit_now<B: Borrow<Charge>>(&self, charges: &[B]) -> Vec<Verdict> {
        let now = self.clock.now_ms();
        for c in charges.iter().map(Borrow::borrow) {
            let mut shard = self.shards[self.shard_of(&c.key)]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(slot) = shard.slots.get_mut(&c.key) {
                c.params.refresh(&mut slot.state, now);
                c.params.credit(&mut slot.state, c.cost, now);
            }
        }
        let probes: Vec<Charge> = charges
            .iter()
            .map(|c| Charge {
                cost: 0,
                ..c.borrow().clone()
            })
            .collect();
        self.peek_now(&probes)
    }

    /// What each charge's limit holds now, as [`LimitStore::peek`] says:
    /// read from a copy of its state (or a fresh one), nothing written.
    pub fn peek_now<B: Borrow<Charge>>(&self, charges: &[B]) -> Vec<Verdict> {
        let now = self.clock.now_ms();
        charges
            .iter()
            .map(Borrow::borrow)
            .map(|c| {
                let shard = self.shards[self.shard_of(&c.key)]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                let mut state = match shard.slots.get(&c.key) {
                    Some(slot) => c.params.adopt(&slot.params, slot.state.clone(), now),
                    None => c.params.fresh(now),
                };
                drop(shard);
                c.params.refresh(&mut state, now);
                let check = c.params.check(&state, c.cost, now);
                // Left before the cost: an admitted check counted it out.
                let remaining = check.remaining + if check.allowed { c.cost } else { 0 };
                Verdict::decided(
                    check.allowed,
                    remaining,
                    check.wait_ms,
                    c.params.reset_ms(&state, now),
                    now,
                )
            })
            .collect()
    }

    /// Locks the given shards in ascending order: no two requests deadlock.
    fn lock(&self, shard_ids: &[usize]) -> Vec<(usize, MutexGuard<'_, Shard>)> {
        let mut order = shard_ids.to_vec();
        order.sort_unstable();
        order.dedup();
        order
            .into_iter()
            .map(|i| (i, self.shards[i].lock().unwrap_or_else(|e| e.into_inner())))
            .collect()
    }

    /// The slot of a charge's key, created fresh or adapted to new numbers.
    /// Also says whether the slot is new.
    fn slot<'a>(&self, shard: &'a mut Shard, c: &Charge, now: u64) -> (&'a mut Slot, bool) {
        // Look up before inserting: the key is copied only for a new slot.
        let new = !shard.slots.contains_key(&c.key);
        if new {
            self.keys.fetch_add(1, Ordering::Relaxed);
            let fresh = Slot {
                params: c.params,
                state: c.params.fresh(now),
                expires_at: 0,
            };
            shard.slots.insert(c.key.clone(), fresh);
        }
        let Some(slot) = shard.slots.get_mut(&c.key) else {
            unreachable!("the slot was just ensured")
        };
        if slot.params != c.params {
            // A reload or a plan changed the numbers: keep what still applies.
            let old = std::mem::replace(&mut slot.state, c.params.fresh(now));
            slot.state = c.params.adopt(&slot.params, old, now);
            slot.params = c.params;
        }
        (slot, new)
    }

    fn sweep_shard(&self, shard: &mut Shard, now: u64) {
        let before = shard.slots.len();
        shard.slots.retain(|_, slot| slot.expires_at > now);
        self.keys
            .fetch_sub((before - shard.slots.len()) as u64, Ordering::Relaxed);
    }

    /// Removes every expired key now (tests and memory benchmarks).
    pub fn sweep(&self) {
        let now = self.clock.now_ms();
        for shard in &self.shards {
            let mut guard = shard.lock().unwrap_or_else(|e| e.into_inner());
            self.sweep_shard(&mut guard, now);
        }
    }
}

/// A check as a charge with `max_delay_ms` reads it: a cost that fits
/// within the delay is admitted after it (charged now for that instant);
/// a forced charge always is. Returns the check and the delay.
fn delayed(c: &Charge, check: Check) -> (Check, u64) {
    if c.op.is_force() {
        return (
            Check {
                allowed: true,
                ..check
            },
            0,
        );
    }
    match check.wait_ms {
        Some(wait) if !check.allowed && c.op.max_delay_ms() > 0 && wait <= c.op.max_delay_ms() => (
            Check {
                allowed: true,
                remaining: 0,
                wait_ms: Some(0),
            },
            wait,
        ),
        _ => (check, 0),
    }
}

/// The locked shard `i` among the guards of one decision.
fn locked<'a>(guards: &'a mut [(usize, MutexGuard<'_, Shard>)], i: usize) -> &'a mut Shard {
    let at = guards
        .iter()
        .position(|(s, _)| *s == i)
        .expect("every shard of a decision is locked before it is used");
    &mut guards[at].1
}

/// The memory store keeps no records: on it, revocations and overrides
/// are this instance's alone, kept in memory by their owners.
impl<C: Clock> RecordStore for MemoryStore<C> {}

#[async_trait]
impl<C: Clock> LimitStore for MemoryStore<C> {
    async fn decide(
        &self,
        charges: &[&Charge],
        blocked_from: Gate,
    ) -> Result<Vec<Verdict>, StoreError> {
        Ok(self.decide_now(charges, blocked_from).0)
    }

    async fn give_back(&self, charges: &[&Charge], spent_at: u64) -> Result<(), StoreError> {
        self.refund(charges, spent_at);
        Ok(())
    }

    async fn peek(&self, charges: &[&Charge]) -> Result<Vec<Verdict>, StoreError> {
        Ok(self.peek_now(charges))
    }

    async fn reset(&self, charges: &[&Charge]) -> Result<(), StoreError> {
        self.reset_now(charges);
        Ok(())
    }

    async fn credit(&self, charges: &[&Charge]) -> Result<Vec<Verdict>, StoreError> {
        Ok(self.credit_now(charges))
    }
}

#[cfg(test)]
mod tests;
