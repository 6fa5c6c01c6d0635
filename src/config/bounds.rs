//! The numeric bounds of the policy, written once: `check` enforces them
//! (`Checker::bounded` in the validator) and `tollgate schema` states
//! them (`minimum`, `maximum` and `default` of the key), so an editor
//! flags what the loader would refuse.

use schemars::Schema;

use crate::edge::defaults as edge;

/// A numeric key's range, and its default when the loader has a fixed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// The least value accepted.
    pub min: u64,
    /// The greatest value accepted.
    pub max: u64,
    /// The value when the key is absent; `None` when it is computed (the
    /// CPUs available) or follows another key.
    pub default: Option<u64>,
}

impl Bound {
    const fn new(min: u64, max: u64, default: u64) -> Self {
        Self {
            min,
            max,
            default: Some(default),
        }
    }

    const fn computed(min: u64, max: u64) -> Self {
        Self {
            min,
            max,
            default: None,
        }
    }
}

impl Bound {
    /// States the bound in a key's schema: `minimum`, `maximum` and
    /// `default` (`#[schemars(transform = bounds::X.schema())]`).
    pub fn schema(self) -> impl FnMut(&mut Schema) {
        move |schema| {
            schema.insert("minimum".into(), self.min.into());
            schema.insert("maximum".into(), self.max.into());
            if let Some(default) = self.default {
                schema.insert("default".into(), default.into());
            }
        }
    }
}

/// An hour, the longest of the timeouts.
const HOUR_MS: u64 = 3_600_000;

