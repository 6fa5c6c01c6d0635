//! The request path up to pool admission, as plain functions over the
//! live policy: client IP, IP rules, route, pre-auth limits, API key and
//! request limits. What it learns goes into [`Facts`] for the later phases.

use std::net::IpAddr;
use std::sync::Arc;

use bytes::Bytes;
use pingora::http::RequestHeader;

use crate::client_ip;
use crate::config::{LimitId, Mode, OnAbandon, PlanId, Policy, PoolId, Route, RouteId, Target};
use crate::edge::target;
use crate::identity::auth::{self, Credential};
use crate::identity::overrides::Resolved;
use crate::key_values::{self as values, BodyValues, Refused, RequestView, Used};
use crate::limits::{combine, Charge, Decision, Group, Identity, Op, Source, Verdict};
use crate::metrics::DecisionOutcome;
use crate::pools::Party;
use crate::respond::{RateHeaders, Rejection};
use crate::routes;
use crate::runtime::Runtime;
use crate::top::Caller;

/// What the request path learned about one request.
#[derive(Debug, Default)]
pub struct Facts {
    /// The resolved client IP, once read.
    pub client_ip: Option<IpAddr>,
    /// The route class, once a route matched.
    pub route: Option<Arc<str>>,
    /// The matched route, by index in the policy.
    pub route_id: Option<RouteId>,
    /// The route class as an upstream header value.
    pub route_header: Option<http::HeaderValue>,
    /// The credential of a valid API key.
    pub credential: Option<Arc<Credential>>,
    /// Which source identified the caller: `file` (the policy's keys and
    /// its keys file) or `jwt`.
    pub auth_source: Option<&'static str>,
    /// `RateLimit-Policy` and `RateLimit` values, when the policy asks for them.
    pub rate_headers: Option<RateHeaders>,
    /// The matched route's cost, charged to each of its limits.
    pub cost: u64,
    /// The limits that denied the request, if any did.
    pub violated: Vec<Arc<str>>,
    /// The normalized origin-form target, when it differs from the one
    /// received: the upstream gets this one.
    pub rewritten_target: Option<String>,
    /// The matched route's body bound (→ 413).
    pub max_body_bytes: u64,
    /// The protocols the matched route lets an `Upgrade` request name.
    pub upgrade: Arc<[Box<str>]>,
    /// The matched route's bound on waiting for the upstream's response.
    pub upstream_timeout: Option<std::time::Duration>,
    /// The matched route's place when its pool is full.
    pub priority: crate::config::Priority,
    /// How long the request is held before it goes on (`on_limit: delay`).
    pub delay_ms: u64,
    /// What the request charged, for a route whose cost the response
    /// reports (`cost_from_response`); taken once it is settled.
    pub reconcile: Option<Reconcile>,
    /// The response header (and trailer) that reports the cost, removed
    /// before the client sees it (unless the route exposes it).
    pub hidden_cost_header: Option<http::HeaderName>,
    /// Whether the request target was accepted (so its path is normalized).
    pub target_ok: bool,
    /// The request's holds on concurrency limits, released when the
    /// facts are dropped with the request, however it ends.
    pub holds: Vec<crate::limits::holds::HoldGuard>,
    /// The trace the request belongs to (W3C `traceparent`).
    pub trace: Option<crate::trace::TraceContext>,
    /// When the decision of its limits began and ended, kept for a
    /// sampled trace's span.
    pub decided: Option<(std::time::Instant, std::time::Instant)>,
    /// The store calls that decided a sampled request.
    pub store_calls: Vec<crate::trace::CallRef>,
    /// The body to send instead of the client's: asking for a stream's
    /// usage (`include_usage`).
    pub rewritten_body: Option<Bytes>,
    /// The values its limits' keys read from it.
    pub used: Used,
    /// The usage ledger's room for its record, on a recording route.
    pub usage: Option<crate::usage::Slot>,
}

impl Facts {
    /// Who the request counts against in reports: the credential, or the
    /// client network before authentication.
    pub fn caller(&self, ipv6_prefix: u8) -> Option<Caller> {
        match &self.credential {
            Some(c) => Some(Caller::Credential(c.id.clone())),
            None => self.network(ipv6_prefix).map(Caller::Ip),
        }
    }

    /// Whose turns the request takes in a pool's queue: its tenant, or
    /// without a credential its client network.
    pub fn party(&self, ipv6_prefix: u8) -> Option<Party> {
        match &self.credential {
            Some(c) => Some(Party::Tenant(c.tenant.clone())),
            None => self.network(ipv6_prefix).map(Party::Network),
        }
    }

    /// The client's network, as IP keys name it.
    pub fn network(&self, ipv6_prefix: u8) -> Option<ipnet::IpNet> {
        self.client_ip
            .map(|ip| client_ip::key_network(ip, ipv6_prefix))
    }
}

/// What an admitted request does next.
#[derive(Debug)]
pub enum Admitted {
    /// Forward to this upstream pool.
    Forward(PoolId),
    /// Answer with the route's fixed response.
    Respond {
        /// The status code.
        status: u16,
        /// The response body.
        body: Bytes,
        /// The `Content-Type` header value.
        content_type: String,
    },
}

/// What a request will be decided on: its route and the charges of both
/// limit groups. Made by [`plan`] without waiting on anything.
#[derive(Debug)]
pub struct Plan<'a> {
    /// The matched route.
    pub route: &'a Route,
    /// Pre-auth charges, then (when the key is valid) the request charges.
    pub charges: Vec<Charge>,
    /// Whether the request may go past authentication.
    pub authenticated: bool,
    /// Set when only a lookup can say who the caller is. The pre-auth
    /// charges are decided first, and the lookup made only if they admit.
    pub lookup: Option<Pending>,
    /// A value a request limit's key cannot use (400): its request
    /// charges are not made, and the refusal comes after the pre-auth
    /// limits and authentication, in their order.
    pub refused: Option<Refused>,
    /// The request's estimate: what it names (`cost_from_request`), or the
    /// route's cost.
    pub estimate: u64,
    /// On a route that reads its body, the request's normalized path: its
    /// request charges wait for the body ([`admit_body`]).
    pub body_path: Option<String>,
}

