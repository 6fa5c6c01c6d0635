//! `tollgate check` on the example policies and on one fixture per failure
//! mode, each asserting the exact message operators see.

use std::process::Command;

fn check(file: &str) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config", file])
        .output()
        .expect("run tollgate check");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn example_policies_are_valid() {
    for file in ["config/quickstart.yaml", "config/production.yaml"] {
        let (code, stdout, stderr) = check(file);
        assert_eq!(code, 0, "{file}: {stderr}");
        assert!(stdout.starts_with(&format!("{file}: policy ")), "{stdout}");
        assert!(stdout.contains(" ok: "), "{stdout}");
    }
}

const FIXTURES: &[(&str, &str)] = &[
    ("unknown_field", "tests/config/unknown_field.yaml:6:5: unknown key limtis at routes[0]; did you mean limits?"),
    ("unknown_algorithm", "tests/config/unknown_algorithm.yaml:3:43: limits.per-tenant.algorithm: unknown variant `leaky_bucket`, expected one of `token_bucket`, `gcra`, `fixed_window`, `sliding_window`, `sliding_log`, `quota`, `concurrency`"),
    ("yaml_syntax", "tests/config/yaml_syntax.yaml:4:1: did not find expected ',' or '}' at line 4 column 1, while parsing a flow mapping at line 3 column 5"),
    ("dangling_limit", "tests/config/dangling_limit.yaml: routes[0].limits[1]: unknown limit \"per-tenat\"; did you mean \"per-tenant\"?"),
    ("dangling_upstream", "tests/config/dangling_upstream.yaml: routes[0].upstream: unknown upstream \"apii\"; did you mean \"api\"?"),
    ("dangling_plan_limit", "tests/config/dangling_plan_limit.yaml: plans.pro.per-tenat: unknown limit \"per-tenat\"; did you mean \"per-tenant\"?"),
    ("dangling_key_plan", "tests/config/dangling_key_plan.yaml: auth.keys[0].plan: unknown plan \"enterprise\""),
    ("non_finite", "tests/config/non_finite.yaml: limits.per-tenant.capacity: must be a finite number, got inf"),
    ("out_of_range", "tests/config/out_of_range.yaml: limits.per-tenant.capacity: must be at most 1000000000, got 2000000000"),
    ("negative_rate", "tests/config/negative_rate.yaml: limits.per-tenant.refill_per_second: must be positive, got -1"),
    ("sliding_log_too_large", "tests/config/sliding_log_too_large.yaml: limits.exact.limit: must be at most 10000, got 20000"),
    ("wrong_parameters", "tests/config/wrong_parameters.yaml: limits.per-tenant: `capacity` does not apply to sliding_window; it takes `limit` and `window_seconds`\ntests/config/wrong_parameters.yaml: limits.per-tenant: missing `limit`"),
    ("cost_exceeds_capacity", "tests/config/cost_exceeds_capacity.yaml: routes[0].limits[0]: route cost 11 exceeds the capacity 10 of limit \"per-tenant\": it could never be admitted"),
    ("cost_exceeds_value_capacity", "tests/config/cost_exceeds_value_capacity.yaml: routes[0].limits[0]: route cost 10 exceeds the capacity 5 of limit \"per-model\" (values \"small\"): it could never be admitted"),
    ("cost_exceeds_plan_capacity", "tests/config/cost_exceeds_plan_capacity.yaml: routes[0].limits[0]: route cost 5 exceeds the capacity 4 of limit \"per-tenant\" (plan \"free\"): it could never be admitted"),
    ("duplicate_route", "tests/config/duplicate_route.yaml: routes[1].name: duplicate route name \"r\""),
    ("duplicate_limit", "tests/config/duplicate_limit.yaml:3:3: limits: duplicate name \"per-tenant\""),
    ("duplicate_credential", "tests/config/duplicate_credential.yaml: auth: duplicate credential id \"ci\""),
    ("bad_digest", "tests/config/bad_digest.yaml: auth.keys[0].sha256: must be 64 hex digits (the SHA-256 of the raw key; see `tollgate hash-key`)"),
    ("bad_template", "tests/config/bad_template.yaml: routes[0].path: \"**\" may only be the last segment"),
    ("pre_auth_by_tenant", "tests/config/pre_auth_by_tenant.yaml: limits.guard.key: a pre_auth limit runs before authentication: its key may only use ip and route"),
    ("bad_network", "tests/config/bad_network.yaml: client_ip.trusted_proxies[0]: \"10.0.0.0/33\" is not an IP network"),
    ("upstream_and_respond", "tests/config/upstream_and_respond.yaml: routes[0]: a route has either `upstream` or `respond`, not both"),
    ("unsupported_version", "tests/config/unsupported_version.yaml: version: unsupported version 2 (expected 1)"),
    ("missing_keys_file", "tests/config/missing_keys_file.yaml: auth.keys_file: cannot read tests/config/no-such-keys.yaml: No such file or directory (os error 2)"),
    ("redis_without_urls", "tests/config/redis_without_urls.yaml: store.urls: backend redis needs at least one url"),
    ("redis_several_urls", "tests/config/redis_several_urls.yaml: store.urls: backend redis takes one url, got 2; several seed nodes are for redis_cluster"),
    ("unauthenticated_tenant_limit", "tests/config/unauthenticated_tenant_limit.yaml: routes[0].limits[0]: limit \"per-tenant\" is keyed by credential or tenant but the route has `auth: none`"),
    ("respond_bad_status", "tests/config/respond_bad_status.yaml: routes[0].respond.status: must be between 200 and 599, got 101"),
    ("respond_no_content_body", "tests/config/respond_no_content_body.yaml: routes[0].respond.body: status 204 has no body"),
    ("respond_content_type_control", "tests/config/respond_content_type_control.yaml: routes[0].respond.content_type: must be a header value without control characters"),
    ("too_deep", "tests/config/too_deep.yaml: nested deeper than 64 levels"),
    ("forward_auth_bad", "tests/config/forward_auth_bad.yaml: auth.forward_auth.headers[1]: \"bad header\" is not a header name\ntests/config/forward_auth_bad.yaml: auth.forward_auth.max_in_flight: must be between 1 and 100000, got 0\ntests/config/forward_auth_bad.yaml: auth.forward_auth.url: must be http:// or https://"),
    ("store_keys_bad", "tests/config/store_keys_bad.yaml: auth.store_keys.cache_entries: must be between 1 and 100000000, got 0\ntests/config/store_keys_bad.yaml: auth.store_keys.negative_ttl_s: must be between 0 and 3600, got 4000"),
    ("queue_per_tenant_zero", "tests/config/queue_per_tenant_zero.yaml: upstreams.api.queue.per_tenant_max: must be between 1 and 1000000, got 0"),
    ("bad_timeout", "tests/config/bad_timeout.yaml: server.timeouts.header_read_ms: must be between 1 and 3600000, got 0"),
    ("sentinel_without_master", "tests/config/sentinel_without_master.yaml: store.master_name: backend redis_sentinel needs the primary's name at the sentinels"),
    ("master_name_without_sentinel", "tests/config/master_name_without_sentinel.yaml: store.master_name: is for backend redis_sentinel, not redis"),
    ("concurrency_bad", "tests/config/concurrency_bad.yaml: limits.delayed.hold_ttl_ms: must be between 1000 and 3600000, got 500\ntests/config/concurrency_bad.yaml: limits.delayed.on_limit: a concurrency limit admits when a request ends, which no wait can foretell: use on_limit: reject (429 with Retry-After: 1), or a pool's queue\ntests/config/concurrency_bad.yaml: limits.inflight: `capacity` does not apply to concurrency; it takes `max_in_flight` and `hold_ttl_ms`\ntests/config/concurrency_bad.yaml: limits.inflight.max_in_flight: must be between 1 and 1000000, got 0\ntests/config/concurrency_bad.yaml: limits.leased.sync: a concurrency limit's hold is one request in flight, taken and released with it: it cannot be leased ahead, use sync: exact\ntests/config/concurrency_bad.yaml: limits.rate: `max_in_flight` does not apply to token_bucket; it is for concurrency\ntests/config/concurrency_bad.yaml: plans.pro.leased.hold_ttl_ms: a plan changes a concurrency limit's max_in_flight; its hold_ttl_ms is the limit's"),
    ("lease_on_sliding_log", "tests/config/lease_on_sliding_log.yaml: limits.exact.sync: a sliding_log records the time of each admission, and a lease spends units later than the store charged them: use sliding_window, or sync: exact"),
    ("lease_without_terms", "tests/config/lease_without_terms.yaml: limits.global.lease: sync: lease needs lease: { units, ttl_ms }"),
    ("lease_too_large", "tests/config/lease_too_large.yaml: limits.global.lease.units: must be a whole number from 1 to 100, got 500\ntests/config/lease_too_large.yaml: limits.global.lease.ttl_ms: must be a whole number from 10 to 60000, got 5"),
    ("lease_on_local_limit", "tests/config/lease_on_local_limit.yaml: limits.global.sync: a lease is taken from the shared store; a limit with store: local has none"),
    ("lease_without_sync", "tests/config/lease_without_sync.yaml: limits.global.lease: only read with sync: lease"),
    ("reserve_everything", "tests/config/reserve_everything.yaml: upstreams.api.reserve.critical: must be a share from 0 to below 1, got 1"),
    ("lease_on_quota", "tests/config/lease_on_quota.yaml: limits.monthly.sync: a quota counts a calendar period; a lease's units would outlive it: use sync: exact"),
    ("quota_without_period", "tests/config/quota_without_period.yaml: limits.monthly: `window_seconds` does not apply to quota; it takes `limit` and `period`\ntests/config/quota_without_period.yaml: limits.monthly: missing `period`"),
    ("delay_on_window", "tests/config/delay_on_window.yaml: limits.b.max_delay_ms: only read with on_limit: delay\ntests/config/delay_on_window.yaml: limits.w.on_limit: delay schedules an admission ahead, which token_bucket and gcra can; a window's count belongs to the window it is made in"),
    ("cost_from_response_log", "tests/config/cost_from_response_log.yaml: routes[0].cost_from_response.header: \"x usage\" is not a header name\ntests/config/cost_from_response_log.yaml: routes[0].cost_from_response.max: must be at least the route's cost 10 (the estimate), got 5\ntests/config/cost_from_response_log.yaml: routes[0].cost_from_response: limit \"exact\" is a sliding_log, whose entries cannot be given back in part"),
    ("url_password_hidden", "tests/config/url_password_hidden.yaml: store.urls[0]: \"http://gate:***@127.0.0.1:6379\" is not a redis:// or rediss:// url"),
    ("schema_misspelled_key", "tests/config/schema_misspelled_key.yaml:3:46: unknown key refil_per_second at limits.per-tenant; did you mean refill_per_second?"),
    ("schema_wrong_enum", "tests/config/schema_wrong_enum.yaml:3:84: limits.per-tenant.on_store_error: unknown variant `maybe`, expected one of `open`, `closed`, `local`"),
    ("schema_wrong_type", "tests/config/schema_wrong_type.yaml:3:10: server.http2: invalid type: string \"yes please\", expected a boolean"),
    ("schema_threads_zero", "tests/config/schema_threads_zero.yaml: server.threads: must be between 1 and 256, got 0"),
    ("schema_routes_not_a_list", "tests/config/schema_routes_not_a_list.yaml:3:3: routes: invalid type: map, expected a sequence"),
    ("unbounded_key_value", "tests/config/unbounded_key_value.yaml: routes[0].limits: limit \"per-end-user\" is keyed by a value the client chooses (header.x-end-user), so each new value would be a new budget: list its values with other: reject, or also apply an enforced limit keyed by credential, tenant or ip that counts requests (not a concurrency limit), in the same or an earlier scope, that does not fail open\ntests/config/unbounded_key_value.yaml: routes[1].limits: limit \"per-end-user\" is keyed by a value the client chooses (header.x-end-user), so each new value would be a new budget: list its values with other: reject, or also apply an enforced limit keyed by credential, tenant or ip that counts requests (not a concurrency limit), in the same or an earlier scope, that does not fail open"),
    ("usage_bad", "tests/config/usage_bad.yaml: usage.routes[0]: no route named \"chta\"; did you mean \"chat\"?\ntests/config/usage_bad.yaml: usage.spool.fsync_ms: must be between 1 and 10000, got 0\ntests/config/usage_bad.yaml: usage.sinks[0].redis_stream: needs urls: the store (memory) is not a Redis the stream can use\ntests/config/usage_bad.yaml: usage.sinks[1].http.token_env: would send the token in the clear: use an https:// url (http:// only to a loopback address)\ntests/config/usage_bad.yaml: usage.sinks[2]: takes exactly one of redis_stream and http"),
    ("key_value_misplaced", "tests/config/key_value_misplaced.yaml: limits.early-model.key: a pre_auth limit runs before the caller is identified and its body read: body.model needs them; a pre_auth key may add header.* and path.*\ntests/config/key_value_misplaced.yaml: limits.typo.key[0]: unknown key dimension \"tenent\": ip, credential, tenant, route, or header.NAME, path.PARAM, query.NAME, claim.NAME, auth.NAME, body.FIELD; did you mean \"tenant\"?\ntests/config/key_value_misplaced.yaml: limits.typo.key[1]: unknown key dimension \"heder.x\": ip, credential, tenant, route, or header.NAME, path.PARAM, query.NAME, claim.NAME, auth.NAME, body.FIELD; did you mean \"header\"?\ntests/config/key_value_misplaced.yaml: routes[0].limits: limit \"per-project\" is keyed by path.project, but the route's path \"/v1/{id}\" has no {project}\ntests/config/key_value_misplaced.yaml: routes[0].limits: limit \"per-org\" is keyed by claim.org_id, but no caller of the route can have a JWT (auth.jwt and auth: required)\ntests/config/key_value_misplaced.yaml: routes[1].oversize: the route reads no request body (no body.* key, cost_from_request.json or include_usage)"),
];

