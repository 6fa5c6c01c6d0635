//! The decision over all of a request's limits, wherever they live: local
//! limits in this process, shared ones in the store, and each shared limit's
//! failure mode when the store cannot answer in time.
//!
//! Local charges are decided first and spent provisionally; the shared
//! charges follow in one store call that is told which groups already
//! failed locally; local charges of groups the store then denied are
//! refunded. So the decision stays all-or-nothing across both, and nothing
//! is ever admitted beyond a budget.
//!
//! Leased charges (`sync: lease`) are spent like local ones, from what this
//! instance holds ([`super::lease`]); one that finds too little held joins
//! the store call, charging its cost and taking a new lease in the same
//! all-or-nothing decision.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::breaker::{Breaker, Permit};
use super::holds::{HoldGuard, Holds, Release};
use super::lease::{GiveBack, Leases, Spend, Taker, Token};
use super::memory::MemoryStore;
use super::plan::{
    fallback_charge, in_order, part_gate, settle, settlement, DebtBound, Fallback, Part, Split,
};
use super::{
    gate, undone, Charge, Gate, Op, Overload, RecordStore, SharedStore, Source, StoreError, Verdict,
};
use crate::clock::{Clock, MonotonicClock};
use crate::logs::STORE as STORE_LOG;
use crate::metrics::Metrics;

/// The shared store with its guards: a bound on every call and a breaker.
pub struct Shared {
    /// The store shared limits are decided in (Redis or Redis Cluster).
    pub store: Arc<dyn SharedStore>,
    /// Stops calls to a failing store.
    pub breaker: Breaker,
    /// `store.timeout_ms`: the store bounds its own calls by it; a shutdown
    /// waits this long for give-backs.
    pub timeout: Duration,
    /// The local fallback enforces `1/instances` of each budget.
    pub instances: u32,
}

/// Why an operator's read or change of a limit's key (peek, reset,
/// credit) failed for a shared limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyStateError {
    /// The limit is shared, but this gateway runs without a shared store.
    #[error("no shared store")]
    NoSharedStore,
    /// The store answered for fewer charges than it was asked about.
    #[error("no answer")]
    NoAnswer,
    /// The store could not answer.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Decides requests' charges: local ones in `local`, shared ones through
/// `shared`'s store, the breaker timed by `C`.
pub struct Limiter<C: Clock = MonotonicClock> {
    local: Arc<MemoryStore<C>>,
    shared: Option<Shared>,
    leases: Leases,
    holds: Arc<Holds>,
    /// Give-back calls in flight, which a shutdown waits for.
    giving_back: AtomicUsize,
    /// Signalled whenever the last give-back in flight ends.
    given_back: tokio::sync::Notify,
    clock: C,
    metrics: Arc<Metrics>,
}

impl Limiter {
    /// A limiter on the process's monotonic clock.
    pub fn new(local: Arc<MemoryStore>, shared: Option<Shared>, metrics: Arc<Metrics>) -> Self {
        Self::with_clock(MonotonicClock::new(), local, shared, metrics)
    }
}

impl<C: Clock> Limiter<C> {
    /// A limiter whose breaker reads `clock` (the in-process store has its
    /// own; tests give both the same one).
    pub fn with_clock(
        clock: C,
        local: Arc<MemoryStore<C>>,
        shared: Option<Shared>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let holds = {
            let (release, now) = (local.clone(), local.clone());
            let store = shared.as_ref().map(|s| s.store.clone());
            // A dropped decision's call lands within its wait to be sent
            // and its own bound, each `timeout_ms`.
            let late_by = shared
                .as_ref()
                .map_or(0, |s| 2 * s.timeout.as_millis() as u64);
            Holds::new(
                Box::new(move |c| release.refund(&[c], 0)),
                Box::new(move |charges, queue| {
                    store.as_ref().is_some_and(|s| {
                        let queue = queue.clone();
                        let again: Vec<Charge> = charges.iter().map(|c| (*c).clone()).collect();
                        s.release_now(charges, Box::new(move |_| queue.failed(again)))
                    })
                }),
                Box::new(move || now.now_ms()),
                late_by,
                metrics.clone(),
            )
        };
        Self {
            local,
            shared,
            leases: Leases::new(metrics.clone()),
            holds: Arc::new(holds),
            giving_back: AtomicUsize::new(0),
            given_back: tokio::sync::Notify::new(),
            clock,
            metrics,
        }
    }