/// The work that may name a caller the local lookups do not know, made
/// only once the pre-auth limits admitted the request: a JWT's signature
/// check, or in order the store's credentials, then the forward-auth
/// service.
#[derive(Debug, Clone, Default)]
pub struct Pending {
    /// The key is a JWT, to verify.
    pub jwt: bool,
    /// The field of the key's record among the store's credentials.
    pub store: Option<String>,
    /// The request's entry at the forward-auth service.
    pub forward: Option<crate::identity::forward_auth::Entry>,
    /// The request's normalized path, for the keys the caller's request
    /// limits read from it.
    pub path: String,
}

/// Runs the request path up to the limits: client IP, IP rules, target
/// and route, body bound, authentication, and the charges to decide.
///
/// Authentication by the keys, a JWT or a cached answer is local, so it
/// runs before the limits and both limit groups go to the store in one
/// call; its result is acted on only in [`conclude`], after the pre-auth
/// limits, so callers observe the design's order: a request denied by its
/// IP limit gets 429 whatever its key, and a bad key is charged to its IP
/// before it gets 401. A key only the forward-auth service can name leaves
/// the plan with its pre-auth charges and a `lookup` that [`admit`] makes
/// once they admit: one more round trip, for uncached callers only.
pub fn plan<'a>(rt: &'a Runtime, peer: IpAddr, req: &RequestHeader) -> Planned<'a> {
    let mut facts = Facts::default();
    let plan = plan_into(rt, peer, req, &mut facts);
    Planned { facts, plan }
}

/// What [`plan`] found: the request's facts as far as the path got (a
/// refusal is logged with its client IP and route), and the plan or why
/// the request stops there.
#[derive(Debug)]
pub struct Planned<'a> {
    /// What the path learnt of the request.
    pub facts: Facts,
    /// The charges to decide, or the refusal.
    pub plan: Result<Plan<'a>, Rejection>,
}

/// [`plan`], noting each fact as soon as it is known.
fn plan_into<'a>(
    rt: &'a Runtime,
    peer: IpAddr,
    req: &RequestHeader,
    facts: &mut Facts,
) -> Result<Plan<'a>, Rejection> {
    let policy = &rt.policy;
    let traceparent = req
        .headers
        .get("traceparent")
        .map(http::HeaderValue::as_bytes);
    let trusted = policy.client_ip.is_trusted(peer);
    facts.trace = Some(crate::trace::TraceContext::of(
        traceparent,
        trusted,
        policy.server.tracing.as_ref().map_or(0, |t| t.sample_ppm),
    ));
    let ip = client_ip::resolve(peer, &req.headers, &policy.client_ip);
    facts.client_ip = Some(ip);
    if !policy.ip_rules.admits(ip) {
        return Err(Rejection::Forbidden);
    }
    let host = req
        .headers
        .get(http::header::HOST)
        .map(http::HeaderValue::as_bytes)
        .or_else(|| req.uri.authority().map(|a| a.as_str().as_bytes()));
    let target =
        target::parse(req.raw_path(), host, policy.server.edge.path).map_err(|e| match e {
            e if e.is_not_found() => Rejection::NotFound,
            e => Rejection::BadRequest { detail: e.detail() },
        })?;
    facts.target_ok = true;
    let host = host
        .and_then(|h| std::str::from_utf8(h).ok())
        .map(routes::request_host);
    let (route, template) = policy
        .routes
        .find_with_template(req.method.as_str(), host.as_deref(), &target.path)
        .ok_or(Rejection::NotFound)?;
    facts.route = Some(route.name.clone());
    facts.route_id = Some(route.id);
    if let Some(ledger) = rt.services.usage.as_ref().filter(|_| rt.records(route.id)) {
        // Room for the request's record before any limit is charged: a
        // request the ledger could not record is not admitted.
        facts.usage = Some(ledger.slot().ok_or(Rejection::UsageUnavailable)?);
    }
    facts.route_header = Some(route.class_header.clone());
    // A route that reads its estimate from the body charges its pre-auth
    // limits the default, before the body is read.
    let estimate = route.estimate(&req.headers, None);
    facts.cost = estimate;
    facts.max_body_bytes = route.max_body_bytes;
    facts.upgrade = route.upgrade.clone();
    facts.upstream_timeout = route.timeout;
    facts.priority = route.priority;
    if target.rewritten {
        facts.rewritten_target = Some(target.origin_form());
    }
    if declared_length(req).is_some_and(|n| n > route.max_body_bytes) {
        return Err(Rejection::PayloadTooLarge);
    }

    let mut lookup = None;
    let verified = if route.auth_required {
        match authenticate(rt, &req.headers) {
            Identified::Known(c, source) => Some((c, source)),
            Identified::Refused(reason) => {
                rt.all_metrics().auth_failure(reason);
                None
            }
            Identified::Ask(entry) => {
                lookup = Some(entry);
                None
            }
        }
    } else {
        None
    };
    if let Some(pending) = &mut lookup {
        pending.path = target.path.to_string();
    }
    let (credential, now) = accept(rt, verified, facts);
    let network = client_ip::key_network(ip, policy.client_ip.ipv6_prefix);
    let tuned = credential
        .as_ref()
        .and_then(|c| rt.tenant_override(&c.tenant, now));
    let view = view_of(req, &target.path, Some(template), credential.as_deref());
    let mut charged = pre_auth_charges(policy, route, network, credential.as_deref(), &view)
        .map_err(|r| key_value(&r))?;
    let body_path = route.body.as_ref().map(|_| target.path.to_string());
    if charged.authenticated && body_path.is_none() {
        add_request_charges(
            &mut charged,
            policy,
            route,
            network,
            credential.as_deref(),
            tuned.as_deref(),
            &view,
        );
    }
    facts.used = charged.used;
    Ok(Plan {
        route,
        charges: charged.charges,
        authenticated: charged.authenticated,
        lookup,
        refused: charged.refused,
        estimate,
        body_path,
    })
}

