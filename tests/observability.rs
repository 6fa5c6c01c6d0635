//! What ships for monitoring: the alerting rules of `deploy/prometheus`
//! load and pass their unit tests under `promtool`, name only series the
//! gateway exports, and the upstream answers they alert on are counted.

mod support;

use std::collections::BTreeSet;
use std::process::Command;

use support::{Gateway, Upstream};

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .output()
        .expect("promtool (Debian's prometheus package; `make deps` installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn the_alerting_rules_load_and_pass_their_unit_tests() {
    let checked = promtool(&["check", "rules", "deploy/prometheus/alerts.yaml"]);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(&["test", "rules", "deploy/prometheus/alerts.test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // The example scrape configuration, with the rules it loads.
    let config = promtool(&["check", "config", "deploy/prometheus/prometheus.yaml"]);
    assert!(config.contains("is valid prometheus config"), "{config}");
}

/// The `tollgate_*` names in `text`.
fn names(text: &str) -> BTreeSet<String> {
    names_with(text, "tollgate_")
}

/// The names in `text` that start with `prefix`.
fn names_with(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        out.insert(name);
    }
    out
}

#[test]
fn every_rule_and_test_names_a_series_the_gateway_registers() {
    let registered = names(&std::fs::read_to_string("src/metrics.rs").unwrap());
    for file in [
        "deploy/prometheus/alerts.yaml",
        "deploy/prometheus/alerts.test.yaml",
    ] {
        let named = names(&std::fs::read_to_string(file).unwrap());
        assert!(!named.is_empty());
        for name in named {
            // Histograms are named by their family.
            let family = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_count")
                .trim_end_matches("_sum");
            assert!(
                registered.contains(family),
                "{file}: {name} is not a metric of the gateway"
            );
        }
    }
}

#[test]
fn upstream_answers_are_counted_by_route_and_status_class() {
    let upstream = Upstream::start();
    let gw = Gateway::start(
        r#"
version: 1
server: { listen: ["{listen}"], admin_listen: "{admin}" }
upstreams:
  api: { servers: ["{upstream}"], retries: 0 }
routes:
  - { name: api, path: "/**", auth: none, upstream: api }
"#,
        Some(&upstream),
    );
    assert_eq!(gw.get("/ok", &[]).status, 200);
    assert_eq!(gw.get("/ok", &[]).status, 200);
    assert_eq!(gw.get("/fail", &[]).status, 502);
    let count = |class: &str| {
        gw.metric(&format!(
            "tollgate_upstream_responses_total{{class=\"{class}\",route=\"api\"}}"
        ))
    };
    assert!(support::eventually(
        std::time::Duration::from_secs(5),
        || { count("2xx") == 2.0 && count("error") == 1.0 }
    ));
}

#[test]
fn a_fresh_gateway_exports_every_family_the_rules_read() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let gw = Gateway::start(
        &format!(
            r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", access_log: {{ path: "{}" }} }}
limits:
  per-ip: {{ key: [ip], capacity: 10, refill_per_second: 1 }}
  inflight: {{ key: [ip], algorithm: concurrency, max_in_flight: 10 }}
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: api, path: "/**", auth: none, upstream: api, limits: [per-ip, inflight] }}
"#,
            dir.path().join("access.log").display()
        ),
        Some(&upstream),
    );
    // No request yet: every series an alert reads is there, at zero.
    let exported = gw.metrics();
    let rules = std::fs::read_to_string("deploy/prometheus/alerts.yaml").unwrap();
    for family in names(&rules) {
        assert!(
            exported
                .lines()
                .any(|l| l.starts_with(&family) && !l.starts_with('#')),
            "{family} is not exported before traffic"
        );
    }
    for series in [
        "tollgate_requests_total{outcome=\"auth_unavailable\",route=\"api\"} 0",
        "tollgate_limit_decisions_total{limit=\"per-ip\",outcome=\"fail_open\"} 0",
        "tollgate_upstream_responses_total{class=\"5xx\",route=\"api\"} 0",
        "tollgate_pool_rejections_total{pool=\"api\",priority=\"critical\"} 0",
        "tollgate_config_reloads_total{result=\"error\"} 0",
    ] {
        assert!(exported.lines().any(|l| l == series), "{series}");
    }
}

