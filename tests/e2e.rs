//! End to end: the real binary in front of a real upstream, on loopback.

mod support;

use std::net::IpAddr;
use std::time::Duration;

use support::{digest, eventually, request, Gateway, Upstream};

const POLICY: &str = r#"
version: 1
policy_version: "e2e"
server: { listen: ["{listen}"], admin_listen: "{admin}", threads: 1 }
store: { backend: memory }
client_ip: { trusted_proxies: ["127.0.0.1/32"], header: x-forwarded-for }
ip_rules: { deny: ["127.0.0.66/32"] }
auth:
  keys:
    - { id: a1, tenant: acme, sha256: "DIGEST_A1" }
    - { id: a2, tenant: acme, sha256: "DIGEST_A2" }
    - { id: b1, tenant: beta, sha256: "DIGEST_B1" }
limits:
  ip-guard: { scope: pre_auth, key: [ip], capacity: 1000, refill_per_second: 0.001 }
  strict-ip: { scope: pre_auth, key: [ip], capacity: 3, refill_per_second: 0.001 }
  per-credential: { key: [credential], capacity: 5, refill_per_second: 0.25 }
  per-tenant: { key: [tenant], capacity: 7, refill_per_second: 0.001 }
  weighted: { key: [credential], capacity: 10, refill_per_second: 0.001 }
  shadow-tight: { key: [credential], capacity: 1, refill_per_second: 0.001, mode: shadow }
upstreams:
  api: { servers: ["{upstream}"] }
routes:
  - { name: health, path: /healthz, auth: none, respond: { status: 200, body: "ok\n" } }
  - { name: guarded, path: "/guarded/**", upstream: api, limits: [strict-ip] }
  - { name: export, methods: [POST], path: /v1/export, cost: 3, upstream: api, limits: [weighted] }
  - { name: cheap, path: /v1/cheap, upstream: api, limits: [weighted] }
  - { name: shadowed, path: /v1/shadowed, upstream: api, limits: [shadow-tight] }
  - { name: credential-only, path: /v1/mine, upstream: api, limits: [per-credential] }
  - { name: reports, methods: [GET], path: "/v1/tenants/{tenant}/reports/{id}", upstream: api, limits: [per-credential, per-tenant] }
  - { name: teapot, path: /teapot, respond: { status: 418, body: "short and stout", content_type: text/plain } }
  - { name: api, path: "/v1/**", upstream: api, limits: [ip-guard] }
responses: { ratelimit_headers: draft }
"#;

const A1: (&str, &str) = ("authorization", "Bearer key-a1");
const A2: (&str, &str) = ("authorization", "Bearer key-a2");
const B1: (&str, &str) = ("authorization", "Bearer key-b1");

fn policy() -> String {
    POLICY
        .replace("DIGEST_A1", &digest("key-a1"))
        .replace("DIGEST_A2", &digest("key-a2"))
        .replace("DIGEST_B1", &digest("key-b1"))
}

fn start() -> (Gateway, Upstream) {
    let upstream = Upstream::start();
    (Gateway::start(&policy(), Some(&upstream)), upstream)
}

/// As [`start`], with the access log written to `path`.
fn start_logging_to(path: &std::path::Path) -> (Gateway, Upstream) {
    let upstream = Upstream::start();
    let policy = policy().replace(
        "threads: 1 }",
        &format!(
            "threads: 1, access_log: {{ path: \"{}\" }} }}",
            path.display()
        ),
    );
    (Gateway::start(&policy, Some(&upstream)), upstream)
}

fn ip(text: &str) -> Option<IpAddr> {
    Some(text.parse().unwrap())
}