/// The caller a source verified, unless revoked (refused as an unknown key
/// is), noted in `facts`; with the wall-clock time revocations and
/// overrides were read at (0 when there is no caller).
fn accept(
    rt: &Runtime,
    verified: Option<(Arc<Credential>, &'static str)>,
    facts: &mut Facts,
) -> (Option<Arc<Credential>>, u64) {
    // Revocations and overrides hold until a wall-clock expiry: read once.
    let now = verified.as_ref().map_or(0, |_| crate::clock::wall_ms());
    let credential = verified.filter(|(c, _)| {
        let revoked = rt.services.revocations.revoked(&c.id, now);
        if revoked {
            rt.all_metrics().auth_failure("revoked");
        }
        !revoked
    });
    facts.auth_source = credential.as_ref().map(|(_, source)| *source);
    let credential = credential.map(|(c, _)| c);
    facts.credential.clone_from(&credential);
    (credential, now)
}

/// Makes the pending lookups of a request whose pre-auth limits admitted
/// it. A caller they name gets the route's request charges added to `plan`
/// (returned: the index they start at); an unknown one stays
/// unauthenticated; a source that cannot answer is a 503.
async fn look_up(
    rt: &Runtime,
    plan: &mut Plan<'_>,
    mut pending: Pending,
    req: &RequestHeader,
    facts: &mut Facts,
) -> Result<Option<usize>, Rejection> {
    let path = std::mem::take(&mut pending.path);
    let identified = if pending.jwt {
        match verify_jwt(rt, &req.headers) {
            Ok(credential) => Some((credential, "jwt")),
            Err(reason) => {
                rt.all_metrics().auth_failure(reason);
                return Ok(None);
            }
        }
    } else {
        identify(rt, pending, req).await?
    };
    let Some((credential, source)) = identified else {
        rt.all_metrics().auth_failure("unknown");
        return Ok(None);
    };
    let (credential, now) = accept(rt, Some((credential, source)), facts);
    let Some(credential) = credential else {
        return Ok(None);
    };
    plan.authenticated = true;
    if plan.body_path.is_some() {
        // Its request charges wait for the body.
        return Ok(None);
    }
    let tuned = rt.tenant_override(&credential.tenant, now);
    let template = rt.policy.routes.template(plan.route.id);
    let view = view_of(req, &path, template, Some(&credential));
    let start =
        add_late_request_charges(rt, plan, facts, Some(&credential), tuned.as_deref(), &view);
    Ok(Some(start))
}

/// Adds to `plan` the request charges of a request whose caller or body
/// is known only now (a lookup named it, or its body was read), keyed by
/// what `view` says, or the value that refuses them; returns where they
/// start in `plan.charges`.
fn add_late_request_charges(
    rt: &Runtime,
    plan: &mut Plan<'_>,
    facts: &mut Facts,
    credential: Option<&Credential>,
    tuned: Option<&Resolved>,
    view: &RequestView<'_>,
) -> usize {
    let mut charged = Charges {
        charges: std::mem::take(&mut plan.charges),
        authenticated: plan.authenticated,
        refused: None,
        used: Used::default(),
    };
    let start = charged.charges.len();
    let ip = facts.client_ip.unwrap_or(IpAddr::from([0u8; 4]));
    let network = client_ip::key_network(ip, rt.policy.client_ip.ipv6_prefix);
    add_request_charges(
        &mut charged,
        &rt.policy,
        plan.route,
        network,
        credential,
        tuned,
        view,
    );
    plan.charges = charged.charges;
    plan.refused = charged.refused;
    facts.used.extend(charged.used);
    start
}

/// What a request's head says, for its limits' keys: `path` normalized,
/// matched by `template`, from the caller `credential` names.
fn view_of<'a>(
    req: &'a RequestHeader,
    path: &'a str,
    template: Option<&'a crate::routes::PathTemplate>,
    credential: Option<&'a Credential>,
) -> RequestView<'a> {
    RequestView {
        headers: &req.headers,
        path,
        template,
        query: req.uri.query(),
        vouched: credential.and_then(|c| c.vouched.as_deref()),
        body: None,
        named: None,
    }
}

/// A request's charges on `route`, and whether it may go past
/// authentication.
#[derive(Debug)]
pub struct Charges {
    /// The pre-auth charges, then the request charges when it may.
    pub charges: Vec<Charge>,
    /// Whether the request may go past authentication.
    pub authenticated: bool,
    /// A value a request limit's key cannot use: the request charges are
    /// left out, and the request is refused after the pre-auth limits.
    pub refused: Option<Refused>,
    /// The values its limits read.
    pub used: Used,
}

/// A request's charges on `route`, from the client network `network`, with
/// the credential its key proved (`None`: no valid key), its keys' values
/// read from `view`. The pre-auth limits are charged in any case, the
/// others only when it may go past authentication. Shared by the gateway
/// and `simulate`. A value a pre-auth limit cannot use refuses the request
/// before anything is charged.
pub fn charges(
    policy: &Policy,
    route: &Route,
    network: ipnet::IpNet,
    credential: Option<&Credential>,
    tuned: Option<&Resolved>,
    view: &RequestView<'_>,
) -> Result<Charges, Refused> {
    let mut charged = pre_auth_charges(policy, route, network, credential, view)?;
    if charged.authenticated {
        add_request_charges(
            &mut charged,
            policy,
            route,
            network,
            credential,
            tuned,
            view,
        );
    }
    Ok(charged)
}

/// The caller `who` a request's charges are keyed for.
fn who<'a>(
    route: &'a Route,
    network: ipnet::IpNet,
    credential: Option<&'a Credential>,
) -> Identity<'a> {
    Identity {
        ip: Some(network),
        credential: credential.map(|c| c.id.as_ref()),
        tenant: credential.map(|c| &c.tenant),
        route: &route.name,
    }
}