#[test]
fn every_fixture_fails_with_its_message() {
    let on_disk = std::fs::read_dir("tests/config")
        .expect("fixtures")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "yaml"))
        })
        .count();
    assert_eq!(
        on_disk,
        FIXTURES.len(),
        "every fixture file has an expected message"
    );
    for (name, expected) in FIXTURES {
        let file = format!("tests/config/{name}.yaml");
        let (code, stdout, stderr) = check(&file);
        assert_eq!(code, 1, "{file} must be rejected");
        assert_eq!(stdout, "", "{file}");
        assert_eq!(stderr.trim_end(), *expected, "{file}");
    }
}

/// `check` of `policy` written to a file of its own: its exit code,
/// stdout, stderr, and the file's name as `check` shows it.
fn check_policy(policy: &str) -> (i32, String, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, policy).unwrap();
    let (code, stdout, stderr) = check(file.to_str().unwrap());
    (code, stdout, stderr, file.display().to_string())
}

#[test]
fn costs_above_a_fallback_share_are_warned_about_but_valid() {
    let (code, stdout, stderr, file) = check_policy(
        r#"
version: 1
store: { backend: redis, urls: ["redis://127.0.0.1:6379/0"], expected_instances: 4 }
limits:
  per-tenant: { key: [tenant], capacity: 20, refill_per_second: 1, on_store_error: local }
routes:
  - { name: export, path: /export, cost: 10, respond: { status: 200 }, limits: [per-tenant] }
"#,
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains(" ok: "));
    assert_eq!(
        stderr.trim_end(),
        format!(
            "{file}: warning: route \"export\": cost 10 exceeds the local fallback share (5) of limit \"per-tenant\" \
             (1/4 of its budget): while the store is failing these requests get 429",
        )
    );
}

