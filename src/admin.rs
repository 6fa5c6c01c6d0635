//! The admin listener: liveness, readiness, metrics, heavy hitters, quota
//! usage and reload. Who may use `/admin/*` is [`access`]'s to say; every
//! write, allowed, refused or failed, goes to the [`audit`] log, and so
//! does every refusal of a caller no token identified (those at a bounded
//! rate). Write bodies are read and parsed by [`body`]. Every error of
//! `/admin/*` is `application/problem+json`.

pub mod access;
pub mod audit;
pub mod body;

pub use access::EnvToken;

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Method, Response};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::config::{Mode, OnStoreError};
use crate::drain::Drain;
use crate::limits::algorithm::Params;
use crate::limits::{Charge, Group, Identity};
use crate::reload::Reloader;
use crate::runtime::Runtime;

/// Rows in `/admin/top`.
const TOP_ROWS: usize = 20;

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
    refusals: audit::Throttle,
    started: std::time::Instant,
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
            refusals: audit::Throttle::default(),
            started: crate::clock::instant(),
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
    /// in all, the count of those left out said before the next line.
    fn audit_refusal(&self, rt: &Runtime, entry: audit::Entry<'_>) {
        rt.services
            .metrics
            .admin_actions
            .with_label_values(&[entry.action, entry.result])
            .inc();
        let now = crate::clock::instant() - self.started;
        let Some(left_out) = self.refusals.admit(now) else {
            return;
        };
        let file = rt.policy.server.audit_log.as_deref();
        if left_out > 0 {
            let time = crate::access_log::timestamp(crate::clock::wall());
            audit::record(file, &audit::Entry::suppressed(time, left_out));
        }
        audit::record(file, &entry);
    }

    /// `POST /admin/reset` and `POST /admin/credit`: the key starts full,
    /// or gets `units` back; audited with what it held before and after.
    async fn reset_or_credit(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        action: &'static str,
        body: &[u8],
    ) -> Response<Vec<u8>> {
        let k = match body::parse(body).and_then(KeyOf::from_json) {
            Ok(k) => k,
            Err(e) => return problem(400, "admin-bad-request", &format!("the body: {e}")),
        };
        let units = match (action, k.units) {
            ("credit", Some(u)) if u > 0 => u,
            ("credit", _) => {
                return problem(
                    400,
                    "admin-bad-request",
                    "a credit needs units, a whole number above 0",
                )
            }
            (_, None) => 0,
            (_, Some(_)) => return problem(400, "admin-bad-request", "a reset takes no units"),
        };
        let charge = match charge_of(rt, &k, units) {
            Ok(c) => c,
            Err((status, detail)) => return problem(status, "admin-bad-request", &detail),
        };
        let probe = Charge {
            cost: 0,
            ..charge.clone()
        };
        let remaining = |peeked: Vec<(Result<crate::limits::Verdict, String>, u64)>| {
            peeked
                .into_iter()
                .next()
                .and_then(|(v, _)| v.ok())
                .map(|v| v.remaining)
        };
        let before = remaining(rt.limiter().peek(std::slice::from_ref(&probe)).await);
        let done = if action == "reset" {
            rt.limiter().reset(std::slice::from_ref(&charge)).await
        } else {
            rt.limiter().credit(std::slice::from_ref(&charge)).await
        };
        let after = remaining(rt.limiter().peek(std::slice::from_ref(&probe)).await);
        let target = serde_json::json!({
            "limit": k.limit, "credential": k.credential, "tenant": k.tenant,
            "ip": k.ip, "route": k.route, "units": k.units,
        });
        self.audit(
            rt,
            audit::Entry {
                time: crate::access_log::timestamp(crate::clock::wall()),
                actor: who.actor(),
                action,
                target,
                before: serde_json::json!({ "remaining": before }),
                after: match &done {
                    Ok(()) => serde_json::json!({ "remaining": after }),
                    Err(e) => serde_json::json!({ "error": e }),
                },
                reason: k.reason.as_deref(),
                result: if done.is_ok() { "ok" } else { "error" },
                suppressed: None,
            },
        );
        audited(match done {
            Ok(()) => {
                let body = serde_json::json!({
                    "limit": k.limit,
                    "remaining_before": before,
                    "remaining": after,
                });
                respond(200, "application/json", body.to_string().into_bytes())
            }
            Err(e) => problem(
                503,
                "admin-store-unavailable",
                &format!("the limit store: {e}"),
            ),
        })
    }

    /// `POST /admin/revocations`: the credential answers 401 on every
    /// instance until the revocation expires.
    async fn revoke(&self, rt: &Runtime, who: &access::Caller, body: &[u8]) -> Response<Vec<u8>> {
        let r: Revoke = match body::parse(body) {
            Ok(r) => r,
            Err(e) => return problem(400, "admin-bad-request", &format!("the body: {e}")),
        };
        if !(1..=MAX_REVOCATION_S).contains(&r.expires_in_s) {
            return problem(
                400,
                "admin-bad-request",
                "expires_in_s must be from 1 to 2592000 (30 days)",
            );
        }
        if r.reason.trim().is_empty() {
            return problem(400, "admin-bad-request", "a revocation needs a reason");
        }
        let auth = &rt.policy.auth;
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        let known = auth.jwt.names(&r.credential)
            || r.credential.starts_with("fwd:") && auth.forward.is_some()
            || auth.keys.credentials().any(|c| *c.id == *r.credential)
            || auth.store_keys.is_some()
                && matches!(
                    rt.services.store_keys.get(store, &r.credential).await,
                    Ok(Some(_))
                );
        if !known {
            return problem(
                404,
                "admin-bad-request",
                &format!("no credential {:?}", r.credential),
            );
        }
        let now = crate::clock::wall_ms();
        let revocation = crate::identity::revocations::Revocation {
            credential: r.credential.clone(),
            expires_at_ms: now + r.expires_in_s * 1000,
            reason: r.reason.clone(),
            actor: who.actor().to_string(),
        };
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        let done = rt
            .services
            .revocations
            .set(store, &r.credential, Some(revocation.clone()), now)
            .await;
        self.changed(
            rt,
            who,
            Change {
                action: "revoke",
                target: serde_json::json!({ "credential": r.credential }),
                reason: Some(&r.reason),
                done,
                after: serde_json::json!(revocation),
                status: 201,
            },
        )
    }

    /// `PUT /admin/overrides/{tenant}`: another plan or other numbers for
    /// the tenant until the expiry, on every instance.
    async fn put_override(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        tenant: &str,
        body: &[u8],
    ) -> Response<Vec<u8>> {
        let put: PutOverride = match body::parse(body) {
            Ok(p) => p,
            Err(e) => return problem(400, "admin-bad-request", &format!("the body: {e}")),
        };
        if !printable(tenant) {
            return problem(
                400,
                "admin-bad-request",
                "the tenant must be 1-256 printable characters",
            );
        }
        if !(1..=MAX_REVOCATION_S).contains(&put.expires_in_s) {
            return problem(
                400,
                "admin-bad-request",
                "expires_in_s must be from 1 to 2592000 (30 days)",
            );
        }
        if put.reason.trim().is_empty() {
            return problem(400, "admin-bad-request", "an override needs a reason");
        }
        if put.plan.is_none() && put.limits.is_empty() {
            return problem(
                400,
                "admin-bad-request",
                "an override names a plan, limits, or both",
            );
        }
        let now = crate::clock::wall_ms();
        let o = crate::identity::overrides::Override {
            tenant: tenant.to_string(),
            plan: put.plan,
            limits: put.limits,
            expires_at_ms: now + put.expires_in_s * 1000,
            reason: put.reason,
            actor: who.actor().to_string(),
        };
        // Validated as the YAML would be, against the live policy.
        if let Err(problems) = crate::config::resolve_override(&rt.policy, &o) {
            return problem(400, "admin-bad-request", &problems.join("; "));
        }
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        let done = rt
            .services
            .overrides
            .set(store, tenant, Some(o.clone()), now)
            .await;
        self.changed(
            rt,
            who,
            Change {
                action: "override",
                target: serde_json::json!({ "tenant": tenant }),
                reason: Some(&o.reason),
                done,
                after: serde_json::json!(o),
                status: 200,
            },
        )
    }

    /// `DELETE /admin/overrides/{tenant}`.
    async fn delete_override(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        tenant: &str,
    ) -> Response<Vec<u8>> {
        let now = crate::clock::wall_ms();
        if !rt
            .services
            .overrides
            .active(now)
            .iter()
            .any(|o| o.tenant == tenant)
        {
            return problem(
                404,
                "admin-bad-request",
                &format!("no override of {tenant:?} in force"),
            );
        }
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        let done = rt.services.overrides.set(store, tenant, None, now).await;
        self.changed(
            rt,
            who,
            Change {
                action: "unoverride",
                target: serde_json::json!({ "tenant": tenant }),
                reason: None,
                done,
                after: serde_json::Value::Null,
                status: 200,
            },
        )
    }

    /// `POST /admin/credentials`: a credential for a key, kept in the store
    /// and known to every instance within `server.admin_refresh_ms`.
    async fn create_credential(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        body: &[u8],
    ) -> Response<Vec<u8>> {
        if rt.policy.auth.store_keys.is_none() {
            return store_keys_off();
        }
        let new: NewCredential = match body::parse(body) {
            Ok(n) => n,
            Err(e) => return problem(400, "admin-bad-request", &format!("the body: {e}")),
        };
        let Some(digest) =
            crate::identity::auth::parse_digest(&new.sha256).filter(|_| new.sha256.len() == 64)
        else {
            return problem(
                400,
                "admin-bad-request",
                "sha256 must be the key's SHA-256 as 64 hex digits",
            );
        };
        if !printable(&new.id) || new.id.contains(' ') {
            return problem(
                400,
                "admin-bad-request",
                "id must be 1-256 printable characters, no spaces",
            );
        }
        if new.id.starts_with("jwt:") || new.id.starts_with("fwd:") {
            return problem(
                400,
                "admin-bad-request",
                "ids starting jwt: and fwd: belong to JWT and forward-auth callers",
            );
        }
        if !printable(&new.tenant) {
            return problem(
                400,
                "admin-bad-request",
                "tenant must be 1-256 printable characters",
            );
        }
        if let Some(plan) = &new.plan {
            if !rt.policy.plans.iter().any(|p| p.name == *plan) {
                return problem(400, "admin-bad-request", &format!("no plan {plan:?}"));
            }
        }
        let keys = &rt.policy.auth.keys;
        if keys.has_id(&new.id) {
            return problem(
                409,
                "admin-conflict",
                &format!("credential {:?} is in the policy's keys", new.id),
            );
        }
        if keys.verify_digest(&digest).is_some() {
            return problem(
                409,
                "admin-conflict",
                "the key belongs to a credential of the policy's keys",
            );
        }
        let stored = crate::identity::store_keys::Stored {
            id: new.id,
            tenant: new.tenant,
            plan: new.plan,
        };
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        let done = match rt.services.store_keys.create(store, &stored, &digest).await {
            Err(crate::identity::store_keys::CreateError::Conflict(why)) => {
                return problem(409, "admin-conflict", &why)
            }
            Err(crate::identity::store_keys::CreateError::Store(e)) => Err(e),
            Ok(()) => Ok(None::<crate::identity::store_keys::Stored>),
        };
        self.changed(
            rt,
            who,
            Change {
                action: "create_credential",
                target: serde_json::json!({ "credential": stored.id }),
                reason: None,
                done,
                after: serde_json::json!(stored),
                status: 201,
            },
        )
    }

    /// `DELETE /admin/credentials/{id}`: refused on every instance within
    /// `server.admin_refresh_ms`.
    async fn delete_credential(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        id: &str,
    ) -> Response<Vec<u8>> {
        if rt.policy.auth.store_keys.is_none() {
            return store_keys_off();
        }
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        let done = rt.services.store_keys.delete(store, id).await;
        if matches!(done, Ok(None)) {
            return problem(
                404,
                "admin-bad-request",
                &format!("no credential {id:?} in the store"),
            );
        }
        self.changed(
            rt,
            who,
            Change {
                action: "delete_credential",
                target: serde_json::json!({ "credential": id }),
                reason: None,
                done,
                after: serde_json::Value::Null,
                status: 200,
            },
        )
    }

    /// `GET /admin/credentials/{id}`.
    async fn show_credential(&self, rt: &Runtime, id: &str) -> Response<Vec<u8>> {
        if rt.policy.auth.store_keys.is_none() {
            return store_keys_off();
        }
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        match rt.services.store_keys.get(store, id).await {
            Ok(Some(stored)) => respond(
                200,
                "application/json",
                serde_json::json!(stored).to_string().into_bytes(),
            ),
            Ok(None) => problem(
                404,
                "admin-bad-request",
                &format!("no credential {id:?} in the store"),
            ),
            Err(e) => problem(
                503,
                "admin-store-unavailable",
                &format!("the limit store: {e}"),
            ),
        }
    }

    /// `DELETE /admin/revocations/{credential}`.
    async fn unrevoke(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        credential: &str,
    ) -> Response<Vec<u8>> {
        let now = crate::clock::wall_ms();
        if !rt.services.revocations.revoked(credential, now) {
            return problem(
                404,
                "admin-bad-request",
                &format!("no revocation of {credential:?} in force"),
            );
        }
        let store = rt.limiter().shared_store().map(|s| s.as_ref());
        let done = rt
            .services
            .revocations
            .set(store, credential, None, now)
            .await;
        self.changed(
            rt,
            who,
            Change {
                action: "unrevoke",
                target: serde_json::json!({ "credential": credential }),
                reason: None,
                done,
                after: serde_json::Value::Null,
                status: 200,
            },
        )
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
                time: crate::access_log::timestamp(crate::clock::wall()),
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
        if unrecorded && (access::is_write(&method) || result == "refused") {
            let entry = audit::Entry {
                time: crate::access_log::timestamp(crate::clock::wall()),
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

    /// An allowed `/admin/*` request, answered.
    async fn route(
        &self,
        session: &mut ServerSession,
        rt: &Runtime,
        who: &access::Caller,
        method: &Method,
        path: &str,
    ) -> Response<Vec<u8>> {
        let authorized = who.identified();
        match (method, path) {
            (&Method::GET, "/admin/revocations") => {
                let active = rt.services.revocations.active(crate::clock::wall_ms());
                let body = serde_json::json!({ "revocations": active }).to_string();
                respond(200, "application/json", body.into_bytes())
            }
            (&Method::POST, "/admin/revocations") => {
                let body = match body::read(session).await {
                    Ok(body) => body,
                    Err(response) => return *response,
                };
                self.revoke(rt, who, &body).await
            }
            (&Method::DELETE, p) if p.starts_with("/admin/revocations/") => {
                let credential = p.trim_start_matches("/admin/revocations/");
                let credential = percent_decode(credential);
                self.unrevoke(rt, who, &credential).await
            }
            (&Method::POST, "/admin/credentials") => {
                let body = match body::read(session).await {
                    Ok(body) => body,
                    Err(response) => return *response,
                };
                self.create_credential(rt, who, &body).await
            }
            (&Method::GET, p) if p.starts_with("/admin/credentials/") => {
                let id = percent_decode(p.trim_start_matches("/admin/credentials/"));
                self.show_credential(rt, &id).await
            }
            (&Method::DELETE, p) if p.starts_with("/admin/credentials/") => {
                let id = percent_decode(p.trim_start_matches("/admin/credentials/"));
                self.delete_credential(rt, who, &id).await
            }
            (&Method::GET, "/admin/overrides") => {
                let active = rt.services.overrides.active(crate::clock::wall_ms());
                let body = serde_json::json!({ "overrides": active }).to_string();
                respond(200, "application/json", body.into_bytes())
            }
            (&Method::PUT, p) if p.starts_with("/admin/overrides/") => {
                let tenant = percent_decode(p.trim_start_matches("/admin/overrides/"));
                let body = match body::read(session).await {
                    Ok(body) => body,
                    Err(response) => return *response,
                };
                self.put_override(rt, who, &tenant, &body).await
            }
            (&Method::DELETE, p) if p.starts_with("/admin/overrides/") => {
                let tenant = percent_decode(p.trim_start_matches("/admin/overrides/"));
                self.delete_override(rt, who, &tenant).await
            }
            (&Method::POST, "/admin/reset" | "/admin/credit") => {
                let action = if path == "/admin/reset" {
                    "reset"
                } else {
                    "credit"
                };
                let body = match body::read(session).await {
                    Ok(body) => body,
                    Err(response) => return *response,
                };
                self.reset_or_credit(rt, who, action, &body).await
            }
            (&Method::GET, "/admin/top") => {
                let rt = self.live.load();
                let rows = rt
                    .services
                    .top
                    .report(TOP_ROWS, authorized, &rt.services.redactor);
                let body = serde_json::json!({ "top": rows }).to_string();
                respond(200, "application/json", body.into_bytes())
            }
            (&Method::GET, "/admin/explain") => {
                explain(rt, session.req_header().uri.query().unwrap_or("")).await
            }
            (&Method::GET, "/admin/usage") => {
                let rt = self.live.load();
                usage(&rt, session.req_header().uri.query()).await
            }
            (&Method::POST, "/admin/reload") => {
                let reloader = self.reloader.clone();
                let before = rt.policy.policy_version.to_string();
                let outcome = tokio::task::spawn_blocking(move || reloader.reload()).await;
                let (result, after, response) = match outcome {
                    Ok(Ok(version)) => (
                        "ok",
                        serde_json::json!(version.to_string()),
                        text(200, format!("reloaded: policy {version}\n")),
                    ),
                    Ok(Err(e)) => (
                        "rejected",
                        serde_json::json!(e.to_string()),
                        problem(
                            400,
                            "admin-reload-rejected",
                            &format!("reload rejected, previous policy kept: {e}"),
                        ),
                    ),
                    Err(_) => (
                        "error",
                        serde_json::Value::Null,
                        problem(500, "admin-internal", "reload failed"),
                    ),
                };
                self.audit(
                    rt,
                    audit::Entry {
                        time: crate::access_log::timestamp(crate::clock::wall()),
                        actor: who.actor(),
                        action: "reload",
                        target: serde_json::json!("policy"),
                        before: serde_json::json!(before),
                        after,
                        reason: None,
                        result,
                        suppressed: None,
                    },
                );
                audited(response)
            }
            (
                _,
                "/admin/top" | "/admin/reload" | "/admin/usage" | "/admin/explain" | "/admin/reset"
                | "/admin/credit" | "/admin/revocations" | "/admin/overrides"
                | "/admin/credentials",
            ) => method_not_allowed(),
            (_, p)
                if [
                    "/admin/revocations/",
                    "/admin/overrides/",
                    "/admin/credentials/",
                ]
                .iter()
                .any(|prefix| p.starts_with(prefix)) =>
            {
                method_not_allowed()
            }
            _ => problem(404, "admin-not-found", "no admin endpoint has this path"),
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

/// The answer of a credentials endpoint when the policy has no
/// `auth.store_keys`.
fn store_keys_off() -> Response<Vec<u8>> {
    problem(
        404,
        "admin-bad-request",
        "credentials are kept in the store only with auth.store_keys in the policy",
    )
}

/// The body of `POST /admin/credentials`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NewCredential {
    id: String,
    tenant: String,
    plan: Option<String>,
    sha256: String,
}

/// The body of `POST /admin/revocations`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Revoke {
    credential: String,
    expires_in_s: u64,
    reason: String,
}

/// A change of an admin record, for [`Admin::changed`].
struct Change<'a, T> {
    action: &'static str,
    target: serde_json::Value,
    reason: Option<&'a str>,
    /// The store's answer: the record in force before.
    done: Result<Option<T>, crate::limits::StoreError>,
    /// The record after (`null` when removed).
    after: serde_json::Value,
    status: u16,
}

/// The body of `PUT /admin/overrides/{tenant}`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PutOverride {
    plan: Option<String>,
    #[serde(default)]
    limits: std::collections::BTreeMap<String, serde_json::Value>,
    expires_in_s: u64,
    reason: String,
}

/// The longest a revocation may last: 30 days.
const MAX_REVOCATION_S: u64 = 30 * 24 * 3600;

/// The body of `POST /admin/reset` and `POST /admin/credit`: a limit and
/// the dimensions its key uses.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyOf {
    limit: String,
    credential: Option<String>,
    tenant: Option<String>,
    ip: Option<std::net::IpAddr>,
    route: Option<String>,
    /// Units to give back (credit only).
    units: Option<u64>,
    /// Why, for the audit log.
    reason: Option<String>,
    /// Values of the dimensions read from requests, by name
    /// (`"header.x-end-user": "alice"`).
    #[serde(skip)]
    values: std::collections::HashMap<String, String>,
}

