//! Running the gateway: pool bounds, health checks, live reload, metrics
//! cardinality, admin endpoints and graceful shutdown, all through the real
//! binary in front of real upstream servers.

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use support::{digest, eventually, get, request, request_with_body, Gateway, Upstream};

fn pools_policy(slow: &Upstream, fast: &Upstream) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 2 }}
upstreams:
  slow: {{ servers: ["{}"], max_in_flight: 2, queue: {{ max_waiting: 2, timeout_ms: 100 }} }}
  fast: {{ servers: ["{}"], max_in_flight: 4 }}
routes:
  - {{ name: slow, path: "/slow/**", auth: none, upstream: slow }}
  - {{ name: fail, path: "/fail", auth: none, upstream: slow }}
  - {{ name: fast, path: "/**", auth: none, upstream: fast }}
"#,
        slow.addr, fast.addr
    )
}

fn in_parallel(n: usize, f: impl Fn(usize) -> u16 + Send + Sync + 'static) -> Vec<u16> {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let f = f.clone();
            thread::spawn(move || f(i))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_pool_never_has_more_than_its_bound_in_flight() {
    let (slow, fast) = (
        Upstream::slow(Duration::from_millis(300)),
        Upstream::start(),
    );
    let gw = Gateway::start(&pools_policy(&slow, &fast), None);
    let addr = gw.addr;
    let statuses = in_parallel(12, move |_| {
        let r = get(addr, "/slow/x", &[]);
        if r.status == 503 {
            assert_eq!(r.header("retry-after"), Some("1"));
            assert_eq!(r.json()["title"], "Service Unavailable");
        }
        r.status
    });
    assert!(
        slow.max_in_flight() <= 2,
        "the upstream saw {} at once",
        slow.max_in_flight()
    );
    let ok = statuses.iter().filter(|&&s| s == 200).count();
    assert!(ok >= 2, "{statuses:?}");
    assert!(
        statuses.iter().all(|&s| s == 200 || s == 503),
        "{statuses:?}"
    );
    assert!(
        statuses.contains(&503),
        "12 at once cannot all fit in 2 + a queue of 2"
    );
    assert!(gw.metric("tollgate_pool_rejections_total{pool=\"slow\",priority=\"normal\"}") >= 1.0);

    // Clients that give up mid-request and upstreams that fail must not
    // leak a permit either.
    for _ in 0..4 {
        let mut s = TcpStream::connect(gw.addr).unwrap();
        s.write_all(b"GET /slow/abandoned HTTP/1.1\r\nhost: t\r\n\r\n")
            .unwrap();
        drop(s);
    }
    let drained = || {
        eventually(Duration::from_secs(5), || {
            gw.metric("tollgate_pool_in_flight{pool=\"slow\"}") == 0.0
                && gw.metric("tollgate_pool_waiting{pool=\"slow\"}") == 0.0
        })
    };
    // The abandoned requests give their permits back (however long the
    // machine takes to notice they are gone), then failed ones do too.
    assert!(drained(), "{}", gw.metrics());
    for _ in 0..3 {
        assert_eq!(gw.get("/fail", &[]).status, 502);
    }
    assert!(drained(), "{}", gw.metrics());
    // And the pool is whole again: two requests fit at once.
    let again = in_parallel(2, move |_| get(addr, "/slow/y", &[]).status);
    assert_eq!(again, [200, 200]);
}

#[test]
fn saturating_one_pool_leaves_another_alone() {
    let (slow, fast) = (Upstream::slow(Duration::from_secs(2)), Upstream::start());
    let gw = Gateway::start(&pools_policy(&slow, &fast), None);
    let addr = gw.addr;
    // Fill the slow pool and its queue.
    let blockers: Vec<_> = (0..4)
        .map(|_| thread::spawn(move || get(addr, "/slow/x", &[]).status))
        .collect();
    assert!(eventually(Duration::from_secs(2), || slow
        .state
        .in_flight
        .load(Ordering::SeqCst)
        == 2));
    assert_eq!(gw.get("/slow/more", &[]).status, 503);
    // The fast pool admits everything while the slow one is still busy.
    for _ in 0..20 {
        assert_eq!(gw.get("/fast", &[]).status, 200);
    }
    assert_eq!(
        slow.state.in_flight.load(Ordering::SeqCst),
        2,
        "the fast requests did not wait for the slow pool"
    );
    for b in blockers {
        b.join().unwrap();
    }
}

#[test]
fn unhealthy_servers_leave_the_round_robin_and_come_back() {
    let (a, b) = (Upstream::start(), Upstream::start());
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
upstreams:
  api:
    servers: ["{}", "{}"]
    health_check: {{ interval_ms: 50, timeout_ms: 200, path: /health, unhealthy_after: 1, healthy_after: 1 }}
routes:
  - {{ name: api, path: "/**", auth: none, upstream: api }}
"#,
        a.addr, b.addr
    );
    let gw = Gateway::start(&policy, None);
    b.state.unhealthy.store(true, Ordering::SeqCst);
    assert!(eventually(Duration::from_secs(3), || {
        let before = b.hits();
        (0..6).all(|_| gw.get("/x", &[]).status == 200) && b.hits() == before
    }));
    b.state.unhealthy.store(false, Ordering::SeqCst);
    let before = b.hits();
    assert!(eventually(Duration::from_secs(3), || {
        gw.get("/x", &[]);
        b.hits() > before
    }));
    a.state.unhealthy.store(true, Ordering::SeqCst);
    b.state.unhealthy.store(true, Ordering::SeqCst);
    assert!(eventually(Duration::from_secs(3), || gw
        .get("/x", &[])
        .status
        == 503));
    let r = gw.get("/x", &[]);
    assert_eq!(r.json()["type"], "urn:tollgate:problem:no-healthy-upstream");
    assert_eq!(r.header("retry-after"), Some("1"));
}

