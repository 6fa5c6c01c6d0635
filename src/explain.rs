//! What the gateway does with a request, limit by limit: the route it
//! takes, every limit that applies with its effective parameters, and (read
//! without charging) each limit's state for the caller. Served as
//! `GET /admin/explain`.

use std::net::IpAddr;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::admission;
use crate::client_ip;
use crate::config::{LimitId, Mode, PlanId, Policy, Route, Scope};
use crate::edge::target;
use crate::identity::auth::Credential;
use crate::limits::algorithm::{Params, MICRO};
use crate::limits::limiter::KeyStateError;
use crate::limits::{Charge, Group, Verdict};
use crate::routes;

/// What to explain: a request (`path`, `method`, `host`) and the identity
/// it comes with, as far as known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    /// The request path (and query), as a client sends it.
    pub path: String,
    /// `GET` when absent.
    pub method: String,
    /// The `Host` header.
    pub host: Option<String>,
    /// A credential id of the policy's keys.
    pub credential: Option<String>,
    /// A tenant; the credential's when absent.
    pub tenant: Option<String>,
    /// The client address.
    pub ip: Option<IpAddr>,
    /// A plan, for identities the gateway cannot look up; the credential's
    /// (or the tenant's first credential's) when absent.
    pub plan: Option<String>,
    /// The cost to read the limits for; the route's when absent.
    pub cost: Option<u64>,
    /// A caller already identified (a verified JWT, for `tollgate explain
    /// --key -`), used instead of looking `credential` up in the keys.
    pub verified: Option<Arc<Credential>>,
    /// Values of the dimensions read from requests, by name
    /// (`header.x-end-user=alice`).
    pub values: std::collections::HashMap<String, String>,
}

/// Why a query cannot be explained: a status and what to say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 400 or 404.
    pub status: u16,
    /// The problem's `type` suffix.
    pub kind: &'static str,
    /// What is wrong.
    pub detail: String,
}

fn bad(detail: String) -> Problem {
    Problem {
        status: 400,
        kind: "admin-bad-query",
        detail,
    }
}

impl Query {
    /// From a URL query string: `path`, `method`, `host`, `credential`,
    /// `tenant`, `ip`, `plan`, `cost`.
    pub fn parse(query: &str) -> Result<Self, Problem> {
        let mut q = Query {
            method: "GET".into(),
            ..Query::default()
        };
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            let value = value.into_owned();
            match name.as_ref() {
                "path" => q.path = value,
                "method" => q.method = value.to_ascii_uppercase(),
                "host" => q.host = Some(value),
                "credential" => q.credential = Some(value),
                "tenant" => q.tenant = Some(value),
                "plan" => q.plan = Some(value),
                "ip" => {
                    q.ip = Some(
                        value
                            .parse()
                            .map_err(|_| bad(format!("ip {value:?} is not an address")))?,
                    )
                }
                "cost" => {
                    q.cost = Some(
                        value
                            .parse()
                            .map_err(|_| bad(format!("cost {value:?} is not a whole number")))?,
                    )
                }
                other if crate::key_values::names_a_value(other) => {
                    q.values.insert(other.to_owned(), value);
                }
                other => return Err(bad(format!("unknown parameter {other:?}"))),
            }
        }
        if !q.path.starts_with('/') {
            return Err(bad("path must be given, starting with \"/\"".into()));
        }
        Ok(q)
    }
}

/// A query resolved against a policy: the route, the identity and, per
/// limit of the route, the charge a request would make (or the key
/// dimension the query lacks).
#[derive(Debug)]
pub struct Explained<'a> {
    /// The route the request takes.
    pub route: &'a Route,
    /// The plan applied.
    pub plan: Option<PlanId>,
    /// Per limit, in the route's order (pre-auth first): its id, and its
    /// charge or the dimension its key needs.
    pub limits: Vec<(LimitId, Result<Charge, admission::plan::Lacks>)>,
}

/// A caller an operator names: its credential, if any, and its tenant.
pub type NamedCaller = (Option<Arc<Credential>>, Option<Arc<str>>);

/// A credential an operator named that the policy's keys do not hold;
/// shown as its id alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{id}")]
pub struct UnknownCredential {
    /// The credential's id, as named.
    pub id: String,
}

