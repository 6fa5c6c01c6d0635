//! `backend: redis_sentinel` through the real binary: a primary, its
//! replica and a sentinel, all real processes; the primary is killed and
//! the gateway follows the failover without a restart.

mod support;

use std::time::Duration;

use support::redis_server::{RedisSentinel, RedisServer};
use support::{digest, eventually, Gateway};

const SECRET: (&str, &str) = ("TOLLGATE_KEY_SECRET", "sentinel-test-secret");
const KEY: (&str, &str) = ("authorization", "Bearer key-s1");
const CAPACITY: usize = 5;

fn policy(sentinel: &RedisSentinel) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store:
  backend: redis_sentinel
  urls: ["{}"]
  master_name: {}
  timeout_ms: 200
  circuit_breaker: {{ failure_threshold: 1000, open_ms: 100 }}
auth:
  keys: [{{ id: s1, tenant: acme, sha256: "{}" }}]
limits:
  per-credential: {{ key: [credential], capacity: {CAPACITY}, refill_per_second: 0.001, on_store_error: closed }}
routes:
  - {{ name: x, path: /x, respond: {{ status: 200 }}, limits: [per-credential] }}
"#,
        sentinel.url(),
        RedisSentinel::MASTER,
        digest("key-s1")
    )
}

fn replicated(primary: &RedisServer, replica: &RedisServer) -> bool {
    let offset = |s: &RedisServer, field: &str| -> Option<u64> {
        let info: String = s.cmd(&["INFO", "replication"]).ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().parse().ok())
    };
    let Some(written) = offset(primary, "master_repl_offset:") else {
        return false;
    };
    offset(replica, "slave_repl_offset:").is_some_and(|r| r >= written)
}

#[test]
fn a_failover_is_followed_without_a_restart() {
    let mut primary = RedisServer::start();
    let replica = RedisServer::replica_of(&primary);
    let sentinel = RedisSentinel::watching(&primary);
    // The sentinel learns of the replica from the primary.
    let knows_replica = || {
        sentinel
            .cmd::<Vec<redis::Value>>(&["SENTINEL", "replicas", RedisSentinel::MASTER])
            .is_ok_and(|r| !r.is_empty())
    };
    assert!(eventually(Duration::from_secs(20), knows_replica));

    let gw = Gateway::start_with_env(&policy(&sentinel), None, &[SECRET]);
    for _ in 0..3 {
        let r = gw.get("/x", &[KEY]);
        assert_eq!(r.status, 200, "{} {}", r.body, gw.log());
    }
    assert!(eventually(Duration::from_secs(5), || replicated(
        &primary, &replica
    )));

    primary.kill();
    // While there is no primary, the limit follows its failure mode.
    let during = gw.get("/x", &[KEY]);
    assert_eq!(during.status, 503, "{}", during.body);

    // The sentinel promotes the replica; the gateway finds it by itself.
    let promoted = || sentinel.primary_port() == Some(replica.port);
    assert!(eventually(Duration::from_secs(30), promoted), "no failover");
    let resumed = || gw.get("/x", &[KEY]).status != 503;
    assert!(eventually(Duration::from_secs(10), resumed), "{}", gw.log());

    // The budget spent before the failover holds after it: of the five
    // units, three were spent before, one by the request that resumed.
    let mut after: usize = 1;
    for _ in 0..5 {
        if gw.get("/x", &[KEY]).status == 200 {
            after += 1;
        }
    }
    let admitted = 3 + after;
    let overage = admitted.saturating_sub(CAPACITY);
    println!(
        "sentinel failover: {admitted} admitted for a budget of {CAPACITY}, overage {overage}"
    );
    assert_eq!(overage, 0, "replication had caught up before the failover");

    // The old primary comes back (empty, as a fresh process) and is made a
    // replica by the sentinel; the gateway never writes to it.
    primary.restart();
    for _ in 0..5 {
        assert_eq!(gw.get("/x", &[KEY]).status, 429);
    }
    let stats: String = primary.cmd(&["INFO", "commandstats"]).unwrap();
    assert!(
        !stats.contains("cmdstat_fcall") && !stats.contains("cmdstat_evalsha"),
        "the demoted node got script calls: {stats}"
    );
    let errors = gw.metric("tollgate_store_errors_total{reason=\"connection\"}")
        + gw.metric("tollgate_store_errors_total{reason=\"timeout\"}");
    assert!(errors >= 1.0, "{}", gw.metrics());
}