/// Every query of the dashboard, its template variables substituted as
/// Grafana would with "All" selected.
fn dashboard_queries() -> Vec<String> {
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("deploy/grafana/tollgate.json").unwrap())
            .unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        // label_values(SELECTOR, label): the selector is a query of its own.
        if let Some(inner) = var["definition"]
            .as_str()
            .and_then(|d| d.strip_prefix("label_values("))
            .and_then(|d| d.rsplit_once(',').map(|(selector, _)| selector.to_owned()))
        {
            queries.push(inner);
        }
    }
    queries
        .into_iter()
        .map(|q| {
            q.replace("$__rate_interval", "1m")
                .replace("$__range", "1h")
                .replace("$instance", ".*")
                .replace("$route", ".*")
                .replace("$limit", ".*")
                .replace("$pool", ".*")
        })
        .collect()
}

#[test]
fn the_dashboard_covers_every_family_and_names_only_series_a_gateway_exports() {
    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "{} queries", queries.len());
    // Each query as a recording rule, for promtool to parse.
    let dir = tempfile::tempdir().unwrap();
    let rules: Vec<serde_json::Value> = queries
        .iter()
        .enumerate()
        .map(|(i, q)| serde_json::json!({ "record": format!("dashboard:query_{i}"), "expr": q }))
        .collect();
    let file = dir.path().join("dashboard.rules.json.yaml");
    let doc = serde_json::json!({ "groups": [{ "name": "dashboard", "rules": rules }] });
    std::fs::write(&file, doc.to_string()).unwrap();
    let checked = promtool(&["check", "rules", file.to_str().unwrap()]);
    assert!(
        checked.contains(&format!("{} rules found", queries.len())),
        "{checked}"
    );

    // A gateway after a short exercise exports every series named: with a
    // leased limit on Redis and a route whose cost the response settles.
    let redis = support::redis_server::RedisServer::start();
    let upstream = Upstream::start();
    let gw = Gateway::start_with_env(
        &format!(
            r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}" }}
store: {}
limits:
  per-ip: {{ key: [ip], capacity: 2, refill_per_second: 0.001 }}
  shared: {{ key: [], capacity: 1000, refill_per_second: 100, sync: lease, lease: {{ units: 10, ttl_ms: 1000 }} }}
  inflight: {{ key: [], algorithm: concurrency, max_in_flight: 100 }}
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - name: api
    path: "/**"
    auth: none
    upstream: api
    limits: [per-ip, shared, inflight]
    cost_from_response: {{ header: x-cost, max: 5 }}
"#,
            redis.store(500)
        ),
        Some(&upstream),
        &[("TOLLGATE_KEY_SECRET", "observability-secret")],
    );
    for _ in 0..3 {
        gw.get("/x", &[]);
    }
    let exported = gw.metrics();
    let all = queries.join("\n");
    let shown: BTreeSet<String> = names(&all)
        .into_iter()
        .chain(names_with(&all, "process_"))
        .map(|name| {
            name.trim_end_matches("_bucket")
                .trim_end_matches("_count")
                .trim_end_matches("_sum")
                .to_owned()
        })
        .collect();
    let mut missing = Vec::new();
    for family in &shown {
        if !exported
            .lines()
            .any(|l| l.starts_with(family.as_str()) && !l.starts_with('#'))
        {
            missing.push(family);
        }
    }
    assert!(missing.is_empty(), "not exported: {missing:?}");

    // And the other way round: every family the gateway exports is on the
    // dashboard (as docs/src/monitoring.md promises), with the process's
    // CPU, RSS and open fds.
    let families: BTreeSet<&str> = exported
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| name.starts_with("tollgate_"))
        .chain([
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
        ])
        .collect();
    assert!(families.len() > 30, "{families:?}");
    let absent: Vec<&&str> = families.iter().filter(|f| !shown.contains(**f)).collect();
    assert!(absent.is_empty(), "not on the dashboard: {absent:?}");
}
