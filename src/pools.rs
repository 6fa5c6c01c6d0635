//! Upstream pools: how much work may be in flight to each, who waits for a
//! slot and for how long, and which of its servers are healthy.
//!
//! A rate limit bounds how fast callers start work; a pool bounds how much
//! of it runs at once. Each pool has `max_in_flight` permits and a bounded
//! wait queue served in priority order (critical, normal, sheddable; first
//! come first served within one): a freed permit goes to the first waiter
//! of the highest priority, the `reserve.critical` share of the permits
//! only ever to critical routes, and when the queue is full a newcomer
//! displaces the newest waiter of a lower priority, which is refused. The
//! permit is a value held by the request context: dropping it is the only
//! way to release it, so no early return, client abort, upstream error or
//! panic can leak one.
//!
//! With `queue.fair: tenant`, waiters of one priority are served in turn
//! between tenants instead of in arrival order (start-time fair queueing):
//! each waiter is tagged one past the later of its tenant's last tag and
//! the tag last served, so a tenant with fifty waiters and a tenant with
//! one alternate, and a newcomer is served within one turn.
//! `queue.per_tenant_max` bounds one tenant's waiters; beyond it that
//! tenant is refused at once while the others still queue. A request
//! with no credential (an `auth: none` route) takes its turns as its
//! client's network ([`Party`]), so anonymous callers share the queue
//! fairly between addresses rather than as one tenant.
//!
//! Pools outlive policies: a reload resizes a pool in place, so requests in
//! flight keep their permits and the bound holds across it.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

use arc_swap::ArcSwap;
use ipnet::IpNet;
use prometheus::{Histogram, IntCounter, IntGauge};
use tokio::sync::oneshot;

use crate::config::Upstream;
use crate::config::{Priority, QueueOrder};
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
    /// Refusals by priority: critical, normal, sheddable.
    rejections: [IntCounter; 3],
    wait_seconds: Histogram,
    /// Forwarding tries after the first, by [`Retry`].
    retries: [IntCounter; 2],
}

/// Why a request was forwarded again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// The connection to the server could not be made: nothing reached it.
    Connect,
    /// A reused connection failed before any byte of the response.
    ReusedConnection,
}

impl Retry {
    const ALL: [Retry; 2] = [Retry::Connect, Retry::ReusedConnection];

    /// Its `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Retry::Connect => "connect",
            Retry::ReusedConnection => "reused_connection",
        }
    }
}

/// A waiter's place: its priority, its turn (its arrival, or its fair
/// tag), its arrival.
type Place = (Priority, u64, u64);

/// Whose turns a waiter takes in a queue shared by tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Party {
    /// The request's tenant.
    Tenant(Arc<str>),
    /// A request with no credential: its client's network (an IPv6
    /// client's `client_ip.ipv6_prefix` network, as IP keys are).
    Network(IpNet),
}

/// One waiter: sent `true` with a permit, or `false` when displaced.
struct Waiter {
    tx: oneshot::Sender<bool>,
    /// Its party, whose waiters it counts among when the queue counts
    /// them (`counted`).
    party: Option<Party>,
    counted: bool,
}

/// A tenant's waiters and the last tag it was given, by priority.
#[derive(Default)]
struct TenantTurns {
    waiting: u32,
    last: [u64; 3],
}

/// Who holds the pool's permits and who waits for one.
struct Permits {
    size: u32,
    /// Of `size`, the permits only critical routes may take.
    reserved: u32,
    in_flight: u32,
    /// Waiters in the order they are served: by priority, then turn.
    waiters: BTreeMap<Place, Waiter>,
    arrivals: u64,
    /// The order waiters of one priority are served in.
    order: QueueOrder,
    /// `queue.per_tenant_max`.
    per_tenant_max: Option<u32>,
    /// The tag last served, by priority (fair queueing's virtual time).
    served: [u64; 3],
    /// Parties with waiters (fair or bounded queues only); `None` for the
    /// waiters of no party, which share one turn.
    tenants: HashMap<Option<Party>, TenantTurns>,
}

impl Permits {
    fn free_for(&self, priority: Priority) -> bool {
        let usable = match priority {
            Priority::Critical => self.size,
            _ => self.size - self.reserved.min(self.size),
        };
        self.in_flight < usable
    }