fn reload_policy(version: &str, capacity: u32) -> String {
    format!(
        r#"
version: 1
policy_version: "{version}"
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  threads: 2
  # Reloads are counted exactly: only the ones asked for.
  watch: false
  admin_tokens: [{{ name: oncall, sha256: "{}", role: write }}]
auth:
  keys:
    - {{ id: c1, tenant: acme, sha256: "{}" }}
    - {{ id: c2, tenant: acme, sha256: "{}" }}
    - {{ id: c3, tenant: acme, sha256: "{}" }}
limits:
  per-credential: {{ key: [credential], capacity: {capacity}, refill_per_second: 0.001 }}
upstreams:
  api: {{ servers: ["{{upstream}}"], max_in_flight: {capacity} }}
routes:
  - {{ name: limited, path: /limited, respond: {{ status: 200 }}, limits: [per-credential] }}
  - {{ name: api, path: "/**", auth: none, upstream: api }}
responses: {{ ratelimit_headers: draft }}
"#,
        digest(ADMIN_TOKEN),
        digest("k1"),
        digest("k2"),
        digest("k3")
    )
}

/// The write token of `reload_policy`.
const ADMIN_TOKEN: &str = "oncall-s3cret";

/// `POST /admin/reload` with the write token, as JSON.
fn reload(gw: &Gateway) -> support::Reply {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    request(
        gw.admin,
        None,
        "POST",
        "/admin/reload",
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
    )
}

fn admitted(gw: &Gateway, key: &str, n: usize) -> usize {
    let auth = format!("Bearer {key}");
    (0..n)
        .filter(|_| gw.get("/limited", &[("authorization", &auth)]).status == 200)
        .count()
}

#[test]
fn a_reload_changes_limits_for_new_requests() {
    let upstream = Upstream::start();
    let gw = Gateway::start(&reload_policy("v1", 2), Some(&upstream));
    assert_eq!(admitted(&gw, "k1", 5), 2);
    gw.rewrite(&reload_policy("v2", 5), Some(&upstream));
    let r = reload(&gw);
    assert_eq!((r.status, r.body.as_str()), (200, "reloaded: policy v2\n"));
    // The reload's log line says what changed, and which way.
    let log = gw.log();
    let line = log
        .lines()
        .find(|l| l.contains("policy reloaded"))
        .expect("a reload line");
    assert!(
        line.contains("~ limit per-credential: capacity 2 → 5 (budgets go up)"),
        "{line}"
    );
    assert_eq!(
        gw.metric("tollgate_config_info{policy_version=\"v2\"}"),
        1.0
    );
    assert_eq!(
        gw.metric("tollgate_config_reloads_total{result=\"ok\"}"),
        1.0
    );
    // A fresh caller gets the new capacity; the spent one keeps its spending.
    assert_eq!(admitted(&gw, "k2", 8), 5);
    let r = gw.get("/limited", &[("authorization", "Bearer k1")]);
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"per-credential\";q=5;w=5000")
    );
    assert_eq!(
        r.status, 429,
        "the state of an unchanged key survives the reload"
    );

    // SIGHUP does the same.
    gw.rewrite(&reload_policy("v3", 7), Some(&upstream));
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(5), || gw
        .metric("tollgate_config_info{policy_version=\"v3\"}")
        == 1.0));
    assert_eq!(admitted(&gw, "k3", 9), 7);
}

