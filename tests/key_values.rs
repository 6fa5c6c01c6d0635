//! Limits keyed by what the request says — a header, a path segment, a
//! query parameter, a JSON body's member — through the real binary, on the memory store and on
//! a real Redis: one budget per value, absent values skipped, a value
//! given twice or not listed refused with 400, and a refused request that
//! leaves no state behind.

mod support;

use support::redis_server::RedisServer;
use support::{digest, Gateway, Upstream};

const SECRET: (&str, &str) = ("TOLLGATE_KEY_SECRET", "key-values-secret");

fn policy(store: &str) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1, http2: true, admin_tokens: [{{ name: oncall, sha256: "{admin}", role: write }}] }}
store: {store}
auth:
  keys:
    - {{ id: c1, tenant: acme, sha256: "{c1}" }}
    - {{ id: c2, tenant: beta, sha256: "{c2}" }}
limits:
  per-credential: {{ key: [credential], capacity: 1000, refill_per_second: 0.001 }}
  tight-credential: {{ key: [credential], capacity: 2, refill_per_second: 0.001 }}
  per-end-user: {{ key: [credential, header.x-end-user], capacity: 2, refill_per_second: 0.001 }}
  per-project: {{ key: [tenant, path.project], capacity: 1, refill_per_second: 0.001 }}
  per-region: {{ key: [query.region], capacity: 1, refill_per_second: 0.001, absent: reject }}
  per-model:
    key: [header.x-model]
    capacity: 1
    refill_per_second: 0.001
    values:
      big: {{ capacity: 1, refill_per_second: 0.001 }}
      small: {{ capacity: 3, refill_per_second: 0.001 }}
    other: reject
  per-user-bucket: {{ key: [credential, header.x-user], absent: bucket, capacity: 1, refill_per_second: 0.001 }}
  per-body-model:
    key: [tenant, body.model]
    capacity: 2
    refill_per_second: 0.001
    values:
      big: {{ capacity: 1, refill_per_second: 0.001 }}
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: users, path: /v1/users, upstream: api, limits: [per-credential, per-end-user] }}
  - {{ name: projects, path: "/v1/projects/{{project}}/items", upstream: api, limits: [per-credential, per-project] }}
  - {{ name: regions, path: /v1/regions, upstream: api, limits: [per-credential, per-region] }}
  - {{ name: models, path: /v1/models, upstream: api, limits: [per-model] }}
  - {{ name: buckets, path: /v1/buckets, upstream: api, limits: [per-credential, per-user-bucket] }}
  - {{ name: crowded, path: /v1/crowded, upstream: api, limits: [tight-credential, per-end-user] }}
  - {{ name: chat, path: /v1/chat, upstream: api, limits: [per-credential, per-body-model] }}
"#,
        c1 = digest("key-c1"),
        c2 = digest("key-c2"),
        admin = digest("admin-token"),
    )
}

const C1: (&str, &str) = ("authorization", "Bearer key-c1");
const C2: (&str, &str) = ("authorization", "Bearer key-c2");

fn statuses(gw: &Gateway, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    (0..n).map(|_| gw.get(path, headers).status).collect()
}

/// The problem type of a 400, checked to be problem+json.
fn problem(gw: &Gateway, path: &str, headers: &[(&str, &str)]) -> String {
    let r = gw.get(path, headers);
    assert_eq!(r.status, 400, "{path}: {}", r.body);
    assert_eq!(
        r.header("content-type"),
        Some("application/problem+json"),
        "{path}"
    );
    r.json()["type"].as_str().unwrap_or_default().to_owned()
}