    /// Seconds a caller should wait when a `closed` limit refuses because
    /// the store is failing: until the breaker tries the store again.
    pub fn unavailable_retry_after(&self) -> u64 {
        self.shared.as_ref().map_or(1, |s| s.breaker_open_secs())
    }

    /// Whether the shared store is answering (or there is none).
    ///
    /// While the circuit is open this is the breaker's probe, so an
    /// instance that receives no traffic (taken out of rotation) still
    /// finds out when the store is back.
    pub async fn store_ready(&self) -> bool {
        let Some(shared) = &self.shared else {
            return true;
        };
        if !shared.breaker.is_open() {
            return true;
        }
        let permit = shared.breaker.permit(self.clock.now_ms());
        if permit != Permit::Probe {
            return false;
        }
        // The store bounds its own calls.
        let ok = shared.store.ping().await.is_ok();
        shared.breaker.record(permit, ok, self.clock.now_ms());
        self.metrics
            .store_circuit_open
            .set(i64::from(shared.breaker.is_open()));
        ok
    }

    /// Decides all charges; one verdict per charge, in order.
    pub async fn decide(&self, charges: &[Charge]) -> Vec<Verdict> {
        let Some(shared) = &self.shared else {
            return self.local.decide_now(charges, Gate::Open).0;
        };
        if charges.iter().all(|c| c.is_local()) {
            return self.local.decide_now(charges, Gate::Open).0;
        }
        // A take in flight for a leased key this request cannot pay for
        // from what is held: its landing decides this request too.
        for c in charges.iter().filter(|c| c.lease().is_some()) {
            if let Some(landing) = self.leases.landing(c) {
                let _ = tokio::time::timeout(shared.timeout, landing).await;
            }
        }
        let now = self.clock.now_ms();

        // Leased charges first: spent from what is held, or a take joins
        // the store call.
        let mut held: Vec<Option<(Verdict, Option<Token>)>> = vec![None; charges.len()];
        let mut takes: Vec<(usize, Charge, u64)> = Vec::new();
        for (i, c) in charges.iter().enumerate() {
            let Some(terms) = c.lease() else {
                continue;
            };
            match self.leases.spend(c, terms, now) {
                Spend::Held(v, token) => held[i] = Some((v, Some(token))),
                Spend::Refused(v) => held[i] = Some((v, None)),
                Spend::Short { want, epoch } => {
                    self.lease_call(c, "take");
                    let take = Charge {
                        op: Op::Take { units: want },
                        ..c.clone()
                    };
                    takes.push((i, take, epoch));
                }
            }
        }

        // Until the takes land (or the request is dropped meanwhile), what
        // they asked for counts as asked.
        let mut landing = Landing {
            leases: &self.leases,
            takes: &takes,
            sent_at: now,
            armed: true,
        };
        // Refusals a lease remembers gate like local denials: nothing of
        // their group or later ones is charged.
        let refused = charges
            .iter()
            .zip(&held)
            .filter(|(_, h)| matches!(h, Some((v, None)) if !v.allowed))
            .map(|(c, _)| c);
        let refused_gate = gate(refused, |_| false, Gate::Open);
        let split = Split::new(charges, |i| held[i].is_some());
        let local: Vec<&Charge> = split.local.iter().map(|&i| &charges[i]).collect();
        let (local_verdicts, spent_at) = self.local.decide_now(&local, refused_gate);
        let local_gate = gate(
            local.iter().copied(),
            |i| local_verdicts[i].allowed,
            refused_gate,
        );
        let mut taking = takes.iter().peekable();
        let remote: Vec<&Charge> = split
            .remote
            .iter()
            .map(|&i| match taking.next_if(|(t, ..)| *t == i) {
                Some((_, take, _)) => take,
                None => &charges[i],
            })
            .collect();

        let remote_verdicts = if remote.is_empty() {
            Vec::new()
        } else {
            match self.call(shared, &remote, local_gate).await {
                Ok(v) => v,
                Err(StoreError::Overloaded(why)) => {
                    // Not decided, and not the store's fault: nothing is
                    // charged and no failure mode applies.
                    self.refund_spent(&local, &local_verdicts, local_gate, Gate::SHUT, spent_at);
                    drop(landing);
                    self.refund_held(charges, &held, Gate::SHUT);
                    return vec![shed(why); charges.len()];
                }
                Err(_) => {
                    // Undo the provisional local charges and decide the
                    // rest again with each shared limit's failure mode;
                    // what the leases held stays spent.
                    self.refund_spent(&local, &local_verdicts, local_gate, Gate::SHUT, spent_at);
                    drop(landing);
                    let verdicts = self.degraded(charges, &held, shared.instances);
                    let final_gate = gate(charges, |i| verdicts[i].allowed, Gate::Open);
                    self.refund_held(charges, &held, final_gate);
                    return verdicts;
                }
            }
        };
        // The three parts settled as one decision: what the leases and the
        // local limits spent in groups denied after all goes back (the
        // store call was told where to stop, so it spent nothing beyond).
        let all: Vec<&Charge> = charges.iter().collect();
        let parts = [
            Part {
                verdicts: split
                    .held
                    .iter()
                    .filter_map(|&i| held[i].map(|(v, _)| v))
                    .collect(),
                members: split.held,
                spent_below: Gate::Open,
            },
            Part {
                members: split.local,
                verdicts: local_verdicts.clone(),
                spent_below: local_gate,
            },
            Part {
                spent_below: part_gate(&all, &split.remote, &remote_verdicts, local_gate),
                members: split.remote,
                verdicts: remote_verdicts,
            },
        ];
        let settled = settle(&all, &parts, Gate::Open);
        let final_gate = settled.gate;
        for &i in &settled.undo[0] {
            if let Some((_, Some(token))) = held[i] {
                self.leases.refund(&charges[i], token);
            }
        }
        let undo_local: Vec<&Charge> = settled.undo[1].iter().map(|&i| &charges[i]).collect();
        if !undo_local.is_empty() {
            self.local.refund(&undo_local, spent_at);
        }
        debug_assert!(
            settled.undo[2].is_empty(),
            "the store was told where to stop"
        );
        // Back into the charges' order.
        let verdicts: Vec<Verdict> = in_order(&parts, charges.len())
            .into_iter()
            .flatten()
            .collect();
        landing.armed = false;
        for (i, take, epoch) in &takes {
            let v = &verdicts[*i];
            // A refusal is remembered before the requests waiting for this
            // take are woken by its landing.
            if !v.allowed {
                self.leases.refused(take, v.wait_ms, now);
            }
            let spent = v.allowed && final_gate.admits(take.group);
            self.leases.landed(
                take,
                Taker::Request,
                take.op.units(),
                *epoch,
                spent.then_some(v),
                now,
            );
        }
        verdicts
    }

