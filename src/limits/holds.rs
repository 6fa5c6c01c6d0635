//! The holds this instance's requests keep on concurrency limits, from the
//! decision that takes them to the end of their request.
//!
//! A hold is taken in the request's all-or-nothing decision like any other
//! charge. Before that decision a [`HoldGuard`] watches the request's holds;
//! whichever way the request ends (its response done, its client gone, its
//! upstream failing or timing out, a later refusal, the process shutting
//! down) the guard is dropped with it, and each hold it took is released
//! exactly once: at once for a hold in this process; for a shared one,
//! queued at once for the store's next (batched) call, so that a decision
//! queued after it, such as the same client's next request, is decided
//! after it. A decision dropped before it
//! answered may still take its holds in the store: they are released once
//! the call can no longer land (twice `store.timeout_ms` later).
//!
//! While a request runs, its shared holds are renewed in one batched call
//! every `hold_ttl_ms / 3`; an instance that dies stops renewing, and the
//! store drops its holds once they expire.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use super::algorithm::{HoldId, Params};
use super::{gate, Charge, Gate, Op, Source, Verdict};
use crate::metrics::Metrics;

/// This process's half of every hold id: random, so that two instances'
/// holds never meet in a shared key.
static INSTANCE: LazyLock<u64> = LazyLock::new(|| {
    let seed = (std::process::id(), crate::clock::wall_ms());
    ahash::RandomState::new().hash_one(seed)
});
/// This process's requests, counted.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// A hold id no other request of the fleet has.
pub fn next_id() -> HoldId {
    (u128::from(*INSTANCE) << 64) | u128::from(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Where a hold lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Its decision has not answered yet: it may be taken anywhere.
    Deciding,
    /// In this process: a local limit, or a shared one's fallback.
    Local,
    /// In the shared store.
    Shared,
}

/// A hold a request of this instance keeps.
#[derive(Debug)]
struct Live {
    /// The charge that took it (for a fallback, the fallback's charge).
    charge: Charge,
    place: Place,
    /// When it was last taken or renewed (the limiter's clock, ms).
    renewed_at: u64,
}

impl Live {
    /// Whether it is, or may be, in the shared store.
    fn maybe_shared(&self) -> bool {
        match self.place {
            Place::Shared => true,
            Place::Deciding => !self.charge.is_local(),
            Place::Local => false,
        }
    }
}

/// A shared hold to release once `due` (the limiter's clock, ms).
#[derive(Debug, Clone)]
pub struct Release {
    /// The charge that took it.
    pub charge: Charge,
    /// Not before this.
    due: u64,
    /// A release that failed is tried again until then: by then the hold
    /// expired in the store unrenewed (0: never tried again).
    pub until: u64,
}

impl Release {
    /// A release tried once, never again (as the process stops).
    pub fn last_try(charge: Charge) -> Self {
        Self {
            charge,
            due: 0,
            until: 0,
        }
    }
}

/// How long a release the store failed waits before it is tried again.
pub const RETRY_MS: u64 = 500;

/// The shared holds waiting for their release in the store, and the
/// keeper's signal; a release the store failed comes back here.
pub struct ReleaseQueue {
    releases: Mutex<Vec<Release>>,
    /// Signalled when a shared hold is to be released.
    work: tokio::sync::Notify,
    now: Arc<dyn Fn() -> u64 + Send + Sync>,
}

impl ReleaseQueue {
    fn push(&self, releases: impl IntoIterator<Item = Release>) {
        let mut queue = self.releases.lock().unwrap_or_else(|e| e.into_inner());
        let before = queue.len();
        queue.extend(releases);
        if queue.len() > before {
            self.work.notify_one();
        }
    }

    /// Holds whose release the store failed (it was stalled or down):
    /// tried again every [`RETRY_MS`] for as long as they could still be
    /// held in the store, so that a store that comes back does not keep
    /// them until they expire.
    pub fn failed(&self, charges: Vec<Charge>) {
        let now = (self.now)();
        self.push(charges.into_iter().map(|charge| Release {
            until: now + hold_ttl(&charge),
            due: now + RETRY_MS,
            charge,
        }));
    }

    /// Releases the store failed again: those that may still be held.
    pub fn retry(&self, releases: Vec<Release>) {
        let now = (self.now)();
        self.push(
            releases
                .into_iter()
                .filter(|r| r.until > now)
                .map(|r| Release {
                    due: now + RETRY_MS,
                    ..r
                }),
        );
    }
}

/// How long a hold of `charge` lives in the store unrenewed.
fn hold_ttl(charge: &Charge) -> u64 {
    match charge.params {
        Params::Concurrency(terms) => terms.hold_ttl_ms,
        _ => 0,
    }
}

/// Releases a hold kept in this process.
pub type LocalRelease = Box<dyn Fn(&Charge) + Send + Sync>;
/// Reads the limiter's clock (ms).
pub type Now = Box<dyn Fn() -> u64 + Send + Sync>;
/// Queues the release of shared holds in the store at once, the queue
/// that a failed one goes back to given; `false` when it cannot (they
/// wait in the keeper's queue instead).
pub type SharedRelease = Box<dyn Fn(&[&Charge], &Arc<ReleaseQueue>) -> bool + Send + Sync>;

/// The holds of this instance's requests.
pub struct Holds {
    live: Mutex<HashMap<HoldId, Live, ahash::RandomState>>,
    queue: Arc<ReleaseQueue>,
    release_local: LocalRelease,
    release_shared: SharedRelease,
    now: Arc<dyn Fn() -> u64 + Send + Sync>,
    /// How long after a dropped decision its store call may still land.
    late_by: u64,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holds").finish_non_exhaustive()
    }
}

