//! Holds on a fleet of limiters sharing one store, on a clock moved by
//! hand: every hold released exactly once, however its request ends, and
//! never more holds than the limit allows.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::clock::{Clock, ManualClock};
use crate::limits::algorithm::Concurrency;
use crate::limits::breaker::Breaker;
use crate::limits::limiter::{Limiter, Shared};
use crate::limits::memory::MemoryStore;
use crate::limits::{LimitStore, RecordStore, SharedStore};
use crate::testing::{block_on, charge, local_charge};

const TTL_MS: u64 = 3_000;
/// The store timeout of every instance: a dropped decision's hold is
/// released `2 × TIMEOUT_MS` later.
const TIMEOUT_MS: u64 = 50;

fn params(max: u64) -> Params {
    Params::Concurrency(Concurrency {
        max_in_flight: max,
        hold_ttl_ms: TTL_MS,
    })
}

/// A request's charge of the shared concurrency limit, with a hold of its own.
fn request(max: u64) -> Charge {
    Charge {
        hold: Some(next_id()),
        ..charge("inflight", "tenant-a", params(max), 1)
    }
}

fn instance(clock: &ManualClock, shared: Option<Arc<dyn SharedStore>>) -> Limiter<ManualClock> {
    let shared = shared.map(|store| Shared {
        store,
        breaker: Breaker::new(1_000, Duration::from_secs(1)),
        timeout: Duration::from_millis(TIMEOUT_MS),
        instances: 2,
    });
    Limiter::with_clock(
        clock.clone(),
        Arc::new(MemoryStore::new(clock.clone())),
        shared,
        Arc::new(Metrics::new()),
    )
}

/// Holds counted in `store` for the key of `probe` now.
fn counted(store: &MemoryStore<ManualClock>, probe: &Charge) -> u64 {
    let probe = Charge {
        cost: 0,
        ..probe.clone()
    };
    probe.params.quota() - store.peek_now(std::slice::from_ref(&probe))[0].remaining
}

/// Decides `c` on `limiter` as the request path does: watched, decided,
/// recorded. The guard when the hold was taken.
async fn admit(limiter: &Limiter<ManualClock>, c: &Charge) -> Option<HoldGuard> {
    let charges = std::slice::from_ref(c);
    let guard = limiter.watch_holds(charges);
    let verdicts = limiter.decide(charges).await;
    limiter.holds_decided(charges, &verdicts);
    verdicts[0].allowed.then_some(guard).flatten()
}

#[test]
fn a_local_hold_is_released_when_its_request_ends() {
    let clock = ManualClock::new(1_000);
    let limiter = instance(&clock, None);
    let c = || Charge {
        hold: Some(next_id()),
        ..local_charge("inflight", "k", params(2), 1)
    };
    block_on(async {
        let first = admit(&limiter, &c()).await.expect("one of two");
        let second = admit(&limiter, &c()).await.expect("two of two");
        assert!(admit(&limiter, &c()).await.is_none(), "a third waits");
        assert_eq!(limiter.holds_kept(), 2, "the refused request keeps none");
        drop(first);
        let third = admit(&limiter, &c()).await.expect("the first ended");
        drop((second, third));
        assert_eq!(limiter.holds_kept(), 0);
        assert!(admit(&limiter, &c()).await.is_some());
    });
}

#[test]
fn a_shared_hold_is_released_off_the_request_path_and_renewed_while_it_runs() {
    let clock = ManualClock::new(1_000);
    let store = Arc::new(MemoryStore::new(clock.clone()));
    let limiter = instance(&clock, Some(store.clone() as Arc<dyn SharedStore>));
    let c = request(1);
    block_on(async {
        let guard = admit(&limiter, &c).await.expect("admitted");
        assert_eq!(counted(&store, &c), 1);
        // Renewed every third of its lifetime: it outlives hold_ttl_ms.
        for _ in 0..6 {
            clock.advance(TTL_MS / 3);
            limiter.keep_holds().await;
        }
        assert_eq!(counted(&store, &c), 1, "renewed, still held");
        drop(guard);
        assert_eq!(
            counted(&store, &c),
            1,
            "released by the keeper, not the request"
        );
        limiter.keep_holds().await;
        assert_eq!(counted(&store, &c), 0);
        assert_eq!(limiter.holds_kept(), 0);
    });
}

#[test]
fn a_dropped_decision_releases_its_hold_once_its_call_can_no_longer_land() {
    let clock = ManualClock::new(1_000);
    let store = Arc::new(MemoryStore::new(clock.clone()));
    let limiter = instance(&clock, Some(store.clone() as Arc<dyn SharedStore>));
    let c = request(3);
    // The decision was dropped after its call took the hold in the store.
    let guard = limiter.watch_holds(std::slice::from_ref(&c));
    store.decide_now(&[&c], Gate::Open);
    drop(guard);
    block_on(async {
        limiter.keep_holds().await;
        assert_eq!(counted(&store, &c), 1, "its call might still land");
        clock.advance(2 * TIMEOUT_MS);
        limiter.keep_holds().await;
        assert_eq!(counted(&store, &c), 0);
    });
}

