//! The server application of one listener: connections within
//! `max_connections` (and `max_connections_per_ip` of one client address),
//! each guarded by [`Guarded`], running Pingora's HTTP/1.1 sessions one
//! request after another.
//!
//! It takes the place of Pingora's own connection loop (the `ServerApp` of
//! an `HttpServerApp`) for one reason: the stream under the HTTP parser
//! must be the guarded one, and each request's end must reset its bounds.
//! Pingora's own timeouts are switched off; the guard's apply.
//!
//! With `server.http2`, a connection that negotiated h2 (ALPN, on TLS) or
//! opens with the HTTP/2 preface (h2c, on plain listeners) goes to
//! Pingora's HTTP/2 server instead: its streams run the same proxy, so
//! every limit, key check, pool permit and header rule applies per stream;
//! the connection still counts against `max_connections`, its header list
//! is bounded by `max_header_bytes`, and it closes after
//! `keepalive_idle_ms` without streams; each stream's body is held to the
//! body bounds by a watch of its own ([`super::body`]). Its client preface
//! must come within `header_read_ms` (read here, and replayed to the
//! HTTP/2 server, whose handshake has no deadline of its own).
//!
//! On TLS listeners the handshake happens here too, after the connection
//! took its slot: a client that opens connections and never finishes a
//! handshake is bounded by `max_connections` and by `header_read_ms`
//! like one that never finishes a request head.

use std::sync::Arc;

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, ServerApp};
use pingora::listeners::tls::Acceptor;
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::{Stream, ALPN};
use pingora::server::ShutdownWatch;
use tokio::io::AsyncReadExt;

use super::body::Watched;
use super::conn::Guarded;
use super::listener::{Listener, Reason};
use super::replay::Replayed;
use super::{EdgeSettings, LiveSettings};
use crate::respond::Rejection;

/// One listener's application around the shared HTTP proxy `A`.
pub struct Edge<A> {
    proxy: Arc<A>,
    /// The proxy for HTTP/2 connections: each stream's body watched.
    watched: Arc<Watched<A>>,
    settings: LiveSettings,
    listener: Arc<Listener>,
    /// Whether HTTP/2 is served: fixed at start, like the listeners' ALPN
    /// and the proxy's HTTP/2 options it goes with.
    http2: bool,
    /// The TLS acceptor of a TLS listener (`server.tls`).
    tls: Option<Arc<Acceptor>>,
}

impl<A> Edge<A> {
    /// Serves `proxy` on one listener, within the bounds `settings` returns,
    /// accounted in `listener`; HTTP/2 as the start-up policy says.
    pub fn new(proxy: Arc<A>, settings: LiveSettings, listener: Arc<Listener>) -> Self {
        let http2 = settings().http2;
        let watched = Arc::new(Watched::new(
            proxy.clone(),
            settings.clone(),
            listener.clone(),
        ));
        Self {
            proxy,
            watched,
            settings,
            listener,
            http2,
            tls: None,
        }
    }

    /// Terminates TLS on this listener's connections with `acceptor`.
    #[must_use]
    pub fn with_tls(mut self, acceptor: Acceptor) -> Self {
        self.tls = Some(Arc::new(acceptor));
        self
    }

    fn settings(&self) -> EdgeSettings {
        (self.settings)()
    }
}

#[async_trait]
impl<A> ServerApp for Edge<A>
where
    A: HttpServerApp + Send + Sync + 'static,
{
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let settings = self.settings();
        let peer = stream
            .get_socket_digest()
            .and_then(|d| d.peer_addr().and_then(|a| a.as_inet()).map(|a| a.ip()));
        let _slot = self.listener.admit_from(
            peer,
            settings.max_connections,
            settings.max_connections_per_ip,
        )?;
        // The handshake, the HTTP/2 detection and the preface are boxed:
        // their state would otherwise be part of every connection's, kept
        // for as long as it is open.
        let mut stream = match &self.tls {
            Some(acceptor) => Box::pin(self.handshake(acceptor, stream, &settings)).await?,
            None => stream,
        };
        if self.http2 && Box::pin(self.speaks_h2(&mut stream, &settings)).await? {
            if stream.get_ssl_digest().is_some() {
                stream = Box::pin(self.preface(stream, &settings)).await?;
            }
            // Pingora's HTTP/2 server, each stream a request of the proxy,
            // its body watched.
            return ServerApp::process_new(&self.watched, stream, shutdown).await;
        }
        let mut stream = Box::new(Guarded::new(stream, settings, self.listener.clone()));
        let mut persistent = None;
        loop {
            // An idle or half-sent connection holds no session of the proxy.
            if !stream.wait_head().await {
                return None;
            }
            let mut session = ServerSession::new_http1(stream);
            match persistent.take() {
                Some(settings) => {
                    pingora::apps::HttpPersistentSettings::apply_to_session(settings, &mut session)
                }
                // Reusable without a Pingora timer: the guard bounds idling.
                None => session.set_keepalive(Some(0)),
            }
            if *shutdown.borrow() {
                session.set_keepalive(None);
            }
            session.set_read_timeout(None);
            let reused = self.proxy.process_new_http(session, shutdown).await?;
            let (next, settings) = reused.consume();
            stream = next.into_any().downcast::<Guarded>().ok()?;
            stream.next_request(self.settings());
            persistent = settings;
        }
    }

    async fn cleanup(&self) {
        self.proxy.http_cleanup().await;
    }
}