    /// Watches the holds of concurrency limits among `charges`, before
    /// they are decided: the guard releases every hold the decision takes
    /// when it is dropped with its request. `None` when none holds.
    pub fn watch_holds(&self, charges: &[Charge]) -> Option<HoldGuard> {
        self.holds.watch(charges)
    }

    /// Records what the decision of `charges` did with their holds, and
    /// counts the expired holds it reclaimed.
    pub fn holds_decided(&self, charges: &[Charge], verdicts: &[Verdict]) {
        let instances = self.shared.as_ref().map_or(1, |s| s.instances);
        self.holds
            .decided(charges, verdicts, |c| fallback_charge(c, instances));
        self.holds.reclaimed(charges, verdicts);
    }

    /// Holds this instance's requests keep.
    pub fn holds_kept(&self) -> usize {
        self.holds.len()
    }

    /// Resolves when a hold is queued for release.
    pub async fn hold_work(&self) {
        self.holds.work().await
    }

    /// Releases the shared holds left to it (those the store could not
    /// queue when their request ended, and those of decisions dropped
    /// before they answered, once due), and renews every hold a third of
    /// its `hold_ttl_ms` old in one batched call: off the request path. The hold keeper runs this whenever
    /// [`Limiter::hold_work`] resolves, and every tick.
    pub async fn keep_holds(&self) {
        let now = self.holds.now();
        let released = self.holds.due_releases(now, false);
        let failed = self.release_shared(released).await;
        self.holds.queue().retry(failed);
        let (local, shared) = self.holds.renewals(now);
        if !local.is_empty() {
            let (verdicts, _) = self.local.decide_now(&local, Gate::Open);
            self.holds.reclaimed(&local, &verdicts);
        }
        if let (Some(store), false) = (&self.shared, shared.is_empty()) {
            for chunk in shared.chunks(HOLDS_PER_CALL) {
                let charges: Vec<&Charge> = chunk.iter().collect();
                // A failed renewal is tried again at the next third of the
                // hold's lifetime; a hold the store reclaimed meanwhile is
                // not taken again.
                if let Ok(verdicts) = self.call(store, &charges, Gate::Open).await {
                    self.holds.reclaimed(chunk, &verdicts);
                }
            }
        }
    }

