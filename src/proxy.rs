//! The Pingora `ProxyHttp` implementation. The phases stay thin: each one
//! calls plain functions ([`admit`], [`crate::client_ip::resolve`], the
//! stores) and records what it learned in the [`RequestCtx`].

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::protocols::l4::socket::SocketAddr as PeerAddr;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};

use crate::auth::{self, Credential};
use crate::client_ip;
use crate::config::{LimitId, Mode, PlanId, PoolId, Target};
use crate::limits::{combine, Charge, Decision, Identity, Source, Verdict};
use crate::respond::{RateHeaders, Rejection};
use crate::routes::normalize_path;
use crate::runtime::Runtime;

/// Headers the gateway owns on the upstream request: client copies are dropped.
const IDENTITY_HEADERS: [&str; 3] = ["x-tenant-id", "x-credential-id", "x-route-class"];

/// Per-request state, carried through the phases.
#[derive(Default)]
pub struct RequestCtx {
    runtime: Option<Arc<Runtime>>,
    client_ip: Option<IpAddr>,
    route: Option<Arc<str>>,
    credential: Option<Arc<Credential>>,
    pool: Option<PoolId>,
    rate_headers: Option<RateHeaders>,
    /// The `outcome` label of `tollgate_requests_total`.
    outcome: &'static str,
    upstream_started: Option<std::time::Instant>,
}

/// What an admitted request does next.
#[derive(Debug)]
pub enum Admitted {
    Forward(PoolId),
    Respond {
        status: u16,
        body: Bytes,
        content_type: String,
    },
}

/// The gateway: the live policy, swapped atomically on reload.
pub struct Gateway {
    live: Arc<ArcSwap<Runtime>>,
}

impl Gateway {
    pub fn new(live: Arc<ArcSwap<Runtime>>) -> Self {
        Self { live }
    }
}

fn peer_ip(addr: Option<&PeerAddr>) -> IpAddr {
    addr.and_then(PeerAddr::as_inet)
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |a| a.ip().to_canonical())
}

/// Runs the request path up to (not including) pool admission: client IP,
/// IP rules, route, pre-auth limits, authentication, request limits.
///
/// Authentication is a local table lookup, so it runs before the limits and
/// both limit groups go to the store in one call; its result is acted on
/// only after the pre-auth limits, so callers observe the design's order: a
/// request denied by its IP limit gets 429 whatever its key, and a bad key
/// is charged to its IP before it gets 401.
pub async fn admit(
    rt: &Runtime,
    peer: IpAddr,
    req: &RequestHeader,
    ctx: &mut RequestCtx,
) -> Result<Admitted, Rejection> {
    let policy = &rt.policy;
    let ip = client_ip::resolve(peer, &req.headers, &policy.client_ip);
    ctx.client_ip = Some(ip);
    if !policy.ip_rules.admits(ip) {
        return Err(Rejection::Forbidden);
    }
    let path = normalize_path(req.uri.path()).map_err(|_| Rejection::NotFound)?;
    let route = policy
        .routes
        .find(req.method.as_str(), &path)
        .ok_or(Rejection::NotFound)?;
    ctx.route = Some(route.name.clone());

    let credential = if route.auth_required {
        auth::presented_key(&req.headers, &policy.auth.header)
            .and_then(|key| policy.auth.keys.verify(key))
    } else {
        None
    };
    let authenticated = !route.auth_required || credential.is_some();
    let who = Identity {
        ip: Some(client_ip::key_network(ip, policy.client_ip.ipv6_prefix)),
        credential: credential.as_deref().map(|c| c.id.as_ref()),
        tenant: credential.as_deref().map(|c| c.tenant.as_ref()),
        route: &route.name,
    };
    let plan = credential.as_ref().and_then(|c| c.plan);
    let mut charges = build_charges(rt, &route.pre_auth, &who, None, route.cost, PRE_AUTH);
    if authenticated {
        charges.extend(build_charges(
            rt,
            &route.request,
            &who,
            plan,
            route.cost,
            REQUEST,
        ));
    }
    let verdicts = if charges.is_empty() {
        Vec::new()
    } else {
        rt.limiter.decide(&charges).await
    };
    record_decisions(rt, &charges, &verdicts);
    if policy.ratelimit_headers {
        ctx.rate_headers = RateHeaders::most_constrained(&charges, &verdicts);
    }

    check_group(rt, &charges, &verdicts, PRE_AUTH)?;
    if !authenticated {
        return Err(Rejection::Unauthorized);
    }
    check_group(rt, &charges, &verdicts, REQUEST)?;
    ctx.credential = credential;

    Ok(match &route.target {
        Target::Upstream(pool) => {
            ctx.pool = Some(*pool);
            Admitted::Forward(*pool)
        }
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

/// Limit groups: pre-authentication limits are decided (and charged) first.
const PRE_AUTH: u8 = 0;
const REQUEST: u8 = 1;

fn build_charges(
    rt: &Runtime,
    ids: &[LimitId],
    who: &Identity<'_>,
    plan: Option<PlanId>,
    cost: u64,
    group: u8,
) -> Vec<Charge> {
    let policy = &rt.policy;
    ids.iter()
        .map(|&id| {
            let l = &policy.limits[id];
            let tenant_scoped = l.key.tenant || l.key.credential;
            Charge {
                limit: id,
                name: l.name.clone(),
                params: policy.params(id, plan),
                key: who.key(&l.name, l.key),
                tenant: who.tenant.filter(|_| tenant_scoped).map(Arc::from),
                cost,
                enforce: l.mode == Mode::Enforce,
                group,
                local: l.local,
                on_store_error: l.on_store_error,
            }
        })
        .collect()
}

fn check_group(
    rt: &Runtime,
    charges: &[Charge],
    verdicts: &[Verdict],
    group: u8,
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
            retry_after: rt.limiter.unavailable_retry_after(),
        }),
    }
}

