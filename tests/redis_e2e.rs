//! Several gateway instances sharing limits in a real Redis, what each limit
//! does when that Redis is killed, paused or restarted empty, and budgets
//! carried over to a replica promoted in its place.

mod support;

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use support::redis_server::{RedisCluster, RedisServer};
use support::{digest, eventually, get, Gateway};

const SECRET: (&str, &str) = ("TOLLGATE_KEY_SECRET", "e2e-secret-3f9a");

fn gateways(n: usize, policy: &str) -> Vec<Gateway> {
    (0..n)
        .map(|_| Gateway::start_with_env(policy, None, &[SECRET]))
        .collect()
}

/// Sends `per_client` requests from each client at once, spreading them
/// over the gateways round robin; returns how many of each client's got 200.
fn blast(gws: &[Gateway], clients: &[(&str, usize)], path: &str) -> Vec<usize> {
    let addrs: Arc<Vec<_>> = Arc::new(gws.iter().map(|g| g.addr).collect());
    let handles: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(n, &(key, per_client))| {
            let (addrs, key, path) = (addrs.clone(), format!("Bearer {key}"), path.to_string());
            thread::spawn(move || {
                let mut ok = 0;
                for i in 0..per_client {
                    let addr = addrs[(n + i) % addrs.len()];
                    if get(addr, &path, &[("authorization", key.as_str())]).status == 200 {
                        ok += 1;
                    }
                }
                ok
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A tenant budget of 40 that refills one request in about 17 minutes: no
/// refill reaches a whole request while a test runs, so the admitted counts
/// are exact whatever the timing. (How a budget refills under load over
/// time is measured by `bench/run.py`, not asserted here.)
fn shared_budget_policy(backend: &str, redis: &RedisServer) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {{ backend: {backend}, urls: ["{}"], timeout_ms: 500 }}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 40, refill_per_second: 0.001 }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200, body: "ok" }}, limits: [per-tenant] }}
"#,
        redis.url(),
        digest("key-c1")
    )
}

#[test]
fn instances_share_one_budget_in_redis_and_not_in_memory() {
    let redis = RedisServer::start();
    // 180 requests from nine concurrent clients, 60 to each of three
    // instances: far more than one budget of 40, more than each instance's.
    let clients = vec![("key-c1", 20); 9];

    let shared = gateways(3, &shared_budget_policy("redis", &redis));
    let admitted: usize = blast(&shared, &clients, "/x").iter().sum();
    assert_eq!(admitted, 40, "the three instances share one budget");
    drop(shared);

    let local = gateways(3, &shared_budget_policy("memory", &redis));
    let admitted_local: usize = blast(&local, &clients, "/x").iter().sum();
    assert_eq!(
        admitted_local,
        3 * 40,
        "per-instance memory stores each admit a whole budget"
    );
}

#[test]
fn all_or_nothing_holds_under_concurrency_and_keys_hide_identities() {
    let redis = RedisServer::start();
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {{ backend: redis, urls: ["{}"], timeout_ms: 500, key_prefix: "tg:" }}
auth:
  keys:
    - {{ id: cred-a1, tenant: tenant-acme, sha256: "{}" }}
    - {{ id: cred-a2, tenant: tenant-acme, sha256: "{}" }}
    - {{ id: cred-b1, tenant: tenant-beta, sha256: "{}" }}
    - {{ id: cred-b2, tenant: tenant-beta, sha256: "{}" }}
limits:
  ip-guard: {{ scope: pre_auth, key: [ip], capacity: 100000, refill_per_second: 1 }}
  per-credential: {{ key: [credential], capacity: 30, refill_per_second: 0.001 }}
  per-tenant: {{ key: [tenant], capacity: 40, refill_per_second: 0.001 }}
  global: {{ key: [], capacity: 60, refill_per_second: 0.001 }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200, body: "ok" }}, limits: [ip-guard, per-credential, per-tenant, global] }}
"#,
        redis.url(),
        digest("raw-key-a1"),
        digest("raw-key-a2"),
        digest("raw-key-b1"),
        digest("raw-key-b2"),
    );
    let gws = gateways(3, &policy);
    let clients = [
        ("raw-key-a1", 60),
        ("raw-key-a1", 60),
        ("raw-key-a2", 60),
        ("raw-key-a2", 60),
        ("raw-key-b1", 60),
        ("raw-key-b1", 60),
        ("raw-key-b2", 60),
        ("raw-key-b2", 60),
    ];
    let admitted = blast(&gws, &clients, "/x");
    let per_credential: Vec<usize> = admitted.chunks(2).map(|c| c.iter().sum()).collect();
    for (i, n) in per_credential.iter().enumerate() {
        assert!(*n <= 30, "credential {i}: {n}");
    }
    assert!(per_credential[0] + per_credential[1] <= 40);
    assert!(per_credential[2] + per_credential[3] <= 40);
    // Demand far exceeds every budget: if no denied request was ever
    // charged to the limits that admitted it, the global budget is used
    // exactly.
    assert_eq!(
        per_credential.iter().sum::<usize>(),
        60,
        "{per_credential:?}"
    );

    let keys = redis.keys();
    assert_eq!(keys.len(), 1 + 4 + 2 + 1, "{keys:?}");
    for key in &keys {
        for secret in [
            "tenant-acme",
            "tenant-beta",
            "cred-",
            "raw-key",
            "127.0.0.1",
            "acme",
            "beta",
        ] {
            assert!(!key.contains(secret), "{key} reveals {secret}");
        }
        assert!(key.starts_with("tg:"), "{key}");
    }
}

