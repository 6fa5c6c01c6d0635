//! Leases through the limiter, with an in-process store standing in for
//! Redis and a clock moved by hand: a simulated fleet never spends beyond
//! the budget and under-uses it by at most what its instances hold; a hot
//! key costs a store call per lease, not per request; all-or-nothing holds
//! across leased and other limits; units go back at expiry and on release.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use proptest::prelude::*;

use crate::clock::{Clock, ManualClock};
use crate::limits::algorithm::{Params, MICRO};
use crate::limits::breaker::Breaker;
use crate::limits::limiter::{Limiter, Shared};
use crate::limits::memory::MemoryStore;
use crate::limits::{
    Charge, Gate, LeaseTerms, LimitStore, OnStoreError, StoreError, SyncMode, Verdict,
};
use crate::metrics::Metrics;
use crate::testing::{block_on, bucket_params, charge, local_charge, window};

/// The shared store of the fleet, counting its calls; it can be failed.
struct Store {
    inner: MemoryStore<ManualClock>,
    calls: AtomicU64,
    failing: std::sync::atomic::AtomicBool,
    /// Calls never answer while set.
    stalled: std::sync::atomic::AtomicBool,
    /// Calls holding this key wait for `release`.
    stall: std::sync::Mutex<Option<String>>,
    release: tokio::sync::Notify,
}

/// It keeps no records.
impl crate::limits::RecordStore for Store {}

impl Store {
    fn new(clock: &ManualClock) -> Arc<Self> {
        Arc::new(Self {
            inner: MemoryStore::new(clock.clone()),
            calls: AtomicU64::new(0),
            failing: Default::default(),
            stalled: Default::default(),
            stall: Default::default(),
            release: tokio::sync::Notify::new(),
        })
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn check(&self) -> Result<(), StoreError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Connection("failed by the test".into()));
        }
        Ok(())
    }

    /// What the key has left now, with nothing charged.
    fn left(&self, c: &Charge) -> u64 {
        let probe = Charge {
            cost: 0,
            sync: SyncMode::Exact,
            ..c.clone()
        };
        self.inner.decide_now(&[probe], Gate::Open).0[0].remaining
    }
}

#[async_trait]
impl LimitStore for Store {
    async fn decide(
        &self,
        charges: &[&Charge],
        blocked_from: Gate,
    ) -> Result<Vec<Verdict>, StoreError> {
        self.check()?;
        if self.stalled.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let stall = self.stall.lock().unwrap().clone();
        if charges.iter().any(|c| Some(&c.key) == stall.as_ref()) {
            self.release.notified().await;
        }
        Ok(self.inner.decide_now(charges, blocked_from).0)
    }

    async fn give_back(&self, charges: &[&Charge], spent_at: u64) -> Result<(), StoreError> {
        self.check()?;
        self.inner.refund(charges, spent_at);
        Ok(())
    }
}

/// One gateway of the fleet.
fn instance(clock: &ManualClock, store: &Arc<Store>, instances: u32) -> Limiter<ManualClock> {
    let shared = Shared {
        store: store.clone(),
        breaker: Breaker::new(1_000_000, Duration::from_secs(1)),
        timeout: Duration::from_secs(5),
        instances,
    };
    let local = Arc::new(MemoryStore::new(clock.clone()));
    Limiter::with_clock(clock.clone(), local, Some(shared), Arc::new(Metrics::new()))
}

fn leased(params: Params, units: u64, ttl_ms: u64, cost: u64) -> Charge {
    growing(params, units, units, ttl_ms, cost)
}

/// A leased charge whose lease may grow from `units` to `max_units`.
fn growing(params: Params, units: u64, max_units: u64, ttl_ms: u64, cost: u64) -> Charge {
    Charge {
        sync: SyncMode::Lease(LeaseTerms {
            units,
            ttl_ms,
            max_units,
        }),
        ..charge("hot", "hot", params, cost)
    }
}

