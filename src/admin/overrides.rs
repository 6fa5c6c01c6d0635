//! Tenants' overrides: another plan or other numbers for a tenant until
//! an expiry, on every instance (`/admin/overrides`).

use http::Response;

use crate::runtime::Runtime;

use super::{access, body, printable, problem, respond, Admin, Change, MAX_REVOCATION_S};

/// `GET /admin/overrides`: the overrides in force.
pub(super) fn list(rt: &Runtime) -> Response<Vec<u8>> {
    let active = rt.services.overrides.active(rt.wall_ms());
    let body = serde_json::json!({ "overrides": active }).to_string();
    respond(200, "application/json", body.into_bytes())
}

impl Admin {
    /// `PUT /admin/overrides/{tenant}`: another plan or other numbers for
    /// the tenant until the expiry, on every instance.
    pub(super) async fn put_override(
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
        let now = rt.wall_ms();
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
        let store = rt.limiter().records();
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
    pub(super) async fn delete_override(
        &self,
        rt: &Runtime,
        who: &access::Caller,
        tenant: &str,
    ) -> Response<Vec<u8>> {
        let now = rt.wall_ms();
        if !rt
            .services
            .overrides
            .active(now)
            .iter()
            .any(|o| o.tenant == tenant)
        {
            return problem(
                404,
                "admin-not-found",
                &format!("no override of {tenant:?} in force"),
            );
        }
        let store = rt.limiter().records();
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
}

/// The body of `PUT /admin/overrides/{tenant}`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PutOverride {
    /// The plan the tenant is on meanwhile, by name.
    plan: Option<String>,
    /// Other numbers for limits, by limit name.
    #[serde(default)]
    limits: std::collections::BTreeMap<String, serde_json::Value>,
    /// Seconds until the override ends.
    expires_in_s: u64,
    /// Why, for the audit log and the record.
    reason: String,
}
