//! The validated policy: the types the request path runs on. A value of
//! these types has passed every check, so nothing downstream re-validates.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ipnet::IpNet;

pub use super::schema::{Backend, Scope};
use crate::auth::KeyTable;
use crate::client_ip::ClientIpConfig;
use crate::edge::EdgeSettings;
use crate::limits::algorithm::Params;
pub use crate::limits::{KeyDims, LimitId, Mode, OnStoreError, PlanId};
pub use crate::routes::RouteId;
use crate::routes::Router;

/// Index of an upstream pool in [`Policy::upstreams`].
pub type PoolId = usize;

/// One complete, validated policy file.
#[derive(Debug)]
pub struct Policy {
    pub file: PathBuf,
    pub policy_version: String,
    pub server: ServerSettings,
    pub store: StoreSettings,
    pub client_ip: ClientIpConfig,
    pub ip_rules: IpRules,
    pub auth: AuthSettings,
    pub plans: Vec<Plan>,
    pub limits: Vec<Limit>,
    pub upstreams: Vec<Upstream>,
    pub routes: Router<Route>,
    pub ratelimit_headers: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSettings {
    pub listen: Vec<SocketAddr>,
    pub admin_listen: Option<SocketAddr>,
    pub threads: usize,
    pub admin_token_env: Option<String>,
    pub shutdown_grace: Duration,
    /// `limits`, `timeouts` and `encoded_slash`: the bounds of the edge.
    pub edge: EdgeSettings,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSettings {
    pub backend: Backend,
    pub urls: Vec<String>,
    pub timeout: Duration,
    pub key_prefix: String,
    pub key_secret_env: String,
    pub failure_threshold: u32,
    pub open_for: Duration,
    pub expected_instances: u32,
}

#[derive(Debug, Clone, Default)]
pub struct IpRules {
    pub deny: Vec<IpNet>,
    pub allow: Vec<IpNet>,
}

impl IpRules {
    /// Whether the rules let this address through.
    pub fn admits(&self, ip: std::net::IpAddr) -> bool {
        !self.deny.iter().any(|n| n.contains(&ip))
            && (self.allow.is_empty() || self.allow.iter().any(|n| n.contains(&ip)))
    }
}

#[derive(Debug)]
pub struct AuthSettings {
    /// Lower-case header name; `authorization` means `Bearer <key>`.
    pub header: http::HeaderName,
    pub keys: KeyTable,
    /// Whether the upstream receives the API key (`auth.forward_key`).
    pub forward_key: bool,
}

/// Per-plan replacement parameters for some limits.
#[derive(Debug, Clone)]
pub struct Plan {
    pub name: String,
    pub overrides: Vec<(LimitId, Params)>,
}

impl Plan {
    pub fn params_for(&self, limit: LimitId) -> Option<Params> {
        self.overrides
            .iter()
            .find(|(id, _)| *id == limit)
            .map(|(_, p)| *p)
    }
}

/// A named limit, validated.
#[derive(Debug, Clone)]
pub struct Limit {
    pub name: Arc<str>,
    pub scope: Scope,
    pub key: KeyDims,
    pub params: Params,
    /// Decided in this process rather than in the shared store.
    pub local: bool,
    pub on_store_error: OnStoreError,
    pub mode: Mode,
}

/// An upstream pool.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: Arc<str>,
    pub servers: Vec<SocketAddr>,
    pub max_in_flight: u32,
    pub queue_max_waiting: u32,
    pub queue_timeout: Duration,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    /// Active health checks; without them every server counts as healthy.
    pub health: Option<HealthCheck>,
}

/// How a pool's servers are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub interval: Duration,
    pub timeout: Duration,
    /// `GET` this path and expect a 2xx or 3xx; without it, a TCP connect.
    pub path: Option<String>,
    /// Consecutive results needed to change a server's state.
    pub healthy_after: u32,
    pub unhealthy_after: u32,
}

/// Where a route's admitted requests go.
#[derive(Debug, Clone)]
pub enum Target {
    Upstream(PoolId),
    Respond {
        status: u16,
        body: Bytes,
        content_type: String,
    },
}

/// A route class.
#[derive(Debug, Clone)]
pub struct Route {
    pub id: RouteId,
    pub name: Arc<str>,
    /// `x-route-class` for the upstream, made once (names are validated
    /// header-safe).
    pub class_header: http::HeaderValue,
    pub auth_required: bool,
    pub target: Target,
    pub cost: u64,
    /// `scope: pre_auth` limits, in the order the route names them.
    pub pre_auth: Vec<LimitId>,
    /// The other limits, decided together after authentication.
    pub request: Vec<LimitId>,
    /// The largest request body accepted (→ 413).
    pub max_body_bytes: u64,
    /// Whether `Upgrade` (WebSocket) requests pass; elsewhere it is removed.
    pub upgrade: bool,
}

impl Policy {
    /// The parameters a limit runs with for a caller on `plan`.
    pub fn params(&self, limit: LimitId, plan: Option<PlanId>) -> Params {
        plan.and_then(|p| self.plans[p].params_for(limit))
            .unwrap_or(self.limits[limit].params)
    }

    /// Valid but probably unintended settings, one sentence each: today,
    /// routes whose cost exceeds a limit's local fallback share, which the
    /// limit then refuses for as long as the store is failing.
    pub fn warnings(&self) -> Vec<String> {
        let instances = self.store.expected_instances;
        let mut out = Vec::new();
        for route in self.routes.iter() {
            for &id in route.pre_auth.iter().chain(&route.request) {
                let limit = &self.limits[id];
                if limit.local || limit.on_store_error != OnStoreError::Local {
                    continue;
                }
                let plans = self.plans.iter().filter_map(|p| p.params_for(id));
                let share = std::iter::once(limit.params)
                    .chain(plans)
                    .map(|p| p.share(instances).quota())
                    .min()
                    .unwrap_or(u64::MAX);
                if route.cost > share {
                    out.push(format!(
                        "route {:?}: cost {} exceeds the local fallback share ({share}) of limit {:?} \
                         (1/{instances} of its budget): while the store is failing these requests get 429",
                        route.name, route.cost, limit.name
                    ));
                }
            }
        }
        out
    }

    /// One line describing the policy, for `tollgate check` and start-up logs.
    pub fn summary(&self) -> String {
        format!(
            "policy {} ok: {} routes, {} limits, {} plans, {} keys, {} upstreams, store {}",
            self.policy_version,
            self.routes.len(),
            self.limits.len(),
            self.plans.len(),
            self.auth.keys.len(),
            self.upstreams.len(),
            self.store.backend,
        )
    }
}