/// One arrival: time since the last, the instance it reaches, its cost,
/// and whether that instance's keeper runs right after it (it always runs
/// on its tick, as in the gateway).
type Arrival = (u64, usize, u64, bool);

/// Arrivals costing 1 to `max_cost`, at most `max_gap_ms` apart.
fn arrivals(max_cost: u64, max_gap_ms: u64) -> impl Strategy<Value = Vec<Arrival>> {
    prop::collection::vec(
        (
            prop_oneof![3 => 0u64..5, 1 => 0..=max_gap_ms],
            0usize..4,
            prop_oneof![4 => Just(1u64), 1 => 1..=max_cost],
            prop::bool::weighted(0.3),
        ),
        1..400,
    )
}

/// `n` gateways sharing one store, on one clock.
struct Fleet {
    clock: ManualClock,
    start: u64,
    limiters: Vec<Limiter<ManualClock>>,
}

impl Fleet {
    fn new(n: usize) -> Self {
        let clock = ManualClock::new(1_000_000);
        let store = Store::new(&clock);
        let limiters = (0..n).map(|_| instance(&clock, &store, n as u32)).collect();
        Self {
            start: clock.now_ms(),
            clock,
            limiters,
        }
    }

    /// One arrival of `charge` (its cost set from the arrival): the clock
    /// moves, every keeper running on each tick that passes, as in the
    /// gateway; the instance decides; its keeper runs when asked to.
    /// Whether it was admitted.
    async fn arrive(&self, arrival: &Arrival, charge: &Charge) -> bool {
        const TICK: u64 = 50;
        let &(advance, at, cost, keep) = arrival;
        let end = self.clock.now_ms() + advance;
        while (self.clock.now_ms() / TICK + 1) * TICK <= end {
            self.clock.set((self.clock.now_ms() / TICK + 1) * TICK);
            self.keep_all().await;
        }
        self.clock.set(end);
        let limiter = &self.limiters[at % self.limiters.len()];
        let c = Charge {
            cost,
            ..charge.clone()
        };
        let admitted = limiter.decide(std::slice::from_ref(&c)).await[0].allowed;
        if keep {
            limiter.keep_leases().await;
        }
        admitted
    }

    async fn keep_all(&self) {
        for limiter in &self.limiters {
            limiter.keep_leases().await;
        }
    }

    /// Units held over the fleet.
    fn held(&self) -> u64 {
        self.limiters.iter().map(|l| l.lease_units()).sum()
    }