    /// Releases every shared hold, queued or kept, and waits for the
    /// store calls (shutdown): the requests still running end with the
    /// process, and one that ends meanwhile finds its holds released
    /// already (each hold leaves the registry once).
    pub async fn release_holds(&self) {
        let mut all: Vec<Release> = self
            .holds
            .surrender()
            .into_iter()
            .map(Release::last_try)
            .collect();
        all.extend(self.holds.due_releases(0, true));
        self.release_shared(all).await;
    }

    /// Gives holds back to the shared store: each one released.
    /// Gives holds back to the shared store; returns the releases it
    /// failed (the caller may try them again).
    async fn release_shared(&self, holds: Vec<Release>) -> Vec<Release> {
        let Some(shared) = &self.shared else {
            return Vec::new();
        };
        let mut failed = Vec::new();
        for chunk in holds.chunks(HOLDS_PER_CALL) {
            let charges: Vec<&Charge> = chunk.iter().map(|r| &r.charge).collect();
            if let Err(e) = shared.store.give_back(&charges, 1).await {
                if e.is_failure() {
                    self.metrics.store_error(e.reason());
                }
                tracing::warn!(target: STORE_LOG, error = %e, holds = charges.len(), "releasing holds failed; tried again while the store may hold them");
                failed.extend_from_slice(chunk);
            }
        }
        failed
    }

    /// Holds again what leases spent for groups the decision did not charge.
    fn refund_held(
        &self,
        charges: &[Charge],
        held: &[Option<(Verdict, Option<Token>)>],
        final_gate: Gate,
    ) {
        for (c, h) in charges.iter().zip(held) {
            if let Some((_, Some(token))) = h {
                if !final_gate.admits(c.group) {
                    self.leases.refund(c, *token);
                }
            }
        }
    }

    fn lease_call(&self, c: &Charge, kind: &str) {
        self.metrics
            .lease_calls
            .with_label_values(&[&c.name, kind])
            .inc();
    }

    /// Renews the leases that ran low and gives back what is due: expired
    /// leases and everything released. The lease keeper runs this whenever
    /// [`Limiter::lease_work`] resolves, and every tick.
    pub async fn keep_leases(&self) {
        let Some(shared) = &self.shared else { return };
        let now = self.clock.now_ms();
        self.leases.expire(now);
        let renewals = self.leases.take_renewals();
        if !renewals.is_empty() {
            let charges: Vec<&Charge> = renewals.iter().map(|r| &r.charge).collect();
            for c in &charges {
                self.lease_call(c, "renew");
            }
            let result = self.call(shared, &charges, Gate::Open).await;
            for (i, r) in renewals.iter().enumerate() {
                let v = result.as_ref().ok().map(|v| &v[i]);
                self.leases.landed(
                    &r.charge,
                    Taker::Renewal,
                    r.charge.op.units(),
                    r.epoch,
                    v.filter(|v| v.allowed),
                    now,
                );
            }
        }
        // Counted from before they are taken out: a shutdown waits for them.
        let _giving = Countdown::start(&self.giving_back, &self.given_back);
        self.return_units(shared, self.leases.take_returns()).await;
    }