    /// Whether waiters are counted by tenant.
    fn by_tenant(&self) -> bool {
        self.order == QueueOrder::FairByTenant || self.per_tenant_max.is_some()
    }

    /// Queues a waiter of `priority` for `party`; `None` when the party
    /// has `per_tenant_max` waiters already.
    fn enqueue(
        &mut self,
        priority: Priority,
        party: Option<Party>,
    ) -> Option<(Place, oneshot::Receiver<bool>)> {
        self.arrivals += 1;
        let arrival = self.arrivals;
        let mut turn = arrival;
        if self.by_tenant() {
            let served = self.served[priority as usize];
            let turns = self.tenants.entry(party.clone()).or_default();
            if self.per_tenant_max.is_some_and(|max| turns.waiting >= max) {
                return None;
            }
            turns.waiting += 1;
            if self.order == QueueOrder::FairByTenant {
                turn = turns.last[priority as usize].max(served) + 1;
                turns.last[priority as usize] = turn;
            }
        }
        let (tx, rx) = oneshot::channel();
        let place = (priority, turn, arrival);
        let counted = self.by_tenant();
        self.waiters.insert(place, Waiter { tx, party, counted });
        Some((place, rx))
    }

    /// Takes the waiter at `place` out of the queue, if it is still there.
    fn dequeue(&mut self, place: &Place) -> Option<oneshot::Sender<bool>> {
        let waiter = self.waiters.remove(place)?;
        if waiter.counted {
            if let Some(turns) = self.tenants.get_mut(&waiter.party) {
                turns.waiting -= 1;
                if turns.waiting == 0 {
                    self.tenants.remove(&waiter.party);
                }
            }
        }
        Some(waiter.tx)
    }

    /// Hands freed permits to the waiters that may take them, highest
    /// priority first. Only the first waiter need be looked at: when it
    /// may not take a permit, nobody behind it may (critical waiters come
    /// first, and may take whatever the others may).
    fn hand_off(&mut self) {
        loop {
            let Some(&key) = self.waiters.keys().next() else {
                return;
            };
            if !self.free_for(key.0) {
                return;
            }
            let Some(waiter) = self.dequeue(&key) else {
                return;
            };
            let served = &mut self.served[key.0 as usize];
            *served = (*served).max(key.1);
            self.in_flight += 1;
            if waiter.send(true).is_err() {
                // It stopped waiting meanwhile.
                self.in_flight -= 1;
            }
        }
    }
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
    permits: Arc<Mutex<Permits>>,
    metrics: PoolMetrics,
    /// When the health checks last ran for this pool.
    pub(crate) last_checked: Mutex<Option<Instant>>,
}

/// A slot in the pool, held until the upstream response is over.
pub struct PoolPermit {
    permits: Arc<Mutex<Permits>>,
    in_flight: IntGauge,
}

impl std::fmt::Debug for PoolPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolPermit").finish_non_exhaustive()
    }
}

impl Drop for PoolPermit {
    fn drop(&mut self) {
        let mut permits = lock(&self.permits);
        permits.in_flight -= 1;
        permits.hand_off();
        self.in_flight.dec();
    }
}

fn lock(permits: &Mutex<Permits>) -> std::sync::MutexGuard<'_, Permits> {
    permits.lock().unwrap_or_else(|e| e.into_inner())
}

/// A place in the queue: leaves it however the wait ends (a timeout, the
/// client gone), passing on a permit handed over meanwhile.
struct Waiting<'a> {
    pool: &'a Pool,
    key: Place,
    /// Where the permit arrives; `None` once it is taken.
    rx: Option<oneshot::Receiver<bool>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut permits = lock(&self.pool.permits);
        if permits.dequeue(&self.key).is_none() {
            // Handed a permit (under this lock, so it is in the channel by
            // now) that nobody will use: pass it on.
            if let Some(mut rx) = self.rx.take() {
                if rx.try_recv() == Ok(true) {
                    permits.in_flight -= 1;
                    permits.hand_off();
                }
            }
        }
        self.pool.metrics.waiting.dec();
    }
}

