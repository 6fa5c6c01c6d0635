//! The decision over all of a request's limits, wherever they live: local
//! limits in this process, shared ones in the store, and each shared limit's
//! failure mode when the store cannot answer in time.
//!
//! Local charges are decided first and spent provisionally; the shared
//! charges follow in one store call that is told which groups already
//! failed locally; local charges of groups the store then denied are
//! refunded. So the decision stays all-or-nothing across both, and nothing
//! is ever admitted beyond a budget.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::breaker::{Breaker, Permit};
use super::memory::MemoryStore;
use super::{gate, undone, Charge, Gate, LimitStore, OnStoreError, Source, StoreError, Verdict};
use crate::clock::{Clock, MonotonicClock};
use crate::metrics::Metrics;

/// The shared store with its guards: a bound on every call and a breaker.
pub struct Shared {
    /// The store shared limits are decided in (Redis or Redis Cluster).
    pub store: Arc<dyn LimitStore>,
    /// Stops calls to a failing store.
    pub breaker: Breaker,
    /// Bound on every store call (`store.timeout_ms`).
    pub timeout: Duration,
    /// The local fallback enforces `1/instances` of each budget.
    pub instances: u32,
}

/// Decides requests' charges: local ones in `local`, shared ones through
/// `shared`'s store, the breaker timed by `C`.
pub struct Limiter<C: Clock = MonotonicClock> {
    local: Arc<MemoryStore<C>>,
    shared: Option<Shared>,
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
        Self {
            local,
            shared,
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
        let ping = tokio::time::timeout(shared.timeout, shared.store.ping()).await;
        let ok = matches!(ping, Ok(Ok(())));
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
        let (local, remote): (Vec<&Charge>, Vec<&Charge>) = charges.iter().partition(|c| c.local);
        if remote.is_empty() {
            return self.local.decide_now(charges, Gate::Open).0;
        }

        let (local_verdicts, spent_at) = self.local.decide_now(&local, Gate::Open);
        let local_gate = gate(
            local.iter().copied(),
            |i| local_verdicts[i].allowed,
            Gate::Open,
        );

        let remote_verdicts = match self.call(shared, &remote, local_gate).await {
            Ok(v) => v,
            Err(_) => {
                // Undo the provisional local charges and decide everything
                // again with each shared limit's failure mode.
                self.refund_spent(&local, &local_verdicts, local_gate, Gate::SHUT, spent_at);
                return self.degraded(charges, shared.instances);
            }
        };
        // Back into the charges' order.
        let (mut l, mut r) = (local_verdicts.iter(), remote_verdicts.iter());
        let verdicts: Vec<Verdict> = charges
            .iter()
            .filter_map(|c| if c.local { l.next() } else { r.next() })
            .copied()
            .collect();
        let final_gate = gate(charges, |i| verdicts[i].allowed, local_gate);
        self.refund_spent(&local, &local_verdicts, local_gate, final_gate, spent_at);
        verdicts
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
        let result =
            match tokio::time::timeout(shared.timeout, shared.store.decide(charges, blocked_from))
                .await
            {
                Ok(Ok(v)) if v.len() != charges.len() => Err(StoreError::Reply(format!(
                    "{} verdicts for {} charges",
                    v.len(),
                    charges.len()
                ))),
                Ok(result) => result,
                Err(_) => Err(StoreError::Timeout),
            };
        self.metrics
            .store_call_seconds
            .observe(started.elapsed().as_secs_f64());
        shared
            .breaker
            .record(permit, result.is_ok(), self.clock.now_ms());
        self.metrics
            .store_circuit_open
            .set(i64::from(shared.breaker.is_open()));
        if let Err(e) = &result {
            tracing::warn!(error = %e, "limit store call failed");
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

    /// The store is failing: local limits as usual, and each shared limit
    /// by its `on_store_error`.
    fn degraded(&self, charges: &[Charge], instances: u32) -> Vec<Verdict> {
        let mut fixed = vec![None; charges.len()];
        let mut run = Vec::new();
        let mut index = Vec::new();
        let mut blocked = Gate::Open;
        for (i, c) in charges.iter().enumerate() {
            match (c.local, c.on_store_error) {
                (true, _) => {
                    run.push(c.clone());
                    index.push(i);
                }
                (false, OnStoreError::Local) => {
                    let mut fallback = c.clone();
                    fallback.params = c.params.share(instances);
                    fallback.key = format!("\u{1e}fallback\u{1f}{}", c.key);
                    run.push(fallback);
                    index.push(i);
                }
                (false, OnStoreError::Open) => fixed[i] = Some(failed(true, Source::FailOpen)),
                (false, OnStoreError::Closed) => {
                    fixed[i] = Some(failed(false, Source::FailClosed));
                    if c.enforce {
                        blocked = blocked.min(Gate::At(c.group));
                    }
                }
            }
        }
        let (decided, _) = self.local.decide_now(&run, blocked);
        for (&i, mut v) in index.iter().zip(decided) {
            if !charges[i].local {
                v.source = Source::Fallback;
            }
            fixed[i] = Some(v);
        }
        fixed.into_iter().flatten().collect()
    }
}

impl Shared {
    fn breaker_open_secs(&self) -> u64 {
        self.breaker.open_for().as_millis().div_ceil(1000).max(1) as u64
    }
}

fn failed(allowed: bool, source: Source) -> Verdict {
    Verdict {
        allowed,
        remaining: 0,
        wait_ms: None,
        reset_ms: 0,
        source,
    }
}

#[cfg(test)]
mod tests;
