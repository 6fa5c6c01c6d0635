//! The gateway flooded on both cores by a real load generator (`h2load`)
//! while Redis answers: limits keep limiting. The flooding tenant is
//! admitted at most its capacity, a tenant whose bucket is empty is
//! admitted never, no decision falls to `on_store_error`, and what the
//! gateway cannot decide in time is shed with 503 `overloaded`. Then the
//! same flood with Redis paused: the failure modes decide, and the limits
//! come back when Redis does.
//!
//! Everything asserted is an outcome (statuses, counts, metric totals);
//! how long anything took is never asserted. The floods of this file run
//! one at a time, each saturating the machine on its own.

mod support;

use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use support::redis_server::RedisServer;
use support::{digest, eventually, free_port, get, make_certs, Gateway, Reply};

const SECRET: (&str, &str) = ("TOLLGATE_KEY_SECRET", "flood-secret-5c1e");
const FLOODER: &str = "flood-key-1";
const QUIET: &str = "quiet-key-2";
/// The `small` limit's capacity: its refill (0.01/s) adds no whole request
/// while a test runs.
const SMALL: u64 = 10;

/// One flood at a time: each is meant to saturate both cores by itself.
static FLOODS: Mutex<()> = Mutex::new(());

/// How the load generator speaks to the gateway.
#[derive(Clone, Copy, PartialEq)]
enum Wire {
    Http1,
    H2c,
    TlsH2,
}

fn policy(redis: &RedisServer, tls: Option<(u16, &std::path::Path, &std::path::Path)>) -> String {
    let tls = tls.map_or(String::new(), |(port, cert, key)| {
        format!(
            r#", tls: {{ listen: ["127.0.0.1:{port}"], cert_file: "{}", key_file: "{}" }}"#,
            cert.display(),
            key.display()
        )
    });
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 2, http2: true{tls} }}
store: {{ backend: redis, urls: ["{}"], timeout_ms: 100, circuit_breaker: {{ failure_threshold: 5, open_ms: 500 }} }}
auth:
  keys:
    - {{ id: flooder, tenant: flood, sha256: "{}" }}
    - {{ id: quiet, tenant: quiet, sha256: "{}" }}
limits:
  small: {{ key: [tenant], capacity: {SMALL}, refill_per_second: 0.01, on_store_error: open }}
  big: {{ key: [tenant], capacity: 1000000000, refill_per_second: 1000000000, on_store_error: open }}
routes:
  - {{ name: small, path: /small, respond: {{ status: 200, body: "ok" }}, limits: [small] }}
  - {{ name: big, path: /big, respond: {{ status: 200, body: "ok" }}, limits: [big] }}
"#,
        redis.url(),
        digest(FLOODER),
        digest(QUIET),
    )
}

/// `h2load` flooding `url` as the flooding tenant for `seconds`, with
/// `clients` connections of `streams` concurrent requests each (over
/// HTTP/1.1, a connection carries one request at a time: a quarter as many
/// requests at once, each on its own connection).
fn h2load(wire: Wire, url: &str, seconds: u32, clients: u32, streams: u32) -> Child {
    let mut cmd = load(wire, FLOODER);
    cmd.args(["-D", &seconds.to_string()]);
    if wire == Wire::Http1 {
        // As many requests at once, a quarter of them as connections.
        cmd.args(["-c", &(clients * streams / 4).to_string()]);
    } else {
        cmd.args(["-c", &clients.to_string()])
            .args(["-m", &streams.to_string()]);
    }
    cmd.arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("h2load must be installed (make test installs nghttp2-client)")
}

/// `h2load` as the tenant of `key`, over `wire`.
fn load(wire: Wire, key: &str) -> Command {
    let mut cmd = Command::new("h2load");
    cmd.args(["-H", &format!("authorization: Bearer {key}")]);
    if wire == Wire::Http1 {
        cmd.arg("--h1");
    }
    cmd
}

/// `n` requests to `url` one after the other as the tenant of `key`,
/// over `wire`; their status classes.
fn requests(wire: Wire, url: &str, key: &str, n: u64) -> (u64, u64, u64) {
    let child = load(wire, key)
        .args(["-n", &n.to_string(), "-c", "1"])
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("h2load must be installed (make test installs nghttp2-client)");
    statuses(child)
}