#[test]
fn a_refusal_by_another_limit_takes_no_hold() {
    let clock = ManualClock::new(1_000);
    let store = Arc::new(MemoryStore::new(clock.clone()));
    let limiter = instance(&clock, Some(store.clone() as Arc<dyn SharedStore>));
    let hold = request(5);
    let empty = charge("rate", "k", crate::testing::bucket_params(1, 1), 1);
    block_on(async {
        let both = [hold.clone(), empty.clone()];
        assert!(limiter.decide(&both).await.iter().all(|v| v.allowed));
        let next = [request(5), empty];
        let guard = limiter.watch_holds(&next);
        let verdicts = limiter.decide(&next).await;
        limiter.holds_decided(&next, &verdicts);
        assert!(!verdicts[1].allowed, "the bucket is empty");
        assert_eq!(counted(&store, &hold), 1, "only the first request's hold");
        assert_eq!(limiter.holds_kept(), 0, "nothing to release");
        drop(guard);
    });
}

/// What a step of the fleet does.
#[derive(Debug, Clone)]
enum Step {
    /// A request reaches instance i.
    Admit(usize),
    /// The k-th running request of instance i ends.
    Finish(usize, usize),
    /// Instance i's decision is dropped after its store call took the hold.
    Cancel(usize),
    /// Instance i's keeper runs (releases, renewals).
    Keep(usize),
    /// Instance i dies: it never releases or renews again.
    Die(usize),
    /// Time passes.
    Advance(u64),
}

fn step(n: usize) -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..n).prop_map(Step::Admit),
        3 => (0..n, 0usize..8).prop_map(|(i, k)| Step::Finish(i, k)),
        1 => (0..n).prop_map(Step::Cancel),
        4 => (0..n).prop_map(Step::Keep),
        1 => (0..n).prop_map(Step::Die),
        3 => (0..TTL_MS / 2).prop_map(Step::Advance),
    ]
}

/// What the store should hold: each hold's expiry and whether its release
/// is queued (and from when it is due).
#[derive(Debug, Default)]
struct Expected {
    holds: HashMap<HoldId, (u64, usize, Option<u64>)>,
}

