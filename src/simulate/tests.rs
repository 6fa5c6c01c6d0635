//! A log with a known shape, replayed: the refusals are exactly those the
//! algorithms predict.

use std::io::Cursor;
use std::time::Duration;

use super::*;

const POLICY: &str = r#"
version: 1
auth:
  keys:
    - { id: c1, tenant: acme, sha256: "DIGEST" }
limits:
  per-tenant: { key: [tenant], capacity: 10, refill_per_second: 1 }
  watch: { key: [tenant], capacity: 5, refill_per_second: 1, mode: shadow }
routes:
  - { name: api, path: "/v1/**", respond: { status: 200 }, limits: [per-tenant, watch] }
"#;

fn policy() -> Policy {
    policy_with_capacity(10)
}

/// [`POLICY`] with `per-tenant` holding `capacity`.
fn policy_with_capacity(capacity: u32) -> Policy {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    let digest = hex::encode(crate::identity::auth::digest(b"key-c1"));
    let text = POLICY
        .replace("DIGEST", &digest)
        .replace("capacity: 10", &format!("capacity: {capacity}"));
    std::fs::write(&file, text).unwrap();
    crate::config::load(&file).unwrap()
}

/// Replays `log`, this gateway's JSON lines, against each of `sims`.
fn replay(log: String, sims: &mut [Simulation]) {
    run(Cursor::new(log), &LogReader::default(), sims, None, None).unwrap();
}

/// A line of the gateway's access log at `ms` after 2025-12-01T00:00:00Z.
fn line(ms: u64, credential: Option<&str>, path: Option<&str>) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(1_764_547_200_000 + ms);
    serde_json::json!({
        "time": humantime::format_rfc3339_millis(at).to_string(),
        "policy_version": "old", "method": "GET", "host": "api.test", "path": path,
        "route": "api", "status": 200, "outcome": "allowed", "tenant": null,
        "credential": credential, "client": "203.0.113.7/32", "cost": 1, "violated": [],
        "upstream": null, "duration_ms": 1.0, "bytes_in": 0, "bytes_out": 2,
    })
    .to_string()
}

#[test]
fn a_burst_is_refused_exactly_where_the_bucket_runs_out() {
    let mut log = String::new();
    // A minute at one request a second: the refill keeps up.
    for s in 0..60 {
        log += &line(s * 1_000, Some("c1"), Some("/v1/x"));
        log.push('\n');
    }
    // At minute 2, thirty requests within the same second: the bucket,
    // full again, admits ten.
    for i in 0..30 {
        log += &line(120_000 + i, Some("c1"), Some("/v1/x"));
        log.push('\n');
    }
    // A request with a key the policy does not know, one without a path,
    // and a line that is not JSON.
    log += &line(200_000, Some("nobody"), Some("/v1/x"));
    log += "\n";
    log += &line(200_001, Some("c1"), None);
    log += "\nnot json\n";

    let mut sims = [Simulation::new(policy())];
    replay(log, &mut sims);
    let sim = &sims[0];
    assert_eq!(sim.replayed, 91);
    assert_eq!(sim.skipped, 2);
    let tenant = sim.limits["per-tenant"];
    assert_eq!(tenant.admitted, (70, 70));
    assert_eq!(tenant.refused, (20, 20));
    assert_eq!(sim.callers["acme"].refused, (20, 20));
    // The unknown key is refused before its tenant's limits.
    assert_eq!(sim.callers["203.0.113.7/32"].refused, (1, 1));
    // The shadow limit (5, 1/s) would have refused 25 of the burst.
    assert_eq!(sim.limits["watch"].flagged.0, 25);
    let minute = (1_764_547_200_000 + 120_000) / 60_000;
    assert_eq!(sim.peak_minute(), Some((minute, 20)));
    let text = report("old", sim, 5);
    assert!(
        text.contains("peak refusal minute: 2025-12-01T00:02:00Z (20 refused)"),
        "{text}"
    );
}

