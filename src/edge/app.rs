//! The server application of one listener: connections within
//! `max_connections`, each guarded by [`Guarded`], running Pingora's
//! HTTP/1.1 sessions one request after another.
//!
//! It takes the place of Pingora's own connection loop (the `ServerApp` of
//! an `HttpServerApp`) for one reason: the stream under the HTTP parser
//! must be the guarded one, and each request's end must reset its bounds.
//! Pingora's own timeouts are switched off; the guard's apply.

use std::sync::Arc;

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, ServerApp};
use pingora::protocols::http::ServerSession;
use pingora::protocols::Stream;
use pingora::server::ShutdownWatch;

use super::conn::Guarded;
use super::listener::Listener;
use super::EdgeSettings;

/// Where the live bounds come from: the live policy's, read at each
/// connection and each request, so a reload applies from the next request.
pub type Settings = Arc<dyn Fn() -> EdgeSettings + Send + Sync>;

/// One listener's application around the shared HTTP proxy `A`.
pub struct Edge<A> {
    proxy: Arc<A>,
    settings: Settings,
    listener: Arc<Listener>,
}

impl<A> Edge<A> {
    /// Serves `proxy` on one listener, within the bounds `settings` returns,
    /// accounted in `listener`.
    pub fn new(proxy: Arc<A>, settings: Settings, listener: Arc<Listener>) -> Self {
        Self {
            proxy,
            settings,
            listener,
        }
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
        let _slot = self.listener.admit(settings.max_connections)?;
        let mut stream = Box::new(Guarded::new(stream, settings, self.listener.clone()));
        let mut persistent = None;
        loop {
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