#[test]
fn a_broken_file_is_rejected_and_the_old_policy_keeps_serving() {
    let upstream = Upstream::start();
    let gw = Gateway::start(&reload_policy("v1", 2), Some(&upstream));
    gw.rewrite(
        &reload_policy("v2", 2).replace("refill_per_second", "refill_per_secnd"),
        Some(&upstream),
    );
    let r = reload(&gw);
    assert_eq!(r.status, 400);
    assert!(
        r.body.contains(
            "unknown key refill_per_secnd at limits.per-credential; did you mean refill_per_second?"
        ),
        "{}",
        r.body
    );
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(5), || gw
        .metric("tollgate_config_reloads_total{result=\"error\"}")
        == 2.0));
    assert_eq!(
        gw.metric("tollgate_config_info{policy_version=\"v1\"}"),
        1.0
    );
    assert_eq!(admitted(&gw, "k1", 3), 2, "still policy v1");
    assert_eq!(gw.get("/anything", &[]).status, 200);
}

#[test]
fn no_request_fails_while_policies_are_reloaded_under_load() {
    let upstream = Upstream::start();
    let gw = Gateway::start(&reload_policy("v0", 64), Some(&upstream));
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let addr = gw.addr;
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let status = get(addr, "/api", &[]).status;
                    sent.fetch_add(1, Ordering::SeqCst);
                    if status != 200 {
                        failed.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for i in 1..=20 {
        gw.rewrite(
            &reload_policy(&format!("v{i}"), 60 + i % 2 * 4),
            Some(&upstream),
        );
        // Admin writes are limited to ten a second per token: a 429 is
        // asked again after it.
        let mut r = reload(&gw);
        for _ in 0..50 {
            if r.status != 429 {
                break;
            }
            thread::sleep(Duration::from_millis(100));
            r = reload(&gw);
        }
        assert_eq!(r.status, 200, "{}", r.body);
    }
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.join().unwrap();
    }
    assert!(sent.load(Ordering::SeqCst) > 20);
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "of {} requests",
        sent.load(Ordering::SeqCst)
    );
    assert_eq!(
        gw.metric("tollgate_config_reloads_total{result=\"ok\"}"),
        20.0
    );
}

/// Non-comment lines of a scrape: one per series (or bucket).
fn series(text: &str) -> usize {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .count()
}

#[test]
fn many_tenants_keys_and_addresses_add_no_series() {
    let tenants = 300;
    let keys: String = (0..tenants)
        .map(|i| {
            format!(
                "    - {{ id: cred-{i}, tenant: tenant-{i}, sha256: \"{}\" }}\n",
                digest(&format!("secret-key-{i}"))
            )
        })
        .collect();
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 2 }}
client_ip: {{ trusted_proxies: ["127.0.0.1/32"] }}
auth:
  keys:
{keys}
limits:
  per-ip: {{ scope: pre_auth, key: [ip], capacity: 100, refill_per_second: 1 }}
  per-credential: {{ key: [credential], capacity: 1, refill_per_second: 0.001 }}
  per-tenant: {{ key: [tenant], capacity: 100, refill_per_second: 1, mode: shadow }}
routes:
  - {{ name: api, path: "/v1/**", respond: {{ status: 200 }}, limits: [per-ip, per-credential, per-tenant] }}
