//! The admin listener: liveness and readiness for orchestrators.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::config::OnStoreError;
use crate::runtime::Runtime;

/// Serves `/healthz` (the process is alive), `/readyz` (a policy is loaded
/// and the store answers, or no limit needs it) and `/metrics`.
pub struct Admin {
    live: Arc<ArcSwap<Runtime>>,
}

impl Admin {
    pub fn new(live: Arc<ArcSwap<Runtime>>) -> Self {
        Self { live }
    }
}

fn text(status: u16, body: String) -> Response<Vec<u8>> {
    let body = body.into_bytes();
    Response::builder()
        .status(status)
        .header("content-type", "text/plain; charset=utf-8")
        .header("content-length", body.len())
        .header("cache-control", "no-store")
        .body(body)
        .unwrap_or_default()
}

/// Whether every shared limit can decide without the store.
fn every_limit_has_a_fallback(rt: &Runtime) -> bool {
    rt.policy
        .limits
        .iter()
        .all(|l| l.local || l.on_store_error != OnStoreError::Closed)
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        match session.req_header().uri.path() {
            "/healthz" => text(200, "ok\n".into()),
            "/readyz" => {
                let rt = self.live.load();
                if rt.limiter.store_healthy() || every_limit_has_a_fallback(&rt) {
                    text(200, format!("ready: policy {}\n", rt.policy.policy_version))
                } else {
                    text(503, "not ready: the limit store is unreachable\n".into())
                }
            }
            "/metrics" => {
                let rt = self.live.load();
                let body = rt.metrics.render();
                Response::builder()
                    .status(200)
                    .header("content-type", "text/plain; version=0.0.4")
                    .header("content-length", body.len())
                    .body(body)
                    .unwrap_or_default()
            }
            _ => text(404, "not found\n".into()),
        }
    }
}