    /// What a bucket of `capacity` refilling `per_second` allows, at most,
    /// since the start, in micro-units.
    fn budget(&self, capacity: u64, per_second: u64) -> u64 {
        capacity * MICRO + (self.clock.now_ms() - self.start) * per_second * 1000
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// At every prefix the fleet admitted at most capacity + rate × elapsed,
    /// and, under the steady demand a hot key sees, at least what one exact
    /// decider admits of the same arrivals, less two leases per instance:
    /// the units an instance holds, and the units that refill in the store
    /// while it waits, after a refusal or a take that emptied the budget,
    /// for a whole lease to fit (kept there for whoever asks next, so
    /// nothing is lost, only late).
    ///
    /// Two things keep the second bound from holding more widely, and the
    /// next properties cover those cases for overage only: a costly request
    /// can be refused while its cost lies split between the store and a
    /// lease; and when demand pauses long enough for the bucket to refill,
    /// units given back into a full bucket are lost as its refill is.
    #[test]
    fn a_fleet_never_overspends_and_underuses_by_at_most_its_leases(
        n in 1usize..5,
        capacity in 5u64..60,
        per_second in 1u64..80,
        units_share in 1u64..100,
        ttl_ms in 20u64..2_000,
        gcra in any::<bool>(),
        arrivals in arrivals(1, 20),
    ) {
        let units = (capacity * units_share / 100).max(1);
        let params = if gcra {
            Params::Gcra(crate::testing::bucket(capacity, per_second))
        } else {
            bucket_params(capacity, per_second)
        };
        let fleet = Fleet::new(n);
        let hot = leased(params, units, ttl_ms, 1);
        let exact = MemoryStore::new(fleet.clock.clone());
        let (mut admitted, mut ideal) = (0u64, 0u64);
        block_on(async {
            for arrival in &arrivals {
                if fleet.arrive(arrival, &hot).await {
                    admitted += 1;
                }
                let plain = charge("hot", "exact", params, 1);
                if exact.decide_now(&[plain], Gate::Open).0[0].allowed {
                    ideal += 1;
                }
                prop_assert!(admitted * MICRO <= fleet.budget(capacity, per_second));
            }
            let held = fleet.held();
            prop_assert!(held <= n as u64 * units, "held {held}");
            prop_assert!(
                admitted + 2 * n as u64 * units >= ideal,
                "admitted {admitted}, exactly {ideal}, {n} × {units} held at most",
            );
            // Renewals still asked for land; past the lease's time every
            // unit goes back.
            fleet.keep_all().await;
            fleet.clock.advance(ttl_ms);
            fleet.keep_all().await;
            prop_assert_eq!(fleet.held(), 0);
            Ok(())
        })?;
    }

    /// With weighted costs too, the fleet never admits beyond capacity +
    /// rate × elapsed.
    #[test]
    fn weighted_costs_never_overspend(
        n in 1usize..5,
        capacity in 5u64..60,
        per_second in 1u64..80,
        units_share in 1u64..100,
        ttl_ms in 20u64..2_000,
        arrivals in arrivals(4, 400),
    ) {
        let units = (capacity * units_share / 100).max(1);
        let fleet = Fleet::new(n);
        let hot = leased(bucket_params(capacity, per_second), units, ttl_ms, 1);
        let mut admitted = 0u64;
        block_on(async {
            for arrival in &arrivals {
                if fleet.arrive(arrival, &hot).await {
                    admitted += arrival.2;
                }
                prop_assert!(admitted * MICRO <= fleet.budget(capacity, per_second));
                let held = fleet.held();
                prop_assert!(held <= n as u64 * units, "held {held}");
            }
            Ok(())
        })?;
    }

    /// A window lease spends nothing in a window it was not taken in: each
    /// window admits at most its limit across the fleet.
    #[test]
    fn a_window_lease_never_spends_into_the_next_window(
        n in 1usize..5,
        limit in 3u64..40,
        units_share in 1u64..100,
        ttl_ms in 20u64..5_000,
        sliding in any::<bool>(),
        arrivals in arrivals(4, 400),
    ) {
        let units = (limit * units_share / 100).max(1);
        let w = window(limit, 1);
        let params = if sliding { Params::SlidingWindow(w) } else { Params::FixedWindow(w) };
        let fleet = Fleet::new(n);
        let hot = leased(params, units, ttl_ms, 1);
        let mut per_window = std::collections::HashMap::new();
        block_on(async {
            for arrival in &arrivals {
                if fleet.arrive(arrival, &hot).await {
                    let count = per_window.entry(fleet.clock.now_ms() / 1000).or_insert(0);
                    *count += arrival.2;
                    prop_assert!(*count <= limit, "{count} in one window of {limit}");
                }
            }
            Ok(())
        })?;
    }
}

#[tokio::test]
async fn a_hot_key_costs_a_store_call_per_lease_not_per_request() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let c = leased(bucket_params(100_000, 100_000), 50, 1_000, 1);
    for _ in 0..10_000 {
        assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
        limiter.keep_leases().await;
    }
    // One take, then a renewal each time half of the 50 units are spent.
    let calls = store.calls();
    assert!(calls <= 2 + 10_000 / 25, "{calls} store calls");
    assert!(calls >= 10_000 / 50, "{calls} store calls");
}

