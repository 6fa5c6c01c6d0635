//! `algorithm: concurrency` through the binary: a tenant's in-flight bound
//! shared by two gateways on one Redis (and on a cluster), holds released
//! on every way a request ends, and a killed gateway's holds reclaimed.

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use support::redis_server::{RedisCluster, RedisServer};
use support::{digest, eventually, get, Gateway, Reply, Upstream};

const SECRET: (&str, &str) = ("TOLLGATE_KEY_SECRET", "concurrency-secret-5b1e");
const HOLDS: &str = "tollgate_concurrency_holds{limit=\"inflight\"}";
const RECLAIMED: &str = "tollgate_concurrency_reclaimed_total{limit=\"inflight\"}";

/// Tenant a may have `max` requests in flight across the fleet; a hold
/// not renewed within `ttl_ms` is reclaimed. `extra` goes into `server`.
fn policy(store: &str, max: u64, ttl_ms: u64, extra: &str) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 2{extra} }}
store: {store}
auth:
  keys:
    - {{ id: a-1, tenant: tenant-a, sha256: "{}" }}
    - {{ id: b-1, tenant: tenant-b, sha256: "{}" }}
limits:
  rate: {{ key: [tenant], capacity: 1000, refill_per_second: 1000 }}
  inflight: {{ key: [tenant], algorithm: concurrency, max_in_flight: {max}, hold_ttl_ms: {ttl_ms} }}
upstreams:
  api: {{ servers: ["{{upstream}}"], read_timeout_ms: 60000 }}
routes:
  - {{ name: api, path: "/**", upstream: api, limits: [rate, inflight] }}
responses: {{ ratelimit_headers: draft }}
"#,
        digest("key-a"),
        digest("key-b")
    )
}

/// Holds kept in Redis, over every key of the `inflight` limit.
fn held_in(redis: &RedisServer) -> usize {
    redis
        .keys()
        .iter()
        .filter(|k| k.contains("inflight"))
        .map(|k| redis.cmd::<usize>(&["ZCARD", k]).unwrap_or(0))
        .sum()
}

const A: [(&str, &str); 1] = [("authorization", "Bearer key-a")];
const B: [(&str, &str); 1] = [("authorization", "Bearer key-b")];