#[test]
fn an_admin_listener_beyond_loopback_without_a_token_is_warned_about_but_valid() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    let check_with = |server: &str| {
        std::fs::write(
            &file,
            format!(
                "version: 1\nserver: {{ listen: [\"127.0.0.1:8080\"], {server} }}\n\
                 routes:\n  - {{ name: r, path: /x, respond: {{ status: 200 }} }}\n"
            ),
        )
        .unwrap();
        check(file.to_str().unwrap())
    };
    let (code, stdout, stderr) = check_with("admin_listen: \"0.0.0.0:9091\"");
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains(" ok: "), "{stdout}");
    assert_eq!(
        stderr.trim_end(),
        format!(
            "{}: warning: server.admin_listen 0.0.0.0:9091 is not a loopback address and no admin \
             token is configured (server.admin_tokens or server.admin_token_env): anyone who can \
             reach it reads the admin API (/admin/top, /admin/explain, /admin/overrides…)",
            file.display()
        )
    );
    let token = format!(
        "admin_tokens: [{{ name: ops, sha256: \"{}\", role: read }}]",
        "a".repeat(64)
    );
    for quiet in [
        "admin_listen: \"127.0.0.1:9091\"".to_string(),
        "admin_listen: \"[::1]:9091\"".to_string(),
        format!("admin_listen: \"0.0.0.0:9091\", {token}"),
        "admin_listen: \"10.0.0.5:9091\", admin_token_env: ADMIN_TOKEN".to_string(),
    ] {
        let (code, _, stderr) = check_with(&quiet);
        assert_eq!((code, stderr.as_str()), (0, ""), "{quiet}");
    }
}