/// The status classes `h2load` reports: (2xx, 4xx, 5xx).
fn statuses(child: Child) -> (u64, u64, u64) {
    let out = child.wait_with_output().expect("h2load output");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("status codes:"))
        .unwrap_or_else(|| panic!("no status line in h2load's output:\n{text}"));
    let count = |class: &str| -> u64 {
        line.split(',')
            .find(|part| part.trim().ends_with(class))
            .and_then(|part| part.split_whitespace().rev().nth(1)?.parse().ok())
            .unwrap_or_else(|| panic!("no {class} count in {line:?}"))
    };
    (count("2xx"), count("4xx"), count("5xx"))
}

fn quiet(gw: &Gateway) -> Reply {
    get(
        gw.addr,
        "/small",
        &[("authorization", &format!("Bearer {QUIET}"))],
    )
}

/// The sum of every series of `family` whose labels contain `labels`.
fn total(gw: &Gateway, family: &str, labels: &str) -> f64 {
    gw.metrics()
        .lines()
        .filter(|l| l.starts_with(family) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// What the quiet tenant's requests got while a flood ran.
#[derive(Debug, Default)]
struct Seen {
    admitted: usize,
    limited: usize,
    shed: usize,
    other: Vec<(u16, String)>,
}

/// Floods the gateway over `wire` on both routes at once while the quiet
/// tenant, whose bucket is already empty, keeps asking; returns what the
/// quiet tenant saw and the flood's status classes on `/small`.
fn flood(gw: &Gateway, wire: Wire, base: &str) -> (Seen, (u64, u64, u64)) {
    let big = h2load(wire, &format!("{base}/big"), 6, 40, 20);
    let small = h2load(wire, &format!("{base}/small"), 6, 20, 10);
    // The quiet tenant asks while the flood is on (its requests are
    // answered slowly then, so a few dozen span it).
    assert!(
        eventually(Duration::from_secs(10), || total(
            gw,
            "tollgate_requests_total",
            "route=\"big\""
        ) > 100.0),
        "the flood never reached the gateway"
    );
    let mut seen = Seen::default();
    let askers: Vec<_> = (0..4)
        .map(|_| {
            let addr = gw.addr;
            thread::spawn(move || {
                (0..10)
                    .map(|_| {
                        get(
                            addr,
                            "/small",
                            &[("authorization", &format!("Bearer {QUIET}"))],
                        )
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for reply in askers.into_iter().flat_map(|h| h.join().unwrap()) {
        let kind = serde_json::from_str::<serde_json::Value>(&reply.body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        match (reply.status, kind.as_str()) {
            (200, _) => seen.admitted += 1,
            (429, _) => seen.limited += 1,
            (503, "urn:tollgate:problem:overloaded") => seen.shed += 1,
            (status, _) => seen.other.push((status, reply.body.clone())),
        }
    }
    let _ = statuses(big);
    (seen, statuses(small))
}

/// A Redis for a flood test. In production Redis has CPUs of its own; here
/// it shares two cores with the load generator, which would keep it from
/// running for longer than `timeout_ms` at times, and that is a store that
/// answers nothing, rightly taken for a failing one. So it gets the
/// scheduler's favour where the tests may give it (as root), and the
/// tests see the gateway's saturation, not the test bed's. The policy's
/// `timeout_ms` is 100, not the default 20: in one run of the whole suite
/// on two shared cores, 70 store calls of the h2c flood outlasted 20 ms
/// and their limits failed open. Which side was starved (Redis, or the
/// debug gateway reading its replies) is not settled; at 100 ms the test
/// still floods the gateway past its CPU and checks that no limit fails
/// open, but no longer measures this test bed's scheduling.
fn redis() -> RedisServer {
    let redis = RedisServer::start();
    let _ = Command::new("renice")
        .args(["-n", "-10", "-p", &redis.pid().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    redis
}

fn limits_hold_under_a_flood(wire: Wire) {
    let _one = FLOODS.lock().unwrap_or_else(|e| e.into_inner());
    let redis = redis();
    let dir = tempfile::tempdir().unwrap();
    let tls_port = free_port();
    let gw = if wire == Wire::TlsH2 {
        let (_, cert, key) = make_certs(dir.path(), "flood");
        Gateway::start_with_env(
            &policy(&redis, Some((tls_port, &cert, &key))),
            None,
            &[SECRET],
        )
    } else {
        Gateway::start_with_env(&policy(&redis, None), None, &[SECRET])
    };
    let base = match wire {
        Wire::TlsH2 => format!("https://127.0.0.1:{tls_port}"),
        Wire::Http1 | Wire::H2c => format!("http://{}", gw.addr),
    };

    // The quiet tenant spends its whole bucket before the flood, over the
    // flood's listener: the first store calls come from there.
    let url = format!("{base}/small");
    assert_eq!(requests(wire, &url, QUIET, SMALL), (SMALL, 0, 0));
    assert_eq!(requests(wire, &url, QUIET, 1), (0, 1, 0));

    let (seen, (admitted, limited, shed)) = flood(&gw, wire, &base);
    let fail_open = total(&gw, "tollgate_limit_decisions_total", "fail_open");
    let summary = format!(
        "quiet tenant {seen:?}; flood on /small: {admitted} 2xx, {limited} 4xx, {shed} 5xx; \
         fail_open {fail_open}; shed {}; store errors: {}",
        total(&gw, "tollgate_overload_shed_total", ""),
        gw.metrics()
            .lines()
            .filter(|l| l.starts_with("tollgate_store_errors_total"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    eprintln!("{summary}");
    assert_eq!(fail_open, 0.0, "no limit was switched off: {summary}");
    assert_eq!(seen.admitted, 0, "an empty bucket admits nobody: {summary}");
    assert!(
        seen.other.is_empty(),
        "only 429 or 503 overloaded: {summary}"
    );
    assert!(
        admitted <= SMALL,
        "the flooding tenant got at most its capacity: {summary}"
    );
    assert!(limited > 0, "the flood was limited: {summary}");
    assert_eq!(
        total(
            &gw,
            "tollgate_requests_total",
            "outcome=\"store_unavailable\""
        ),
        0.0,
        "{summary}"
    );
    // Every 503 the flood got is a shed decision, counted as such.
    let shed_requests = total(&gw, "tollgate_requests_total", "outcome=\"overloaded\"");
    assert!(
        shed_requests <= total(&gw, "tollgate_overload_shed_total", ""),
        "{summary}"
    );
    // The store never failed: not one call counted against the breaker.
    assert_eq!(
        total(&gw, "tollgate_store_circuit_open", ""),
        0.0,
        "{summary}"
    );
}

#[test]
fn limits_hold_under_an_http1_flood() {
    limits_hold_under_a_flood(Wire::Http1);
}

#[test]
fn limits_hold_under_an_h2c_flood() {
    limits_hold_under_a_flood(Wire::H2c);
}

#[test]
fn limits_hold_under_a_tls_h2_flood() {
    limits_hold_under_a_flood(Wire::TlsH2);
}

/// With Redis paused, the same flood is decided by `on_store_error` (open
/// here: the quiet tenant is admitted), the breaker opens; once Redis
/// resumes, the breaker closes and the empty bucket refuses again.
#[test]
fn a_paused_store_under_a_flood_falls_to_the_failure_modes_and_comes_back() {
    let _one = FLOODS.lock().unwrap_or_else(|e| e.into_inner());
    let redis = redis();
    let gw = Gateway::start_with_env(&policy(&redis, None), None, &[SECRET]);
    for _ in 0..SMALL {
        assert_eq!(quiet(&gw).status, 200);
    }
    assert_eq!(quiet(&gw).status, 429);
    let base = format!("http://{}", gw.addr);

    redis.pause();
    let big = h2load(Wire::H2c, &format!("{base}/big"), 4, 20, 10);
    assert!(
        eventually(Duration::from_secs(20), || gw
            .metric("tollgate_store_circuit_open")
            == 1.0),
        "the breaker opens while Redis answers nothing"
    );
    assert!(
        eventually(Duration::from_secs(20), || quiet(&gw).status == 200),
        "on_store_error: open admits while the store fails"
    );
    assert!(total(&gw, "tollgate_limit_decisions_total", "fail_open") > 0.0);
    let _ = statuses(big);

    redis.resume();
    assert!(
        eventually(Duration::from_secs(20), || quiet(&gw).status == 429),
        "the bucket, still empty in Redis, refuses again once Redis is back"
    );
    assert_eq!(gw.metric("tollgate_store_circuit_open"), 0.0);
}

/// Holds of concurrency limits in Redis, over every key of `limit`.
fn holds_in(redis: &RedisServer, limit: &str) -> usize {
    redis
        .keys()
        .iter()
        .filter(|k| k.contains(limit))
        .map(|k| redis.cmd::<usize>(&["ZCARD", k]).unwrap_or(0))
        .sum()
}

#[test]
fn a_concurrency_bound_holds_under_a_flood_and_every_hold_comes_back() {
    let _one = FLOODS.lock().unwrap_or_else(|e| e.into_inner());
    let redis = redis();
    // Each forwarded request holds the upstream for 100 ms: the flood keeps
    // far more than the bound waiting.
    let upstream = support::Upstream::slow(Duration::from_millis(100));
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 2, http2: true }}
store: {{ backend: redis, urls: ["{}"], timeout_ms: 100 }}
auth:
  keys:
    - {{ id: flooder, tenant: flood, sha256: "{}" }}
    - {{ id: quiet, tenant: quiet, sha256: "{}" }}
limits:
  inflight: {{ key: [tenant], algorithm: concurrency, max_in_flight: 8, hold_ttl_ms: 60000 }}
upstreams:
  api: {{ servers: ["{{upstream}}"], max_in_flight: 256, queue: {{ max_waiting: 256, timeout_ms: 1000 }} }}
routes:
  - {{ name: slow, path: "/slow", upstream: api, limits: [inflight] }}
"#,
        redis.url(),
        digest(FLOODER),
        digest(QUIET),
    );
    let gw = Gateway::start_with_env(&policy, Some(&upstream), &[SECRET]);
    let base = format!("http://{}", gw.addr);
    let flood = h2load(Wire::H2c, &format!("{base}/slow"), 6, 20, 20);
    assert!(
        eventually(Duration::from_secs(10), || upstream.hits() > 20),
        "the flood never reached the upstream"
    );
    // Another tenant's bound is its own while the flood is on: admitted,
    // or shed by a gateway too busy to decide, never refused by the bound.
    let quiet_statuses: Vec<u16> = (0..5)
        .map(|_| {
            get(
                gw.addr,
                "/slow",
                &[("authorization", &format!("Bearer {QUIET}"))],
            )
            .status
        })
        .collect();
    let (ok, limited, _) = statuses(flood);
    assert!(ok > 0 && limited > 0, "admitted {ok}, refused {limited}");
    assert!(
        quiet_statuses.iter().all(|s| *s == 200 || *s == 503),
        "{quiet_statuses:?}"
    );
    // The flooding tenant never had more than its bound at the upstream
    // (the quiet tenant's one request at a time aside).
    assert!(
        upstream.max_in_flight() <= 8 + 1,
        "{} at once",
        upstream.max_in_flight()
    );
    // Every hold comes back once the flood is over: released, or, for a
    // decision its client dropped mid-way, once its call could no longer
    // land; none is left to expire.
    assert!(
        eventually(Duration::from_secs(10), || holds_in(&redis, "inflight")
            == 0),
        "{} holds left",
        holds_in(&redis, "inflight")
    );
    assert_eq!(total(&gw, "tollgate_concurrency_holds", ""), 0.0);
    assert_eq!(total(&gw, "tollgate_concurrency_reclaimed_total", ""), 0.0);
    assert_eq!(
        total(
            &gw,
            "tollgate_limit_decisions_total",
            "outcome=\"fail_open\""
        ),
        0.0
    );
}
