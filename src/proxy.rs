//! The Pingora `ProxyHttp` implementation. The phases stay thin: each one
//! calls plain functions ([`admission::admit`], the pools, [`respond`]) and
//! keeps what it learned in the [`RequestCtx`].
//!
//! [`respond`]: crate::respond

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::time::Instant;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::protocols::l4::socket::SocketAddr as PeerAddr;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};

use crate::access_log::{self, AccessLog, Line};
use crate::admission::{self, Admission, Admitted, BodyInput, Facts};
use crate::config::UpstreamProtocol;
use crate::config::{HostHeader, Oversize, PoolId};
use crate::drain::{Drain, InFlight};
use crate::edge::body::{self, BodyReservation};
use crate::edge::headers::{self, Forwarding};
use crate::identity::AuthSource;
use crate::limits::meter::{Meter, MAX_HELD};
use crate::metrics::Outcome;
use crate::pools::{PoolRefusal, Retry};
use crate::respond::Rejection;
use crate::runtime::Runtime;
use crate::top::Caller;

// Added headers are named by `&'static str`: Pingora then keeps the name as
// given (no allocation), where a `HeaderName` of a non-standard header would
// be title-cased into a new buffer first. Lookups use `HeaderName`s, which
// need no parsing.
const TENANT_ID: &str = "x-tenant-id";
const CREDENTIAL_ID: &str = "x-credential-id";
const ROUTE_CLASS: &str = "x-route-class";

/// One denial in this many is logged at info level.
const DENIAL_LOG_SAMPLE: u64 = 100;

/// Per-request state, carried through the phases.
#[derive(Default)]
pub struct RequestCtx {
    /// Counts the request as in flight for a drain, until the context drops.
    _in_flight: Option<InFlight>,
    runtime: Option<Arc<Runtime>>,
    facts: Facts,
    server: Option<(PoolId, SocketAddr)>,
    /// The `outcome` label of `tollgate_requests_total`, once decided.
    outcome: Option<Outcome>,
    started: Option<Instant>,
    upstream_started: Option<Instant>,
    /// Request body bytes read so far, held to the route's bound.
    body_bytes: u64,
    /// Forwarding attempts after the first (connect failures, failed
    /// reused connections).
    retries: u32,
    /// The upstream's response head arrived.
    answered: bool,
    /// The status of the upstream's response, once its head arrived.
    upstream_status: Option<u16>,
    /// An answer read whole before it goes on (see [`HeldAnswer`]).
    held: Option<HeldAnswer>,
    /// Reads the usage out of a metered answer's body as it passes, with
    /// the share of `buffered_bytes_total` the piece it holds may take.
    meter: Option<(Meter, Option<BodyReservation>)>,
    /// What a request whose cost the response reports was settled at, and
    /// how (`reported`, `estimate`, `max`), for its usage record.
    settled: Option<(u64, &'static str)>,
}

/// An upstream answer of a declared length within the pool's
/// `response_buffer_bytes`, gathered until the upstream sent all of it:
/// then the request's pool permit and holds end, and the whole answer goes
/// to the client, however slowly it reads. The bytes are counted in
/// `buffered_bytes_total` while held.
struct HeldAnswer {
    /// The answer so far: the first chunk as it came (most answers come
    /// whole in one, and are never copied), then a buffer once a second
    /// one came.
    first: Option<Bytes>,
    rest: Option<bytes::BytesMut>,
    /// The declared length still to come.
    left: u64,
    _reservation: BodyReservation,
}

impl HeldAnswer {
    /// Takes `chunk` in; the whole answer once the last declared byte came
    /// (or the upstream ended it early: `end`).
    fn take(&mut self, chunk: Option<Bytes>, end: bool) -> Option<Bytes> {
        if let Some(chunk) = chunk.filter(|c| !c.is_empty()) {
            self.left = self.left.saturating_sub(chunk.len() as u64);
            match (&mut self.rest, self.first.take()) {
                (Some(rest), _) => rest.extend_from_slice(&chunk),
                (None, None) => self.first = Some(chunk),
                (None, Some(first)) => {
                    let mut rest = bytes::BytesMut::with_capacity(first.len() + chunk.len());
                    rest.extend_from_slice(&first);
                    rest.extend_from_slice(&chunk);
                    self.rest = Some(rest);
                }
            }
        }
        if self.left > 0 && !end {
            return None;
        }
        let whole = match self.rest.take() {
            Some(rest) => rest.freeze(),
            None => self.first.take().unwrap_or_default(),
        };
        Some(whole)
    }
}

/// The gateway: the live policy, swapped atomically on reload.
pub struct Gateway {
    live: Arc<ArcSwap<Runtime>>,
    denials: AtomicU64,
    drain: Arc<Drain>,
}

impl Gateway {
    /// A gateway serving whatever runtime `live` holds at each request,
    /// counting its requests in flight in `drain`.
    pub fn new(live: Arc<ArcSwap<Runtime>>, drain: Arc<Drain>) -> Self {
        Self {
            live,
            denials: AtomicU64::new(0),
            drain,
        }
    }

