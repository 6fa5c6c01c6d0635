//! The request path up to pool admission, in stages:
//!
//! 1. [`head`]: the head alone — client IP, IP rules, target, route, body
//!    bound. Pure.
//! 2. [`identify`]: the caller, from the sources in memory (the policy's
//!    keys, cached answers); the sources that cost wait for stage 4.
//! 3. [`plan`]: the charges of the route's limits, keyed for that caller
//!    by what the request says. Pure: the gateway, `simulate`, `explain`
//!    and the admin API all charge here.
//! 4. The store decides them in one call (pre-auth and request limits
//!    together when the caller is known). A caller only a lookup can name
//!    is looked up once the pre-auth limits admitted the request, and its
//!    request limits decided in a second call; on a route that reads its
//!    body, the request limits wait for it ([`admit_body`]).
//! 5. [`mod@conclude`]: the verdicts acted on in order — pre-auth limits,
//!    authentication, request limits. Pure.
//!
//! What the request path learns goes into [`Facts`] for the later
//! phases: what was decided, what the request holds until it ends
//! ([`Held`]), and what its trace is told ([`Telemetry`]).

use std::net::IpAddr;
use std::sync::Arc;

use bytes::Bytes;
use pingora::http::RequestHeader;

use crate::client_ip;
use crate::config::{PoolId, RouteId};
use crate::identity::auth::Credential;
use crate::identity::AuthSource;
use crate::key_values::{BodyValues, Used};
use crate::limits::{Charge, Group, Source, Verdict};
use crate::metrics::DecisionOutcome;
use crate::pools::Party;
use crate::respond::{RateHeaders, Rejection};
use crate::runtime::Runtime;
use crate::top::Caller as Reported;

pub mod conclude;
pub mod head;
pub mod identify;
pub mod plan;
pub mod settle;

pub use conclude::{conclude, Conclusion};
pub use plan::{charge, plan_of, Caller, Charges, Groups, Plan};
pub use settle::{Reconcile, Unreported};

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
    /// Which source named the caller.
    pub auth_source: Option<AuthSource>,
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
    /// The body to send instead of the client's: asking for a stream's
    /// usage (`include_usage`).
    pub rewritten_body: Option<Bytes>,
    /// The values its limits' keys read from it.
    pub used: Used,
    /// What it holds until it ends.
    pub held: Held,
    /// What its trace is told.
    pub telemetry: Telemetry,
}

/// What a request holds of shared capacity, each released when dropped:
/// when the request's context drops, however it ends, or earlier, once
/// the upstream's answer is complete ([`Held::release_upstream`]).
#[derive(Debug, Default)]
pub struct Held {
    /// Its slot in its upstream pool.
    pub permit: Option<crate::pools::PoolPermit>,
    /// Its holds on concurrency limits.
    pub holds: Vec<crate::limits::holds::HoldGuard>,
    /// The share of `buffered_bytes_total` its body, read whole, takes.
    pub body: Option<crate::edge::body::BodyReservation>,
    /// The usage ledger's room for its record, on a recording route.
    pub usage: Option<crate::usage::Slot>,
}

impl Held {
    /// Releases what bounds the upstream's work (the pool slot and the
    /// concurrency holds): the upstream is done with the request.
    pub fn release_upstream(&mut self) {
        self.permit = None;
        self.holds.clear();
    }
}

/// What a sampled request's trace is told.
#[derive(Debug, Default)]
pub struct Telemetry {
    /// The trace the request belongs to (W3C `traceparent`).
    pub trace: Option<crate::trace::TraceContext>,
    /// When the decision of its limits began and ended, for its span (on
    /// tokio's clock, as every span of the request).
    pub decided: Option<(tokio::time::Instant, tokio::time::Instant)>,
    /// The store calls that decided it.
    pub store_calls: Vec<crate::trace::CallRef>,
}

