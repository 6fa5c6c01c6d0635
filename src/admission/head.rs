//! The head stage: what a request's head alone decides, before any caller
//! is known or any limit charged — its trace, its client IP and the IP
//! rules, its target normalized, its route, and its body bound. A plain
//! function of the policy and the head: no store, no clock, no metrics.

use std::net::IpAddr;

use pingora::http::RequestHeader;

use crate::client_ip;
use crate::config::{Policy, Route};
use crate::edge::target;
use crate::identity::auth::Credential;
use crate::key_values::RequestView;
use crate::respond::Rejection;
use crate::routes::{self, PathTemplate};

use super::Facts;

/// A request whose head found its route.
#[derive(Debug)]
pub struct Routed<'p> {
    /// The matched route.
    pub route: &'p Route,
    /// Its path template, for the keys that read `path.*`.
    pub template: &'p PathTemplate,
    /// The normalized path the route matched.
    pub path: String,
    /// The client network, as IP keys name it.
    pub network: ipnet::IpNet,
    /// The request's estimate before its body is read: what a header
    /// names (`cost_from_request`), or the route's cost.
    pub estimate: u64,
}

impl<'p> Routed<'p> {
    /// What the request says to its limits' keys, from the caller
    /// `credential` names (its vouched values), without the body.
    pub fn view<'a>(
        &'a self,
        req: &'a RequestHeader,
        credential: Option<&'a Credential>,
    ) -> RequestView<'a> {
        RequestView {
            headers: &req.headers,
            path: &self.path,
            template: Some(self.template),
            query: req.uri.query(),
            vouched: credential.and_then(|c| c.vouched.as_deref()),
            body: None,
            named: None,
        }
    }
}

/// Reads `req`'s head from the connection's `peer` under `policy`: the
/// route it takes, or why it stops here. Each fact is noted in `facts` as
/// soon as it is known, so that a refusal is logged with its client IP
/// and route.
pub fn route<'p>(
    policy: &'p Policy,
    peer: IpAddr,
    req: &RequestHeader,
    facts: &mut Facts,
) -> Result<Routed<'p>, Rejection> {
    let traceparent = req
        .headers
        .get("traceparent")
        .map(http::HeaderValue::as_bytes);
    let trusted = policy.client_ip.is_trusted(peer);
    facts.telemetry.trace = Some(crate::trace::TraceContext::of(
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
    if super::declared_length(req).is_some_and(|n| n > route.max_body_bytes) {
        return Err(Rejection::PayloadTooLarge);
    }
    Ok(Routed {
        route,
        template,
        path: target.path.into_owned(),
        network: client_ip::key_network(ip, policy.client_ip.ipv6_prefix),
        estimate,
    })
}
