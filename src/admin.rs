//! The admin listener: liveness and readiness for orchestrators.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::runtime::Runtime;

/// Serves `/healthz` (the process is alive) and `/readyz` (a policy is
/// loaded and the gateway can decide limits).
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

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        match session.req_header().uri.path() {
            "/healthz" => text(200, "ok\n".into()),
            "/readyz" => {
                let rt = self.live.load();
                text(200, format!("ready: policy {}\n", rt.policy.policy_version))
            }
            _ => text(404, "not found\n".into()),
        }
    }
}