/// The caller an operator names: a credential of the policy's keys (`Err`
/// with its id when there is none) and its tenant, or the tenant given.
pub fn caller(
    policy: &Policy,
    credential: Option<&str>,
    tenant: Option<&str>,
) -> Result<NamedCaller, UnknownCredential> {
    let credential = match credential {
        Some(id) => Some(
            policy
                .auth
                .keys
                .credentials()
                .find(|c| *c.id == *id)
                .cloned()
                .ok_or_else(|| UnknownCredential { id: id.to_string() })?,
        ),
        None => None,
    };
    let tenant = tenant
        .map(Arc::from)
        .or_else(|| credential.as_ref().map(|c| c.tenant.clone()));
    Ok((credential, tenant))
}

/// Resolves `q` as the gateway would: the normalized path picks the route,
/// the credential its tenant and plan.
pub fn resolve<'a>(
    policy: &'a Policy,
    q: &Query,
    tuned: impl Fn(&str) -> Option<Arc<crate::identity::overrides::Resolved>>,
) -> Result<Explained<'a>, Problem> {
    let (raw_path, _) = q.path.split_once('?').unwrap_or((&q.path, ""));
    let host = q.host.as_deref();
    let parsed = target::parse(
        raw_path.as_bytes(),
        host.map(str::as_bytes),
        policy.server.edge.path,
    )
    .map_err(|e| bad(format!("path: {}", e.detail())))?;
    let host = host.map(routes::request_host);
    let route = policy
        .routes
        .find(&q.method, host.as_deref(), &parsed.path)
        .ok_or_else(|| Problem {
            status: 404,
            kind: "admin-no-route",
            detail: format!("no route serves {} {}", q.method, q.path),
        })?;
    let (credential, tenant) = match &q.verified {
        Some(c) => (Some(c.clone()), Some(c.tenant.clone())),
        None => {
            caller(policy, q.credential.as_deref(), q.tenant.as_deref()).map_err(|e| Problem {
                status: 404,
                kind: "admin-unknown-credential",
                detail: format!("no credential {:?} in the policy's keys", e.id),
            })?
        }
    };
    let tuned = tenant.as_deref().and_then(tuned);
    let network =
        q.ip.map(|ip| client_ip::key_network(ip, policy.client_ip.ipv6_prefix));
    let mut caller = admission::Caller::of_tenant(
        policy,
        network,
        credential.as_deref(),
        tenant.as_ref(),
        tuned.as_deref(),
    );
    if let Some(name) = &q.plan {
        caller.plan = Some(
            policy
                .plans
                .iter()
                .position(|p| p.name == *name)
                .map(PlanId::new)
                .ok_or_else(|| bad(format!("unknown plan {name:?}")))?,
        );
    }
    let plan = caller.plan;
    let cost = q.cost.unwrap_or_else(|| route.admission_cost());
    let limits = route
        .pre_auth
        .iter()
        .map(|&id| (id, Group::PreAuth))
        .chain(route.request.iter().map(|&id| (id, Group::Request)))
        .map(|(id, group)| {
            let key = policy.limits[id].key;
            let needs = if key.ip && network.is_none() {
                Some("ip")
            } else if key.credential && credential.is_none() {
                Some("credential")
            } else if key.tenant && tenant.is_none() {
                Some("tenant")
            } else {
                None
            };
            let charge = match needs {
                Some(dim) => Err(admission::plan::Lacks::Caller(dim)),
                None => admission::plan::named_charge(
                    policy,
                    id,
                    &caller,
                    &route.name,
                    cost,
                    group,
                    &q.values,
                ),
            };
            (id, charge)
        })
        .collect();
    Ok(Explained {
        route,
        plan,
        limits,
    })
}

/// A limit's parameters as the policy writes them.
pub fn params_json(params: &Params) -> Value {
    match params {
        Params::TokenBucket(b) | Params::Gcra(b) => json!({
            "capacity": b.capacity / MICRO,
            "refill_per_second": b.per_ms as f64 * 1000.0 / MICRO as f64,
        }),
        Params::FixedWindow(w) | Params::SlidingWindow(w) | Params::SlidingLog(w) => json!({
            "limit": w.limit,
            "window_seconds": w.window_ms as f64 / 1000.0,
        }),
        Params::Quota(q) => json!({
            "limit": q.limit,
            "period": if q.period == crate::limits::algorithm::Period::Day { "day" } else { "month" },
        }),
        Params::Concurrency(c) => json!({
            "max_in_flight": c.max_in_flight,
            "hold_ttl_ms": c.hold_ttl_ms,
        }),
    }
}