#[tokio::test]
async fn a_request_holding_nothing_charges_and_takes_in_one_call() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let c = leased(bucket_params(100, 1), 10, 1_000, 3);
    assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
    assert_eq!(store.calls(), 1);
    // The cost and ten units beyond it left the shared budget.
    assert_eq!(store.left(&c), 100 - 3 - 10);
    assert_eq!(limiter.lease_units(), 10);
    // The next three requests spend what is held, with no store call.
    for _ in 0..3 {
        assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
    }
    assert_eq!(store.calls(), 1);
    assert_eq!(limiter.lease_units(), 1);
}

#[tokio::test]
async fn a_denial_elsewhere_holds_the_lease_spend_again() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let hot = leased(bucket_params(100, 1), 10, 1_000, 1);
    assert!(limiter.decide(std::slice::from_ref(&hot)).await[0].allowed);
    let held = limiter.lease_units();
    // A local limit that denies: the leased charge is undone.
    let empty = local_charge("tight", "tight", bucket_params(1, 1), 1);
    let _ = limiter.decide(std::slice::from_ref(&empty)).await;
    let verdicts = limiter.decide(&[hot.clone(), empty]).await;
    assert!(verdicts[0].allowed && !verdicts[1].allowed);
    assert_eq!(limiter.lease_units(), held);
    // A shared exact limit that denies, in the same store call: the same.
    let shared_empty = charge("exact", "exact", bucket_params(1, 1), 1);
    let _ = limiter.decide(std::slice::from_ref(&shared_empty)).await;
    let verdicts = limiter.decide(&[hot, shared_empty]).await;
    assert!(verdicts[0].allowed && !verdicts[1].allowed);
    assert_eq!(limiter.lease_units(), held);
}

#[tokio::test]
async fn a_take_denied_by_another_limit_takes_nothing() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let hot = leased(bucket_params(100, 1), 10, 1_000, 1);
    let shared_empty = charge("exact", "exact", bucket_params(1, 1), 1);
    let _ = limiter.decide(std::slice::from_ref(&shared_empty)).await;
    let verdicts = limiter.decide(&[hot.clone(), shared_empty]).await;
    assert!(verdicts[0].allowed && !verdicts[1].allowed);
    assert_eq!(limiter.lease_units(), 0);
    assert_eq!(
        store.left(&hot),
        100,
        "all or nothing: the take is not charged"
    );
}

#[tokio::test]
async fn unspent_units_go_back_at_expiry_and_on_release() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let c = leased(bucket_params(100, 1), 10, 500, 1);
    assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
    assert_eq!(store.left(&c), 89);
    limiter.keep_leases().await;
    assert_eq!(limiter.lease_units(), 10, "not yet due");
    clock.advance(500);
    limiter.keep_leases().await;
    assert_eq!(limiter.lease_units(), 0);
    // Ten given back; the refill of half a second brings no whole token.
    assert_eq!(store.left(&c), 99);

    assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
    assert_eq!(limiter.lease_units(), 10);
    limiter.release_leases();
    assert_eq!(limiter.lease_units(), 0, "released at once");
    limiter.keep_leases().await;
    assert_eq!(store.left(&c), 98);
}

#[tokio::test]
async fn a_failing_store_leaves_what_is_held_then_the_failure_mode() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let c = Charge {
        on_store_error: OnStoreError::Closed,
        ..leased(bucket_params(100, 1), 4, 60_000, 1)
    };
    assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
    store.failing.store(true, Ordering::SeqCst);
    // Four held: spent without the store.
    for _ in 0..4 {
        assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
    }
    // Nothing held, the store failing: `closed` refuses.
    let v = limiter.decide(std::slice::from_ref(&c)).await;
    assert!(!v[0].allowed);
    assert_eq!(v[0].source, crate::limits::Source::FailClosed);
}

