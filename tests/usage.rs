//! The usage ledger through the real binary, with a real Redis and a real
//! HTTP receiver of CloudEvents batches: every admitted request of a
//! recording route recorded once at each sink with its settled cost, none
//! lost to a failing sink, a killed gateway or a Redis restarted empty; a
//! full spool refusing or dropping; SIGTERM's drain shipping what is left.

mod support;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use support::redis_server::{RedisCluster, RedisServer};
use support::{digest, eventually, Gateway, Upstream};

/// An HTTP endpoint taking CloudEvents batches: it keeps the ids of the
/// events it accepted (every time, duplicates included), answers 500 while
/// `failing`, and waits `delay_ms` before each answer.
struct Receiver {
    addr: SocketAddr,
    ids: Arc<Mutex<Vec<String>>>,
    failing: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
}

impl Receiver {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let ids = Arc::new(Mutex::new(Vec::new()));
        let failing = Arc::new(AtomicBool::new(false));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (i, f, d) = (ids.clone(), failing.clone(), delay_ms.clone());
        thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (i, f, d) = (i.clone(), f.clone(), d.clone());
                thread::spawn(move || receive(conn, &i, &f, &d));
            }
        });
        Self {
            addr,
            ids,
            failing,
            delay_ms,
        }
    }

    fn ids(&self) -> Vec<String> {
        self.ids.lock().unwrap().clone()
    }
}

fn receive(conn: TcpStream, ids: &Mutex<Vec<String>>, failing: &AtomicBool, delay: &AtomicU64) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    loop {
        let mut length = 0;
        let mut kind = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            if let Some(v) = lower.strip_prefix("content-type:") {
                kind = v.trim().to_owned();
            }
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        thread::sleep(Duration::from_millis(delay.load(Ordering::SeqCst)));
        let status = if failing.load(Ordering::SeqCst) {
            "500 Internal Server Error"
        } else {
            assert_eq!(kind, "application/cloudevents-batch+json");
            let events: Vec<serde_json::Value> = serde_json::from_slice(&body).unwrap();
            let mut seen = ids.lock().unwrap();
            for e in events {
                assert_eq!(e["specversion"], "1.0");
                assert_eq!(e["type"], "tollgate.request");
                assert_eq!(e["id"], e["data"]["id"]);
                seen.push(e["id"].as_str().unwrap().to_owned());
            }
            "200 OK"
        };
        let reply = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
        if conn.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// A policy recording `api` and `metered` (not `free`), its spool in
/// `spool`, shipping to `sinks`.
fn policy(spool: &std::path::Path, sinks: &str, extra: &str) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {{ backend: memory }}
auth:
  keys:
    - {{ id: c1, tenant: acme, sha256: "{c1}" }}
limits:
  per-credential: {{ key: [credential], capacity: 20, refill_per_second: 0.001 }}
  tokens: {{ key: [tenant], capacity: 100000, refill_per_second: 1 }}
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: api, path: "/v1/**", upstream: api, limits: [per-credential] }}
  - name: metered
    path: "/metered/**"
    upstream: api
    limits: [tokens]
    cost_from_response: {{ header: x-usage-tokens, max: 50 }}
  - {{ name: free, path: "/free/**", upstream: api, auth: none }}
usage:
  routes: [api, metered]
  spool: {{ path: "{spool}", fsync_ms: 10{extra} }}
  sinks: [{sinks}]
"#,
        c1 = digest("key-c1"),
        spool = spool.display(),
    )
}

fn sinks(redis: Option<&RedisServer>, receiver: &Receiver, batch: u32) -> String {
    let http = format!(
        "{{ http: {{ url: \"http://{}/events\", batch: {batch}, timeout_ms: 2000 }} }}",
        receiver.addr
    );
    match redis {
        Some(r) => format!(
            "{{ redis_stream: {{ key: \"tollgate:usage\", urls: [\"{}\"] }} }}, {http}",
            r.url()
        ),
        None => http,
    }
}

const C1: (&str, &str) = ("authorization", "Bearer key-c1");