/// The dimensions a limit's key is made of, as the policy names them.
pub fn key_dims(l: &crate::config::Limit) -> Vec<String> {
    [
        (l.key.ip, "ip"),
        (l.key.credential, "credential"),
        (l.key.tenant, "tenant"),
        (l.key.route, "route"),
    ]
    .into_iter()
    .filter(|(on, _)| *on)
    .map(|(_, dim)| dim.to_owned())
    .chain(l.values.dims.iter().map(ToString::to_string))
    .collect()
}

/// The algorithm's name in the policy.
pub fn algorithm(params: &Params) -> &'static str {
    match params {
        Params::TokenBucket(_) => "token_bucket",
        Params::Gcra(_) => "gcra",
        Params::FixedWindow(_) => "fixed_window",
        Params::SlidingWindow(_) => "sliding_window",
        Params::SlidingLog(_) => "sliding_log",
        Params::Quota(_) => "quota",
        Params::Concurrency(_) => "concurrency",
    }
}

/// The answer of `/admin/explain`: `states` holds, per limit with a
/// charge, what a peek read and the units this instance holds.
pub fn to_json(
    policy: &Policy,
    explained: &Explained<'_>,
    mut states: impl Iterator<Item = (Result<Verdict, KeyStateError>, u64)>,
) -> Value {
    let limits: Vec<Value> = explained
        .limits
        .iter()
        .map(|(id, charge)| {
            let l = &policy.limits[*id];
            // The charge's numbers: after the plan and the tenant's override.
            let params = match charge {
                Ok(c) => c.params,
                Err(_) => policy.params(*id, explained.plan),
            };
            let key = key_dims(l);
            let mut out = json!({
                "name": l.name.as_ref(),
                "scope": if l.scope == Scope::PreAuth { "pre_auth" } else { "request" },
                "key": key,
                "algorithm": algorithm(&params),
                "mode": if l.mode == Mode::Enforce { "enforce" } else { "shadow" },
                "store": if l.sync.is_local() { "local" } else { "shared" },
                "sync": if l.sync.lease().is_some() { "lease" } else { "exact" },
                "params": params_json(&params),
            });
            match charge {
                Err(dim) => out["state"] = json!(format!("needs {dim}")),
                Ok(c) => {
                    out["cost"] = json!(c.cost);
                    match states.next() {
                        Some((Ok(v), held)) => {
                            out["remaining"] = json!(v.remaining);
                            out["reset_ms"] = json!(v.reset_ms);
                            out["retry_after_ms"] = match (v.allowed, v.wait_ms) {
                                (true, _) => json!(0),
                                (false, Some(ms)) => json!(ms),
                                (false, None) => Value::Null,
                            };
                            if l.sync.lease().is_some() {
                                out["held_units"] = json!(held);
                            }
                        }
                        Some((Err(e), _)) => out["state"] = json!(format!("unavailable: {e}")),
                        None => out["state"] = json!("unavailable"),
                    }
                }
            }
            out
        })
        .collect();
    json!({
        "route": explained.route.name.as_ref(),
        "plan": explained.plan.map(|p| policy.plans[p].name.as_str()),
        "limits": limits,
    })
}

/// How `tollgate explain` shows a shared limit's store key.
pub enum StoreKeys<'a> {
    /// Hashed as the gateway hashes it.
    Hashed(&'a crate::limits::keys::KeyHasher),
    /// Not computed: why (the secret's variable is unset).
    Unknown(String),
    /// The memory store: keys never leave the process.
    InProcess,
}