#[test]
fn proxies_with_identity_headers_and_drops_spoofed_ones() {
    let (gw, upstream) = start();
    let r = gw.get(
        "/v1/orders/17?full=1",
        &[
            A1,
            ("x-tenant-id", "victim"),
            ("x-credential-id", "victim-ci"),
            ("x-route-class", "admin"),
        ],
    );
    assert_eq!(r.status, 200, "{}", gw.log());
    assert_eq!(r.json()["path"], "/v1/orders/17?full=1");
    assert_eq!(r.upstream_saw("x-tenant-id"), ["acme"]);
    assert_eq!(r.upstream_saw("x-credential-id"), ["a1"]);
    assert_eq!(r.upstream_saw("x-route-class"), ["api"]);
    assert_eq!(r.upstream_saw("x-forwarded-for"), ["127.0.0.1"]);
    // The key stays at the gateway unless `auth.forward_key: true`.
    assert!(r.upstream_saw("authorization").is_empty());
    assert_eq!(upstream.hits(), 1);

    // A trusted proxy's chain is kept and the peer appended.
    let r = gw.get("/v1/x", &[B1, ("x-forwarded-for", "198.51.100.9")]);
    assert_eq!(
        r.upstream_saw("x-forwarded-for"),
        ["198.51.100.9, 127.0.0.1"]
    );
}

#[test]
fn missing_and_unknown_keys_get_the_same_401() {
    let (gw, upstream) = start();
    let missing = gw.get("/v1/x", &[]);
    let unknown = gw.get("/v1/x", &[("authorization", "Bearer nope")]);
    let wrong_scheme = gw.get("/v1/x", &[("authorization", "Basic a2V5LWExOg==")]);
    for r in [&missing, &unknown, &wrong_scheme] {
        assert_eq!(r.status, 401);
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        assert_eq!(r.header("cache-control"), Some("no-store"));
        assert_eq!(r.body, missing.body);
    }
    assert_eq!(missing.json()["status"], 401);
    assert_eq!(upstream.hits(), 0);
}

#[test]
fn denied_addresses_get_403_directly_or_through_a_trusted_proxy() {
    let (gw, upstream) = start();
    let direct = request(gw.addr, ip("127.0.0.66"), "GET", "/v1/x", &[A1]);
    assert_eq!(direct.status, 403);
    assert_eq!(direct.json()["title"], "Forbidden");
    let forwarded = request(
        gw.addr,
        ip("127.0.0.1"),
        "GET",
        "/v1/x",
        &[A1, ("x-forwarded-for", "127.0.0.66")],
    );
    assert_eq!(forwarded.status, 403);
    // An untrusted peer cannot borrow a denied (or any) address.
    let spoof = request(
        gw.addr,
        ip("127.0.0.5"),
        "GET",
        "/v1/x",
        &[A1, ("x-forwarded-for", "127.0.0.66")],
    );
    assert_eq!(spoof.status, 200);
    assert_eq!(upstream.hits(), 1);
}

#[test]
fn unmatched_paths_and_dot_segments_get_404() {
    let (gw, upstream) = start();
    for path in ["/nope", "/v1/../teapot", "/v1/%2e%2e/teapot", "/v1/./x"] {
        let r = gw.get(path, &[A1]);
        assert_eq!(r.status, 404, "{path}");
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
    }
    // Methods are part of the match: DELETE on the GET-only reports route
    // falls through to the catch-all.
    let r = request(gw.addr, None, "DELETE", "/v1/tenants/t/reports/1", &[A1]);
    assert_eq!(r.upstream_saw("x-route-class"), ["api"]);
    // Collapsed slashes still match.
    assert_eq!(gw.get("//teapot", &[A1]).status, 418);
    assert_eq!(upstream.hits(), 1);
}