    /// Gives back units of leases, counted as `return` calls.
    async fn return_units(&self, shared: &Shared, back: Vec<GiveBack>) {
        for r in &back {
            self.lease_call(&r.charge, "return");
        }
        self.give_back(shared, back).await;
    }

    /// Gives back units (a lease's, or a cost the response made smaller),
    /// one store call per take time (calls at once are batched by the
    /// store).
    async fn give_back(&self, shared: &Shared, back: Vec<GiveBack>) {
        if back.is_empty() {
            return;
        }
        let mut by_time: Vec<(u64, Vec<&Charge>)> = Vec::new();
        for b in &back {
            match by_time.iter_mut().find(|(t, _)| *t == b.spent_at) {
                Some((_, charges)) => charges.push(&b.charge),
                None => by_time.push((b.spent_at, vec![&b.charge])),
            }
        }
        let calls = by_time
            .iter()
            .map(|(at, charges)| shared.store.give_back(charges, *at));
        for result in futures_util::future::join_all(calls).await {
            let Err(failed) = result else { continue };
            if failed.is_failure() {
                self.metrics.store_error(failed.reason());
            }
            tracing::warn!(target: STORE_LOG, error = %failed, "giving back units failed; they stay charged until the keys refill");
        }
    }

    /// Settles a request's charges (with the store times they were made
    /// at) once its actual cost is known: `delta` more is charged to each,
    /// whatever the state, into debt of at most `debt`, or `-delta` given
    /// back; in this process for local limits, in one store call for the
    /// shared ones. Off the request path. Returns the most units a limit
    /// left uncharged because it was at its deepest debt.
    pub async fn reconcile(&self, charged: &[(Charge, u64)], delta: i64, debt: DebtBound) -> u64 {
        if delta == 0 || charged.is_empty() {
            return 0;
        }
        let settle = settlement(charged, delta, debt);
        let (local, shared): (Vec<_>, Vec<_>) = settle.iter().partition(|(c, _)| c.is_local());
        if delta > 0 {
            let mut verdicts = Vec::new();
            let local: Vec<&Charge> = local.iter().map(|(c, _)| c).collect();
            if !local.is_empty() {
                verdicts.extend(self.local.decide_now(&local, Gate::Open).0);
            }
            let shared: Vec<&Charge> = shared.iter().map(|(c, _)| c).collect();
            if let (Some(store), false) = (&self.shared, shared.is_empty()) {
                // A failed settlement leaves the estimate charged: counted
                // as a store error, and its cost as uncharged.
                match self.call(store, &shared, Gate::Open).await {
                    Ok(v) => verdicts.extend(v),
                    Err(_) => return delta.unsigned_abs(),
                }
            }
            return verdicts.iter().map(|v| v.uncharged).max().unwrap_or(0);
        }
        for (c, at) in &local {
            self.local.refund(&[c], *at);
        }
        if let (Some(store), false) = (&self.shared, shared.is_empty()) {
            let back = shared
                .iter()
                .map(|(c, at)| GiveBack {
                    charge: c.clone(),
                    spent_at: *at,
                })
                .collect();
            self.give_back(store, back).await;
        }
        0
    }

    /// Gives back every lease now (the policy reloaded): the next requests
    /// take new ones under the new numbers.
    pub fn release_leases(&self) {
        self.leases.release_all();
    }

    /// Gives back every lease and waits for the store call (shutdown).
    ///
    /// The lease keeper may still be giving back what it took out a moment
    /// before; this waits for that too, up to the store timeout.
    pub async fn return_leases(&self) {
        let Some(shared) = &self.shared else { return };
        self.leases.drop_renewals();
        self.return_units(shared, self.leases.surrender_all()).await;
        let given_back = crate::drain::until(&self.given_back, || {
            self.giving_back.load(Ordering::Acquire) == 0
        });
        let _ = tokio::time::timeout(shared.timeout, given_back).await;
        // What a take that landed meanwhile left to give back.
        self.return_units(shared, self.leases.take_returns()).await;
    }

