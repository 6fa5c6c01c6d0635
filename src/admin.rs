//! The admin listener: liveness, readiness, metrics, heavy hitters, quota
//! usage and reload. Who may use `/admin/*` is [`access`]'s to say; every
//! write, allowed, refused or failed, goes to the [`audit`] log, and so
//! do every failed read by a valid token and every refusal of a caller no
//! token identified (those at a bounded rate). Write bodies are read and
//! parsed by [`body`]. Every error of `/admin/*` is
//! `application/problem+json`.
//!
//! This file holds the listener, the router (one table of every `/admin/*`
//! endpoint, the function `endpoint`) and the answers every handler shares.
//! The handlers live with their resource: `status` (the probes, metrics and
//! heavy hitters), `policy` (reload), `limits` (reset, credit, usage and
//! explain), `credentials` (revocations and the keys kept in the store) and
//! `overrides` (tenants' overrides).

pub mod access;
pub mod audit;
pub mod body;

mod credentials;
mod limits;
mod overrides;
mod policy;
mod status;

pub use access::EnvToken;

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Method, Response};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::drain::Drain;
use crate::reload::Reloader;
use crate::runtime::Runtime;

/// How long an admin connection may wait for a request (its first, or the
/// next on a kept-alive one) before it is closed: admin clients ask at
/// once, and an idle connection must not hold a slot a probe needs.
pub const IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// Serves `/healthz` (the process is alive), `/readyz` (a policy is loaded
/// and the store answers, or no limit needs it), `/metrics`, `/admin/top`
/// and `POST /admin/reload`.
pub struct Admin {
    live: Arc<ArcSwap<Runtime>>,
    reloader: Arc<Reloader>,
    env: EnvToken,
    drain: Arc<Drain>,
    writes: access::WriteLimiter,
    /// Audit lines of refused callers without a valid token.
    refusals: Arc<audit::Throttle>,
    started: std::time::Instant,
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_string();
        match path.as_str() {
            // Any method, and no token asked: probes and scrapers.
            "/healthz" => status::healthz(),
            "/readyz" => self.readyz().await,
            "/metrics" => self.metrics(),
            p if p.starts_with("/admin/") => self.admin(session, p).await,
            _ => problem(
                404,
                "admin-not-found",
                "the admin listener has no such path",
            ),
        }
    }
}

