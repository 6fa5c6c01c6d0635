use super::*;
use crate::clock::ManualClock;
use crate::limits::algorithm::{Bucket, Window, MICRO};
use crate::limits::{combine, Decision, Gate, Group};
use crate::testing::{bucket_params, local_charge};

fn decide(store: &MemoryStore<ManualClock>, charges: &[Charge]) -> Vec<Verdict> {
    store.decide_now(charges, Gate::Open).0
}

#[test]
fn a_denial_by_one_limit_charges_none() {
    let store = MemoryStore::new(ManualClock::new(1_000));
    let both = [
        local_charge("tenant", "t", bucket_params(1, 1), 1),
        local_charge("credential", "c", bucket_params(10, 1), 1),
    ];
    assert_eq!(
        combine(&both, &decide(&store, &both), Group::Request),
        Decision::Allow
    );
    let denied = decide(&store, &both);
    assert!(!denied[0].allowed && denied[1].allowed);
    assert_eq!(
        denied[1].remaining, 9,
        "the credential bucket was not charged"
    );
    let alone = decide(&store, &both[1..]);
    assert_eq!(alone[0].remaining, 8);
}

#[test]
fn shadow_limits_never_gate() {
    let store = MemoryStore::new(ManualClock::new(1_000));
    let pair = [
        Charge {
            mode: crate::limits::Mode::Shadow,
            ..local_charge("shadow", "s", bucket_params(1, 1), 1)
        },
        local_charge("real", "r", bucket_params(5, 1), 1),
    ];
    for _ in 0..3 {
        assert_eq!(
            combine(&pair, &decide(&store, &pair), Group::Request),
            Decision::Allow
        );
    }
    let v = decide(&store, &pair);
    assert!(!v[0].allowed, "the shadow limit reports what it would do");
    assert_eq!(v[1].remaining, 1);
}

#[test]
fn a_failed_earlier_group_blocks_later_ones_but_keeps_its_own_charges() {
    let store = MemoryStore::new(ManualClock::new(1_000));
    let mut ip = local_charge("ip", "ip", bucket_params(2, 1), 1);
    ip.group = Group::PreAuth;
    let tenant = local_charge("tenant", "t", bucket_params(5, 1), 1);
    let spent = [local_charge("spent", "x", bucket_params(1, 1), 1)];
    decide(&store, &spent);
    // Group 1 fails on `spent`: the ip limit (group 0) is still charged.
    let v = decide(&store, &[ip.clone(), tenant.clone(), spent[0].clone()]);
    assert_eq!((v[0].remaining, v[1].remaining), (1, 5));
    // Group 0 fails: nothing in group 1 is charged either.
    let blocked = store
        .decide_now(&[ip.clone(), tenant.clone()], Gate::SHUT)
        .0;
    assert_eq!((blocked[0].remaining, blocked[1].remaining), (1, 5));
}

#[test]
fn refunds_give_back_exactly_what_was_spent() {
    let clock = ManualClock::new(5_000);
    let store = MemoryStore::new(clock.clone());
    let charges = [
        local_charge("b", "b", bucket_params(5, 1), 2),
        local_charge(
            "g",
            "g",
            Params::Gcra(Bucket {
                capacity: 5 * MICRO,
                per_ms: 1_000,
            }),
            2,
        ),
        local_charge(
            "f",
            "f",
            Params::FixedWindow(Window {
                limit: 5,
                window_ms: 10_000,
            }),
            2,
        ),
        local_charge(
            "s",
            "s",
            Params::SlidingWindow(Window {
                limit: 5,
                window_ms: 10_000,
            }),
            2,
        ),
        local_charge(
            "l",
            "l",
            Params::SlidingLog(Window {
                limit: 5,
                window_ms: 10_000,
            }),
            2,
        ),
    ];
    let (_, at) = store.decide_now(&charges, Gate::Open);
    clock.advance(1);
    store.refund(&charges, at);
    for v in decide(&store, &charges) {
        assert!(v.allowed);
        assert_eq!(v.remaining, 3, "{v:?}");
    }
}

#[test]
fn retry_after_is_the_longest_wait_in_whole_seconds() {
    // At 1 s into a 10 s window the window limit waits 9 s, the bucket 1 s.
    let store = MemoryStore::new(ManualClock::new(1_000));
    let both = [
        local_charge("a", "a", bucket_params(1, 1), 1),
        local_charge(
            "b",
            "b",
            Params::FixedWindow(Window {
                limit: 1,
                window_ms: 10_000,
            }),
            1,
        ),
    ];
    decide(&store, &both);
    assert_eq!(
        combine(&both, &decide(&store, &both), Group::Request),
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
        decide(
            &store,
            &[local_charge(
                "ip",
                &format!("k{i}"),
                bucket_params(10, 10),
                1,
            )],
        );
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
    decide(&store, &[local_charge("l", "k", bucket_params(10, 1), 8)]);
    let v = decide(&store, &[local_charge("l", "k", bucket_params(5, 1), 1)]);
    assert!(v[0].allowed);
    assert_eq!(v[0].remaining, 1, "2 left of the old bucket, minus 1");
}

#[test]
fn a_refused_request_leaves_no_new_key() {
    let store = MemoryStore::new(ManualClock::new(1_000));
    let spent = local_charge("credential", "c", bucket_params(1, 1), 1);
    decide(&store, std::slice::from_ref(&spent));
    assert_eq!(store.len(), 1);
    // The credential is spent: every new end user is refused with it, and
    // none of them is kept.
    for i in 0..20 {
        let user = local_charge("end-user", &format!("u{i}"), bucket_params(5, 1), 1);
        let v = decide(&store, &[spent.clone(), user]);
        assert!(!v[0].allowed && v[1].allowed);
    }
    assert_eq!(store.len(), 1);
    // A refused key that held state keeps it.
    let user = local_charge("end-user", "kept", bucket_params(5, 1), 1);
    decide(&store, std::slice::from_ref(&user));
    decide(&store, &[spent.clone(), user.clone()]);
    assert_eq!(store.len(), 2);
    assert_eq!(decide(&store, &[user])[0].remaining, 3);
}