#[tokio::test]
async fn new_numbers_give_the_old_lease_back() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let old = leased(bucket_params(100, 1), 10, 60_000, 1);
    assert!(limiter.decide(std::slice::from_ref(&old)).await[0].allowed);
    let new = leased(bucket_params(50, 1), 10, 60_000, 1);
    assert!(limiter.decide(std::slice::from_ref(&new)).await[0].allowed);
    limiter.keep_leases().await;
    // The new numbers clamp the balance to 50; the new lease took its
    // cost and ten, and the old lease's ten came back.
    assert_eq!(limiter.lease_units(), 10);
    assert_eq!(store.left(&new), 50 - 1 - 10 + 10);
}

#[tokio::test]
async fn a_refused_take_is_remembered_for_at_most_the_lease_time() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    // One token a second; a lease of 2 for 300 ms.
    let c = leased(bucket_params(3, 1), 2, 300, 1);
    for _ in 0..3 {
        assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
    }
    let v = limiter.decide(std::slice::from_ref(&c)).await[0];
    assert!(!v.allowed, "the budget of 3 is spent");
    let calls = store.calls();
    // Refused here while the store said the cost would not fit, up to 300 ms.
    for _ in 0..100 {
        let v = limiter.decide(std::slice::from_ref(&c)).await[0];
        assert!(!v.allowed && v.wait_ms.is_some_and(|w| w > 0));
    }
    assert_eq!(store.calls(), calls);
    clock.advance(300);
    let _ = limiter.decide(std::slice::from_ref(&c)).await;
    assert_eq!(
        store.calls(),
        calls + 1,
        "the store is asked again after ttl_ms"
    );
}