#[test]
fn two_policies_show_who_gains_and_who_loses() {
    let mut log = String::new();
    for i in 0..30 {
        log += &line(i, Some("c1"), Some("/v1/x"));
        log.push('\n');
    }
    let strict = policy();
    let lenient = policy_with_capacity(25);
    let mut sims = [Simulation::new(strict), Simulation::new(lenient)];
    replay(log, &mut sims);
    assert_eq!(sims[0].callers["acme"].refused.0, 20);
    assert_eq!(sims[1].callers["acme"].refused.0, 5);
    let diff = difference(&sims[0], &sims[1], 5);
    assert!(
        diff.contains("acme") && diff.contains("-15") && diff.contains("gains"),
        "{diff}"
    );
    let page = html::page(&["strict".into(), "lenient".into()], &sims, 5);
    assert!(
        page.contains("<h2>Refused cost under lenient against strict</h2>")
            && page.contains("<tr><td>acme</td><td class=n>-15</td><td>gains</td></tr>"),
        "{page}"
    );
}

#[test]
fn a_time_window_limits_the_replay() {
    let log: String = (0..10)
        .map(|s| line(s * 60_000, Some("c1"), Some("/v1/x")) + "\n")
        .collect();
    let start = UNIX_EPOCH + Duration::from_millis(1_764_547_200_000);
    let mut sims = [Simulation::new(policy())];
    let from = start + Duration::from_secs(120);
    let to = start + Duration::from_secs(300);
    run(
        Cursor::new(log),
        &LogReader::default(),
        &mut sims,
        Some(from),
        Some(to),
    )
    .unwrap();
    assert_eq!(sims[0].replayed, 3);
}

#[test]
fn the_html_report_stands_alone_and_escapes_names() {
    let mut log = String::new();
    for i in 0..30 {
        log += &line(120_000 + i, Some("c1"), Some("/v1/x"));
        log.push('\n');
    }
    let mut sims = [Simulation::new(policy())];
    replay(log, &mut sims);
    let page = html::page(&["<old>".to_string()], &sims, 5);
    assert!(page.starts_with("<!doctype html>"));
    assert!(page.contains("&lt;old&gt;") && !page.contains("<old>"));
    assert!(page.contains("<polyline"), "a chart per limit and tenant");
    assert!(page.contains("<b>per-tenant</b>: 20 refused"), "{page}");
    assert!(page.contains("<b>acme</b>: 20 refused"), "{page}");
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "nothing fetched"
    );
}

/// A `combined` line at `second` after 2025-12-01T00:00:00Z, written with a
/// +01:00 offset, the credential id in a `cred=` field after a user agent
/// that names another.
fn combined(second: u64, client: &str, target: &str, cred: &str) -> String {
    let (h, m, s) = (1 + second / 3600, second / 60 % 60, second % 60);
    format!(
        "{client} - - [01/Dec/2025:{h:02}:{m:02}:{s:02} +0100] \"GET {target} HTTP/1.1\" 200 2 \
         \"-\" \"probe cred=c9 (X11)\" cred={cred} rt=0.001\n"
    )
}

#[test]
fn a_combined_log_replays_like_the_gateway_s_own() {
    let mut log = String::new();
    for s in 0..60 {
        log += &combined(s, "203.0.113.7", "/v1/x", "c1");
    }
    // The burst, its targets written as the edge would normalize them.
    for i in 0..30 {
        let target = ["/v1/x", "//v1//x?page=2", "/v1/%78"][i % 3];
        log += &combined(120, "203.0.113.7", target, "\"c1\"");
    }
    // No credential from an IPv6 client; a target the edge refuses; a line
    // that is not `combined`.
    log += &combined(200, "2001:db8::1", "/v1/x", "-");
    log += &combined(201, "203.0.113.7", "/v1/../../etc/passwd", "c1");
    log += "GET /v1/x\n";
    let reader = LogReader {
        format: LogFormat::Combined,
        key_field: Some("cred".into()),
    };
    let mut sims = [Simulation::new(policy())];
    run(Cursor::new(log), &reader, &mut sims, None, None).unwrap();
    let sim = &sims[0];
    assert_eq!((sim.replayed, sim.skipped), (91, 2));
    assert_eq!(sim.limits["per-tenant"].refused, (20, 20));
    let minute = (1_764_547_200_000 + 120_000) / 60_000;
    assert_eq!(sim.peak_minute(), Some((minute, 20)));
    // Keyed as the policy keys IPv6 clients: by their /64.
    assert_eq!(sim.callers["2001:db8::/64"].refused, (1, 1));
}