impl KeyOf {
    /// From a JSON object whose members are the fields above, and values
    /// of the dimensions read from requests named as the key names them.
    fn from_json(mut object: serde_json::Map<String, serde_json::Value>) -> Result<Self, String> {
        let mut values = std::collections::HashMap::new();
        let named: Vec<String> = object
            .keys()
            .filter(|k| crate::key_values::names_a_value(k))
            .cloned()
            .collect();
        for name in named {
            match object.remove(&name) {
                Some(serde_json::Value::String(v)) => values.insert(name, v),
                _ => return Err(format!("{name:?} takes a string")),
            };
        }
        let mut k: KeyOf =
            serde_json::from_value(serde_json::Value::Object(object)).map_err(|e| e.to_string())?;
        k.values = values;
        Ok(k)
    }
}

/// The charge naming `k`'s key (of `cost`), or the problem with `k`.
fn charge_of(rt: &Runtime, k: &KeyOf, cost: u64) -> Result<Charge, (u16, String)> {
    let policy = &rt.policy;
    let bad = |status: u16, detail: String| (status, detail);
    let Some((id, limit)) = policy
        .limits
        .iter()
        .enumerate()
        .find(|(_, l)| *l.name == *k.limit)
    else {
        return Err(bad(404, format!("no limit {:?}", k.limit)));
    };
    let (credential, tenant) =
        crate::explain::caller(policy, k.credential.as_deref(), k.tenant.as_deref())
            .map_err(|id| bad(404, format!("no credential {id:?}")))?;
    if let Some(route) = &k.route {
        if !policy.routes.iter().any(|r| *r.name == **route) {
            return Err(bad(404, format!("no route {route:?}")));
        }
    }
    let dims = limit.key;
    let missing = [
        (dims.ip && k.ip.is_none(), "ip"),
        (dims.credential && credential.is_none(), "credential"),
        (dims.tenant && tenant.is_none(), "tenant"),
        (dims.route && k.route.is_none(), "route"),
    ];
    if let Some((_, dim)) = missing.iter().find(|(m, _)| *m) {
        return Err(bad(
            400,
            format!("limit {:?} is keyed by {dim}: give it", k.limit),
        ));
    }
    let tuned = tenant
        .as_ref()
        .and_then(|t| rt.tenant_override(t, crate::clock::wall_ms()));
    let plan = crate::admission::plan_of(
        policy,
        tuned.as_deref(),
        credential.as_deref(),
        tenant.as_ref(),
    );
    let who = Identity {
        ip: k
            .ip
            .map(|ip| crate::client_ip::key_network(ip, policy.client_ip.ipv6_prefix)),
        credential: credential.as_ref().map(|c| c.id.as_ref()),
        tenant: tenant.as_ref(),
        route: k.route.as_deref().unwrap_or(""),
    };
    let charge = crate::admission::charge(
        policy,
        id,
        &who,
        plan,
        tuned.as_deref(),
        cost,
        Group::Request,
    );
    let overridden = tuned.as_deref().and_then(|o| o.params(id)).is_some();
    crate::explain::with_values(&limit.values, &k.values, charge, overridden).map_err(|dims| {
        bad(
            400,
            format!("limit {:?} is keyed by {dims}: give it", k.limit),
        )
    })
}