/// A request's pre-auth charges (see [`charges`]), and whether it may go
/// past authentication.
fn pre_auth_charges(
    policy: &Policy,
    route: &Route,
    network: ipnet::IpNet,
    credential: Option<&Credential>,
    view: &RequestView<'_>,
) -> Result<Charges, Refused> {
    let cost = route.admission_cost_of(route.estimate(view.headers, view.body));
    let mut used = Used::default();
    let charges = build_charges(
        policy,
        &route.pre_auth,
        &who(route, network, credential),
        None,
        None,
        cost,
        Group::PreAuth,
        view,
        &mut used,
    )?;
    Ok(Charges {
        charges,
        authenticated: !route.auth_required || credential.is_some(),
        refused: None,
        used,
    })
}

/// Adds an authenticated request's request charges (see [`charges`]) to
/// `charged`, or the value that refuses them.
fn add_request_charges(
    charged: &mut Charges,
    policy: &Policy,
    route: &Route,
    network: ipnet::IpNet,
    credential: Option<&Credential>,
    tuned: Option<&Resolved>,
    view: &RequestView<'_>,
) {
    // A tenant's override may name another plan, and numbers of its own.
    let plan = plan_of(policy, tuned, credential, None);
    let cost = route.admission_cost_of(route.estimate(view.headers, view.body));
    match build_charges(
        policy,
        &route.request,
        &who(route, network, credential),
        plan,
        tuned,
        cost,
        Group::Request,
        view,
        &mut charged.used,
    ) {
        Ok(request) => charged.charges.extend(request),
        Err(r) => charged.refused = Some(r),
    }
}