/// Has Pingora's HTTP/2 server answer a stream whose authority is malformed
/// (`:authority` and `Host` disagree, both are missing, or one names a user:
/// RFC 9113 §8.3.1) with the edge's problem+json 400. Pingora refuses such a
/// stream in its accept loop, before any stream reaches the proxy, so the
/// answer is handed to it in advance (the one change of the vendored
/// `pingora-core`). Once for the process; later calls change nothing.
pub fn answer_malformed_authorities() {
    let refusal = Rejection::BadRequest {
        detail: "The request's :authority and Host disagree, are both missing, or name a user.",
    };
    let body = refusal.body();
    if let Ok(header) = refusal.header(body.len(), None) {
        pingora::protocols::http::v2::server::set_authority_rejection(header.headers.clone(), body);
    }
}

/// The first bytes of the HTTP/2 preface: no HTTP/1.1 request starts so
/// (`PRI` is the preface's method), and even the shortest one has them.
const H2_PREFACE_START: &[u8] = b"PRI";
/// The whole client preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl<A> Edge<A> {
    /// The TLS handshake, within `header_read_ms` (counted as a header
    /// timeout when it takes longer); `None` when it failed or timed out.
    async fn handshake(
        &self,
        acceptor: &Acceptor,
        stream: Stream,
        settings: &EdgeSettings,
    ) -> Option<Stream> {
        // A plain listener's connections are L4 streams.
        let l4 = *stream.into_any().downcast::<L4Stream>().ok()?;
        match tokio::time::timeout(settings.header_read, acceptor.tls_handshake(l4)).await {
            Ok(Ok(tls)) => Some(Box::new(tls)),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                None
            }
            Err(_) => {
                self.listener.rejected(Reason::HeaderTimeout);
                None
            }
        }
    }

    /// A connection that chose h2 by ALPN: its client preface, read within
    /// `header_read_ms` (Pingora's HTTP/2 handshake has no deadline of its
    /// own), then replayed to the HTTP/2 server. `None` when it did not
    /// come in time, was not the preface, or the client left.
    async fn preface(&self, mut stream: Stream, settings: &EdgeSettings) -> Option<Stream> {
        let mut preface = [0u8; H2_PREFACE.len()];
        match tokio::time::timeout(settings.header_read, stream.read_exact(&mut preface)).await {
            Ok(Ok(_)) if preface == *H2_PREFACE => Some(Box::new(Replayed::new(
                stream,
                bytes::Bytes::copy_from_slice(&preface),
            ))),
            Ok(_) => {
                self.listener.rejected(Reason::BadRequest);
                None
            }
            Err(_) => {
                self.listener.rejected(Reason::HeaderTimeout);
                None
            }
        }
    }

    /// Whether the connection speaks HTTP/2: h2 chosen by ALPN, or the
    /// start of the preface on a plain connection (its first three bytes,
    /// peeked within `header_read_ms`; `None` when they did not come in
    /// time, or the client left).
    async fn speaks_h2(&self, stream: &mut Stream, settings: &EdgeSettings) -> Option<bool> {
        if stream.get_ssl_digest().is_some() {
            return Some(stream.selected_alpn_proto() == Some(ALPN::H2));
        }
        // One deadline for the start and the rest of the preface: the
        // HTTP/2 handshake that follows has none of its own.
        let peek = async {
            let mut start = [0u8; H2_PREFACE_START.len()];
            if !stream.try_peek(&mut start).await? || start != *H2_PREFACE_START {
                // Peeking not offered, or not the preface: HTTP/1.1.
                return Ok(false);
            }
            let mut preface = [0u8; H2_PREFACE.len()];
            stream.try_peek(&mut preface).await?;
            Ok::<_, std::io::Error>(preface == *H2_PREFACE)
        };
        match tokio::time::timeout(settings.header_read, peek).await {
            Ok(Ok(true)) => Some(true),
            // HTTP/1.1; a `PRI` that is not the preface gets its parser's 400.
            Ok(Ok(false)) => Some(false),
            Ok(Err(_)) => None,
            Err(_) => {
                self.listener.rejected(Reason::HeaderTimeout);
                None
            }
        }
    }
}