fn failure_policy(redis: &RedisServer) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store:
  backend: redis
  urls: ["{}"]
  timeout_ms: 50
  circuit_breaker: {{ failure_threshold: 3, open_ms: 400 }}
  expected_instances: 2
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  open-limit: {{ key: [credential], capacity: 1, refill_per_second: 0.001, on_store_error: open }}
  closed-limit: {{ key: [credential], capacity: 100, refill_per_second: 0.001, on_store_error: closed }}
  local-limit: {{ key: [credential], capacity: 10, refill_per_second: 0.001, on_store_error: local }}
routes:
  - {{ name: open, path: /open, respond: {{ status: 200 }}, limits: [open-limit] }}
  - {{ name: closed, path: /closed, respond: {{ status: 200 }}, limits: [closed-limit] }}
  - {{ name: local, path: /local, respond: {{ status: 200 }}, limits: [local-limit] }}
"#,
        redis.url(),
        digest("key-c1")
    )
}

const KEY: (&str, &str) = ("authorization", "Bearer key-c1");

/// A request with the test key. A store that hangs must never hang the
/// request: `get` fails the test if the gateway does not answer (its client
/// gives up after 10 s); how fast the answer comes is measured by
/// `bench/store_stall.py`, not asserted here.
fn keyed(gw: &Gateway, path: &str) -> support::Reply {
    gw.get(path, &[KEY])
}

fn statuses(gw: &Gateway, path: &str, n: usize) -> Vec<u16> {
    (0..n).map(|_| keyed(gw, path).status).collect()
}

fn assert_failure_modes(gw: &Gateway) {
    assert_eq!(
        statuses(gw, "/open", 4),
        [200; 4],
        "open admits while the store fails"
    );
    let closed = keyed(gw, "/closed");
    assert_eq!(closed.status, 503);
    assert_eq!(closed.header("retry-after"), Some("1"));
    assert_eq!(closed.json()["status"], 503);
    // The local fallback enforces 10 / 2 instances = 5.
    assert_eq!(statuses(gw, "/local", 6), [200, 200, 200, 200, 200, 429]);
    for (limit, outcome) in [
        ("open-limit", "fail_open"),
        ("closed-limit", "fail_closed"),
        ("local-limit", "local_fallback"),
    ] {
        let series =
            format!("tollgate_limit_decisions_total{{limit=\"{limit}\",outcome=\"{outcome}\"}}");
        assert!(gw.metric(&series) >= 1.0, "{series} in\n{}", gw.metrics());
    }
}

#[test]
fn killed_redis_follows_each_limits_failure_mode() {
    let mut redis = RedisServer::start();
    let gw = Gateway::start_with_env(&failure_policy(&redis), None, &[SECRET]);
    assert_eq!(
        statuses(&gw, "/open", 2),
        [200, 429],
        "decided by Redis while it is up"
    );
    assert_eq!(
        gw.get("/readyz", &[]).status,
        404,
        "readiness lives on the admin port"
    );
    redis.kill();
    assert_failure_modes(&gw);
    assert!(
        gw.metric("tollgate_store_errors_total{reason=\"connection\"}")
            + gw.metric("tollgate_store_errors_total{reason=\"timeout\"}")
            >= 1.0
    );
    let ready = || get(gw.admin, "/readyz", &[]).status;
    assert!(eventually(Duration::from_secs(2), || ready() == 503));
    // Out of rotation, with no traffic at all, readiness still notices
    // when the store is back.
    redis.restart();
    assert!(eventually(Duration::from_secs(5), || ready() == 200));
}

#[test]
fn paused_redis_opens_the_circuit_and_it_closes_again() {
    let redis = RedisServer::start();
    let gw = Gateway::start_with_env(&failure_policy(&redis), None, &[SECRET]);
    assert_eq!(keyed(&gw, "/closed").status, 200);
    redis.pause();
    assert_failure_modes(&gw);
    assert_eq!(gw.metric("tollgate_store_circuit_open"), 1.0);
    assert!(gw.metric("tollgate_store_errors_total{reason=\"circuit_open\"}") >= 1.0);
    redis.resume();
    // After open_ms one probe goes through and closes the circuit.
    assert!(eventually(Duration::from_secs(5), || keyed(&gw, "/closed")
        .status
        == 200));
    assert_eq!(gw.metric("tollgate_store_circuit_open"), 0.0);
}

#[test]
fn redis_restarted_empty_is_used_again_without_operator_action() {
    let mut redis = RedisServer::start();
    let gw = Gateway::start_with_env(&failure_policy(&redis), None, &[SECRET]);
    assert_eq!(statuses(&gw, "/open", 2), [200, 429]);
    redis.restart();
    // The connection is remade and the script reloaded; the new server
    // starts with a fresh budget.
    assert!(eventually(Duration::from_secs(5), || keyed(&gw, "/closed")
        .status
        == 200));
    assert_eq!(statuses(&gw, "/open", 2), [200, 429]);
    assert_eq!(get(gw.admin, "/readyz", &[]).status, 200);
}