#[tokio::test]
async fn a_lease_grows_under_steady_demand_and_shrinks_when_refused() {
    let clock = ManualClock::new(1_000_000);
    // A budget no test run spends, a request every millisecond.
    let params = bucket_params(100_000, 1_000);
    let run = |max_units: u64| {
        let clock = clock.clone();
        async move { steady(&clock, params, max_units).await }
    };
    async fn steady(clock: &ManualClock, params: Params, max_units: u64) -> (u64, u64) {
        let store = Store::new(clock);
        let limiter = instance(clock, &store, 1);
        let c = growing(params, 10, max_units, 1_000, 1);
        let mut most = 0;
        for _ in 0..2_000 {
            clock.advance(1);
            assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
            limiter.keep_leases().await;
            most = most.max(limiter.lease_units());
        }
        (store.calls(), most)
    }
    let (fixed, fixed_most) = run(10).await;
    let (grown, grown_most) = run(160).await;
    assert!(
        fixed_most <= 10 && grown_most <= 160,
        "{fixed_most} {grown_most}"
    );
    assert!(grown_most > 80, "the lease grew: {grown_most}");
    // About 2 / units calls per request: 2 / 10 fixed, towards 2 / 160.
    assert!(fixed >= 300, "{fixed}");
    assert!(grown * 5 < fixed, "{grown} calls grown, {fixed} fixed");

    // Refused: back to the smallest lease.
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let small = bucket_params(60, 1);
    let c = growing(small, 10, 40, 1_000, 1);
    let mut admitted = 0;
    for _ in 0..100 {
        clock.advance(1);
        admitted += u64::from(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
        limiter.keep_leases().await;
    }
    assert!(admitted <= 60, "never beyond the budget: {admitted}");
    assert!(
        limiter.lease_units() <= 10,
        "shrunk to units: {}",
        limiter.lease_units()
    );
}

#[tokio::test]
async fn a_refusal_is_remembered_until_a_whole_lease_would_fit() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    // A hundred tokens a second, a lease of 10 for a minute.
    let c = leased(bucket_params(20, 100), 10, 60_000, 1);
    let mut admitted = 0;
    for _ in 0..30 {
        admitted += u64::from(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
    }
    assert_eq!(admitted, 20, "the budget of 20, and not one more");
    let calls = store.calls();
    // The cost fits again in 10 ms, a whole lease in 100 ms: asked again
    // only then, whatever the demand.
    for _ in 0..9 {
        clock.advance(10);
        for _ in 0..50 {
            assert!(!limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
        }
    }
    assert_eq!(store.calls(), calls, "no call while a lease would not fit");
    clock.advance(10);
    assert!(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
    assert_eq!(store.calls(), calls + 1);
    // What refilled meanwhile was taken, not lost: ten spent here.
    let mut spent = 1;
    while limiter.decide(std::slice::from_ref(&c)).await[0].allowed {
        spent += 1;
    }
    assert_eq!(spent, 10);
}

#[tokio::test]
async fn a_remembered_refusal_charges_no_local_limit_of_its_group() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let hot = leased(bucket_params(1, 1), 1, 1_000, 1);
    let local = local_charge("local", "local", bucket_params(5, 1), 1);
    assert!(limiter.decide(std::slice::from_ref(&hot)).await[0].allowed);
    // Refused by the store once, then remembered: the local limit of the
    // same request is never charged.
    for _ in 0..10 {
        let v = limiter.decide(&[hot.clone(), local.clone()]).await;
        assert!(!v[0].allowed && v[1].allowed);
    }
    let v = limiter.decide(std::slice::from_ref(&local)).await;
    assert_eq!(v[0].remaining, 4, "the local budget of 5 is whole");
}

#[tokio::test]
async fn a_spend_undone_after_its_window_ended_is_not_held_in_the_next() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = Arc::new(instance(&clock, &store, 1));
    let hot = leased(Params::FixedWindow(window(100, 1)), 10, 60_000, 1);
    // An exact limit that denies from its second request on.
    let never_refills = Params::TokenBucket(crate::limits::algorithm::Bucket {
        capacity: MICRO,
        per_ms: 1,
    });
    let exact = charge("exact", "exact", never_refills, 1);
    let _ = limiter.decide(std::slice::from_ref(&exact)).await;
    for _ in 0..10 {
        assert!(limiter.decide(std::slice::from_ref(&hot)).await[0].allowed);
    }
    assert_eq!(limiter.lease_units(), 1);
    // R1 spends the last unit of this window's lease, and waits on the
    // store for its exact limit.
    *store.stall.lock().unwrap() = Some("exact".into());
    let before = store.calls();
    let r1 = {
        let (limiter, hot, exact) = (limiter.clone(), hot.clone(), exact.clone());
        tokio::spawn(async move { limiter.decide(&[hot, exact]).await })
    };
    while store.calls() == before {
        tokio::task::yield_now().await;
    }
    // Next window: the renewals R1 asked for land there, and some of the
    // new lease is spent.
    clock.advance(1_000);
    limiter.keep_leases().await;
    for _ in 0..2 {
        assert!(limiter.decide(std::slice::from_ref(&hot)).await[0].allowed);
    }
    let held = limiter.lease_units();
    assert!(held > 0 && held < 10, "{held}");
    // R1 is denied: its unit belongs to the last window, not this one.
    store.release.notify_one();
    let v = r1.await.unwrap();
    assert!(v[0].allowed && !v[1].allowed);
    assert_eq!(limiter.lease_units(), held);
}

#[tokio::test]
async fn a_request_dropped_while_taking_leaves_nothing_asked_for() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = instance(&clock, &store, 1);
    let hot = leased(bucket_params(100, 1), 10, 60_000, 1);
    store.stalled.store(true, Ordering::SeqCst);
    let call = limiter.decide(std::slice::from_ref(&hot));
    assert!(tokio::time::timeout(Duration::from_millis(5), call)
        .await
        .is_err());
    store.stalled.store(false, Ordering::SeqCst);
    // The next request takes its cost and a whole lease again.
    assert!(limiter.decide(std::slice::from_ref(&hot)).await[0].allowed);
    assert_eq!(limiter.lease_units(), 10);
}

