//! `sync: lease` through the real binary: four gateways share one leased
//! budget in Redis with no overage and bounded under-use, call Redis a
//! fraction of a time per request, give unspent units back, and a killed
//! gateway's units come back by themselves.

mod support;

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use support::redis_server::{RedisCluster, RedisServer};
use support::{digest, eventually, get, Gateway};

const SECRET: (&str, &str) = ("TOLLGATE_KEY_SECRET", "lease-secret-71c2");
const INSTANCES: usize = 4;
const UNITS: usize = 20;

/// Store calls may take this long: on a loaded machine a slow call must
/// not become a store failure (a 503), which would change the counts.
const STORE_TIMEOUT_MS: u64 = 2000;

/// A global budget leased `UNITS` at a time, in one Redis.
fn policy(redis: &RedisServer, capacity: u64, per_second: f64, ttl_ms: u64) -> String {
    policy_on(&redis.store(STORE_TIMEOUT_MS), capacity, per_second, ttl_ms)
}

/// The same on the `store` given.
fn policy_on(store: &str, capacity: u64, per_second: f64, ttl_ms: u64) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {store}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  hot: {{ key: [], capacity: {capacity}, refill_per_second: {per_second}, sync: lease, lease: {{ units: {UNITS}, ttl_ms: {ttl_ms} }} }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200, body: "ok" }}, limits: [hot] }}
"#,
        digest("key-c1")
    )
}