/// The records in the stream, in order.
fn stream(redis: &RedisServer) -> Vec<serde_json::Value> {
    let entries: Vec<(String, Vec<(String, String)>)> = redis
        .cmd(&["XRANGE", "tollgate:usage", "-", "+"])
        .unwrap_or_default();
    entries
        .iter()
        .map(|(_, fields)| {
            assert_eq!(fields.len(), 1, "one field per entry");
            assert_eq!(fields[0].0, "record");
            serde_json::from_str(&fields[0].1).unwrap()
        })
        .collect()
}

fn ids_of(records: &[serde_json::Value]) -> Vec<String> {
    records
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect()
}

fn distinct(ids: &[String]) -> HashSet<String> {
    ids.iter().cloned().collect()
}

fn tollgate(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_admitted_request_is_recorded_once_at_each_sink_with_its_settled_cost() {
    let redis = RedisServer::start();
    let receiver = Receiver::start();
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let text = policy(
        &dir.path().join("spool"),
        &sinks(Some(&redis), &receiver, 7),
        "",
    );
    let gw = Gateway::start(&text, Some(&upstream));

    // 25 asked, 20 admitted: the 5 refused are not recorded.
    let admitted = (0..25)
        .filter(|_| gw.get("/v1/x", &[C1]).status == 200)
        .count();
    assert_eq!(admitted, 20);
    // Metered: settled at what each answer reports.
    let mut reported = 0;
    for n in 1..=10u64 {
        let usage = n.to_string();
        assert_eq!(
            gw.get("/metered/x", &[C1, ("x-reply-usage", &usage)])
                .status,
            200
        );
        reported += n;
    }
    // Not recorded.
    assert_eq!(gw.get("/free/x", &[]).status, 200);

    assert!(
        eventually(Duration::from_secs(10), || stream(&redis).len() >= 30
            && distinct(&receiver.ids()).len() >= 30),
        "{}",
        gw.log()
    );
    let records = stream(&redis);
    assert_eq!(records.len(), 30, "each record once in the stream");
    let ids = ids_of(&records);
    assert_eq!(distinct(&ids).len(), 30);
    assert_eq!(
        distinct(&receiver.ids()),
        distinct(&ids),
        "the same records at both sinks"
    );

    let of = |route: &'static str| records.iter().filter(move |r| r["route"] == route);
    assert_eq!(of("api").count(), 20);
    assert!(of("api")
        .all(|r| r["cost_admitted"] == 1 && r["cost_settled"] == 1 && r["cost_source"] == "route"));
    let settled: u64 = of("metered")
        .map(|r| r["cost_settled"].as_u64().unwrap())
        .sum();
    assert_eq!(
        settled, reported,
        "the settled costs are what the answers reported"
    );
    assert!(of("metered").all(|r| r["cost_source"] == "reported"));
    let first = &records[0];
    assert_eq!(first["tenant"], "acme");
    assert_eq!(first["credential"], "c1");
    assert_eq!(first["method"], "GET");
    assert_eq!(first["path"], "/v1/x");
    assert_eq!(first["status"], 200);
    assert_eq!(first["client"], "127.0.0.1/32");
    assert!(first["time"].as_str().unwrap().ends_with('Z'));
    assert_eq!(
        gw.metric("tollgate_usage_records_total{result=\"shipped\",sink=\"redis_stream\"}"),
        30.0
    );

    // The operators' view of the stream.
    let config = gw.config.to_str().unwrap();
    let tail = tollgate(&["usage", "tail", "--config", config, "-n", "3"]);
    let lines: Vec<serde_json::Value> = tail
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(ids_of(&lines), ids[27..], "the last three, oldest first");
    // Of a recent span, some fields only.
    let args = ["usage", "tail", "--config", config, "-n", "2"];
    let fields = tollgate(&[&args[..], &["--since", "1h", "--by", "tenant,route"]].concat());
    let lines: Vec<serde_json::Value> = fields
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{fields}");
    for line in &lines {
        assert_eq!(line.as_object().unwrap().len(), 2, "{line}");
        assert_eq!(line["tenant"], "acme");
        assert!(line["route"].is_string(), "{line}");
    }
    let summary = tollgate(&["usage", "summary", "--config", config, "--since", "1h"]);
    assert!(summary.starts_with("30 records since "), "{summary}");
    let row = |route: &str| -> Vec<String> {
        let line = summary
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(route))
            .unwrap_or_else(|| panic!("{summary}"));
        line.split_whitespace().map(str::to_owned).collect()
    };
    assert_eq!(
        row("metered"),
        ["acme", "metered", "10", "10", &reported.to_string()]
    );
    assert_eq!(row("api"), ["acme", "api", "20", "20", "20"]);

    // The ledger's records replay as an access log does.
    let all = tollgate(&["usage", "tail", "--config", config, "-n", "1000"]);
    let log = dir.path().join("records.jsonl");
    std::fs::write(&log, all).unwrap();
    let report = tollgate(&[
        "simulate",
        "--config",
        config,
        "--log",
        log.to_str().unwrap(),
    ]);
    assert!(
        report.contains("30 requests replayed, 0 lines skipped"),
        "{report}"
    );

    // The book's consumer group books each record once and trims the stream.
    let consume = || {
        let root = env!("CARGO_MANIFEST_DIR");
        let out = std::process::Command::new("python3")
            .arg(format!("{root}/docs/usage_consumer.py"))
            .env("PYTHONPATH", format!("{root}/target/pylib"))
            .env("REDIS_URL", redis.url())
            .output()
            .expect("python3 must be installed");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{} (make test installs redis-py in target/pylib)",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    assert_eq!(
        consume(),
        format!("acme\tapi\t20\nacme\tmetered\t{reported}\nbooked 30, trimmed 30, 0 left\n")
    );
    assert_eq!(consume(), "booked 0, trimmed 0, 0 left\n");
}

