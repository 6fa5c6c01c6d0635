//! Keys provisioned at runtime (`auth.store_keys`): created, read and
//! deleted through `/admin/credentials`, resolved by each gateway on first
//! use, and reaching every instance's cache through the store's change
//! feed; one id space with the policy's keys.

mod support;

use std::time::Duration;

use support::redis_server::{RedisCluster, RedisServer};
use support::{admin_call, digest, eventually, Gateway, Upstream};

const SECRET: (&str, &str) = ("TOLLGATE_KEY_SECRET", "store-keys-secret-51c2");

/// A policy with store keys, a write token (`oncall-token`), a key of its
/// own (`file-1`), plan `pro` doubling `per-credential`, admin records read
/// every 200 ms, on `store` (a `store:` value), its access log at `log`.
fn policy(store: &str, log: &std::path::Path) -> String {
    format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  admin_refresh_ms: 200
  # Reloads are counted exactly: only the ones asked for.
  watch: false
  admin_tokens: [{{ name: oncall, sha256: "{}", role: write }}]
  access_log: {{ path: "{}" }}
store: {store}
auth:
  keys: [{{ id: file-1, tenant: acme, sha256: "{}" }}]
  store_keys: {{ cache_entries: 1000, negative_ttl_s: 600 }}
plans:
  pro: {{ per-credential: {{ capacity: 4, refill_per_second: 0.001 }} }}
limits:
  per-credential: {{ key: [credential], capacity: 2, refill_per_second: 0.001 }}
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: api, path: "/**", upstream: api, limits: [per-credential] }}
"#,
        digest("oncall-token"),
        log.display(),
        digest("file-key")
    )
}

fn status(gw: &Gateway, key: &str) -> u16 {
    gw.get("/x", &[("authorization", &format!("Bearer {key}"))])
        .status
}

