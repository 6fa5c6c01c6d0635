//! What a running gateway holds: the parts that live as long as the process
//! (limit state, metrics, pools, heavy hitters) and, per policy, a
//! [`Runtime`] that requests use from start to finish.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::config::Policy;
use crate::limits::limiter::Limiter;
use crate::metrics::{Metrics, PolicyMetrics};
use crate::pools::{Pool, Pools};
use crate::top::{Redactor, Top};

/// The process-long parts, shared by every policy that goes live.
pub struct Services {
    /// Bytes of request bodies read whole, over the process.
    pub body_budget: Arc<crate::edge::body::BodyBudget>,
    /// The limiter of client-caused log lines; a reload sets its rate.
    pub client_log: Arc<crate::logs::ClientLog>,
    /// The access log, when `server.access_log` is set (at start).
    pub access_log: Option<crate::access_log::AccessLog>,
    /// The TLS listeners' certificate, re-read on reload.
    pub certificate: Option<Arc<crate::tls::Certificate>>,
    /// Decides limits; its state outlives reloads.
    pub limiter: Arc<Limiter>,
    /// The metrics handle.
    pub metrics: Arc<Metrics>,
    /// Upstream pools by name, kept across reloads.
    pub pools: Pools,
    /// The heavy-hitters sketch.
    pub top: Top,
    /// Hashes caller identities for logs and reports.
    pub redactor: Redactor,
    /// Credentials revoked at runtime, as this instance last read them.
    pub revocations: Arc<crate::identity::revocations::Revocations>,
    /// Tenant overrides put at runtime, as this instance last read them.
    pub overrides: Arc<crate::identity::overrides::Overrides>,
    /// Credentials provisioned at runtime, as this instance cached them.
    pub store_keys: Arc<crate::identity::store_keys::StoreKeys>,
    /// Exports request spans, when `server.tracing` is set (at start).
    pub tracer: Option<&'static crate::trace::otlp::Exporter>,
    /// The usage ledger, when `usage` is set (at start).
    pub usage: Option<Arc<crate::usage::Ledger>>,
    /// The wall clock requests and operators' changes are timed by.
    pub wall: Arc<dyn crate::clock::WallClock>,
}

/// Reload generations: each runtime's is new, so what was resolved against
/// one policy is never taken for another's.
static GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One live policy with its pools. Requests hold an `Arc` of it from start
/// to finish, so a request always completes under the policy it began with.
pub struct Runtime {
    /// The validated policy.
    pub policy: Policy,
    /// The policy's pools, indexed by [`crate::config::PoolId`].
    pub pools: Vec<Arc<Pool>>,
    /// The process-long parts.
    pub services: Arc<Services>,
    /// This runtime's reload generation.
    pub generation: u64,
    metrics: PolicyMetrics,
    /// Declared last, so dropped last: runs once the policy has been freed.
    dropped: AfterDrop,
}

/// What runs when a replaced runtime has been freed, on whatever thread
/// let it go last.
#[derive(Default)]
struct AfterDrop(std::sync::Mutex<Option<fn()>>);

impl Drop for AfterDrop {
    fn drop(&mut self) {
        let hook = self.0.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(hook) = hook {
            hook();
        }
    }
}

impl Runtime {
    /// Whether route `id` records its admitted requests in the usage
    /// ledger (which is kept).
    pub fn records(&self, id: crate::config::RouteId) -> bool {
        self.services.usage.is_some() && self.policy.usage.as_ref().is_some_and(|u| u.records(id))
    }

    /// Prepares `policy` to serve: its pools reconciled with those already
    /// running, its metric series indexed by route and limit.
    pub fn new(policy: Policy, services: Arc<Services>) -> Self {
        let pools = services.pools.reconcile(&policy.upstreams);
        // Issuers whose keys come from a URL fetch them while this policy
        // is live.
        policy.auth.jwt.start_fetching();
        if let Some(settings) = policy.auth.store_keys {
            services.store_keys.configure(settings);
        }
        let metrics = PolicyMetrics::new(
            services.metrics.clone(),
            policy.routes.iter().map(|r| r.name.clone()).collect(),
            policy.limits.iter().map(|l| l.name.clone()).collect(),
        );
        for limit in policy.limits.iter().filter(|l| l.sync.lease().is_some()) {
            metrics.export_lease(&limit.name);
        }
        for limit in policy.limits.iter().filter(|l| l.params.is_concurrency()) {
            metrics.export_concurrency(&limit.name);
        }
        Self {
            policy,
            pools,
            services,
            generation: GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            metrics,
            dropped: AfterDrop::default(),
        }
    }

    /// The pool `id` of this runtime's policy.
    pub fn pool(&self, id: crate::config::PoolId) -> &Arc<crate::pools::Pool> {
        &self.pools[id.index()]
    }

    /// The wall clock now, in ms since the epoch.
    pub fn wall_ms(&self) -> u64 {
        self.services.wall.wall_ms()
    }

