use super::*;
use crate::testing::{bucket, window};
use proptest::prelude::*;

/// Refresh, check and spend when allowed: one decision on one key.
fn take(p: &Params, s: &mut State, cost: u64, now: u64) -> Check {
    p.refresh(s, now);
    let c = p.check(s, cost, now);
    if c.allowed {
        p.spend(s, cost, now);
    }
    c
}

#[test]
fn token_bucket_starts_full_and_waits_exactly() {
    let p = Params::TokenBucket(bucket(20, 5));
    let mut s = p.fresh(10_000);
    for i in 0..20 {
        let c = take(&p, &mut s, 1, 10_000);
        assert!(c.allowed, "request {i}");
        assert_eq!(c.remaining, 19 - i);
    }
    let denied = take(&p, &mut s, 1, 10_000);
    assert_eq!(denied, Check::deny(0, Some(200)));
    assert!(!take(&p, &mut s, 1, 10_199).allowed);
    assert!(take(&p, &mut s, 1, 10_200).allowed);
}

#[test]
fn token_bucket_refill_is_capped() {
    let p = Params::TokenBucket(bucket(10, 1));
    let mut s = p.fresh(0);
    assert!(take(&p, &mut s, 10, 0).allowed);
    // A day idle refills to capacity, never beyond.
    p.refresh(&mut s, 86_400_000);
    assert_eq!(
        s,
        State::Bucket {
            balance: 10 * MICRO as i64,
            at: 86_400_000
        }
    );
    assert!(!take(&p, &mut s, 11, 86_400_000).allowed);
}

#[test]
fn fractional_rates_refill_without_loss() {
    // 0.5 tokens per second: 500 micro-tokens per millisecond.
    let p = Params::TokenBucket(Bucket {
        capacity: MICRO,
        per_ms: 500,
    });
    let mut s = p.fresh(0);
    assert!(take(&p, &mut s, 1, 0).allowed);
    // Polling every millisecond must not starve the refill.
    for t in 1..2_000 {
        assert!(!take(&p, &mut s, 1, t).allowed, "at {t}");
    }
    assert!(take(&p, &mut s, 1, 2_000).allowed);
}

#[test]
fn cost_larger_than_capacity_never_fits() {
    let p = Params::TokenBucket(bucket(5, 1));
    let mut s = p.fresh(0);
    let c = take(&p, &mut s, 6, 0);
    assert_eq!(c, Check::deny(5, None));
    // And it spent nothing.
    assert!(take(&p, &mut s, 5, 0).allowed);
}

#[test]
fn weighted_cost_spends_several_tokens() {
    let p = Params::TokenBucket(bucket(20, 5));
    let mut s = p.fresh(0);
    for _ in 0..5 {
        assert!(take(&p, &mut s, 4, 0).allowed);
    }
    assert_eq!(take(&p, &mut s, 4, 0).wait_ms, Some(800));
}

#[test]
fn clock_moving_back_never_mints_tokens() {
    for p in [
        Params::TokenBucket(bucket(2, 1)),
        Params::Gcra(bucket(2, 1)),
        Params::FixedWindow(window(2, 1)),
        Params::SlidingWindow(window(2, 1)),
        Params::SlidingLog(window(2, 1)),
    ] {
        let mut s = p.fresh(50_000);
        assert!(take(&p, &mut s, 2, 50_000).allowed);
        assert!(
            !take(&p, &mut s, 1, 10_000).allowed,
            "{p:?} after a step back"
        );
        assert!(
            !take(&p, &mut s, 1, 50_000).allowed,
            "{p:?} back at the present"
        );
    }
}