/// The static half of an explanation as text, for `tollgate explain`: the
/// route, the caller, and per limit its effective parameters, its store
/// key and what a request of this cost needs of it.
pub fn to_text(
    policy: &Policy,
    q: &Query,
    explained: &Explained<'_>,
    keys: &StoreKeys<'_>,
) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let route = explained.route;
    let _ = writeln!(out, "route: {} ({} {})", route.name, q.method, q.path);
    let who = match (&q.verified, &q.credential, &q.tenant) {
        (Some(c), ..) => format!("credential {} of tenant {} (from a JWT)", c.id, c.tenant),
        (None, Some(c), _) => format!("credential {c} (from the keys)"),
        (None, None, Some(t)) => format!("tenant {t}"),
        (None, None, None) => "anonymous".into(),
    };
    let plan = explained
        .plan
        .map_or("none", |p| policy.plans[p].name.as_str());
    let _ = writeln!(out, "caller: {who}, plan {plan}");
    if explained.limits.is_empty() {
        let _ = writeln!(out, "limits: none");
    } else {
        let _ = writeln!(out, "limits, in the order they are decided:");
    }
    for (id, charge) in &explained.limits {
        let l = &policy.limits[*id];
        let params = match charge {
            Ok(c) => c.params,
            Err(_) => policy.params(*id, explained.plan),
        };
        let dims = key_dims(l);
        let numbers = params_json(&params)
            .as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, v)| match (v.as_str(), v.as_f64()) {
                        (Some(text), _) => format!("{k} {text}"),
                        (None, Some(n)) => format!("{k} {}", number(n)),
                        (None, None) => format!("{k} {v}"),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  {} ({}, key [{}]): {}, {numbers}; {}, {}, {}",
            l.name,
            if l.scope == Scope::PreAuth {
                "pre_auth"
            } else {
                "request"
            },
            dims.join(", "),
            algorithm(&params),
            if l.sync.is_local() { "local" } else { "shared" },
            if l.sync.lease().is_some() {
                "lease"
            } else {
                "exact"
            },
            if l.mode == Mode::Enforce {
                "enforce"
            } else {
                "shadow"
            },
        );
        match charge {
            Err(admission::plan::Lacks::Caller(dim)) => {
                let _ = writeln!(out, "    store key: needs the caller's {dim} (--{dim})");
            }
            Err(lacks) => {
                let _ = writeln!(out, "    store key: needs {lacks}");
            }
            Ok(c) => {
                let key = match keys {
                    StoreKeys::InProcess => "in process (backend: memory)".to_string(),
                    _ if c.is_local() => "in process (store: local)".to_string(),
                    StoreKeys::Hashed(hasher) => hasher.key(c),
                    StoreKeys::Unknown(why) => format!("not computed: {why}"),
                };
                let _ = writeln!(out, "    store key: {key}");
                let _ = writeln!(out, "    {}", needs(&params, c.cost));
            }
        }
    }
    out
}

/// A number as a policy writes it: `20`, `0.5`, at most three decimals.
pub fn number(n: f64) -> String {
    let text = format!("{n:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// What a request of `cost` needs of a limit, in its own terms.
fn needs(params: &Params, cost: u64) -> String {
    let cost_f = cost.max(1) as f64;
    let fits = |budget: f64| (budget / cost_f).floor();
    let per_second = |rate: f64| number(rate / cost_f);
    let head = format!("a request costs {cost}");
    match params {
        Params::TokenBucket(b) | Params::Gcra(b) => {
            let capacity = (b.capacity / MICRO) as f64;
            if cost as f64 > capacity {
                return format!("{head}: more than the capacity {capacity}, never admitted");
            }
            let rate = b.per_ms as f64 * 1000.0 / MICRO as f64;
            format!(
                "{head}: {} from a full budget, then {} a second",
                fits(capacity),
                per_second(rate)
            )
        }
        Params::FixedWindow(w) | Params::SlidingWindow(w) | Params::SlidingLog(w) => {
            if cost > w.limit {
                return format!("{head}: more than the limit {}, never admitted", w.limit);
            }
            format!(
                "{head}: {} a window of {} s",
                fits(w.limit as f64),
                number(w.window_ms as f64 / 1000.0)
            )
        }
        Params::Quota(q) => {
            if cost > q.limit {
                return format!("{head}: more than the limit {}, never admitted", q.limit);
            }
            let period = match q.period {
                crate::limits::algorithm::Period::Day => "day",
                _ => "month",
            };
            format!("{head}: {} a {period}", fits(q.limit as f64))
        }
        Params::Concurrency(c) => format!(
            "a request holds 1 while it runs: {} at once",
            c.max_in_flight
        ),
    }
}