/// A request's holds: released when it is dropped, with the request.
pub struct HoldGuard {
    holds: Arc<Holds>,
    ids: Vec<HoldId>,
}

impl std::fmt::Debug for HoldGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HoldGuard")
            .field("holds", &self.ids.len())
            .finish()
    }
}

impl Holds {
    /// No holds yet. `release_local` releases one kept in this process,
    /// `release_shared` queues the release of shared ones in the store,
    /// `now` reads the limiter's clock, and `late_by` is how long after a
    /// dropped decision its store call may still land.
    pub fn new(
        release_local: LocalRelease,
        release_shared: SharedRelease,
        now: Now,
        late_by: u64,
        metrics: Arc<Metrics>,
    ) -> Self {
        let now: Arc<dyn Fn() -> u64 + Send + Sync> = Arc::from(now);
        Self {
            live: Mutex::new(HashMap::default()),
            queue: Arc::new(ReleaseQueue {
                releases: Mutex::new(Vec::new()),
                work: tokio::sync::Notify::new(),
                now: now.clone(),
            }),
            release_local,
            release_shared,
            now,
            late_by,
            metrics,
        }
    }

    /// Watches the holds among `charges` before they are decided: from
    /// now on they are released however the request ends. `None` when no
    /// charge holds.
    pub fn watch(self: &Arc<Self>, charges: &[Charge]) -> Option<HoldGuard> {
        let now_ms = (self.now)();
        let mut ids = Vec::new();
        let mut live = self.lock_live();
        for c in charges {
            let Some(id) = c.hold else { continue };
            ids.push(id);
            live.insert(
                id,
                Live {
                    charge: c.clone(),
                    place: Place::Deciding,
                    renewed_at: now_ms,
                },
            );
        }
        drop(live);
        (!ids.is_empty()).then(|| HoldGuard {
            holds: self.clone(),
            ids,
        })
    }

    /// Records what the decision of `charges` did with their holds: a
    /// hold is kept where its verdict was reached when its charge was
    /// spent (admitted, and its group charged), and forgotten otherwise.
    /// `fallback(c)` is the charge a shared limit's local fallback decided.
    pub fn decided(
        &self,
        charges: &[Charge],
        verdicts: &[Verdict],
        fallback: impl Fn(&Charge) -> Charge,
    ) {
        let charged = gate(charges, |i| verdicts[i].allowed, Gate::Open);
        let now = (self.now)();
        // A call that failed (late, or cut off) may still have reached the
        // store and taken its holds there: they are released after it, as
        // a dropped decision's are (a release twice is one release).
        let late: Vec<Release> = charges
            .iter()
            .zip(verdicts)
            .filter(|(c, v)| {
                c.hold.is_some()
                    && !c.is_local()
                    && matches!(
                        v.source,
                        Source::FailOpen | Source::FailClosed | Source::Fallback
                    )
            })
            .map(|(c, _)| Release {
                until: now + self.late_by + hold_ttl(c),
                charge: c.clone(),
                due: now + self.late_by,
            })
            .collect();
        self.queue.push(late);
        let mut live = self.lock_live();
        for (c, v) in charges.iter().zip(verdicts) {
            let Some(id) = c.hold else { continue };
            let place = match v.source {
                _ if !(v.allowed && charged.admits(c.group)) => None,
                Source::Store if c.is_local() => Some(Place::Local),
                Source::Store => Some(Place::Shared),
                Source::Fallback => Some(Place::Local),
                Source::FailOpen | Source::FailClosed | Source::Shed(_) => None,
            };
            match place {
                Some(place) => {
                    if let Some(held) = live.get_mut(&id) {
                        held.place = place;
                        if v.source == Source::Fallback {
                            held.charge = fallback(c);
                        }
                        self.gauge(c).inc();
                    }
                }
                None => {
                    live.remove(&id);
                }
            }
        }
    }

