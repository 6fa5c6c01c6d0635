//! Leased budgets (`sync: lease`): a hot key decided in this process
//! against units taken ahead of time from the shared budget.
//!
//! An instance takes up to `units` of a key's budget in one store call (the
//! request's own all-or-nothing call when it holds too little, or a
//! background renewal once half is spent) and admits against what it holds
//! with no store call at all. What it has not spent goes back when `ttl_ms`
//! has passed since its last take, when the policy reloads and when the
//! process shuts down.
//!
//! Admissions never exceed what was taken, and what was taken never
//! exceeded the budget, so a leased limit is never over-spent. The price is
//! under-use: units held unspent, at most the lease's size per key and
//! instance, since a take never asks for more than brings the held and
//! asked-for units to that size.
//!
//! The size starts at `units`. When half a lease is spent within half its
//! `ttl_ms`, demand is steady and the next take asks for twice as much, up
//! to `max_units`; when the store refuses, or a take empties the shared
//! budget, it is back to `units`. So calls per request fall towards
//! 2 / `max_units` for a key in steady demand, and a contended key is
//! shared in small leases; the under-use bound is instances ×
//! `max_units`.
//!
//! A window's units count in the window the store charged them to, so a
//! window lease also ends with that window (reckoned from before the call
//! was sent, so never late).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use prometheus::IntGauge;
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;

use super::{Charge, LeaseTerms, Op, Verdict};
use crate::metrics::Metrics;

const SHARDS: usize = 16;

/// What one instance holds of one key's budget.
struct Held {
    /// The charge the units were taken for: its limit, key and numbers.
    charge: Charge,
    terms: LeaseTerms,
    /// Units held now.
    units: u64,
    /// Units asked for by store calls in flight.
    pending: u64,
    /// Requests' takes in flight (renewals not counted: they wait for the
    /// keeper, and no request waits for them).
    taking: u32,
    /// The lease's size now: what a take or renewal fills up to, from
    /// `terms.units` up to `terms.max_units`.
    size: u64,
    /// This process's time (ms) when the last take was sent.
    asked_at: u64,
    /// This process's time (ms) at which what is held goes back (`ttl_ms`
    /// after the last take); until then it is only spent.
    expires_at: u64,
    /// This process's time (ms) from which nothing held may be spent: the
    /// end of the window it was taken in; never for a bucket.
    valid_until: u64,
    /// The store's time of the last take: what a give-back refers to.
    taken_at: u64,
    /// Changes whenever the held units leave (given back or dropped), so
    /// that a spend undone or a take landing afterwards is not mixed in.
    epoch: u64,
    /// Until then (this process's time, ms) a request this lease cannot
    /// pay for is refused here: the store refused a take and said how long
    /// the cost would not fit, capped at `ttl_ms` so that units other
    /// instances give back are seen.
    refused_until: u64,
    /// What the store had left after the last take, and its reset.
    shared_remaining: u64,
    reset_ms: u64,
    gauge: IntGauge,
    /// Woken whenever a take or renewal for this key lands.
    landed: Arc<Notify>,
}

impl Held {
    /// Takes the held units out, to be given back: `None` when none.
    fn surrender(&mut self, epoch: u64) -> Option<GiveBack> {
        let units = std::mem::take(&mut self.units);
        self.gauge.sub(units as i64);
        self.epoch = epoch;
        (units > 0).then(|| GiveBack {
            charge: Charge {
                cost: units,
                op: self.charge.op.without_take(),
                ..self.charge.clone()
            },
            spent_at: self.taken_at,
        })
    }
}

/// Units that go back to the store: `charge.cost` of them, taken at store
/// time `spent_at`.
#[derive(Debug, Clone)]
pub struct GiveBack {
    /// The key, numbers and unit count to give back.
    pub charge: Charge,
    /// The store time of the take.
    pub spent_at: u64,
}

/// A renewal wanted: take up to `want` units for the charge's key.
#[derive(Debug, Clone)]
pub struct Renewal {
    /// The key and numbers, with `cost` 0 and `take` the units wanted.
    pub charge: Charge,
    /// The lease's epoch when it was asked for.
    pub epoch: u64,
}

/// Who sent a take: a request short of units, or the lease keeper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taker {
    /// A request's own store call, charging its cost and taking more.
    Request,
    /// A background renewal.
    Renewal,
}

/// Proof of a spend from a lease, to undo it.
#[derive(Debug, Clone, Copy)]
pub struct Token {
    epoch: u64,
    taken_at: u64,
}

