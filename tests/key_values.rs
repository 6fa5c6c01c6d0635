//! Limits keyed by what the request says — a header, a path segment, a
//! query parameter — through the real binary, on the memory store and on
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
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1, admin_tokens: [{{ name: oncall, sha256: "{admin}", role: write }}] }}
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
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: users, path: /v1/users, upstream: api, limits: [per-credential, per-end-user] }}
  - {{ name: projects, path: "/v1/projects/{{project}}/items", upstream: api, limits: [per-credential, per-project] }}
  - {{ name: regions, path: /v1/regions, upstream: api, limits: [per-credential, per-region] }}
  - {{ name: models, path: /v1/models, upstream: api, limits: [per-model] }}
  - {{ name: buckets, path: /v1/buckets, upstream: api, limits: [per-credential, per-user-bucket] }}
  - {{ name: crowded, path: /v1/crowded, upstream: api, limits: [tight-credential, per-end-user] }}
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

#[test]
fn memory_keys_from_headers_paths_and_queries() {
    let upstream = Upstream::start();
    let gw = Gateway::start(&policy("{ backend: memory }"), Some(&upstream));
    each_value_has_its_budget(&gw);
    unusable_values_are_refused(&gw);
    operators_name_values_by_dimension(&gw);
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
