//! Upstream pools: how much work may be in flight to each, who waits for a
//! slot and for how long, and which of its servers are healthy.
//!
//! A rate limit bounds how fast callers start work; a pool bounds how much
//! of it runs at once. Each pool has a semaphore of `max_in_flight` permits
//! and a bounded wait queue. The permit is a value held by the request
//! context: dropping it is the only way to release it, so no early return,
//! client abort, upstream error or panic can leak one.
//!
//! Pools outlive policies: a reload resizes a pool's semaphore in place, so
//! requests in flight keep their permits and the bound holds across it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;
use prometheus::{Histogram, IntCounter, IntGauge};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Upstream;
use crate::metrics::Metrics;

/// One server of a pool and what the health checks think of it.
#[derive(Debug)]
pub struct Server {
    /// Where the server listens.
    pub addr: SocketAddr,
    healthy: AtomicBool,
    /// Consecutive check results of the current streak.
    streak: AtomicU32,
}

impl Server {
    fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            healthy: AtomicBool::new(true),
            streak: AtomicU32::new(0),
        }
    }

    /// Whether the server is in the rotation; true until checks say otherwise.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Records one check; flips the state after enough agreeing results.
    /// Returns the new state when it changed.
    pub fn record_check(&self, ok: bool, healthy_after: u32, unhealthy_after: u32) -> Option<bool> {
        if ok == self.is_healthy() {
            self.streak.store(0, Ordering::Relaxed);
            return None;
        }
        let streak = self.streak.fetch_add(1, Ordering::Relaxed) + 1;
        let needed = if ok { healthy_after } else { unhealthy_after };
        if streak < needed {
            return None;
        }
        self.streak.store(0, Ordering::Relaxed);
        self.healthy.store(ok, Ordering::Relaxed);
        Some(ok)
    }
}

/// The pool's series, resolved once.
struct PoolMetrics {
    in_flight: IntGauge,
    waiting: IntGauge,
    rejections: IntCounter,
    wait_seconds: Histogram,
}

/// Why a request got no permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolRefusal {
    /// No permit within the queue bound (or the queue is full).
    Saturated,
    /// Every server of the pool fails its health checks.
    NoHealthyServer,
}

/// Run-time state of one upstream pool.
pub struct Pool {
    /// The upstream name, the `pool` label.
    pub name: Arc<str>,
    def: ArcSwap<Upstream>,
    servers: ArcSwap<Vec<Arc<Server>>>,
    next: AtomicUsize,
    permits: Arc<Semaphore>,
    size: Mutex<u32>,
    waiting: AtomicU32,
    metrics: PoolMetrics,
    /// When the health checks last ran for this pool.
    pub(crate) last_checked: Mutex<Option<Instant>>,
}

/// A slot in the pool, held until the upstream response is over.
pub struct PoolPermit {
    _permit: OwnedSemaphorePermit,
    in_flight: IntGauge,
}

impl Drop for PoolPermit {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

/// Keeps `waiting` honest however the wait ends.
struct WaitSlot<'a>(&'a Pool);

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
        self.0.metrics.waiting.dec();
    }
}

impl Pool {
    fn new(def: &Upstream, metrics: &Metrics) -> Self {
        let label = [def.name.as_ref()];
        Self {
            name: def.name.clone(),
            def: ArcSwap::from_pointee(def.clone()),
            servers: ArcSwap::from_pointee(
                def.servers
                    .iter()
                    .map(|&a| Arc::new(Server::new(a)))
                    .collect(),
            ),
            next: AtomicUsize::new(0),
            permits: Arc::new(Semaphore::new(def.max_in_flight as usize)),
            size: Mutex::new(def.max_in_flight),
            waiting: AtomicU32::new(0),
            metrics: PoolMetrics {
                in_flight: metrics.pool_in_flight.with_label_values(&label),
                waiting: metrics.pool_waiting.with_label_values(&label),
                rejections: metrics.pool_rejections.with_label_values(&label),
                wait_seconds: metrics.pool_wait_seconds.with_label_values(&label),
            },
            last_checked: Mutex::new(None),
        }
    }

