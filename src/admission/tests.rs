//! Admission from plain values: a policy from text, a request head, a
//! caller and verdicts written by hand. No runtime, no store, no files.

use std::collections::HashMap;
use std::sync::Arc;

use pingora::http::RequestHeader;

use super::conclude::Conclusion;
use super::head::{self, Routed};
use super::plan::{self as planning, Caller, Groups, Plan};
use super::*;
use crate::config::Policy;
use crate::edge::target;
use crate::identity::overrides::Resolved;
use crate::limits::algorithm::Params;

const POLICY: &str = r#"
version: 1
client_ip: { trusted_proxies: ["10.0.0.0/8"] }
ip_rules: { deny: ["192.0.2.0/24"] }
auth:
  keys:
    - { id: a1, tenant: acme, sha256: "1111111111111111111111111111111111111111111111111111111111111111" }
    - { id: p1, tenant: bigco, plan: pro, sha256: "2222222222222222222222222222222222222222222222222222222222222222" }
plans:
  pro: { reports-limit: { capacity: 100, refill_per_second: 10 } }
limits:
  ip-guard: { scope: pre_auth, key: [ip], capacity: 10, refill_per_second: 1 }
  reports-limit: { key: [credential], capacity: 10, refill_per_second: 1 }
  shadowed: { key: [tenant], capacity: 10, refill_per_second: 1, mode: shadow }
  per-user: { key: [tenant, header.x-end-user], absent: reject, capacity: 5, refill_per_second: 1 }
upstreams:
  api: { servers: ["127.0.0.1:9"] }
routes:
  - { name: reports, methods: [POST], path: "/v1/reports/{id}", upstream: api, cost: 2, limits: [ip-guard, reports-limit, shadowed] }
  - { name: users, path: "/v1/users", upstream: api, limits: [ip-guard, per-user] }
  - { name: public, path: "/public/**", auth: none, upstream: api, max_body_bytes: 8 }
  - { name: teapot, path: /teapot, auth: none, respond: { status: 418, body: "short" } }
  - { name: metered, path: /metered, upstream: api, limits: [reports-limit], cost_from_response: { header: x-cost, max: 5 } }
"#;

fn policy() -> Policy {
    crate::config::from_text(std::path::Path::new("policy.yaml"), POLICY).unwrap()
}

fn request(method: &str, target: &str, headers: &[(&str, &str)]) -> RequestHeader {
    let mut req = RequestHeader::build(method, target.as_bytes(), None).unwrap();
    for (k, v) in headers {
        req.append_header(k.to_string(), *v).unwrap();
    }
    req
}

const PEER: &str = "203.0.113.5";

/// The credential `id` of the policy's keys.
fn credential(policy: &Policy, id: &str) -> Arc<Credential> {
    policy
        .auth
        .keys
        .credentials()
        .find(|c| &*c.id == id)
        .cloned()
        .unwrap()
}

/// The head of `method target`, and the facts it noted.
fn routed<'p>(
    policy: &'p Policy,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
) -> (Result<Routed<'p>, Rejection>, Facts) {
    let req = request(method, target, headers);
    let mut facts = Facts::default();
    let routed = head::route(policy, PEER.parse().unwrap(), &req, &mut facts);
    (routed, facts)
}

/// The plan of `method target` from the caller `id` names (`None`: no
/// valid key), as the gateway makes it when it knows the caller at once.
fn planned<'p>(
    policy: &'p Policy,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    id: Option<&str>,
    tuned: Option<&Resolved>,
) -> Result<Plan<'p>, Rejection> {
    let req = request(method, target, headers);
    let routed = head::route(policy, PEER.parse().unwrap(), &req, &mut Facts::default())?;
    let credential = id.map(|id| credential(policy, id));
    let caller = Caller::new(policy, Some(routed.network), credential.as_deref(), tuned);
    let view = routed.view(&req, credential.as_deref());
    let charged = planning::plan(policy, routed.route, &view, &caller, Groups::Both)
        .map_err(|r| conclude::key_value(&r))?;
    Ok(Plan::new(routed.route, charged, routed.estimate))
}