/// What the sources at hand say of a request's caller.
enum Identified {
    /// Known to this source (`file`, `jwt`, `forward` from the cache).
    Known(Arc<Credential>, &'static str),
    /// Refused, for this `tollgate_auth_failures_total` reason.
    Refused(&'static str),
    /// Only a lookup can say.
    Ask(Pending),
}

/// The caller a request's key names, and the source that knew it (`file`
/// for the policy's keys and its keys file, `jwt`, `forward` when the
/// service's answer is cached); else the failure's reason, or the entry to
/// ask the forward-auth service about. A JWT that fails is refused, never
/// tried as an API key.
fn authenticate(rt: &Runtime, headers: &http::HeaderMap) -> Identified {
    let policy = &rt.policy;
    let metrics = rt.all_metrics();
    let Some(key) = auth::presented_key(headers, &policy.auth.header) else {
        return Identified::Refused("missing");
    };
    if !policy.auth.jwt.is_empty() && crate::identity::jwt::looks_like_jwt(key) {
        // A signature check costs many times a key's lookup (and an
        // unknown `kid` a key-set fetch): it waits for the pre-auth limits,
        // so a flood of forged tokens is bounded by them first.
        return Identified::Ask(Pending {
            jwt: true,
            ..Pending::default()
        });
    }
    let digest = auth::digest(key);
    if let Some(c) = policy.auth.keys.verify_digest(&digest) {
        metrics.auth_lookup("file", "hit");
        return Identified::Known(c, "file");
    }
    metrics.auth_lookup("file", "miss");
    let mut pending = Pending::default();
    if policy.auth.store_keys.is_some() {
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        let field = crate::identity::store_keys::StoreKeys::field(store, &digest);
        let plans = |name: &str| policy.plan_id(name);
        let taken = |id: &str| policy.auth.keys.has_id(id);
        match rt
            .services
            .store_keys
            .cached(&field, rt.generation, plans, taken)
        {
            Some(crate::identity::store_keys::Lookup::Known(c)) => {
                metrics.auth_lookup("store", "cached");
                return Identified::Known(c, "store");
            }
            Some(crate::identity::store_keys::Lookup::Unknown) => {
                metrics.auth_lookup("store", "cached")
            }
            None => pending.store = Some(field),
        }
    }
    if let Some(service) = &policy.auth.forward {
        let entry = service.entry(headers);
        // The store comes first: its answer is not known yet.
        let cached = pending.store.is_none().then(|| service.cached(&entry));
        match cached.flatten() {
            Some(crate::identity::forward_auth::Answer::Known(c)) => {
                metrics.auth_lookup("forward", "cached");
                return Identified::Known(c, "forward");
            }
            Some(_) => metrics.auth_lookup("forward", "cached"),
            None => pending.forward = Some(entry),
        }
    }
    if pending.store.is_none() && pending.forward.is_none() {
        Identified::Refused("unknown")
    } else {
        Identified::Ask(pending)
    }
}

/// The plan a caller's limits run under: its tenant's override's, else
/// its credential's, else (for a tenant named alone) the plan of the
/// tenant's first credential.
pub fn plan_of(
    policy: &Policy,
    tuned: Option<&Resolved>,
    credential: Option<&Credential>,
    tenant: Option<&Arc<str>>,
) -> Option<PlanId> {
    tuned
        .and_then(|o| o.plan)
        .or_else(|| credential.and_then(|c| c.plan))
        .or_else(|| {
            let t = tenant?;
            policy
                .auth
                .keys
                .credentials()
                .find(|c| c.tenant == *t)
                .and_then(|c| c.plan)
        })
}

/// What [`conclude`] needs to know beyond the request: plain values, so
/// that the gateway and `simulate` conclude alike.
#[derive(Debug, Clone, Copy, Default)]
pub struct Conclusion {
    /// Whether to work out the `RateLimit` fields
    /// (`responses.ratelimit_headers: draft`).
    pub ratelimit_headers: bool,
    /// `Retry-After` of a 503 when the store is failing and a limit says
    /// `closed`.
    pub unavailable_retry_after: u64,
    /// The instances sharing the store (`store.expected_instances`): a
    /// charge the local fallback decided is settled against its share.
    pub instances: u32,
}

impl Conclusion {
    /// As the live policy and limiter say.
    pub fn of(rt: &Runtime) -> Self {
        Self {
            ratelimit_headers: rt.policy.ratelimit_headers,
            unavailable_retry_after: rt.limiter().unavailable_retry_after(),
            instances: rt.policy.store.expected_instances,
        }
    }
}

/// Acts on the limits' verdicts, group by group: the pre-auth limits, then
/// authentication, then the request limits. Plain inputs only: the
/// gateway and `simulate` both conclude here.
pub fn conclude(
    plan: &Plan<'_>,
    verdicts: &[Verdict],
    how: Conclusion,
    facts: &mut Facts,
) -> Result<Admitted, Rejection> {
    if how.ratelimit_headers {
        facts.rate_headers = RateHeaders::most_constrained(&plan.charges, verdicts);
    }
    let check = |group| check_group(&plan.charges, verdicts, group, how.unavailable_retry_after);
    check(Group::PreAuth).inspect_err(|r| facts.note(r))?;
    if !plan.authenticated {
        return Err(Rejection::Unauthorized);
    }
    if let Some(refused) = &plan.refused {
        return Err(key_value(refused));
    }
    check(Group::Request).inspect_err(|r| facts.note(r))?;
    if let Some(spec) = &plan.route.cost_from_response {
        facts.hidden_cost_header = spec.source.header().filter(|_| !spec.expose).cloned();
        facts.reconcile = Some(Reconcile {
            spec: spec.clone(),
            estimate: plan.estimate,
            reserved: plan.route.admission_cost_of(plan.estimate),
            route: plan.route.name.clone(),
            // What the store charged is settled in the store; what the
            // local fallback charged (the store failing), in this
            // process's share of the budget, where it was charged.
            charged: plan
                .charges
                .iter()
                .zip(verdicts)
                .filter(|(_, v)| v.allowed)
                .filter_map(|(c, v)| match v.source {
                    Source::Store => Some((c.clone(), v.at)),
                    Source::Fallback => Some((
                        Charge {
                            local: true,
                            ..crate::limits::plan::fallback_charge(c, how.instances.max(1))
                        },
                        v.at,
                    )),
                    _ => None,
                })
                .collect(),
        });
    }
    // Admitted after the longest wait an enforced limit scheduled it for.
    facts.delay_ms = plan
        .charges
        .iter()
        .zip(verdicts)
        .filter(|(c, _)| c.enforce)
        .map(|(_, v)| v.delay_ms)
        .max()
        .unwrap_or(0);
    Ok(match &plan.route.target {
        Target::Upstream(pool) => Admitted::Forward(*pool),
        Target::Respond {
            status,
            body,
            content_type,
        } => Admitted::Respond {
            status: *status,
            body: body.clone(),
            content_type: content_type.clone(),
        },
    })
}

/// The charges of an admitted request whose actual cost the response
/// reports: each with the store time it was charged at.
#[derive(Debug, Clone)]
pub struct Reconcile {
    /// Where the actual cost is read, and its bound.
    pub spec: crate::config::CostFromResponse,
    /// The route's cost.
    pub estimate: u64,
    /// What admission charged: the estimate, or `max` (`reserve: max`).
    pub reserved: u64,
    /// The route class, for the metric.
    pub route: Arc<str>,
    /// The charges made, with their store times.
    pub charged: Vec<(Charge, u64)>,
}

impl Reconcile {
    /// The actual cost a response reports in `headers`, at most `max`:
    /// the largest of its values when it reports several (several header
    /// lines, or a list), `max` for a whole number too large to hold, and
    /// the estimate in place of a value that is not a whole number
    /// (negative, fractional, malformed). `None` when the header is absent
    /// or holds no whole number at all (the estimate stands).
    pub fn actual(&self, headers: &http::HeaderMap) -> Option<u64> {
        let mut largest: Option<u64> = None;
        let mut unreadable = false;
        let header = self.spec.source.header()?;
        for value in headers.get_all(header) {
            for item in value.as_bytes().split(|&b| b == b',') {
                match reported_cost(item, self.spec.max) {
                    Reported::Empty => {}
                    Reported::Cost(n) => largest = Some(largest.map_or(n, |l| l.max(n))),
                    Reported::Unreadable => unreadable = true,
                }
            }
        }
        let largest = largest?;
        Some(if unreadable {
            largest.max(self.estimate.min(self.spec.max))
        } else {
            largest
        })
    }

    /// What a response that ended without reporting its cost is settled
    /// at.
    pub fn unreported(&self, end: Unreported) -> u64 {
        let metered = self.metered();
        match (end, self.spec.on_abandon) {
            (Unreported::Abandoned, OnAbandon::Max) => self.spec.max,
            // A body that completes without its usage, or that the upstream
            // breaks off, is charged the most: otherwise a client would
            // hide its usage by asking for none.
            (Unreported::Missing, _) if metered => self.spec.max,
            _ => self.estimate,
        }
    }

    /// Whether the cost is read from the response's body.
    pub fn metered(&self) -> bool {
        matches!(self.spec.source, crate::config::CostSource::Body(_))
    }

    /// A meter for the response's body, when the cost is read from it;
    /// `event_stream` says whether the body is a `text/event-stream`.
    pub fn meter(&self, event_stream: bool) -> Option<crate::limits::meter::Meter> {
        match &self.spec.source {
            crate::config::CostSource::Body(reader) => Some(crate::limits::meter::Meter::new(
                reader.clone(),
                event_stream,
            )),
            crate::config::CostSource::Header(_) => None,
        }
    }

    /// The settlement of a response that cost `settled`: the difference
    /// from what admission charged.
    pub fn delta(&self, settled: u64) -> i64 {
        settled as i64 - self.reserved as i64
    }
}

/// One value of a reported cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reported {
    /// Nothing between two commas (a list may have empty items).
    Empty,
    /// A whole number, at most the route's `max`.
    Cost(u64),
    /// Negative, fractional or not a number.
    Unreadable,
}

/// Reads one value of a reported cost: decimal digits, with spaces around
/// them. A number beyond what a `u64` holds is more than any `max`, so it
/// is `max`: an upstream that reports it spent that much is not let off
/// with the estimate.
fn reported_cost(item: &[u8], max: u64) -> Reported {
    if item.trim_ascii().is_empty() {
        return Reported::Empty;
    }
    match crate::config::decimal(item) {
        Some(n) => Reported::Cost(n.map_or(max, |n| n.min(max))),
        None => Reported::Unreadable,
    }
}

#[cfg(test)]
mod reported_costs {
    use super::*;