#[test]
fn gcra_spaces_requests_after_the_burst() {
    let p = Params::Gcra(bucket(3, 10));
    let mut s = p.fresh(1_000);
    for _ in 0..3 {
        assert!(take(&p, &mut s, 1, 1_000).allowed);
    }
    assert_eq!(take(&p, &mut s, 1, 1_000).wait_ms, Some(100));
    // Then one request per emission interval (100 ms), no more.
    for k in 1..10 {
        let t = 1_000 + k * 100;
        assert!(take(&p, &mut s, 1, t).allowed, "at {t}");
        assert!(!take(&p, &mut s, 1, t + 99).allowed, "at {}", t + 99);
    }
}

#[test]
fn fixed_window_allows_a_double_burst_at_the_edge() {
    let p = Params::FixedWindow(window(100, 60));
    let mut s = p.fresh(59_999);
    assert!(take(&p, &mut s, 100, 59_999).allowed);
    assert_eq!(take(&p, &mut s, 1, 59_999).wait_ms, Some(1));
    // One millisecond later a new window starts: another full burst.
    assert!(take(&p, &mut s, 100, 60_000).allowed);
    assert_eq!(take(&p, &mut s, 1, 60_000).wait_ms, Some(60_000));
}

#[test]
fn sliding_window_weights_the_previous_window() {
    let p = Params::SlidingWindow(window(100, 60));
    let mut s = p.fresh(0);
    assert!(take(&p, &mut s, 100, 0).allowed);
    // A quarter into the next window, 75 of the previous 100 still count.
    let c = take(&p, &mut s, 25, 75_000);
    assert!(c.allowed);
    assert_eq!(c.remaining, 0);
    let denied = take(&p, &mut s, 1, 75_000);
    // 100·(60000−e)/60000 + 25 + 1 ≤ 100 once e ≥ 15600: 600 ms later.
    assert_eq!(denied.wait_ms, Some(600));
    assert!(!take(&p, &mut s, 1, 75_599).allowed);
    assert!(take(&p, &mut s, 1, 75_600).allowed);
}

#[test]
fn sliding_log_is_exact() {
    let p = Params::SlidingLog(window(3, 10));
    let mut s = p.fresh(0);
    assert!(take(&p, &mut s, 1, 0).allowed);
    assert!(take(&p, &mut s, 2, 4_000).allowed);
    let c = take(&p, &mut s, 1, 9_000);
    assert_eq!(c, Check::deny(0, Some(1_000)));
    assert!(
        !take(&p, &mut s, 2, 10_000).allowed,
        "the cost-2 entry is still inside"
    );
    assert!(take(&p, &mut s, 1, 10_000).allowed);
    assert_eq!(take(&p, &mut s, 2, 10_000).wait_ms, Some(4_000));
}

#[test]
fn reset_reports_the_return_to_a_fresh_state() {
    let p = Params::TokenBucket(bucket(10, 2));
    let mut s = p.fresh(0);
    take(&p, &mut s, 4, 0);
    assert_eq!(p.reset_ms(&s, 0), 2_000);
    let w = Params::SlidingWindow(window(10, 1));
    let mut s = w.fresh(0);
    take(&w, &mut s, 1, 500);
    assert_eq!(w.reset_ms(&s, 500), 1_500);
}

fn any_params() -> impl Strategy<Value = Params> {
    let b = (1u64..50, 1u64..5_000).prop_map(|(c, per_ms)| Bucket {
        capacity: c * MICRO,
        per_ms,
    });
    let w = (1u64..50, 1u64..5_000).prop_map(|(limit, window_ms)| Window { limit, window_ms });
    prop_oneof![
        b.clone().prop_map(Params::TokenBucket),
        b.prop_map(Params::Gcra),
        w.clone().prop_map(Params::FixedWindow),
        w.clone().prop_map(Params::SlidingWindow),
        w.prop_map(Params::SlidingLog),
    ]
}