    /// The wall clock now, for timestamps.
    pub fn wall(&self) -> std::time::SystemTime {
        self.services.wall.wall()
    }

    /// The override of `tenant` in force at `now_ms` (wall clock),
    /// resolved against this policy.
    pub fn tenant_override(
        &self,
        tenant: &str,
        now_ms: u64,
    ) -> Option<Arc<crate::identity::overrides::Resolved>> {
        self.services.overrides.of(
            |o| crate::config::resolve_override(&self.policy, o),
            self.generation,
            tenant,
            now_ms,
        )
    }

    /// Calls `hook` once this runtime, its policy and keys, has been freed
    /// (by the last request that held it).
    pub fn after_drop(&self, hook: fn()) {
        *self.dropped.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    /// The process-wide limiter.
    pub fn limiter(&self) -> &Limiter {
        &self.services.limiter
    }

    /// The metrics, with this policy's series at hand.
    pub fn metrics(&self) -> &PolicyMetrics {
        &self.metrics
    }

    /// The process-wide metrics.
    pub fn all_metrics(&self) -> &Metrics {
        &self.services.metrics
    }
}

/// Reads the admin records of the shared store again (revocations) every
/// `server.admin_refresh_ms`, when they changed.
pub struct RecordsRefresher {
    live: Arc<arc_swap::ArcSwap<Runtime>>,
}

impl RecordsRefresher {
    /// Keeps the live runtime's revocations current.
    pub fn new(live: Arc<arc_swap::ArcSwap<Runtime>>) -> Self {
        Self { live }
    }
}

#[async_trait]
impl BackgroundService for RecordsRefresher {
    async fn start(&self, _shutdown: ShutdownWatch) {
        loop {
            let rt = self.live.load_full();
            if let Some(store) = rt.limiter().records() {
                if let Err(e) = rt.services.revocations.refresh(store).await {
                    tracing::warn!(target: crate::logs::STORE, error = %e, "reading the revocations failed; the last ones read stay in force");
                }
                if let Err(e) = rt.services.overrides.refresh(store).await {
                    tracing::warn!(target: crate::logs::STORE, error = %e, "reading the overrides failed; the last ones read stay in force");
                }
                if rt.policy.auth.store_keys.is_some() {
                    if let Err(e) = rt.services.store_keys.refresh(store).await {
                        tracing::warn!(target: crate::logs::STORE, error = %e, "reading the credentials change feed failed; cached credentials stay until it is read");
                    }
                }
            }
            tokio::time::sleep(rt.policy.server.admin_refresh).await;
        }
    }
}

/// Background work of the limiter, off the request path: as soon as there
/// is some, and on a short tick for what falls due by time.
pub struct Keeper {
    limiter: Arc<Limiter>,
    of: Kept,
}

/// What a [`Keeper`] keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Leases: renews those that ran low, gives back what is due
    /// (expiries, every 50 ms).
    Leases,
    /// Holds of concurrency limits: releases what the registry queued,
    /// renews those a third of their lifetime old (every 100 ms; a third
    /// of the shortest `hold_ttl_ms` is 333 ms).
    Holds,
}

impl Keeper {
    /// Keeps `of` for `limiter`.
    pub fn new(limiter: Arc<Limiter>, of: Kept) -> Self {
        Self { limiter, of }
    }
}

#[async_trait]
impl BackgroundService for Keeper {
    async fn start(&self, _shutdown: ShutdownWatch) {
        // Runs through the drain, while requests still take, spend and
        // hold; the drain gives everything back once they have finished.
        let limiter = &self.limiter;
        let tick = match self.of {
            Kept::Leases => Duration::from_millis(50),
            Kept::Holds => Duration::from_millis(100),
        };
        loop {
            let work = async {
                match self.of {
                    Kept::Leases => limiter.lease_work().await,
                    Kept::Holds => limiter.hold_work().await,
                }
            };
            tokio::select! {
                () = work => {}
                () = tokio::time::sleep(tick) => {}
            }
            match self.of {
                Kept::Leases => limiter.keep_leases().await,
                Kept::Holds => limiter.keep_holds().await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    static CALLS: AtomicUsize = AtomicUsize::new(0);

    #[test]
    fn the_hook_runs_once_when_the_last_holder_lets_go() {
        struct Held {
            _first: Vec<u8>,
            dropped: AfterDrop,
        }
        let held = Arc::new(Held {
            _first: vec![0; 16],
            dropped: AfterDrop::default(),
        });
        *held.dropped.0.lock().unwrap() = Some(|| {
            CALLS.fetch_add(1, Ordering::SeqCst);
        });
        let request = held.clone();
        drop(held);
        assert_eq!(CALLS.load(Ordering::SeqCst), 0, "a request still holds it");
        drop(request);
        assert_eq!(CALLS.load(Ordering::SeqCst), 1);
    }
}