#[tokio::test]
async fn an_abused_key_costs_each_instance_a_call_per_lease_of_refill() {
    // Three instances share 200 tokens refilling 100 a second in leases of
    // 10; each gets a request every millisecond (30 × the refill), and its
    // keeper runs after each.
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let fleet: Vec<_> = (0..3).map(|_| instance(&clock, &store, 3)).collect();
    let c = leased(bucket_params(200, 100), 10, 1_000, 1);
    let mut admitted = 0;
    let mut calls_after_drain = 0;
    for ms in 0..2_000 {
        if ms == 500 {
            calls_after_drain = store.calls();
        }
        clock.advance(1);
        for limiter in &fleet {
            admitted += u64::from(limiter.decide(std::slice::from_ref(&c)).await[0].allowed);
            limiter.keep_leases().await;
        }
    }
    // Never more than the budget: 200 and two seconds of refill.
    assert!(admitted <= 400, "admitted {admitted}");
    // Under-use within what the instances hold at once.
    assert!(admitted + 3 * 10 >= 400, "admitted {admitted}");
    // Once the first budget is spent, at most one call per instance for
    // each 10 units of refill (every 100 ms), and one per `ttl_ms`.
    let calls = store.calls() - calls_after_drain;
    assert!(calls <= 3 * (15 + 2), "{calls} calls in 1.5 s");
}

#[tokio::test]
async fn requests_finding_the_lease_empty_during_a_take_wait_for_it_and_ask_nothing() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = Arc::new(instance(&clock, &store, 1));
    let hot = leased(bucket_params(100, 1), 10, 60_000, 1);
    // R1 holds nothing: its call charges its cost and takes a lease, and
    // waits on the store; four more come while the take is out.
    let (r1, others) = four_behind_a_take(&store, &limiter, &hot).await;
    assert_eq!(store.calls(), 1, "one call for the five requests");
    // The take lands: the four are paid from it.
    store.release.notify_one();
    assert!(r1.await.unwrap()[0].allowed);
    for r in others {
        assert!(r.await.unwrap()[0].allowed);
    }
    assert_eq!(store.calls(), 1);
    // R1 charged its cost and took a lease of 10 beyond it.
    assert_eq!(limiter.lease_units(), 10 - 4);
}

#[tokio::test]
async fn requests_waiting_for_a_refused_take_are_refused_with_no_call() {
    let clock = ManualClock::new(1_000_000);
    let store = Store::new(&clock);
    let limiter = Arc::new(instance(&clock, &store, 1));
    // A budget of one, spent elsewhere: the next take is refused.
    let hot = leased(bucket_params(1, 1), 10, 60_000, 1);
    let _ = store.inner.decide_now(&[&hot], Gate::Open);
    let (r1, others) = four_behind_a_take(&store, &limiter, &hot).await;
    assert_eq!(store.calls(), 1, "the four wait for the take in flight");
    store.release.notify_one();
    assert!(!r1.await.unwrap()[0].allowed);
    for r in others {
        assert!(!r.await.unwrap()[0].allowed, "refused as remembered");
    }
    assert_eq!(
        store.calls(),
        1,
        "the refusal was remembered, not asked again"
    );
}

/// R1, whose store call (a take for `hot`) is held by the store until
/// `store.release`, and four more requests for `hot` started while it is
/// out, each run until it waits.
async fn four_behind_a_take(
    store: &Store,
    limiter: &Arc<Limiter<ManualClock>>,
    hot: &Charge,
) -> (
    tokio::task::JoinHandle<Vec<Verdict>>,
    Vec<tokio::task::JoinHandle<Vec<Verdict>>>,
) {
    *store.stall.lock().unwrap() = Some("hot".into());
    let r1 = spawn_decide(limiter, hot);
    while store.calls() == 0 {
        tokio::task::yield_now().await;
    }
    let others = (0..4).map(|_| spawn_decide(limiter, hot)).collect();
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    (r1, others)
}

/// One request's decision of `c`, running on its own task.
fn spawn_decide(
    limiter: &Arc<Limiter<ManualClock>>,
    c: &Charge,
) -> tokio::task::JoinHandle<Vec<Verdict>> {
    let (limiter, c) = (limiter.clone(), c.clone());
    tokio::spawn(async move { limiter.decide(std::slice::from_ref(&c)).await })
}
