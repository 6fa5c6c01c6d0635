//! The validated policy: the types the request path runs on. A value of
//! these types has passed every check, so nothing downstream re-validates.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ipnet::IpNet;

pub use super::schema::{
    AdminRole, Backend, OnAbandon, Oversize, Priority, Reserve, Scope, UpstreamProtocol,
};
use crate::access_log::AccessLogSettings;
use crate::client_ip::ClientIpConfig;
use crate::edge::EdgeSettings;
use crate::identity::auth::KeyTable;
use crate::key_values::{BodyValues, FieldPath};
use crate::limits::algorithm::Params;
pub use crate::limits::plan::DebtBound;
pub use crate::limits::{KeyDims, LimitId, Mode, OnStoreError, PlanId};
pub use crate::routes::RouteId;
use crate::routes::Router;
use crate::tls::TlsSettings;

pub use crate::ids::PoolId;

/// One complete, validated policy file.
#[derive(Debug)]
pub struct Policy {
    /// The policy file it was loaded from, for messages and reloads.
    pub file: PathBuf,
    /// The operator's label (`policy_version`), `"unversioned"` when absent.
    pub policy_version: String,
    /// Listeners, threads, shutdown and edge bounds.
    pub server: ServerSettings,
    /// The backend of shared limits and how to call it.
    pub store: StoreSettings,
    /// What validation found valid but probably unintended, said again
    /// with [`Policy::warnings`].
    pub notes: Vec<String>,
    /// How the client IP is resolved behind trusted proxies.
    pub client_ip: ClientIpConfig,
    /// Networks denied or allowed before routing.
    pub ip_rules: IpRules,
    /// The key header and the credentials.
    pub auth: AuthSettings,
    /// Plans, indexed by [`PlanId`].
    pub plans: Vec<Plan>,
    /// Limits, indexed by [`LimitId`].
    pub limits: Vec<Limit>,
    /// Upstream pools, indexed by [`PoolId`].
    pub upstreams: Vec<Upstream>,
    /// Routes in file order, with their path matcher.
    pub routes: Router<Route>,
    /// Whether responses carry `RateLimit-Policy` and `RateLimit` (`draft`).
    pub ratelimit_headers: bool,
    /// The ledger of admitted requests (`usage`), if kept.
    pub usage: Option<UsageSettings>,
}

