//! The limiter against a scripted store, on a clock moved by hand and in
//! paused tokio time: merging, refunds, failure modes and the breaker,
//! without Redis and without waiting.

use std::collections::VecDeque;
use std::sync::Mutex;

use async_trait::async_trait;

use super::*;
use crate::clock::ManualClock;
use crate::limits::{Group, LimitStore, OnStoreError};
use crate::testing::{bucket_params, charge, local_charge};

/// One scripted answer of the fake store.
enum Answer {
    /// One verdict per charge: admitted or not.
    Verdicts(Vec<bool>),
    Fail(StoreError),
    /// Answers nothing: the store's own bound ends the call after its
    /// timeout, as a Redis store's does.
    Silent,
    /// Answers with no verdicts at all.
    Short,
}

/// A store that answers from a script and records what it was asked.
#[derive(Default)]
struct FakeStore {
    answers: Mutex<VecDeque<Answer>>,
    /// For each call: the charges' keys and the gate it was given.
    calls: Mutex<Vec<(Vec<String>, Gate)>>,
    /// For each call: each charge's cost and operation.
    ops: Mutex<Vec<Vec<(u64, Op)>>>,
    /// For each give-back: the keys and costs given back, and when they
    /// were spent.
    given_back: Mutex<Vec<GivenBack>>,
}

/// It keeps no records.
impl crate::limits::RecordStore for FakeStore {}

/// The keys and costs of one give-back, and the store time they were
/// spent at.
type GivenBack = (Vec<(String, u64)>, u64);

impl FakeStore {
    fn answering(answers: impl IntoIterator<Item = Answer>) -> Arc<Self> {
        Arc::new(Self {
            answers: Mutex::new(answers.into_iter().collect()),
            ..Self::default()
        })
    }

    fn calls(&self) -> Vec<(Vec<String>, Gate)> {
        self.calls.lock().unwrap().clone()
    }
}

fn store_verdict(allowed: bool) -> Verdict {
    Verdict {
        allowed,
        remaining: u64::from(allowed),
        wait_ms: (!allowed).then_some(1_000),
        reset_ms: 1_000,
        source: Source::Store,
        granted: 0,
        at: 0,
        delay_ms: 0,
        uncharged: 0,
        reclaimed: 0,
    }
}

#[async_trait]
impl LimitStore for FakeStore {
    async fn decide(
        &self,
        charges: &[&Charge],
        blocked_from: Gate,
    ) -> Result<Vec<Verdict>, StoreError> {
        let keys = charges.iter().map(|c| c.key.clone()).collect();
        self.calls.lock().unwrap().push((keys, blocked_from));
        let ops = charges.iter().map(|c| (c.cost, c.op)).collect();
        self.ops.lock().unwrap().push(ops);
        let answer = self.answers.lock().unwrap().pop_front();
        match answer.expect("a scripted answer for every call") {
            Answer::Verdicts(v) => Ok(v.into_iter().map(store_verdict).collect()),
            Answer::Fail(e) => Err(e),
            Answer::Silent => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Err(StoreError::Timeout)
            }
            Answer::Short => Ok(Vec::new()),
        }
    }

    async fn give_back(&self, charges: &[&Charge], spent_at: u64) -> Result<(), StoreError> {
        let back = charges.iter().map(|c| (c.key.clone(), c.cost)).collect();
        self.given_back.lock().unwrap().push((back, spent_at));
        Ok(())
    }
}

/// A local charge of `group` against a bucket of `capacity`.
fn local(key: &str, group: Group, capacity: u64) -> Charge {
    Charge {
        group,
        ..local_charge(key, key, bucket_params(capacity, 1), 1)
    }
}

/// A shared charge of `group` with its failure mode.
fn shared(key: &str, group: Group, on_store_error: OnStoreError) -> Charge {
    Charge {
        group,
        on_store_error,
        ..charge(key, key, bucket_params(4, 1), 1)
    }
}

struct Setup {
    limiter: Limiter<ManualClock>,
    clock: ManualClock,
    metrics: Arc<Metrics>,
}

