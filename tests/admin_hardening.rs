//! The admin port under attack, through the real binary: a flood of
//! refused requests cannot fill the audit log, a valid token's failed
//! writes are each audited, idle or piled-up connections from one address
//! cannot lock another out, every error is a problem, and admin bodies and
//! tenants are read strictly.

mod support;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::time::Duration;

use support::{admin_call, connect, digest, eventually, status_of, Gateway};

const WRITE_TOKEN: &str = "hardening-oncall";

fn policy(audit: &std::path::Path) -> String {
    format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  threads: 2
  audit_log: {{ path: "{}" }}
  admin_tokens: [{{ name: oncall, sha256: "{}", role: write }}]
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 3, refill_per_second: 0.001 }}
  monthly: {{ algorithm: quota, key: [tenant], limit: 5, period: month }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200 }}, limits: [per-tenant, monthly] }}
"#,
        audit.display(),
        digest(WRITE_TOKEN),
        digest("key-c1")
    )
}

fn audit_lines(audit: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(audit)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// One request on a fresh connection from `from`, read to its end: the
/// status, or 0 when the connection closed without an answer.
fn status_from(gw: &Gateway, from: IpAddr, head: &str) -> u16 {
    let mut s = connect(gw.admin, Some(from));
    let _ = s.write_all(head.as_bytes());
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    status_of(&String::from_utf8_lossy(&out))
}

#[test]
fn a_flood_of_refused_writes_is_counted_but_written_ten_lines_a_second_each_cut_to_1_kib() {
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    let gw = Gateway::start(&policy(&audit), None);
    let long = format!("/admin/{}", "x".repeat(30_000));
    let started = tollgate::clock::instant();
    let sent: u32 = 200;
    for _ in 0..sent {
        let r = support::request(
            gw.admin,
            None,
            "POST",
            &long,
            &[("content-type", "application/json")],
        );
        assert_eq!(r.status, 401);
    }
    // The seconds the flood touched, each with at most 10 lines and one
    // saying how many were left out.
    let seconds = tollgate::clock::instant()
        .saturating_duration_since(started)
        .as_secs()
        + 2;
    let lines = audit_lines(&audit);
    assert!(
        lines.len() as u64 <= seconds * 11,
        "{} lines in {seconds} s",
        lines.len()
    );
    assert!(lines.iter().all(|l| l.len() <= 1024), "every line ≤ 1 KiB");
    assert_eq!(
        gw.metric("tollgate_admin_actions_total{action=\"unknown\",result=\"refused\"}"),
        f64::from(sent),
        "every refusal is counted"
    );
    // The count of those left out is written at the end of the second
    // that left them out, with no request after the flood: every refusal
    // is accounted for, written or counted in a `suppressed` line.
    let accounted = || {
        let lines: Vec<serde_json::Value> = audit_lines(&audit)
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let written = lines.iter().filter(|l| l["action"] != "suppressed").count() as u64;
        let left_out: u64 = lines
            .iter()
            .filter(|l| l["action"] == "suppressed")
            .map(|l| l["suppressed"].as_u64().unwrap())
            .sum();
        (written, left_out)
    };
    assert!(
        eventually(Duration::from_secs(10), || {
            let (written, left_out) = accounted();
            left_out > 0 && written + left_out == u64::from(sent)
        }),
        "{:?} of {sent}",
        accounted()
    );
    let cut: serde_json::Value = serde_json::from_str(&audit_lines(&audit)[0]).unwrap();
    let path = cut["target"]["path"].as_str().unwrap();
    assert!(
        path.starts_with("/admin/xxx") && path.ends_with("…[cut]"),
        "{path}"
    );
}

#[test]
fn every_attempt_by_a_valid_token_is_audited_failures_included() {
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    let gw = Gateway::start(&policy(&audit), None);
    let attempts = [
        ("POST", "/admin/nothing", "{}", 404),
        ("POST", "/admin/reset", r#"{"limit": "nope"}"#, 404),
        ("POST", "/admin/reset", "not json", 400),
        ("PATCH", "/admin/reset", "{}", 405),
        ("DELETE", "/admin/overrides/ghost", "", 404),
        (
            "PUT",
            "/admin/overrides/acme",
            r#"{"expires_in_s": 0}"#,
            400,
        ),
        // Reads that failed are attempts too.
        ("GET", "/admin/nothing", "", 404),
        ("GET", "/admin/reload", "", 405),
        ("GET", "/admin/usage?limit=nope&tenant=acme", "", 404),
    ];
    for (method, path, body, status) in attempts {
        let r = admin_call(&gw, method, path, WRITE_TOKEN, body);
        assert_eq!(r.status, status, "{method} {path}: {}", r.body);
    }
    let lines: Vec<serde_json::Value> = audit_lines(&audit)
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), attempts.len(), "{lines:?}");
    for (line, (method, path, _, status)) in lines.iter().zip(attempts) {
        assert_eq!(line["actor"], "oncall");
        assert_eq!(line["result"], "rejected", "{line}");
        assert_eq!(line["target"]["method"], method);
        assert_eq!(line["target"]["path"], path.split('?').next().unwrap());
        assert_eq!(line["after"]["status"], status);
        assert!(line["after"]["detail"].is_string(), "{line}");
    }
    assert_eq!(
        gw.metric("tollgate_admin_actions_total{action=\"reset\",result=\"rejected\"}"),
        3.0
    );
    assert_eq!(
        gw.metric("tollgate_admin_actions_total{action=\"read\",result=\"rejected\"}"),
        3.0
    );
    // A read that succeeds is not an attempt to change anything.
    let r = admin_call(&gw, "GET", "/admin/top", WRITE_TOKEN, "");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(audit_lines(&audit).len(), attempts.len());
}

