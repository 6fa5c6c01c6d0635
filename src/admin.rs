//! The admin listener: liveness, readiness, metrics, heavy hitters and
//! reload. `/admin/*` requires the admin token when one is configured.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Method, Response};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::config::{Mode, OnStoreError};
use crate::drain::Drain;
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
    access: AdminAccess,
    drain: Arc<Drain>,
}

/// Who may use `/admin/*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminAccess {
    /// No token configured: the listener's address is the only guard, and
    /// identities in reports stay hashed.
    Open,
    /// A token is configured but its variable is empty or unset: nobody.
    Closed,
    /// Holders of the token whose SHA-256 this is.
    Token([u8; 32]),
}

impl AdminAccess {
    /// From `server.admin_token_env` and the environment.
    pub fn from_env(var: Option<&str>) -> Self {
        match var.map(std::env::var) {
            None => AdminAccess::Open,
            Some(Ok(token)) if !token.is_empty() => {
                AdminAccess::Token(crate::auth::digest(token.as_bytes()))
            }
            Some(_) => AdminAccess::Closed,
        }
    }
}

impl Admin {
    /// Serves the live runtime; `reloader` backs `POST /admin/reload`, `access`
    /// guards `/admin/*`.
    pub fn new(
        live: Arc<ArcSwap<Runtime>>,
        reloader: Arc<Reloader>,
        access: AdminAccess,
        drain: Arc<Drain>,
    ) -> Self {
        Self {
            live,
            reloader,
            access,
            drain,
        }
    }

    /// Whether the request carries the configured admin token. Digests are
    /// compared, so the time taken says nothing about the token.
    fn has_token(&self, session: &ServerSession) -> bool {
        let headers = &session.req_header().headers;
        let presented = crate::auth::presented_key(headers, &http::header::AUTHORIZATION);
        match (self.access, presented) {
            (AdminAccess::Token(token), Some(key)) => crate::auth::digest(key) == token,
            _ => false,
        }
    }

    async fn admin(&self, session: &ServerSession, path: &str) -> Response<Vec<u8>> {
        let authorized = self.has_token(session);
        match self.access {
            AdminAccess::Closed => {
                return text(403, "the admin token variable is not set\n".into())
            }
            AdminAccess::Token(_) if !authorized => {
                return text(401, "admin token required\n".into())
            }
            AdminAccess::Open | AdminAccess::Token(_) => {}
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
///
/// Only enforced limits that some route uses count.
fn every_limit_has_a_fallback(rt: &Runtime) -> bool {
    let policy = &rt.policy;
    policy
        .routes
        .iter()
        .flat_map(|r| r.pre_auth.iter().chain(&r.request))
        .map(|&id| &policy.limits[id])
        .all(|l| l.local || l.mode == Mode::Shadow || l.on_store_error != OnStoreError::Closed)
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_string();
        match path.as_str() {
            "/healthz" => text(200, "ok\n".into()),
            "/readyz" => {
                let rt = self.live.load();
                if self.drain.draining() {
                    text(503, "not ready: shutting down\n".into())
                } else if every_limit_has_a_fallback(&rt) || rt.limiter().store_ready().await {
                    text(200, format!("ready: policy {}\n", rt.policy.policy_version))
                } else {
                    text(503, "not ready: the limit store is unreachable\n".into())
                }
            }
            "/metrics" => {
                let rt = self.live.load();
                respond(200, "text/plain; version=0.0.4", rt.all_metrics().render())
            }
            p if p.starts_with("/admin/") => self.admin(session, p).await,
            _ => text(404, "not found\n".into()),
        }
    }
}