fn limiter(store: Option<Arc<FakeStore>>) -> Setup {
    let clock = ManualClock::new(1_000_000);
    let metrics = Arc::new(Metrics::new());
    let shared = store.map(|store| Shared {
        store,
        breaker: Breaker::new(2, Duration::from_secs(1)),
        timeout: Duration::from_millis(20),
        instances: 2,
    });
    let local = Arc::new(MemoryStore::new(clock.clone()));
    Setup {
        limiter: Limiter::with_clock(clock.clone(), local, shared, metrics.clone()),
        clock,
        metrics,
    }
}

fn allowed(verdicts: &[Verdict]) -> Vec<bool> {
    verdicts.iter().map(|v| v.allowed).collect()
}

fn errors(metrics: &Metrics, reason: &str) -> u64 {
    metrics.store_errors.with_label_values(&[reason]).get()
}

#[tokio::test(start_paused = true)]
async fn without_a_store_every_charge_is_decided_here() {
    let s = limiter(None);
    let charges = [
        local("a", Group::Request, 1),
        shared("b", Group::Request, OnStoreError::Closed),
    ];
    assert_eq!(allowed(&s.limiter.decide(&charges).await), [true, true]);
    assert_eq!(allowed(&s.limiter.decide(&charges).await), [false, true]);
}

#[tokio::test(start_paused = true)]
async fn verdicts_come_back_in_the_charges_order() {
    let store = FakeStore::answering([Answer::Verdicts(vec![false, true])]);
    let s = limiter(Some(store.clone()));
    let charges = [
        shared("s1", Group::Request, OnStoreError::Closed),
        local("l1", Group::Request, 5),
        shared("s2", Group::Request, OnStoreError::Closed),
    ];
    let verdicts = s.limiter.decide(&charges).await;
    assert_eq!(allowed(&verdicts), [false, true, true]);
    assert_eq!(
        store.calls(),
        [(vec!["s1".into(), "s2".into()], Gate::Open)]
    );
}

#[tokio::test(start_paused = true)]
async fn a_local_denial_blocks_its_group_in_the_store_call() {
    let store = FakeStore::answering([Answer::Verdicts(vec![true]), Answer::Verdicts(vec![true])]);
    let s = limiter(Some(store.clone()));
    let charges = [
        local("ip", Group::PreAuth, 1),
        shared("tenant", Group::Request, OnStoreError::Closed),
    ];
    s.limiter.decide(&charges).await;
    let verdicts = s.limiter.decide(&charges).await;
    assert_eq!(allowed(&verdicts), [false, true]);
    let gates: Vec<Gate> = store.calls().into_iter().map(|(_, g)| g).collect();
    assert_eq!(gates, [Gate::Open, Gate::SHUT]);
}

#[tokio::test(start_paused = true)]
async fn a_store_denial_gives_back_the_local_charges_of_its_group() {
    let store = FakeStore::answering([
        Answer::Verdicts(vec![false]),
        Answer::Verdicts(vec![true]),
        Answer::Verdicts(vec![true]),
    ]);
    let s = limiter(Some(store));
    // The local limit holds one unit: the denied decision must not spend it.
    let charges = [
        local("mine", Group::Request, 1),
        shared("theirs", Group::Request, OnStoreError::Closed),
    ];
    assert_eq!(allowed(&s.limiter.decide(&charges).await), [true, false]);
    assert_eq!(allowed(&s.limiter.decide(&charges).await), [true, true]);
    assert_eq!(allowed(&s.limiter.decide(&charges).await), [false, true]);
}

#[tokio::test(start_paused = true)]
async fn a_timeout_switches_each_limit_to_its_failure_mode() {
    let store = FakeStore::answering([Answer::Silent]);
    let s = limiter(Some(store));
    let charges = [
        local("mine", Group::Request, 1),
        shared("open", Group::Request, OnStoreError::Open),
        shared("closed", Group::Request, OnStoreError::Closed),
        shared("fallback", Group::Request, OnStoreError::Local),
    ];
    let verdicts = s.limiter.decide(&charges).await;
    let sources: Vec<Source> = verdicts.iter().map(|v| v.source).collect();
    assert_eq!(
        sources,
        [
            Source::Store,
            Source::FailOpen,
            Source::FailClosed,
            Source::Fallback
        ]
    );
    // The closed limit blocks its group: nothing of it is spent, so the
    // local limit's one unit is still there once the store answers.
    assert_eq!(allowed(&verdicts), [true, true, false, true]);
    assert_eq!(errors(&s.metrics, "timeout"), 1);
    let again = [local("mine", Group::Request, 1)];
    assert_eq!(allowed(&s.limiter.decide(&again).await), [true]);
}