#[test]
fn the_head_routes_on_the_normalized_target() {
    let policy = policy();
    let (out, facts) = routed(&policy, "POST", "/v1/%72eports//1?x=%2F", &[]);
    let out = out.unwrap();
    assert_eq!(&*out.route.name, "reports");
    assert_eq!(out.path, "/v1/reports/1");
    assert_eq!(
        facts.rewritten_target.as_deref(),
        Some("/v1/reports/1?x=%2F")
    );
    assert_eq!(facts.cost, 2);

    let (_, facts) = routed(&policy, "GET", "/public/x", &[]);
    assert_eq!(
        facts.rewritten_target, None,
        "a normal target is forwarded as received"
    );
}

/// Method, target, headers, and the refusal expected.
type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], Rejection);

#[test]
fn head_refusals_table() {
    let policy = policy();
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
        let (out, _) = routed(&policy, method, target, headers);
        assert_eq!(out.as_ref().err(), Some(want), "{method} {target}");
    }
}

#[test]
fn denied_addresses_are_refused_before_anything_else() {
    let policy = policy();
    let req = request("GET", "v1/secret", &[]);
    let mut facts = Facts::default();
    let out = head::route(&policy, "192.0.2.7".parse().unwrap(), &req, &mut facts);
    assert_eq!(out.err(), Some(Rejection::Forbidden));
    assert_eq!(
        facts.client_ip,
        Some("192.0.2.7".parse().unwrap()),
        "a refusal keeps what the path learnt"
    );
}

#[test]
fn a_caller_without_a_key_is_planned_only_its_pre_auth_charges() {
    let policy = policy();
    let plan = planned(&policy, "POST", "/v1/reports/1", &[], None, None).unwrap();
    assert_eq!(plan.charges.len(), 1);
    assert_eq!(&*plan.charges[0].name, "ip-guard");
    assert!(!plan.authenticated);

    let plan = planned(&policy, "POST", "/v1/reports/1", &[], Some("a1"), None).unwrap();
    let names: Vec<&str> = plan.charges.iter().map(|c| &*c.name).collect();
    assert_eq!(names, ["ip-guard", "reports-limit", "shadowed"]);
    assert!(plan.authenticated);
    assert!(plan.charges.iter().all(|c| c.cost == 2));
}

#[test]
fn the_caller_s_plan_and_override_price_its_request_limits_only() {
    let policy = policy();
    let capacity = |plan: &Plan<'_>, i: usize| match plan.charges[i].params {
        Params::TokenBucket(b) => b.capacity / crate::limits::algorithm::MICRO,
        other => panic!("{other:?}"),
    };
    let free = planned(&policy, "POST", "/v1/reports/1", &[], Some("a1"), None).unwrap();
    let pro = planned(&policy, "POST", "/v1/reports/1", &[], Some("p1"), None).unwrap();
    assert_eq!((capacity(&free, 1), capacity(&pro, 1)), (10, 100));
    assert_eq!(capacity(&pro, 0), 10, "a pre-auth limit runs under no plan");

    let reports = policy.limit_named("reports-limit").map(|(id, _)| id);
    let boosted = Params::TokenBucket(crate::limits::algorithm::Bucket {
        capacity: 7 * crate::limits::algorithm::MICRO,
        per_ms: 1,
    });
    let tuned = Resolved {
        limits: HashMap::from([(reports.unwrap(), boosted)]),
        ..Resolved::default()
    };
    let plan = planned(
        &policy,
        "POST",
        "/v1/reports/1",
        &[],
        Some("p1"),
        Some(&tuned),
    )
    .unwrap();
    assert_eq!((capacity(&plan, 0), capacity(&plan, 1)), (10, 7));
}