#[test]
fn the_burst_is_followed_by_429_with_an_exact_retry_after() {
    let (gw, upstream) = start();
    for i in 0..5 {
        assert_eq!(gw.get("/v1/mine", &[A2]).status, 200, "request {i}");
    }
    let r = gw.get("/v1/mine", &[A2]);
    assert_eq!(r.status, 429);
    // One token at 0.25 tokens per second: four seconds.
    assert_eq!(r.header("retry-after"), Some("4"));
    assert_eq!(r.header("cache-control"), Some("no-store"));
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let body = r.json();
    assert_eq!(body["status"], 429);
    assert_eq!(
        body["violated-policies"],
        serde_json::json!(["per-credential"])
    );
    assert_eq!(upstream.hits(), 5);
    // Another credential is unaffected.
    assert_eq!(gw.get("/v1/mine", &[B1]).status, 200);
}

#[test]
fn weighted_requests_spend_their_cost() {
    let (gw, upstream) = start();
    for _ in 0..3 {
        assert_eq!(
            request(gw.addr, None, "POST", "/v1/export", &[B1]).status,
            200
        );
    }
    // 9 of 10 spent: another export (3) does not fit, a cheap call (1) does.
    let denied = request(gw.addr, None, "POST", "/v1/export", &[B1]);
    assert_eq!(denied.status, 429);
    assert_eq!(
        denied.json()["violated-policies"],
        serde_json::json!(["weighted"])
    );
    assert_eq!(gw.get("/v1/cheap", &[B1]).status, 200);
    assert_eq!(gw.get("/v1/cheap", &[B1]).status, 429);
    assert_eq!(upstream.hits(), 4);
}

#[test]
fn a_request_denied_by_one_limit_charges_none_of_the_others() {
    let (gw, _upstream) = start();
    let reports = "/v1/tenants/acme/reports/1";
    for _ in 0..5 {
        assert_eq!(gw.get(reports, &[A1]).status, 200);
    }
    // a1's own limit is spent; the tenant (5 of 7 used) must not be charged
    // for the denied attempts.
    for _ in 0..3 {
        let r = gw.get(reports, &[A1]);
        assert_eq!(r.status, 429);
        assert_eq!(
            r.json()["violated-policies"],
            serde_json::json!(["per-credential"])
        );
    }
    assert_eq!(gw.get(reports, &[A2]).status, 200);
    assert_eq!(gw.get(reports, &[A2]).status, 200);
    // Now the tenant is spent: a2 is denied by it, and its own credential
    // budget (2 of 5 used) is left as it was.
    for _ in 0..4 {
        let r = gw.get(reports, &[A2]);
        assert_eq!(r.status, 429);
        assert_eq!(
            r.json()["violated-policies"],
            serde_json::json!(["per-tenant"])
        );
    }
    let mine: Vec<u16> = (0..4).map(|_| gw.get("/v1/mine", &[A2]).status).collect();
    assert_eq!(mine, [200, 200, 200, 429]);
}

#[test]
fn shadow_limits_never_deny() {
    let (gw, upstream) = start();
    for _ in 0..5 {
        assert_eq!(gw.get("/v1/shadowed", &[B1]).status, 200);
    }
    assert_eq!(upstream.hits(), 5);
}

#[test]
fn pre_auth_limits_key_by_the_resolved_client_ip() {
    let (gw, _upstream) = start();
    let untrusted = ip("127.0.0.2");
    // Bad keys are charged to the address before they get their 401, and a
    // spoofed x-forwarded-for from an untrusted peer changes nothing.
    for spoof in ["203.0.113.1", "203.0.113.2", "203.0.113.3"] {
        let r = request(
            gw.addr,
            untrusted,
            "GET",
            "/guarded/a",
            &[("authorization", "Bearer bad"), ("x-forwarded-for", spoof)],
        );
        assert_eq!(r.status, 401);
    }
    let r = request(
        gw.addr,
        untrusted,
        "GET",
        "/guarded/a",
        &[A1, ("x-forwarded-for", "203.0.113.4")],
    );
    assert_eq!(r.status, 429, "the address is spent whatever the key");
    assert_eq!(
        r.json()["violated-policies"],
        serde_json::json!(["strict-ip"])
    );
    assert_eq!(
        request(gw.addr, ip("127.0.0.3"), "GET", "/guarded/a", &[A1]).status,
        200
    );

    // Through the trusted proxy each forwarded client has its own budget.
    let trusted = ip("127.0.0.1");
    let from = |client: &str| {
        request(
            gw.addr,
            trusted,
            "GET",
            "/guarded/a",
            &[A1, ("x-forwarded-for", client)],
        )
        .status
    };
    let first: Vec<u16> = (0..4).map(|_| from("198.51.100.7")).collect();
    assert_eq!(first, [200, 200, 200, 429]);
    assert_eq!(from("198.51.100.8"), 200);
}

