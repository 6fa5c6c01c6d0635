//! The process's own state: liveness (`/healthz`), readiness (`/readyz`),
//! the metrics (`/metrics`) and the heavy hitters (`GET /admin/top`).

use http::Response;

use crate::config::{Mode, OnStoreError};
use crate::runtime::Runtime;

use super::{respond, text, Admin};

/// Rows in `/admin/top`.
const TOP_ROWS: usize = 20;

/// `/healthz`: the process is alive.
pub(super) fn healthz() -> Response<Vec<u8>> {
    text(200, "ok\n".into())
}

impl Admin {
    /// `/readyz`: a policy is loaded and the store answers, or no limit
    /// needs it; never while the process drains.
    pub(super) async fn readyz(&self) -> Response<Vec<u8>> {
        let rt = self.live.load();
        if self.drain.draining() {
            text(503, "not ready: shutting down\n".into())
        } else if every_limit_has_a_fallback(&rt) || rt.limiter().store_ready().await {
            // Nothing about the policy: the probe needs no token (its
            // version is in `tollgate_config_info`, beside the metrics).
            text(200, "ready\n".into())
        } else {
            text(503, "not ready: the limit store is unreachable\n".into())
        }
    }

    /// `/metrics`: every series, in Prometheus's text format.
    pub(super) fn metrics(&self) -> Response<Vec<u8>> {
        let rt = self.live.load();
        let metrics = rt.all_metrics();
        // Read where it is kept, at each scrape.
        metrics
            .store_pending
            .set(rt.limiter().store_pending() as i64);
        metrics
            .revocations_active
            .set(rt.services.revocations.active(rt.wall_ms()).len() as i64);
        metrics
            .overrides_active
            .set(rt.services.overrides.active(rt.wall_ms()).len() as i64);
        respond(200, "text/plain; version=0.0.4", metrics.render())
    }

    /// `GET /admin/top`: the heaviest callers, their identities shown only
    /// to a caller a token identified (`reveal`).
    pub(super) fn top(&self, reveal: bool) -> Response<Vec<u8>> {
        // The runtime live now, loaded afresh.
        let rt = self.live.load();
        let rows = rt
            .services
            .top
            .report(TOP_ROWS, reveal, &rt.services.redactor);
        let body = serde_json::json!({ "top": rows }).to_string();
        respond(200, "application/json", body.into_bytes())
    }
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
        .all(|l| {
            l.sync.is_local() || l.mode == Mode::Shadow || l.on_store_error != OnStoreError::Closed
        })
}