fn create(gw: &Gateway, id: &str, key: &str, plan: Option<&str>) -> support::Reply {
    let plan = plan.map_or(String::new(), |p| format!(r#", "plan": "{p}""#));
    let body = format!(
        r#"{{"id": "{id}", "tenant": "globex", "sha256": "{}"{plan}}}"#,
        digest(key)
    );
    write(gw, "POST", "/admin/credentials", &body)
}

/// An admin write as `oncall`, sent again while the per-actor write budget
/// (10 a second) refuses it.
fn write(gw: &Gateway, method: &str, path: &str, body: &str) -> support::Reply {
    let mut reply = None;
    eventually(Duration::from_secs(10), || {
        let r = admin_call(gw, method, path, "oncall-token", body);
        let done = r.status != 429;
        reply = Some(r);
        done
    });
    reply.expect("an answer")
}

#[test]
fn a_created_key_is_admitted_named_upstream_and_refused_once_deleted() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let gw = Gateway::start(&policy("{ backend: memory }", &log), Some(&upstream));
    assert_eq!(status(&gw, "sk-new"), 401);
    let made = create(&gw, "s-1", "sk-new", Some("pro"));
    assert_eq!(made.status, 201, "{}", made.body);
    assert_eq!(made.json()["id"], "s-1");
    let reply = gw.get("/x", &[("authorization", "Bearer sk-new")]);
    assert_eq!(
        reply.status, 200,
        "a refusal remembered before is dropped at once"
    );
    assert_eq!(reply.upstream_saw("x-credential-id"), ["s-1"]);
    assert_eq!(reply.upstream_saw("x-tenant-id"), ["globex"]);
    // The pro plan's capacity of 4: three more, then refused.
    let more: Vec<u16> = (0..4).map(|_| status(&gw, "sk-new")).collect();
    assert_eq!(more, [200, 200, 200, 429]);

    let shown = support::get(
        gw.admin,
        "/admin/credentials/s-1",
        &[("authorization", "Bearer oncall-token")],
    );
    assert_eq!(shown.status, 200);
    assert_eq!(
        shown.json(),
        serde_json::json!({"id": "s-1", "tenant": "globex", "plan": "pro"})
    );
    let explained = support::get(
        gw.admin,
        "/admin/explain?path=/x&credential=s-1",
        &[("authorization", "Bearer oncall-token")],
    );
    assert_eq!(explained.status, 200, "{}", explained.body);
    assert_eq!(explained.json()["plan"], "pro", "explained with its plan");
    let gone = admin_call(&gw, "DELETE", "/admin/credentials/s-1", "oncall-token", "");
    assert_eq!(gone.status, 200, "{}", gone.body);
    assert_eq!(status(&gw, "sk-new"), 401);
    assert_eq!(
        admin_call(&gw, "DELETE", "/admin/credentials/s-1", "oncall-token", "").status,
        404
    );
    assert!(
        eventually(Duration::from_secs(10), || std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(r#""auth_source":"store""#)),
        "the access log names the source"
    );
    assert_eq!(
        gw.metric("tollgate_auth_lookups_total{result=\"hit\",source=\"store\"}"),
        1.0
    );
    assert!(gw.metric("tollgate_auth_lookups_total{result=\"cached\",source=\"store\"}") >= 4.0);
}

#[test]
fn ids_and_keys_are_one_space_with_the_policy_keys_and_bad_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start();
    let gw = Gateway::start(
        &policy("{ backend: memory }", &dir.path().join("a.log")),
        Some(&upstream),
    );
    assert_eq!(create(&gw, "s-1", "sk-1", None).status, 201);
    for (id, key, plan, code) in [
        ("file-1", "sk-2", None, 409),     // an id of the policy's keys
        ("s-2", "file-key", None, 409),    // a key of the policy's keys
        ("s-1", "sk-3", None, 409),        // an id of the store
        ("s-3", "sk-1", None, 409),        // a key of the store
        ("jwt:main:x", "sk-4", None, 400), // a JWT caller's space
        ("fwd:x", "sk-5", None, 400),      // a forward-auth caller's space
        ("has space", "sk-6", None, 400),
        ("s-7", "sk-7", Some("gold"), 400), // no such plan
    ] {
        let r = create(&gw, id, key, plan);
        assert_eq!(r.status, code, "{id}: {}", r.body);
    }
    let bad_digest = r#"{"id": "s-8", "tenant": "t", "sha256": "abc"}"#;
    assert_eq!(
        write(&gw, "POST", "/admin/credentials", bad_digest).status,
        400
    );
    let unknown_field = format!(
        r#"{{"id": "s-9", "tenant": "t", "sha256": "{}", "key": "x"}}"#,
        digest("k")
    );
    assert_eq!(
        write(&gw, "POST", "/admin/credentials", &unknown_field).status,
        400
    );
    // A read token cannot create.
    assert_eq!(
        admin_call(&gw, "POST", "/admin/credentials", "nobody", bad_digest).status,
        401
    );
    assert_eq!(status(&gw, "sk-1"), 200);
    assert_eq!(status(&gw, "file-key"), 200);
}

/// Two gateways on one store: refused on the first (and remembered),
/// created on the second, admitted by both; deleted, refused by both.
fn provisioned_across(store: &str) -> Vec<Gateway> {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = policy(store, &dir.path().join("a.log"));
    let gws: Vec<Gateway> = (0..2)
        .map(|_| Gateway::start_with_env(&policy, Some(&upstream), &[SECRET]))
        .collect();
    // Refused on both, and remembered as unknown for negative_ttl_s (600 s).
    assert_eq!(
        (status(&gws[0], "sk-fleet"), status(&gws[1], "sk-fleet")),
        (401, 401)
    );
    assert_eq!(status(&gws[0], "sk-fleet"), 401);
    assert!(
        gws[0].metric("tollgate_auth_lookups_total{result=\"cached\",source=\"store\"}") >= 1.0
    );

    let made = create(&gws[1], "fleet-1", "sk-fleet", None);
    assert_eq!(made.status, 201, "{}", made.body);
    assert_eq!(
        status(&gws[1], "sk-fleet"),
        200,
        "at once where it was made"
    );
    assert!(
        eventually(Duration::from_secs(10), || status(&gws[0], "sk-fleet")
            == 200),
        "the other instance dropped its remembered refusal"
    );
    let shown = support::get(
        gws[0].admin,
        "/admin/credentials/fleet-1",
        &[("authorization", "Bearer oncall-token")],
    );
    assert_eq!(shown.json()["tenant"], "globex");

    let gone = admin_call(
        &gws[0],
        "DELETE",
        "/admin/credentials/fleet-1",
        "oncall-token",
        "",
    );
    assert_eq!(gone.status, 200, "{}", gone.body);
    assert_eq!(status(&gws[0], "sk-fleet"), 401);
    assert!(
        eventually(Duration::from_secs(10), || status(&gws[1], "sk-fleet")
            == 401),
        "the other instance dropped the credential it cached"
    );
    gws
}

#[test]
fn a_store_credential_whose_id_a_reloaded_keys_list_takes_is_refused() {
    let upstream = Upstream::start();
    let dir = tempfile::tempdir().unwrap();
    let text = policy("{ backend: memory }", &dir.path().join("a.log"));
    let gw = Gateway::start(&text, Some(&upstream));
    assert_eq!(create(&gw, "s-9", "sk-9", None).status, 201);
    assert_eq!(status(&gw, "sk-9"), 200);
    // The policy's keys now name s-9 too, with another key: one id space,
    // and the policy's keys win.
    let taken = text.replace(
        "auth:\n  keys: [",
        &format!(
            "auth:\n  keys: [{{ id: s-9, tenant: acme, sha256: \"{}\" }}, ",
            digest("file-9")
        ),
    );
    assert_ne!(taken, text);
    gw.rewrite(&taken, Some(&upstream));
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(10), || {
        gw.metric("tollgate_config_reloads_total{result=\"ok\"}") == 1.0
    }));
    assert_eq!(status(&gw, "sk-9"), 401);
    assert_eq!(status(&gw, "file-9"), 200);
}

