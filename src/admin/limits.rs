//! The state of limits' keys: emptied or given units back (`POST
//! /admin/reset`, `POST /admin/credit`), a quota's use (`GET
//! /admin/usage`), and what a request would meet (`GET /admin/explain`).

use std::sync::Arc;

use http::Response;

use crate::limits::algorithm::Params;
use crate::limits::limiter::KeyStateError;
use crate::limits::{Charge, Group, Verdict};
use crate::runtime::Runtime;

use super::{access, audit, audited, body, problem, respond, Admin};

impl Admin {
    /// `POST /admin/reset` and `POST /admin/credit`: the key starts full,
    /// or gets `units` back; audited with what it held before and after.
    pub(super) async fn reset_or_credit(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        action: &'static str,
        body: &[u8],
    ) -> Response<Vec<u8>> {
        let k = match body::parse(body)
            .map_err(KeyOfError::from)
            .and_then(KeyOf::from_json)
        {
            Ok(k) => k,
            Err(e) => return problem(400, "admin-bad-request", &format!("the body: {e}")),
        };
        let units = match (action, k.units) {
            ("credit", Some(u)) if u > 0 => u,
            ("credit", _) => {
                return problem(
                    400,
                    "admin-bad-request",
                    "a credit needs units, a whole number above 0",
                )
            }
            (_, None) => 0,
            (_, Some(_)) => return problem(400, "admin-bad-request", "a reset takes no units"),
        };
        let charge = match charge_of(rt, &k, units) {
            Ok(c) => c,
            Err((404, detail)) => return problem(404, "admin-not-found", &detail),
            Err((status, detail)) => return problem(status, "admin-bad-request", &detail),
        };
        let probe = Charge {
            cost: 0,
            ..charge.clone()
        };
        let remaining = |peeked: Vec<(Result<Verdict, KeyStateError>, u64)>| {
            peeked
                .into_iter()
                .next()
                .and_then(|(v, _)| v.ok())
                .map(|v| v.remaining)
        };
        let before = remaining(rt.limiter().peek(std::slice::from_ref(&probe)).await);
        let done = if action == "reset" {
            rt.limiter().reset(std::slice::from_ref(&charge)).await
        } else {
            rt.limiter().credit(std::slice::from_ref(&charge)).await
        };
        let after = remaining(rt.limiter().peek(std::slice::from_ref(&probe)).await);
        let target = serde_json::json!({
            "limit": k.limit, "credential": k.credential, "tenant": k.tenant,
            "ip": k.ip, "route": k.route, "units": k.units,
        });
        self.audit(
            rt,
            audit::Entry {
                time: crate::access_log::timestamp(rt.wall()),
                actor: who.actor(),
                action,
                target,
                before: serde_json::json!({ "remaining": before }),
                after: match &done {
                    Ok(()) => serde_json::json!({ "remaining": after }),
                    Err(e) => serde_json::json!({ "error": e.to_string() }),
                },
                reason: k.reason.as_deref(),
                result: if done.is_ok() { "ok" } else { "error" },
                suppressed: None,
            },
        );
        audited(match done {
            Ok(()) => {
                let body = serde_json::json!({
                    "limit": k.limit,
                    "remaining_before": before,
                    "remaining": after,
                });
                respond(200, "application/json", body.to_string().into_bytes())
            }
            Err(e) => problem(
                503,
                "admin-store-unavailable",
                &format!("the limit store: {e}"),
            ),
        })
    }
}

/// The body of `POST /admin/reset` and `POST /admin/credit`: a limit and
/// the dimensions its key uses.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyOf {
    /// The limit's name.
    limit: String,
    /// The credential's id, when the key uses it.
    credential: Option<String>,
    /// The tenant, when the key uses it.
    tenant: Option<String>,
    /// The client IP, when the key uses it.
    ip: Option<std::net::IpAddr>,
    /// The route's name, when the key uses it.
    route: Option<String>,
    /// Units to give back (credit only).
    units: Option<u64>,
    /// Why, for the audit log.
    reason: Option<String>,
    /// Values of the dimensions read from requests, by name
    /// (`"header.x-end-user": "alice"`).
    #[serde(skip)]
    values: std::collections::HashMap<String, String>,
}