/// An `/admin/*` endpoint, as [`endpoint`] finds it. The item a path
/// names (a credential, an id, a tenant) is still percent-encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint<'p> {
    /// `GET /admin/top`.
    Top,
    /// `GET /admin/explain`.
    Explain,
    /// `GET /admin/usage`.
    Usage,
    /// `POST /admin/reset`.
    Reset,
    /// `POST /admin/credit`.
    Credit,
    /// `POST /admin/reload`.
    Reload,
    /// `GET /admin/revocations`.
    Revocations,
    /// `POST /admin/revocations`.
    Revoke,
    /// `DELETE /admin/revocations/{credential}`.
    Unrevoke(&'p str),
    /// `POST /admin/credentials`.
    CreateCredential,
    /// `GET /admin/credentials/{id}`.
    ShowCredential(&'p str),
    /// `DELETE /admin/credentials/{id}`.
    DeleteCredential(&'p str),
    /// `GET /admin/overrides`.
    Overrides,
    /// `PUT /admin/overrides/{tenant}`.
    PutOverride(&'p str),
    /// `DELETE /admin/overrides/{tenant}`.
    DeleteOverride(&'p str),
    /// A path of an endpoint above, asked with a method it does not take.
    MethodNotAllowed,
    /// No endpoint has this path.
    NotFound,
}

impl Endpoint<'_> {
    /// Whether the endpoint reads a JSON body, read before its handler
    /// runs.
    fn takes_body(self) -> bool {
        matches!(
            self,
            Endpoint::Reset
                | Endpoint::Credit
                | Endpoint::Revoke
                | Endpoint::CreateCredential
                | Endpoint::PutOverride(_)
        )
    }
}

/// The router: every `/admin/*` endpoint, by method and path. A path of
/// one of them asked with another method is 405, any other path 404.
fn endpoint<'p>(method: &Method, path: &'p str) -> Endpoint<'p> {
    use Endpoint as E;
    let (collection, item) = split(path);
    match (method, collection, item) {
        (&Method::GET, "/admin/top", None) => E::Top,
        (&Method::GET, "/admin/explain", None) => E::Explain,
        (&Method::GET, "/admin/usage", None) => E::Usage,
        (&Method::POST, "/admin/reset", None) => E::Reset,
        (&Method::POST, "/admin/credit", None) => E::Credit,
        (&Method::POST, "/admin/reload", None) => E::Reload,
        (&Method::GET, "/admin/revocations", None) => E::Revocations,
        (&Method::POST, "/admin/revocations", None) => E::Revoke,
        (&Method::DELETE, "/admin/revocations", Some(credential)) => E::Unrevoke(credential),
        (&Method::POST, "/admin/credentials", None) => E::CreateCredential,
        (&Method::GET, "/admin/credentials", Some(id)) => E::ShowCredential(id),
        (&Method::DELETE, "/admin/credentials", Some(id)) => E::DeleteCredential(id),
        (&Method::GET, "/admin/overrides", None) => E::Overrides,
        (&Method::PUT, "/admin/overrides", Some(tenant)) => E::PutOverride(tenant),
        (&Method::DELETE, "/admin/overrides", Some(tenant)) => E::DeleteOverride(tenant),
        (
            _,
            "/admin/top" | "/admin/explain" | "/admin/usage" | "/admin/reset" | "/admin/credit"
            | "/admin/reload" | "/admin/revocations" | "/admin/credentials" | "/admin/overrides",
            _,
        ) => E::MethodNotAllowed,
        _ => E::NotFound,
    }
}

/// The paths whose last segment names an item of a collection
/// (`/admin/overrides/{tenant}`), each with its trailing slash.
const COLLECTIONS: [&str; 3] = [
    "/admin/revocations/",
    "/admin/credentials/",
    "/admin/overrides/",
];

/// `path` as the collection it is under and the item it names (still
/// percent-encoded, the collection's prefix taken off once), or as itself
/// and no item. An empty item names the collection itself.
fn split(path: &str) -> (&str, Option<&str>) {
    for prefix in COLLECTIONS {
        if let Some(item) = path.strip_prefix(prefix) {
            let collection = prefix.trim_end_matches('/');
            return (collection, Some(item).filter(|item| !item.is_empty()));
        }
    }
    (path, None)
}

/// A path segment, percent-decoded (a credential id may hold any
/// character).
fn percent_decode(segment: &str) -> String {
    form_urlencoded::parse(format!("x={}", segment.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

impl Admin {
    /// Serves the live runtime; `reloader` backs `POST /admin/reload`;
    /// `env` is the token `server.admin_token_env` names, beside the live
    /// policy's `server.admin_tokens`.
    pub fn new(
        live: Arc<ArcSwap<Runtime>>,
        reloader: Arc<Reloader>,
        env: EnvToken,
        drain: Arc<Drain>,
    ) -> Self {
        // Every action and result from the start, so alerts and the
        // dashboard see zeros.
        let metrics = &live.load().services.metrics;
        for action in ACTIONS {
            for result in RESULTS {
                metrics.admin_actions.with_label_values(&[action, result]);
            }
        }
        Self {
            live,
            reloader,
            env,
            drain,
            writes: access::WriteLimiter::default(),
            refusals: Arc::default(),
            started: crate::clock::instant(),
        }
    }

    /// `/admin/*`: the caller's rights checked, the request answered, and
    /// the attempt audited unless its handler did: every write by a valid
    /// token whatever came of it, and every refusal of a caller without
    /// one (those within the refusals' rate).
    async fn admin(&self, session: &mut ServerSession, path: &str) -> Response<Vec<u8>> {
        let rt = self.live.load_full();
        let (method, headers) = (&session.req_header().method, &session.req_header().headers);
        let method = method.clone();
        let who = access::caller(self.env, &rt.policy.server.admin_tokens, headers);
        let allowed = access::check(self.env, &who, &method, headers).and_then(|()| {
            if access::is_write(&method) {
                self.writes
                    .admit(who.actor(), crate::clock::instant() - self.started)
            } else {
                Ok(())
            }
        });
        let (response, result) = match allowed {
            Err(refusal) => (
                problem(refusal.status, refusal.kind, refusal.detail),
                "refused",
            ),
            Ok(()) => {
                let response = self.route(session, &rt, &who, &method, path).await;
                let result = match response.status().as_u16() {
                    500.. => "error",
                    400.. => "rejected",
                    _ => "ok",
                };
                (response, result)
            }
        };
        let unrecorded = response.extensions().get::<Audited>().is_none();
        // Every attempt to write, every refusal, and every failed read by
        // a valid token.
        let failed_read = who.identified() && result != "ok";
        if unrecorded && (access::is_write(&method) || result == "refused" || failed_read) {
            let entry = audit::Entry {
                time: crate::access_log::timestamp(rt.wall()),
                actor: who.actor(),
                action: action_of(&method, path),
                target: serde_json::json!({ "method": method.as_str(), "path": path }),
                before: serde_json::Value::Null,
                after: serde_json::json!({
                    "status": response.status().as_u16(),
                    "detail": response.extensions().get::<Detail>().map(|d| d.0.as_str()),
                }),
                reason: None,
                result,
                suppressed: None,
            };
            if who.identified() {
                self.audit(&rt, entry);
            } else {
                self.audit_refusal(&rt, entry);
            }
        }
        response
    }

    /// An allowed `/admin/*` request, answered by the handler [`endpoint`]
    /// names; a write's body is read first.
    async fn route(
        &self,
        session: &mut ServerSession,
        rt: &Runtime,
        who: &access::Caller,
        method: &Method,
        path: &str,
    ) -> Response<Vec<u8>> {
        let asked = endpoint(method, path);
        let body = if asked.takes_body() {
            match body::read(session).await {
                Ok(body) => body,
                Err(response) => return *response,
            }
        } else {
            Vec::new()
        };
        match asked {
            Endpoint::Top => self.top(who.identified()),
            Endpoint::Explain => {
                limits::explain(rt, session.req_header().uri.query().unwrap_or("")).await
            }
            // The runtime live now, loaded afresh (as `top` does), not `rt`.
            Endpoint::Usage => {
                limits::usage(&self.live.load(), session.req_header().uri.query()).await
            }
            Endpoint::Reset => self.reset_or_credit(rt, who, "reset", &body).await,
            Endpoint::Credit => self.reset_or_credit(rt, who, "credit", &body).await,
            Endpoint::Reload => self.reload(rt, who).await,
            Endpoint::Revocations => credentials::list_revocations(rt),
            Endpoint::Revoke => self.revoke(rt, who, &body).await,
            Endpoint::Unrevoke(credential) => {
                self.unrevoke(rt, who, &percent_decode(credential)).await
            }
            Endpoint::CreateCredential => self.create_credential(rt, who, &body).await,
            Endpoint::ShowCredential(id) => self.show_credential(rt, &percent_decode(id)).await,
            Endpoint::DeleteCredential(id) => {
                self.delete_credential(rt, who, &percent_decode(id)).await
            }
            Endpoint::Overrides => overrides::list(rt),
            Endpoint::PutOverride(tenant) => {
                self.put_override(rt, who, &percent_decode(tenant), &body)
                    .await
            }
            Endpoint::DeleteOverride(tenant) => {
                self.delete_override(rt, who, &percent_decode(tenant)).await
            }
            Endpoint::MethodNotAllowed => method_not_allowed(),
            Endpoint::NotFound => {
                problem(404, "admin-not-found", "no admin endpoint has this path")
            }
        }
    }

    /// Records an admin write in the audit log and the metric.
    fn audit(&self, rt: &Runtime, entry: audit::Entry<'_>) {
        rt.services
            .metrics
            .admin_actions
            .with_label_values(&[entry.action, entry.result])
            .inc();
        audit::record(rt.policy.server.audit_log.as_deref(), &entry);
    }

    /// Records the refusal of a caller no token identified: always in the
    /// metric, in the audit log within [`audit::REFUSALS_PER_SECOND`] lines
    /// in all, the count of those left out said at the end of their second
    /// (or before the next line, when one comes first).
    fn audit_refusal(&self, rt: &Arc<Runtime>, entry: audit::Entry<'_>) {
        rt.services
            .metrics
            .admin_actions
            .with_label_values(&[entry.action, entry.result])
            .inc();
        let now = crate::clock::instant() - self.started;
        let left_out = match self.refusals.admit(now) {
            audit::Admit::Write { left_out } => left_out,
            audit::Admit::LeftOut { say_at: None } => return,
            audit::Admit::LeftOut { say_at: Some(at) } => {
                let (refusals, rt) = (self.refusals.clone(), rt.clone());
                let due = tokio::time::Instant::from_std(self.started + at);
                tokio::spawn(async move {
                    tokio::time::sleep_until(due).await;
                    say_left_out(&rt, refusals.take_left_out());
                });
                return;
            }
        };
        say_left_out(rt, left_out);
        audit::record(rt.policy.server.audit_log.as_deref(), &entry);
    }

    /// A change of an admin record, audited with what was in force before
    /// and after; the answer is `after` (with `status`), or 503 when the
    /// store failed.
    fn changed<T: serde::Serialize>(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        change: Change<'_, T>,
    ) -> Response<Vec<u8>> {
        let (result, before, after) = match &change.done {
            Ok(before) => ("ok", serde_json::json!(before), change.after.clone()),
            Err(e) => (
                "error",
                serde_json::Value::Null,
                serde_json::json!({ "error": e.to_string() }),
            ),
        };
        self.audit(
            rt,
            audit::Entry {
                time: crate::access_log::timestamp(rt.wall()),
                actor: who.actor(),
                action: change.action,
                target: change.target.clone(),
                before,
                after,
                reason: change.reason,
                result,
                suppressed: None,
            },
        );
        audited(match change.done {
            Ok(_) => {
                let body = if change.after.is_null() {
                    serde_json::json!({ "removed": change.target })
                } else {
                    change.after
                };
                respond(
                    change.status,
                    "application/json",
                    body.to_string().into_bytes(),
                )
            }
            Err(e) => problem(
                503,
                "admin-store-unavailable",
                &format!("the limit store: {e}"),
            ),
        })
    }
}

/// An answer of `status` with `body`, never kept by a cache.
fn respond(status: u16, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .header("cache-control", "no-store")
        .body(body)
        .unwrap_or_default()
}

/// A plain-text answer.
fn text(status: u16, body: String) -> Response<Vec<u8>> {
    respond(status, "text/plain; charset=utf-8", body.into_bytes())
}

/// Marks an answer whose handler wrote its audit line (with what changed),
/// so that [`Admin::admin`] does not write another.
#[derive(Debug, Clone, Copy)]
struct Audited;

/// An answer marked [`Audited`].
fn audited(mut response: Response<Vec<u8>>) -> Response<Vec<u8>> {
    response.extensions_mut().insert(Audited);
    response
}

/// A problem answer's detail, for the audit line of the attempt.
#[derive(Debug, Clone)]
struct Detail(String);

/// An `application/problem+json` answer (RFC 9457).
fn problem(status: u16, kind: &str, detail: &str) -> Response<Vec<u8>> {
    let title = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    let body = serde_json::json!({
        "type": format!("urn:tollgate:problem:{kind}"),
        "title": title,
        "status": status,
        "detail": detail,
    });
    let mut response = respond(
        status,
        "application/problem+json",
        body.to_string().into_bytes(),
    );
    response.extensions_mut().insert(Detail(detail.to_string()));
    response
}

/// An admin endpoint asked with a method it does not take.
fn method_not_allowed() -> Response<Vec<u8>> {
    problem(
        405,
        "admin-method-not-allowed",
        "this admin endpoint does not take this method",
    )
}

/// The audit log's actions, as `action_of` names them: `read` is a refused
/// read, `unknown` a write to no endpoint.
const ACTIONS: [&str; 11] = [
    "read",
    "unknown",
    "reload",
    "reset",
    "credit",
    "revoke",
    "unrevoke",
    "override",
    "unoverride",
    "create_credential",
    "delete_credential",
];

/// An admin write's `result`: done, refused by its caller's rights or
/// rate, rejected as invalid, or failed.
const RESULTS: [&str; 4] = ["ok", "refused", "rejected", "error"];

/// The audit log's `action` of a request to `path`.
fn action_of(method: &Method, path: &str) -> &'static str {
    if !access::is_write(method) {
        return "read";
    }
    match (method, path) {
        (_, "/admin/reload") => "reload",
        (_, "/admin/reset") => "reset",
        (_, "/admin/credit") => "credit",
        (&Method::POST, "/admin/revocations") => "revoke",
        (&Method::DELETE, p) if p.starts_with("/admin/revocations/") => "unrevoke",
        (&Method::PUT, p) if p.starts_with("/admin/overrides/") => "override",
        (&Method::DELETE, p) if p.starts_with("/admin/overrides/") => "unoverride",
        (&Method::POST, "/admin/credentials") => "create_credential",
        (&Method::DELETE, p) if p.starts_with("/admin/credentials/") => "delete_credential",
        _ => "unknown",
    }
}

/// Whether `v` may name a credential or a tenant: 1 to 256 bytes, each
/// printable ASCII (no control byte, newline or NUL that could forge a log
/// line or a store key).
fn printable(v: &str) -> bool {
    (1..=256).contains(&v.len()) && v.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// The longest a revocation may last: 30 days.
const MAX_REVOCATION_S: u64 = 30 * 24 * 3600;

/// The audit line that says `left_out` refusals were left out of the log,
/// when some were.
fn say_left_out(rt: &Runtime, left_out: u64) {
    if left_out > 0 {
        let time = crate::access_log::timestamp(rt.wall());
        let file = rt.policy.server.audit_log.as_deref();
        audit::record(file, &audit::Entry::suppressed(time, left_out));
    }
}

/// A change of an admin record, for [`Admin::changed`].
struct Change<'a, T> {
    /// The audit log's `action`, one of [`ACTIONS`].
    action: &'static str,
    /// What it acts on; the answer's `removed` when the record is removed.
    target: serde_json::Value,
    /// The reason the caller gave.
    reason: Option<&'a str>,
    /// The store's answer: the record in force before.
    done: Result<Option<T>, crate::limits::StoreError>,
    /// The record after (`null` when removed).
    after: serde_json::Value,
    /// The answer's status when the store did its part.
    status: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_write_is_audited_under_an_action_exported_from_start() {
        for (method, path) in [
            (Method::POST, "/admin/reload"),
            (Method::POST, "/admin/reset"),
            (Method::POST, "/admin/credit"),
            (Method::POST, "/admin/revocations"),
            (Method::DELETE, "/admin/revocations/c1"),
            (Method::PUT, "/admin/overrides/acme"),
            (Method::DELETE, "/admin/overrides/acme"),
            (Method::POST, "/admin/credentials"),
            (Method::DELETE, "/admin/credentials/c1"),
        ] {
            let action = action_of(&method, path);
            assert!(ACTIONS.contains(&action), "{method} {path}: {action}");
        }
        assert_eq!(action_of(&Method::POST, "/admin/nothing"), "unknown");
        assert_eq!(action_of(&Method::GET, "/admin/reload"), "read");
        assert!(ACTIONS.contains(&"unknown") && ACTIONS.contains(&"read"));
    }

    #[test]
    fn the_router_tells_a_wrong_method_from_an_unknown_path() {
        use super::Endpoint as E;
        for (method, path, want) in [
            (Method::GET, "/admin/top", E::Top),
            (Method::POST, "/admin/top", E::MethodNotAllowed),
            (Method::HEAD, "/admin/usage", E::MethodNotAllowed),
            (Method::DELETE, "/admin/reload", E::MethodNotAllowed),
            (Method::GET, "/admin/revocations", E::Revocations),
            (Method::DELETE, "/admin/revocations", E::MethodNotAllowed),
            (
                Method::DELETE,
                "/admin/revocations/c%201",
                E::Unrevoke("c%201"),
            ),
            (Method::GET, "/admin/revocations/c1", E::MethodNotAllowed),
            (Method::GET, "/admin/credentials", E::MethodNotAllowed),
            (Method::GET, "/admin/credentials/", E::MethodNotAllowed),
            (Method::GET, "/admin/overrides/", E::Overrides),
            (
                Method::GET,
                "/admin/credentials//admin/credentials/c1",
                E::ShowCredential("/admin/credentials/c1"),
            ),
            (Method::PUT, "/admin/overrides/acme", E::PutOverride("acme")),
            (Method::POST, "/admin/overrides/acme", E::MethodNotAllowed),
            (Method::GET, "/admin/top/x", E::NotFound),
            (Method::GET, "/admin/overridesx", E::NotFound),
            (Method::POST, "/admin/nothing", E::NotFound),
        ] {
            assert_eq!(endpoint(&method, path), want, "{method} {path}");
        }
    }
}