#[test]
fn creations_and_deletions_reach_every_instance_through_the_change_feed() {
    let redis = RedisServer::start();
    provisioned_across(&redis.store(500));
    // Nothing in the store names the key, its digest or the credential.
    let key_digest = digest("sk-fleet");
    for key in redis.keys() {
        assert!(
            !key.contains("fleet") && !key.contains(&key_digest),
            "{key}"
        );
        let kind: String = redis.cmd(&["TYPE", &key]).unwrap();
        if kind == "hash" {
            let fields: Vec<String> = redis.cmd(&["HKEYS", &key]).unwrap();
            for f in fields {
                assert!(
                    !f.contains(&key_digest) && !f.contains("fleet"),
                    "{key}: {f}"
                );
            }
        }
    }
}

#[test]
fn provisioned_keys_reach_every_instance_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    provisioned_across(&cluster.store(1000));
}

#[test]
fn a_store_that_fails_leaves_cached_callers_and_refuses_new_ones_with_503() {
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = policy(&redis.store(200), &dir.path().join("a.log"));
    let upstream = Upstream::start();
    let gw = Gateway::start_with_env(&policy, Some(&upstream), &[SECRET]);
    assert_eq!(create(&gw, "s-1", "sk-known", None).status, 201);
    assert_eq!(status(&gw, "sk-known"), 200);
    redis.kill();
    let new = gw.get("/x", &[("authorization", "Bearer sk-never-seen")]);
    assert_eq!(new.status, 503, "{}", new.body);
    assert!(new.body.contains("auth-unavailable"), "{}", new.body);
    assert!(gw.metric("tollgate_auth_lookups_total{result=\"error\",source=\"store\"}") >= 1.0);
    // The caller cached before still is one: its limit follows its own
    // on_store_error, not the lookup's failure.
    let known = gw.get("/x", &[("authorization", "Bearer sk-known")]);
    assert!(
        known.status != 401 && !known.body.contains("auth-unavailable"),
        "{} {}",
        known.status,
        known.body
    );
}