impl Pool {
    fn new(def: &Upstream, metrics: &Metrics) -> Self {
        let label = [def.name.as_ref()];
        let rejections = [Priority::Critical, Priority::Normal, Priority::Sheddable].map(|p| {
            metrics
                .pool_rejections
                .with_label_values(&[&def.name, p.label()])
        });
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
            permits: Arc::new(Mutex::new(Permits {
                size: def.max_in_flight,
                reserved: def.reserved_critical,
                in_flight: 0,
                waiters: BTreeMap::new(),
                arrivals: 0,
                order: def.queue_order,
                per_tenant_max: def.queue_per_tenant_max,
                served: [0; 3],
                tenants: HashMap::new(),
            })),
            metrics: PoolMetrics {
                in_flight: metrics.pool_in_flight.with_label_values(&label),
                waiting: metrics.pool_waiting.with_label_values(&label),
                rejections,
                wait_seconds: metrics.pool_wait_seconds.with_label_values(&label),
                retries: Retry::ALL.map(|r| {
                    metrics
                        .upstream_retries
                        .with_label_values(&[&def.name, r.label()])
                }),
            },
            last_checked: Mutex::new(None),
        }
    }

    /// Counts a forwarding try after the first.
    pub fn count_retry(&self, why: Retry) {
        self.metrics.retries[why as usize].inc();
    }

    /// The pool's current definition.
    pub fn def(&self) -> Arc<Upstream> {
        self.def.load_full()
    }

    /// The pool's current servers, with their health.
    pub fn servers(&self) -> Arc<Vec<Arc<Server>>> {
        self.servers.load_full()
    }

    /// Takes a permit for a request of `party` on a route of `priority`,
    /// waiting in the bounded queue if need be.
    pub async fn admit(
        &self,
        priority: Priority,
        party: Option<Party>,
    ) -> Result<PoolPermit, PoolRefusal> {
        self.wait(priority, party)
            .await
            .inspect_err(|_| self.metrics.rejections[priority as usize].inc())?;
        self.metrics.in_flight.inc();
        Ok(PoolPermit {
            permits: self.permits.clone(),
            in_flight: self.metrics.in_flight.clone(),
        })
    }

    async fn wait(&self, priority: Priority, party: Option<Party>) -> Result<(), PoolRefusal> {
        let def = self.def.load();
        let (rx, key) = {
            let mut permits = lock(&self.permits);
            // Waiters of this priority or a higher one go first.
            let ahead = permits
                .waiters
                .keys()
                .next()
                .is_some_and(|(p, ..)| *p <= priority);
            if permits.free_for(priority) && !ahead {
                permits.in_flight += 1;
                return Ok(());
            }
            if permits.waiters.len() >= def.queue_max_waiting as usize {
                // Full: the newest waiter of a lower priority makes room.
                let last = permits.waiters.keys().next_back().copied();
                match last.filter(|(p, ..)| *p > priority) {
                    Some(lowest) => {
                        if let Some(displaced) = permits.dequeue(&lowest) {
                            let _ = displaced.send(false);
                        }
                    }
                    None => return Err(PoolRefusal::Saturated),
                }
            }
            let Some((key, rx)) = permits.enqueue(priority, party) else {
                return Err(PoolRefusal::Saturated);
            };
            (rx, key)
        };
        self.metrics.waiting.inc();
        let mut place = Waiting {
            pool: self,
            key,
            rx: Some(rx),
        };
        let started = Instant::now();
        let arrived = match place.rx.as_mut() {
            Some(rx) => tokio::time::timeout(def.queue_timeout, rx).await,
            None => unreachable!("the receiver is set above"),
        };
        self.metrics
            .wait_seconds
            .observe(started.elapsed().as_secs_f64());
        if let Ok(Ok(true)) = arrived {
            place.rx = None;
            return Ok(());
        }
        // Timed out or displaced; a permit handed over meanwhile is passed
        // on as `place` drops.
        Err(PoolRefusal::Saturated)
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
    /// stay), queue settings, and the number of permits.
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
        // Shrinking: permits in flight above the new size are not handed on
        // as they come back.
        let mut permits = lock(&self.permits);
        permits.size = def.max_in_flight;
        permits.reserved = def.reserved_critical;
        // Waiters keep their places; those queued after take the new rules.
        permits.order = def.queue_order;
        permits.per_tenant_max = def.queue_per_tenant_max;
        permits.hand_off();
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