proptest! {
    /// GCRA and the token bucket are two representations of one schedule:
    /// they must agree on every decision.
    #[test]
    fn gcra_agrees_with_token_bucket(
        cap in 1u64..40, per_ms in 1u64..3_000,
        steps in prop::collection::vec((0u64..3_000, 1u64..8), 1..60),
    ) {
        let b = Bucket { capacity: cap * MICRO, per_ms };
        let (tb, gc) = (Params::TokenBucket(b), Params::Gcra(b));
        let (mut s1, mut s2) = (tb.fresh(0), gc.fresh(0));
        let mut now = 0;
        for (dt, cost) in steps {
            now += dt;
            prop_assert_eq!(take(&tb, &mut s1, cost, now), take(&gc, &mut s2, cost, now));
        }
    }

    /// A denial's wait is exact: one millisecond earlier still denies,
    /// at the wait the same cost is admitted.
    #[test]
    fn wait_is_exact(
        p in any_params(),
        steps in prop::collection::vec((0u64..2_000, 1u64..10), 1..40),
        probe in 1u64..10,
    ) {
        let mut s = p.fresh(0);
        let mut now = 0;
        for (dt, cost) in steps {
            now += dt;
            take(&p, &mut s, cost, now);
        }
        let c = { p.refresh(&mut s, now); p.check(&s, probe, now) };
        if let (false, Some(wait)) = (c.allowed, c.wait_ms) {
            let mut later = s.clone();
            p.refresh(&mut later, now + wait);
            prop_assert!(p.check(&later, probe, now + wait).allowed);
            let mut earlier = s.clone();
            p.refresh(&mut earlier, now + wait - 1);
            prop_assert!(!p.check(&earlier, probe, now + wait - 1).allowed);
        }
        if c.wait_ms.is_none() {
            prop_assert!(probe > p.quota());
        }
    }

    /// Admitted cost never exceeds what the limit promises over any run.
    #[test]
    fn bucket_never_admits_more_than_capacity_plus_refill(
        cap in 1u64..40, per_ms in 1u64..3_000,
        steps in prop::collection::vec((0u64..500, 1u64..8), 1..80),
    ) {
        let p = Params::TokenBucket(Bucket { capacity: cap * MICRO, per_ms });
        let mut s = p.fresh(0);
        let (mut now, mut admitted) = (0, 0);
        for (dt, cost) in steps {
            now += dt;
            if take(&p, &mut s, cost, now).allowed {
                admitted += cost * MICRO;
            }
            prop_assert!(admitted <= cap * MICRO + now * per_ms);
        }
    }
}

#[test]
fn state_is_kept_only_where_it_means_the_same() {
    let b = Params::TokenBucket(bucket(10, 1));
    let spent = State::Bucket {
        balance: 8 * MICRO as i64,
        at: 5,
    };
    // Any bucket: the balance means the same, clamped to a smaller one.
    let small = Params::TokenBucket(bucket(4, 9));
    assert_eq!(
        small.adopt(&b, spent.clone(), 7),
        State::Bucket {
            balance: 4 * MICRO as i64,
            at: 5
        }
    );
    // A GCRA at another rate, a window of another length, another
    // algorithm: afresh.
    let g = Params::Gcra(bucket(10, 1));
    let g2 = Params::Gcra(bucket(10, 2));
    let schedule = State::Gcra { tat: 900, frac: 3 };
    assert_eq!(g2.adopt(&g, schedule.clone(), 7), g2.fresh(7));
    assert_eq!(
        Params::Gcra(bucket(20, 1)).adopt(&g, schedule.clone(), 7),
        schedule
    );
    let w = Params::FixedWindow(window(5, 10));
    let counted = State::Window { start: 0, count: 3 };
    assert_eq!(
        Params::FixedWindow(window(9, 10)).adopt(&w, counted.clone(), 7),
        counted
    );
    let longer = Params::FixedWindow(window(5, 20));
    assert_eq!(longer.adopt(&w, counted.clone(), 7), longer.fresh(7));
    let sliding = Params::SlidingWindow(window(5, 10));
    assert_eq!(sliding.adopt(&w, counted, 7), sliding.fresh(7));
    assert!(!sliding.same_meaning(&w));
    assert!(g.same_meaning(&Params::Gcra(bucket(1, 1))));
}