#[test]
fn an_estimate_a_request_may_name_beyond_a_budget_is_warned_about() {
    // The same chat route under the `tokens` limit as each case defines it.
    let warned = |limit: &str| {
        let (code, _, stderr, file) = check_policy(&format!(
            r#"
version: 1
limits:
  tokens: {limit}
upstreams:
  llm: {{ servers: ["127.0.0.1:9"] }}
routes:
  - name: chat
    path: /v1/chat/completions
    upstream: llm
    auth: none
    limits: [tokens]
    oversize: absent
    cost_from_request: {{ json: max_tokens, max: 4000, default: 100 }}
    cost_from_response: {{ format: openai, max: 800, include_usage: true }}
"#
        ));
        assert_eq!(code, 0, "{stderr}");
        stderr.trim_end().replace(&file, "FILE")
    };
    assert_eq!(
        warned("{ key: [ip], capacity: 1000, refill_per_second: 1 }"),
        "FILE: warning: route \"chat\": cost_from_request.max (4000) exceeds the capacity (1000) \
         of limit \"tokens\": a request naming that much is refused even by a full budget",
    );
    // So for the budget of a value the limit lists (the model's).
    assert_eq!(
        warned(
            "{ key: [ip, body.model], capacity: 100000, refill_per_second: 1, \
             values: { gpt-4o: { capacity: 2000, refill_per_second: 1 } }, other: reject }"
        ),
        "FILE: warning: route \"chat\": cost_from_request.max (4000) exceeds the capacity (2000) \
         of limit \"tokens\" (values \"gpt-4o\"): a request naming that much is refused even by a \
         full budget",
    );
}