/// `GET /admin/explain?path=…`: the route a request takes and, for every
/// limit of it, its parameters and state, read without charging.
async fn explain(rt: &Runtime, query: &str) -> Response<Vec<u8>> {
    let mut query = crate::explain::Query::parse(query);
    // A credential of the store, not of the policy's keys: read from it.
    if let Ok(q) = &mut query {
        let unlisted = q
            .credential
            .as_deref()
            .filter(|id| !rt.policy.auth.keys.has_id(id));
        if let (Some(id), Some(_)) = (unlisted, rt.policy.auth.store_keys) {
            let store = rt.limiter().shared_store().map(|s| s.as_ref());
            if let Ok(Some(stored)) = rt.services.store_keys.get(store, id).await {
                let plan = stored
                    .plan
                    .as_deref()
                    .and_then(|name| rt.policy.plan_id(name));
                q.verified =
                    crate::identity::auth::Credential::new(&stored.id, &stored.tenant, plan)
                        .map(Arc::new);
            }
        }
    }
    let explained = match query.and_then(|q| {
        crate::explain::resolve(&rt.policy, &q, |t| {
            rt.tenant_override(t, crate::clock::wall_ms())
        })
    }) {
        Ok(e) => e,
        Err(p) => return problem(p.status, p.kind, &p.detail),
    };
    let charges: Vec<Charge> = explained
        .limits
        .iter()
        .filter_map(|(_, c)| c.as_ref().ok().cloned())
        .collect();
    let states = rt.limiter().peek(&charges).await;
    let body = crate::explain::to_json(&rt.policy, &explained, states.into_iter());
    respond(200, "application/json", body.to_string().into_bytes())
}