/// What a leased charge gets from what this instance holds.
#[derive(Debug)]
pub enum Spend {
    /// Spent from the lease.
    Held(Verdict, Token),
    /// Too little held, and the store refused a take a moment ago: refused
    /// here, with no store call.
    Refused(Verdict),
    /// Too little held: the request's store call charges the cost and
    /// takes up to `want` more.
    Short {
        /// Units to take beyond the cost.
        want: u64,
        /// The lease's epoch when the take was asked for.
        epoch: u64,
    },
}

/// The leases of one process, by key.
pub struct Leases {
    shards: Vec<Mutex<HashMap<String, Held, ahash::RandomState>>>,
    hasher: ahash::RandomState,
    epochs: AtomicU64,
    returns: Mutex<Vec<GiveBack>>,
    renewals: Mutex<Vec<Renewal>>,
    wake: tokio::sync::Notify,
    metrics: Arc<Metrics>,
}

impl Leases {
    /// No leases yet.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: Default::default(),
            epochs: AtomicU64::new(1),
            returns: Mutex::default(),
            renewals: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            metrics,
        }
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<String, Held, ahash::RandomState>> {
        let i = (self.hasher.hash_one(key) as usize) % SHARDS;
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn epoch(&self) -> u64 {
        self.epochs.fetch_add(1, Ordering::Relaxed)
    }

    fn give_back_later(&self, back: impl IntoIterator<Item = GiveBack>) {
        let mut returns = self.returns.lock().unwrap_or_else(|e| e.into_inner());
        let before = returns.len();
        returns.extend(back);
        if returns.len() > before {
            self.wake.notify_one();
        }
    }

    /// Spends `c.cost` (at this process's time `now`) from what is held
    /// for its key, or says how much to take.
    pub fn spend(&self, c: &Charge, terms: LeaseTerms, now: u64) -> Spend {
        let mut back = None;
        let mut renew = None;
        let spend = {
            let mut shard = self.shard(&c.key);
            if !shard.contains_key(&c.key) {
                let held = Held {
                    charge: c.clone(),
                    terms,
                    units: 0,
                    pending: 0,
                    taking: 0,
                    size: terms.units,
                    asked_at: 0,
                    expires_at: 0,
                    valid_until: 0,
                    taken_at: 0,
                    epoch: self.epoch(),
                    refused_until: 0,
                    shared_remaining: 0,
                    reset_ms: 0,
                    gauge: self.metrics.lease_units.with_label_values(&[&c.name]),
                    landed: Arc::default(),
                };
                shard.insert(c.key.clone(), held);
            }
            let Some(held) = shard.get_mut(&c.key) else {
                unreachable!("the lease was just ensured")
            };
            if held.charge.params != c.params || held.terms != terms {
                // A reload or a plan changed the numbers: what is held was
                // taken under the old ones.
                back = held.surrender(self.epoch());
                held.charge = c.clone();
                held.terms = terms;
                held.size = terms.units;
                held.refused_until = 0;
            } else if held.units > 0 && now >= held.valid_until {
                // Taken in a window that has ended since.
                back = held.surrender(self.epoch());
            }
            if held.units >= c.cost {
                held.units -= c.cost;
                held.gauge.sub(c.cost as i64);
                let verdict = Verdict::decided(
                    true,
                    held.units + held.shared_remaining,
                    Some(0),
                    held.reset_ms,
                    held.taken_at,
                );
                let outstanding = held.units + held.pending;
                // A renewal only when the store had the units to spare at
                // the last take: a contended key's renewal would come back
                // with crumbs, a store call for next to nothing.
                if outstanding <= held.size / 2 && held.shared_remaining >= held.size - outstanding
                {
                    // Half spent within half its time: demand is steady,
                    // so the next take brings more, up to `max_units`.
                    if now.saturating_sub(held.asked_at) < terms.ttl_ms / 2 {
                        held.size = (held.size * 2).min(terms.max_units);
                    }
                    held.asked_at = now;
                    let want = held.size - outstanding;
                    held.pending += want;
                    renew = Some(Renewal {
                        charge: Charge {
                            cost: 0,
                            op: Op::Take { units: want },
                            ..held.charge.clone()
                        },
                        epoch: held.epoch,
                    });
                }
                let token = Token {
                    epoch: held.epoch,
                    taken_at: held.taken_at,
                };
                Spend::Held(verdict, token)
            } else if now < held.refused_until {
                Spend::Refused(Verdict::decided(
                    false,
                    held.units,
                    Some(held.refused_until - now),
                    held.reset_ms,
                    held.taken_at,
                ))
            } else {
                let want = held.size.saturating_sub(held.units + held.pending);
                held.asked_at = now;
                held.pending += want;
                held.taking += 1;
                Spend::Short {
                    want,
                    epoch: held.epoch,
                }
            }
        };
        self.give_back_later(back);
        if let Some(r) = renew {
            self.renewals
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(r);
            self.wake.notify_one();
        }
        spend
    }

    /// When what is held cannot pay `c.cost` and a request's take for its
    /// key is in flight: the landing to wait for, so that a request finding
    /// the lease empty a moment after another asked the store does not ask
    /// too. What the take brings pays for it, or the refusal it remembers
    /// refuses it here; either way with no call of its own. (Concurrent
    /// requests of an abused key each asked the store when a remembered
    /// refusal ended: a call per request in flight instead of one.)
    pub fn landing(&self, c: &Charge) -> Option<OwnedNotified> {
        let shard = self.shard(&c.key);
        let held = shard.get(&c.key)?;
        // Registered before the lock is let go, so no landing is missed.
        (held.taking > 0 && held.units < c.cost && held.charge.params == c.params)
            .then(|| held.landed.clone().notified_owned())
    }

    /// Undoes a [`Spend::Held`] (a later part of the same decision denied):
    /// the units are held again, up to `units`, and the rest given back, all
    /// of them when the lease has moved on (given back, another window).
    pub fn refund(&self, c: &Charge, token: Token) {
        let back = {
            let mut shard = self.shard(&c.key);
            let kept = match shard.get_mut(&c.key) {
                Some(held) if held.epoch == token.epoch => {
                    let kept = c.cost.min(held.size.saturating_sub(held.units));
                    held.units += kept;
                    held.gauge.add(kept as i64);
                    kept
                }
                _ => 0,
            };
            (c.cost > kept).then(|| GiveBack {
                charge: Charge {
                    cost: c.cost - kept,
                    op: c.op.without_take(),
                    ..c.clone()
                },
                spent_at: token.taken_at,
            })
        };
        self.give_back_later(back);
    }

    /// The store refused a take's cost for `wait_ms` (from `sent_at`):
    /// requests that cannot be paid from the lease are refused here until
    /// a whole lease would fit, at most `ttl_ms`.
    ///
    /// Until the cost alone fits would be sooner (one unit of refill), but
    /// an abused key is refused again and again: asking every time a unit
    /// refills costs a store call per unit, per instance. Waiting for
    /// `units` to refill costs each instance at most one call per `units`
    /// of refill however hard the key is pushed. Nothing is lost meanwhile:
    /// the shared budget keeps what refills for whichever instance asks
    /// first, and each instance asks again after the same wait, so none is
    /// favoured.
    pub fn refused(&self, c: &Charge, wait_ms: Option<u64>, sent_at: u64) {
        let Some(wait_ms) = wait_ms else { return };
        let mut shard = self.shard(&c.key);
        if let Some(held) = shard.get_mut(&c.key) {
            // Contended: back to the smallest lease.
            held.size = held.terms.units;
            let rest = held.terms.units.saturating_sub(c.cost);
            let wait_ms = wait_ms + c.params.refill_ms(rest);
            held.refused_until = sent_at + wait_ms.min(held.terms.ttl_ms);
        }
    }

    /// A take (`by` a request or a renewal) that asked for `asked` units
    /// beyond the cost has ended: with the store's verdict when the charge
    /// was spent (its `granted` units now held), `None` when it was not or
    /// the call failed. `sent_at` is this process's time when the call was
    /// sent.
    pub fn landed(
        &self,
        c: &Charge,
        by: Taker,
        asked: u64,
        epoch: u64,
        spent: Option<&Verdict>,
        sent_at: u64,
    ) {
        let back = {
            let mut shard = self.shard(&c.key);
            let held = shard.get_mut(&c.key);
            if let Some(held) = held {
                held.pending = held.pending.saturating_sub(asked);
                if by == Taker::Request {
                    held.taking = held.taking.saturating_sub(1);
                }
            }
            let back = match (shard.get_mut(&c.key), spent) {
                (Some(held), Some(v)) if held.epoch == epoch => self.hold(held, v, sent_at),
                // Taken for a lease that has moved on: straight back.
                (_, spent) => spent.filter(|v| v.granted > 0).map(|v| GiveBack {
                    charge: Charge {
                        cost: v.granted,
                        op: c.op.without_take(),
                        ..c.clone()
                    },
                    spent_at: v.at,
                }),
            };
            if let Some(held) = shard.get(&c.key) {
                held.landed.notify_waiters();
            }
            back
        };
        self.give_back_later(back);
    }

    /// A take's granted units, held from now on (the store charged them at
    /// `v.at`; the call was sent at this process's `sent_at`). Returns what
    /// an ended window's units give back.
    fn hold(&self, held: &mut Held, v: &Verdict, sent_at: u64) -> Option<GiveBack> {
        let mut back = None;
        let mut valid_until = u64::MAX;
        if let Some(window_ms) = held.charge.params.window_ms() {
            let start = |t: u64| t - t % window_ms;
            if start(v.at) != start(held.taken_at) {
                // Units of a window that has ended go back to it (its
                // count still weighs in a sliding window), and spends
                // from it that are undone later follow them there.
                back = held.surrender(self.epoch());
            }
            valid_until = sent_at + (start(v.at) + window_ms - v.at);
        }
        held.units += v.granted;
        held.gauge.add(v.granted as i64);
        if v.remaining == 0 {
            // The take emptied the shared budget: others want it too, and
            // a take before a whole lease has refilled would be refused or
            // come back with crumbs. So when these units run out, requests
            // are refused here until then, as after a refusal.
            held.size = held.terms.units;
            let refill_ms = held.charge.params.refill_ms(held.terms.units);
            held.refused_until = held
                .refused_until
                .max(sent_at + refill_ms.min(held.terms.ttl_ms));
        }
        held.taken_at = v.at;
        held.valid_until = valid_until;
        held.expires_at = (sent_at + held.terms.ttl_ms).min(valid_until);
        held.shared_remaining = v.remaining;
        held.reset_ms = v.reset_ms;
        back
    }

    /// Every lease whose time is up at `now` gives its units back; leases
    /// holding nothing, asking for nothing and remembering no refusal are
    /// forgotten.
    pub fn expire(&self, now: u64) {
        let mut back = Vec::new();
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            shard.retain(|_, held| {
                if now < held.expires_at {
                    return true;
                }
                if held.units > 0 {
                    back.extend(held.surrender(self.epochs.fetch_add(1, Ordering::Relaxed)));
                }
                // Kept while a take is out or a refusal is remembered.
                held.pending > 0 || now < held.refused_until
            });
        }
        self.give_back_later(back);
    }

    /// Every lease gives its units back (the policy reloads, or the process
    /// stops); takes still in flight give theirs back when they land.
    pub fn release_all(&self) {
        let back = self.surrender_all();
        self.give_back_later(back);
    }

    /// Every lease's units, taken out to be given back now, with the
    /// give-backs already waiting (the process stops).
    pub fn surrender_all(&self) -> Vec<GiveBack> {
        let mut back = self.take_returns();
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            for held in shard.values_mut() {
                back.extend(held.surrender(self.epochs.fetch_add(1, Ordering::Relaxed)));
                held.expires_at = 0;
                held.valid_until = 0;
                held.refused_until = 0;
            }
        }
        back
    }

    /// The give-backs waiting, taken out.
    pub fn take_returns(&self) -> Vec<GiveBack> {
        std::mem::take(&mut *self.returns.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The renewals waiting, taken out.
    pub fn take_renewals(&self) -> Vec<Renewal> {
        std::mem::take(&mut *self.renewals.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Drops the renewals waiting (the process stops): nothing is taken
    /// that would only be given back.
    pub fn drop_renewals(&self) {
        for r in self.take_renewals() {
            self.landed(
                &r.charge,
                Taker::Renewal,
                r.charge.op.units(),
                r.epoch,
                None,
                0,
            );
        }
    }

    /// Resolves when a renewal or a give-back is waiting.
    pub async fn work(&self) {
        self.wake.notified().await
    }

    /// Units this instance holds for one key.
    pub fn held_for(&self, key: &str) -> u64 {
        self.shard(key).get(key).map_or(0, |h| h.units)
    }

    /// Units held now, over every key.
    pub fn held(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap_or_else(|e| e.into_inner());
                s.values().map(|h| h.units).sum::<u64>()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests;