#[test]
fn a_reported_cost_that_may_exceed_a_budget_is_warned_about_and_new_keys_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    let write = |extra: &str, path: &str| {
        std::fs::write(
            &file,
            format!(
                r#"
version: 1
server: {{ path: {path} }}
limits:
  tokens: {{ key: [ip], capacity: 1000, refill_per_second: 1 }}
upstreams:
  llm: {{ servers: ["127.0.0.1:9"] }}
routes:
  - name: chat
    path: /chat
    upstream: llm
    cost: 100
    upgrade: [websocket, h2c]
    cost_from_response: {{ header: x-usage-tokens, max: 5000{extra} }}
    limits: [tokens]
"#
            ),
        )
        .unwrap();
    };
    write(
        ", on_abandon: estimate, max_debt: 20000",
        "{ params: strip, trailing_slash: ignore, case: insensitive }",
    );
    let (code, _, stderr) = check(file.to_str().unwrap());
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!(
            "{}: warning: route \"chat\": cost_from_response.max - cost (4900) exceeds the capacity (1000) \
             of limit \"tokens\": one response may cost more than a full budget, and callers go into debt",
            file.display()
        )
    );
    // `reserve: max` charges the max at admission: it must fit the budget.
    write(", reserve: max", "{}");
    let (code, _, stderr) = check(file.to_str().unwrap());
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("route cost 5000 exceeds the capacity 1000"),
        "{stderr}"
    );
    for (extra, path, expected) in [
        (", on_abandon: never", "{}", "on_abandon"),
        (", max_debt: -1", "{}", "max_debt"),
        ("", "{ params: drop }", "params"),
        ("", "{ case: upper }", "case"),
        ("", "{ slash: keep }", "unknown field `slash`"),
    ] {
        write(extra, path);
        let (code, _, stderr) = check(file.to_str().unwrap());
        assert_eq!(code, 1, "{extra} {path}: {stderr}");
        assert!(stderr.contains(expected), "{extra} {path}: {stderr}");
    }
}

#[test]
fn a_lease_may_grow_from_units_to_max_units_within_the_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    let write = |lease: &str| {
        let policy = format!(
            r#"
version: 1
store: {{ backend: redis, urls: ["redis://127.0.0.1:6379/0"] }}
limits:
  global: {{ key: [], capacity: 1000, refill_per_second: 100, sync: lease, lease: {lease} }}
routes:
  - {{ name: all, path: "/**", auth: none, respond: {{ status: 200 }}, limits: [global] }}
"#
        );
        std::fs::write(&file, policy).unwrap();
    };
    write("{ units: 10, ttl_ms: 1000, max_units: 200 }");
    let (code, _, stderr) = check(file.to_str().unwrap());
    assert_eq!(code, 0, "{stderr}");
    for (lease, expected) in [
        (
            "{ units: 10, ttl_ms: 1000, max_units: 5 }",
            "max_units: must be a whole number from 10 to 1000",
        ),
        (
            "{ units: 10, ttl_ms: 1000, max_units: 1001 }",
            "max_units: must be a whole number from 10 to 1000",
        ),
    ] {
        write(lease);
        let (code, _, stderr) = check(file.to_str().unwrap());
        assert_eq!(code, 1, "{lease}: {stderr}");
        assert!(stderr.contains(expected), "{lease}: {stderr}");
    }
}

#[test]
fn hash_key_prints_the_sha256_of_stdin() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("hash-key")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"tg_demo_4f1c2a\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "3b8d535cecedeba16c1775db9f30582b43ba3abd8557059f99c0340d130ff52c\n"
    );
}