#[test]
fn a_value_a_request_limit_cannot_use_is_refused_after_the_pre_auth_limits() {
    let policy = policy();
    let plan = planned(&policy, "GET", "/v1/users", &[], Some("a1"), None).unwrap();
    // `per-user` reads a header the request does not send, and says
    // `absent: reject`: the request charges are left out, and the
    // request is refused once its pre-auth limits admit it.
    assert_eq!(plan.charges.len(), 1);
    let refused = plan.refused.as_ref().unwrap();
    assert_eq!(&*refused.limit, "per-user");
    let concluded = |allowed| {
        conclude(
            &plan,
            &[verdict(allowed)],
            Conclusion::default(),
            &mut Facts::default(),
        )
    };
    let admitted = concluded(true);
    assert!(
        matches!(admitted, Err(Rejection::KeyValue { .. })),
        "{admitted:?}"
    );
    let limited = concluded(false);
    assert!(
        matches!(limited, Err(Rejection::RateLimited { .. })),
        "{limited:?}"
    );

    let plan = end_user_u1(&policy);
    assert!(plan.refused.is_none());
    assert_eq!(plan.charges.len(), 2);
}

#[test]
fn an_operator_names_a_key_s_values_as_a_request_would_send_them() {
    let policy = policy();
    let a1 = credential(&policy, "a1");
    let caller = Caller::new(&policy, None, Some(&a1), None);
    let (id, _) = policy.limit_named("per-user").unwrap();
    let named = HashMap::from([("header.x-end-user".to_owned(), "u-1".to_owned())]);
    let named_charge = |named: &HashMap<String, String>| {
        let group = crate::limits::Group::Request;
        planning::named_charge(&policy, id, &caller, "users", 1, group, named)
    };
    let by_operator = named_charge(&named).unwrap();
    assert_eq!(by_operator.key, end_user_u1(&policy).charges[1].key);
    let missing = named_charge(&HashMap::new()).unwrap_err();
    assert!(
        matches!(&missing, planning::Lacks::Unusable { dims, .. } if dims == "header.x-end-user"),
        "{missing:?}"
    );
    assert!(missing.to_string().starts_with("header.x-end-user that "));
}

/// The plan of `GET /v1/users` from `a1`, for the end user `u-1`.
fn end_user_u1(policy: &Policy) -> Plan<'_> {
    let headers = [("x-end-user", "u-1")];
    planned(policy, "GET", "/v1/users", &headers, Some("a1"), None).unwrap()
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

#[test]
fn conclusion_table() {
    let policy = policy();
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
        let id = with_key.then_some("a1");
        let plan = planned(&policy, "POST", "/v1/reports/1", &[], id, None).unwrap();
        let verdicts: Vec<Verdict> = verdicts.iter().map(|&a| verdict(a)).collect();
        let mut facts = Facts::default();
        let out = conclude(&plan, &verdicts, Conclusion::default(), &mut facts);
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
    let policy = policy();
    let plan = planned(&policy, "GET", "/metered", &[], Some("a1"), None).unwrap();
    assert_eq!(plan.charges.len(), 1);
    let how = Conclusion {
        instances: 4,
        ..Conclusion::default()
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
    assert!(stored[0].0.sync == plan.charges[0].sync && stored[0].1 == 7);
    // The local fallback charged it (the store failing): settled where it
    // was, in this process's quarter of the budget.
    let fallback = decided(crate::limits::Source::Fallback);
    assert_eq!(fallback.len(), 1);
    let (charge, at) = &fallback[0];
    assert!(charge.is_local() && *at == 7);
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
    let policy = policy();
    let plan = planned(&policy, "GET", "/teapot", &[], None, None).unwrap();
    assert!(plan.charges.is_empty());
    match conclude(&plan, &[], Conclusion::default(), &mut Facts::default()) {
        Ok(Admitted::Respond { status, body, .. }) => {
            assert_eq!(status, 418);
            assert_eq!(&body[..], b"short");
        }
        other => panic!("{other:?}"),
    }
}