    fn reconcile() -> Reconcile {
        Reconcile {
            spec: crate::config::CostFromResponse {
                source: crate::config::CostSource::Header(http::HeaderName::from_static(
                    "x-usage-tokens",
                )),
                include_usage: false,
                max: 1000,
                expose: false,
                on_abandon: OnAbandon::Max,
                reserve: crate::config::Reserve::Estimate,
                max_debt: crate::limits::plan::DebtBound {
                    explicit: None,
                    default: 10_000,
                },
            },
            estimate: 10,
            reserved: 10,
            route: "r".into(),
            charged: Vec::new(),
        }
    }

    fn actual(lines: &[&str]) -> Option<u64> {
        let mut headers = http::HeaderMap::new();
        for line in lines {
            headers.append("x-usage-tokens", line.parse().unwrap());
        }
        reconcile().actual(&headers)
    }

    #[test]
    fn one_value_is_read_within_max() {
        assert_eq!(actual(&[]), None);
        assert_eq!(actual(&["42"]), Some(42));
        assert_eq!(actual(&[" 42 "]), Some(42));
        assert_eq!(actual(&["0"]), Some(0));
        assert_eq!(actual(&["5000"]), Some(1000));
        assert_eq!(actual(&["18446744073709551615"]), Some(1000));
    }

    #[test]
    fn a_value_beyond_what_the_gateway_holds_is_max() {
        assert_eq!(actual(&["18446744073709551616"]), Some(1000));
        assert_eq!(actual(&["99999999999999999999999"]), Some(1000));
        assert_eq!(actual(&["7", "99999999999999999999999"]), Some(1000));
    }

    #[test]
    fn several_values_are_the_largest() {
        assert_eq!(actual(&["3", "40"]), Some(40));
        assert_eq!(actual(&["40", "3"]), Some(40));
        assert_eq!(actual(&["3, 40, 7"]), Some(40));
        assert_eq!(actual(&["3,", "", ", 5"]), Some(5));
    }

    #[test]
    fn values_that_are_not_whole_numbers_keep_the_estimate() {
        for value in ["-5", "1.5", "abc", "+3", "0x10", "", ",", "1e3", "5 5"] {
            assert_eq!(actual(&[value]), None, "{value:?}");
        }
        // Beside a whole number, an unreadable value counts as the
        // estimate: the largest of the two is charged.
        assert_eq!(actual(&["3", "abc"]), Some(10));
        assert_eq!(actual(&["30, -1"]), Some(30));
    }
}

/// How a response whose cost the upstream reports ended without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreported {
    /// The client went away (connection closed, stream reset) before the
    /// cost arrived, whether or not the upstream had answered yet.
    Abandoned,
    /// The response completed without the header, or the upstream broke
    /// it after its headers: counted as `missing`.
    Missing,
    /// The upstream never answered (the request failed before a response).
    Unanswered,
}

/// The whole request path up to pool admission: [`plan`], the one store
/// call, the decisions counted, then [`conclude`].
pub async fn admit<'a>(
    rt: &'a Runtime,
    peer: IpAddr,
    req: &RequestHeader,
    facts: &mut Facts,
) -> Result<Admission<'a>, Rejection> {
    let planned = plan(rt, peer, req);
    *facts = planned.facts;
    let mut plan = planned.plan?;
    let mut verdicts = decide(rt, &plan.charges, facts).await;
    let pre_auth_admits = |plan: &Plan<'_>, verdicts: &[Verdict]| {
        check_group(&plan.charges, verdicts, Group::PreAuth, 0).is_ok()
    };
    if let Some(pending) = plan
        .lookup
        .take()
        .filter(|_| pre_auth_admits(&plan, &verdicts))
    {
        // Boxed: a lookup's state (a store or an HTTP call) is ten times
        // the rest of the decision's, and most requests never make one.
        match Box::pin(look_up(rt, &mut plan, pending, req, facts)).await {
            Ok(Some(start)) => verdicts.extend(decide(rt, &plan.charges[start..], facts).await),
            Ok(None) => {}
            Err(rejection) => {
                record_decisions(rt, &plan.charges, &verdicts);
                return Err(rejection);
            }
        }
    }
    record_decisions(rt, &plan.charges, &verdicts);
    if plan.body_path.is_some() && plan.authenticated && pre_auth_admits(&plan, &verdicts) {
        return Ok(Admission::ReadBody(BodyWait { plan, verdicts }));
    }
    conclude(&plan, &verdicts, Conclusion::of(rt), facts).map(Admission::Decided)
}

/// Where [`admit`] got to.
#[derive(Debug)]
pub enum Admission<'a> {
    /// Decided.
    Decided(Admitted),
    /// Past its pre-auth limits and authentication, on a route that reads
    /// its body: its request limits wait for the body ([`admit_body`]).
    ReadBody(BodyWait<'a>),
}

/// A request whose request limits wait for its body.
#[derive(Debug)]
pub struct BodyWait<'a> {
    plan: Plan<'a>,
    verdicts: Vec<Verdict>,
}

impl BodyWait<'_> {
    /// What the route reads from the body.
    pub fn reads(&self) -> &crate::config::BodyRead {
        self.plan
            .route
            .body
            .as_ref()
            .expect("a request waits for its body only on a route that reads it")
    }
}

/// A request's body, as read for its limits.
#[derive(Debug)]
pub enum BodyInput {
    /// Read whole (empty when there is none).
    Read(Bytes),
    /// Too large to read whole, and `oversize: absent`.
    Oversize,
}