#[test]
fn a_failing_sink_a_killed_gateway_and_a_redis_restarted_empty_lose_nothing() {
    let mut redis = RedisServer::start();
    let receiver = Receiver::start();
    receiver.failing.store(true, Ordering::SeqCst);
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let text = policy(
        &dir.path().join("spool"),
        &sinks(Some(&redis), &receiver, 4),
        "",
    );
    let gw = Gateway::start(&text, Some(&upstream));
    for _ in 0..10 {
        assert_eq!(gw.get("/v1/x", &[C1]).status, 200);
    }
    assert!(eventually(Duration::from_secs(10), || stream(&redis).len() == 10));
    let before = ids_of(&stream(&redis));
    assert!(
        receiver.ids().is_empty(),
        "the receiver refused every batch"
    );

    // Killed at once, then started again on the same spool.
    gw.signal("-KILL");
    drop(gw);
    let gw = Gateway::start(&text, Some(&upstream));
    // Redis goes away, and comes back empty.
    redis.kill();
    for _ in 0..10 {
        assert_eq!(
            gw.get("/metered/x", &[C1, ("x-reply-usage", "3")]).status,
            200
        );
    }
    redis.restart();
    receiver.failing.store(false, Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(15), || stream(&redis).len() >= 10
            && distinct(&receiver.ids()).len() >= 20),
        "{}",
        gw.log()
    );
    let after = ids_of(&stream(&redis));
    assert_eq!(
        after.len(),
        10,
        "the records made while Redis was away, once each"
    );
    assert_eq!(distinct(&after).len(), 10);
    assert!(distinct(&after).is_disjoint(&distinct(&before)));
    let all: HashSet<String> = before.iter().chain(&after).cloned().collect();
    assert_eq!(
        distinct(&receiver.ids()),
        all,
        "every record reached the receiver"
    );
    assert!(gw.metric("tollgate_usage_records_total{result=\"failed\",sink=\"http\"}") > 0.0);
}