fn each_value_has_its_budget(gw: &Gateway) {
    let alice = [C1, ("x-end-user", "alice")];
    let bob = [C1, ("x-end-user", "bob")];
    assert_eq!(statuses(gw, "/v1/users", &alice, 3), [200, 200, 429]);
    assert_eq!(statuses(gw, "/v1/users", &bob, 3), [200, 200, 429]);
    // Another credential's alice is another end user.
    assert_eq!(
        statuses(gw, "/v1/users", &[C2, ("x-end-user", "alice")], 2),
        [200, 200]
    );
    // Without the header the limit does not apply (absent: skip).
    assert_eq!(statuses(gw, "/v1/users", &[C1], 4), [200; 4]);
    let r = gw.get("/v1/users", &alice);
    assert_eq!(
        r.json()["violated-policies"],
        serde_json::json!(["per-end-user"])
    );

    // A path segment, read as the upstream reads it: %61 is a.
    assert_eq!(statuses(gw, "/v1/projects/a/items", &[C1], 2), [200, 429]);
    assert_eq!(gw.get("/v1/projects/%61/items", &[C1]).status, 429);
    assert_eq!(gw.get("/v1/projects/b/items", &[C1]).status, 200);
    assert_eq!(gw.get("/v1/projects/a/items", &[C2]).status, 200);

    // A query parameter.
    assert_eq!(statuses(gw, "/v1/regions?region=eu", &[C1], 2), [200, 429]);
    assert_eq!(gw.get("/v1/regions?x=1&region=us", &[C1]).status, 200);

    // Listed values take their own numbers.
    assert_eq!(
        statuses(gw, "/v1/models", &[C1, ("x-model", "small")], 4),
        [200, 200, 200, 429]
    );
    assert_eq!(
        statuses(gw, "/v1/models", &[C1, ("x-model", "big")], 2),
        [200, 429]
    );

    // Absent values share one bucket (absent: bucket).
    assert_eq!(statuses(gw, "/v1/buckets", &[C1], 2), [200, 429]);
    assert_eq!(gw.get("/v1/buckets", &[C1, ("x-user", "u")]).status, 200);
}

fn unusable_values_are_refused(gw: &Gateway) {
    let urn = |kind: &str| format!("urn:tollgate:problem:{kind}");
    let twice = [C1, ("x-end-user", "carol"), ("x-end-user", "dave")];
    assert_eq!(problem(gw, "/v1/users", &twice), urn("ambiguous-key-value"));
    assert_eq!(
        problem(gw, "/v1/regions?region=a&region=b", &[C1]),
        urn("ambiguous-key-value")
    );
    assert_eq!(problem(gw, "/v1/regions", &[C1]), urn("missing-key-value"));
    assert_eq!(
        problem(gw, "/v1/models", &[C1, ("x-model", "huge")]),
        urn("unknown-key-value")
    );
    let long = "e".repeat(257);
    assert_eq!(
        problem(gw, "/v1/users", &[C1, ("x-end-user", &long)]),
        urn("invalid-key-value")
    );
    assert_eq!(
        problem(gw, "/v1/regions?region=a%0Ab", &[C1]),
        urn("invalid-key-value")
    );
    // Authentication comes first: no key is 401 whatever the values.
    assert_eq!(gw.get("/v1/users", &twice[1..]).status, 401);
}