#[test]
fn the_redis_backend_needs_its_key_secret() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("policy.yaml");
    let policy = failure_policy(&redis)
        .replace("{listen}", "127.0.0.1:1")
        .replace("{admin}", "127.0.0.1:2");
    std::fs::write(&config, policy).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "--config"])
        .arg(&config)
        .env_remove("TOLLGATE_KEY_SECRET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("environment variable TOLLGATE_KEY_SECRET is not set"),
        "{stderr}"
    );
}

#[test]
fn spent_budgets_survive_a_failover_to_a_promoted_replica() {
    let mut primary = RedisServer::start();
    let replica = RedisServer::replica_of(&primary);
    let linked = eventually(Duration::from_secs(10), || {
        replica
            .cmd::<String>(&["INFO", "replication"])
            .is_ok_and(|info| info.contains("master_link_status:up"))
    });
    assert!(linked, "the replica never linked to its primary");

    // Five requests a tenant, refilled one a minute: spent within the test.
    let policy = |redis: &RedisServer| {
        format!(
            r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {{ backend: redis, urls: ["{}"], timeout_ms: 500 }}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 5, refill_per_second: 0.0167 }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200, body: "ok" }}, limits: [per-tenant] }}
"#,
            redis.url(),
            digest("key-c1")
        )
    };
    let key = [("authorization", "Bearer key-c1")];
    let gw = Gateway::start_with_env(&policy(&primary), None, &[SECRET]);
    let before: Vec<u16> = (0..6).map(|_| gw.get("/x", &key).status).collect();
    assert_eq!(before, [200, 200, 200, 200, 200, 429]);

    // The script's writes reach the replica, expiry included.
    let keys = primary.keys();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let state: Vec<u8> = primary.cmd(&["GET", &keys[0]]).unwrap();
    let replicated = eventually(Duration::from_secs(5), || {
        replica.cmd::<Option<Vec<u8>>>(&["GET", &keys[0]]).ok() == Some(Some(state.clone()))
    });
    assert!(replicated, "the replica never saw {state:?}");
    let ttl: i64 = replica.cmd(&["PTTL", &keys[0]]).unwrap();
    assert!(ttl > 0, "the key expires on the replica too, PTTL {ttl}");

    // Fail over: the primary dies, the replica is promoted, and a gateway
    // pointed at it finds the tenant's budget spent, not fresh.
    drop(gw);
    primary.kill();
    let _: String = replica.cmd(&["REPLICAOF", "NO", "ONE"]).unwrap();
    let gw = Gateway::start_with_env(&policy(&replica), None, &[SECRET]);
    let r = gw.get("/x", &key);
    assert_eq!(
        r.status, 429,
        "the budget spent before the failover still counts"
    );
    assert!(r.header("retry-after").is_some());
}

#[test]
fn redis_over_tls_verifies_the_server_and_shares_the_budget() {
    let (redis, ca) = RedisServer::start_tls();
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {{ backend: redis, urls: ["{}"], timeout_ms: 1000 }}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 3, refill_per_second: 0.0167, on_store_error: closed }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200, body: "ok" }}, limits: [per-tenant] }}
"#,
        redis.tls_url(),
        digest("key-c1")
    );
    let key = [("authorization", "Bearer key-c1")];
    let ca = ca.to_string_lossy().into_owned();
    let trusting = |n| {
        (0..n)
            .map(|_| {
                Gateway::start_with_env(&policy, None, &[SECRET, ("SSL_CERT_FILE", ca.as_str())])
            })
            .collect::<Vec<_>>()
    };

    // Two instances that trust the CA share the budget over TLS.
    let gws = trusting(2);
    let statuses: Vec<u16> = (0..4).map(|i| gws[i % 2].get("/x", &key).status).collect();
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert_eq!(redis.keys().len(), 1, "the state went to Redis");

    // One that does not trust it refuses the server: the store fails, and
    // the closed limit answers 503.
    let unknown_ca = tempfile::NamedTempFile::new().unwrap();
    let path = unknown_ca.path().to_string_lossy().into_owned();
    let wary = Gateway::start_with_env(&policy, None, &[SECRET, ("SSL_CERT_FILE", path.as_str())]);
    let r = wary.get("/x", &key);
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        wary.metric("tollgate_store_errors_total{reason=\"connection\"}") >= 1.0
            || wary.metric("tollgate_store_errors_total{reason=\"timeout\"}") >= 1.0,
        "{}",
        wary.metrics()
    );
}

#[test]
fn a_cluster_shares_budgets_and_decides_across_slots_all_or_nothing() {
    let cluster = RedisCluster::start(3);
    // The global limit is named `everyone` so that its key and the tenant's
    // land on different nodes of this three-node cluster (keys are HMACs
    // under the test's fixed secret, slots split evenly by `redis-cli`).
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 10, refill_per_second: 0.001, on_store_error: open }}
  everyone: {{ key: [], capacity: 3, refill_per_second: 0.001, on_store_error: closed }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200, body: "ok" }}, limits: [per-tenant, everyone] }}