/// Sends `per_client` requests from each of `clients` threads at once,
/// round robin over `gws`; returns how many got 200.
fn blast(gws: &[&Gateway], clients: usize, per_client: usize) -> usize {
    let addrs: Arc<Vec<_>> = Arc::new(gws.iter().map(|g| g.addr).collect());
    let handles: Vec<_> = (0..clients)
        .map(|n| {
            let addrs = addrs.clone();
            thread::spawn(move || {
                (0..per_client)
                    .filter(|i| {
                        let addr = addrs[(n + i) % addrs.len()];
                        get(addr, "/x", &[("authorization", "Bearer key-c1")]).status == 200
                    })
                    .count()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).sum()
}

/// Script calls Redis has served (`FCALL` or `EVALSHA`).
fn script_calls(redis: &RedisServer) -> u64 {
    let info: String = redis.cmd(&["INFO", "commandstats"]).expect("INFO");
    info.lines()
        .filter(|l| l.starts_with("cmdstat_fcall:") || l.starts_with("cmdstat_evalsha:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Sends requests to `gw` until `admitted` reaches `budget` (units given
/// back reach the store within the lease time); the total admitted, which
/// is `budget` when every unit given back was spent and none twice.
fn spend_the_rest(gw: &Gateway, mut admitted: usize, budget: usize) -> usize {
    eventually(Duration::from_secs(10), || {
        admitted += blast(&[gw], 1, 10);
        admitted >= budget
    });
    admitted
}

/// Whether every gateway soon holds nothing (its units given back).
fn all_given_back(gws: &[&Gateway]) -> bool {
    eventually(Duration::from_secs(10), || {
        gws.iter().all(|g| held(g) == 0.0)
    })
}

/// `n` gateways on the same policy.
fn fleet(n: usize, text: &str) -> Vec<Gateway> {
    (0..n)
        .map(|_| Gateway::start_with_env(text, None, &[SECRET]))
        .collect()
}

fn held(gw: &Gateway) -> f64 {
    gw.metric("tollgate_lease_units{limit=\"hot\"}")
}

#[test]
fn four_gateways_share_a_leased_budget_without_overage() {
    let redis = RedisServer::start();
    // 400 units that refill one unit in about 17 minutes, and leases
    // that outlive the test: every unit is either admitted or held, so the
    // counts are exact whatever the timing. (Giving back at ttl_ms is the
    // next test's.)
    let text = policy(&redis, 400, 0.001, 60_000);
    let gws = fleet(INSTANCES, &text);
    let all: Vec<&Gateway> = gws.iter().collect();
    let before = script_calls(&redis);

    let sent = 16 * 50;
    let admitted = blast(&all, 16, 50);
    assert!(admitted <= 400, "no overage: {admitted} admitted of 400");
    // (Once a renewal still on its way has landed.)
    let held_total = || all.iter().map(|g| held(g)).sum::<f64>();
    assert!(
        eventually(Duration::from_secs(5), || admitted as f64 + held_total()
            == 400.0),
        "every unit admitted or held: {admitted} admitted, {} held",
        held_total()
    );
    assert!(
        admitted >= 400 - INSTANCES * UNITS,
        "under-use at most instances × units: {admitted} admitted"
    );
    let calls = script_calls(&redis) - before;
    // Exact decisions would be a call a request (batched: a little less).
    assert!(
        calls * 4 <= sent as u64,
        "{calls} script calls for {sent} requests"
    );

    // A reload gives back what is held: one gateway alone then admits
    // exactly what is left of the 400, and not one more.
    for g in &all {
        g.signal("-HUP");
    }
    assert!(all_given_back(&all));
    assert_eq!(spend_the_rest(all[0], admitted, 400), 400);
}

#[test]
fn unspent_units_go_back_after_the_lease_time() {
    let redis = RedisServer::start();
    let text = policy(&redis, 400, 0.001, 300);
    let gws = fleet(INSTANCES, &text);
    let all: Vec<&Gateway> = gws.iter().collect();
    // Less than the budget: every request is admitted, and the gateways
    // are left holding what they took beyond it.
    assert_eq!(blast(&all, 10, 30), 300);
    let holding: Vec<f64> = all.iter().map(|g| held(g)).collect();
    assert!(holding.iter().sum::<f64>() > 0.0, "{holding:?}");
    assert!(holding.iter().all(|&h| h <= UNITS as f64), "{holding:?}");
    assert!(all_given_back(&all));
    for (g, h) in all.iter().zip(&holding) {
        let series = "tollgate_lease_calls_total{kind=\"return\",limit=\"hot\"}";
        let returned = eventually(Duration::from_secs(10), || g.metric(series) >= 1.0);
        assert!(*h == 0.0 || returned, "held {h}, never returned");
    }
    // One gateway alone now takes every unit the others gave back.
    assert_eq!(spend_the_rest(all[0], 300, 400), 400);
}

#[test]
fn a_killed_gateways_lease_comes_back_without_operator_action() {
    let redis = RedisServer::start();
    // 100 units refilling 100 a second: a lost lease of 20 refills in
    // 200 ms, well within the lease's 500 ms.
    let text = policy(&redis, 100, 100.0, 500);
    let doomed = Gateway::start_with_env(&text, None, &[SECRET]);
    assert_eq!(blast(&[&doomed], 1, 1), 1);
    assert_eq!(held(&doomed), UNITS as f64);
    // SIGKILL: nothing is given back.
    drop(doomed);
    // The key expires once its budget is whole again: Redis holds nothing
    // of the dead instance, and the next instance starts from a full budget.
    assert!(eventually(Duration::from_secs(5), || redis
        .keys()
        .is_empty()));
    let survivor = Gateway::start_with_env(&text, None, &[SECRET]);
    assert!(blast(&[&survivor], 4, 25) >= 100 - UNITS);
}

#[test]
fn a_gateway_that_stops_gives_its_lease_back() {
    let redis = RedisServer::start();
    // A lease time far longer than the test: only the shutdown gives back.
    let text = policy(&redis, 100, 0.001, 60_000);
    let mut first = Gateway::start_with_env(&text, None, &[SECRET]);
    assert_eq!(blast(&[&first], 1, 1), 1);
    assert_eq!(held(&first), UNITS as f64);
    first.signal("-TERM");
    assert!(first.wait_exit(Duration::from_secs(10)).is_some());
    let second = Gateway::start_with_env(&text, None, &[SECRET]);
    assert_eq!(
        blast(&[&second], 1, 120),
        99,
        "all but the one request spent"
    );
}

#[test]
fn leases_are_taken_and_given_back_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let text = policy_on(&cluster.store(STORE_TIMEOUT_MS), 100, 0.001, 300);
    let gws = fleet(2, &text);
    let all: Vec<&Gateway> = gws.iter().collect();
    assert_eq!(blast(&all, 2, 30), 60);
    assert!(all_given_back(&all));
    assert_eq!(spend_the_rest(all[1], 60, 100), 100);
}

#[test]
fn a_reload_gives_leases_back() {
    let redis = RedisServer::start();
    let text = policy(&redis, 100, 0.001, 60_000);
    let gw = Gateway::start_with_env(&text, None, &[SECRET]);
    assert_eq!(blast(&[&gw], 1, 1), 1);
    assert_eq!(held(&gw), UNITS as f64);
    gw.rewrite(&text, None);
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(10), || held(&gw) == 0.0));
    // The units came back to the store: the rest of the budget is there.
    assert_eq!(spend_the_rest(&gw, 1, 100), 100);
}