#[test]
fn idle_and_piled_up_connections_from_one_address_never_lock_out_another() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&policy(&dir.path().join("audit.jsonl")), None);
    let flooder = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1));
    let idle: Vec<TcpStream> = (0..300).map(|_| connect(gw.admin, Some(flooder))).collect();
    // Another address is answered at once, not once the flood idles out.
    let probe = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    assert_eq!(
        status_from(
            &gw,
            probe,
            "GET /readyz HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
        ),
        200
    );
    // The server closes every one: those beyond the address's share at
    // once, the others when they idle out.
    for mut s in idle {
        let mut buf = [0u8; 64];
        assert!(matches!(s.read(&mut buf), Ok(0)), "closed by the server");
    }
    let rejected = |reason: &str| {
        gw.metric(&format!(
            "tollgate_connections_rejected_total{{listener=\"admin\",reason=\"{reason}\"}}"
        ))
    };
    assert!(rejected("max_connections_per_ip") >= 1.0);
    assert!(
        eventually(Duration::from_secs(10), || rejected(
            "max_connections_per_ip"
        ) + rejected("header_timeout")
            == 300.0),
        "each refused for its address or closed idle: {}",
        gw.metrics()
    );
}

#[test]
fn an_idle_admin_connection_is_closed_by_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&policy(&dir.path().join("audit.jsonl")), None);
    let from = Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3)));
    // A connection that never asks.
    let mut silent = connect(gw.admin, from);
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 64];
    assert!(matches!(silent.read(&mut buf), Ok(0)), "closed unasked");
    // A kept-alive connection after its answer.
    let mut kept = connect(gw.admin, from);
    kept.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        .unwrap();
    let mut out = Vec::new();
    assert!(kept.read_to_end(&mut out).is_ok(), "closed after idling");
    assert_eq!(status_of(&String::from_utf8_lossy(&out)), 200);
}

#[test]
fn admin_errors_are_problems_and_bodies_and_tenants_are_read_strictly() {
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    let gw = Gateway::start(&policy(&audit), None);
    let token = format!("Bearer {WRITE_TOKEN}");
    for (query, status) in [
        ("", 400),
        ("limit=nope&tenant=acme", 404),
        ("limit=per-tenant&tenant=acme", 400),
        ("limit=monthly", 400),
    ] {
        let r = support::get(
            gw.admin,
            &format!("/admin/usage?{query}"),
            &[("authorization", &token)],
        );
        assert_eq!(r.status, status, "{query}: {}", r.body);
        assert_eq!(
            r.header("content-type"),
            Some("application/problem+json"),
            "{query}"
        );
        assert_eq!(r.json()["status"], status);
        if status == 404 {
            assert_eq!(r.json()["type"], "urn:tollgate:problem:admin-not-found");
        }
    }

    // A name given twice: serde_json would keep the last without a word.
    let limit = r#"{"capacity": 6, "refill_per_second": 0.001}"#;
    let twice = [
        format!(
            r#"{{"limits": {{"per-tenant": {limit}, "per-tenant": {limit}}}, "expires_in_s": 60, "reason": "r"}}"#
        ),
        r#"{"limits": {"per-tenant": {"capacity": 6, "capacity": 600, "refill_per_second": 0.001}}, "expires_in_s": 60, "reason": "r"}"#.to_string(),
    ];
    for body in &twice {
        let r = admin_call(&gw, "PUT", "/admin/overrides/acme", WRITE_TOKEN, body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        assert!(r.json()["detail"].as_str().unwrap().contains("twice"));
    }
    // A tenant is printable ASCII, 1 to 256 bytes, as a credential's.
    let once =
        format!(r#"{{"limits": {{"per-tenant": {limit}}}, "expires_in_s": 60, "reason": "r"}}"#);
    let long = "t".repeat(5_000);
    for tenant in ["a%0Ab", "%00", "a%0D%0Ab", long.as_str()] {
        let path = format!("/admin/overrides/{tenant}");
        let r = admin_call(&gw, "PUT", &path, WRITE_TOKEN, &once);
        assert_eq!(r.status, 400, "{tenant:.20}: {}", r.body);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
    }
    let r = admin_call(&gw, "PUT", "/admin/overrides/acme", WRITE_TOKEN, &once);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(audit_lines(&audit).iter().all(|l| l.len() <= 1024));

    // Nothing there is a 404 of one problem type, whatever the endpoint; a
    // collection's prefix is taken off once, so a repeated one names no
    // item.
    for path in [
        "/admin/overrides/nobody",
        "/admin/overrides//admin/overrides/acme",
    ] {
        let r = admin_call(&gw, "DELETE", path, WRITE_TOKEN, "");
        assert_eq!(r.status, 404, "{path}: {}", r.body);
        assert_eq!(r.json()["type"], "urn:tollgate:problem:admin-not-found");
    }
}

#[test]
fn the_probes_answer_without_a_token_and_reveal_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(&policy(&dir.path().join("audit.jsonl")), None);
    let version = gw.metrics();
    let version = version
        .lines()
        .find_map(|l| l.strip_prefix("tollgate_config_info{policy_version=\""))
        .and_then(|rest| rest.split('"').next())
        .expect("the policy's version is in the metrics")
        .to_owned();
    for (path, body) in [("/readyz", "ready"), ("/healthz", "ok")] {
        let r = support::get(gw.admin, path, &[]);
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.body.trim(), body, "{path}");
        assert!(!r.body.contains(&version), "{path}: {}", r.body);
    }
}