#[test]
fn direct_responses_never_reach_the_upstream() {
    let (gw, upstream) = start();
    let r = gw.get("/teapot", &[A1]);
    assert_eq!(r.status, 418);
    assert_eq!(r.body, "short and stout");
    assert_eq!(r.header("content-type"), Some("text/plain"));
    let h = gw.get("/healthz", &[]);
    assert_eq!((h.status, h.body.as_str()), (200, "ok\n"));
    assert_eq!(
        gw.get("/teapot", &[]).status,
        401,
        "direct routes still authenticate"
    );
    assert_eq!(upstream.hits(), 0);
}

#[test]
fn draft_ratelimit_headers_describe_the_tightest_limit() {
    let (gw, _upstream) = start();
    let r = gw.get("/v1/mine", &[B1]);
    assert_eq!(r.status, 200);
    // Capacity 5 refilling 0.25/s: a 20 s period; one token back in 4 s.
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"per-credential\";q=5;w=20")
    );
    assert_eq!(r.header("ratelimit"), Some("\"per-credential\";r=4;t=4"));
}

#[test]
fn servers_of_a_pool_take_turns_and_a_dead_pool_gets_a_502_problem() {
    let (one, two) = (Upstream::start(), Upstream::start());
    // Nothing in the tests binds this loopback address: a free port on
    // 127.0.0.1 could be taken by another test's server meanwhile.
    let dead = "127.0.0.254:1";
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
upstreams:
  pair: {{ servers: ["{}", "{}"] }}
  dead: {{ servers: ["{dead}"], connect_timeout_ms: 500 }}
routes:
  - {{ name: dead, path: /dead, auth: none, upstream: dead }}
  - {{ name: pair, path: "/**", auth: none, upstream: pair }}
"#,
        one.addr, two.addr
    );
    let gw = Gateway::start(&policy, None);
    for _ in 0..6 {
        assert_eq!(gw.get("/x", &[]).status, 200);
    }
    assert_eq!((one.hits(), two.hits()), (3, 3));
    let r = gw.get("/dead", &[]);
    assert_eq!(r.status, 502);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.header("cache-control"), Some("no-store"));
    assert_eq!(r.json()["title"], "Bad Gateway");
    // Admitted, then forwarding failed: counted as admitted (no value of the
    // `outcome` label stands for it; the status is in the upstream histogram
    // and logs).
    let counted = eventually(Duration::from_secs(5), || {
        gw.metric("tollgate_requests_total{outcome=\"allowed\",route=\"dead\"}") == 1.0
    });
    assert!(counted, "{}", gw.metrics());
}