/// Counts every limit decision by limit and outcome.
fn record_decisions(rt: &Runtime, charges: &[Charge], verdicts: &[Verdict]) {
    for (c, v) in charges.iter().zip(verdicts) {
        let outcome = match (v.source, v.allowed, c.enforce) {
            (Source::FailOpen, ..) => "fail_open",
            (Source::FailClosed, ..) => "fail_closed",
            (Source::Fallback, ..) => "local_fallback",
            (Source::Store, true, _) => "allowed",
            (Source::Store, false, true) => "limited",
            (Source::Store, false, false) => "shadow_limited",
        };
        rt.metrics
            .limit_decisions
            .with_label_values(&[c.name.as_ref(), outcome])
            .inc();
    }
}

/// Writes a complete response from the gateway itself.
async fn write(session: &mut Session, header: ResponseHeader, body: Bytes) -> Result<()> {
    session
        .write_response_header(Box::new(header), false)
        .await?;
    session.write_response_body(Some(body), true).await
}

async fn reject(session: &mut Session, rejection: &Rejection, ctx: &RequestCtx) -> Result<()> {
    let body = rejection.body();
    let header = rejection.header(body.len(), ctx.rate_headers.as_ref())?;
    write(session, header, body).await
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx::default()
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let rt = self.live.load_full();
        ctx.runtime = Some(rt.clone());
        let peer = peer_ip(session.client_addr());
        let admitted = admit(&rt, peer, session.req_header(), ctx).await;
        ctx.outcome = match &admitted {
            Ok(_) => "allowed",
            Err(rejection) => rejection.outcome(),
        };
        match admitted {
            Ok(Admitted::Forward(_)) => Ok(false),
            Ok(Admitted::Respond {
                status,
                body,
                content_type,
            }) => {
                let mut h = ResponseHeader::build(status, Some(3))?;
                h.insert_header("content-type", content_type)?;
                h.insert_header("content-length", body.len().to_string())?;
                if let Some(extra) = &ctx.rate_headers {
                    extra.apply(&mut h)?;
                }
                write(session, h, body).await?;
                Ok(true)
            }
            Err(rejection) => {
                reject(session, &rejection, ctx).await?;
                Ok(true)
            }
        }
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        let (Some(rt), Some(pool)) = (&ctx.runtime, ctx.pool) else {
            return Error::e_explain(ErrorType::InternalError, "no pool chosen for request");
        };
        let Some(addr) = rt.pools[pool].pick() else {
            return Error::e_explain(ErrorType::ConnectNoRoute, "pool has no servers");
        };
        let upstream = &rt.policy.upstreams[pool];
        ctx.upstream_started = Some(std::time::Instant::now());
        let mut peer = HttpPeer::new(addr, false, String::new());
        peer.options.connection_timeout = Some(upstream.connect_timeout);
        peer.options.read_timeout = Some(upstream.read_timeout);
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        for name in IDENTITY_HEADERS {
            upstream.remove_header(name);
        }
        if let Some(c) = &ctx.credential {
            upstream.insert_header("x-tenant-id", c.tenant.as_ref())?;
            upstream.insert_header("x-credential-id", c.id.as_ref())?;
        }
        if let Some(route) = &ctx.route {
            upstream.insert_header("x-route-class", route.as_ref())?;
        }
        let peer = peer_ip(session.client_addr());
        let forwarded = match upstream.headers.get("x-forwarded-for").map(|v| v.to_str()) {
            Some(Ok(prior)) if !prior.trim().is_empty() => format!("{prior}, {peer}"),
            _ => peer.to_string(),
        };
        upstream.insert_header("x-forwarded-for", forwarded)?;
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if let Some(extra) = &ctx.rate_headers {
            extra.apply(response)?;
        }
        Ok(())
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        let code = match e.etype() {
            ErrorType::HTTPStatus(code) => *code,
            _ => match e.esource() {
                ErrorSource::Upstream => 502,
                ErrorSource::Downstream => 0,
                ErrorSource::Internal | ErrorSource::Unset => 500,
            },
        };
        if code > 0 {
            let _ = reject(session, &Rejection::ProxyFailed { status: code }, ctx).await;
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        if let Some(rt) = &ctx.runtime {
            let route = ctx.route.as_deref().unwrap_or("unmatched");
            if !ctx.outcome.is_empty() {
                rt.metrics
                    .requests
                    .with_label_values(&[route, ctx.outcome])
                    .inc();
            }
            if let Some(started) = ctx.upstream_started {
                rt.metrics
                    .upstream_seconds
                    .with_label_values(&[route])
                    .observe(started.elapsed().as_secs_f64());
            }
        }
        tracing::debug!(
            route = ctx.route.as_deref().unwrap_or("-"),
            status,
            error = e.map(|e| e.to_string()),
            "request"
        );
    }
}