/// A JSON body's member keys a limit: read decoded (an escape and an
/// integer are the value they spell), sent on byte for byte, whether the
/// body came with a length or chunked; a member named twice or a body
/// that is not JSON is 400, one too large to read is 413.
fn body_members_key_limits(gw: &Gateway) {
    let post = |body: &str| {
        let headers = [C1, ("content-type", "application/json")];
        support::request_with_body(gw.addr, "POST", "/v1/chat", &headers, body.as_bytes())
    };
    let status = |body: &str| post(body).status;
    let first = r#"{ "model" : "a", "messages": [{"role": "user", "content": "h\u0069"}] }"#;
    let r = post(first);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["body"],
        first,
        "the upstream reads what the client sent"
    );
    assert_eq!(status(r#"{"model":"a"}"#), 200);
    assert_eq!(status(r#"{"model":"\u0061"}"#), 429, "decoded, a is a");
    assert_eq!(
        status(r#"{"model":"b"}"#),
        200,
        "another value, another budget"
    );
    assert_eq!(status(r#"{"model":"big"}"#), 200);
    assert_eq!(
        status(r#"{"model":"big"}"#),
        429,
        "a listed value's numbers"
    );
    assert_eq!(status(r#"{"model":7}"#), 200);
    assert_eq!(status(r#"{"model":7}"#), 200);
    assert_eq!(
        status(r#"{"model":"7"}"#),
        429,
        "an integer is its decimal string"
    );
    // Absent (skip): no member, a float, an object, or no body at all.
    for absent in [
        r#"{"messages":[]}"#,
        r#"{"model":1.5}"#,
        r#"{"model":{}}"#,
        "",
        "[1]",
    ] {
        assert_eq!(status(absent), 200, "{absent}");
        assert_eq!(status(absent), 200, "{absent}");
        assert_eq!(status(absent), 200, "{absent}");
    }
    let kind = |r: support::Reply| {
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        r.json()["type"].as_str().unwrap_or_default().to_owned()
    };
    let r = post(r#"{"model":"c","model":"d"}"#);
    assert_eq!(r.status, 400);
    assert_eq!(kind(r), "urn:tollgate:problem:ambiguous-key-value");
    let r = post("model=c");
    assert_eq!(r.status, 400);
    assert_eq!(kind(r), "urn:tollgate:problem:bad-request");
    assert_eq!(
        status(&format!(r#"{{"model":"{}"}}"#, "c".repeat(257))),
        400
    );
    // Chunked, in two pieces.
    let chunked = |model: &str| {
        let body = format!(r#"{{"model":"{model}"}}"#);
        let (a, b) = body.split_at(5);
        let raw = format!(
            "POST /v1/chat HTTP/1.1\r\nhost: test\r\nauthorization: Bearer key-c1\r\n\
             transfer-encoding: chunked\r\nconnection: close\r\n\r\n\
             {:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
            a.len(),
            b.len()
        );
        support::raw(gw.addr, raw.as_bytes())
    };
    let reply = chunked("e");
    assert_eq!(support::status_of(&reply), 200, "{reply}");
    assert!(reply.contains(r#"\"model\":\"e\""#), "{reply}");
    assert_eq!(support::status_of(&chunked("e")), 200);
    assert_eq!(support::status_of(&chunked("e")), 429);
    // Over HTTP/2, with and without a declared length.
    let h2 = |model: &str, length: bool| {
        let url = format!("http://{}/v1/chat", gw.addr);
        let body = format!(r#"{{"model":"{model}"}}"#);
        let mut args = vec![
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{http_version}",
        ];
        args.extend(["--max-time", "10", "--http2-prior-knowledge"]);
        args.extend([
            "-H",
            "authorization: Bearer key-c1",
            "--data-binary",
            &body,
            &url,
        ]);
        if !length {
            args.extend(["-H", "content-length:"]);
        }
        let out = std::process::Command::new("curl").args(&args).output();
        String::from_utf8_lossy(&out.expect("curl (make test installs it)").stdout).into_owned()
    };
    assert_eq!(h2("g", true), "200 2");
    assert_eq!(h2("g", false), "200 2");
    assert_eq!(h2("g", false), "429 2");
    // An unknown caller is refused before its body is read: one that never
    // comes changes nothing.
    let unknown = "POST /v1/chat HTTP/1.1\r\nhost: test\r\ncontent-length: 100\r\n\r\n";
    assert_eq!(
        support::status_of(&support::raw(gw.addr, unknown.as_bytes())),
        401
    );
    // Larger than can be read whole before the limits: 413 (oversize: reject).
    let large = format!(r#"{{"model":"f","pad":"{}"}}"#, "x".repeat(70_000));
    assert_eq!(status(&large), 413);
}

/// `/admin/explain` and `/admin/reset` name a key read from requests by its
/// dimension, as the request carries it.
fn operators_name_values_by_dimension(gw: &Gateway) {
    let explain = |query: &str| {
        let token = [("authorization", "Bearer admin-token")];
        let r = support::get(gw.admin, &format!("/admin/explain?{query}"), &token);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["limits"].clone()
    };
    let limits = explain("path=/v1/users&credential=c1&header.x-end-user=alice");
    assert_eq!(limits[1]["name"], "per-end-user");
    assert_eq!(
        limits[1]["key"],
        serde_json::json!(["credential", "header.x-end-user"])
    );
    assert_eq!(limits[1]["remaining"], 0);
    let limits = explain("path=/v1/users&credential=c1&header.x-end-user=zed");
    assert_eq!(limits[1]["remaining"], 2);
    let limits = explain("path=/v1/users&credential=c1");
    assert_eq!(limits[1]["state"], "needs header.x-end-user");

    let reset = |body: &str| support::admin_call(gw, "POST", "/admin/reset", "admin-token", body);
    let r = reset(r#"{"limit": "per-end-user", "credential": "c1"}"#);
    assert_eq!(r.status, 400, "{}", r.body);
    let r = reset(r#"{"limit": "per-end-user", "credential": "c1", "header.x-end-user": "alice"}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    let alice = [C1, ("x-end-user", "alice")];
    assert_eq!(statuses(gw, "/v1/users", &alice, 3), [200, 200, 429]);
}

/// The access log shows each value a limit read as a digest, the same for
/// the same value, never in the clear; and a `values` entry that matched
/// by its name.
fn the_access_log_keeps_values_as_digests(log: &std::path::Path) {
    let mut lines = Vec::new();
    assert!(support::eventually(
        std::time::Duration::from_secs(5),
        || {
            lines = std::fs::read_to_string(log)
                .unwrap_or_default()
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                .collect();
            lines.iter().filter(|l| l["route"] == "chat").count() >= 20
        }
    ));
    let text = std::fs::read_to_string(log).unwrap();
    assert!(!text.contains("alice"), "a header's value in the clear");
    let digest =
        |l: &serde_json::Value, dim: &str| l["key_values"][dim].as_str().map(str::to_owned);
    let users: Vec<_> = lines
        .iter()
        .filter(|l| l["route"] == "users")
        .filter_map(|l| digest(l, "header.x-end-user"))
        .collect();
    assert!(users
        .iter()
        .all(|d| d.len() == 12 && d.bytes().all(|b| b.is_ascii_hexdigit())));
    let chat: Vec<_> = lines.iter().filter(|l| l["route"] == "chat").collect();
    let big: Vec<_> = chat
        .iter()
        .filter(|l| l["values"]["per-body-model"] == "big")
        .collect();
    assert_eq!(
        big.len(),
        2,
        "both requests for the listed value, and no other"
    );
    assert_eq!(digest(big[0], "body.model"), digest(big[1], "body.model"));
    assert!(chat
        .iter()
        .filter(|l| l["key_values"].is_null())
        .all(|l| l["values"].is_null()));
}

#[test]
fn memory_keys_from_headers_paths_and_queries() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.jsonl");
    let logged = format!("threads: 1, access_log: {{ path: \"{}\" }},", log.display());
    let policy = policy("{ backend: memory }").replacen("threads: 1,", &logged, 1);
    let gw = Gateway::start(&policy, Some(&upstream));
    each_value_has_its_budget(&gw);
    unusable_values_are_refused(&gw);
    operators_name_values_by_dimension(&gw);
    body_members_key_limits(&gw);
    the_access_log_keeps_values_as_digests(&log);
    // (That a refused request leaves no key in this store is a unit test
    // of the store: it has no count to read from outside.)
}

#[test]
fn redis_keys_from_headers_paths_and_queries() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let gw = Gateway::start_with_env(&policy(&redis.store(2000)), Some(&upstream), &[SECRET]);
    each_value_has_its_budget(&gw);
    unusable_values_are_refused(&gw);
    body_members_key_limits(&gw);
    assert_eq!(statuses(&gw, "/v1/crowded", &[C2], 3), [200, 200, 429]);
    let before = redis.keys().len();
    for i in 0..50 {
        let user = format!("user-{i}");
        assert_eq!(
            gw.get("/v1/crowded", &[C2, ("x-end-user", &user)]).status,
            429
        );
    }
    assert_eq!(redis.keys().len(), before);
    // No value reaches a key in the clear.
    assert!(redis.keys().iter().all(|k| !k.contains("alice")));
    many_values_at_once_each_get_exactly_their_budget(&gw);
}

/// Ten end users, eight requests each, all at once from ten clients: each
/// user gets exactly its two, whatever the interleaving.
fn many_values_at_once_each_get_exactly_their_budget(gw: &Gateway) {
    let addr = gw.addr;
    let admitted: Vec<usize> = (0..10)
        .map(|u| {
            std::thread::spawn(move || {
                let user = format!("load-{u}");
                let headers = [
                    ("authorization", "Bearer key-c1"),
                    ("x-end-user", user.as_str()),
                ];
                (0..8)
                    .filter(|_| support::get(addr, "/v1/users", &headers).status == 200)
                    .count()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    assert_eq!(admitted, [2; 10]);
}