"#
    );
    let gw = Gateway::start(&policy, None);
    let traffic = |i: usize| {
        let ip = format!("198.51.{}.{}", i / 250, i % 250 + 1);
        let key = format!("Bearer secret-key-{i}");
        let from = [
            ("x-forwarded-for", ip.as_str()),
            ("authorization", key.as_str()),
        ];
        assert_eq!(gw.get(&format!("/v1/orders/{i}"), &from).status, 200);
        assert_eq!(gw.get(&format!("/v1/orders/{i}"), &from).status, 429);
        assert_eq!(
            gw.get("/v1/x", &[from[0], ("authorization", "Bearer wrong")])
                .status,
            401
        );
        assert_eq!(gw.get(&format!("/nope-{i}"), &from[..1]).status, 404);
    };
    (0..10).for_each(traffic);
    let before = gw.metrics();
    (10..tenants).for_each(traffic);
    let after = gw.metrics();
    assert_eq!(
        series(&before),
        series(&after),
        "series grew with identities"
    );
    for i in [0, 7, 150, 299] {
        for identity in [
            format!("tenant-{i}"),
            format!("cred-{i}"),
            format!("secret-key-{i}"),
            format!("198.51.0.{}", i % 250 + 1),
            format!("nope-{i}"),
            format!("orders/{i}"),
        ] {
            assert!(!after.contains(&identity), "{identity} in the scrape");
        }
    }
    assert_eq!(
        gw.metric("tollgate_requests_total{outcome=\"allowed\",route=\"api\"}"),
        tenants as f64
    );
    assert_eq!(
        gw.metric("tollgate_requests_total{outcome=\"limited\",route=\"api\"}"),
        tenants as f64
    );
    assert_eq!(
        gw.metric("tollgate_requests_total{outcome=\"not_found\",route=\"unmatched\"}"),
        tenants as f64
    );
}

#[test]
fn admin_endpoints_need_the_token_and_top_hides_identities_without_it() {
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1, admin_token_env: TEST_ADMIN_TOKEN }}
auth:
  keys: [ {{ id: heavy-caller, tenant: acme, sha256: "{}" }} ]
limits:
  per-credential: {{ key: [credential], capacity: 5, refill_per_second: 0.001 }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200 }}, limits: [per-credential] }}
"#,
        digest("k-heavy")
    );
    let gw = Gateway::start_with_env(&policy, None, &[("TEST_ADMIN_TOKEN", "admin-s3cret")]);
    let heavy = [("authorization", "Bearer k-heavy")];
    let statuses: Vec<u16> = (0..7).map(|_| gw.get("/x", &heavy).status).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
    assert_eq!(get(gw.admin, "/admin/top", &[]).status, 401);
    assert_eq!(
        get(gw.admin, "/admin/top", &[("authorization", "Bearer wrong")]).status,
        401
    );
    assert_eq!(
        request(gw.admin, None, "POST", "/admin/reload", &[]).status,
        401
    );
    assert_eq!(
        get(gw.admin, "/metrics", &[]).status,
        200,
        "metrics stay open for scrapers"
    );
    let top = get(
        gw.admin,
        "/admin/top",
        &[("authorization", "Bearer admin-s3cret")],
    )
    .json();
    assert_eq!(top["top"][0]["caller"], "credential:heavy-caller");
    assert_eq!(top["top"][0]["admitted_cost"], 5);
    assert_eq!(
        top["top"][0]["denied_cost"], 2,
        "denials count against the credential"
    );
    // A path no endpoint has, or a method an endpoint does not take, is a
    // problem like every other admin error.
    let token = [
        ("authorization", "Bearer admin-s3cret"),
        ("content-type", "application/json"),
    ];
    for (method, path, status) in [
        ("GET", "/admin/nothing", 404),
        ("DELETE", "/admin/top", 405),
        ("GET", "/admin/overrides/acme", 405),
        ("PUT", "/admin/credentials/heavy-caller", 405),
    ] {
        let answer = request(gw.admin, None, method, path, &token);
        assert_eq!(answer.status, status, "{method} {path}");
        assert_eq!(
            answer.header("content-type"),
            Some("application/problem+json"),
            "{method} {path}"
        );
    }

    // Without a configured token, /admin/top answers with hashed callers.
    let open = Gateway::start(
        &policy.replace(", admin_token_env: TEST_ADMIN_TOKEN", ""),
        None,
    );
    open.get("/x", &[("authorization", "Bearer k-heavy")]);
    let top = get(open.admin, "/admin/top", &[]);
    assert_eq!(top.status, 200);
    let caller = top.json()["top"][0]["caller"].as_str().unwrap().to_string();
    assert!(
        caller.starts_with("credential:") && !caller.contains("heavy"),
        "{caller}"
    );

    // Without any token the admin API is read-only.
    let reload = request(
        open.admin,
        None,
        "POST",
        "/admin/reload",
        &[("content-type", "application/json")],
    );
    assert_eq!(reload.status, 403);
    assert_eq!(
        reload.header("content-type"),
        Some("application/problem+json")
    );

    // A token variable that is named but unset closes /admin/* entirely.
    let closed = Gateway::start(&policy, None);
    assert_eq!(get(closed.admin, "/admin/top", &[]).status, 403);
    assert_eq!(
        request(closed.admin, None, "POST", "/admin/reload", &[]).status,
        403
    );
}

