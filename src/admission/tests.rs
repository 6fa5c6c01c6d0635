//! The request path without a server: [`plan`] and [`conclude`] over a
//! policy, with verdicts written by hand.

use std::sync::Arc;

use super::*;
use crate::limits::limiter::Limiter;
use crate::limits::memory::MemoryStore;
use crate::metrics::Metrics;
use crate::pools::Pools;
use crate::runtime::Services;
use crate::top::{Redactor, Top};

const POLICY: &str = r#"
version: 1
client_ip: { trusted_proxies: ["10.0.0.0/8"] }
ip_rules: { deny: ["192.0.2.0/24"] }
auth:
  keys:
    - { id: a1, tenant: acme, sha256: "DIGEST" }
limits:
  ip-guard: { scope: pre_auth, key: [ip], capacity: 10, refill_per_second: 1 }
  reports-limit: { key: [credential], capacity: 10, refill_per_second: 1 }
  shadowed: { key: [tenant], capacity: 10, refill_per_second: 1, mode: shadow }
upstreams:
  api: { servers: ["127.0.0.1:9"] }
routes:
  - { name: reports, methods: [POST], path: "/v1/reports/{id}", upstream: api, cost: 2, limits: [ip-guard, reports-limit, shadowed] }
  - { name: public, path: "/public/**", auth: none, upstream: api, max_body_bytes: 8 }
  - { name: teapot, path: /teapot, auth: none, respond: { status: 418, body: "short" } }
  - { name: metered, path: /metered, upstream: api, limits: [reports-limit], cost_from_response: { header: x-cost, max: 5 } }
"#;

fn runtime() -> Runtime {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    let digest = hex::encode(crate::identity::auth::digest(b"key-a1"));
    std::fs::write(&file, POLICY.replace("DIGEST", &digest)).unwrap();
    let policy = crate::config::load(&file).unwrap();
    let metrics = Arc::new(Metrics::new());
    let services = Arc::new(Services {
        body_budget: crate::edge::body::BodyBudget::new(),
        client_log: crate::logs::ClientLog::new(1),
        access_log: None,
        certificate: None,
        limiter: Arc::new(Limiter::new(
            Arc::new(MemoryStore::default()),
            None,
            metrics.clone(),
        )),
        pools: Pools::new(metrics.clone()),
        metrics,
        top: Top::new(),
        redactor: Redactor::new().unwrap(),
        revocations: Arc::default(),
        overrides: Arc::default(),
        store_keys: Arc::default(),
        tracer: None,
        usage: None,
    });
    Runtime::new(policy, services)
}

fn request(method: &str, target: &str, headers: &[(&str, &str)]) -> RequestHeader {
    let mut req = RequestHeader::build(method, target.as_bytes(), None).unwrap();
    for (k, v) in headers {
        req.append_header(k.to_string(), *v).unwrap();
    }
    req
}

const PEER: &str = "203.0.113.5";
const KEY: (&str, &str) = ("authorization", "Bearer key-a1");

fn planned(
    rt: &Runtime,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
) -> (Result<(String, usize, bool), Rejection>, Facts) {
    let req = request(method, target, headers);
    let planned = plan(rt, PEER.parse().unwrap(), &req);
    let out = planned
        .plan
        .map(|p| (p.route.name.to_string(), p.charges.len(), p.authenticated));
    (out, planned.facts)
}

#[test]
fn plans_route_on_the_normalized_target() {
    let rt = runtime();
    let (out, facts) = planned(&rt, "POST", "/v1/%72eports//1?x=%2F", &[KEY]);
    assert_eq!(out, Ok(("reports".into(), 3, true)));
    assert_eq!(
        facts.rewritten_target.as_deref(),
        Some("/v1/reports/1?x=%2F")
    );
    assert_eq!(facts.cost, 2);
    assert_eq!(facts.credential.as_ref().map(|c| c.id.as_ref()), Some("a1"));

    let (_, facts) = planned(&rt, "GET", "/public/x", &[]);
    assert_eq!(
        facts.rewritten_target, None,
        "a normal target is forwarded as received"
    );
}

/// Method, target, headers, and the refusal expected.
type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], Rejection);

#[test]
fn plan_refusals_table() {
    let rt = runtime();
    let bad = |detail| Rejection::BadRequest { detail };
    let table: &[Case] = &[
        (
            "GET",
            "v1/secret",
            &[],
            bad(target::TargetError::NotOriginForm.detail()),
        ),
        (
            "GET",
            "/public/%2e%2e%2fx",
            &[],
            bad(target::TargetError::EncodedSlash.detail()),
        ),
        ("GET", "/public/%2e%2e/x", &[], Rejection::NotFound),
        ("GET", "/nowhere", &[], Rejection::NotFound),
        (
            "GET",
            "http://other/public/x",
            &[("host", "here")],
            bad(target::TargetError::HostMismatch.detail()),
        ),
        (
            "POST",
            "/public/x",
            &[("content-length", "9")],
            Rejection::PayloadTooLarge,
        ),
    ];
    for (method, target, headers, want) in table {
        let (out, _) = planned(&rt, method, target, headers);
        assert_eq!(out.as_ref().err(), Some(want), "{method} {target}");
    }
}