#[tokio::test(start_paused = true)]
async fn a_shed_decision_charges_nothing_and_never_trips_the_breaker() {
    let late = || Answer::Fail(StoreError::Overloaded(Overload::Wait));
    let store = FakeStore::answering([late(), late(), late(), Answer::Verdicts(vec![true, true])]);
    let s = limiter(Some(store.clone()));
    let charges = [
        local("mine", Group::PreAuth, 1),
        shared("open", Group::Request, OnStoreError::Open),
        shared("fallback", Group::Request, OnStoreError::Local),
    ];
    // Three late decisions in a row, over a breaker that opens after two
    // failures: every one is shed, none decided by a failure mode.
    for _ in 0..3 {
        let verdicts = s.limiter.decide(&charges).await;
        assert!(verdicts
            .iter()
            .all(|v| v.source == Source::Shed(Overload::Wait) && !v.allowed));
    }
    assert_eq!(
        s.metrics.store_circuit_open.get(),
        0,
        "overload is no failure"
    );
    assert_eq!(store.calls().len(), 3, "every decision went to the store");
    assert_eq!(
        errors(&s.metrics, "timeout") + errors(&s.metrics, "store_wait"),
        0
    );
    assert_eq!(
        s.metrics.store_call_seconds.get_sample_count(),
        0,
        "a shed decision is no store call"
    );
    // The local unit was given back each time: the next decision has it.
    let verdicts = s.limiter.decide(&charges).await;
    assert_eq!(allowed(&verdicts), [true, true, true]);
    assert_eq!(s.metrics.store_call_seconds.get_sample_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_was_shed_lets_the_next_call_probe() {
    let down = || Answer::Fail(StoreError::Connection("down".into()));
    let late = Answer::Fail(StoreError::Overloaded(Overload::Pending));
    let store = FakeStore::answering([down(), down(), late, Answer::Verdicts(vec![true])]);
    let s = limiter(Some(store.clone()));
    let charges = [shared("x", Group::Request, OnStoreError::Closed)];
    for _ in 0..2 {
        s.limiter.decide(&charges).await;
    }
    assert_eq!(s.metrics.store_circuit_open.get(), 1);
    s.clock.advance(1_000);
    let v = s.limiter.decide(&charges).await;
    assert_eq!(v[0].source, Source::Shed(Overload::Pending));
    let v = s.limiter.decide(&charges).await;
    assert_eq!(v[0].source, Source::Store, "the next call was the probe");
    assert_eq!(s.metrics.store_circuit_open.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_local_fallback_holds_a_share_of_the_budget() {
    let store = FakeStore::answering([
        Answer::Fail(StoreError::Connection("down".into())),
        Answer::Fail(StoreError::Connection("down".into())),
    ]);
    let s = limiter(Some(store));
    // Capacity 4 over 2 instances: 2 here.
    let charges = [shared("fallback", Group::Request, OnStoreError::Local)];
    let mut admitted = 0;
    for _ in 0..5 {
        admitted += usize::from(s.limiter.decide(&charges).await[0].allowed);
    }
    assert_eq!(admitted, 2);
    assert_eq!(errors(&s.metrics, "connection"), 2);
    assert_eq!(errors(&s.metrics, "circuit_open"), 3);
}

#[tokio::test(start_paused = true)]
async fn a_reply_of_the_wrong_length_is_a_store_failure() {
    let store = FakeStore::answering([Answer::Short]);
    let s = limiter(Some(store));
    let verdicts = s
        .limiter
        .decide(&[shared("x", Group::Request, OnStoreError::Open)])
        .await;
    assert_eq!(verdicts[0].source, Source::FailOpen);
    assert_eq!(errors(&s.metrics, "reply"), 1);
}

#[tokio::test(start_paused = true)]
async fn the_breaker_opens_then_lets_one_probe_through() {
    let down = || Answer::Fail(StoreError::Connection("down".into()));
    let store = FakeStore::answering([down(), down(), Answer::Verdicts(vec![true])]);
    let s = limiter(Some(store.clone()));
    let charges = [shared("x", Group::Request, OnStoreError::Closed)];
    for _ in 0..3 {
        let v = s.limiter.decide(&charges).await;
        assert_eq!(v[0].source, Source::FailClosed);
    }
    assert_eq!(store.calls().len(), 2, "no call while the circuit is open");
    assert_eq!(s.metrics.store_circuit_open.get(), 1);
    assert_eq!(s.limiter.unavailable_retry_after(), 1);

    s.clock.advance(1_000);
    let v = s.limiter.decide(&charges).await;
    assert_eq!(v[0].source, Source::Store, "the probe went through");
    assert_eq!(store.calls().len(), 3);
    assert_eq!(s.metrics.store_circuit_open.get(), 0);
}

/// The default debt bound of a route whose `max` is its estimate: each
/// limit's capacity.
const DEBT: DebtBound = DebtBound {
    explicit: None,
    default: 0,
};

/// What the local bucket of `key` (capacity 4) has left: a decision of
/// cost 0 reads it.
fn local_left(limiter: &Limiter<ManualClock>, key: &str) -> u64 {
    let probe = Charge {
        cost: 0,
        ..local(key, Group::Request, 4)
    };
    limiter.local.decide_now(&[probe], Gate::Open).0[0].remaining
}

#[tokio::test(start_paused = true)]
async fn a_larger_actual_cost_is_forced_on_every_charge() {
    let store = FakeStore::answering([Answer::Verdicts(vec![true]), Answer::Verdicts(vec![true])]);
    let setup = limiter(Some(store.clone()));
    let charges = vec![
        local("credential", Group::Request, 4),
        shared("tenant", Group::Request, OnStoreError::Closed),
    ];
    let verdicts = setup.limiter.decide(&charges).await;
    assert_eq!(allowed(&verdicts), vec![true, true]);
    assert_eq!(local_left(&setup.limiter, "credential"), 3);

    let charged: Vec<(Charge, u64)> = charges.iter().map(|c| (c.clone(), 7)).collect();
    let uncharged = setup.limiter.reconcile(&charged, 5, DEBT).await;
    assert_eq!(uncharged, 0, "a bucket of 4 takes a debt of 4");
    // Forced into debt: the bucket of 4 holds nothing now, whatever it
    // held.
    assert_eq!(local_left(&setup.limiter, "credential"), 0);
    let ops = store.ops.lock().unwrap().clone();
    assert_eq!(ops.len(), 2, "one decision, then one settlement call");
    assert_eq!(
        ops[1],
        vec![(5, Op::Force { max_debt: 4 })],
        "the shared charge, forced by the difference"
    );
    assert!(store.given_back.lock().unwrap().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_smaller_actual_cost_is_given_back_where_it_was_spent() {
    let store = FakeStore::answering([]);
    let setup = limiter(Some(store.clone()));
    let charges = [
        Charge {
            cost: 3,
            ..local("credential", Group::Request, 4)
        },
        Charge {
            cost: 3,
            ..shared("tenant", Group::Request, OnStoreError::Closed)
        },
    ];
    let (_, spent_at) = setup.limiter.local.decide_now(&charges[..1], Gate::Open);
    assert_eq!(local_left(&setup.limiter, "credential"), 1);
    let charged = vec![(charges[0].clone(), spent_at), (charges[1].clone(), 99)];
    setup.limiter.reconcile(&charged, -2, DEBT).await;
    assert_eq!(local_left(&setup.limiter, "credential"), 3, "2 of 3 back");
    assert_eq!(
        store.given_back.lock().unwrap().clone(),
        vec![(vec![("tenant".to_string(), 2)], 99)],
        "given back at the store time it was spent"
    );
    assert!(store.calls().is_empty(), "a give-back decides nothing");
}

#[tokio::test(start_paused = true)]
async fn a_cost_that_was_right_settles_nothing() {
    let store = FakeStore::answering([]);
    let setup = limiter(Some(store.clone()));
    let charged = vec![(shared("tenant", Group::Request, OnStoreError::Closed), 5)];
    setup.limiter.reconcile(&charged, 0, DEBT).await;
    assert!(store.calls().is_empty());
    assert!(store.given_back.lock().unwrap().is_empty());
}