    /// Everything before forwarding: the request path, a small body read
    /// whole, then pool admission. `Err` when the client failed (went away,
    /// or sent its body too slowly: the edge answered it), `Ok(Err(_))` for
    /// a rejection to answer.
    async fn prepare(
        &self,
        rt: &Runtime,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Result<Admitted, Rejection>> {
        let peer = peer_ip(session.client_addr());
        let admitted = match admission::admit(rt, peer, session.req_header(), &mut ctx.facts).await
        {
            Ok(Admission::Decided(admitted)) => admitted,
            Ok(Admission::ReadBody(wait)) => {
                // Boxed, as a body read whole is below.
                let body = match Box::pin(read_for_limits(rt, session, ctx, wait.reads())).await? {
                    Ok(body) => body,
                    Err(rejection) => return Ok(Err(rejection)),
                };
                let req = session.req_header();
                match admission::admit_body(rt, wait, req, body, &mut ctx.facts).await {
                    Ok(admitted) => admitted,
                    Err(rejection) => return Ok(Err(rejection)),
                }
            }
            Err(rejection) => return Ok(Err(rejection)),
        };
        if ctx.facts.delay_ms > 0 {
            // Charged for this instant by the decision itself; no permit
            // is held while waiting for it.
            tokio::time::sleep(std::time::Duration::from_millis(ctx.facts.delay_ms)).await;
        }
        if let Admitted::Forward(pool_id) = admitted {
            if let Some(len) = small_body(rt, session) {
                // Boxed: reading a body is a future as large as all the
                // rest of the request path's, and most requests have none.
                if let Some(rejection) = Box::pin(read_small_body(rt, session, ctx, len)).await? {
                    return Ok(Err(rejection));
                }
            }
            if !session.is_body_empty() {
                // A body still to stream: its bounds run from here.
                body::started();
            }
            let pool = &rt.pool(pool_id);
            let refusal = |r| match r {
                PoolRefusal::Saturated => Rejection::Overloaded { retry_after: 1 },
                PoolRefusal::NoHealthyServer => Rejection::NoHealthyUpstream { retry_after: 1 },
            };
            let party = ctx.facts.party(rt.policy.client_ip.ipv6_prefix);
            match pool.admit(ctx.facts.priority, party).await {
                Ok(permit) => ctx.facts.held.permit = Some(permit),
                Err(r) => return Ok(Err(refusal(r))),
            }
            match pool.pick() {
                Ok(server) => ctx.server = Some((pool_id, server)),
                Err(r) => return Ok(Err(refusal(r))),
            }
        }
        Ok(Ok(admitted))
    }
}

/// Reads a body of at most `server.limits.buffer_body_bytes` whole, before
/// the request takes a pool permit, so that no client holds a permit by
/// sending its body slowly; the proxy then sends it on from Pingora's
/// retry buffer. Only once authenticated and admitted by the limits (an
/// unknown caller never makes the gateway buffer). `len` is the body's
/// declared length, from [`small_body`].
async fn read_small_body(
    rt: &Runtime,
    session: &mut Session,
    ctx: &mut RequestCtx,
    len: u64,
) -> Result<Option<Rejection>> {
    Ok(read_whole(rt, session, ctx, len, None).await?.err())
}

/// Reads the body of a request on a route whose request limits read it,
/// once its pre-auth limits admitted it and its caller is known: whole,
/// up to `server.limits.buffer_body_bytes` (Pingora's retry buffer sends
/// it on). A body declared larger is 413 or, with `oversize: absent`,
/// left unread to stream on; one that turns out larger as it comes (no
/// length declared) is 413 whatever `oversize` says, since what was read
/// of it could not be sent on.
async fn read_for_limits(
    rt: &Runtime,
    session: &mut Session,
    ctx: &mut RequestCtx,
    reads: &crate::config::BodyRead,
) -> Result<Result<BodyInput, Rejection>> {
    if session.is_body_empty() || session.is_body_done() {
        return Ok(Ok(BodyInput::Read(Bytes::new())));
    }
    let limit = rt.policy.server.edge.buffer_body_bytes;
    let declared = admission::declared_length(session.req_header());
    match declared {
        Some(0) => return Ok(Ok(BodyInput::Read(Bytes::new()))),
        Some(n) if n > limit => {
            return Ok(match reads.oversize {
                Oversize::Reject => Err(Rejection::PayloadTooLarge),
                Oversize::Absent => Ok(BodyInput::Oversize),
            })
        }
        _ => {}
    }
    let caller = ctx.facts.caller(rt.policy.client_ip.ipv6_prefix);
    let body = read_whole(rt, session, ctx, declared.unwrap_or(limit), caller).await?;
    Ok(body.map(|b| BodyInput::Read(b.unwrap_or_default())))
}

/// Reads a body whole into Pingora's retry buffer, within
/// `buffered_bytes_total` over the process (beyond: 503 `overloaded`) and,
/// for a `caller`, within its share of it; `reserve` bytes are held until
/// the request ends. `Expect: 100-continue` is answered here, and not
/// passed on. For a `caller` the body is kept and returned, and one over
/// `buffer_body_bytes` is 413.
async fn read_whole(
    rt: &Runtime,
    session: &mut Session,
    ctx: &mut RequestCtx,
    reserve: u64,
    caller: Option<Caller>,
) -> Result<Result<Option<Bytes>, Rejection>> {
    let server = &rt.policy.server;
    let budget = &rt.services.body_budget;
    let total = server.buffered_bytes_total;
    let limit = server.edge.buffer_body_bytes;
    let reservation = match &caller {
        Some(who) => budget.reserve_for(who.digest(), reserve, total, limit),
        None => budget.reserve(reserve, total),
    };
    let Some(reservation) = reservation else {
        rt.all_metrics().overload_shed("body_buffer");
        return Ok(Err(Rejection::Overloaded { retry_after: 1 }));
    };
    let expects = session
        .req_header()
        .headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects {
        session.write_continue_response().await?;
        session
            .req_header_mut()
            .remove_header(&http::header::EXPECT);
    }
    session.enable_retry_buffering();
    body::started();
    let mut kept = caller.map(|_| bytes::BytesMut::new());
    while let Some(chunk) = session.read_request_body().await? {
        body::read(chunk.len(), false);
        if let Some(kept) = &mut kept {
            if (kept.len() + chunk.len()) as u64 > limit {
                return Ok(Err(Rejection::PayloadTooLarge));
            }
            kept.extend_from_slice(&chunk);
        }
    }
    body::read(0, true);
    ctx.facts.held.body = Some(reservation);
    Ok(Ok(kept.map(bytes::BytesMut::freeze)))
}

/// The declared length of a body to read whole before the request takes
/// a permit: one not yet read, of at most `server.limits.buffer_body_bytes`.
fn small_body(rt: &Runtime, session: &mut Session) -> Option<u64> {
    let len = admission::declared_length(session.req_header())?;
    let limit = rt.policy.server.edge.buffer_body_bytes;
    (len > 0 && len <= limit && !session.is_body_done()).then_some(len)
}

/// For a route whose cost the response reports: reads it from `headers`
/// (the response's, or its trailers) and settles it, once per request (the
/// first place that carries it). Returns the header to remove before the
/// client sees it, unless the route exposes it.
fn settle(ctx: &mut RequestCtx, headers: &http::HeaderMap) -> Option<http::HeaderName> {
    let hidden = ctx.facts.hidden_cost_header.clone();
    let actual = ctx.facts.reconcile.as_ref()?.actual(headers);
    if let (Some(actual), Some(rt)) = (actual, &ctx.runtime) {
        let reconcile = ctx.facts.reconcile.take()?;
        ctx.settled = Some((actual, "reported"));
        spawn_settlement(rt, reconcile, actual, false);
    }
    hidden
}

/// A meter for an answer whose cost its body reports: JSON, or an event
/// stream. An answer the upstream encoded (despite `Accept-Encoding:
/// identity`) cannot be read, and settles as one without usage.
fn meter_for(
    response: &ResponseHeader,
    ctx: &RequestCtx,
) -> Option<(Meter, Option<BodyReservation>)> {
    let reconcile = ctx.facts.reconcile.as_ref()?;
    let header = |name| {
        response
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_ascii_lowercase())
    };
    if header(http::header::CONTENT_ENCODING).is_some_and(|e| e != "identity") {
        return None;
    }
    let event_stream =
        header(http::header::CONTENT_TYPE).is_some_and(|t| t.starts_with("text/event-stream"));
    let meter = reconcile.meter(event_stream)?;
    // The piece a meter holds is counted with the bodies the gateway holds,
    // when there is room; the answer is metered either way (it is already
    // admitted, and its pool's permits bound how many are metered at once).
    let reservation = ctx.runtime.as_ref().and_then(|rt| {
        let total = rt.policy.server.buffered_bytes_total;
        rt.services.body_budget.reserve(MAX_HELD as u64, total)
    });
    Some((meter, reservation))
}

/// Settles a metered answer that came whole: at the usage its body
/// reported. One that reported none is left to [`settle_unreported`],
/// which charges the most.
fn settle_metered(ctx: &mut RequestCtx) {
    let Some((meter, _)) = ctx.meter.take() else {
        return;
    };
    if let (Some(usage), Some(rt)) = (meter.finish(true), &ctx.runtime) {
        if let Some(reconcile) = ctx.facts.reconcile.take() {
            let settled = usage.min(reconcile.spec.max);
            ctx.settled = Some((settled, "reported"));
            spawn_settlement(rt, reconcile, settled, false);
        }
    }
}

/// Settles a response that ended without reporting its cost: at `max` when
/// its client abandoned it (unless `on_abandon: estimate`), otherwise at
/// the estimate, counted as `missing` when the upstream had answered.
fn settle_unreported(ctx: &mut RequestCtx, e: Option<&Error>) {
    let (Some(reconcile), Some(rt)) = (ctx.facts.reconcile.take(), &ctx.runtime) else {
        return;
    };
    // A client that leaves while the upstream works (before its answer or
    // during it) abandoned a response that may have cost the max.
    // An error answer of a metered route (a 4xx or 5xx of the API) spent
    // no tokens it reports: it keeps the estimate rather than the most.
    let metered = reconcile.metered();
    let failed = ctx
        .upstream_status
        .is_some_and(|s| !(200..300).contains(&s));
    let end = if e.is_some_and(|e| e.esource() == &ErrorSource::Downstream) {
        admission::Unreported::Abandoned
    } else if !ctx.answered || (metered && failed) {
        admission::Unreported::Unanswered
    } else {
        admission::Unreported::Missing
    };
    let settled = reconcile.unreported(end);
    let how = if settled == reconcile.estimate {
        "estimate"
    } else {
        "max"
    };
    ctx.settled = Some((settled, how));
    spawn_settlement(
        rt,
        reconcile,
        settled,
        end == admission::Unreported::Missing,
    );
}

/// Charges or gives back the difference between `settled` and what
/// admission charged, off the request path, and counts it.
fn spawn_settlement(rt: &Runtime, reconcile: admission::Reconcile, settled: u64, missing: bool) {
    let delta = reconcile.delta(settled);
    let (limiter, metrics) = (rt.services.limiter.clone(), rt.services.metrics.clone());
    if missing {
        metrics
            .cost_reconciled
            .with_label_values(&[&reconcile.route, "missing"])
            .inc();
    }
    if delta == 0
        && reconcile
            .charged
            .iter()
            .all(|(c, _)| c.cost == reconcile.reserved)
    {
        return;
    }
    tokio::spawn(async move {
        // Each charge moves from what it was charged to `settled`: the
        // pre-auth limits of a route that reads its estimate from the body
        // were charged before the body named it.
        let mut uncharged = 0;
        let mut charged = reconcile.charged;
        while !charged.is_empty() {
            let cost = charged[0].0.cost;
            let (same, rest): (Vec<_>, Vec<_>) =
                charged.into_iter().partition(|(c, _)| c.cost == cost);
            charged = rest;
            let delta = settled as i64 - cost as i64;
            uncharged = uncharged.max(
                limiter
                    .reconcile(&same, delta, reconcile.spec.max_debt)
                    .await,
            );
        }
        if delta != 0 {
            let direction = if delta > 0 { "charged" } else { "refunded" };
            metrics
                .cost_reconciled
                .with_label_values(&[&reconcile.route, direction])
                .inc();
        }
        if uncharged > 0 {
            metrics
                .cost_uncharged
                .with_label_values(&[&reconcile.route])
                .inc_by(uncharged);
        }
    });
}

/// The answer to gather whole before it goes on: one with a body of a
/// declared length within its pool's `response_buffer_bytes`, while
/// `buffered_bytes_total` has room for it. A streamed answer (no declared
/// length), a larger one, or an upgrade goes on as it comes, and keeps its
/// permit while it streams.
fn hold_answer(
    session: &Session,
    response: &ResponseHeader,
    ctx: &RequestCtx,
) -> Option<HeldAnswer> {
    let (rt, (pool, _)) = (ctx.runtime.as_ref()?, ctx.server?);
    let status = response.status.as_u16();
    if session.req_header().method == http::Method::HEAD
        || response.status.is_informational()
        || matches!(status, 204 | 304)
    {
        return None;
    }
    let len: u64 = response
        .headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()?;
    if len == 0 || len > rt.pool(pool).def().response_buffer_bytes {
        return None;
    }
    let total = rt.policy.server.buffered_bytes_total;
    let reservation = rt.services.body_budget.reserve(len, total)?;
    Some(HeldAnswer {
        first: None,
        rest: None,
        left: len,
        _reservation: reservation,
    })
}

/// How long an HTTP/2 response may wait for its client's flow-control
/// window, once `sent` bytes went to it: the grace, or longer when those
/// bytes earned it at `send_min_rate`; at most `send_ms`. A stream whose
/// client keeps its window shut is cut then (a zero window is a rate of
/// zero), and releases what it held. Pingora applies the bound to each
/// wait for window, so a client that opens it again in time goes on.
fn send_timeout(edge: &crate::edge::EdgeSettings, sent: u64) -> std::time::Duration {
    edge.send_allowance(sent).min(edge.send)
}

fn peer_ip(addr: Option<&PeerAddr>) -> IpAddr {
    addr.and_then(PeerAddr::as_inet)
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |a| a.ip().to_canonical())
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
    let header = rejection.header(body.len(), ctx.facts.rate_headers.as_ref())?;
    write(session, header, body).await
}