/// `server.threads`: the CPUs available when absent.
pub const THREADS: Bound = Bound::computed(1, 256);
/// `server.shutdown_grace_seconds`.
pub const SHUTDOWN_GRACE_SECONDS: Bound = Bound::new(0, 3_600, 10);
/// `server.admin_max_connections`.
pub const ADMIN_MAX_CONNECTIONS: Bound = Bound::new(1, 100_000, 256);
/// `server.admin_max_connections_per_ip`.
pub const ADMIN_MAX_CONNECTIONS_PER_IP: Bound = Bound::new(1, 100_000, 8);
/// `server.http2_max_streams`.
pub const HTTP2_MAX_STREAMS: Bound = Bound::new(1, 10_000, 100);
/// `server.log_client_errors_per_s`.
pub const LOG_CLIENT_ERRORS_PER_S: Bound = Bound::new(0, 10_000, 1);
/// `server.admin_refresh_ms`.
pub const ADMIN_REFRESH_MS: Bound = Bound::new(100, 60_000, 1_000);
/// `server.limits.max_connections`.
pub const MAX_CONNECTIONS: Bound = Bound::new(1, 1_000_000, edge::MAX_CONNECTIONS);
/// `server.limits.max_connections_per_ip`.
pub const MAX_CONNECTIONS_PER_IP: Bound = Bound::new(1, 1_000_000, 1_000);
/// `server.limits.max_header_bytes`.
pub const MAX_HEADER_BYTES: Bound = Bound::new(1_024, 1_048_576, edge::MAX_HEADER_BYTES);
/// `server.limits.max_body_bytes`.
pub const MAX_BODY_BYTES: Bound = Bound::new(0, 1 << 40, edge::MAX_BODY_BYTES);
/// `routes[].max_body_bytes`: `server.limits.max_body_bytes` when absent.
pub const ROUTE_MAX_BODY_BYTES: Bound = Bound::computed(0, 1 << 40);
/// `server.limits.buffer_body_bytes`.
pub const BUFFER_BODY_BYTES: Bound = Bound::new(0, 65_536, edge::BUFFER_BODY_BYTES);
/// `server.limits.buffered_bytes_total`.
pub const BUFFERED_BYTES_TOTAL: Bound = Bound::new(0, 16 << 30, 256 << 20);
/// `server.timeouts.header_read_ms`.
pub const HEADER_READ_MS: Bound = Bound::new(1, HOUR_MS, edge::HEADER_READ_MS);
/// `server.timeouts.keepalive_idle_ms`.
pub const KEEPALIVE_IDLE_MS: Bound = Bound::new(1, HOUR_MS, edge::KEEPALIVE_IDLE_MS);
/// `server.timeouts.body_read_ms`.
pub const BODY_READ_MS: Bound = Bound::new(1, HOUR_MS, edge::BODY_READ_MS);
/// `server.timeouts.send_ms`.
pub const SEND_MS: Bound = Bound::new(1, HOUR_MS, edge::SEND_MS);
/// `server.timeouts.body_min_rate`.
pub const BODY_MIN_RATE: Bound = Bound::new(1, 1 << 30, edge::BODY_MIN_RATE);
/// `server.limits.send_min_rate`.
pub const SEND_MIN_RATE: Bound = Bound::new(1, 1 << 30, edge::SEND_MIN_RATE);
/// `upstreams.*.response_buffer_bytes`.
pub const RESPONSE_BUFFER_BYTES: Bound = Bound::new(0, 16 << 20, 65_536);
/// `server.timeouts.body_grace_ms`.
pub const BODY_GRACE_MS: Bound = Bound::new(1, HOUR_MS, edge::BODY_GRACE_MS);
/// `server.timeouts.body_total_ms`.
pub const BODY_TOTAL_MS: Bound = Bound::new(1, HOUR_MS, edge::BODY_TOTAL_MS);
/// `usage.spool.max_bytes`: from 64 KiB (eight records' room), 1 GiB by
/// default.
pub const SPOOL_MAX_BYTES: Bound = Bound::new(64 << 10, 1 << 50, 1 << 30);
/// `usage.spool.fsync_ms`.
pub const SPOOL_FSYNC_MS: Bound = Bound::new(1, 10_000, 100);
/// `usage.sinks[].http.batch`.
pub const SINK_BATCH: Bound = Bound::new(1, 10_000, 500);
/// `usage.sinks[].http.timeout_ms`.
pub const SINK_TIMEOUT_MS: Bound = Bound::new(1, 60_000, 2_000);
/// `client_ip.ipv6_prefix`.
pub const IPV6_PREFIX: Bound = Bound::new(1, 128, 64);
/// `store.timeout_ms`.
pub const STORE_TIMEOUT_MS: Bound = Bound::new(1, 10_000, 20);
/// `store.max_pending`.
pub const MAX_PENDING: Bound = Bound::new(1, 1_000_000, 4_096);
/// `store.circuit_breaker.failure_threshold`.
pub const FAILURE_THRESHOLD: Bound = Bound::new(1, 1_000, 5);
/// `store.circuit_breaker.open_ms`.
pub const OPEN_MS: Bound = Bound::new(1, 600_000, 1_000);
/// `store.expected_instances`.
pub const EXPECTED_INSTANCES: Bound = Bound::new(1, 10_000, 1);
/// `limits.*.max_delay_ms`.
pub const MAX_DELAY_MS: Bound = Bound::computed(1, 60_000);
/// `limits.*.lease.ttl_ms`.
pub const LEASE_TTL_MS: Bound = Bound::computed(10, 60_000);
/// `limits.*.max_in_flight` (`algorithm: concurrency`).
pub const LIMIT_MAX_IN_FLIGHT: Bound = Bound::computed(1, 1_000_000);
/// `limits.*.hold_ttl_ms` (`algorithm: concurrency`).
pub const HOLD_TTL_MS: Bound = Bound::new(1_000, HOUR_MS, 30_000);
/// `auth.jwt[].leeway_s`.
pub const JWT_LEEWAY_S: Bound = Bound::new(0, 300, 30);
/// `auth.jwt[].refresh_s`.
pub const JWKS_REFRESH_S: Bound = Bound::new(1, 86_400, 300);
/// `upstreams.*.queue.per_tenant_max`.
pub const QUEUE_PER_TENANT_MAX: Bound = Bound::computed(1, 1_000_000);
/// `auth.store_keys.cache_entries`.
pub const STORE_KEYS_CACHE_ENTRIES: Bound = Bound::new(1, 100_000_000, 100_000);
/// `auth.store_keys.negative_ttl_s`.
pub const STORE_KEYS_NEGATIVE_TTL_S: Bound = Bound::new(0, 3_600, 10);
/// `auth.forward_auth.timeout_ms`.
pub const FORWARD_AUTH_TIMEOUT_MS: Bound = Bound::new(1, 60_000, 200);
/// `auth.forward_auth.cache_ttl_s`.
pub const FORWARD_AUTH_CACHE_TTL_S: Bound = Bound::new(0, 86_400, 60);
/// `auth.forward_auth.negative_ttl_s`.
pub const FORWARD_AUTH_NEGATIVE_TTL_S: Bound = Bound::new(0, 3_600, 10);
/// `auth.forward_auth.max_entries`.
pub const FORWARD_AUTH_MAX_ENTRIES: Bound = Bound::new(1, 100_000_000, 1_000_000);
/// `auth.forward_auth.max_in_flight`.
pub const FORWARD_AUTH_MAX_IN_FLIGHT: Bound = Bound::new(1, 100_000, 64);
/// `routes[].timeout_ms`.
pub const ROUTE_TIMEOUT_MS: Bound = Bound::computed(1, HOUR_MS);
/// `routes[].respond.status`.
pub const RESPOND_STATUS: Bound = Bound::computed(200, 599);
/// `upstreams.*.max_in_flight`.
pub const MAX_IN_FLIGHT: Bound = Bound::new(1, 1_000_000, 256);
/// `upstreams.*.queue.max_waiting`: the pool's `max_in_flight` when absent.
pub const QUEUE_MAX_WAITING: Bound = Bound::computed(0, 1_000_000);
/// `upstreams.*.queue.timeout_ms`.
pub const QUEUE_TIMEOUT_MS: Bound = Bound::new(0, 60_000, 100);
/// `upstreams.*.connect_timeout_ms`.
pub const CONNECT_TIMEOUT_MS: Bound = Bound::new(1, 60_000, 3_500);
/// `upstreams.*.retries`.
pub const RETRIES: Bound = Bound::new(0, 10, 2);
/// `upstreams.*.read_timeout_ms`.
pub const READ_TIMEOUT_MS: Bound = Bound::new(1, HOUR_MS, 30_000);
/// `upstreams.*.health_check.interval_ms`.
pub const HEALTH_INTERVAL_MS: Bound = Bound::new(10, HOUR_MS, 2_000);
/// `upstreams.*.health_check.timeout_ms`.
pub const HEALTH_TIMEOUT_MS: Bound = Bound::new(1, 60_000, 1_000);
/// `upstreams.*.health_check.healthy_after`.
pub const HEALTHY_AFTER: Bound = Bound::new(1, 100, 1);
/// `upstreams.*.health_check.unhealthy_after`.
pub const UNHEALTHY_AFTER: Bound = Bound::new(1, 100, 2);

/// The largest capacity, rate, limit or cost: a billion.
pub const MAX_AMOUNT: f64 = 1e9;

/// States in a key's schema what `check` requires of an amount (a
/// capacity, rate, limit or cost): positive, at most [`MAX_AMOUNT`].
pub fn amount(schema: &mut Schema) {
    schema.insert("exclusiveMinimum".into(), 0.into());
    schema.insert("maximum".into(), MAX_AMOUNT.into());
}