/// The validated `server` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSettings {
    /// Client listeners; at least one.
    pub listen: Vec<SocketAddr>,
    /// The admin listener, if any.
    pub admin_listen: Option<SocketAddr>,
    /// Open connections of the admin listener, at most.
    pub admin_max_connections: usize,
    /// Open connections of the admin listener from one client address, at
    /// most.
    pub admin_max_connections_per_ip: usize,
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` of HTTP/2 connections (read at
    /// start).
    pub http2_max_streams: u32,
    /// Client-caused log lines a second, per kind.
    pub log_client_errors_per_s: u32,
    /// Bytes of request bodies read whole at once, over every request.
    pub buffered_bytes_total: u64,
    /// Worker threads.
    pub threads: usize,
    /// Environment variable whose value, when set, guards `/admin/*` (a
    /// `write` token named `env`).
    pub admin_token_env: Option<String>,
    /// The admin API's tokens.
    pub admin_tokens: Vec<AdminToken>,
    /// The audit log's file; the process log when `None`.
    pub audit_log: Option<PathBuf>,
    /// How often the shared store's admin records are read again.
    pub admin_refresh: Duration,
    /// How long requests in flight may run after SIGTERM.
    pub shutdown_grace: Duration,
    /// Whether the policy's files are watched and reloaded on change.
    pub watch: bool,
    /// `limits`, `timeouts` and `encoded_slash`: the bounds of the edge.
    pub edge: EdgeSettings,
    /// Where access log lines go, if anywhere.
    pub access_log: Option<AccessLogSettings>,
    /// TLS listeners and their certificate, if any.
    pub tls: Option<TlsSettings>,
    /// Where request spans are exported, if anywhere (`server.tracing`).
    pub tracing: Option<crate::trace::Exporting>,
}

/// The validated `store` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSettings {
    /// Where shared limits are decided.
    pub backend: Backend,
    /// Redis URLs: one server, the seed nodes of a cluster, or sentinels.
    pub urls: Vec<String>,
    /// The primary's name at the sentinels (`redis_sentinel`).
    pub master_name: Option<String>,
    /// Bound on every store call, and on every decision's wait for one.
    pub timeout: Duration,
    /// Decisions waiting for the store at most (`store.max_pending`).
    pub max_pending: usize,
    /// Prepended to every Redis key.
    pub key_prefix: String,
    /// Environment variable holding the HMAC secret for store keys.
    pub key_secret_env: String,
    /// Failed store calls in a row that open the circuit breaker.
    pub failure_threshold: u32,
    /// How long the breaker stays open before a trial call.
    pub open_for: Duration,
    /// Instances sharing the store; the local fallback enforces 1/this of a budget.
    pub expected_instances: u32,
}

/// The validated `usage` section: the ledger of admitted requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageSettings {
    /// Whether each route (by [`RouteId`]) records its admitted requests.
    pub records: Vec<bool>,
    /// The local spool.
    pub spool: SpoolSettings,
    /// Where records are shipped.
    pub sinks: Vec<SinkSettings>,
}

impl UsageSettings {
    /// Whether route `id` records its admitted requests.
    pub fn records(&self, id: RouteId) -> bool {
        self.records.get(id.index()).copied().unwrap_or(false)
    }
}

/// `usage.spool`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolSettings {
    /// The spool's directory.
    pub path: PathBuf,
    /// The most bytes it holds.
    pub max_bytes: u64,
    /// The longest a written record waits for fsync.
    pub fsync: Duration,
    /// What a full spool does.
    pub on_full: super::schema::OnFull,
}

/// One of `usage.sinks`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkSettings {
    /// A Redis stream.
    RedisStream {
        /// The stream's key.
        key: String,
        /// The Redis: one server, or a cluster's seed nodes.
        urls: Vec<String>,
        /// Whether `urls` are a cluster's.
        cluster: bool,
    },
    /// An HTTP endpoint receiving CloudEvents batches.
    Http {
        /// Where batches are POSTed.
        url: String,
        /// Records per request.
        batch: usize,
        /// The longest a request waits.
        timeout: Duration,
        /// The environment variable holding a bearer token.
        token_env: Option<String>,
    },
}

impl SinkSettings {
    /// The sink's kind, its `sink` label in metrics: `redis_stream` or
    /// `http` (a policy has at most one of each).
    pub fn kind(&self) -> &'static str {
        match self {
            SinkSettings::RedisStream { .. } => "redis_stream",
            SinkSettings::Http { .. } => "http",
        }
    }
}

/// The validated `ip_rules` section, applied to the resolved client IP.
#[derive(Debug, Clone, Default)]
pub struct IpRules {
    /// Networks refused with a 403.
    pub deny: Vec<IpNet>,
    /// When non-empty, the only networks let through.
    pub allow: Vec<IpNet>,
}

impl IpRules {
    /// Whether the rules let this address through.
    pub fn admits(&self, ip: std::net::IpAddr) -> bool {
        !self.deny.iter().any(|n| n.contains(&ip))
            && (self.allow.is_empty() || self.allow.iter().any(|n| n.contains(&ip)))
    }
}

/// The validated `auth` section.
#[derive(Debug)]
pub struct AuthSettings {
    /// Lower-case header name; `authorization` means `Bearer <key>`.
    pub header: http::HeaderName,
    /// Every credential, from `keys` and the keys file.
    pub keys: KeyTable,
    /// Whether the upstream receives the API key (`auth.forward_key`).
    pub forward_key: bool,
    /// The issuers of JWT callers (`auth.jwt`).
    pub jwt: crate::identity::jwt::Issuers,
    /// How credentials provisioned at runtime are cached
    /// (`auth.store_keys`); none when they are not used.
    pub store_keys: Option<crate::identity::store_keys::Settings>,
    /// The service asked about keys no other source knows
    /// (`auth.forward_auth`).
    pub forward: Option<Arc<crate::identity::forward_auth::ForwardAuth>>,
}

/// Per-plan replacement parameters for some limits.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The plan name.
    pub name: String,
    /// The limits this plan changes, with their replacement parameters.
    pub overrides: Vec<(LimitId, Params)>,
}

impl Plan {
    /// The plan's parameters for `limit`, if it overrides that limit.
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
    /// The limit name, used in metrics and `RateLimit` headers.
    pub name: Arc<str>,
    /// Whether it runs before or after authentication.
    pub scope: Scope,
    /// What its budgets are counted per.
    pub key: KeyDims,
    /// The algorithm and its numbers, before any plan override.
    pub params: Params,
    /// Where it is decided: in this process, in the shared store, or
    /// against a lease of the shared budget.
    pub sync: crate::limits::SyncMode,
    /// What it does while the store fails.
    pub on_store_error: OnStoreError,
    /// Enforced, or only decided and counted (shadow).
    pub mode: Mode,
    /// What a request whose cost does not fit gets: 429, or a wait.
    pub on_limit: crate::limits::OnLimit,
    /// The part of its key read from the request (`header.*`, `path.*`, …).
    pub values: crate::key_values::ValueKey,
}

impl Limit {
    /// Its own numbers and those of each `values` entry, the entries by
    /// value: every budget a request of some value is decided against
    /// (plans aside).
    pub fn budgets(&self) -> Vec<(Option<&str>, Params)> {
        let mut entries: Vec<(Option<&str>, Params)> = (self.values.values.iter())
            .flat_map(|values| values.iter().map(|(v, p)| (Some(&**v), *p)))
            .collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        std::iter::once((None, self.params))
            .chain(entries)
            .collect()
    }
}

/// The order a pool's waiters of one priority are served in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum QueueOrder {
    /// In arrival order (the default).
    #[default]
    Arrival,
    /// In turn between tenants (`queue.fair: tenant`), a request without
    /// a credential taking its turns as its client's network.
    FairByTenant,
}

/// An upstream pool.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// The pool name, used in metrics.
    pub name: Arc<str>,
    /// The resolved server addresses.
    pub servers: Vec<SocketAddr>,
    /// Requests forwarded to the pool at once.
    pub max_in_flight: u32,
    /// Requests that may wait for a permit.
    pub queue_max_waiting: u32,
    /// Longest wait for a permit before a 503.
    pub queue_timeout: Duration,
    /// Bound on connecting to a server.
    pub connect_timeout: Duration,
    /// Bound on reading from a server.
    pub read_timeout: Duration,
    /// Answers of a declared length up to this are read whole before
    /// they go on, so the permit ends with the upstream's work.
    pub response_buffer_bytes: u64,
    /// Further tries after a connect failure or a failed reused connection.
    pub retries: u32,
    /// The servers as configured (`host:port`), in the order of `servers`.
    pub server_names: Vec<String>,
    /// The `Host` the upstream receives.
    pub host_header: HostHeader,
    /// HTTPS to the servers, when set.
    pub tls: Option<UpstreamTls>,
    /// The HTTP version spoken to the servers.
    pub protocol: UpstreamProtocol,
    /// Active health checks; without them every server counts as healthy.
    pub health: Option<HealthCheck>,
    /// Permits only critical routes may take.
    pub reserved_critical: u32,
    /// The order waiters of one priority are served in.
    pub queue_order: QueueOrder,
    /// The most waiters one tenant may have in the queue
    /// (`queue.per_tenant_max`).
    pub queue_per_tenant_max: Option<u32>,
}

/// How a pool's servers are reached over TLS.
#[derive(Debug, Clone)]
pub struct UpstreamTls {
    /// The name sent in SNI and verified.
    pub sni: String,
    /// CA certificates to verify with; the system's roots when `None`.
    pub ca: Option<Arc<[pingora::utils::tls::WrappedX509]>>,
    /// Whether certificates and names are verified.
    pub verify: bool,
}

/// What the upstream receives as `Host`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostHeader {
    /// The client's, as received.
    Preserve,
    /// The chosen server's `host:port`, as configured.
    Upstream,
    /// This value.
    Literal(http::HeaderValue),
}

/// How a pool's servers are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    /// Time between probes of the pool's servers.
    pub interval: Duration,
    /// Bound on one probe.
    pub timeout: Duration,
    /// `GET` this path and expect a 2xx or 3xx; without it, a TCP connect.
    pub path: Option<String>,
    /// Consecutive results needed to change a server's state.
    pub healthy_after: u32,
    /// Consecutive failed probes that take a server out of the rotation.
    pub unhealthy_after: u32,
}

/// Where a route's admitted requests go.
#[derive(Debug, Clone)]
pub enum Target {
    /// Forward to this upstream pool.
    Upstream(PoolId),
    /// Answer from the gateway itself.
    Respond {
        /// The status code, 200-599.
        status: u16,
        /// The response body.
        body: Bytes,
        /// The `Content-Type` header value.
        content_type: String,
    },
}

/// A route class.
#[derive(Debug, Clone)]
pub struct Route {
    /// Index of the route in the policy, in file order.
    pub id: RouteId,
    /// The route class, used in metrics and logs.
    pub name: Arc<str>,
    /// `x-route-class` for the upstream, made once (names are validated
    /// header-safe).
    pub class_header: http::HeaderValue,
    /// Whether the request needs a valid API key.
    pub auth_required: bool,
    /// Where admitted requests go.
    pub target: Target,
    /// What one request charges each of its limits.
    pub cost: u64,
    /// `scope: pre_auth` limits, in the order the route names them.
    pub pre_auth: Vec<LimitId>,
    /// The other limits, decided together after authentication.
    pub request: Vec<LimitId>,
    /// The largest request body accepted (→ 413).
    pub max_body_bytes: u64,
    /// The protocols an `Upgrade` request may name (`websocket` for
    /// `upgrade: true`); otherwise the header is removed. Empty: none.
    pub upgrade: Arc<[Box<str>]>,
    /// The longest wait for the upstream's response; `None`: the pool's.
    pub timeout: Option<Duration>,
    /// Its place when the pool is full.
    pub priority: Priority,
    /// The actual cost, reported by the upstream after the response.
    pub cost_from_response: Option<CostFromResponse>,
    /// Where a request names its own estimate (`cost_from_request`).
    pub cost_from_request: Option<CostFromRequest>,
    /// What it reads from the request's JSON body, if anything.
    pub body: Option<BodyRead>,
}

/// `routes[].cost_from_request`, validated: a request's estimate, clamped
/// to `[1, max]`, `default` when it names none.
#[derive(Debug, Clone)]
pub struct CostFromRequest {
    /// Where the request names it.
    pub source: RequestCost,
    /// The largest estimate.
    pub max: u64,
    /// The estimate of a request that names none.
    pub default: u64,
}

/// Where a request names its estimate.
#[derive(Debug, Clone)]
pub enum RequestCost {
    /// A request header.
    Header(http::HeaderName),
    /// A member of the JSON body, by dotted path.
    Json(FieldPath),
}

impl CostFromRequest {
    /// The estimate a request names in its `headers` or its JSON `body`:
    /// a whole number, clamped to `[1, max]` (a number too large to hold
    /// is `max`, as is any estimate of a body too large to read);
    /// `default` when it names none, names it twice or names no whole
    /// number.
    pub fn estimate(&self, headers: &http::HeaderMap, body: Option<&BodyValues>) -> u64 {
        // A body too large to read (`oversize: absent`) could have named
        // anything: the most, whichever source names the estimate.
        if body.is_some_and(|b| b.oversize) {
            return self.max;
        }
        let named = match &self.source {
            RequestCost::Header(name) => {
                let mut lines = headers.get_all(name).iter();
                let (Some(value), None) = (lines.next(), lines.next()) else {
                    return self.default;
                };
                decimal(value.as_bytes())
            }
            RequestCost::Json(path) => match body {
                Some(b) => match b.get(path) {
                    Ok(Some(v)) => decimal(v.as_bytes()),
                    _ => None,
                },
                None => None,
            },
        };
        match named {
            Some(n) => n.map_or(self.max, |n| n.clamp(1, self.max)),
            None => self.default,
        }
    }
}

/// What a route reads from a request's JSON body before its request
/// limits are decided.
#[derive(Debug, Clone)]
pub struct BodyRead {
    /// The members read: its request limits' `body.*` keys and the
    /// estimate's `cost_from_request.json`.
    pub fields: Vec<FieldPath>,
    /// What a body too large to read whole does.
    pub oversize: Oversize,
    /// Whether a streamed (chat) completions request is sent asking for
    /// its usage (`cost_from_response.include_usage`).
    pub include_usage: bool,
}

/// A whole number written in decimal digits, with spaces around it:
/// `Some(None)` for one too large for 64 bits, `None` for empty text or
/// anything else (a sign, a fraction, letters). The costs a request or a
/// response names are read this way.
pub fn decimal(text: &[u8]) -> Option<Option<u64>> {
    let digits = text.trim_ascii();
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    }))
}

impl Route {
    /// What admission charges: the route's cost, or `max` when the cost
    /// comes from the response and `reserve: max`.
    pub fn admission_cost(&self) -> u64 {
        self.admission_cost_of(self.cost)
    }

    /// What admission charges a request whose estimate is `estimate`.
    pub fn admission_cost_of(&self, estimate: u64) -> u64 {
        self.cost_from_response
            .as_ref()
            .map_or(estimate, |f| f.admission_cost(estimate))
    }

    /// The estimate of a request with these headers and body values:
    /// its own (`cost_from_request`), or the route's cost.
    pub fn estimate(&self, headers: &http::HeaderMap, body: Option<&BodyValues>) -> u64 {
        self.cost_from_request
            .as_ref()
            .map_or(self.cost, |c| c.estimate(headers, body))
    }
}

/// `routes[].cost_from_response`, validated.
#[derive(Debug, Clone)]
pub struct CostFromResponse {
    /// Where the actual cost is read.
    pub source: CostSource,
    /// Whether a streamed chat/completions request is sent asking for its
    /// usage (`include_usage`, with `format: openai`).
    pub include_usage: bool,
    /// The most a response is charged.
    pub max: u64,
    /// Whether the client sees the header.
    pub expose: bool,
    /// What a response abandoned by its client is settled at.
    pub on_abandon: OnAbandon,
    /// What admission charges.
    pub reserve: Reserve,
    /// How deep into debt a settlement may push each limit.
    pub max_debt: DebtBound,
}

/// Where a response reports its actual cost.
#[derive(Debug, Clone, PartialEq)]
pub enum CostSource {
    /// A header, or a trailer, holding a whole number.
    Header(http::HeaderName),
    /// The body, read as it streams past: JSON paths, or an API's usage.
    Body(crate::limits::meter::Reader),
}

impl CostSource {
    /// The header that reports the cost, for a header source.
    pub fn header(&self) -> Option<&http::HeaderName> {
        match self {
            CostSource::Header(h) => Some(h),
            CostSource::Body(_) => None,
        }
    }
}

impl CostFromResponse {
    /// What admission charges on a route of cost `estimate`.
    pub fn admission_cost(&self, estimate: u64) -> u64 {
        match self.reserve {
            Reserve::Estimate => estimate,
            Reserve::Max => self.max,
        }
    }
}

impl Policy {
    /// The limit named `name`, with its id.
    pub fn limit_named(&self, name: &str) -> Option<(LimitId, &Limit)> {
        self.limits().find(|(_, l)| *l.name == *name)
    }

    /// Every limit, with its id.
    pub fn limits(&self) -> impl Iterator<Item = (LimitId, &Limit)> {
        self.limits
            .iter()
            .enumerate()
            .map(|(i, l)| (LimitId::new(i), l))
    }

    /// The plan named `name`, if the policy has one.
    pub fn plan_id(&self, name: &str) -> Option<PlanId> {
        self.plans
            .iter()
            .position(|p| p.name == name)
            .map(PlanId::new)
    }

    /// The parameters a limit runs with for a caller on `plan`.
    pub fn params(&self, limit: LimitId, plan: Option<PlanId>) -> Params {
        plan.and_then(|p| self.plans[p].params_for(limit))
            .unwrap_or(self.limits[limit].params)
    }

    /// Valid but probably unintended settings, one sentence each: an admin
    /// listener beyond loopback that no token guards, and routes whose cost
    /// exceeds a limit's local fallback share, which the limit then refuses
    /// for as long as the store is failing.
    pub fn warnings(&self) -> Vec<String> {
        let instances = self.store.expected_instances;
        let mut out = Vec::new();
        let server = &self.server;
        let open_admin = server
            .admin_listen
            .filter(|a| !a.ip().to_canonical().is_loopback());
        if let (Some(addr), true, None) = (
            open_admin,
            server.admin_tokens.is_empty(),
            &server.admin_token_env,
        ) {
            out.push(format!(
                "server.admin_listen {addr} is not a loopback address and no admin token is \
                 configured (server.admin_tokens or server.admin_token_env): anyone who can \
                 reach it reads the admin API (/admin/top, /admin/explain, /admin/overrides…)"
            ));
        }
        out.extend(self.notes.iter().cloned());
        for route in self.routes.iter() {
            for &id in route.pre_auth.iter().chain(&route.request) {
                let limit = &self.limits[id];
                if limit.params.is_concurrency() {
                    continue;
                }
                for (value, params) in limit.budgets() {
                    let capacity = params.quota();
                    let of = match value {
                        Some(v) => format!("limit {:?} (values {v:?})", limit.name),
                        None => format!("limit {:?}", limit.name),
                    };
                    if let Some(spec) = &route.cost_from_response {
                        if spec.max - route.cost > capacity {
                            out.push(format!(
                                "route {:?}: cost_from_response.max - cost ({}) exceeds the \
                                 capacity ({capacity}) of {of}: one response may cost more than \
                                 a full budget, and callers go into debt",
                                route.name,
                                spec.max - route.cost,
                            ));
                        }
                    }
                    if let Some(named) = &route.cost_from_request {
                        if named.max > capacity {
                            out.push(format!(
                                "route {:?}: cost_from_request.max ({}) exceeds the capacity \
                                 ({capacity}) of {of}: a request naming that much is refused \
                                 even by a full budget",
                                route.name, named.max,
                            ));
                        }
                    }
                }
                if limit.sync.is_local() || limit.on_store_error != OnStoreError::Local {
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

/// One admin token (`server.admin_tokens`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminToken {
    /// Who holds it.
    pub name: Arc<str>,
    /// The SHA-256 of the token.
    pub digest: [u8; 32],
    /// What it may do.
    pub role: AdminRole,
}

/// A policy's lists are indexed by their own ids only.
macro_rules! indexed_by {
    ($item:ty, $id:ty) => {
        impl std::ops::Index<$id> for [$item] {
            type Output = $item;

            fn index(&self, id: $id) -> &$item {
                &self[id.index()]
            }
        }

        impl std::ops::Index<$id> for Vec<$item> {
            type Output = $item;

            fn index(&self, id: $id) -> &$item {
                &self[id.index()]
            }
        }
    };
}

indexed_by!(Limit, LimitId);
indexed_by!(Plan, PlanId);
indexed_by!(Upstream, PoolId);
indexed_by!(Route, RouteId);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_names_its_estimate_clamped_and_an_unread_body_is_the_most() {
        let from_header = CostFromRequest {
            source: RequestCost::Header(http::HeaderName::from_static("x-tokens")),
            max: 1000,
            default: 50,
        };
        let headers = |value: &str| {
            let mut h = http::HeaderMap::new();
            h.insert("x-tokens", value.parse().unwrap());
            h
        };
        assert_eq!(from_header.estimate(&headers("300"), None), 300);
        assert_eq!(from_header.estimate(&headers("0"), None), 1);
        assert_eq!(from_header.estimate(&headers("5000"), None), 1000);
        assert_eq!(
            from_header.estimate(&headers("99999999999999999999999"), None),
            1000
        );
        assert_eq!(from_header.estimate(&headers("-3"), None), 50);
        assert_eq!(from_header.estimate(&http::HeaderMap::new(), None), 50);
        // A body too large to read could have said anything: the most,
        // though the estimate is named by a header.
        let unread = BodyValues::oversize();
        assert_eq!(from_header.estimate(&headers("300"), Some(&unread)), 1000);
    }
}
