//! The Redis store against real `redis-server` processes: the Lua script
//! agrees with the Rust algorithms decision for decision, each algorithm's
//! boundary behaviour holds through Redis, refunds agree too, the script
//! survives a lost script cache, and decisions spanning the slots of a Redis
//! Cluster stay all-or-nothing.

mod support;

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use support::redis_server::{RedisCluster, RedisServer};
use tollgate::clock::ManualClock;
use tollgate::limits::algorithm::{
    Bucket, Concurrency, HoldId, Params, Period, Quota, Window, MICRO,
};
use tollgate::limits::holds::next_id;
use tollgate::limits::keys::KeyHasher;
use tollgate::limits::memory::MemoryStore;
use tollgate::limits::redis::cluster::ClusterStore;
use tollgate::limits::redis::{Bounds, RedisStore};
use tollgate::limits::{Charge, Gate, Group, LimitStore, Mode, OnLimit, Op, RecordStore, Verdict};
use tollgate::testing::{bucket_params as bucket, charge, window};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn store(server: &RedisServer, clock: &ManualClock) -> RedisStore {
    RedisStore::with_clock(
        &server.url(),
        KeyHasher::new("t:", b"test-secret"),
        Bounds::new(Duration::from_secs(2)),
        clock.clone(),
    )
    .unwrap()
}