/// Decides the request limits of a request that waited for its `body`:
/// its values read, its estimate named, and on a route that asks for a
/// stream's usage, the body to send instead (in `facts`). A body that is
/// not JSON is a 400 before any request limit is charged.
pub async fn admit_body(
    rt: &Runtime,
    wait: BodyWait<'_>,
    req: &RequestHeader,
    body: BodyInput,
    facts: &mut Facts,
) -> Result<Admitted, Rejection> {
    let BodyWait {
        mut plan,
        mut verdicts,
    } = wait;
    let reads = plan.route.body.as_ref().expect("checked by admit");
    let values = match &body {
        BodyInput::Read(bytes) => {
            BodyValues::parse(bytes, &reads.fields).map_err(|_| Rejection::BadRequest {
                detail: "The request body is not JSON.",
            })?
        }
        BodyInput::Oversize => BodyValues::oversize(),
    };
    if let (true, BodyInput::Read(bytes)) = (reads.include_usage, &body) {
        if completions(&req.uri) {
            facts.rewritten_body = crate::request_json::ask_for_usage(bytes)
                .map_err(|_| Rejection::BadRequest {
                    detail: "The request body names stream, stream_options or its \
                             include_usage more than once.",
                })?
                .map(Bytes::from);
        }
    }
    let credential = facts.credential.clone();
    let now = credential.as_ref().map_or(0, |_| crate::clock::wall_ms());
    let tuned = credential
        .as_ref()
        .and_then(|c| rt.tenant_override(&c.tenant, now));
    let path = plan.body_path.take().unwrap_or_default();
    let template = rt.policy.routes.template(plan.route.id);
    let mut view = view_of(req, &path, template, credential.as_deref());
    view.body = Some(&values);
    plan.estimate = plan.route.estimate(&req.headers, Some(&values));
    facts.cost = plan.estimate;
    let start = add_late_request_charges(
        rt,
        &mut plan,
        facts,
        credential.as_deref(),
        tuned.as_deref(),
        &view,
    );
    if plan.refused.is_none() {
        let fresh = decide(rt, &plan.charges[start..], facts).await;
        record_decisions(rt, &plan.charges[start..], &fresh);
        verdicts.extend(fresh);
    }
    conclude(&plan, &verdicts, Conclusion::of(rt), facts)
}

/// Whether a request goes to an OpenAI (chat) completions endpoint, the
/// ones that take `stream_options`.
fn completions(uri: &http::Uri) -> bool {
    uri.path().trim_end_matches('/').ends_with("/completions")
}

fn verify_jwt(rt: &Runtime, headers: &http::HeaderMap) -> Result<Arc<Credential>, &'static str> {
    let policy = &rt.policy;
    let key = auth::presented_key(headers, &policy.auth.header).ok_or("missing")?;
    let plans = |name: &str| policy.plan_id(name);
    let verified = policy.auth.jwt.verify(key, plans);
    let result = if verified.is_ok() { "hit" } else { "miss" };
    rt.all_metrics().auth_lookup("jwt", result);
    verified.map(Arc::new).map_err(|failure| failure.reason())
}

/// The caller the store's credentials, then the forward-auth service,
/// name; `None` when neither knows the key. A store that cannot answer
/// leaves the caller to the forward-auth service; 503 only when no source
/// that answered named it and one could not answer.
async fn identify(
    rt: &Runtime,
    pending: Pending,
    req: &RequestHeader,
) -> Result<Option<(Arc<Credential>, &'static str)>, Rejection> {
    let metrics = rt.all_metrics();
    let unavailable = |why: &dyn std::fmt::Display| {
        metrics.auth_failure("unavailable");
        tracing::warn!(target: crate::logs::REQUEST, reason = %why, "a source of identities gave no answer");
        Rejection::AuthUnavailable
    };
    let mut store_down = None;
    if let Some(field) = pending.store {
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        let plans = |name: &str| rt.policy.plan_id(name);
        let (found, called) = rt
            .services
            .store_keys
            .look_up(store, &field, rt.generation, plans, |id| {
                rt.policy.auth.keys.has_id(id)
            })
            .await;
        let result = match (&found, called) {
            (Err(_), _) => "error",
            (_, false) => "cached",
            (Ok(crate::identity::store_keys::Lookup::Known(_)), true) => "hit",
            (Ok(crate::identity::store_keys::Lookup::Unknown), true) => "miss",
        };
        metrics.auth_lookup("store", result);
        match found {
            Ok(crate::identity::store_keys::Lookup::Known(c)) => return Ok(Some((c, "store"))),
            Ok(crate::identity::store_keys::Lookup::Unknown) => {}
            // One source down is not the gate: the next may name the
            // caller. Only a key no source could answer for is refused.
            Err(e) => store_down = Some(e),
        }
    }
    let (Some(entry), Some(service)) = (pending.forward, &rt.policy.auth.forward) else {
        return match store_down {
            Some(e) => Err(unavailable(&e)),
            None => Ok(None),
        };
    };
    let started = crate::clock::instant();
    let (answer, via) = service.ask(entry, &req.headers).await;
    if via == crate::identity::forward_auth::Via::Call {
        metrics
            .forward_auth_seconds
            .observe(started.elapsed().as_secs_f64());
    }
    let result = match (&answer, via) {
        (crate::identity::forward_auth::Answer::Unavailable(_), _) => "error",
        (_, crate::identity::forward_auth::Via::Cache) => "cached",
        (crate::identity::forward_auth::Answer::Known(_), _) => "hit",
        (crate::identity::forward_auth::Answer::Unknown, _) => "miss",
    };
    metrics.auth_lookup("forward", result);
    match (answer, store_down) {
        (crate::identity::forward_auth::Answer::Known(c), _) => Ok(Some((c, "forward"))),
        // The store, which could not answer, may know the key.
        (crate::identity::forward_auth::Answer::Unknown, Some(e)) => Err(unavailable(&e)),
        (crate::identity::forward_auth::Answer::Unknown, None) => Ok(None),
        (crate::identity::forward_auth::Answer::Unavailable(why), _) => Err(unavailable(&why)),
    }
}

