//! The policy: loaded again from its file on `POST /admin/reload`.

use http::Response;

use crate::runtime::Runtime;

use super::{access, audit, audited, problem, text, Admin};

impl Admin {
    /// `POST /admin/reload`: the policy file loaded again, off the async
    /// threads; a policy that does not load leaves the previous one in
    /// force. Audited with the versions before and after.
    pub(super) async fn reload(&self, rt: &Runtime, who: &access::Caller) -> Response<Vec<u8>> {
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
                time: crate::access_log::timestamp(rt.wall()),
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
}