#[test]
fn admin_writes_need_a_write_token_and_json_and_each_leaves_an_audit_line() {
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    let policy = reload_policy("v1", 2).replace(
        "  admin_tokens: [{ name: oncall,",
        &format!(
            "  audit_log: {{ path: \"{}\" }}\n  admin_tokens: [{{ name: viewer, sha256: \"{}\", role: read }}, {{ name: oncall,",
            audit.display(),
            digest("viewer-s3cret")
        ),
    );
    let upstream = Upstream::start();
    let gw = Gateway::start(&policy, Some(&upstream));
    let post = |headers: &[(&str, &str)]| request(gw.admin, None, "POST", "/admin/reload", headers);
    let json = ("content-type", "application/json");
    let viewer = ("authorization", "Bearer viewer-s3cret");
    let oncall = format!("Bearer {ADMIN_TOKEN}");
    let oncall = ("authorization", oncall.as_str());

    assert_eq!(
        get(gw.admin, "/admin/top", &[]).status,
        401,
        "reads need a token"
    );
    assert_eq!(get(gw.admin, "/admin/top", &[viewer]).status, 200);
    let cases: [(&[(&str, &str)], u16); 5] = [
        (&[json], 401),
        (&[viewer, json], 403),
        (&[oncall, ("content-type", "text/plain")], 415),
        (
            &[
                oncall,
                ("content-type", "application/x-www-form-urlencoded"),
            ],
            415,
        ),
        (&[oncall, json], 200),
    ];
    for (headers, status) in cases {
        let r = post(headers);
        assert_eq!(r.status, status, "{headers:?}: {}", r.body);
        if status != 200 {
            assert_eq!(r.header("content-type"), Some("application/problem+json"));
            assert!(r.json()["type"]
                .as_str()
                .unwrap()
                .starts_with("urn:tollgate:problem:"));
        }
    }
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seen: Vec<(String, String)> = lines
        .iter()
        .map(|l| {
            (
                l["actor"].as_str().unwrap().into(),
                l["result"].as_str().unwrap().into(),
            )
        })
        .collect();
    // The refused read first: a caller without a valid token is audited
    // whatever it asked.
    let expected = [
        ("unknown", "refused"),
        ("unknown", "refused"),
        ("viewer", "refused"),
        ("oncall", "refused"),
        ("oncall", "refused"),
        ("oncall", "ok"),
    ];
    assert_eq!(
        seen,
        expected.map(|(a, r)| (a.to_string(), r.to_string())),
        "one line per write, refused ones too"
    );
    assert_eq!(lines[0]["action"], "read");
    assert!(lines[1..]
        .iter()
        .all(|l| l["action"] == "reload" && l["time"].is_string()));
    assert_eq!(lines[5]["before"], "v1");
    assert_eq!(lines[5]["after"], "v1");
    assert_eq!(
        gw.metric("tollgate_admin_actions_total{action=\"reload\",result=\"refused\"}"),
        4.0
    );
    assert_eq!(
        gw.metric("tollgate_admin_actions_total{action=\"reload\",result=\"ok\"}"),
        1.0
    );

    // On the memory store a revocation is this instance's, at once.
    let revoke = br#"{"credential": "c1", "expires_in_s": 60, "reason": "leaked"}"#;
    let r = request_with_body(
        gw.admin,
        "POST",
        "/admin/revocations",
        &[oncall, json],
        revoke,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(
        gw.get("/limited", &[("authorization", "Bearer k1")]).status,
        401
    );
    assert_eq!(
        gw.get("/limited", &[("authorization", "Bearer k2")]).status,
        200
    );
    let r = request_with_body(
        gw.admin,
        "DELETE",
        "/admin/revocations/c1",
        &[oncall, json],
        b"",
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        gw.get("/limited", &[("authorization", "Bearer k1")]).status,
        200
    );
    let lines = std::fs::read_to_string(&audit).unwrap();
    assert!(lines.contains("\"action\":\"revoke\"") && lines.contains("\"action\":\"unrevoke\""));
}

#[test]
fn sigterm_stops_accepting_and_lets_requests_in_flight_finish() {
    let slow = Upstream::slow(Duration::from_millis(800));
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1, shutdown_grace_seconds: 30 }}
upstreams:
  api: {{ servers: ["{}"] }}