    /// Resolves when a lease wants renewing or giving back.
    pub async fn lease_work(&self) {
        self.leases.work().await
    }

    /// What each charge's limit holds now, charging nothing: local limits
    /// and what leases hold as this instance sees them, shared ones read
    /// from the store (`Err` with why when it cannot answer). With each,
    /// the units this instance holds under a lease of its key.
    pub async fn peek(&self, charges: &[Charge]) -> Vec<(Result<Verdict, KeyStateError>, u64)> {
        let held = |c: &Charge| {
            if c.lease().is_some() {
                self.leases.held_for(&c.key)
            } else {
                0
            }
        };
        let shared: Vec<&Charge> = charges.iter().filter(|c| !c.is_local()).collect();
        let mut remote = match (&self.shared, shared.is_empty()) {
            (_, true) => Vec::new(),
            (None, false) => vec![Err(KeyStateError::NoSharedStore); shared.len()],
            (Some(s), false) => match s.store.peek(&shared).await {
                Ok(v) => v.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(KeyStateError::Store(e)); shared.len()],
            },
        }
        .into_iter();
        charges
            .iter()
            .map(|c| {
                let verdict = if c.is_local() {
                    Ok(self.local.peek_now(std::slice::from_ref(c))[0])
                } else {
                    remote.next().unwrap_or(Err(KeyStateError::NoAnswer))
                };
                (verdict, held(c))
            })
            .collect()
    }

    /// Starts each charge's key afresh, where it lives (an operator's
    /// reset). Units leases hold stay held until they go back.
    pub async fn reset(&self, charges: &[Charge]) -> Result<(), KeyStateError> {
        let (local, shared): (Vec<&Charge>, Vec<&Charge>) =
            charges.iter().partition(|c| c.is_local());
        self.local.reset_now(&local);
        match (&self.shared, shared.is_empty()) {
            (_, true) => Ok(()),
            (None, false) => Err(KeyStateError::NoSharedStore),
            (Some(s), false) => s.store.reset(&shared).await.map_err(KeyStateError::Store),
        }
    }

    /// Gives each charge's cost back to its key now, where it lives (an
    /// operator's credit).
    pub async fn credit(&self, charges: &[Charge]) -> Result<(), KeyStateError> {
        let (local, shared): (Vec<&Charge>, Vec<&Charge>) =
            charges.iter().partition(|c| c.is_local());
        self.local.credit_now(&local);
        match (&self.shared, shared.is_empty()) {
            (_, true) => Ok(()),
            (None, false) => Err(KeyStateError::NoSharedStore),
            (Some(s), false) => s
                .store
                .credit(&shared)
                .await
                .map(drop)
                .map_err(KeyStateError::Store),
        }
    }

    /// The shared store, when limits live in one.
    pub fn shared_store(&self) -> Option<&Arc<dyn SharedStore>> {
        self.shared.as_ref().map(|s| &s.store)
    }

    /// Where operators' records are shared between instances, when there
    /// is a shared store.
    pub fn records(&self) -> Option<&dyn RecordStore> {
        self.shared
            .as_ref()
            .map(|s| s.store.as_ref() as &dyn RecordStore)
    }

    /// Units this instance holds under leases, over every key.
    pub fn lease_units(&self) -> u64 {
        self.leases.held()
    }

    /// Decisions waiting for the shared store (`tollgate_store_pending`).
    pub fn store_pending(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.store.pending())
    }

    /// One bounded, breaker-guarded store call, measured.
    async fn call(
        &self,
        shared: &Shared,
        charges: &[&Charge],
        blocked_from: Gate,
    ) -> Result<Vec<Verdict>, StoreError> {
        let permit = shared.breaker.permit(self.clock.now_ms());
        if permit == Permit::Refuse {
            self.metrics.store_error(StoreError::CircuitOpen.reason());
            return Err(StoreError::CircuitOpen);
        }
        let started = Instant::now();
        let started_ms = self.clock.now_ms();
        // The store bounds the call itself (`timeout_ms`), and tells a
        // failing store from a gateway too busy to wait for it.
        let result = match shared.store.decide(charges, blocked_from).await {
            Ok(v) if v.len() != charges.len() => Err(StoreError::Reply(format!(
                "{} verdicts for {} charges",
                v.len(),
                charges.len()
            ))),
            result => result,
        };
        if let Err(StoreError::Overloaded(_)) = result {
            // Neither a success nor a failure of the store, nor a call of
            // it: a decision shed before its call.
            shared.breaker.release(permit, self.clock.now_ms());
            return result;
        }
        self.metrics
            .store_call_seconds
            .observe(started.elapsed().as_secs_f64());
        shared
            .breaker
            .record_since(permit, result.is_ok(), self.clock.now_ms(), started_ms);
        self.metrics
            .store_circuit_open
            .set(i64::from(shared.breaker.is_open()));
        if let Err(e) = &result {
            tracing::warn!(target: STORE_LOG, error = %e, "limit store call failed");
            self.metrics.store_error(e.reason());
        }
        result
    }

    /// Refunds local charges that were spent (their group was below
    /// `spent_below`) but whose group ended at or above `final_gate`.
    fn refund_spent(
        &self,
        charges: &[&Charge],
        verdicts: &[Verdict],
        spent_below: Gate,
        final_gate: Gate,
        at: u64,
    ) {
        let undo: Vec<&Charge> = charges
            .iter()
            .zip(verdicts)
            .filter(|(c, v)| undone(c, v, spent_below, final_gate))
            .map(|(c, _)| *c)
            .collect();
        if !undo.is_empty() {
            self.local.refund(&undo, at);
        }
    }

    /// The store is failing: local limits as usual, leased units already
    /// spent (`held`) stay spent, and each other shared limit follows its
    /// `on_store_error` ([`Fallback`]).
    fn degraded(
        &self,
        charges: &[Charge],
        held: &[Option<(Verdict, Option<Token>)>],
        instances: u32,
    ) -> Vec<Verdict> {
        let held: Vec<Option<Verdict>> = held.iter().map(|h| h.map(|(v, _)| v)).collect();
        let plan = Fallback::new(charges, &held, instances);
        let (decided, _) = self.local.decide_now(&plan.to_run(), plan.blocked);
        plan.conclude(charges, decided)
    }
}