/// Sends one request per gateway address in `to`, all at once, each on a
/// thread of its own; the replies, in the order they finished.
fn at_once(to: &[std::net::SocketAddr], path: &'static str) -> Vec<Reply> {
    let replies = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = to
        .iter()
        .map(|&addr| {
            let replies = replies.clone();
            thread::spawn(move || {
                let reply = get(addr, path, &A);
                replies.lock().unwrap().push(reply);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    Arc::try_unwrap(replies).unwrap().into_inner().unwrap()
}

/// A request of tenant a that the upstream holds: sent, and left open.
fn hold_open(to: std::net::SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(to).unwrap();
    s.write_all(b"GET /slow HTTP/1.1\r\nhost: api\r\nauthorization: Bearer key-a\r\n\r\n")
        .unwrap();
    s
}

#[test]
fn a_tenants_bound_holds_across_two_gateways_and_frees_as_requests_end() {
    let redis = RedisServer::start();
    // Each slow request takes 1.5 s; holds live far longer than the test
    // unless released.
    let upstream = Upstream::slow(Duration::from_millis(1_500));
    let text = policy(&redis.store(2_000), 3, 60_000, "");
    let one = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    let two = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    let fleet = [one.addr, two.addr, one.addr, two.addr, one.addr, two.addr];
    let replies = at_once(&fleet, "/slow");
    let admitted = replies.iter().filter(|r| r.status == 200).count();
    let refused: Vec<&Reply> = replies.iter().filter(|r| r.status == 429).collect();
    assert_eq!(
        (admitted, refused.len()),
        (3, 3),
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    for r in &refused {
        assert_eq!(r.json()["violated-policies"][0], "inflight");
        assert_eq!(r.header("retry-after"), Some("1"));
        // The rate limit's numbers, never the concurrency limit's.
        let fields = r.header("ratelimit-policy").unwrap_or_default();
        assert!(!fields.contains("inflight"), "{fields}");
    }
    assert_eq!(upstream.max_in_flight(), 3, "only the admitted reached it");
    // Every request has ended and each hold was released: the whole
    // bound is free again, long before any hold would expire.
    assert!(eventually(Duration::from_secs(5), || held_in(&redis) == 0));
    assert_eq!(one.metric(HOLDS) + two.metric(HOLDS), 0.0);
    let again = at_once(&fleet[..3], "/fast");
    assert!(again.iter().all(|r| r.status == 200));
    assert!(eventually(Duration::from_secs(5), || held_in(&redis) == 0));
    // Another tenant's bound is its own.
    upstream
        .state
        .delay_ms
        .store(30_000, std::sync::atomic::Ordering::SeqCst);
    let holding: Vec<TcpStream> = (0..3).map(|_| hold_open(one.addr)).collect();
    assert!(eventually(Duration::from_secs(5), || one.metric(HOLDS) == 3.0));
    assert_eq!(two.get("/fast", &A).status, 429, "a's bound is full");
    assert_eq!(two.get("/fast", &B).status, 200, "b's is not");
    drop(holding);
    // Nothing ever expired unrenewed.
    assert_eq!(one.metric(RECLAIMED) + two.metric(RECLAIMED), 0.0);
}

#[test]
fn a_hold_whose_release_failed_while_redis_stalled_is_released_once_it_answers() {
    let redis = RedisServer::start();
    let upstream = Upstream::slow(Duration::from_millis(1_500));
    // Holds would live a minute unreleased.
    let text = policy(&redis.store(200), 2, 60_000, "");
    let gw = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    let addr = gw.addr;
    let slow: Vec<_> = (0..2)
        .map(|_| thread::spawn(move || get(addr, "/slow", &A).status))
        .collect();
    assert!(eventually(Duration::from_secs(5), || held_in(&redis) == 2));
    // The requests end while Redis is stopped: their releases fail.
    redis.pause();
    for t in slow {
        assert_eq!(t.join().unwrap(), 200);
    }
    thread::sleep(Duration::from_millis(500));
    redis.resume();
    // Tried again once Redis answers: the bound is free long before the
    // holds would have expired.
    assert!(
        eventually(Duration::from_secs(15), || held_in(&redis) == 0),
        "{}",
        gw.log()
    );
    assert_eq!(gw.get("/fast", &A).status, 200);
}

#[test]
fn a_client_that_goes_away_frees_its_hold_at_once() {
    let redis = RedisServer::start();
    let upstream = Upstream::slow(Duration::from_secs(30));
    let text = policy(&redis.store(2_000), 1, 60_000, "");
    let gw = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    let client = hold_open(gw.addr);
    assert!(eventually(Duration::from_secs(5), || upstream.hits() == 1));
    assert_eq!(gw.metric(HOLDS), 1.0);
    assert_eq!(gw.get("/fast", &A).status, 429, "the one hold is taken");
    // The client hangs up while the upstream still works on its request.
    drop(client);
    assert!(eventually(Duration::from_secs(5), || held_in(&redis) == 0));
    assert_eq!(gw.metric(HOLDS), 0.0);
    assert_eq!(gw.get("/fast", &A).status, 200, "released, not expired");
}

#[test]
fn every_way_a_request_ends_releases_its_hold() {
    let redis = RedisServer::start();
    let upstream = Upstream::slow(Duration::from_millis(1_000));
    // No server listens on `down`; `tiny` has one permit and no queue.
    let text = policy(&redis.store(2_000), 1, 60_000, ", shutdown_grace_seconds: 1")
        .replace(
            "upstreams:\n",
            "upstreams:\n  down: { servers: [\"127.0.0.1:9\"], connect_timeout_ms: 200, retries: 0 }\n  tiny: { servers: [\"{upstream}\"], max_in_flight: 1, queue: { max_waiting: 0 } }\n",
        )
        .replace(
            "routes:\n",
            "routes:\n  - { name: down, path: \"/down/**\", upstream: down, limits: [rate, inflight] }\n  - { name: timeout, path: \"/slow-timeout/**\", upstream: api, timeout_ms: 200, limits: [rate, inflight] }\n  - { name: tiny, path: \"/slow-tiny/**\", upstream: tiny, limits: [rate, inflight] }\n  - { name: fixed, path: \"/fixed\", respond: { status: 200, body: ok }, limits: [rate, inflight] }\n",
        );
    let mut gw = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    // With one hold in all, each request is admitted only if the one
    // before released its hold when it ended.
    let ends = [
        ("/fast", 200, "response done"),
        ("/fixed", 200, "a fixed response"),
        ("/down/x", 502, "the upstream refused the connection"),
        ("/fail/x", 502, "the upstream closed without an answer"),
        ("/slow-timeout/x", 504, "the upstream timed out"),
    ];
    for (path, status, how) in ends {
        assert_eq!(gw.get(path, &A).status, status, "{how}");
        assert!(
            eventually(Duration::from_secs(5), || held_in(&redis) == 0),
            "{how}: the hold is still kept"
        );
        assert_eq!(gw.metric(HOLDS), 0.0, "{how}");
    }
    // Refused by the pool after the decision took the hold: tenant b
    // keeps `tiny`'s one permit, so a's request there gets 503.
    upstream
        .state
        .delay_ms
        .store(30_000, std::sync::atomic::Ordering::SeqCst);
    let busy = hold_open_on(gw.addr, "/slow-tiny/x", &B);
    assert!(eventually(Duration::from_secs(5), || gw.metric(HOLDS) == 1.0));
    assert_eq!(gw.get("/slow-tiny/y", &A).status, 503, "the pool is full");
    assert!(
        eventually(Duration::from_secs(5), || held_in(&redis) == 1),
        "only b's hold is kept"
    );
    assert_eq!(gw.metric(HOLDS), 1.0);
    assert_eq!(gw.get("/fast", &A).status, 200, "a's hold was released");
    drop(busy);
    assert!(eventually(Duration::from_secs(5), || held_in(&redis) == 0));
    // Shutdown: a request still running when the process stops gives its
    // hold back with it.
    let _running = hold_open(gw.addr);
    assert!(eventually(Duration::from_secs(5), || gw.metric(HOLDS) == 1.0));
    gw.signal("-TERM");
    assert!(gw.wait_exit(Duration::from_secs(10)).is_some());
    let left: Vec<String> = redis
        .keys()
        .into_iter()
        .filter(|k| k.contains("inflight"))
        .collect();
    let members: Vec<Vec<u8>> = left
        .iter()
        .flat_map(|k| {
            redis
                .cmd::<Vec<Vec<u8>>>(&["ZRANGE", k, "0", "-1"])
                .unwrap()
        })
        .collect();
    assert!(
        left.is_empty(),
        "holds left in Redis: {left:?} {members:?} {}",
        gw.log()
    );
}

/// A request on a connection left open, as `hold_open` with any path and
/// caller.
fn hold_open_on(to: std::net::SocketAddr, path: &str, who: &[(&str, &str)]) -> TcpStream {
    let mut s = TcpStream::connect(to).unwrap();
    let mut head = format!("GET {path} HTTP/1.1\r\nhost: api\r\n");
    for (k, v) in who {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s
}

#[test]
fn a_killed_gateways_holds_are_reclaimed_within_their_lifetime() {
    let redis = RedisServer::start();
    let upstream = Upstream::slow(Duration::from_secs(30));
    let text = policy(&redis.store(2_000), 2, 1_500, "");
    let doomed = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    let survivor = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    let _held: Vec<TcpStream> = (0..2).map(|_| hold_open(doomed.addr)).collect();
    assert!(eventually(Duration::from_secs(5), || upstream.hits() == 2));
    // Renewed while their gateway lives: still held for more than twice
    // their lifetime.
    let freed = eventually(Duration::from_secs(4), || {
        survivor.get("/fast", &A).status != 429
    });
    assert!(!freed, "the holds expired while their gateway renewed them");
    // SIGKILL: nothing is released, nothing renewed; the survivor's
    // decisions find both holds expired and drop them.
    drop(doomed);
    assert!(eventually(Duration::from_secs(10), || {
        let _ = survivor.get("/fast", &A);
        survivor.metric(RECLAIMED) == 2.0
    }));
    assert_eq!(survivor.get("/fast", &A).status, 200);
}

#[test]
fn holds_are_shared_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let upstream = Upstream::slow(Duration::from_millis(1_500));
    let text = policy(&cluster.store(2_000), 2, 60_000, "");
    let one = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    let two = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    let replies = at_once(&[one.addr, two.addr, one.addr, two.addr], "/slow");
    let admitted = replies.iter().filter(|r| r.status == 200).count();
    assert_eq!(
        admitted,
        2,
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert!(eventually(Duration::from_secs(5), || one.metric(HOLDS)
        == 0.0
        && two.metric(HOLDS) == 0.0));
    assert_eq!(one.get("/fast", &A).status, 200);
}

#[test]
fn a_concurrency_refusal_is_logged_like_any_other() {
    let redis = RedisServer::start();
    let upstream = Upstream::slow(Duration::from_secs(30));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let extra = format!(", access_log: {{ path: \"{}\" }}", log.display());
    let text = policy(&redis.store(2_000), 1, 60_000, &extra);
    let gw = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    let _busy = hold_open(gw.addr);
    assert!(eventually(Duration::from_secs(5), || upstream.hits() == 1));
    assert_eq!(gw.get("/fast", &A).status, 429);
    assert!(eventually(Duration::from_secs(5), || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .any(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap_or_default();
                v["status"] == 429 && v["violated"][0] == "inflight"
            })
    }));
}

#[test]
fn the_memory_store_bounds_one_gateways_requests_in_flight() {
    let upstream = Upstream::slow(Duration::from_secs(30));
    let text = policy("{ backend: memory }", 1, 60_000, "");
    let gw = Gateway::start(&text, Some(&upstream));
    let busy = hold_open(gw.addr);
    assert!(eventually(Duration::from_secs(5), || upstream.hits() == 1));
    assert_eq!(gw.get("/fast", &A).status, 429);
    assert_eq!(gw.get("/fast", &B).status, 200, "another tenant's bound");
    drop(busy);
    assert!(eventually(Duration::from_secs(5), || gw
        .get("/fast", &A)
        .status
        == 200));
}

#[test]
fn a_caller_that_waits_for_each_answer_is_never_refused_at_its_bound() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let text = policy(&redis.store(2_000), 1, 60_000, "")
        .replace("routes:\n", "routes:\n  - { name: fixed, path: \"/fixed\", respond: { status: 200, body: ok }, limits: [rate, inflight] }\n");
    let gw = Gateway::start_with_env(&text, Some(&upstream), &[SECRET]);
    // One request at a time, each sent as soon as the last one's answer
    // arrived: the hold of the last is always released before the next
    // is decided.
    for i in 0..200 {
        let path = if i % 2 == 0 { "/fast" } else { "/fixed" };
        assert_eq!(gw.get(path, &A).status, 200, "request {i}");
    }
}
