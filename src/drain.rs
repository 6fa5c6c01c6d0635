//! Shutting down without waiting for nothing: on SIGTERM, `/readyz` turns
//! 503 at once, the proxy listeners stop accepting (Pingora closes them),
//! and the process exits as soon as the requests in flight have finished,
//! at the latest after `server.shutdown_grace_seconds`.
//!
//! The admin listener is served here, outside Pingora's services, so that
//! it keeps answering (`/readyz` 503, `/metrics`) while the proxy drains.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::BoxFuture;
use pingora::apps::ServerApp;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use tokio::sync::watch;

/// Requests in flight, and whether the process is draining.
#[derive(Debug, Default)]
pub struct Drain {
    in_flight: AtomicUsize,
    draining: AtomicBool,
    /// Signalled whenever the last request in flight finishes.
    idle: tokio::sync::Notify,
}

impl Drain {
    /// A fresh state: nothing in flight, not draining.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Counts a request until the returned guard drops.
    pub fn enter(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(self.clone())
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Whether SIGTERM was received.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}

/// One request in flight; counted down when dropped.
#[derive(Debug)]
pub struct InFlight(Arc<Drain>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    /// Resolves once no request is in flight.
    async fn idle(&self) {
        until(&self.idle, || self.in_flight() == 0).await;
    }
}

/// Resolves once `done()` holds, looking again whenever `changed` is
/// notified: a wait for a count to fall, without polling it.
pub async fn until(changed: &tokio::sync::Notify, done: impl Fn() -> bool) {
    loop {
        let notified = changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if done() {
            return;
        }
        notified.await;
    }
}

/// The background service that waits for SIGTERM, then for the requests in
/// flight, then ends the process.
pub struct Drainer {
    drain: Arc<Drain>,
    grace: Duration,
    /// Run last, before the process exits (leases given back, the access
    /// log flushed), given what is left of the grace.
    before_exit: Box<dyn Fn(Duration) -> BoxFuture<'static, ()> + Send + Sync>,
}

impl Drainer {
    /// Drains `drain` for at most `grace`, then runs `before_exit` with
    /// what is left of `grace` and ends the process.
    pub fn new(
        drain: Arc<Drain>,
        grace: Duration,
        before_exit: impl Fn(Duration) -> BoxFuture<'static, ()> + Send + Sync + 'static,
    ) -> Self {
        Self {
            drain,
            grace,
            before_exit: Box::new(before_exit),
        }
    }
}

#[async_trait]
impl BackgroundService for Drainer {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        if shutdown.changed().await.is_err() {
            return;
        }
        self.drain.draining.store(true, Ordering::Release);
        let started = tokio::time::Instant::now();
        tracing::info!(
            in_flight = self.drain.in_flight(),
            "draining: no new connections, exiting once requests in flight finish"
        );
        let _ = tokio::time::timeout(self.grace, self.drain.idle()).await;
        let waited = started.elapsed();
        tracing::info!(
            left = self.drain.in_flight(),
            waited_ms = waited.as_millis() as u64,
            "drained, exiting"
        );
        (self.before_exit)(self.grace.saturating_sub(waited)).await;
        std::process::exit(0);
    }
}

/// An accepted admin connection as Pingora's stream: answers go out at
/// once (`TCP_NODELAY`: a small answer on a kept-alive connection would
/// otherwise wait on the client's delayed ack), and the client's address
/// is known to the edge, which bounds connections per address.
fn admin_stream(tcp: tokio::net::TcpStream) -> pingora::protocols::Stream {
    use pingora::protocols::GetSocketDigest;
    use std::os::fd::AsRawFd;
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "admin connection: cannot set TCP_NODELAY");
    }
    let digest = pingora::protocols::SocketDigest::from_raw_fd(tcp.as_raw_fd());
    let mut stream = pingora::protocols::l4::stream::Stream::from(tcp);
    stream.set_socket_digest(digest);
    Box::new(stream)
}

/// The admin listener, accepting on its own so that a drain does not close
/// it.
pub struct AdminListener<A> {
    listener: std::sync::Mutex<Option<std::net::TcpListener>>,
    app: Arc<A>,
    /// Never fires: admin connections end with the process.
    quiet: watch::Sender<bool>,
}

impl<A> AdminListener<A> {
    /// Binds `addr` now, so that a taken port fails start-up with a clear
    /// error.
    pub fn bind(addr: SocketAddr, app: A) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener: std::sync::Mutex::new(Some(listener)),
            app: Arc::new(app),
            quiet: watch::channel(false).0,
        })
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> BackgroundService for AdminListener<A> {
    async fn start(&self, _shutdown: ShutdownWatch) {
        let taken = self
            .listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(listener) = taken.and_then(|l| tokio::net::TcpListener::from_std(l).ok()) else {
            tracing::error!("the admin listener could not start");
            return;
        };
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                // Out of descriptors, most likely: give the process a moment.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let app = self.app.clone();
            let quiet = self.quiet.subscribe();
            tokio::spawn(async move {
                app.process_new(admin_stream(tcp), &quiet).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn admin_connections_send_at_once_and_know_their_client() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        // The same socket, under another descriptor: its options are shared.
        let probe = accepted.try_clone().unwrap();
        accepted.set_nonblocking(true).unwrap();
        let stream = admin_stream(tokio::net::TcpStream::from_std(accepted).unwrap());
        assert!(probe.nodelay().unwrap(), "TCP_NODELAY");
        let digest = stream.get_socket_digest().expect("a socket digest");
        let peer = digest.peer_addr().and_then(|a| a.as_inet()).copied();
        assert_eq!(peer, Some(client.local_addr().unwrap()));
    }
}