#[test]
fn build_and_process_series_are_exported() {
    let (gw, _upstream) = start();
    let text = gw.metrics();
    let build = format!(
        "tollgate_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    assert!(text.contains(&build), "{text}");
    for series in ["process_resident_memory_bytes", "process_open_fds"] {
        assert!(gw.metric(series) > 0.0, "{series} in {text}");
    }
    assert!(text.contains("\nprocess_cpu_seconds_total "), "{text}");
}

#[test]
fn the_access_log_has_one_json_line_per_request_as_the_client_saw_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.jsonl");
    let (gw, upstream) = start_logging_to(&path);
    let statuses = [
        gw.get("/v1/%6Frders/1?x=1", &[A1]).status,
        gw.get("/v1/orders/2", &[]).status,
        gw.get("/nowhere", &[]).status,
    ];
    assert_eq!(statuses, [200, 401, 404]);
    let lines = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(5), || lines().len() == 3),
        "{:?}",
        lines()
    );
    let lines = lines();
    let fields: Vec<&str> = lines[0]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    let mut expected = vec![
        "time",
        "policy_version",
        "method",
        "host",
        "path",
        "route",
        "status",
        "outcome",
        "tenant",
        "credential",
        "auth_source",
        "client",
        "cost",
        "violated",
        "upstream",
        "duration_ms",
        "bytes_in",
        "bytes_out",
        "trace_id",
    ];
    expected.sort_unstable();
    let mut fields = fields;
    fields.sort_unstable();
    assert_eq!(fields, expected);
    assert_eq!(
        lines[0]["path"], "/v1/orders/1",
        "normalized, without the query"
    );
    assert_eq!(lines[0]["status"], 200);
    assert_eq!(lines[0]["outcome"], "allowed");
    assert_eq!(lines[0]["credential"], "a1");
    assert_eq!(lines[0]["auth_source"], "file");
    assert_eq!(lines[0]["tenant"], "acme");
    assert_eq!(lines[0]["client"], "127.0.0.1/32");
    assert_eq!(lines[0]["upstream"], upstream.addr.to_string());
    assert_eq!(lines[0]["host"], "test");
    assert!(lines[0]["time"].as_str().unwrap().ends_with('Z'));
    assert_eq!(
        (lines[1]["status"].clone(), lines[1]["outcome"].clone()),
        (401.into(), "unauthorized".into())
    );
    assert!(lines[1]["credential"].is_null());
    assert_eq!(lines[2]["status"], 404);
    assert!(lines[2]["route"].is_null());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "identities in the clear: owner only");
    }

    // Rotation: the file is moved away, SIGHUP, and the next line goes to a
    // new file.
    let rotated = dir.path().join("access.jsonl.1");
    std::fs::rename(&path, &rotated).unwrap();
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(5), || {
        gw.get("/nowhere", &[]);
        std::fs::read_to_string(&path).is_ok_and(|t| !t.is_empty())
    }));
}

#[test]
fn simulate_replays_the_gateway_s_own_log_to_the_same_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.jsonl");
    let (gw, _upstream) = start_logging_to(&log);
    // `weighted` holds 10 per credential and barely refills: a1 is refused
    // 4 times, b1 never; the request without a key is refused by auth.
    let mut refused = 0;
    for key in [A1; 14].iter().chain(&[B1; 3]) {
        refused += usize::from(gw.get("/v1/cheap", &[*key]).status == 429);
    }
    assert_eq!(refused, 4);
    assert_eq!(gw.get("/v1/cheap", &[]).status, 401);
    let lines = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count()
    };
    assert!(eventually(Duration::from_secs(5), || lines() == 18));

    let report = dir.path().join("report.html");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("simulate")
        .arg("--config")
        .arg(&gw.config)
        .arg("--log")
        .arg(&log)
        .arg("--report")
        .arg(&report)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("18 requests replayed, 0 lines skipped"),
        "{text}"
    );
    let row = |name: &str| -> Vec<u64> {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row {name}: {text}"));
        line.split_whitespace()
            .skip(1)
            .map(|n| n.parse().unwrap())
            .collect()
    };
    // Admitted, cost, refused, cost, flagged, cost: as the gateway decided.
    assert_eq!(row("weighted"), [13, 13, 4, 4, 0, 0]);
    assert_eq!(row("acme")[2], 4);
    assert_eq!(row("cheap")[2], 5, "four by the limit, one by auth");
    let page = std::fs::read_to_string(&report).unwrap();
    assert!(page.contains("<b>weighted</b>: 4 refused"), "{page}");
}