async fn respond_directly(
    session: &mut Session,
    ctx: &RequestCtx,
    status: u16,
    body: Bytes,
    content_type: String,
) -> Result<()> {
    let mut h = ResponseHeader::build(status, Some(4))?;
    h.insert_header("content-type", content_type)?;
    h.insert_header("content-length", body.len().to_string())?;
    if let Some(extra) = &ctx.facts.rate_headers {
        extra.apply(&mut h)?;
    }
    write(session, h, body).await
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            _in_flight: Some(self.drain.enter()),
            ..RequestCtx::default()
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        ctx.started = Some(Instant::now());
        let rt = self.live.load_full();
        ctx.runtime = Some(rt.clone());
        if session.req_header().version == http::Version::HTTP_2 {
            // An HTTP/2 stream is not under the edge's guarded stream: a
            // client that stops reading its response still loses it.
            session.set_write_timeout(Some(rt.policy.server.edge.send));
        }
        let prepared = match self.prepare(&rt, session, ctx).await {
            Ok(prepared) => prepared,
            Err(e) => {
                // The client failed while its body was read whole (it left,
                // or sent too slowly: the edge answered it).
                ctx.outcome = Some(Outcome::BadRequest);
                return Err(e);
            }
        };
        ctx.outcome = Some(match &prepared {
            Ok(_) => Outcome::Allowed,
            Err(rejection) => rejection.outcome(),
        });
        match prepared {
            Ok(Admitted::Forward(_)) => {
                headers::limit_upgrade(session.req_header_mut(), &ctx.facts.upgrade)?;
                Ok(false)
            }
            Ok(Admitted::Respond {
                status,
                body,
                content_type,
            }) => {
                // Answered here: the request's holds go before the answer.
                ctx.facts.held.holds.clear();
                respond_directly(session, ctx, status, body, content_type).await?;
                Ok(true)
            }
            Err(rejection) => {
                ctx.facts.held.holds.clear();
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
        let (Some(rt), Some((pool, mut addr))) = (&ctx.runtime, ctx.server) else {
            return Error::e_explain(ErrorType::InternalError, "no upstream chosen for request");
        };
        if ctx.retries > 0 {
            // A retry goes to the next healthy server, when there is another.
            if let Ok(next) = rt.pool(pool).pick() {
                addr = next;
                ctx.server = Some((pool, addr));
            }
        }
        let upstream = rt.pool(pool).def();
        ctx.upstream_started.get_or_insert_with(Instant::now);
        let mut peer = match &upstream.tls {
            Some(tls) => {
                let mut peer = HttpPeer::new(addr, true, tls.sni.clone());
                peer.options.verify_cert = tls.verify;
                peer.options.verify_hostname = tls.verify;
                peer.options.ca = tls.ca.clone();
                peer
            }
            None => HttpPeer::new(addr, false, String::new()),
        };
        peer.options.alpn = match upstream.protocol {
            UpstreamProtocol::Http1 => pingora::protocols::ALPN::H1,
            UpstreamProtocol::H2 => pingora::protocols::ALPN::H2,
            UpstreamProtocol::Auto => pingora::protocols::ALPN::H2H1,
        };
        peer.options.connection_timeout = Some(upstream.connect_timeout);
        peer.options.read_timeout =
            Some(ctx.facts.upstream_timeout.unwrap_or(upstream.read_timeout));
        Ok(Box::new(peer))
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        // Nothing reached the server: another try is always safe.
        e.set_retry(self.may_retry(ctx, Retry::Connect));
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut RequestCtx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        // As Pingora decides by default: an idempotent request whose reused
        // connection failed before any response byte; then within `retries`.
        if !session.req_header().method.is_idempotent() || session.as_ref().retry_buffer_truncated()
        {
            e.set_retry(false);
        } else {
            e.retry.decide_reuse(client_reused);
        }
        if e.retry() {
            e.set_retry(self.may_retry(ctx, Retry::ReusedConnection));
        }
        e
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if let Some(target) = &ctx.facts.rewritten_target {
            let uri = target
                .parse()
                .or_else(|e| Error::e_because(ErrorType::InternalError, "normalized target", e))?;
            upstream.set_uri(uri);
        }
        let Some(rt) = &ctx.runtime else {
            return Error::e_explain(ErrorType::InternalError, "no policy for request");
        };
        let peer = peer_ip(session.client_addr());
        let auth = &rt.policy.auth;
        headers::rewrite(
            upstream,
            &Forwarding {
                peer,
                client: ctx.facts.client_ip.unwrap_or(peer),
                peer_trusted: rt.policy.client_ip.is_trusted(peer),
                scheme: if session.digest().is_some_and(|d| d.ssl_digest.is_some()) {
                    "https"
                } else {
                    "http"
                },
                strip_key: (!auth.forward_key).then_some(&auth.header),
            },
        )?;
        if let Some((pool, addr)) = ctx.server {
            let def = rt.pool(pool).def();
            match &def.host_header {
                HostHeader::Preserve => {}
                HostHeader::Upstream => {
                    let at = def.servers.iter().position(|s| *s == addr);
                    if let Some(name) = at.and_then(|i| def.server_names.get(i)) {
                        upstream.insert_header(http::header::HOST, name.as_str())?;
                    }
                }
                HostHeader::Literal(value) => {
                    upstream.insert_header(http::header::HOST, value.clone())?;
                }
            }
        }
        if let Some(c) = &ctx.facts.credential {
            upstream.insert_header(TENANT_ID, c.tenant_header.clone())?;
            upstream.insert_header(CREDENTIAL_ID, c.id_header.clone())?;
        }
        if let Some(class) = &ctx.facts.route_header {
            upstream.insert_header(ROUTE_CLASS, class.clone())?;
        }
        let metered = ctx
            .facts
            .reconcile
            .as_ref()
            .is_some_and(|r| r.spec.source.header().is_none());
        if metered {
            // The usage is read from the body as it passes: not compressed.
            upstream.insert_header(http::header::ACCEPT_ENCODING, "identity")?;
        }
        if let Some(body) = &ctx.facts.rewritten_body {
            // The body sent is the one asking for the stream's usage.
            upstream.remove_header(&http::header::TRANSFER_ENCODING);
            upstream.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())?;
        }
        if let Some(trace) = &ctx.facts.telemetry.trace {
            // This gateway's span is the upstream's parent; a state that
            // came with a trace the gateway did not continue is not its.
            upstream.insert_header("traceparent", trace.header())?;
            if trace.parent_id.is_none() && upstream.headers.contains_key("tracestate") {
                upstream.remove_header("tracestate");
            }
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        // An upgraded connection's bytes pass here too; they are no body.
        if session.was_upgraded() {
            return Ok(());
        }
        let len = body.as_ref().map_or(0, |b| b.len());
        body::read(len, end_of_stream);
        ctx.body_bytes += len as u64;
        if ctx.body_bytes > ctx.facts.max_body_bytes {
            ctx.outcome = Some(Outcome::BadRequest);
            return Error::e_explain(ErrorType::HTTPStatus(413), "request body too large");
        }
        if let Some(rewritten) = &ctx.facts.rewritten_body {
            // The body was read whole, and is sent from the retry buffer in
            // one piece (again on a retry): that piece becomes the new one.
            if len > 0 {
                *body = Some(rewritten.clone());
            }
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if let Some(extra) = &ctx.facts.rate_headers {
            extra.apply(response)?;
        }
        if let Some(hidden) = settle(ctx, &response.headers) {
            response.remove_header(&hidden);
        }
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        session: &mut Session,
        response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        ctx.answered = true;
        ctx.upstream_status = Some(response.status.as_u16());
        ctx.held = hold_answer(session, response, ctx);
        ctx.meter = meter_for(response, ctx);
        Ok(())
    }

    fn response_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<std::time::Duration>> {
        if let (Some((meter, _)), Some(chunk)) = (&mut ctx.meter, body.as_ref()) {
            meter.feed(chunk);
        }
        if end_of_stream {
            settle_metered(ctx);
        }
        let mut complete = end_of_stream;
        if let Some(held) = &mut ctx.held {
            match held.take(body.take(), end_of_stream) {
                Some(whole) => {
                    *body = Some(whole);
                    complete = true;
                    ctx.held = None;
                }
                None => return Ok(None),
            }
        }
        // The upstream's work is done: its permit and holds go now, before
        // the last bytes are written, not once the client has read them.
        if complete {
            ctx.facts.held.release_upstream();
        }
        if session.req_header().version == http::Version::HTTP_2 {
            if let (Some(rt), Some(_)) = (&ctx.runtime, body.as_ref()) {
                // The bytes its client took so far, before this chunk (and
                // any others filtered with it, written after).
                let sent = session.body_bytes_sent() as u64;
                let edge = &rt.policy.server.edge;
                session.set_write_timeout(Some(send_timeout(edge, sent)));
            }
        }
        Ok(None)
    }

    async fn response_trailer_filter(
        &self,
        _session: &mut Session,
        trailers: &mut http::HeaderMap,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Bytes>> {
        // A streamed response (gRPC) reports its usage at the end.
        if let Some(hidden) = settle(ctx, trailers) {
            trailers.remove(&hidden);
        }
        Ok(None)
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        let code = match e.etype() {
            ErrorType::HTTPStatus(code) => *code,
            ErrorType::ReadTimedout if *e.esource() == ErrorSource::Upstream => 504,
            _ => match e.esource() {
                ErrorSource::Upstream => 502,
                // The client went away or stalled: nobody to answer.
                ErrorSource::Downstream
                    if matches!(
                        e.etype(),
                        ErrorType::ReadError
                            | ErrorType::WriteError
                            | ErrorType::ConnectionClosed
                            | ErrorType::ReadTimedout
                            | ErrorType::WriteTimedout
                    ) =>
                {
                    0
                }
                // The client sent something unreadable (a bad chunk size):
                // a framing error gets its 400.
                ErrorSource::Downstream => 400,
                ErrorSource::Internal | ErrorSource::Unset => 500,
            },
        };
        // Once a response has started, an answer of our own would be
        // written into its body: the connection is closed instead.
        if code > 0 && session.response_written().is_none() {
            let _ = reject(session, &Rejection::ProxyFailed { status: code }, ctx).await;
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    /// Pingora's own error lines describe a request with this: the route
    /// class, never the raw path, query or host.
    fn request_summary(&self, session: &Session, ctx: &RequestCtx) -> String {
        let route = ctx.facts.route.as_deref().unwrap_or("unmatched");
        format!("{} route={route}", session.req_header().method)
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        // The pool slot is free as soon as the response is over.
        ctx.facts.held.permit = None;
        if let (Some(e), Some(rt)) = (e, &ctx.runtime) {
            let h2 = session.req_header().version == http::Version::HTTP_2;
            if h2 && e.etype() == &ErrorType::WriteTimedout {
                let edge = &rt.policy.server.edge;
                let sent = session.body_bytes_sent() as u64;
                body::send_cut(if send_timeout(edge, sent) < edge.send {
                    crate::edge::listener::Reason::SendTooSlow
                } else {
                    crate::edge::listener::Reason::SendTimeout
                });
            }
        }
        settle_unreported(ctx, e);
        let Some(rt) = ctx.runtime.clone() else {
            return;
        };
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        if let (Some(ledger), Some(slot)) = (&rt.services.usage, ctx.facts.held.usage.take()) {
            if ctx.outcome == Some(Outcome::Allowed) {
                let mut room = crate::usage::record::Formatted::new();
                let record = usage_record(ledger, &rt, session, ctx, status, &mut room);
                ledger.record(&record, slot);
            }
        }
        let route = ctx.facts.route.as_deref().unwrap_or("unmatched");
        self.account(&rt, ctx);
        let caller = || {
            ctx.facts
                .caller(rt.policy.client_ip.ipv6_prefix)
                .map(|c| rt.services.redactor.caller(&c))
        };
        let elapsed_ms = ctx.started.map_or(0.0, |s| s.elapsed().as_secs_f64() * 1e3);
        let outcome = ctx.outcome.map(Outcome::as_str);
        let denied = matches!(
            ctx.outcome,
            Some(Outcome::Limited | Outcome::Unauthorized | Outcome::Forbidden)
        );
        if denied && self.denials.fetch_add(1, Ordering::Relaxed) % DENIAL_LOG_SAMPLE == 0 {
            tracing::info!(target: crate::logs::REQUEST, route, status, outcome, caller = caller(), violated = ?ctx.facts.violated, "request denied (sampled)");
        }
        tracing::debug!(
            route,
            status,
            outcome,
            caller = caller(),
            elapsed_ms,
            error = e.map(|e| e.to_string()),
            "request"
        );
        if let Some(log) = rt.services.access_log.as_ref().filter(|l| l.wants()) {
            access(log, &rt, session, ctx, status, elapsed_ms);
        }
        if let (Some(tracer), Some(trace)) = (&rt.services.tracer, ctx.facts.telemetry.trace) {
            if trace.sampled {
                tracer.export(&trace, &spans_of(session, ctx, status, rt.wall()));
            }
        }
    }
}

/// What a finished request did, for its spans: times read back from the
/// monotonic clock onto the wall clock's `now`.
fn spans_of(
    session: &Session,
    ctx: &RequestCtx,
    status: u16,
    now: std::time::SystemTime,
) -> crate::trace::otlp::RequestSpans {
    let ago = |elapsed: std::time::Duration| now.checked_sub(elapsed).unwrap_or(now);
    let start = ctx.started.map_or(now, |s| ago(s.elapsed()));
    crate::trace::otlp::RequestSpans {
        method: session.req_header().method.to_string(),
        route: ctx.facts.route.as_deref().unwrap_or("unmatched").to_owned(),
        status,
        outcome: ctx.outcome.map(Outcome::as_str),
        violated: ctx.facts.violated.iter().map(|v| v.to_string()).collect(),
        request: (start, now),
        decision: ctx
            .facts
            .telemetry
            .decided
            .map(|(from, to)| (ago(from.elapsed()), ago(to.elapsed()))),
        store_calls: ctx.facts.telemetry.store_calls.clone(),
        upstream: ctx.upstream_started.map(|s| {
            let server = ctx.server.map(|(_, a)| a.to_string()).unwrap_or_default();
            (ago(s.elapsed()), now, server)
        }),
    }
}

/// An admitted request's usage record, once it is settled: its text
/// borrowed from the request, the caller and the policy.
fn usage_record<'a>(
    ledger: &'a crate::usage::Ledger,
    rt: &'a Runtime,
    session: &'a Session,
    ctx: &'a RequestCtx,
    status: u16,
    room: &'a mut crate::usage::record::Formatted,
) -> crate::usage::Record<'a> {
    use std::borrow::Cow;
    let network = ctx.facts.network(rt.policy.client_ip.ipv6_prefix);
    let trace = ctx.facts.telemetry.trace.as_ref().map(|t| &t.trace_id);
    let formatted = room.fields(rt.wall(), network, trace);
    let req = session.req_header();
    let credential = ctx.facts.credential.as_deref();
    let admitted = ctx.facts.cost;
    let charged = ctx
        .facts
        .route_id
        .and_then(|id| rt.policy.routes.get(id))
        .map_or(admitted, |r| r.admission_cost_of(admitted));
    let (settled, how) = ctx.settled.unwrap_or((charged, "route"));
    let plan = credential
        .and_then(|c| c.plan)
        .and_then(|p| rt.policy.plans.get(p.index()))
        .map(|p| Cow::Borrowed(&*p.name));
    crate::usage::Record {
        id: formatted.id.into(),
        time: formatted.time,
        instance: ledger.instance().into(),
        tenant: credential.map(|c| Cow::Borrowed(&*c.tenant)),
        credential: credential.map(|c| Cow::Borrowed(&*c.id)),
        plan,
        route: ctx.facts.route.as_deref().unwrap_or_default().into(),
        method: req.method.as_str().into(),
        host: named_host(req),
        // An admitted request's target was accepted: it has a path.
        path: crate::usage::record::bounded_path(normalized_path(req, ctx).unwrap_or_default())
            .into(),
        client: formatted.client,
        status,
        cost_admitted: charged,
        cost_settled: settled,
        cost_source: how.into(),
        values: (ctx.facts.used.matched.iter())
            .map(|(limit, value)| (Cow::Borrowed(&**limit), Cow::Borrowed(value.as_str())))
            .collect(),
        trace_id: formatted.trace.map(Cow::Borrowed),
    }
}

/// The host a request named (`Host`, or an absolute target's authority),
/// lower-case, without its port.
fn named_host(req: &RequestHeader) -> Option<std::borrow::Cow<'_, str>> {
    req.headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri.authority().map(|a| a.as_str()))
        .map(crate::routes::request_host)
}

/// The request's normalized path, without the query string; `None` when
/// its target was refused.
fn normalized_path<'a>(req: &'a RequestHeader, ctx: &'a RequestCtx) -> Option<&'a str> {
    match &ctx.facts.rewritten_target {
        Some(target) => Some(target.split('?').next().unwrap_or(target)),
        None if ctx.facts.target_ok => Some(req.uri.path()),
        None => None,
    }
}

/// Writes a request's access log line.
fn access(
    log: &AccessLog,
    rt: &Runtime,
    session: &Session,
    ctx: &RequestCtx,
    status: u16,
    duration_ms: f64,
) {
    let req = session.req_header();
    let host = named_host(req);
    let path = normalized_path(req, ctx);
    let credential = ctx.facts.credential.as_deref();
    let client = ctx
        .facts
        .network(rt.policy.client_ip.ipv6_prefix)
        .map(|net| net.to_string());
    log.log(&Line {
        time: access_log::timestamp(rt.wall()),
        policy_version: &rt.policy.policy_version,
        method: req.method.as_str(),
        host: host.as_deref(),
        path,
        route: ctx.facts.route.as_deref(),
        status,
        outcome: ctx.outcome.map(Outcome::as_str),
        tenant: credential.map(|c| c.tenant.as_ref()),
        credential: credential.map(|c| c.id.as_ref()),
        auth_source: ctx.facts.auth_source.map(AuthSource::as_str),
        client,
        cost: ctx.facts.cost,
        violated: ctx.facts.violated.iter().map(|v| v.as_ref()).collect(),
        upstream: ctx.server.map(|(_, addr)| addr.to_string()),
        duration_ms,
        bytes_in: ctx.body_bytes,
        bytes_out: session.body_bytes_sent() as u64,
        trace_id: ctx.facts.telemetry.trace.as_ref().map(|t| t.trace_id_hex()),
        key_values: (ctx.facts.used.values.iter())
            .map(|(dim, value)| (dim.clone(), rt.services.redactor.tag(value)))
            .collect(),
        values: (ctx.facts.used.matched.iter())
            .map(|(limit, value)| (limit.as_ref(), value.as_str()))
            .collect(),
    });
}

impl Gateway {
    /// Whether the request may be forwarded once more (within its pool's
    /// `retries`), counting the retry by `why` when it may.
    fn may_retry(&self, ctx: &mut RequestCtx, why: Retry) -> bool {
        let (Some(rt), Some((pool, _))) = (&ctx.runtime, ctx.server) else {
            return false;
        };
        let def = rt.pool(pool).def();
        if ctx.retries >= def.retries {
            return false;
        }
        ctx.retries += 1;
        rt.pool(pool).count_retry(why);
        true
    }

    /// Metrics and heavy hitters for a finished request.
    fn account(&self, rt: &Runtime, ctx: &RequestCtx) {
        let metrics = rt.metrics();
        let route = ctx.facts.route_id;
        if let Some(outcome) = ctx.outcome {
            metrics.request(route, outcome);
        }
        if let Some(started) = ctx.upstream_started {
            metrics.upstream_seconds(route, started.elapsed().as_secs_f64());
            metrics.upstream_response(route, ctx.upstream_status);
        }
        if let Some(admitted @ (Outcome::Allowed | Outcome::Limited)) = ctx.outcome {
            if let Some(caller) = ctx.facts.caller(rt.policy.client_ip.ipv6_prefix) {
                rt.services
                    .top
                    .record(&caller, ctx.facts.cost, admitted == Outcome::Allowed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::body::BodyBudget;

    fn held(len: u64) -> HeldAnswer {
        HeldAnswer {
            first: None,
            rest: None,
            left: len,
            _reservation: BodyBudget::new().reserve(len, len).unwrap(),
        }
    }

    #[test]
    fn a_held_answer_goes_on_whole_once_its_last_declared_byte_came() {
        let mut one = held(5);
        assert_eq!(
            one.take(Some(Bytes::from_static(b"hello")), false)
                .as_deref(),
            Some(&b"hello"[..])
        );

        let mut three = held(6);
        assert_eq!(three.take(Some(Bytes::from_static(b"ab")), false), None);
        assert_eq!(three.take(None, false), None);
        assert_eq!(three.take(Some(Bytes::from_static(b"cd")), false), None);
        assert_eq!(
            three
                .take(Some(Bytes::from_static(b"ef")), false)
                .as_deref(),
            Some(&b"abcdef"[..])
        );
    }

    #[test]
    fn a_held_answer_the_upstream_ends_early_goes_on_as_far_as_it_came() {
        let mut cut = held(10);
        assert_eq!(cut.take(Some(Bytes::from_static(b"abc")), false), None);
        assert_eq!(cut.take(None, true).as_deref(), Some(&b"abc"[..]));
    }
}