#[test]
fn without_a_key_field_the_combined_caller_is_the_remote_user() {
    let line =
        "198.51.100.2 - c1 [01/Dec/2025:00:00:00 +0000] \"GET /v1/x HTTP/1.1\" 200 2 \"-\" \"-\"";
    let (parsed, at) = LogReader {
        format: LogFormat::Combined,
        key_field: None,
    }
    .parse(line)
    .unwrap();
    assert_eq!(at, 1_764_547_200_000);
    assert_eq!(parsed.credential.as_deref(), Some("c1"));
    assert_eq!(parsed.target.as_deref(), Some("/v1/x"));
    assert_eq!(
        "nginx".parse::<LogFormat>().unwrap_err(),
        "unknown log format \"nginx\" (tollgate, combined)"
    );
}

#[test]
fn a_json_key_field_names_the_member_holding_the_credential() {
    let text = line(0, Some("c9"), Some("/v1/x"))
        .replace("\"bytes_in\"", "\"caller\":\"c1\",\"bytes_in\"");
    let reader = LogReader {
        format: LogFormat::Tollgate,
        key_field: Some("caller".into()),
    };
    assert_eq!(
        reader.parse(&text).unwrap().0.credential.as_deref(),
        Some("c1")
    );
}

#[test]
fn jwt_callers_are_replayed_as_their_lines_name_them() {
    // Thirty requests at once from a JWT caller of tenant acme: not in the
    // policy's keys, yet limited as its tenant, as the gateway limited it.
    let mut log = String::new();
    for i in 0..30 {
        let mut l: serde_json::Value =
            serde_json::from_str(&line(i, Some("jwt:main:alice"), Some("/v1/x"))).unwrap();
        l["tenant"] = "acme".into();
        l["auth_source"] = "jwt".into();
        log += &l.to_string();
        log.push('\n');
    }
    // The same caller without a source is unknown to the policy: no tenant.
    log += &line(40, Some("jwt:main:alice"), Some("/v1/x"));
    log.push('\n');
    let mut sims = [Simulation::new(policy())];
    replay(log, &mut sims);
    assert_eq!(sims[0].callers["acme"].refused.0, 20);
}

/// A line of [`line`]'s shape for credential c1, ending at `end_ms` after
/// `duration_ms` (none: the field left out).
fn timed(end_ms: u64, duration_ms: Option<f64>) -> String {
    let mut v: serde_json::Value =
        serde_json::from_str(&line(end_ms, Some("c1"), Some("/v1/x"))).unwrap();
    match duration_ms {
        Some(d) => v["duration_ms"] = d.into(),
        None => {
            v.as_object_mut().unwrap().remove("duration_ms");
        }
    }
    v.to_string() + "\n"
}

/// The example policy with a concurrency limit of one request in flight.
fn one_in_flight() -> Policy {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    let digest = hex::encode(crate::identity::auth::digest(b"key-c1"));
    let text = POLICY.replace("DIGEST", &digest).replace(
        "  watch:",
        "  inflight: { key: [tenant], algorithm: concurrency, max_in_flight: 1 }\n  watch:",
    );
    let text = text.replace(
        "limits: [per-tenant, watch]",
        "limits: [per-tenant, inflight]",
    );
    std::fs::write(&file, text).unwrap();
    crate::config::load(&file).unwrap()
}

#[test]
fn holds_are_modelled_from_each_lines_start_and_end() {
    // Logged as they ended: two short requests (1-2 s, 3-4 s) inside a
    // long one (0-5 s), then one after it (6-7 s). Replayed by start, the
    // long one holds the only unit and both short ones are refused (by
    // end, each short one would have gone first).
    let log = [
        timed(2_000, Some(1_000.0)),
        timed(4_000, Some(1_000.0)),
        timed(5_000, Some(5_000.0)),
        timed(7_000, Some(1_000.0)),
    ]
    .concat();
    let mut sims = [Simulation::new(one_in_flight())];
    replay(log, &mut sims);
    let inflight = sims[0].limits["inflight"];
    assert_eq!((inflight.admitted.0, inflight.refused.0), (2, 2));
    assert_eq!(sims[0].undated, 0);
    let report = report("p", &sims[0], 5);
    assert!(
        report.contains("held from its start (time - duration_ms)"),
        "{report}"
    );
    assert!(!report.contains("cannot be modelled"), "{report}");
}

#[test]
fn a_log_without_durations_says_holds_cannot_be_modelled() {
    let log = [timed(1_000, None), timed(1_500, None)].concat();
    let mut sims = [Simulation::new(one_in_flight())];
    replay(log, &mut sims);
    assert_eq!(sims[0].undated, 2);
    let report = report("p", &sims[0], 5);
    assert!(
        report.contains("concurrency limits cannot be modelled for 2 lines without duration_ms"),
        "{report}"
    );
}
