//! Credentials: the revocations that refuse one on every instance
//! (`/admin/revocations`), and the keys kept in the store rather than in
//! the policy (`/admin/credentials`, with `auth.store_keys`).

use http::Response;

use crate::runtime::Runtime;

use super::{access, body, printable, problem, respond, Admin, Change, MAX_REVOCATION_S};

/// `GET /admin/revocations`: the revocations in force.
pub(super) fn list_revocations(rt: &Runtime) -> Response<Vec<u8>> {
    let active = rt.services.revocations.active(rt.wall_ms());
    let body = serde_json::json!({ "revocations": active }).to_string();
    respond(200, "application/json", body.into_bytes())
}

impl Admin {
    /// `POST /admin/revocations`: the credential answers 401 on every
    /// instance until the revocation expires.
    pub(super) async fn revoke(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        body: &[u8],
    ) -> Response<Vec<u8>> {
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
        let store = rt.limiter().records();
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
                "admin-not-found",
                &format!("no credential {:?}", r.credential),
            );
        }
        let now = rt.wall_ms();
        let revocation = crate::identity::revocations::Revocation {
            credential: r.credential.clone(),
            expires_at_ms: now + r.expires_in_s * 1000,
            reason: r.reason.clone(),
            actor: who.actor().to_string(),
        };
        let store = rt.limiter().records();
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

    /// `DELETE /admin/revocations/{credential}`.
    pub(super) async fn unrevoke(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        credential: &str,
    ) -> Response<Vec<u8>> {
        let now = rt.wall_ms();
        if !rt.services.revocations.revoked(credential, now) {
            return problem(
                404,
                "admin-not-found",
                &format!("no revocation of {credential:?} in force"),
            );
        }
        let store = rt.limiter().records();
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

    /// `POST /admin/credentials`: a credential for a key, kept in the store
    /// and known to every instance within `server.admin_refresh_ms`.
    pub(super) async fn create_credential(
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
        let store = rt.limiter().records();
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

    /// `GET /admin/credentials/{id}`.
    pub(super) async fn show_credential(&self, rt: &Runtime, id: &str) -> Response<Vec<u8>> {
        if rt.policy.auth.store_keys.is_none() {
            return store_keys_off();
        }
        let store = rt.limiter().records();
        match rt.services.store_keys.get(store, id).await {
            Ok(Some(stored)) => respond(
                200,
                "application/json",
                serde_json::json!(stored).to_string().into_bytes(),
            ),
            Ok(None) => problem(
                404,
                "admin-not-found",
                &format!("no credential {id:?} in the store"),
            ),
            Err(e) => problem(
                503,
                "admin-store-unavailable",
                &format!("the limit store: {e}"),
            ),
        }
    }

    /// `DELETE /admin/credentials/{id}`: refused on every instance within
    /// `server.admin_refresh_ms`.
    pub(super) async fn delete_credential(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        id: &str,
    ) -> Response<Vec<u8>> {
        if rt.policy.auth.store_keys.is_none() {
            return store_keys_off();
        }
        let store = rt.limiter().records();
        let done = rt.services.store_keys.delete(store, id).await;
        if matches!(done, Ok(None)) {
            return problem(
                404,
                "admin-not-found",
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
}

/// The answer of a credentials endpoint when the policy has no
/// `auth.store_keys`.
fn store_keys_off() -> Response<Vec<u8>> {
    problem(
        404,
        "admin-not-found",
        "credentials are kept in the store only with auth.store_keys in the policy",
    )
}

/// The body of `POST /admin/credentials`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NewCredential {
    /// The credential's id.
    id: String,
    /// The tenant it belongs to.
    tenant: String,
    /// Its plan, by name.
    plan: Option<String>,
    /// The key's SHA-256, as 64 hex digits.
    sha256: String,
}

/// The body of `POST /admin/revocations`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Revoke {
    /// The credential's id.
    credential: String,
    /// Seconds until the revocation ends.
    expires_in_s: u64,
    /// Why, for the audit log and the record.
    reason: String,
}