/// `GET /admin/usage?limit=L&tenant=T`: a quota's period, and how much of
/// it the tenant has used, read from the store the limit lives in (nothing
/// is charged). The quota's key may only be `[tenant]` or `[]`.
async fn usage(rt: &Runtime, query: Option<&str>) -> Response<Vec<u8>> {
    let args: std::collections::HashMap<String, String> =
        form_urlencoded::parse(query.unwrap_or("").as_bytes())
            .into_owned()
            .collect();
    let Some(name) = args.get("limit") else {
        return problem(
            400,
            "admin-bad-request",
            "usage needs ?limit=NAME (and &tenant=ID)",
        );
    };
    let policy = &rt.policy;
    let Some((id, limit)) = policy
        .limits
        .iter()
        .enumerate()
        .find(|(_, l)| *l.name == **name)
    else {
        return problem(404, "admin-bad-request", &format!("no limit {name:?}"));
    };
    if !matches!(limit.params, Params::Quota(_)) {
        return problem(
            400,
            "admin-bad-request",
            &format!("limit {name:?} is not a quota"),
        );
    }
    if limit.key.ip || limit.key.credential || limit.key.route {
        return problem(
            400,
            "admin-bad-request",
            &format!("limit {name:?} is keyed by more than the tenant; usage is read per tenant"),
        );
    }
    let tenant: Option<Arc<str>> = match (limit.key.tenant, args.get("tenant")) {
        (true, Some(t)) => Some(t.as_str().into()),
        (true, None) => {
            return problem(
                400,
                "admin-bad-request",
                &format!("limit {name:?} is per tenant: add &tenant=ID"),
            )
        }
        (false, _) => None,
    };
    let tuned = tenant
        .as_ref()
        .and_then(|t| rt.tenant_override(t, crate::clock::wall_ms()));
    let plan = crate::admission::plan_of(policy, tuned.as_deref(), None, tenant.as_ref());
    let who = Identity {
        ip: None,
        credential: None,
        tenant: tenant.as_ref(),
        route: "",
    };
    // Read without charging or writing, from the store the quota lives in
    // (a failing one is a 503 here, whatever the limit's failure mode).
    let probe =
        crate::admission::charge(policy, id, &who, plan, tuned.as_deref(), 0, Group::Request);
    let named: std::collections::HashMap<String, String> = args
        .iter()
        .filter(|(k, _)| crate::key_values::names_a_value(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let overridden = tuned.as_deref().and_then(|o| o.params(id)).is_some();
    let probe = match crate::explain::with_values(&limit.values, &named, probe, overridden) {
        Ok(p) => p,
        Err(dims) => {
            return problem(
                400,
                "admin-bad-request",
                &format!("limit {name:?} is keyed by {dims}: add &{dims}=VALUE"),
            )
        }
    };
    // The quota's numbers as this tenant's charges carry them (plan and
    // override applied).
    let Params::Quota(quota) = probe.params else {
        return problem(
            500,
            "admin-internal",
            "a plan changed the quota's algorithm",
        );
    };
    let verdict = match rt.limiter().peek(std::slice::from_ref(&probe)).await.pop() {
        Some((Ok(v), _)) => v,
        _ => {
            return problem(
                503,
                "admin-store-unavailable",
                "the limit store is unavailable",
            )
        }
    };
    // The period is the store's: the time the counter was read at.
    let now_ms = verdict.at;
    let (start, end) = quota.period.bounds(now_ms);
    let at = |ms: u64| {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
        humantime::format_rfc3339_seconds(t).to_string()
    };
    let body = serde_json::json!({
        "limit": limit.name.as_ref(),
        "tenant": tenant.as_deref(),
        "period": quota.period.name(now_ms),
        "period_start": at(start),
        "period_end": at(end),
        "quota": quota.limit,
        "used": quota.limit.saturating_sub(verdict.remaining),
        "remaining": verdict.remaining,
    });
    respond(200, "application/json", body.to_string().into_bytes())
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
                let metrics = rt.all_metrics();
                // Read where it is kept, at each scrape.
                metrics
                    .store_pending
                    .set(rt.limiter().store_pending() as i64);
                metrics.revocations_active.set(
                    rt.services
                        .revocations
                        .active(crate::clock::wall_ms())
                        .len() as i64,
                );
                metrics
                    .overrides_active
                    .set(rt.services.overrides.active(crate::clock::wall_ms()).len() as i64);
                respond(200, "text/plain; version=0.0.4", metrics.render())
            }
            p if p.starts_with("/admin/") => self.admin(session, p).await,
            _ => problem(
                404,
                "admin-not-found",
                "the admin listener has no such path",
            ),
        }
    }
}

/// A path segment, percent-decoded (a credential id may hold any
/// character).
fn percent_decode(segment: &str) -> String {
    form_urlencoded::parse(format!("x={}", segment.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
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
}