impl Expected {
    fn live(&self, now: u64) -> u64 {
        self.holds.values().filter(|(e, ..)| *e > now).count() as u64
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Instances admitting, finishing, cancelling, renewing and dying in
    /// any order: at every step the store counts exactly the holds taken
    /// and neither released nor expired, never more than `max_in_flight`;
    /// once every survivor's requests end and the dead ones' holds expire,
    /// nothing is held.
    #[test]
    fn a_fleet_never_holds_more_than_the_limit_and_releases_each_hold_once(
        n in 1usize..4,
        max in 1u64..6,
        steps in proptest::collection::vec(step(3), 1..80),
    ) {
        let clock = ManualClock::new(1_000);
        let store = Arc::new(MemoryStore::new(clock.clone()));
        let fleet: Vec<_> = (0..n)
            .map(|_| instance(&clock, Some(store.clone() as Arc<dyn SharedStore>)))
            .collect();
        let mut running: Vec<Vec<(HoldId, HoldGuard)>> = (0..n).map(|_| Vec::new()).collect();
        let mut dead = vec![false; n];
        let mut renewed: HashMap<HoldId, u64> = HashMap::new();
        let mut expected = Expected::default();
        let probe = request(max);
        block_on(async {
            for s in steps {
                let now = clock.now_ms();
                match s {
                    Step::Admit(i) | Step::Cancel(i) | Step::Keep(i) | Step::Finish(i, _) | Step::Die(i)
                        if i >= n || dead[i] => {}
                    Step::Admit(i) => {
                        let c = request(max);
                        let id = c.hold.unwrap();
                        if let Some(guard) = admit(&fleet[i], &c).await {
                            prop_assert!(expected.live(now) < max, "admitted beyond the limit");
                            expected.holds.insert(id, (now + TTL_MS, i, None));
                            renewed.insert(id, now);
                            running[i].push((id, guard));
                        } else {
                            prop_assert_eq!(expected.live(now), max, "refused below the limit");
                        }
                    }
                    Step::Finish(i, k) => {
                        if !running[i].is_empty() {
                            let len = running[i].len();
                            let (id, guard) = running[i].remove(k % len);
                            drop(guard);
                            if let Some(h) = expected.holds.get_mut(&id) {
                                h.2 = Some(now);
                            }
                        }
                    }
                    Step::Cancel(i) => {
                        let c = request(max);
                        let id = c.hold.unwrap();
                        let guard = fleet[i].watch_holds(std::slice::from_ref(&c));
                        let taken = store.decide_now(&[&c], Gate::Open).0[0].allowed;
                        drop(guard);
                        if taken {
                            expected.holds.insert(id, (now + TTL_MS, i, Some(now + 2 * TIMEOUT_MS)));
                        }
                    }
                    Step::Keep(i) => {
                        fleet[i].keep_holds().await;
                        expected.holds.retain(|_, (_, owner, due)| {
                            !(*owner == i && due.is_some_and(|d| d <= now))
                        });
                        for (id, (expiry, owner, due)) in expected.holds.iter_mut() {
                            let last = renewed.get(id).copied().unwrap_or(0);
                            if *owner == i && due.is_none() && now >= last + TTL_MS / 3 {
                                renewed.insert(*id, now);
                                if *expiry > now {
                                    *expiry = now + TTL_MS;
                                }
                            }
                        }
                    }
                    Step::Die(i) => {
                        dead[i] = true;
                        for (_, guard) in running[i].drain(..) {
                            std::mem::forget(guard);
                        }
                    }
                    Step::Advance(ms) => clock.advance(ms),
                }
                let now = clock.now_ms();
                let held = counted(&store, &probe);
                prop_assert!(held <= max, "{held} holds of {max}");
                prop_assert_eq!(held, expected.live(now));
            }
            // Every survivor's requests end; the dead instances' holds
            // run out.
            for (i, limiter) in fleet.iter().enumerate().filter(|(i, _)| !dead[*i]) {
                running[i].clear();
                clock.advance(2 * TIMEOUT_MS);
                limiter.keep_holds().await;
                prop_assert_eq!(limiter.holds_kept(), 0);
            }
            clock.advance(TTL_MS);
            prop_assert_eq!(counted(&store, &probe), 0);
            Ok(())
        })?;
    }
}

/// A store that is down: every call fails.
struct Down;

/// It keeps no records either.
impl RecordStore for Down {}

#[async_trait::async_trait]
impl LimitStore for Down {
    async fn decide(
        &self,
        _: &[&Charge],
        _: Gate,
    ) -> Result<Vec<Verdict>, crate::limits::StoreError> {
        Err(crate::limits::StoreError::Connection("refused".into()))
    }

    async fn give_back(&self, _: &[&Charge], _: u64) -> Result<(), crate::limits::StoreError> {
        Err(crate::limits::StoreError::Connection("refused".into()))
    }
}

#[test]
fn while_the_store_fails_a_local_fallback_holds_its_share_and_releases_it() {
    let clock = ManualClock::new(1_000);
    // Two instances expected: each holds half of four.
    let limiter = instance(&clock, Some(Arc::new(Down) as Arc<dyn SharedStore>));
    let c = || Charge {
        on_store_error: crate::limits::OnStoreError::Local,
        ..request(4)
    };
    block_on(async {
        let first = admit(&limiter, &c()).await.expect("one of two");
        let _second = admit(&limiter, &c()).await.expect("two of two");
        assert!(admit(&limiter, &c()).await.is_none(), "half of four");
        drop(first);
        assert!(
            admit(&limiter, &c()).await.is_some(),
            "released from the fallback's own key"
        );
    });
}

#[test]
fn a_shadow_limit_holds_what_it_admits_and_never_refuses() {
    let clock = ManualClock::new(1_000);
    let store = Arc::new(MemoryStore::new(clock.clone()));
    let limiter = instance(&clock, Some(store.clone() as Arc<dyn SharedStore>));
    let c = || Charge {
        mode: crate::limits::Mode::Shadow,
        ..request(1)
    };
    block_on(async {
        let charges = [c()];
        let kept = limiter.watch_holds(&charges);
        let verdicts = limiter.decide(&charges).await;
        limiter.holds_decided(&charges, &verdicts);
        assert!(verdicts[0].allowed);
        let over = [c()];
        let guard = limiter.watch_holds(&over);
        let verdicts = limiter.decide(&over).await;
        limiter.holds_decided(&over, &verdicts);
        assert!(!verdicts[0].allowed, "over the limit");
        let decision = crate::limits::combine(&over, &verdicts, crate::limits::Group::Request);
        assert_eq!(
            decision,
            crate::limits::Decision::Allow,
            "a shadow limit never refuses"
        );
        assert_eq!(limiter.holds_kept(), 1, "only the admitted request holds");
        drop((kept, guard));
        limiter.keep_holds().await;
        assert_eq!(counted(&store, &charges[0]), 0);
    });
}