impl Facts {
    /// Who the request counts against in reports: the credential, or the
    /// client network before authentication.
    pub fn caller(&self, ipv6_prefix: u8) -> Option<Reported> {
        match &self.credential {
            Some(c) => Some(Reported::Credential(c.id.clone())),
            None => self.network(ipv6_prefix).map(Reported::Ip),
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

/// The whole request path up to pool admission: the head, the caller,
/// the plan, the store's verdicts (counted), then [`conclude()`].
pub async fn admit<'a>(
    rt: &'a Runtime,
    peer: IpAddr,
    req: &RequestHeader,
    facts: &mut Facts,
) -> Result<Admission<'a>, Rejection> {
    *facts = Facts::default();
    let policy = &rt.policy;
    let routed = head::route(policy, peer, req, facts)?;
    let route = routed.route;
    if let Some(ledger) = rt.services.usage.as_ref().filter(|_| rt.records(route.id)) {
        // Room for the request's record before any limit is charged: a
        // request the ledger could not record is not admitted.
        facts.held.usage = Some(ledger.slot().ok_or(Rejection::UsageUnavailable)?);
    }
    // Revocations and overrides hold until a wall-clock expiry, cached
    // answers until a monotonic one: each clock is read once.
    let now = rt.wall_ms();
    let monotonic = tokio::time::Instant::now();
    let mut lookup = None;
    let verified = if route.auth_required {
        match identify::authenticate(rt, &req.headers, monotonic) {
            identify::Identified::Known(c, source) => Some((c, source)),
            identify::Identified::Refused(reason) => {
                rt.all_metrics().auth_failure(reason);
                None
            }
            identify::Identified::Ask(pending) => {
                lookup = Some(pending);
                None
            }
        }
    } else {
        None
    };
    let credential = identify::accept(rt, verified, now, facts);
    let tuned = credential
        .as_ref()
        .and_then(|c| rt.tenant_override(&c.tenant, now));
    let caller = Caller::new(
        policy,
        Some(routed.network),
        credential.as_deref(),
        tuned.as_deref(),
    );
    // On a route that reads its body, the request limits wait for it.
    let groups = if route.body.is_some() {
        Groups::PreAuth
    } else {
        Groups::Both
    };
    let view = routed.view(req, credential.as_deref());
    let mut charged =
        plan::plan(policy, route, &view, &caller, groups).map_err(|r| conclude::key_value(&r))?;
    facts.used = std::mem::take(&mut charged.used);
    let mut plan = Plan::new(route, charged, routed.estimate);
    let mut verdicts = decide(rt, &plan.charges, facts).await;
    if let Some(pending) = lookup.filter(|_| conclude::admits(&plan, &verdicts, Group::PreAuth)) {
        // Boxed: a lookup's state (a store or an HTTP call) is ten times
        // the rest of the decision's, and most requests never make one.
        let found = match Box::pin(identify::look_up(rt, pending, &req.headers, now)).await {
            Ok(found) => found,
            Err(rejection) => {
                record_decisions(rt, &plan.charges, &verdicts);
                return Err(rejection);
            }
        };
        if let Some(credential) = identify::accept(rt, found, now, facts) {
            plan.authenticated = true;
            if groups == Groups::Both {
                let tuned = rt.tenant_override(&credential.tenant, now);
                let caller = Caller::new(
                    policy,
                    Some(routed.network),
                    Some(&credential),
                    tuned.as_deref(),
                );
                let view = routed.view(req, Some(&credential));
                let start = plan.add_request_charges(policy, &view, &caller, &mut facts.used);
                verdicts.extend(decide(rt, &plan.charges[start..], facts).await);
            }
        }
    }
    record_decisions(rt, &plan.charges, &verdicts);
    if groups == Groups::PreAuth
        && plan.authenticated
        && conclude::admits(&plan, &verdicts, Group::PreAuth)
    {
        return Ok(Admission::ReadBody(BodyWait {
            plan,
            verdicts,
            path: routed.path,
            network: routed.network,
        }));
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
    /// The normalized path its route matched.
    path: String,
    /// Its client network.
    network: ipnet::IpNet,
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
        path,
        network,
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
    let now = credential.as_ref().map_or(0, |_| rt.wall_ms());
    let tuned = credential
        .as_ref()
        .and_then(|c| rt.tenant_override(&c.tenant, now));
    let policy = &rt.policy;
    let caller = Caller::new(
        policy,
        Some(network),
        credential.as_deref(),
        tuned.as_deref(),
    );
    let view = crate::key_values::RequestView {
        headers: &req.headers,
        path: &path,
        template: policy.routes.template(plan.route.id),
        query: req.uri.query(),
        vouched: credential.as_ref().and_then(|c| c.vouched.as_deref()),
        body: Some(&values),
        named: None,
    };
    plan.estimate = plan.route.estimate(&req.headers, Some(&values));
    facts.cost = plan.estimate;
    let start = plan.add_request_charges(policy, &view, &caller, &mut facts.used);
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

/// The verdicts of `charges`, in one store call (none for no charges).
/// The holds it takes on concurrency limits are the request's until
/// `facts` is dropped; watched from before the call, so that a request
/// dropped while it is decided releases them too.
async fn decide(rt: &Runtime, charges: &[Charge], facts: &mut Facts) -> Vec<Verdict> {
    if charges.is_empty() {
        return Vec::new();
    }
    let limiter = rt.limiter();
    let timed = facts.telemetry.trace.is_some_and(|t| t.sampled);
    let started = timed.then(tokio::time::Instant::now);
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
        facts.telemetry.store_calls.extend(calls);
        verdicts
    } else {
        limiter.decide(charges).await
    };
    if let Some(holds) = holds {
        limiter.holds_decided(charges, &verdicts);
        facts.held.holds.push(holds);
    }
    if let Some(started) = started {
        // From the first call's start to the last one's end.
        let first = facts.telemetry.decided.map_or(started, |(first, _)| first);
        facts.telemetry.decided = Some((first, tokio::time::Instant::now()));
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

/// Counts every limit decision by limit and outcome, and a decision the
/// gateway shed once, by why.
fn record_decisions(rt: &Runtime, charges: &[Charge], verdicts: &[Verdict]) {
    if let Some(Source::Shed(why)) = verdicts.first().map(|v| v.source) {
        rt.all_metrics().overload_shed(why.reason());
        return;
    }
    for (c, v) in charges.iter().zip(verdicts) {
        let outcome = match (v.source, v.allowed, c.enforced()) {
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