#[test]
fn denied_addresses_are_refused_before_anything_else() {
    let rt = runtime();
    let req = request("GET", "v1/secret", &[]);
    let planned = plan(&rt, "192.0.2.7".parse().unwrap(), &req);
    assert_eq!(planned.plan.err(), Some(Rejection::Forbidden));
    assert_eq!(
        planned.facts.client_ip,
        Some("192.0.2.7".parse().unwrap()),
        "a refusal keeps what the path learnt"
    );
}

#[test]
fn a_missing_key_plans_only_the_pre_auth_charges() {
    let rt = runtime();
    let (out, facts) = planned(&rt, "POST", "/v1/reports/1", &[]);
    assert_eq!(out, Ok(("reports".into(), 1, false)));
    assert!(facts.credential.is_none());
}

fn verdict(allowed: bool) -> Verdict {
    Verdict {
        allowed,
        remaining: if allowed { 5 } else { 0 },
        wait_ms: Some(1500),
        reset_ms: 9000,
        source: crate::limits::Source::Store,
        granted: 0,
        at: 0,
        delay_ms: 0,
        uncharged: 0,
        reclaimed: 0,
    }
}

fn concluded(headers: &[(&str, &str)], verdicts: &[bool]) -> (Result<Admitted, Rejection>, Facts) {
    let rt = runtime();
    let req = request("POST", "/v1/reports/1", headers);
    let Planned { plan, mut facts } = plan(&rt, PEER.parse().unwrap(), &req);
    let plan = plan.unwrap();
    let verdicts: Vec<Verdict> = verdicts.iter().map(|&a| verdict(a)).collect();
    (
        conclude(&plan, &verdicts, Conclusion::of(&rt), &mut facts),
        facts,
    )
}

#[test]
fn conclusion_table() {
    let limited = |name: &str| Rejection::RateLimited {
        violated: vec![name.into()],
        retry_after: Some(2),
    };
    // (key presented, verdicts in charge order, expected)
    let cases: &[(bool, &[bool], Result<(), Rejection>)] = &[
        (true, &[true, true, true], Ok(())),
        // A shadow limit that denies never refuses.
        (true, &[true, true, false], Ok(())),
        (true, &[true, false, true], Err(limited("reports-limit"))),
        // The IP limit speaks first, whatever the key.
        (true, &[false, false, true], Err(limited("ip-guard"))),
        (false, &[false], Err(limited("ip-guard"))),
        (false, &[true], Err(Rejection::Unauthorized)),
    ];
    for (with_key, verdicts, want) in cases {
        let headers: &[(&str, &str)] = if *with_key { &[KEY] } else { &[] };
        let (out, facts) = concluded(headers, verdicts);
        match (out, want) {
            (Ok(Admitted::Forward(_)), Ok(())) => assert!(facts.violated.is_empty()),
            (Err(got), Err(want)) => {
                assert_eq!(&got, want, "{verdicts:?}");
                if let Rejection::RateLimited { violated, .. } = want {
                    assert_eq!(&facts.violated, violated);
                }
            }
            (got, want) => panic!("{verdicts:?}: got {got:?}, want {want:?}"),
        }
    }
}

#[test]
fn a_charge_the_local_fallback_made_is_settled_in_its_share() {
    let rt = runtime();
    let req = request("GET", "/metered", &[KEY]);
    let plan = plan(&rt, PEER.parse().unwrap(), &req).plan.unwrap();
    assert_eq!(plan.charges.len(), 1);
    let how = Conclusion {
        instances: 4,
        ..Conclusion::of(&rt)
    };
    let decided = |source| {
        let mut v = verdict(true);
        v.source = source;
        v.at = 7;
        let mut facts = Facts::default();
        conclude(&plan, &[v], how, &mut facts).unwrap();
        facts.reconcile.unwrap().charged
    };
    // The store charged it: settled in the store, as charged.
    let stored = decided(crate::limits::Source::Store);
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].0.key, plan.charges[0].key);
    assert!(stored[0].0.local == plan.charges[0].local && stored[0].1 == 7);
    // The local fallback charged it (the store failing): settled where it
    // was, in this process's quarter of the budget.
    let fallback = decided(crate::limits::Source::Fallback);
    assert_eq!(fallback.len(), 1);
    let (charge, at) = &fallback[0];
    assert!(charge.local && *at == 7);
    assert_eq!(
        charge.key,
        crate::limits::plan::fallback_charge(&plan.charges[0], 4).key
    );
    assert_eq!(charge.params, plan.charges[0].params.share(4));
    // Admitted by `open`: charged nowhere, nothing to settle.
    assert!(decided(crate::limits::Source::FailOpen).is_empty());
}

#[test]
fn respond_routes_answer_directly() {
    let rt = runtime();
    let req = request("GET", "/teapot", &[]);
    let Planned { plan, mut facts } = plan(&rt, PEER.parse().unwrap(), &req);
    let plan = plan.unwrap();
    assert!(plan.charges.is_empty());
    match conclude(&plan, &[], Conclusion::of(&rt), &mut facts) {
        Ok(Admitted::Respond { status, body, .. }) => {
            assert_eq!(status, 418);
            assert_eq!(&body[..], b"short");
        }
        other => panic!("{other:?}"),
    }
}