"#,
        cluster.store(1000),
        digest("key-c1")
    );
    let gws = gateways(2, &policy);
    let key = [("authorization", "Bearer key-c1")];
    let statuses: Vec<u16> = (0..5).map(|i| gws[i % 2].get("/x", &key).status).collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 429],
        "two instances, one global budget of 3"
    );

    // Read on the other instance without charging: the tenant's bucket
    // and the global one, from two slots.
    let explained = get(gws[1].admin, "/admin/explain?path=/x&credential=c1", &[]).json();
    assert_eq!(explained["limits"][0]["remaining"], 7, "{explained}");
    assert_eq!(explained["limits"][1]["remaining"], 0);
    // One unit at 0.001 a second, less what refilled while the test ran.
    let retry = explained["limits"][1]["retry_after_ms"].as_u64().unwrap();
    assert!((900_000..=1_000_000).contains(&retry), "{retry}");

    // The tenant's key and the global key live in different slots, so each
    // request was decided by two script calls on different nodes.
    let keys = cluster.keys();
    let find = |name: &str| {
        keys.iter()
            .find(|k| k.contains(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} key in {keys:?}"))
            .clone()
    };
    let (tenant, global) = (find("per-tenant"), find("everyone"));
    assert_ne!(
        tollgate::limits::redis::cluster::slot(&tenant),
        tollgate::limits::redis::cluster::slot(&global)
    );
    // The two denied requests were charged to the tenant and given back:
    // its bucket holds 10 - 3 units, not 10 - 5.
    let state = cluster.get(&tenant).expect("the tenant's state");
    // A token bucket's state: algorithm (1 byte), meaning (8), then the
    // balance in micro-tokens and its time (8 each), little-endian.
    let balance = |state: &[u8]| {
        assert_eq!((state.len(), state[0]), (25, 1), "a token bucket's state");
        u64::from_le_bytes(state[9..17].try_into().unwrap()) / 1_000_000
    };
    assert_eq!(balance(&state), 7, "state {state:?}");

    // The node holding the global key dies: that limit fails closed (503),
    // and what the tenant's slot charged meanwhile is given back.
    let holder = |key: &str| {
        cluster
            .nodes
            .iter()
            .position(|n| {
                n.cmd::<Option<Vec<u8>>>(&["GET", key])
                    .is_ok_and(|v| v.is_some())
            })
            .unwrap()
    };
    let (tenant_node, global_node) = (holder(&tenant), holder(&global));
    assert_ne!(tenant_node, global_node, "the keys live on different nodes");
    let mut cluster = cluster;
    cluster.nodes[global_node].kill();
    for gw in &gws {
        let r = gw.get("/x", &key);
        assert_eq!(r.status, 503, "{}", r.body);
    }
    let after = cluster.nodes[tenant_node]
        .cmd::<Vec<u8>>(&["GET", &tenant])
        .unwrap();
    assert_eq!(balance(&after), 7, "state {after:?}");
}

#[test]
fn acl_users_and_passwords_in_urls_work_and_stay_secret() {
    let redis = RedisServer::start();
    redis
        .cmd::<()>(&[
            "ACL",
            "SETUSER",
            "gate",
            "on",
            ">s3cr3t-pass",
            "~*",
            "&*",
            "+@all",
        ])
        .unwrap();
    let policy = |password: &str| {
        format!(
            r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {{ backend: redis, urls: ["redis://gate:{password}@127.0.0.1:{}/0"], timeout_ms: 500 }}
auth:
  keys: [{{ id: c1, tenant: acme, sha256: "{}" }}]
limits:
  per-credential: {{ key: [credential], capacity: 5, refill_per_second: 1, on_store_error: closed }}
routes:
  - {{ name: x, path: /x, respond: {{ status: 200 }}, limits: [per-credential] }}
"#,
            redis.port,
            digest("key-c1")
        )
    };
    let key = [("authorization", "Bearer key-c1")];
    let gw = Gateway::start_with_env(&policy("s3cr3t-pass"), None, &[SECRET]);
    assert_eq!(gw.get("/x", &key).status, 200, "{}", gw.log());
    assert_eq!(
        redis.keys().len(),
        1,
        "the state went to Redis as user gate"
    );

    let wrong = Gateway::start_with_env(&policy("not-the-pass"), None, &[SECRET]);
    let r = wrong.get("/x", &key);
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        wrong.metric("tollgate_store_errors_total{reason=\"connection\"}") >= 1.0,
        "{}",
        wrong.metrics()
    );
    for log in [gw.log(), wrong.log()] {
        assert!(
            !log.contains("s3cr3t-pass") && !log.contains("not-the-pass"),
            "{log}"
        );
    }
}

/// A chat route charged 100 at admission and then the 1000 its slow
/// upstream reports, against a daily window of 1000 per tenant in `redis`.
fn under_estimated_policy(redis: &RedisServer, route_extra: &str) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 2 }}
store: {}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  tokens: {{ algorithm: fixed_window, key: [tenant], limit: 1000, window_seconds: 86400 }}
upstreams:
  llm: {{ servers: ["{{upstream}}"] }}
routes:
  - name: chat
    path: "/slow/chat"
    upstream: llm
    cost: 100
    cost_from_response: {{ header: x-usage-tokens, max: 1000{route_extra} }}
    limits: [tokens]
"#,
        redis.store(500),
        digest("key-c1")
    )
}

/// The count of the one fixed window in `redis`: its state is the
/// algorithm (1 byte), its window (8), its start (8) and its count (8).
fn window_count(redis: &RedisServer) -> u64 {
    let keys = redis.keys();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let state: Vec<u8> = redis.cmd(&["GET", &keys[0]]).expect("GET");
    assert_eq!(state.len(), 25, "{state:?}");
    u64::from_le_bytes(state[17..25].try_into().unwrap())
}

