//! The admin listener: liveness, readiness, metrics, heavy hitters and
//! reload. `/admin/*` requires the admin token when one is configured.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Method, Response};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::config::OnStoreError;
use crate::reload::Reloader;
use crate::runtime::Runtime;

/// Rows in `/admin/top`.
const TOP_ROWS: usize = 20;

/// Serves `/healthz` (the process is alive), `/readyz` (a policy is loaded
/// and the store answers, or no limit needs it), `/metrics`, `/admin/top`
/// and `POST /admin/reload`.
pub struct Admin {
    live: Arc<ArcSwap<Runtime>>,
    reloader: Arc<Reloader>,
    /// SHA-256 of the admin token, when one is configured.
    token: Option<[u8; 32]>,
}

impl Admin {
    pub fn new(live: Arc<ArcSwap<Runtime>>, reloader: Arc<Reloader>, token: Option<&str>) -> Self {
        Self {
            live,
            reloader,
            token: token.map(|t| crate::auth::digest(t.as_bytes())),
        }
    }

    /// Whether the request carries the configured admin token. Digests are
    /// compared, so the time taken says nothing about the token.
    fn has_token(&self, session: &ServerSession) -> bool {
        let presented =
            crate::auth::presented_key(&session.req_header().headers, &http::header::AUTHORIZATION);
        match (self.token, presented) {
            (Some(token), Some(key)) => crate::auth::digest(key) == token,
            _ => false,
        }
    }

    async fn admin(&self, session: &ServerSession, path: &str) -> Response<Vec<u8>> {
        let authorized = self.has_token(session);
        if self.token.is_some() && !authorized {
            return text(401, "admin token required\n".into());
        }
        let method = &session.req_header().method;
        match (method, path) {
            (&Method::GET, "/admin/top") => {
                let rt = self.live.load();
                let rows = rt
                    .services
                    .top
                    .report(TOP_ROWS, authorized, &rt.services.redactor);
                let body = serde_json::json!({ "top": rows }).to_string();
                respond(200, "application/json", body.into_bytes())
            }
            (&Method::POST, "/admin/reload") => {
                let reloader = self.reloader.clone();
                match tokio::task::spawn_blocking(move || reloader.reload()).await {
                    Ok(Ok(version)) => text(200, format!("reloaded: policy {version}\n")),
                    Ok(Err(e)) => text(
                        400,
                        format!("reload rejected, previous policy kept:\n{e}\n"),
                    ),
                    Err(_) => text(500, "reload failed\n".into()),
                }
            }
            (_, "/admin/top" | "/admin/reload") => text(405, "method not allowed\n".into()),
            _ => text(404, "not found\n".into()),
        }
    }
}

fn respond(status: u16, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .header("cache-control", "no-store")
        .body(body)
        .unwrap_or_default()
}

fn text(status: u16, body: String) -> Response<Vec<u8>> {
    respond(status, "text/plain; charset=utf-8", body.into_bytes())
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
        let path = session.req_header().uri.path().to_string();
        match path.as_str() {
            "/healthz" => text(200, "ok\n".into()),
            "/readyz" => {
                let rt = self.live.load();
                if rt.limiter().store_healthy() || every_limit_has_a_fallback(&rt) {
                    text(200, format!("ready: policy {}\n", rt.policy.policy_version))
                } else {
                    text(503, "not ready: the limit store is unreachable\n".into())
                }
            }
            "/metrics" => {
                let rt = self.live.load();
                respond(200, "text/plain; version=0.0.4", rt.metrics().render())
            }
            p if p.starts_with("/admin/") => self.admin(session, p).await,
            _ => text(404, "not found\n".into()),
        }
    }
}