    /// The pool's current definition.
    pub fn def(&self) -> Arc<Upstream> {
        self.def.load_full()
    }

    /// The pool's current servers, with their health.
    pub fn servers(&self) -> Arc<Vec<Arc<Server>>> {
        self.servers.load_full()
    }

    /// Takes a permit, waiting in the bounded queue if need be.
    pub async fn admit(&self) -> Result<PoolPermit, PoolRefusal> {
        let permit = match self.permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => self
                .wait()
                .await
                .inspect_err(|_| self.metrics.rejections.inc())?,
        };
        self.metrics.in_flight.inc();
        Ok(PoolPermit {
            _permit: permit,
            in_flight: self.metrics.in_flight.clone(),
        })
    }

    async fn wait(&self) -> Result<OwnedSemaphorePermit, PoolRefusal> {
        let def = self.def.load();
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= def.queue_max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(PoolRefusal::Saturated);
        }
        self.metrics.waiting.inc();
        let _slot = WaitSlot(self);
        let started = Instant::now();
        let acquired =
            tokio::time::timeout(def.queue_timeout, self.permits.clone().acquire_owned()).await;
        self.metrics
            .wait_seconds
            .observe(started.elapsed().as_secs_f64());
        match acquired {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(PoolRefusal::Saturated),
        }
    }

    /// The next healthy server, round robin.
    pub fn pick(&self) -> Result<SocketAddr, PoolRefusal> {
        let servers = self.servers.load();
        let n = servers.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| &servers[(start + i) % n])
            .find(|s| s.is_healthy())
            .map(|s| s.addr)
            .ok_or(PoolRefusal::NoHealthyServer)
    }

    /// Applies a new definition: servers (keeping the health of those that
    /// stay), queue settings, and the semaphore's size.
    fn update(&self, def: &Upstream) {
        let old = self.servers.load();
        let servers = def
            .servers
            .iter()
            .map(|&a| {
                old.iter()
                    .find(|s| s.addr == a)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(Server::new(a)))
            })
            .collect();
        self.servers.store(Arc::new(servers));
        self.def.store(Arc::new(def.clone()));
        self.resize(def.max_in_flight);
    }

    fn resize(&self, target: u32) {
        let mut size = self.size.lock().unwrap_or_else(|e| e.into_inner());
        if target > *size {
            self.permits.add_permits((target - *size) as usize);
        } else if target < *size {
            let surplus = *size - target;
            // Free permits go at once; the rest as requests in flight finish.
            let taken = self.permits.forget_permits(surplus as usize) as u32;
            let owed = surplus - taken;
            if owed > 0 {
                let permits = self.permits.clone();
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move {
                        if let Ok(p) = permits.acquire_many_owned(owed).await {
                            p.forget();
                        }
                    });
                }
            }
        }
        *size = target;
    }
}

/// Every pool by name, across reloads.
pub struct Pools {
    by_name: Mutex<HashMap<Arc<str>, Arc<Pool>>>,
    metrics: Arc<Metrics>,
}

impl Pools {
    /// No pools yet; each records its series in `metrics`.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            by_name: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// The pools of a policy, in its order: existing ones updated in place,
    /// new ones created, removed ones forgotten (their requests in flight
    /// still hold them).
    pub fn reconcile(&self, upstreams: &[Upstream]) -> Vec<Arc<Pool>> {
        let mut by_name = self.by_name.lock().unwrap_or_else(|e| e.into_inner());
        let pools: Vec<Arc<Pool>> = upstreams
            .iter()
            .map(|def| match by_name.get(&def.name) {
                Some(pool) => {
                    pool.update(def);
                    pool.clone()
                }
                None => Arc::new(Pool::new(def, &self.metrics)),
            })
            .collect();
        *by_name = pools.iter().map(|p| (p.name.clone(), p.clone())).collect();
        pools
    }
}

#[cfg(test)]
mod tests;