/// Sends `n` chat requests at once, each reporting `usage`; returns how
/// many were admitted.
fn concurrent_chats(gw: &Gateway, n: usize, usage: &str) -> usize {
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (addr, usage) = (gw.addr, usage.to_string());
            thread::spawn(move || {
                let headers = [
                    ("authorization", "Bearer key-c1"),
                    ("x-reply-usage", usage.as_str()),
                ];
                get(addr, "/slow/chat", &headers).status
            })
        })
        .collect();
    let statuses: Vec<u16> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        statuses.iter().all(|s| [200, 429].contains(s)),
        "{statuses:?}"
    );
    statuses.iter().filter(|&&s| s == 200).count()
}

#[test]
fn concurrent_under_estimates_are_charged_in_full() {
    let redis = RedisServer::start();
    // Slow enough that every request is decided before any settles.
    let upstream = support::Upstream::slow(Duration::from_millis(300));
    let gw = Gateway::start_with_env(
        &under_estimated_policy(&redis, ""),
        Some(&upstream),
        &[SECRET],
    );
    let admitted = concurrent_chats(&gw, 15, "1000");
    assert_eq!(admitted, 10, "ten estimates of 100 fit a budget of 1000");
    let series = "tollgate_cost_reconciled_total{direction=\"charged\",route=\"chat\"}";
    assert!(eventually(Duration::from_secs(10), || gw.metric(series) == 10.0));
    // Every response's 1000, to the unit: the default debt bound (10 x
    // (max - cost) = 9000 beyond the limit) holds all of them.
    assert_eq!(window_count(&redis), 10_000);
    assert_eq!(
        gw.metric("tollgate_cost_uncharged_total{route=\"chat\"}"),
        0.0
    );
}

#[test]
fn what_goes_beyond_max_debt_is_counted_and_reserve_max_never_overspends() {
    let redis = RedisServer::start();
    let upstream = support::Upstream::slow(Duration::from_millis(300));
    // A debt bound of 2000 beyond the limit: 3000 of the 10 000 are charged.
    let policy = under_estimated_policy(&redis, ", max_debt: 2000");
    let gw = Gateway::start_with_env(&policy, Some(&upstream), &[SECRET]);
    assert_eq!(concurrent_chats(&gw, 15, "1000"), 10);
    let uncharged = "tollgate_cost_uncharged_total{route=\"chat\"}";
    // Ten settlements of 900: the first two fit (2000 of debt room), then
    // nothing: 7 x 900 uncharged in whole and 200 of the third.
    assert!(eventually(Duration::from_secs(10), || gw.metric(uncharged)
        == 7.0 * 900.0 + 700.0));
    assert_eq!(window_count(&redis), 3_000);
    drop(gw);

    // reserve: max charges the max at admission and gives back the rest.
    let redis = RedisServer::start();
    let policy = under_estimated_policy(&redis, ", reserve: max");
    let gw = Gateway::start_with_env(&policy, Some(&upstream), &[SECRET]);
    assert_eq!(concurrent_chats(&gw, 15, "400"), 1, "one max of 1000 fits");
    let series = "tollgate_cost_reconciled_total{direction=\"refunded\",route=\"chat\"}";
    assert!(eventually(Duration::from_secs(10), || gw.metric(series) == 1.0));
    assert_eq!(window_count(&redis), 400);
}

#[test]
fn explain_reads_every_limit_of_a_route_without_charging() {
    let redis = RedisServer::start();
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}", plan: pro }} ]
limits:
  per-ip: {{ key: [ip], scope: pre_auth, capacity: 100, refill_per_second: 0.001, store: local }}
  per-tenant: {{ key: [tenant], capacity: 40, refill_per_second: 0.001 }}
  daily: {{ algorithm: quota, key: [tenant], limit: 1000, period: day }}
plans:
  pro: {{ per-tenant: {{ capacity: 60, refill_per_second: 0.001 }} }}
routes:
  - {{ name: api, path: "/v1/**", respond: {{ status: 200 }}, limits: [per-ip, per-tenant, daily], cost: 2 }}
"#,
        redis.store(500),
        digest("key-c1")
    );
    let gws = gateways(2, &policy);
    let key = [("authorization", "Bearer key-c1")];
    for _ in 0..5 {
        assert_eq!(get(gws[0].addr, "/v1/x", &key).status, 200);
    }
    let explain =
        |gw: &Gateway, query: &str| get(gw.admin, &format!("/admin/explain?{query}"), &[]);
    let query = "path=/v1/reports&credential=c1&ip=198.51.100.7";
    let first = explain(&gws[1], query);
    assert_eq!(first.status, 200, "{}", first.body);
    let body = first.json();
    assert_eq!(body["route"], "api");
    assert_eq!(body["plan"], "pro");
    let limits = body["limits"].as_array().unwrap();
    let by_name = |n: &str| limits.iter().find(|l| l["name"] == n).unwrap().clone();
    let tenant = by_name("per-tenant");
    assert_eq!(tenant["params"]["capacity"], 60, "the plan's numbers");
    assert_eq!(tenant["remaining"], 50, "60 less five requests of cost 2");
    assert_eq!(tenant["retry_after_ms"], 0);
    assert_eq!(tenant["store"], "shared");
    let daily = by_name("daily");
    assert_eq!(daily["algorithm"], "quota");
    assert_eq!(daily["remaining"], 990);
    let ip = by_name("per-ip");
    assert_eq!(ip["scope"], "pre_auth");
    assert_eq!(ip["store"], "local");
    assert_eq!(
        ip["remaining"], 100,
        "this instance saw none of that address"
    );
    // The same shared numbers on the other instance, and reading changed
    // nothing.
    for _ in 0..3 {
        let again = explain(&gws[0], query).json();
        let again = again["limits"].as_array().unwrap();
        assert_eq!(again[1]["remaining"], 50);
        assert_eq!(again[2]["remaining"], 990);
    }
    // A tenant alone: the credential-free limits read, the rest say why.
    let by_tenant = explain(&gws[0], "path=/v1/x&tenant=acme").json();
    assert_eq!(by_tenant["limits"][0]["state"], "needs ip");
    assert_eq!(by_tenant["limits"][1]["remaining"], 50);
    assert_eq!(explain(&gws[0], "path=/elsewhere").status, 404);
    let bad = explain(&gws[0], "path=/v1/x&credential=nobody");
    assert_eq!(
        (bad.status, bad.header("content-type")),
        (404, Some("application/problem+json"))
    );
    assert_eq!(explain(&gws[0], "path=/v1/x&ip=not-an-ip").status, 400);
    assert_eq!(
        get(gws[0].addr, "/v1/x", &key).status,
        200,
        "still 40 - 10 - 2 left"
    );
    let after = explain(&gws[1], query).json();
    assert_eq!(after["limits"][1]["remaining"], 48);
}