/// Counts calls in flight: up when made, down however they end, with a
/// signal when none is left.
struct Countdown<'a>(&'a AtomicUsize, &'a tokio::sync::Notify);

impl<'a> Countdown<'a> {
    fn start(count: &'a AtomicUsize, none_left: &'a tokio::sync::Notify) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count, none_left)
    }
}

impl Drop for Countdown<'_> {
    fn drop(&mut self) {
        if self.0.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.1.notify_waiters();
        }
    }
}

/// Takes of one decision not yet landed: landed as failed if the decision
/// is dropped (its request went away) or its store call failed, so that
/// what they asked for is not counted as asked for ever.
struct Landing<'a> {
    leases: &'a Leases,
    takes: &'a [(usize, Charge, u64)],
    sent_at: u64,
    armed: bool,
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        if self.armed {
            for (_, take, epoch) in self.takes {
                self.leases.landed(
                    take,
                    Taker::Request,
                    take.op.units(),
                    *epoch,
                    None,
                    self.sent_at,
                );
            }
        }
    }
}

impl Shared {
    fn breaker_open_secs(&self) -> u64 {
        self.breaker.open_for().as_millis().div_ceil(1000).max(1) as u64
    }
}

/// Holds released or renewed per store call, at most.
const HOLDS_PER_CALL: usize = 1024;

/// The verdict of a charge whose decision was shed.
fn shed(why: Overload) -> Verdict {
    Verdict::undecided(false, Source::Shed(why))
}

#[cfg(test)]
mod tests;