routes:
  - {{ name: api, path: "/**", auth: none, upstream: api }}
"#,
        slow.addr
    );
    let mut gw = Gateway::start(&policy, None);
    let addr = gw.addr;
    let in_flight = thread::spawn(move || get(addr, "/slow/work", &[]).status);
    assert!(eventually(Duration::from_secs(2), || slow
        .state
        .in_flight
        .load(Ordering::SeqCst)
        == 1));
    gw.signal("-TERM");
    // At once: not ready, and no new connections, while the request runs.
    assert!(
        eventually(Duration::from_secs(2), || get(gw.admin, "/readyz", &[])
            .status
            == 503),
        "readiness turns 503 during the drain"
    );
    assert!(
        eventually(Duration::from_secs(2), || TcpStream::connect(addr).is_err()),
        "the listener closed"
    );
    assert_eq!(
        in_flight.join().unwrap(),
        200,
        "the request in flight finished"
    );
    // Then the process goes as soon as nothing is in flight: well before
    // the 30 s grace.
    let status = gw
        .wait_exit(Duration::from_secs(5))
        .expect("exits once the requests in flight finished, not after the grace");
    assert!(status.success(), "{status:?}");
}

#[test]
fn an_idle_gateway_exits_at_once_on_sigterm() {
    let policy = r#"
version: 1
server: { listen: ["{listen}"], admin_listen: "{admin}", threads: 1, shutdown_grace_seconds: 30 }
routes:
  - { name: ok, path: "/**", auth: none, respond: { status: 200 } }
"#;
    let mut gw = Gateway::start(policy, None);
    assert_eq!(gw.get("/x", &[]).status, 200);
    gw.signal("-TERM");
    let status = gw
        .wait_exit(Duration::from_secs(5))
        .expect("nothing in flight: no wait for the 30 s grace");
    assert!(status.success(), "{status:?}");
}

/// A SIGHUP sent the moment the gateway accepts its first connection (a
/// deploy script's reload right after a start) is a reload: the handler is
/// in place before any listener opens. It used to be installed by a
/// background service that could start after the listeners, and a SIGHUP
/// in between ended the process (the signal's default action).
#[test]
fn a_sighup_as_soon_as_the_gateway_accepts_is_a_reload() {
    let policy = "version: 1\nserver: { listen: [\"{listen}\"], admin_listen: \"{admin}\" }\n\
                  routes:\n  - { name: r, path: /, respond: { status: 200 } }\n";
    for round in 0..5 {
        let mut gw = Gateway::launch(policy, None, &[]);
        assert!(
            eventually(Duration::from_secs(20), || TcpStream::connect(gw.addr)
                .is_ok()),
            "round {round}: the gateway never listened: {}",
            gw.log()
        );
        gw.signal("-HUP");
        let reloaded = eventually(Duration::from_secs(20), || {
            TcpStream::connect(gw.admin).is_ok()
                && gw.metric("tollgate_config_reloads_total{result=\"ok\"}") == 1.0
        });
        let alive = gw.wait_exit(Duration::from_millis(50)).is_none();
        assert!(alive, "round {round}: the SIGHUP ended the gateway");
        assert!(reloaded, "round {round}: the SIGHUP was no reload");
    }
}