    /// Releases the holds `ids`: their request ended.
    fn release(&self, ids: &[HoldId]) {
        let now = (self.now)();
        let mut gone = Vec::new();
        {
            let mut live = self.lock_live();
            gone.extend(ids.iter().filter_map(|id| live.remove(id)));
        }
        let mut shared = Vec::new();
        let mut ended = Vec::new();
        for held in gone {
            match held.place {
                Place::Local => {
                    self.gauge(&held.charge).dec();
                    (self.release_local)(&held.charge);
                }
                Place::Shared => {
                    self.gauge(&held.charge).dec();
                    ended.push(held.charge);
                }
                // Its decision was dropped: the hold may have been taken,
                // here at once, in the store by a call still to land.
                Place::Deciding if held.charge.is_local() => (self.release_local)(&held.charge),
                Place::Deciding => shared.push(Release {
                    until: now + self.late_by + hold_ttl(&held.charge),
                    charge: held.charge,
                    due: now + self.late_by,
                }),
            }
        }
        // Queued in the store now, before the request's end is known to
        // its client: a decision queued after it (the client's next
        // request) is decided after it.
        let charges: Vec<&Charge> = ended.iter().collect();
        if !charges.is_empty() && !(self.release_shared)(&charges, &self.queue) {
            shared.extend(ended.into_iter().map(|charge| Release {
                until: now + hold_ttl(&charge),
                charge,
                due: now,
            }));
        }
        self.queue.push(shared);
    }

    /// The shared holds due for release at `now` (all of them with
    /// `everything`, at shutdown), taken out of the queue.
    pub fn due_releases(&self, now: u64, everything: bool) -> Vec<Release> {
        let mut queue = self
            .queue
            .releases
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (due, later): (Vec<Release>, Vec<Release>) = std::mem::take(&mut *queue)
            .into_iter()
            .partition(|r| everything || r.due <= now);
        *queue = later;
        due
    }

    /// Where releases the store failed go back to.
    pub fn queue(&self) -> &Arc<ReleaseQueue> {
        &self.queue
    }

    /// The holds to renew at `now`: each one last renewed a third of its
    /// `hold_ttl_ms` ago or more, as forced charges (a forced hold is kept
    /// on if it is still held), split into those kept in this process and
    /// those in the store. Marked renewed at `now`.
    pub fn renewals(&self, now: u64) -> (Vec<Charge>, Vec<Charge>) {
        let (mut local, mut shared) = (Vec::new(), Vec::new());
        let mut live = self.lock_live();
        for held in live.values_mut() {
            let Params::Concurrency(terms) = held.charge.params else {
                continue;
            };
            if held.place == Place::Deciding || now < held.renewed_at + terms.hold_ttl_ms / 3 {
                continue;
            }
            held.renewed_at = now;
            let renewal = Charge {
                op: Op::Force { max_debt: 0 },
                ..held.charge.clone()
            };
            if held.place == Place::Local {
                local.push(renewal);
            } else {
                shared.push(renewal);
            }
        }
        (local, shared)
    }

    /// Every hold that may be in the shared store, released as the process
    /// stops: its requests end with it.
    pub fn surrender(&self) -> Vec<Charge> {
        let mut live = self.lock_live();
        let mut out = Vec::new();
        live.retain(|_, held| {
            if !held.maybe_shared() {
                return true;
            }
            if held.place == Place::Shared {
                self.gauge(&held.charge).dec();
            }
            out.push(held.charge.clone());
            false
        });
        out
    }

    /// The limiter's clock, in ms.
    pub fn now(&self) -> u64 {
        (self.now)()
    }

    /// Holds kept by this instance's requests (decided or deciding).
    pub fn len(&self) -> usize {
        self.lock_live().len()
    }

    /// Whether no request keeps a hold.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves when a shared hold is queued for release.
    pub async fn work(&self) {
        self.queue.work.notified().await
    }

    /// Counts reclaimed holds that decisions reported.
    pub fn reclaimed(&self, charges: &[Charge], verdicts: &[Verdict]) {
        for (c, v) in charges.iter().zip(verdicts) {
            if c.hold.is_some() && v.reclaimed > 0 {
                self.metrics
                    .concurrency_reclaimed
                    .with_label_values(&[&c.name])
                    .inc_by(v.reclaimed);
            }
        }
    }

    fn gauge(&self, c: &Charge) -> prometheus::IntGauge {
        self.metrics.concurrency_holds.with_label_values(&[&c.name])
    }

    fn lock_live(&self) -> std::sync::MutexGuard<'_, HashMap<HoldId, Live, ahash::RandomState>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for HoldGuard {
    fn drop(&mut self) {
        self.holds.release(&self.ids);
    }
}

#[cfg(test)]
mod tests;