#[test]
fn reset_and_credit_change_what_every_instance_sees_next() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    let policy = format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  threads: 1
  admin_tokens: [{{ name: oncall, sha256: "{}", role: write }}, {{ name: viewer, sha256: "{}", role: read }}]
  audit_log: {{ path: "{}" }}
store: {}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 3, refill_per_second: 0.001 }}
  daily: {{ algorithm: quota, key: [tenant], limit: 5, period: day }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200 }}, limits: [per-tenant, daily] }}
"#,
        digest("oncall-token"),
        digest("viewer-token"),
        audit.display(),
        redis.store(500),
        digest("key-c1")
    );
    let gws = gateways(2, &policy);
    let key = [("authorization", "Bearer key-c1")];
    let admitted = |gw: &Gateway, n: usize| {
        (0..n)
            .filter(|_| get(gw.addr, "/x", &key).status == 200)
            .count()
    };
    assert_eq!(admitted(&gws[0], 5), 3, "the bucket of 3 is spent");
    let post = |gw: &Gateway, path: &str, token: &str, body: &str| {
        support::admin_call(gw, "POST", path, token, body)
    };
    let reset = r#"{"limit": "per-tenant", "tenant": "acme", "reason": "outage"}"#;
    assert_eq!(
        post(&gws[0], "/admin/reset", "viewer-token", reset).status,
        403
    );
    let r = post(&gws[0], "/admin/reset", "oncall-token", reset);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (
            r.json()["remaining_before"].as_u64(),
            r.json()["remaining"].as_u64()
        ),
        (Some(0), Some(3))
    );
    // The other instance sees the full bucket; the daily quota of 5 had 3
    // used, so two more pass.
    assert_eq!(admitted(&gws[1], 5), 2);
    // The quota spent: a credit of 2 gives two requests back.
    let credit = r#"{"limit": "daily", "credential": "c1", "units": 2, "reason": "our outage"}"#;
    let r = post(&gws[1], "/admin/credit", "oncall-token", credit);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["remaining"], 2);
    assert_eq!(
        post(&gws[1], "/admin/reset", "oncall-token", reset).status,
        200
    );
    assert_eq!(admitted(&gws[0], 5), 2, "two back on the quota");
    for (body, status) in [
        (r#"{"limit": "nope", "units": 1}"#, 404),
        (r#"{"limit": "daily", "units": 1}"#, 400),
        (r#"{"limit": "daily", "tenant": "acme"}"#, 400),
        (
            r#"{"limit": "daily", "tenant": "acme", "units": 1, "extra": 1}"#,
            400,
        ),
        ("not json", 400),
    ] {
        let r = post(&gws[0], "/admin/credit", "oncall-token", body);
        assert_eq!(r.status, status, "{body}: {}", r.body);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
    }
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let actions: Vec<(&str, &str)> = lines
        .iter()
        .filter(|l| l["result"] != "refused" || l["actor"] == "viewer")
        .map(|l| (l["action"].as_str().unwrap(), l["result"].as_str().unwrap()))
        .collect();
    assert_eq!(
        &actions[..4],
        [
            ("reset", "refused"),
            ("reset", "ok"),
            ("credit", "ok"),
            ("reset", "ok")
        ],
        "{lines:?}"
    );
    let credited = lines.iter().find(|l| l["action"] == "credit").unwrap();
    assert_eq!(credited["reason"], "our outage");
    assert_eq!(credited["actor"], "oncall");
    assert_eq!(credited["before"]["remaining"], 0);
    assert_eq!(credited["after"]["remaining"], 2);
}

/// A policy with a write token (`oncall-token`) and admin records read
/// every 200 ms, on `store` (a `store:` value); `rest` follows it.
fn admin_policy(store: &str, rest: &str) -> String {
    format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  threads: 1
  admin_refresh_ms: 200
  admin_tokens: [{{ name: oncall, sha256: "{}", role: write }}]
store: {store}
{rest}"#,
        digest("oncall-token")
    )
}

#[test]
fn a_revoked_key_is_refused_on_every_instance_until_it_is_lifted() {
    let redis = RedisServer::start();
    let store = redis.store(500);
    let rest = format!(
        r#"auth:
  keys:
    - {{ id: leaked, tenant: acme, sha256: "{}" }}
    - {{ id: other, tenant: acme, sha256: "{}" }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200 }} }}
