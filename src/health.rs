//! Active health checks of upstream servers: a TCP connect, or an HTTP
//! `GET` of a path expecting 2xx/3xx, every `interval` per pool. A server
//! leaves the round robin after `unhealthy_after` failed checks in a row and
//! returns after `healthy_after` good ones.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::config::HealthCheck;
use crate::pools::Pool;
use crate::runtime::Runtime;

/// How often the checker looks for pools that are due.
const TICK: Duration = Duration::from_millis(50);

/// One check of one server.
pub async fn probe(addr: SocketAddr, check: Arc<HealthCheck>) -> bool {
    let attempt = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        let Some(path) = &check.path else {
            return Some(true);
        };
        let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nuser-agent: tollgate-health\r\nconnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        // "HTTP/1.1 200 ..." → the status class is the tenth byte; the
        // status line may arrive in pieces.
        let mut head = [0u8; 12];
        let mut filled = 0;
        while filled < head.len() {
            match stream.read(&mut head[filled..]).await.ok()? {
                0 => break,
                n => filled += n,
            }
        }
        Some(filled >= 10 && head.starts_with(b"HTTP/1.") && matches!(head[9], b'2' | b'3'))
    };
    matches!(
        tokio::time::timeout(check.timeout, attempt).await,
        Ok(Some(true))
    )
}

async fn check_pool(pool: Arc<Pool>, check: HealthCheck) {
    let servers = pool.servers();
    let check = Arc::new(check);
    let results = futures_join(servers.iter().map(|s| probe(s.addr, check.clone()))).await;
    for (server, ok) in servers.iter().zip(results) {
        if let Some(now_healthy) =
            server.record_check(ok, check.healthy_after, check.unhealthy_after)
        {
            if now_healthy {
                tracing::info!(pool = %pool.name, server = %server.addr, "upstream server healthy again");
            } else {
                tracing::warn!(pool = %pool.name, server = %server.addr, "upstream server unhealthy");
            }
        }
    }
}

/// Runs futures concurrently and collects their outputs in order.
async fn futures_join<F: std::future::Future<Output = bool> + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<bool> {
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.unwrap_or(false));
    }
    out
}

/// The background service that checks every pool of the live policy.
pub struct HealthChecker {
    live: Arc<ArcSwap<Runtime>>,
}

impl HealthChecker {
    /// Checks the pools of whatever runtime `live` holds at each round.
    pub fn new(live: Arc<ArcSwap<Runtime>>) -> Self {
        Self { live }
    }

    fn due(pool: &Pool, interval: Duration) -> bool {
        let mut last = pool.last_checked.lock().unwrap_or_else(|e| e.into_inner());
        let due = last.is_none_or(|at| at.elapsed() >= interval);
        if due {
            *last = Some(Instant::now());
        }
        due
    }
}

#[async_trait]
impl BackgroundService for HealthChecker {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            let rt = self.live.load_full();
            for pool in &rt.pools {
                let Some(check) = pool.def().health.clone() else {
                    continue;
                };
                if Self::due(pool, check.interval) {
                    tokio::spawn(check_pool(pool.clone(), check));
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(TICK) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}
