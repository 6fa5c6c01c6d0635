use super::*;
use crate::clock::ManualClock;
use crate::limits::algorithm::{Bucket, Window, MICRO};
use crate::limits::{combine, Decision};

fn charge(name: &str, key: &str, params: Params, cost: u64, enforce: bool) -> Charge {
    Charge {
        limit: 0,
        name: name.into(),
        params,
        key: key.into(),
        cost,
        enforce,
    }
}

fn bucket(capacity: u64, per_second: u64) -> Params {
    Params::TokenBucket(Bucket {
        capacity: capacity * MICRO,
        per_ms: per_second * 1000,
    })
}

#[test]
fn a_denial_by_one_limit_charges_none() {
    let store = MemoryStore::new(ManualClock::new(1_000));
    let small = charge("tenant", "t", bucket(1, 1), 1, true);
    let big = charge("credential", "c", bucket(10, 1), 1, true);
    assert_eq!(
        combine(
            &[small.clone(), big.clone()],
            &store.decide_now(&[small.clone(), big.clone()])
        ),
        Decision::Allow
    );
    let denied = store.decide_now(&[small.clone(), big.clone()]);
    assert!(!denied[0].allowed && denied[1].allowed);
    assert_eq!(
        denied[1].remaining, 9,
        "the credential bucket was not charged"
    );
    // Alone, the credential bucket still has its 9 tokens.
    let alone = store.decide_now(&[big]);
    assert_eq!(alone[0].remaining, 8);
}

#[test]
fn shadow_limits_never_gate() {
    let store = MemoryStore::new(ManualClock::new(1_000));
    let shadow = charge("shadow", "s", bucket(1, 1), 1, false);
    let real = charge("real", "r", bucket(5, 1), 1, true);
    for _ in 0..3 {
        let v = store.decide_now(&[shadow.clone(), real.clone()]);
        assert_eq!(
            combine(&[shadow.clone(), real.clone()], &v),
            Decision::Allow
        );
    }
    let v = store.decide_now(&[shadow.clone(), real.clone()]);
    assert!(!v[0].allowed, "the shadow limit reports what it would do");
    assert_eq!(v[1].remaining, 1);
}

#[test]
fn retry_after_is_the_longest_wait_in_whole_seconds() {
    // At 1 s into a 10 s window the window limit waits 9 s, the bucket 1 s.
    let store = MemoryStore::new(ManualClock::new(1_000));
    let a = charge("a", "a", bucket(1, 1), 1, true);
    let b = charge(
        "b",
        "b",
        Params::FixedWindow(Window {
            limit: 1,
            window_ms: 10_000,
        }),
        1,
        true,
    );
    store.decide_now(&[a.clone(), b.clone()]);
    let both = [a, b];
    let d = combine(&both, &store.decide_now(&both));
    assert_eq!(
        d,
        Decision::Deny {
            violated: vec!["a".into(), "b".into()],
            retry_after: Some(9)
        }
    );
}

#[test]
fn expired_keys_are_swept() {
    let clock = ManualClock::new(1_000);
    let store = MemoryStore::new(clock.clone());
    for i in 0..100 {
        store.decide_now(&[charge("ip", &format!("k{i}"), bucket(10, 10), 1, true)]);
    }
    assert_eq!(store.len(), 100);
    clock.advance(500);
    store.sweep();
    assert_eq!(store.len(), 100, "not yet refilled plus slack");
    clock.advance(1_000);
    store.sweep();
    assert_eq!(store.len(), 0);
}

#[test]
fn changed_parameters_keep_the_spent_budget() {
    let store = MemoryStore::new(ManualClock::new(1_000));
    store.decide_now(&[charge("l", "k", bucket(10, 1), 8, true)]);
    let v = store.decide_now(&[charge("l", "k", bucket(5, 1), 1, true)]);
    assert!(v[0].allowed);
    assert_eq!(v[0].remaining, 1, "2 left of the old bucket, minus 1");
}