"#,
        digest("key-leaked"),
        digest("key-other")
    );
    let policy = admin_policy(&store, &rest);
    let gws = gateways(2, &policy);
    let status = |gw: &Gateway, key: &str| {
        get(
            gw.addr,
            "/x",
            &[("authorization", &format!("Bearer {key}"))],
        )
        .status
    };
    assert_eq!(
        (status(&gws[0], "key-leaked"), status(&gws[1], "key-leaked")),
        (200, 200)
    );
    let revoke =
        r#"{"credential": "leaked", "expires_in_s": 3600, "reason": "posted in a public repo"}"#;
    let r = support::admin_call(
        &gws[0],
        "POST",
        "/admin/revocations",
        "oncall-token",
        revoke,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(
        status(&gws[0], "key-leaked"),
        401,
        "at once where it was made"
    );
    assert!(
        eventually(Duration::from_secs(10), || status(&gws[1], "key-leaked")
            == 401),
        "within admin_refresh_ms on the other instance"
    );
    assert_eq!(status(&gws[1], "key-other"), 200, "only that credential");
    let listed = get(
        gws[1].admin,
        "/admin/revocations",
        &[("authorization", "Bearer oncall-token")],
    )
    .json();
    assert_eq!(listed["revocations"][0]["credential"], "leaked");
    assert_eq!(
        listed["revocations"][0]["reason"],
        "posted in a public repo"
    );
    assert!(eventually(Duration::from_secs(5), || {
        gws[1].metric("tollgate_revocations_active") == 1.0
    }));
    // Nothing about the credential in the store's keys.
    assert!(
        redis.keys().iter().all(|k| !k.contains("leaked")),
        "{:?}",
        redis.keys()
    );

    for (body, code) in [
        (
            r#"{"credential": "leaked", "expires_in_s": 0, "reason": "x"}"#,
            400,
        ),
        (
            r#"{"credential": "leaked", "expires_in_s": 2592001, "reason": "x"}"#,
            400,
        ),
        (
            r#"{"credential": "leaked", "expires_in_s": 60, "reason": " "}"#,
            400,
        ),
        (
            r#"{"credential": "nobody", "expires_in_s": 60, "reason": "x"}"#,
            404,
        ),
    ] {
        assert_eq!(
            support::admin_call(&gws[0], "POST", "/admin/revocations", "oncall-token", body).status,
            code,
            "{body}"
        );
    }
    let lifted = support::admin_call(
        &gws[1],
        "DELETE",
        "/admin/revocations/leaked",
        "oncall-token",
        "",
    );
    assert_eq!(lifted.status, 200, "{}", lifted.body);
    assert!(eventually(Duration::from_secs(10), || status(
        &gws[0],
        "key-leaked"
    ) == 200));
    assert_eq!(status(&gws[1], "key-leaked"), 200);
    assert_eq!(
        support::admin_call(
            &gws[1],
            "DELETE",
            "/admin/revocations/leaked",
            "oncall-token",
            ""
        )
        .status,
        404
    );
}

#[test]
fn a_tenant_override_holds_on_every_instance_until_it_ends() {
    let redis = RedisServer::start();
    let store = redis.store(500);
    let rest = format!(
        r#"auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 3, refill_per_second: 0.001 }}
plans:
  pro: {{ per-tenant: {{ capacity: 10, refill_per_second: 0.001 }} }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200 }}, limits: [per-tenant] }}