/// The verdicts of `charges`, in one store call (none for no charges).
/// The holds it takes on concurrency limits are the request's until
/// `facts` is dropped; watched from before the call, so that a request
/// dropped while it is decided releases them too.
async fn decide(rt: &Runtime, charges: &[Charge], facts: &mut Facts) -> Vec<Verdict> {
    if charges.is_empty() {
        return Vec::new();
    }
    let limiter = rt.limiter();
    let timed = facts.trace.is_some_and(|t| t.sampled);
    let started = timed.then(crate::clock::instant);
    let holds = limiter.watch_holds(charges);
    let verdicts = if timed {
        // The store calls that decide it are noted, and exported.
        let noted = std::cell::RefCell::new(Vec::new());
        let (verdicts, calls) = crate::trace::STORE_CALLS
            .scope(noted, async {
                let verdicts = limiter.decide(charges).await;
                (verdicts, crate::trace::STORE_CALLS.with(|c| c.take()))
            })
            .await;
        facts.store_calls.extend(calls);
        verdicts
    } else {
        limiter.decide(charges).await
    };
    if let Some(holds) = holds {
        limiter.holds_decided(charges, &verdicts);
        facts.holds.push(holds);
    }
    if let Some(started) = started {
        // From the first call's start to the last one's end.
        let first = facts.decided.map_or(started, |(first, _)| first);
        facts.decided = Some((first, crate::clock::instant()));
    }
    verdicts
}

/// The request's `content-length`, when it has one (the edge already
/// refused malformed or conflicting ones).
pub fn declared_length(req: &RequestHeader) -> Option<u64> {
    req.headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

impl Facts {
    fn note(&mut self, rejection: &Rejection) {
        if let Rejection::RateLimited { violated, .. } = rejection {
            self.violated.clone_from(violated);
        }
    }
}

/// The 400 of a value a limit's key cannot use.
fn key_value(refused: &Refused) -> Rejection {
    Rejection::KeyValue {
        kind: refused.problem.kind(),
        detail: refused.detail(),
    }
}

/// The charges of limits `ids` for caller `who`, each keyed by what it
/// reads from `view`; a limit whose value is absent and says `skip` is
/// left out.
#[allow(clippy::too_many_arguments)]
fn build_charges(
    policy: &Policy,
    ids: &[LimitId],
    who: &Identity<'_>,
    plan: Option<PlanId>,
    tuned: Option<&Resolved>,
    cost: u64,
    group: Group,
    view: &RequestView<'_>,
    used: &mut Used,
) -> Result<Vec<Charge>, Refused> {
    let mut out = Vec::with_capacity(ids.len());
    for &id in ids {
        let l = &policy.limits[id];
        if l.values.is_empty() {
            out.push(charge(policy, id, who, plan, tuned, cost, group));
            continue;
        }
        match values::read(&l.values, view) {
            Ok(read) => {
                used.note(&l.name, &l.values, &read);
                let overridden = tuned.and_then(|o| o.params(id)).is_some();
                let c = charge(policy, id, who, plan, tuned, cost, group);
                out.extend(read.keyed(c, overridden));
            }
            Err(problem) => {
                let dim = l.values.dims.iter().map(ToString::to_string);
                return Err(Refused {
                    limit: l.name.clone(),
                    dim: dim.collect::<Vec<_>>().join(", "),
                    problem,
                });
            }
        }
    }
    Ok(out)
}

/// The charge of `cost` to limit `id` for caller `who`, under `plan` and
/// the tenant's override (`tuned`), whose numbers come first. A key read
/// from the request adds its parts to the charge's key
/// ([`values::push_parts`]).
pub fn charge(
    policy: &Policy,
    id: LimitId,
    who: &Identity<'_>,
    plan: Option<PlanId>,
    tuned: Option<&Resolved>,
    cost: u64,
    group: Group,
) -> Charge {
    let l = &policy.limits[id];
    let tenant_scoped = l.key.tenant || l.key.credential;
    // A concurrency limit holds one unit per request, whatever its cost.
    let hold = l
        .params
        .is_concurrency()
        .then(crate::limits::holds::next_id);
    Charge {
        limit: id,
        name: l.name.clone(),
        params: tuned
            .and_then(|o| o.params(id))
            .unwrap_or_else(|| policy.params(id, plan)),
        key: who.key(&l.name, l.key),
        tenant: who.tenant.filter(|_| tenant_scoped).cloned(),
        cost: if hold.is_some() { 1 } else { cost },
        enforce: l.mode == Mode::Enforce,
        group,
        local: l.local,
        on_store_error: l.on_store_error,
        lease: l.lease,
        op: Op::Decide {
            max_delay_ms: l.max_delay_ms,
        },
        hold,
    }
}

fn check_group(
    charges: &[Charge],
    verdicts: &[Verdict],
    group: Group,
    unavailable_retry_after: u64,
) -> Result<(), Rejection> {
    match combine(charges, verdicts, group) {
        Decision::Allow => Ok(()),
        Decision::Deny {
            violated,
            retry_after,
        } => Err(Rejection::RateLimited {
            violated,
            retry_after,
        }),
        Decision::Unavailable => Err(Rejection::StoreUnavailable {
            retry_after: unavailable_retry_after,
        }),
        Decision::Shed(_) => Err(Rejection::Overloaded { retry_after: 1 }),
    }
}

/// Counts every limit decision by limit and outcome, and a decision the
/// gateway shed once, by why.
fn record_decisions(rt: &Runtime, charges: &[Charge], verdicts: &[Verdict]) {
    if let Some(Source::Shed(why)) = verdicts.first().map(|v| v.source) {
        rt.all_metrics().overload_shed(why.reason());
        return;
    }
    for (c, v) in charges.iter().zip(verdicts) {
        let outcome = match (v.source, v.allowed, c.enforce) {
            // A shed decision sheds every charge of it (above).
            (Source::Shed(_), ..) => continue,
            (Source::FailOpen, ..) => DecisionOutcome::FailOpen,
            (Source::FailClosed, ..) => DecisionOutcome::FailClosed,
            (Source::Fallback, ..) => DecisionOutcome::LocalFallback,
            (Source::Store, true, _) if v.delay_ms > 0 => DecisionOutcome::Delayed,
            (Source::Store, true, _) => DecisionOutcome::Allowed,
            (Source::Store, false, true) => DecisionOutcome::Limited,
            (Source::Store, false, false) => DecisionOutcome::ShadowLimited,
        };
        rt.metrics().decision(c.limit, outcome);
    }
}

#[cfg(test)]
mod tests;