#[test]
fn a_full_spool_refuses_recording_routes_or_drops_the_oldest() {
    let receiver = Receiver::start();
    receiver.failing.store(true, Ordering::SeqCst);
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    // Records of ~2.5 KiB (a long path) fill the smallest spool, 64 KiB,
    // in a few dozen.
    let long = format!("/v1/{}", "p".repeat(2000));
    let path = |n: usize| format!("{long}{n}");
    let text = policy(
        &dir.path().join("refuse"),
        &sinks(None, &receiver, 50),
        ", max_bytes: 65536",
    )
    .replace("capacity: 20,", "capacity: 100000,");
    let gw = Gateway::start(&text, Some(&upstream));
    let refused = (0..1000)
        .map(|n| gw.get(&path(n), &[C1]))
        .find(|r| r.status != 200);
    let refused = refused.expect("the spool fills up");
    assert_eq!(refused.status, 503);
    assert_eq!(
        refused.json()["type"],
        "urn:tollgate:problem:usage-unavailable"
    );
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(
        gw.get("/free/x", &[]).status,
        200,
        "a route that records nothing is served"
    );
    assert!(
        gw.metric("tollgate_requests_total{outcome=\"usage_unavailable\",route=\"api\"}") >= 1.0
    );
    drop(gw);

    let text = text
        .replace(
            dir.path().join("refuse").to_str().unwrap(),
            dir.path().join("drop").to_str().unwrap(),
        )
        .replace("fsync_ms: 10,", "fsync_ms: 10, on_full: drop,");
    let gw = Gateway::start(&text, Some(&upstream));
    assert!((0..800).all(|n| gw.get(&path(n), &[C1]).status == 200));
    assert!(eventually(Duration::from_secs(5), || gw
        .metric("tollgate_usage_dropped_total")
        > 0.0));
    assert!(gw.metric("tollgate_usage_spool_bytes") <= 65536.0);
}

#[test]
fn sigterm_ships_what_the_spool_holds_before_exiting() {
    let receiver = Receiver::start();
    receiver.delay_ms.store(150, Ordering::SeqCst);
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let text = policy(&dir.path().join("spool"), &sinks(None, &receiver, 1), "");
    let mut gw = Gateway::start(&text, Some(&upstream));
    for _ in 0..8 {
        assert_eq!(gw.get("/v1/x", &[C1]).status, 200);
    }
    // One record a batch, 150 ms each: most are still in the spool.
    gw.signal("-TERM");
    assert!(gw.wait_exit(Duration::from_secs(20)).is_some());
    assert_eq!(distinct(&receiver.ids()).len(), 8, "{}", gw.log());
}

/// On a Redis Cluster store, the stream is on the store's cluster: the
/// script that appends a record and marks its id keeps both in the
/// stream's slot, and each record is in the stream once.
#[test]
fn on_a_cluster_the_stream_takes_each_record_once() {
    let cluster = RedisCluster::start(3);
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let text = policy(
        &dir.path().join("spool"),
        r#"{ redis_stream: { key: "tollgate:usage" } }"#,
        "",
    )
    .replace(
        "store: { backend: memory }",
        &format!("store: {}", cluster.store(500)),
    );
    let gw = Gateway::start_with_env(
        &text,
        Some(&upstream),
        &[("TOLLGATE_KEY_SECRET", "usage-cluster-secret")],
    );
    for _ in 0..12 {
        assert_eq!(gw.get("/v1/x", &[C1]).status, 200);
    }
    let holder = || {
        cluster
            .nodes
            .iter()
            .find(|n| n.cmd::<u64>(&["EXISTS", "tollgate:usage"]).unwrap_or(0) == 1)
    };
    assert!(
        eventually(Duration::from_secs(10), || holder()
            .is_some_and(|n| stream(n).len() >= 12)),
        "{}",
        gw.log()
    );
    let records = stream(holder().unwrap());
    assert_eq!(records.len(), 12);
    assert_eq!(distinct(&ids_of(&records)).len(), 12);
    let config = gw.config.to_str().unwrap();
    let summary = tollgate(&["usage", "summary", "--config", config, "--by", "route"]);
    assert!(summary.starts_with("12 records since "), "{summary}");
}