/// Runs the futures as concurrent tasks on `rt`; their outputs, in order.
fn concurrently<T, F>(rt: &tokio::runtime::Runtime, futures: Vec<F>) -> Vec<T>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    rt.block_on(async {
        let tasks: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
}

/// The store takes charges by reference.
fn refs(charges: &[Charge]) -> Vec<&Charge> {
    charges.iter().collect()
}

/// Decides one charge at a time through Redis, moving the test clock.
struct Probe {
    rt: tokio::runtime::Runtime,
    store: RedisStore,
    clock: ManualClock,
    _server: RedisServer,
}

impl Probe {
    fn new() -> Self {
        let server = RedisServer::start();
        let clock = ManualClock::new(1_000_000);
        Probe {
            rt: runtime(),
            store: store(&server, &clock),
            clock,
            _server: server,
        }
    }

    fn at(&self, ms: u64, params: Params, cost: u64) -> Verdict {
        self.clock.set(1_000_000 + ms);
        let c = charge("l", "k", params, cost);
        self.rt
            .block_on(self.store.decide(&[&c], Gate::Open))
            .unwrap()[0]
    }
}

#[test]
fn token_bucket_refills_and_caps_through_redis() {
    let p = Probe::new();
    let b = bucket(20, 5);
    for _ in 0..20 {
        assert!(p.at(0, b, 1).allowed);
    }
    let denied = p.at(0, b, 1);
    assert_eq!((denied.allowed, denied.wait_ms), (false, Some(200)));
    assert!(!p.at(199, b, 1).allowed);
    assert!(p.at(200, b, 1).allowed);
    // A long idle time refills to capacity and no further.
    assert_eq!(p.at(3_600_000, b, 1).remaining, 19);
    // Weighted: a cost of 4 takes 4; a cost beyond capacity never fits.
    assert_eq!(p.at(3_600_000, b, 4).remaining, 15);
    let never = p.at(3_600_000, b, 21);
    assert_eq!((never.allowed, never.wait_ms), (false, None));
    assert_eq!(
        p.at(3_600_000, b, 1).remaining,
        14,
        "the impossible cost spent nothing"
    );
}

#[test]
fn clock_moving_back_mints_nothing_through_redis() {
    let p = Probe::new();
    let b = bucket(2, 1);
    assert!(p.at(50_000, b, 2).allowed);
    assert!(
        !p.at(10_000, b, 1).allowed,
        "the stored time does not move back"
    );
    assert!(!p.at(50_000, b, 1).allowed);
    assert!(p.at(51_000, b, 1).allowed);
}

#[test]
fn gcra_spaces_requests_through_redis() {
    let p = Probe::new();
    let g = Params::Gcra(Bucket {
        capacity: 3 * MICRO,
        per_ms: 10_000,
    });
    for _ in 0..3 {
        assert!(p.at(0, g, 1).allowed);
    }
    assert_eq!(p.at(0, g, 1).wait_ms, Some(100));
    for k in 1..5 {
        assert!(p.at(k * 100, g, 1).allowed);
        assert!(!p.at(k * 100 + 99, g, 1).allowed);
    }
}

#[test]
fn fixed_window_edge_burst_through_redis() {
    let p = Probe::new();
    let f = Params::FixedWindow(window(100, 60));
    // The probe's clock starts at 1 000 000 ms: window edges fall on
    // multiples of 60 000, so 1 019 999 is the last millisecond of one.
    assert!(p.at(19_999, f, 100).allowed);
    assert_eq!(p.at(19_999, f, 1).wait_ms, Some(1));
    assert!(
        p.at(20_000, f, 100).allowed,
        "a second full burst right after the edge"
    );
    assert_eq!(p.at(20_000, f, 1).wait_ms, Some(60_000));
}

#[test]
fn sliding_window_weights_the_previous_window_through_redis() {
    let p = Probe::new();
    let s = Params::SlidingWindow(window(100, 60));
    // Window starts at 960 000; the probe's zero is 1 000 000 (40 s in).
    assert!(p.at(0, s, 100).allowed);
    // 35 s into the next window (t = 55 s): 100·(25/60) ≈ 41.7 still count.
    let v = p.at(55_000, s, 58);
    assert!(v.allowed, "{v:?}");
    let denied = p.at(55_000, s, 1);
    assert!(!denied.allowed);
    // 100·(60000−e)/60000 + 58 + 1 ≤ 100 once e ≥ 35 400: 400 ms later.
    assert_eq!(denied.wait_ms, Some(400));
    assert!(!p.at(55_399, s, 1).allowed);
    assert!(p.at(55_400, s, 1).allowed);
}

#[test]
fn sliding_log_is_exact_through_redis() {
    let p = Probe::new();
    let l = Params::SlidingLog(window(3, 10));
    assert!(p.at(0, l, 1).allowed);
    assert!(p.at(4_000, l, 2).allowed);
    let v = p.at(9_000, l, 1);
    assert_eq!((v.allowed, v.wait_ms), (false, Some(1_000)));
    assert!(!p.at(10_000, l, 2).allowed);
    assert!(p.at(10_000, l, 1).allowed);
    assert_eq!(p.at(10_000, l, 2).wait_ms, Some(4_000));
}

#[test]
fn a_limit_that_changes_algorithm_keeps_working() {
    let p = Probe::new();
    assert!(p.at(0, bucket(5, 1), 1).allowed);
    // The same key, now a sliding log (a string key becomes a sorted set)…
    let log = Params::SlidingLog(window(2, 10));
    assert!(p.at(10, log, 1).allowed);
    assert!(p.at(20, log, 1).allowed);
    assert!(!p.at(30, log, 1).allowed);
    // …and back to a window counter (the sorted set becomes a string).
    assert!(p.at(40, Params::FixedWindow(window(1, 10)), 1).allowed);
}

#[test]
fn a_changed_algorithm_or_window_starts_the_key_afresh() {
    let p = Probe::new();
    // fixed_window → sliding_window: the counter is not read as a window pair.
    let fixed = Params::FixedWindow(window(5, 60));
    assert!(p.at(0, fixed, 5).allowed);
    let sliding = Params::SlidingWindow(window(5, 60));
    let v = p.at(10, sliding, 1);
    assert_eq!((v.allowed, v.remaining), (true, 4));

    // gcra → fixed_window: a spent schedule is not read as a full window.
    let p = Probe::new();
    let gcra = Params::Gcra(Bucket::per_second(3, 1));
    assert!(p.at(0, gcra, 3).allowed);
    assert!(!p.at(0, gcra, 1).allowed);
    let v = p.at(10, fixed, 1);
    assert_eq!((v.allowed, v.remaining, v.wait_ms), (true, 4, Some(0)));

    // A window of another length means other windows: afresh too.
    let p = Probe::new();
    assert!(p.at(0, Params::FixedWindow(window(1, 10)), 1).allowed);
    assert!(!p.at(1, Params::FixedWindow(window(1, 10)), 1).allowed);
    assert!(p.at(2, Params::FixedWindow(window(1, 20)), 1).allowed);
    // A larger limit on the same window keeps what was counted.
    assert!(!p.at(3, Params::FixedWindow(window(1, 20)), 1).allowed);
    assert!(p.at(4, Params::FixedWindow(window(2, 20)), 1).allowed);
    assert!(!p.at(5, Params::FixedWindow(window(2, 20)), 1).allowed);
}

#[test]
fn a_full_sliding_log_is_decided_in_bounded_work() {
    let server = RedisServer::start();
    let clock = ManualClock::new(50_000_000);
    let s = store(&server, &clock);
    let rt = runtime();
    let log = Params::SlidingLog(window(10_000, 3_600));
    // One tenant fills the largest log allowed: 10 000 entries.
    let heavy = charge("export", "heavy", log, 1);
    for _ in 0..100 {
        let batch: Vec<&Charge> = vec![&heavy; 100];
        let v = rt.block_on(s.decide(&batch, Gate::Open)).unwrap();
        assert!(v.iter().all(|v| v.allowed));
        clock.advance(100);
    }
    let card: u64 = server.cmd(&["ZCARD", &server.keys()[0]]).unwrap();
    assert_eq!(card, 10_000);
    // Another tenant, whose own budget is spent, and a fresh one.
    let spent = charge("own", "spent", bucket(1, 1), 1);
    let fresh = charge("own", "fresh", bucket(1, 1), 1);
    assert!(rt.block_on(s.decide(&[&spent], Gate::Open)).unwrap()[0].allowed);

    server.cmd::<()>(&["CONFIG", "RESETSTAT"]).unwrap();
    for i in 1..=20 {
        clock.advance(10);
        let full = rt.block_on(s.decide(&[&heavy], Gate::Open)).unwrap()[0];
        assert!(!full.allowed);
        // The oldest entry, written 10 000 ms before the loop, leaves first.
        assert_eq!(full.wait_ms, Some(3_600_000 - 10_000 - 10 * i));
        let own = rt.block_on(s.decide(&[&spent], Gate::Open)).unwrap()[0];
        assert!(!own.allowed, "the spent tenant stays refused");
    }
    assert!(rt.block_on(s.decide(&[&fresh], Gate::Open)).unwrap()[0].allowed);
    let stats: String = server.cmd(&["INFO", "commandstats"]).unwrap();
    let line = stats
        .lines()
        .find(|l| l.starts_with("cmdstat_fcall:") || l.starts_with("cmdstat_evalsha:"))
        .unwrap_or_else(|| panic!("no script stats: {stats}"));
    let per_call: f64 = line
        .split(',')
        .find_map(|f| f.strip_prefix("usec_per_call="))
        .and_then(|v| v.parse().ok())
        .unwrap();
    println!("script time per decision with a full log: {per_call} µs ({line})");
    assert!(per_call < 1_000.0, "{line}");
}

#[test]
fn keys_expire_once_back_to_their_initial_state() {
    let server = RedisServer::start();
    let clock = ManualClock::new(5_000_000);
    let s = store(&server, &clock);
    let rt = runtime();
    // Spend 4 of 10 at 2/s: full again in 2 s, so the key lives 3 s.
    rt.block_on(s.decide(&[&charge("b", "k", bucket(10, 2), 4)], Gate::Open))
        .unwrap();
    let keys = server.keys();
    assert_eq!(keys.len(), 1);
    let ttl: i64 = server.cmd(&["PTTL", &keys[0]]).unwrap();
    assert!((2_900..=3_000).contains(&ttl), "{ttl}");
}

#[test]
fn a_lost_script_cache_is_reloaded() {
    let server = RedisServer::start();
    let clock = ManualClock::new(5_000_000);
    let s = store(&server, &clock);
    let rt = runtime();
    let c = [charge("b", "k", bucket(10, 1), 1)];
    assert!(rt.block_on(s.decide(&refs(&c), Gate::Open)).unwrap()[0].allowed);
    let _: String = server.cmd(&["SCRIPT", "FLUSH"]).unwrap();
    let _: String = server.cmd(&["FUNCTION", "FLUSH"]).unwrap();
    let v = rt.block_on(s.decide(&refs(&c), Gate::Open)).unwrap();
    assert_eq!(v[0].remaining, 8);
}

/// Calls of each kind the server counted (`INFO commandstats`).
fn calls(server: &RedisServer, command: &str) -> u64 {
    let stats: String = server.cmd(&["INFO", "commandstats"]).unwrap();
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn decisions_run_as_a_function_where_the_server_has_functions() {
    let server = RedisServer::start();
    let clock = ManualClock::new(5_000_000);
    let s = store(&server, &clock);
    let rt = runtime();
    let c = [charge("b", "k", bucket(10, 1), 1)];
    for _ in 0..3 {
        assert!(rt.block_on(s.decide(&refs(&c), Gate::Open)).unwrap()[0].allowed);
    }
    // The three decisions and the store's warm-up call, each by FCALL;
    // the warm-up and the first decision may both find the library
    // missing (they race), load it and call again.
    let fcalls = calls(&server, "fcall");
    assert!((4..=6).contains(&fcalls), "{fcalls} FCALLs");
    assert_eq!(calls(&server, "evalsha"), 0);
    let libraries: Vec<redis::Value> = server.cmd(&["FUNCTION", "LIST"]).unwrap();
    assert_eq!(libraries.len(), 1);
}

/// The URL of a user of `server` who may do anything but use functions.
fn user_without_functions(server: &RedisServer) -> String {
    server
        .cmd::<()>(&[
            "ACL",
            "SETUSER",
            "plain",
            "on",
            ">pw",
            "~*",
            "&*",
            "+@all",
            "-function",
            "-fcall",
        ])
        .unwrap();
    format!("redis://plain:pw@127.0.0.1:{}/0", server.port)
}

#[test]
fn a_user_without_functions_gets_scripts() {
    let server = RedisServer::start();
    let url = user_without_functions(&server);
    let clock = ManualClock::new(5_000_000);
    let s = RedisStore::with_clock(
        &url,
        KeyHasher::new("t:", b"x"),
        Bounds::new(Duration::from_secs(2)),
        clock,
    )
    .unwrap();
    let rt = runtime();
    let c = [charge("b", "k", bucket(2, 1), 1)];
    let v: Vec<bool> = (0..3)
        .map(|_| rt.block_on(s.decide(&refs(&c), Gate::Open)).unwrap()[0].allowed)
        .collect();
    assert_eq!(v, [true, true, false]);
    assert!(calls(&server, "evalsha") >= 3);
}

#[test]
fn server_time_drives_the_script_by_default() {
    let server = RedisServer::start();
    let s = RedisStore::new(
        &server.url(),
        KeyHasher::new("t:", b"x"),
        Bounds::new(Duration::from_secs(2)),
    )
    .unwrap();
    let rt = runtime();
    let c = [charge("b", "k", bucket(2, 1), 1)];
    let v: Vec<bool> = (0..3)
        .map(|_| rt.block_on(s.decide(&refs(&c), Gate::Open)).unwrap()[0].allowed)
        .collect();
    assert_eq!(v, [true, true, false]);
}

// ---- The script and the Rust algorithms agree on every decision. ----

#[derive(Debug, Clone)]
struct Step {
    advance_ms: u64,
    /// Requests sent at once (they may share one script call).
    requests: Vec<Request>,
    /// Limit `i` runs with its second parameters in this step when bit `i`
    /// is set: a reload that changes the algorithm or the numbers of a key
    /// with state, and back.
    second: u8,
    /// After the requests, the hold of a concurrency limit taken earlier
    /// (by index among those still held) is released.
    release: Option<usize>,
}

/// A list of (limit index, cost, group, what the charge does) and the first
/// blocked group.
type Request = (Vec<(usize, u64, Group, Op)>, Gate);

fn any_params() -> impl Strategy<Value = Params> {
    let bucket = (1u64..30, 1u64..4_000).prop_map(|(c, per_ms)| Bucket {
        capacity: c * MICRO + per_ms % 7,
        per_ms,
    });
    let win = (1u64..30, 1u64..4_000).prop_map(|(limit, window_ms)| Window { limit, window_ms });
    let quota = (
        1u64..30,
        prop_oneof![Just(Period::Day), Just(Period::Month)],
    )
        .prop_map(|(limit, period)| Quota { limit, period });
    let concurrency =
        (1u64..30, 1_000u64..5_000).prop_map(|(max_in_flight, hold_ttl_ms)| Concurrency {
            max_in_flight,
            hold_ttl_ms,
        });
    prop_oneof![
        concurrency.prop_map(Params::Concurrency),
        bucket.clone().prop_map(Params::TokenBucket),
        bucket.prop_map(Params::Gcra),
        win.clone().prop_map(Params::FixedWindow),
        win.clone().prop_map(Params::SlidingWindow),
        win.prop_map(Params::SlidingLog),
        quota.prop_map(Params::Quota),
    ]
}

/// The same algorithm with another capacity or limit: state that keeps
/// its meaning (a bucket's balance is clamped).
fn resized(params: Params, to: u64) -> Params {
    match params {
        Params::TokenBucket(b) => Params::TokenBucket(Bucket {
            capacity: to * MICRO + b.capacity % MICRO,
            ..b
        }),
        Params::Gcra(b) => Params::Gcra(Bucket {
            capacity: to * MICRO + b.capacity % MICRO,
            ..b
        }),
        Params::FixedWindow(w) => Params::FixedWindow(Window { limit: to, ..w }),
        Params::SlidingWindow(w) => Params::SlidingWindow(Window { limit: to, ..w }),
        Params::SlidingLog(w) => Params::SlidingLog(Window { limit: to, ..w }),
        Params::Quota(q) => Params::Quota(Quota { limit: to, ..q }),
        Params::Concurrency(c) => Params::Concurrency(Concurrency {
            max_in_flight: to,
            ..c
        }),
    }
}

/// Limits: first parameters, second parameters (another algorithm, other
/// numbers, or only another size), and whether they are enforced.
fn limit_set() -> impl Strategy<Value = Vec<(Params, Params, bool)>> {
    let limit = (
        any_params(),
        any_params(),
        1u64..30,
        0u8..3,
        prop::bool::weighted(0.8),
    )
        .prop_map(|(first, other, size, how, enforce)| {
            let second = match how {
                0 => other,
                1 => resized(first, size),
                _ => first,
            };
            (first, second, enforce)
        });
    prop::collection::vec(limit, 1..5)
}

fn group() -> impl Strategy<Value = Group> {
    prop_oneof![Just(Group::PreAuth), Just(Group::Request)]
}

/// The hold a forced charge of `key` renews: the oldest still held there.
fn renewed(held: &[Charge], key: &str, op: Op) -> Option<HoldId> {
    if !op.is_force() {
        return None;
    }
    held.iter().find(|c| c.key == key).and_then(|c| c.hold)
}

fn steps(limits: usize) -> impl Strategy<Value = Vec<Step>> {
    let request = (
        prop::collection::vec(
            (
                0..limits,
                1u64..8,
                group(),
                prop_oneof![
                    6 => Just(Op::DECIDE),
                    // A lease's take: as many of these units as fit.
                    3 => (1u64..40).prop_map(|units| Op::Take { units }),
                    // `on_limit: delay`: the longest wait.
                    3 => (1u64..3_000).prop_map(|max_ms| Op::Decide { on_limit: OnLimit::Delay { max_ms } }),
                    // A cost learnt after the response, into a debt
                    // bound of its own.
                    1 => (0u64..30).prop_map(|max_debt| Op::Force { max_debt }),
                ],
            ),
            1..=limits,
        ),
        prop_oneof![
            4 => Just(Gate::Open),
            1 => Just(Gate::At(Group::Request)),
            1 => Just(Gate::SHUT)
        ],
    )
        .prop_map(|(mut charges, blocked_from)| {
            // One charge per limit in a request.
            charges.sort_by_key(|c| c.0);
            charges.dedup_by_key(|c| c.0);
            (charges, blocked_from)
        });
    let second = prop_oneof![3 => Just(0u8), 1 => any::<u8>()];
    let release = prop::option::weighted(0.5, 0usize..64);
    // A request may come 1-3 times in a row, as a busy caller's do: the
    // script reads a repeat in a batch as one byte.
    let requests = prop::collection::vec((request, 1usize..4), 1..4).prop_map(|requests| {
        requests
            .into_iter()
            .flat_map(|(r, times)| std::iter::repeat_n(r, times))
            .collect::<Vec<_>>()
    });
    let step = (0u64..2_500, requests, second, release).prop_map(
        |(advance_ms, requests, second, release)| Step {
            advance_ms,
            requests,
            second,
            release,
        },
    );
    prop::collection::vec(step, 1..25)
}

#[test]
fn lua_and_rust_agree_on_random_sequences() {
    let server = RedisServer::start();
    let rt = runtime();
    let mut runner = TestRunner::new(Config {
        cases: 64,
        ..Config::default()
    });
    let case = std::sync::atomic::AtomicU64::new(0);
    let strategy = limit_set().prop_flat_map(|limits| {
        let n = limits.len();
        (Just(limits), steps(n))
    });
    runner
        .run(&strategy, |(limits, steps)| {
            // Fresh keys per case; a clock far from zero like real time.
            let id = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let clock = ManualClock::new(1_764_000_000_000 + id * 1_000_000_000);
            let memory = MemoryStore::new(clock.clone());
            let redis = Arc::new(store(&server, &clock));
            // Holds of concurrency limits taken and not yet released.
            let mut held: Vec<Charge> = Vec::new();
            for step in steps {
                clock.advance(step.advance_ms);
                let requests: Vec<(Vec<Charge>, Gate)> = step
                    .requests
                    .iter()
                    .map(|(charges, blocked)| {
                        let charges = charges
                            .iter()
                            .map(|&(i, cost, group, op)| {
                                let (first, second, enforce) = limits[i];
                                let params = if step.second & (1 << i) != 0 {
                                    second
                                } else {
                                    first
                                };
                                let key = format!("case{id}-l{i}");
                                let mut c = charge(&format!("l{i}"), &key, params, cost);
                                c.mode = if enforce { Mode::Enforce } else { Mode::Shadow };
                                c.group = group;
                                c.op = op;
                                if params.is_concurrency() {
                                    // One unit per request; a forced
                                    // charge renews a hold taken before.
                                    c.cost = 1;
                                    c.hold = Some(renewed(&held, &key, op).unwrap_or_else(next_id));
                                }
                                c
                            })
                            .collect();
                        (charges, *blocked)
                    })
                    .collect();
                // Sent together: the store may batch them into one call,
                // which must decide them as if one after the other.
                let got: Vec<Vec<Verdict>> = concurrently(
                    &rt,
                    requests
                        .iter()
                        .cloned()
                        .map(|(charges, blocked)| {
                            let redis = redis.clone();
                            async move { redis.decide(&refs(&charges), blocked).await.unwrap() }
                        })
                        .collect(),
                );
                for ((charges, blocked), got) in requests.iter().zip(&got) {
                    let expected = memory.decide_now(charges, *blocked).0;
                    prop_assert_eq!(got, &expected, "charges {:?}", charges);
                    let charged = tollgate::limits::gate(charges, |i| got[i].allowed, *blocked);
                    held.extend(
                        charges
                            .iter()
                            .zip(got)
                            .filter(|(c, v)| {
                                c.hold.is_some()
                                    && !c.op.is_force()
                                    && v.allowed
                                    && charged.admits(c.group)
                            })
                            .map(|(c, _)| c.clone()),
                    );
                }
                if let Some(k) = step.release.filter(|_| !held.is_empty()) {
                    let gone = held.remove(k % held.len());
                    memory.refund(&[&gone], 1);
                    rt.block_on(redis.give_back(&[&gone], 1)).unwrap();
                }
                // Every limit read without charging, at two costs: the same
                // in both stores, and the same when read again.
                let peeks: Vec<Charge> = (0..limits.len())
                    .flat_map(|i| {
                        let (first, second, _) = limits[i];
                        let params = if step.second & (1 << i) != 0 {
                            second
                        } else {
                            first
                        };
                        let key = format!("case{id}-l{i}");
                        [1, 7].map(|cost| charge(&format!("l{i}"), &key, params, cost))
                    })
                    .collect();
                let expected = memory.peek_now(&peeks);
                let got = rt.block_on(redis.peek(&refs(&peeks))).unwrap();
                prop_assert_eq!(&got, &expected, "peeks {:?}", peeks);
                let again = rt.block_on(redis.peek(&refs(&peeks))).unwrap();
                prop_assert_eq!(&again, &got, "a peek changes nothing");
            }
            Ok(())
        })
        .unwrap();
}

/// A hold renewed under a shorter `hold_ttl_ms` (a reload, or a plan
/// with its own) expires earlier: the store's reset time says so, as the
/// in-process model's does, rather than the old expiry it replaced.
#[test]
fn a_hold_renewed_for_less_time_resets_at_its_new_expiry() {
    let server = RedisServer::start();
    let rt = runtime();
    let clock = ManualClock::new(1_764_000_000_000);
    let memory = MemoryStore::new(clock.clone());
    let redis = store(&server, &clock);
    let params = |max_in_flight, hold_ttl_ms| {
        Params::Concurrency(Concurrency {
            max_in_flight,
            hold_ttl_ms,
        })
    };
    let hold = next_id();
    for (at, (limit, ttl), op) in [
        (
            0,
            (7, 2_014),
            Op::Decide {
                on_limit: OnLimit::Reject,
            },
        ),
        (0, (8, 3_773), Op::Force { max_debt: 0 }),
        (0, (7, 2_014), Op::Force { max_debt: 0 }),
        (500, (7, 1_000), Op::Force { max_debt: 0 }),
    ] {
        clock.advance(at);
        let mut c = charge("l0", "renewed", params(limit, ttl), 1);
        c.op = op;
        c.hold = Some(hold);
        let got = rt.block_on(redis.decide(&[&c], Gate::Open)).unwrap();
        let expected = memory.decide_now(&[c.clone()], Gate::Open).0;
        assert_eq!(got, expected, "{op:?} with hold_ttl_ms {ttl}");
        assert_eq!(got[0].reset_ms, ttl, "the hold's new expiry");
    }
}

#[test]
fn a_peek_writes_nothing() {
    let server = RedisServer::start();
    let rt = runtime();
    let clock = ManualClock::new(1_970_000_000_000);
    let redis = store(&server, &clock);
    let memory = MemoryStore::new(clock.clone());
    let fresh = charge("p", "never-charged", bucket(10, 1), 3);
    let v = rt.block_on(redis.peek(&[&fresh])).unwrap();
    assert_eq!((v[0].allowed, v[0].remaining, v[0].reset_ms), (true, 10, 0));
    assert!(server.keys().is_empty(), "no key made: {:?}", server.keys());
    // A spent bucket, read twice: nothing refills or drains but time.
    let spent = charge("p", "spent", bucket(10, 1), 10);
    rt.block_on(redis.decide(&[&spent], Gate::Open)).unwrap();
    memory.decide_now(&[&spent], Gate::Open);
    let probe = charge("p", "spent", bucket(10, 1), 2);
    let ttl: i64 = server.cmd(&["PTTL", &server.keys()[0]]).unwrap();
    for _ in 0..2 {
        let v = rt.block_on(redis.peek(&[&probe])).unwrap();
        assert_eq!(v, memory.peek_now(&[&probe]));
        assert_eq!(
            (v[0].allowed, v[0].remaining, v[0].wait_ms),
            (false, 0, Some(2_000))
        );
    }
    let after: i64 = server.cmd(&["PTTL", &server.keys()[0]]).unwrap();
    assert!(
        after <= ttl,
        "the key's expiry was not renewed: {ttl} then {after}"
    );
}

#[test]
fn lua_and_rust_agree_on_refunds() {
    let server = RedisServer::start();
    let rt = runtime();
    let mut runner = TestRunner::new(Config {
        cases: 48,
        ..Config::default()
    });
    let case = std::sync::atomic::AtomicU64::new(0);
    // Each step decides one request; some then give back what it spent,
    // a little later, as a cluster does when another slot denied.
    let strategy = limit_set().prop_flat_map(|limits| {
        let n = limits.len();
        let step = (
            0u64..2_500,
            prop::collection::vec((0..n, 1u64..8, group()), 1..=n),
            prop::option::weighted(0.5, 0u64..1_500),
        );
        (Just(limits), prop::collection::vec(step, 1..20))
    });
    runner
        .run(&strategy, |(limits, steps)| {
            let id = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let clock = ManualClock::new(1_864_000_000_000 + id * 1_000_000_000);
            let memory = MemoryStore::new(clock.clone());
            let redis = store(&server, &clock);
            for (advance, mut picks, refund_after) in steps {
                picks.sort_by_key(|c| c.0);
                picks.dedup_by_key(|c| c.0);
                let charges: Vec<Charge> = picks
                    .iter()
                    .map(|&(i, cost, group)| {
                        let (params, _, enforce) = limits[i];
                        let mut c =
                            charge(&format!("l{i}"), &format!("refund{id}-l{i}"), params, cost);
                        c.mode = if enforce { Mode::Enforce } else { Mode::Shadow };
                        c.group = group;
                        c
                    })
                    .collect();
                clock.advance(advance);
                let (expected, spent_at) = memory.decide_now(&charges, Gate::Open);
                let got = rt
                    .block_on(redis.decide(&refs(&charges), Gate::Open))
                    .unwrap();
                prop_assert_eq!(&got, &expected, "decide {:?}", charges);
                let Some(after) = refund_after else { continue };
                let gate = tollgate::limits::gate(&charges, |i| expected[i].allowed, Gate::Open);
                let spent: Vec<&Charge> = charges
                    .iter()
                    .zip(&expected)
                    .filter(|(c, v)| v.allowed && gate.admits(c.group))
                    .map(|(c, _)| c)
                    .collect();
                clock.advance(after);
                memory.refund(&spent, spent_at);
                rt.block_on(redis.give_back(&spent, spent_at)).unwrap();
                // The next decisions compare the refunded states.
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn concurrent_requests_are_batched_and_decided_as_if_one_by_one() {
    let server = RedisServer::start();
    let clock = ManualClock::new(9_000_000);
    let redis = Arc::new(store(&server, &clock));
    let memory = MemoryStore::new(clock.clone());
    // Forty requests share a global bucket of 25 and each has its own
    // bucket of 1 that was spent already, for half of them.
    let request = |i: usize| {
        vec![
            charge("global", "g", bucket(25, 1), 1),
            charge("own", &format!("own-{i}"), bucket(1, 1), 1),
        ]
    };
    let rt = runtime();
    let spent: Vec<Charge> = (0..40).step_by(2).map(|i| request(i)[1].clone()).collect();
    for c in &spent {
        rt.block_on(redis.decide(&[c], Gate::Open)).unwrap();
        memory.decide_now(std::slice::from_ref(c), Gate::Open);
    }
    let _: String = server.cmd(&["CONFIG", "RESETSTAT"]).unwrap();
    let got: Vec<Vec<Verdict>> = concurrently(
        &rt,
        (0..40)
            .map(|i| {
                let (redis, charges) = (redis.clone(), request(i));
                async move { redis.decide(&refs(&charges), Gate::Open).await.unwrap() }
            })
            .collect(),
    );
    let expected: Vec<Vec<Verdict>> = (0..40)
        .map(|i| memory.decide_now(&request(i), Gate::Open).0)
        .collect();
    assert_eq!(
        got, expected,
        "the batch decides in submission order, like one call each"
    );
    let script_calls = calls(&server, "fcall") + calls(&server, "evalsha");
    assert!(
        script_calls < 40,
        "{script_calls} script calls for 40 concurrent requests"
    );
    // 20 requests found their own bucket spent; 20 were admitted by both.
    assert_eq!(
        got.iter().filter(|v| v[0].allowed && v[1].allowed).count(),
        20
    );
}

// The stores are used from many request tasks at once.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<RedisStore>();
    shareable::<ClusterStore>();
    shareable::<tollgate::limits::memory::MemoryStore>();
};

#[test]
fn cluster_decisions_across_slots_stay_all_or_nothing_under_concurrency() {
    let cluster = RedisCluster::start(3);
    let store = Arc::new(
        ClusterStore::new(
            &cluster.urls(),
            KeyHasher::new("t:", b"test-secret"),
            Bounds::new(Duration::from_secs(2)),
        )
        .unwrap(),
    );
    // Sixty requests, each from its own tenant (a slot of its own, mostly)
    // with 5 units, all sharing a global budget of 25 that barely refills.
    let global = Params::TokenBucket(Bucket {
        capacity: 25 * MICRO,
        per_ms: 1,
    });
    let own = |i: usize, cost: u64| {
        let mut c = charge("own", &format!("own-{i}"), bucket(5, 1), cost);
        c.tenant = Some(format!("t{i}").into());
        c
    };
    let rt = runtime();
    let admitted: Vec<bool> = concurrently(
        &rt,
        (0..60)
            .map(|i| {
                let store = store.clone();
                let charges = vec![own(i, 1), charge("global", "g", global, 1)];
                async move {
                    let v = store.decide(&refs(&charges), Gate::Open).await.unwrap();
                    v.iter().all(|v| v.allowed)
                }
            })
            .collect(),
    );
    assert_eq!(admitted.iter().filter(|a| **a).count(), 25);
    // Every denied request's unit went back to its tenant: all 5 fit again
    // there, and 4 where the request was admitted.
    for (i, was_admitted) in admitted.iter().enumerate() {
        let whole = own(i, 5);
        let v = rt.block_on(store.decide(&[&whole], Gate::Open)).unwrap();
        assert_eq!(v[0].allowed, !was_admitted, "tenant {i}");
    }
}

/// A call of `conn` for these requests, decided at `now`: their verdicts.
fn decided(
    rt: &tokio::runtime::Runtime,
    conn: &tollgate::limits::redis::conn::Connection,
    requests: &[&tollgate::limits::redis::codec::Request],
) -> Vec<Vec<Verdict>> {
    use tollgate::limits::redis::batch::Link;
    rt.block_on(conn.call(requests))
        .unwrap()
        .into_iter()
        .map(|answer| answer.unwrap().0)
        .collect()
}

/// A batch of one concurrency limit's requests on `conn`: a decision queued
/// before the release of the hold that fills the limit (its request ended
/// while the decision waited), and a peek. Each concern is a call of its
/// own, sent in one pipeline, the give-back first: the decision finds the
/// limit free, as it would a moment later. `calls` counts the server's
/// script calls.
fn several_concerns_in_one_batch(
    rt: &tokio::runtime::Runtime,
    conn: &tollgate::limits::redis::conn::Connection,
    key: &str,
    calls: impl Fn() -> u64,
) {
    use tollgate::limits::redis::codec::{Request, PEEK};
    let one = Params::Concurrency(Concurrency {
        max_in_flight: 1,
        hold_ttl_ms: 60_000,
    });
    let request = |hold: Option<HoldId>, refund_at| {
        let mut c = charge("c", key, one, 1);
        c.hold = hold;
        Request::new(vec![key.into()], &[&c], Gate::Open, refund_at)
    };
    let first = next_id();
    assert!(decided(rt, conn, &[&request(Some(first), 0)])[0][0].allowed);
    let before = calls();
    let next = request(Some(next_id()), 0);
    let release = request(Some(first), 1);
    let peek = request(None, PEEK);
    let got = decided(rt, conn, &[&next, &release, &peek]);
    assert!(got[0][0].allowed, "{key}: the decision after the release");
    assert_eq!(got[2][0].remaining, 0, "{key}: the peek after both");
    assert_eq!(calls() - before, 3, "{key}: one call per concern");
}

#[test]
fn a_batch_of_several_concerns_is_one_call_each_give_backs_first() {
    use tollgate::limits::redis::conn::Connection;
    let server = RedisServer::start();
    let plain = user_without_functions(&server);
    for (url, command) in [(server.url(), "fcall"), (plain, "evalsha")] {
        let conn = Connection::single(&url, Duration::from_secs(2), None).unwrap();
        let key = format!("t:{command}");
        several_concerns_in_one_batch(&runtime(), &conn, &key, || calls(&server, command));
        let held: u64 = server.cmd(&["ZCARD", &key]).unwrap();
        assert_eq!(held, 1, "{command}: the new hold alone");
    }
}

/// The same on a cluster, whose functions go to the node of the key's
/// slot, one call after the other; the library is loaded on every primary
/// at once, and again when a node has lost it (a restart without
/// persistence, a node that joined later).
#[test]
fn a_cluster_sends_a_batch_of_several_concerns_in_order() {
    use tollgate::limits::redis::conn::Connection;
    let cluster = RedisCluster::start(3);
    let conn = Connection::cluster(&cluster.urls(), Duration::from_secs(2)).unwrap();
    // (One runtime: the cluster client's task lives on it.)
    let rt = runtime();
    let fcalls = || cluster.nodes.iter().map(|n| calls(n, "fcall")).sum();
    let libraries = || {
        cluster
            .nodes
            .iter()
            .map(|node| {
                node.cmd::<Vec<redis::Value>>(&["FUNCTION", "LIST"])
                    .unwrap()
                    .len()
            })
            .collect::<Vec<_>>()
    };
    several_concerns_in_one_batch(&rt, &conn, "t:{tenant}held", fcalls);
    assert_eq!(libraries(), [1, 1, 1], "every primary has the library");
    for node in &cluster.nodes {
        let _: String = node.cmd(&["FUNCTION", "FLUSH"]).unwrap();
    }
    several_concerns_in_one_batch(&rt, &conn, "t:{tenant}again", fcalls);
    assert_eq!(libraries(), [1, 1, 1], "loaded again on every primary");
    for node in &cluster.nodes {
        assert_eq!(calls(node, "evalsha"), 0, "no script on a cluster");
    }
}

/// A batch whose operator's peek fails (an algorithm no script knows)
/// beside a decision: the decision's call went through and is answered,
/// charged; only the peek fails. On functions and on scripts.
#[test]
fn a_failing_call_fails_its_own_requests_alone() {
    use tollgate::limits::redis::batch::Link;
    use tollgate::limits::redis::codec::{Request, PEEK};
    use tollgate::limits::redis::conn::Connection;
    use tollgate::limits::StoreError;
    let server = RedisServer::start();
    let rt = runtime();
    for url in [server.url(), user_without_functions(&server)] {
        let conn = Connection::single(&url, Duration::from_secs(2), None).unwrap();
        let key = format!("t:alone-{}", url.len());
        let c = charge("b", &key, bucket(10, 1), 4);
        let decision = Request::new(vec![key.as_str().into()], &[&c], Gate::Open, 0);
        let mut peek = Request::new(vec![key.as_str().into()], &[&c], Gate::Open, PEEK);
        peek.limits[0].kind = 9;
        let answers = rt.block_on(conn.call(&[&decision, &peek])).unwrap();
        let (verdicts, _) = answers[0].as_ref().expect("the decision is answered");
        assert_eq!(verdicts[0].remaining, 6, "and charged");
        assert!(
            matches!(&answers[1], Err(StoreError::Script(m)) if m.contains("unknown algorithm 9")),
            "{:?}",
            answers[1]
        );
    }
}

#[test]
fn an_unknown_algorithm_or_flag_is_a_script_error_not_a_guess() {
    use tollgate::limits::redis::codec::{Request, Spec};
    use tollgate::limits::redis::conn::{parts, Connection};
    use tollgate::limits::StoreError;
    let server = RedisServer::start();
    let rt = runtime();
    // On functions, and as scripts (whose flags are decoded per call).
    for url in [server.url(), user_without_functions(&server)] {
        let conn = Connection::single(&url, Duration::from_secs(2), None).unwrap();
        // An algorithm, then a flag bit (128), that no script knows.
        for (kind, flags, expected) in
            [(9, 3, "unknown algorithm 9"), (1, 131, "unknown flags 131")]
        {
            let request = Request {
                keys: vec!["t:unknown".into()],
                limits: vec![Spec {
                    kind,
                    a: 10,
                    b: 1000,
                    cost: 1,
                    flags,
                    take: 0,
                    max_delay_ms: 0,
                    force: false,
                    max_debt: 0,
                    hold: None,
                }],
                blocked_from: Gate::Open.wire(),
                refund_at: 0,
            };
            match rt
                .block_on(conn.eval(&parts(&[&request])))
                .unwrap()
                .pop()
                .unwrap()
            {
                Err(StoreError::Script(message)) => {
                    assert!(message.contains(expected), "{message}")
                }
                other => panic!("expected a script error, got {other:?}"),
            }
        }
    }
    assert!(server.keys().is_empty(), "nothing was written");
}

/// Milliseconds since the epoch of a UTC date and time.
fn utc(y: i32, m: u32, d: u32, hms: (u32, u32, u32)) -> u64 {
    use chrono::{NaiveDate, TimeZone, Utc};
    let date = NaiveDate::from_ymd_opt(y, m, d).unwrap();
    let at = date.and_hms_opt(hms.0, hms.1, hms.2).unwrap();
    Utc.from_utc_datetime(&at).timestamp_millis() as u64
}

#[test]
fn quotas_roll_over_at_utc_calendar_boundaries_in_lua_and_rust() {
    let server = RedisServer::start();
    let rt = runtime();
    // The last second of a period, then the first of the next: month
    // ends of 31, 30 and 28 or 29 days, a year's end, and a day.
    let edges = [
        (Period::Month, utc(2026, 12, 31, (23, 59, 59)), "2026-12"),
        (Period::Month, utc(2027, 4, 30, (23, 59, 59)), "2027-04"),
        (Period::Month, utc(2028, 2, 29, (23, 59, 59)), "2028-02"),
        (Period::Month, utc(2027, 2, 28, (23, 59, 59)), "2027-02"),
        (Period::Day, utc(2026, 12, 1, (23, 59, 59)), "2026-12-01"),
    ];
    for (i, (period, last_second, name)) in edges.into_iter().enumerate() {
        assert_eq!(period.name(last_second), name);
        let (start, end) = period.bounds(last_second);
        assert!(start <= last_second && last_second < end && end - last_second == 1_000);
        let clock = ManualClock::new(last_second);
        let memory = MemoryStore::new(clock.clone());
        let redis = store(&server, &clock);
        let p = Params::Quota(Quota { limit: 3, period });
        let c = charge("q", &format!("quota-edge-{i}"), p, 2);
        let decide = |expect: &[bool]| {
            let want = memory.decide_now(std::slice::from_ref(&c), Gate::Open).0;
            let got = rt.block_on(redis.decide(&[&c], Gate::Open)).unwrap();
            assert_eq!(got, want, "{name}");
            assert_eq!(
                got.iter().map(|v| v.allowed).collect::<Vec<_>>(),
                expect,
                "{name}"
            );
            got[0]
        };
        decide(&[true]);
        // Over the period's limit: the wait is what is left of the period.
        let refused = decide(&[false]);
        assert_eq!(refused.wait_ms, Some(1_000));
        clock.advance(1_000);
        decide(&[true]);
    }
}

#[test]
fn forced_charges_and_delays_agree_in_lua_and_rust() {
    let server = RedisServer::start();
    let rt = runtime();
    let every = [
        bucket(10, 10),
        Params::Gcra(Bucket::per_second(10, 10)),
        Params::FixedWindow(window(10, 60)),
        Params::SlidingWindow(window(10, 60)),
        Params::SlidingLog(window(10, 60)),
        Params::Quota(Quota {
            limit: 10,
            period: Period::Day,
        }),
    ];
    for (i, p) in every.into_iter().enumerate() {
        let clock = ManualClock::new(1_900_000_000_000 + i as u64 * 1_000_000);
        let memory = MemoryStore::new(clock.clone());
        let redis = store(&server, &clock);
        let both = |c: &Charge| {
            let want = memory.decide_now(std::slice::from_ref(c), Gate::Open).0;
            let got = rt.block_on(redis.decide(&[c], Gate::Open)).unwrap();
            assert_eq!(got, want, "{p:?} {c:?}");
            got[0]
        };
        // Forced far beyond the budget, with a debt bound of one more
        // budget: 20 of the first 25 fit, none of the next; with a bound of
        // four budgets, both fit whole.
        for (debt, uncharged) in [(40, [0, 0]), (10, [5, 25])] {
            let forced = Charge {
                op: Op::Force { max_debt: debt },
                ..charge("f", &format!("forced-{i}-{debt}"), p, 25)
            };
            for expected in uncharged {
                let v = both(&forced);
                assert!(v.allowed && v.remaining == 0, "{p:?} {v:?}");
                assert_eq!(v.uncharged, expected, "{p:?} debt {debt}");
            }
        }
        let forced = Charge {
            op: Op::Force { max_debt: 10 },
            ..charge("f", &format!("forced-{i}"), p, 25)
        };
        for _ in 0..2 {
            both(&forced);
        }
        let after = both(&charge("f", &format!("forced-{i}"), p, 1));
        assert!(!after.allowed, "{p:?}");
        if let Params::TokenBucket(_) | Params::Gcra(_) = p {
            // Ten tokens owed (one capacity) at ten a second: 1.1 s until
            // one token is there again.
            assert_eq!(after.wait_ms, Some(1_100), "{p:?}");
        }
    }

    // Delay: ten at once, then each a tenth of a second later, up to
    // half a second; beyond it, refused and nothing charged.
    let clock = ManualClock::new(1_950_000_000_000);
    let memory = MemoryStore::new(clock.clone());
    let redis = store(&server, &clock);
    for p in [bucket(10, 10), Params::Gcra(Bucket::per_second(10, 10))] {
        let c = Charge {
            op: Op::Decide {
                on_limit: OnLimit::Delay { max_ms: 500 },
            },
            ..charge("d", &format!("delay-{p:?}"), p, 1)
        };
        let mut delays = Vec::new();
        for _ in 0..16 {
            let want = memory.decide_now(std::slice::from_ref(&c), Gate::Open).0;
            let got = rt.block_on(redis.decide(&[&c], Gate::Open)).unwrap();
            assert_eq!(got, want);
            delays.push(got[0].allowed.then_some(got[0].delay_ms));
        }
        let mut expected = vec![Some(0); 10];
        expected.extend([100, 200, 300, 400, 500].map(Some));
        expected.push(None);
        assert_eq!(delays, expected, "{p:?}");
    }
}

#[test]
fn a_forced_charge_never_lifts_a_deeper_debt() {
    let server = RedisServer::start();
    let rt = runtime();
    let clock = ManualClock::new(1_960_000_000_000);
    let memory = MemoryStore::new(clock.clone());
    let redis = store(&server, &clock);
    for p in [bucket(5, 5), Params::Gcra(Bucket::per_second(5, 5))] {
        let both = |c: &Charge| {
            let want = memory.decide_now(std::slice::from_ref(c), Gate::Open).0;
            let got = rt.block_on(redis.decide(&[c], Gate::Open)).unwrap();
            assert_eq!(got, want, "{p:?}");
            got[0]
        };
        let key = format!("deep-{p:?}");
        // Thirty held requests schedule six seconds ahead: six capacities
        // of debt, deeper than a forced charge may go.
        let delayed = Charge {
            op: Op::Decide {
                on_limit: OnLimit::Delay { max_ms: 10_000 },
            },
            ..charge("d", &key, p, 1)
        };
        for _ in 0..30 {
            assert!(both(&delayed).allowed);
        }
        let probe = charge("d", &key, p, 1);
        let before = both(&probe).wait_ms.unwrap();
        let forced = Charge {
            op: Op::Force { max_debt: 5 },
            ..charge("d", &key, p, 1)
        };
        both(&forced);
        let after = both(&probe).wait_ms.unwrap();
        assert!(
            after >= before,
            "{p:?}: {before} ms before, {after} ms after"
        );
    }
}

#[test]
fn credits_and_resets_agree_in_lua_and_rust() {
    let server = RedisServer::start();
    let rt = runtime();
    let every = [
        bucket(20, 1),
        Params::Gcra(Bucket::per_second(20, 1)),
        Params::FixedWindow(window(20, 60)),
        Params::SlidingWindow(window(20, 60)),
        Params::SlidingLog(window(20, 60)),
        Params::Quota(Quota {
            limit: 20,
            period: Period::Day,
        }),
    ];
    for (i, p) in every.into_iter().enumerate() {
        let clock = ManualClock::new(1_980_000_000_000 + i as u64 * 1_000_000);
        let memory = MemoryStore::new(clock.clone());
        let redis = store(&server, &clock);
        let key = format!("credit-{i}");
        let probe = charge("c", &key, p, 1);
        let peek = || {
            let want = memory.peek_now(&[&probe]);
            let got = rt.block_on(redis.peek(&[&probe])).unwrap();
            assert_eq!(got, want, "{p:?}");
            got[0].remaining
        };
        // Costs 3, 4, 5: 12 of 20 spent.
        for cost in [3, 4, 5] {
            let c = charge("c", &key, p, cost);
            memory.decide_now(&[&c], Gate::Open);
            rt.block_on(redis.decide(&[&c], Gate::Open)).unwrap();
            clock.advance(10);
        }
        assert_eq!(peek(), 8, "{p:?}");
        // A credit of 6: a log drops its newest entry (5) and not the 4,
        // which no longer fits; the others get 6 back.
        let credit = charge("c", &key, p, 6);
        let want = memory.credit_now(&[&credit]);
        let got = rt.block_on(redis.credit(&[&credit])).unwrap();
        assert_eq!(got, want, "{p:?}");
        let expected = if matches!(p, Params::SlidingLog(_)) {
            13
        } else {
            14
        };
        assert_eq!(peek(), expected, "{p:?}");
        // A credit never goes beyond the initial state.
        let big = charge("c", &key, p, 100);
        assert_eq!(
            rt.block_on(redis.credit(&[&big])).unwrap(),
            memory.credit_now(&[&big]),
            "{p:?}"
        );
        memory.reset_now(&[&probe]);
        rt.block_on(redis.reset(&[&probe])).unwrap();
        assert_eq!(peek(), 20, "{p:?}: full after a reset");
        // Spent then reset: full again, in both.
        let all = charge("c", &key, p, 20);
        memory.decide_now(&[&all], Gate::Open);
        rt.block_on(redis.decide(&[&all], Gate::Open)).unwrap();
        assert_eq!(peek(), 0, "{p:?}");
        memory.reset_now(&[&probe]);
        rt.block_on(redis.reset(&[&probe])).unwrap();
        assert_eq!(peek(), 20, "{p:?}");
    }
}

#[test]
fn the_change_feed_lists_each_record_changed_and_says_when_changes_were_lost() {
    let server = RedisServer::start();
    let clock = ManualClock::new(1_000);
    let s = store(&server, &clock);
    let rt = runtime();
    rt.block_on(async {
        s.put_record_at("credentials", "f-before", Some("{}"))
            .await
            .unwrap();
        // An empty cursor starts at the feed's end: nothing before it.
        let start = s.record_changes("").await.unwrap();
        assert!(start.changed.is_empty() && start.complete);
        s.put_record_at("credentials", "f-1", Some("{}"))
            .await
            .unwrap();
        s.put_record_at("credentials", "f-1", None).await.unwrap();
        s.put_record_at("revocations", "f-2", Some("{}"))
            .await
            .unwrap();
        let read = s.record_changes(&start.cursor).await.unwrap();
        assert!(read.complete);
        let fields: Vec<_> = read
            .changed
            .iter()
            .map(|(k, f)| (k.as_str(), f.as_str()))
            .collect();
        assert_eq!(
            fields,
            [
                ("credentials", "f-1"),
                ("credentials", "f-1"),
                ("revocations", "f-2")
            ]
        );
        let again = s.record_changes(&read.cursor).await.unwrap();
        assert!(again.changed.is_empty() && again.complete);
        assert_eq!(again.cursor, read.cursor);
        // The entry read last trimmed away: what came after it may be lost.
        s.put_record_at("credentials", "f-3", Some("{}"))
            .await
            .unwrap();
        let feed = server
            .keys()
            .into_iter()
            .find(|k| k.ends_with(":changes"))
            .unwrap();
        let _: i64 = server.cmd(&["XTRIM", &feed, "MAXLEN", "1"]).unwrap();
        let lost = s.record_changes(&read.cursor).await.unwrap();
        assert!(!lost.complete);
        assert_eq!(
            lost.changed,
            [("credentials".to_string(), "f-3".to_string())]
        );
    });
}