"#,
        digest("key-c1")
    );
    let policy = admin_policy(&store, &rest);
    let gws = gateways(2, &policy);
    let capacity = |gw: &Gateway| {
        let e = get(
            gw.admin,
            "/admin/explain?path=/x&tenant=acme",
            &[("authorization", "Bearer oncall-token")],
        )
        .json();
        (
            e["limits"][0]["params"]["capacity"].as_u64().unwrap(),
            e["plan"].clone(),
        )
    };
    let put = |gw: &Gateway, body: &str| {
        support::admin_call(gw, "PUT", "/admin/overrides/acme", "oncall-token", body)
    };
    let boost = r#"{"limits": {"per-tenant": {"capacity": 6, "refill_per_second": 0.001}}, "expires_in_s": 3600, "reason": "incident 7"}"#;
    let r = put(&gws[0], boost);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(capacity(&gws[0]).0, 6, "at once where it was made");
    assert!(eventually(Duration::from_secs(10), || capacity(&gws[1]).0 == 6));
    let key = [("authorization", "Bearer key-c1")];
    let admitted = (0..10)
        .filter(|_| get(gws[1].addr, "/x", &key).status == 200)
        .count();
    assert_eq!(admitted, 6, "the boosted budget, on the other instance");
    let listed = get(
        gws[1].admin,
        "/admin/overrides",
        &[("authorization", "Bearer oncall-token")],
    )
    .json();
    assert_eq!(listed["overrides"][0]["tenant"], "acme");
    assert_eq!(listed["overrides"][0]["reason"], "incident 7");
    assert!(eventually(Duration::from_secs(5), || gws[1]
        .metric("tollgate_overrides_active")
        == 1.0));

    // Validated as the YAML would be.
    for body in [
        r#"{"limits": {"nope": {"capacity": 6, "refill_per_second": 1}}, "expires_in_s": 60, "reason": "x"}"#,
        r#"{"limits": {"per-tenant": {"limit": 6, "window_seconds": 1}}, "expires_in_s": 60, "reason": "x"}"#,
        r#"{"limits": {"per-tenant": {"capacity": -1, "refill_per_second": 1}}, "expires_in_s": 60, "reason": "x"}"#,
        r#"{"plan": "gold", "expires_in_s": 60, "reason": "x"}"#,
        r#"{"expires_in_s": 60, "reason": "x"}"#,
        r#"{"plan": "pro", "expires_in_s": 0, "reason": "x"}"#,
        r#"{"plan": "pro", "expires_in_s": 60, "reason": ""}"#,
    ] {
        let r = put(&gws[0], body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
    }

    // Lifted on one, gone on both.
    let lifted = support::admin_call(
        &gws[1],
        "DELETE",
        "/admin/overrides/acme",
        "oncall-token",
        "",
    );
    assert_eq!(lifted.status, 200, "{}", lifted.body);
    assert!(eventually(Duration::from_secs(10), || capacity(&gws[0]).0 == 3));

    // Another plan for a second, then the tenant's own again.
    let r = put(
        &gws[0],
        r#"{"plan": "pro", "expires_in_s": 1, "reason": "trial"}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(capacity(&gws[0]), (10, serde_json::json!("pro")));
    assert!(
        eventually(Duration::from_secs(10), || capacity(&gws[0]).0 == 3),
        "it ends at its expiry"
    );
    assert_eq!(
        support::admin_call(
            &gws[1],
            "DELETE",
            "/admin/overrides/acme",
            "oncall-token",
            ""
        )
        .status,
        404
    );
}

#[test]
fn resets_overrides_and_revocations_work_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let rest = format!(
        r#"auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 10, refill_per_second: 0.001 }}
  everyone: {{ key: [], capacity: 100, refill_per_second: 0.001 }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200 }}, limits: [per-tenant, everyone] }}
"#,
        digest("key-c1")
    );
    let policy = admin_policy(&cluster.store(1000), &rest);
    let gws = gateways(2, &policy);
    let key = [("authorization", "Bearer key-c1")];
    for _ in 0..4 {
        assert_eq!(gws[0].get("/x", &key).status, 200);
    }
    let explain = |gw: &Gateway| {
        get(
            gw.admin,
            "/admin/explain?path=/x&tenant=acme",
            &[("authorization", "Bearer oncall-token")],
        )
        .json()
    };
    let e = explain(&gws[1]);
    assert_eq!(
        (
            e["limits"][0]["remaining"].as_u64(),
            e["limits"][1]["remaining"].as_u64()
        ),
        (Some(6), Some(96))
    );
    // Both limits, in two slots: the tenant's reset, the global one credited.
    let reset = support::admin_call(
        &gws[0],
        "POST",
        "/admin/reset",
        "oncall-token",
        r#"{"limit": "per-tenant", "tenant": "acme"}"#,
    );
    assert_eq!(reset.status, 200, "{}", reset.body);
    let credit = support::admin_call(
        &gws[0],
        "POST",
        "/admin/credit",
        "oncall-token",
        r#"{"limit": "everyone", "units": 2}"#,
    );
    assert_eq!(credit.status, 200, "{}", credit.body);
    let e = explain(&gws[1]);
    assert_eq!(
        (
            e["limits"][0]["remaining"].as_u64(),
            e["limits"][1]["remaining"].as_u64()
        ),
        (Some(10), Some(98))
    );
    // Admin records live on one slot of the cluster too.
    let boost = r#"{"limits": {"per-tenant": {"capacity": 20, "refill_per_second": 0.001}}, "expires_in_s": 600, "reason": "x"}"#;
    assert_eq!(
        support::admin_call(
            &gws[0],
            "PUT",
            "/admin/overrides/acme",
            "oncall-token",
            boost
        )
        .status,
        200
    );
    assert!(eventually(Duration::from_secs(10), || explain(&gws[1])
        ["limits"][0]["params"]["capacity"]
        == 20));
    let revoke = r#"{"credential": "c1", "expires_in_s": 600, "reason": "x"}"#;
    assert_eq!(
        support::admin_call(
            &gws[1],
            "POST",
            "/admin/revocations",
            "oncall-token",
            revoke
        )
        .status,
        201
    );
    assert!(eventually(Duration::from_secs(10), || gws[0]
        .get("/x", &key)
        .status
        == 401));
}

#[test]
fn decisions_queued_behind_a_silent_store_follow_their_failure_mode_as_one_failed_call() {
    let redis = RedisServer::start();
    let gw = Gateway::start_with_env(&failure_policy(&redis), None, &[SECRET]);
    assert_eq!(keyed(&gw, "/closed").status, 200);
    redis.pause();
    // Twenty at once: one call goes out and hangs, the others queue
    // behind it. None is shed as overload, every one follows `open`.
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..20)
            .map(|_| s.spawn(|| keyed(&gw, "/open").status))
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert_eq!(
        gw.metric("tollgate_overload_shed_total{reason=\"store_wait\"}"),
        0.0
    );
    // The breaker (three failures) counted the calls that failed, not the
    // decisions they carried.
    assert_eq!(gw.metric("tollgate_store_circuit_open"), 0.0);
    redis.resume();
}