impl KeyOf {
    /// From a JSON object whose members are the fields above, and values
    /// of the dimensions read from requests named as the key names them.
    fn from_json(
        mut object: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self, KeyOfError> {
        let mut values = std::collections::HashMap::new();
        let named: Vec<String> = object
            .keys()
            .filter(|k| crate::key_values::names_a_value(k))
            .cloned()
            .collect();
        for name in named {
            match object.remove(&name) {
                Some(serde_json::Value::String(v)) => values.insert(name, v),
                _ => return Err(KeyOfError::NotAString { name }),
            };
        }
        let mut k: KeyOf = serde_json::from_value(serde_json::Value::Object(object))
            .map_err(KeyOfError::Fields)?;
        k.values = values;
        Ok(k)
    }
}

/// Why a reset's or credit's body names no key; shown after "the body: ".
#[derive(Debug, thiserror::Error)]
enum KeyOfError {
    /// Not JSON, or a member named twice.
    #[error(transparent)]
    Body(#[from] body::BodyError),
    /// A member naming a dimension read from requests holds something
    /// other than a string.
    #[error("{name:?} takes a string")]
    NotAString {
        /// The member's name (`header.x-end-user`).
        name: String,
    },
    /// The other members do not make a [`KeyOf`].
    #[error(transparent)]
    Fields(serde_json::Error),
}

/// The charge naming `k`'s key (of `cost`), or the problem with `k`.
fn charge_of(rt: &Runtime, k: &KeyOf, cost: u64) -> Result<Charge, (u16, String)> {
    let policy = &rt.policy;
    let bad = |status: u16, detail: String| (status, detail);
    let Some((id, limit)) = policy.limit_named(&k.limit) else {
        return Err(bad(404, format!("no limit {:?}", k.limit)));
    };
    let (credential, tenant) =
        crate::explain::caller(policy, k.credential.as_deref(), k.tenant.as_deref())
            .map_err(|e| bad(404, format!("no credential {:?}", e.id)))?;
    if let Some(route) = &k.route {
        if !policy.routes.iter().any(|r| *r.name == **route) {
            return Err(bad(404, format!("no route {route:?}")));
        }
    }
    let dims = limit.key;
    let missing = [
        (dims.ip && k.ip.is_none(), "ip"),
        (dims.credential && credential.is_none(), "credential"),
        (dims.tenant && tenant.is_none(), "tenant"),
        (dims.route && k.route.is_none(), "route"),
    ];
    if let Some((_, dim)) = missing.iter().find(|(m, _)| *m) {
        return Err(bad(
            400,
            format!("limit {:?} is keyed by {dim}: give it", k.limit),
        ));
    }
    let tuned = tenant
        .as_ref()
        .and_then(|t| rt.tenant_override(t, rt.wall_ms()));
    let network =
        k.ip.map(|ip| crate::client_ip::key_network(ip, policy.client_ip.ipv6_prefix));
    let caller = crate::admission::Caller::of_tenant(
        policy,
        network,
        credential.as_deref(),
        tenant.as_ref(),
        tuned.as_deref(),
    );
    let route = k.route.as_deref().unwrap_or("");
    crate::admission::plan::named_charge(
        policy,
        id,
        &caller,
        route,
        cost,
        Group::Request,
        &k.values,
    )
    .map_err(|dims| {
        bad(
            400,
            format!("limit {:?} is keyed by {dims}: give it", k.limit),
        )
    })
}

/// `GET /admin/explain?path=…`: the route a request takes and, for every
/// limit of it, its parameters and state, read without charging.
pub(super) async fn explain(rt: &Runtime, query: &str) -> Response<Vec<u8>> {
    let mut query = crate::explain::Query::parse(query);
    // A credential of the store, not of the policy's keys: read from it.
    if let Ok(q) = &mut query {
        let unlisted = q
            .credential
            .as_deref()
            .filter(|id| !rt.policy.auth.keys.has_id(id));
        if let (Some(id), Some(_)) = (unlisted, rt.policy.auth.store_keys) {
            let store = rt.limiter().records();
            if let Ok(Some(stored)) = rt.services.store_keys.get(store, id).await {
                let plan = stored
                    .plan
                    .as_deref()
                    .and_then(|name| rt.policy.plan_id(name));
                q.verified =
                    crate::identity::auth::Credential::new(&stored.id, &stored.tenant, plan)
                        .map(Arc::new);
            }
        }
    }
    let explained = match query.and_then(|q| {
        crate::explain::resolve(&rt.policy, &q, |t| rt.tenant_override(t, rt.wall_ms()))
    }) {
        Ok(e) => e,
        Err(p) => return problem(p.status, p.kind, &p.detail),
    };
    let charges: Vec<Charge> = explained
        .limits
        .iter()
        .filter_map(|(_, c)| c.as_ref().ok().cloned())
        .collect();
    let states = rt.limiter().peek(&charges).await;
    let body = crate::explain::to_json(&rt.policy, &explained, states.into_iter());
    respond(200, "application/json", body.to_string().into_bytes())
}

/// `GET /admin/usage?limit=L&tenant=T`: a quota's period, and how much of
/// it the tenant has used, read from the store the limit lives in (nothing
/// is charged). The quota's key may only be `[tenant]` or `[]`.
pub(super) async fn usage(rt: &Runtime, query: Option<&str>) -> Response<Vec<u8>> {
    let args: std::collections::HashMap<String, String> =
        form_urlencoded::parse(query.unwrap_or("").as_bytes())
            .into_owned()
            .collect();
    let Some(name) = args.get("limit") else {
        return problem(
            400,
            "admin-bad-request",
            "usage needs ?limit=NAME (and &tenant=ID)",
        );
    };
    let policy = &rt.policy;
    let Some((id, limit)) = policy.limit_named(name) else {
        return problem(404, "admin-not-found", &format!("no limit {name:?}"));
    };
    if !matches!(limit.params, Params::Quota(_)) {
        return problem(
            400,
            "admin-bad-request",
            &format!("limit {name:?} is not a quota"),
        );
    }
    if limit.key.ip || limit.key.credential || limit.key.route {
        return problem(
            400,
            "admin-bad-request",
            &format!("limit {name:?} is keyed by more than the tenant; usage is read per tenant"),
        );
    }
    let tenant: Option<Arc<str>> = match (limit.key.tenant, args.get("tenant")) {
        (true, Some(t)) => Some(t.as_str().into()),
        (true, None) => {
            return problem(
                400,
                "admin-bad-request",
                &format!("limit {name:?} is per tenant: add &tenant=ID"),
            )
        }
        (false, _) => None,
    };
    let tuned = tenant
        .as_ref()
        .and_then(|t| rt.tenant_override(t, rt.wall_ms()));
    let caller =
        crate::admission::Caller::of_tenant(policy, None, None, tenant.as_ref(), tuned.as_deref());
    let named: std::collections::HashMap<String, String> = args
        .iter()
        .filter(|(k, _)| crate::key_values::names_a_value(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // Read without charging or writing, from the store the quota lives in
    // (a failing one is a 503 here, whatever the limit's failure mode).
    let probe = match crate::admission::plan::named_charge(
        policy,
        id,
        &caller,
        "",
        0,
        Group::Request,
        &named,
    ) {
        Ok(p) => p,
        Err(dims) => {
            return problem(
                400,
                "admin-bad-request",
                &format!("limit {name:?} is keyed by {dims}: add &{dims}=VALUE"),
            )
        }
    };
    // The quota's numbers as this tenant's charges carry them (plan and
    // override applied).
    let Params::Quota(quota) = probe.params else {
        return problem(
            500,
            "admin-internal",
            "a plan changed the quota's algorithm",
        );
    };
    let verdict = match rt.limiter().peek(std::slice::from_ref(&probe)).await.pop() {
        Some((Ok(v), _)) => v,
        _ => {
            return problem(
                503,
                "admin-store-unavailable",
                "the limit store is unavailable",
            )
        }
    };
    // The period is the store's: the time the counter was read at.
    let now_ms = verdict.at;
    let (start, end) = quota.period.bounds(now_ms);
    let at = |ms: u64| {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
        humantime::format_rfc3339_seconds(t).to_string()
    };
    let body = serde_json::json!({
        "limit": limit.name.as_ref(),
        "tenant": tenant.as_deref(),
        "period": quota.period.name(now_ms),
        "period_start": at(start),
        "period_end": at(end),
        "quota": quota.limit,
        "used": quota.limit.saturating_sub(verdict.remaining),
        "remaining": verdict.remaining,
    });
    respond(200, "application/json", body.to_string().into_bytes())
}
