//! The YAML schema as written by operators: plain serde structs that reject
//! unknown keys. Nothing here is trusted; `validate` turns it into a policy.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use schemars::JsonSchema;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::bounds;
use crate::edge::target::{Case, PathParams, TrailingDots, TrailingSlash};

pub use crate::limits::{Mode, OnStoreError};

/// A YAML mapping whose keys must be unique: a repeated name is an error,
/// not a silent overwrite of the first entry.
#[derive(Debug)]
pub struct UniqueMap<V>(pub BTreeMap<String, V>);

impl<V> Default for UniqueMap<V> {
    fn default() -> Self {
        Self(BTreeMap::new())
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for UniqueMap<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Unique<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Unique<V> {
            type Value = UniqueMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping of names")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = BTreeMap::new();
                while let Some(key) = map.next_key::<String>()? {
                    if out.contains_key(&key) {
                        return Err(serde::de::Error::custom(format!("duplicate name {key:?}")));
                    }
                    let value = map.next_value()?;
                    out.insert(key, value);
                }
                Ok(UniqueMap(out))
            }
        }
        deserializer.deserialize_map(Unique(PhantomData))
    }
}

/// In the schema, a mapping of names to `V` (a repeated name is refused by
/// the loader: YAML editors flag duplicate keys themselves).
impl<V: JsonSchema> JsonSchema for UniqueMap<V> {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        format!("Map_of_{}", V::schema_name()).into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        <BTreeMap<String, V>>::json_schema(generator)
    }
}

/// What the schema cannot say, in its description: `check` stays the
/// authority for it.
const SCHEMA_LIMITS: &str = "The shape of a tollgate policy: keys, types, \
enums, defaults and numeric bounds. Rules that span keys are not in this \
schema and `tollgate check` enforces them: names referred to (limits, plans, \
upstreams, routes, keys files) must exist and be unique, a route's cost must \
fit every limit it charges, algorithms take their own parameters, leases and \
delays combine only with some algorithms, and addresses, networks, digests \
and templates must parse. Run `tollgate check --config FILE` before a reload.";

/// The JSON Schema (draft 2020-12) of a policy file, from the structs the
/// loader deserializes: `tollgate schema`.
pub fn policy_schema() -> schemars::Schema {
    let mut schema = schemars::schema_for!(RawConfig);
    schema.insert("title".into(), "tollgate policy".into());
    schema.insert("description".into(), SCHEMA_LIMITS.into());
    schema
}

/// The JSON Schema of a keys file (`auth.keys_file`): `tollgate schema
/// --keys-file`.
pub fn keys_file_schema() -> schemars::Schema {
    let mut schema = schemars::schema_for!(RawKeysFile);
    schema.insert("title".into(), "tollgate keys file".into());
    schema
}

/// A whole policy file, as parsed.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Schema version of the file; must be `1`.
    #[schemars(extend("const" = 1))]
    pub version: u32,
    /// Free label shown by `check`, in logs, by `/readyz` and in `tollgate_config_info`;
    /// `"unversioned"` when absent.
    #[serde(default)]
    pub policy_version: Option<String>,
    /// Listeners, threads, shutdown and edge bounds (`server`).
    #[serde(default)]
    pub server: RawServer,
    /// Where shared limits keep their state (`store`).
    #[serde(default)]
    pub store: RawStore,
    /// How the client IP is read behind trusted proxies (`client_ip`).
    #[serde(default)]
    pub client_ip: RawClientIp,
    /// Networks denied or allowed before routing (`ip_rules`).
    #[serde(default)]
    pub ip_rules: RawIpRules,
    /// The API key header and the credentials (`auth`).
    #[serde(default)]
    pub auth: RawAuth,
    /// Per-plan overrides: plan name → limit name → replacement numbers.
    #[serde(default)]
    pub plans: UniqueMap<UniqueMap<RawOverride>>,
    /// Named limits that routes refer to.
    #[serde(default)]
    pub limits: UniqueMap<RawLimit>,
    /// Named upstream pools that routes forward to.
    #[serde(default)]
    pub upstreams: UniqueMap<RawUpstream>,
    /// Routes, matched in file order; at least one.
    pub routes: Vec<RawRoute>,
    /// Optional response headers (`responses`).
    #[serde(default)]
    pub responses: RawResponses,
    /// A ledger of admitted requests for billing (`usage`): a local spool
    /// shipped to a Redis stream and/or an HTTP endpoint.
    pub usage: Option<RawUsage>,
}

/// The `usage` section: which routes record, the spool, the sinks.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawUsage {
    /// `all` (the default) or a list of route names.
    #[serde(default)]
    pub routes: RawUsageRoutes,
    /// The local spool every record is written to before it is shipped.
    pub spool: RawSpool,
    /// Where records are shipped; at least one.
    pub sinks: Vec<RawSink>,
}

/// `usage.routes`: `all`, or route names.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum RawUsageRoutes {
    /// `all`.
    All(String),
    /// These routes.
    Named(Vec<String>),
}

impl Default for RawUsageRoutes {
    fn default() -> Self {
        RawUsageRoutes::All("all".into())
    }
}

/// `usage.spool`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawSpool {
    /// A directory of this instance's own (created mode 0700).
    pub path: String,
    /// The most bytes the spool holds; default 1 GiB.
    #[schemars(transform = bounds::SPOOL_MAX_BYTES.schema())]
    pub max_bytes: Option<u64>,
    /// The longest a written record waits for fsync, in ms; default 100.
    #[schemars(transform = bounds::SPOOL_FSYNC_MS.schema())]
    pub fsync_ms: Option<u64>,
    /// When full: `refuse` (503 `usage-unavailable` to recording routes,
    /// the default) or `drop` (the oldest records, counted).
    #[serde(default)]
    pub on_full: OnFull,
}

/// `usage.spool.on_full`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnFull {
    /// Refuse recording routes' requests (503 `usage-unavailable`).
    #[default]
    Refuse,
    /// Drop the oldest records, counted in `tollgate_usage_dropped_total`.
    Drop,
}

/// One entry of `usage.sinks`: exactly one of `redis_stream` and `http`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawSink {
    /// A Redis stream, each record one entry with one field, `record`.
    pub redis_stream: Option<RawRedisStream>,
    /// An HTTP endpoint receiving CloudEvents 1.0 batches.
    pub http: Option<RawHttpSink>,
}

/// `usage.sinks[].redis_stream`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawRedisStream {
    /// The stream's key; default `tollgate:usage`.
    pub key: Option<String>,
    /// A Redis of its own (one URL); the store's when absent.
    pub urls: Option<Vec<String>>,
}

/// `usage.sinks[].http`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawHttpSink {
    /// `http://` or `https://`.
    pub url: String,
    /// `cloudevents` (the only one, and the default).
    pub format: Option<String>,
    /// Records per request, 1-10000; default 500.
    #[schemars(transform = bounds::SINK_BATCH.schema())]
    pub batch: Option<u64>,
    /// The longest a request waits, in ms; default 2000.
    #[schemars(transform = bounds::SINK_TIMEOUT_MS.schema())]
    pub timeout_ms: Option<u64>,
    /// An environment variable holding a bearer token.
    pub token_env: Option<String>,
}

/// The `server` section: listeners, threads, shutdown and edge bounds.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    /// Client listeners as `ip:port`; `["0.0.0.0:8080"]` when absent.
    pub listen: Option<Vec<String>>,
    /// Address of the admin listener (`/healthz`, `/readyz`, `/metrics`, `/admin/*`), if any.
    pub admin_listen: Option<String>,
    /// Worker threads, 1-256; the number of CPUs available when absent.
    #[schemars(transform = bounds::THREADS.schema())]
    pub threads: Option<usize>,
    /// Name of the environment variable whose value guards `/admin/*` as a bearer token
    /// (a `write` token named `env`).
    pub admin_token_env: Option<String>,
    /// Tokens of the admin API: each a name, the SHA-256 of the token and a role,
    /// `read` (GETs) or `write` (GETs and writes).
    #[serde(default)]
    pub admin_tokens: Vec<RawAdminToken>,
    /// Where every admin write, and every refused one, is recorded (`server.audit_log`).
    pub audit_log: Option<RawAuditLog>,
    /// How often each instance reads the admin records (revocations) of the shared
    /// store again, 100-60000 ms; default 1000.
    #[schemars(transform = bounds::ADMIN_REFRESH_MS.schema())]
    pub admin_refresh_ms: Option<u64>,
    /// Reload by itself when the policy file, its keys file, TLS
    /// certificate and key or a JWKS file change; default true. Read at
    /// start.
    pub watch: Option<bool>,
    /// How long requests in flight may run after SIGTERM, 0-3600; default 10.
    #[schemars(transform = bounds::SHUTDOWN_GRACE_SECONDS.schema())]
    pub shutdown_grace_seconds: Option<u64>,
    /// Connection, header and body bounds (`server.limits`).
    pub limits: Option<RawServerLimits>,
    /// Read, idle and send timeouts of client connections (`server.timeouts`).
    pub timeouts: Option<RawTimeouts>,
    /// What `%2F` in a request path does: `reject` (400, the default) or `keep`.
    pub encoded_slash: Option<EncodedSlashName>,
    /// How paths are read for upstreams that read them loosely
    /// (`server.path`).
    #[serde(default)]
    pub path: RawPath,
    /// One JSON line per request (`server.access_log`).
    pub access_log: Option<RawAccessLog>,
    /// TLS listeners (`server.tls`).
    pub tls: Option<RawTls>,
    /// Serve HTTP/2: h2 by ALPN on TLS listeners, h2c with prior knowledge
    /// on plain ones; default false.
    #[serde(default)]
    pub http2: bool,
    /// Concurrent streams an HTTP/2 client may open on one connection
    /// (`SETTINGS_MAX_CONCURRENT_STREAMS`), 1-10000; default 100. Read at
    /// start.
    #[schemars(transform = bounds::HTTP2_MAX_STREAMS.schema())]
    pub http2_max_streams: Option<u32>,
    /// Open connections of the admin listener, 1-100000; default 256.
    #[schemars(transform = bounds::ADMIN_MAX_CONNECTIONS.schema())]
    pub admin_max_connections: Option<u64>,
    /// Open connections of the admin listener from one client address,
    /// 1-100000; default 8. Beyond, new ones are closed at once.
    #[schemars(transform = bounds::ADMIN_MAX_CONNECTIONS_PER_IP.schema())]
    pub admin_max_connections_per_ip: Option<u64>,
    /// Lines a client can cause (proxy errors, store warnings, sampled
    /// denials) written a second, per kind, 0-10000; default 1. The rest
    /// are counted and summarized.
    #[schemars(transform = bounds::LOG_CLIENT_ERRORS_PER_S.schema())]
    pub log_client_errors_per_s: Option<u32>,
    /// Spans of requests exported over OTLP/HTTP (`server.tracing`).
    /// Without it `traceparent` is still continued, started and forwarded.
    pub tracing: Option<RawTracing>,
}

/// The `server.tracing` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    /// Where spans are sent: an OTLP/HTTP traces endpoint
    /// (`http://collector:4318/v1/traces`), protobuf encoded.
    pub otlp_endpoint: String,
    /// The share of traces this gateway starts that are sampled, 0 to 1;
    /// default 1. A trace continued from a trusted proxy keeps its flag.
    pub sample: Option<f64>,
}

/// The `server.tls` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    /// The TLS listeners, `ip:port`.
    pub listen: Vec<String>,
    /// The PEM certificate chain, re-read on reload.
    pub cert_file: String,
    /// The PEM private key, re-read on reload.
    pub key_file: String,
}

/// The `server.access_log` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawAccessLog {
    /// A file (created mode 0600, appended to) or `stdout`.
    pub path: String,
    /// The share of requests logged, in (0, 1]; default 1.
    pub sample: Option<f64>,
}

/// The `server.limits` section: bounds on what a client may send.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawServerLimits {
    /// Open client connections per listener; beyond, new ones are closed at once. Default 10000.
    #[schemars(transform = bounds::MAX_CONNECTIONS.schema())]
    pub max_connections: Option<u64>,
    /// Open client connections of one client address (the TCP peer), the
    /// proxy's listeners together; beyond, new ones from it are closed at
    /// once, so that no client takes every slot. 1-1000000; default 1000.
    #[schemars(transform = bounds::MAX_CONNECTIONS_PER_IP.schema())]
    pub max_connections_per_ip: Option<u64>,
    /// Largest request line and headers; above is a 431. Default 65536.
    #[schemars(transform = bounds::MAX_HEADER_BYTES.schema())]
    pub max_header_bytes: Option<u64>,
    /// Default of `routes[].max_body_bytes`; default 10485760.
    #[schemars(transform = bounds::MAX_BODY_BYTES.schema())]
    pub max_body_bytes: Option<u64>,
    /// Request bodies up to this size are read whole before the request
    /// takes a pool permit, 0-65536 (0: none); default 65536.
    #[schemars(transform = bounds::BUFFER_BODY_BYTES.schema())]
    pub buffer_body_bytes: Option<u64>,
    /// All bodies read whole at once, together, at most; beyond, 503
    /// overloaded. 0-17179869184; default 268435456.
    #[schemars(transform = bounds::BUFFERED_BYTES_TOTAL.schema())]
    pub buffered_bytes_total: Option<u64>,
    /// Least rate a client must take a response at, bytes a second of the
    /// time the gateway waits on it, once `server.timeouts.body_grace_ms`
    /// of waiting passed (a zero HTTP/2 window is a rate of zero),
    /// 1-1073741824; default 1024. Slower, the response is cut.
    #[schemars(transform = bounds::SEND_MIN_RATE.schema())]
    pub send_min_rate: Option<u64>,
}

/// The `server.timeouts` section, all in milliseconds.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawTimeouts {
    /// From a request's first byte to the end of its headers (→ 408); default 10000.
    #[schemars(transform = bounds::HEADER_READ_MS.schema())]
    pub header_read_ms: Option<u64>,
    /// Idle time allowed between requests on a connection; default 60000.
    #[schemars(transform = bounds::KEEPALIVE_IDLE_MS.schema())]
    pub keepalive_idle_ms: Option<u64>,
    /// Longest wait for the next bytes of a request body (→ 408); default 30000.
    #[schemars(transform = bounds::BODY_READ_MS.schema())]
    pub body_read_ms: Option<u64>,
    /// Longest time a client may leave a response write pending; default 30000.
    #[schemars(transform = bounds::SEND_MS.schema())]
    pub send_ms: Option<u64>,
    /// Least average rate of a request body, bytes a second since it
    /// started, once `body_grace_ms` passed, 1-1073741824; default 1024.
    #[schemars(transform = bounds::BODY_MIN_RATE.schema())]
    pub body_min_rate: Option<u64>,
    /// How long a body may run before its rate is held to `body_min_rate`;
    /// default 5000.
    #[schemars(transform = bounds::BODY_GRACE_MS.schema())]
    pub body_grace_ms: Option<u64>,
    /// Longest time a request body may take in all; default 300000.
    #[schemars(transform = bounds::BODY_TOTAL_MS.schema())]
    pub body_total_ms: Option<u64>,
}

/// `routes[].upgrade`: a flag or the protocol tokens.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(untagged, expecting = "true, false or a list of protocol tokens")]
pub enum RawUpgrade {
    /// `true` is `[websocket]`; `false` is none.
    Flag(bool),
    /// Every token of a request's `Upgrade` must be one of these.
    Protocols(Vec<String>),
}

impl Default for RawUpgrade {
    fn default() -> Self {
        RawUpgrade::Flag(false)
    }
}

/// One `server.admin_tokens` entry.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawAdminToken {
    /// Who holds it: the audit log's `actor`.
    pub name: String,
    /// The SHA-256 of the token, hex (as `tollgate hash-key` prints it).
    pub sha256: String,
    /// `read` or `write`.
    pub role: AdminRole,
}

/// The `server.audit_log` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawAuditLog {
    /// A file, appended to (created mode 0600); the process log when absent.
    pub path: String,
}

/// The `server.path` section: what `;` parameters, a trailing `/`,
/// segments ending in `.` or a space, and ASCII case do to routing.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawPath {
    /// `;` parameters (raw or `%3B`): `reject` (400, the default), `strip`
    /// (removed before routing and forwarding) or `keep`.
    pub params: Option<PathParams>,
    /// `strict` (the default) or `ignore`: a route also matches its path
    /// with one trailing `/`.
    pub trailing_slash: Option<TrailingSlash>,
    /// `refuse` (400, the default) or `allow`: a path segment ending in
    /// `.` or a space (raw or encoded, `/v1/admin.`, `/v1/x%20/y`), which
    /// servers that strip them would read as another route.
    pub trailing_dots: Option<TrailingDots>,
    /// `sensitive` (the default) or `insensitive`: routes match whatever
    /// the ASCII case.
    pub case: Option<Case>,
}

/// The values of `server.encoded_slash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EncodedSlashName {
    /// A `%2F` in the path is a 400.
    Reject,
    /// A `%2F` is kept encoded inside its segment, for matching and forwarding.
    Keep,
}

/// The values of `store.backend`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// State in this process only: one instance, no Redis.
    #[default]
    Memory,
    /// One Redis server, at the single URL in `store.urls`.
    Redis,
    /// A Redis Cluster, reached through the seed nodes in `store.urls`.
    RedisCluster,
    /// A primary found through the Redis Sentinels in `store.urls`, by
    /// `store.master_name`, followed across failovers.
    RedisSentinel,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::RedisCluster => "redis_cluster",
            Backend::RedisSentinel => "redis_sentinel",
        })
    }
}

/// The `store` section: the backend of shared limits and how to call it.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    /// `memory`, `redis`, `redis_cluster` or `redis_sentinel`; `memory` when absent.
    #[serde(default)]
    pub backend: Backend,
    /// `redis://` or `rediss://` URLs: one for `redis`, seed nodes for
    /// `redis_cluster`, sentinels for `redis_sentinel`.
    #[serde(default)]
    pub urls: Vec<String>,
    /// The name the sentinels know the primary by (`redis_sentinel` only).
    pub master_name: Option<String>,
    /// Bound on every store call, 1-10000 ms; default 20. A decision that
    /// waits this long while the store answers other calls is shed (503
    /// overloaded), not counted as a store failure.
    #[schemars(transform = bounds::STORE_TIMEOUT_MS.schema())]
    pub timeout_ms: Option<u64>,
    /// Decisions waiting for the store (queued or in flight) at most,
    /// 1-1000000; beyond, 503 overloaded. Default 4096.
    #[schemars(transform = bounds::MAX_PENDING.schema())]
    pub max_pending: Option<u64>,
    /// Prepended to every Redis key; `"tg:"` when absent.
    pub key_prefix: Option<String>,
    /// Name of the environment variable holding the HMAC secret for store keys;
    /// `TOLLGATE_KEY_SECRET` when absent.
    pub key_secret_env: Option<String>,
    /// When to stop calling a failing store (`store.circuit_breaker`).
    pub circuit_breaker: Option<RawBreaker>,
    /// Instances sharing the store; `on_store_error: local` enforces 1/this of a budget. Default 1.
    #[schemars(transform = bounds::EXPECTED_INSTANCES.schema())]
    pub expected_instances: Option<u32>,
}

/// The `store.circuit_breaker` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawBreaker {
    /// Failed store calls in a row that open the breaker, 1-1000; default 5.
    #[schemars(transform = bounds::FAILURE_THRESHOLD.schema())]
    pub failure_threshold: Option<u32>,
    /// How long the breaker stays open before a trial call, 1-600000 ms; default 1000.
    #[schemars(transform = bounds::OPEN_MS.schema())]
    pub open_ms: Option<u64>,
}

/// The `client_ip` section: where the client address comes from.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawClientIp {
    /// Networks (CIDR or bare address) whose forwarding header is believed.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// The forwarding header read from a trusted peer; `x-forwarded-for` when absent.
    #[serde(default)]
    pub header: HeaderName,
    /// Length of the network IPv6 clients are keyed by, 1-128; default 64.
    #[schemars(transform = bounds::IPV6_PREFIX.schema())]
    pub ipv6_prefix: Option<u8>,
}

/// The values of `client_ip.header`.
#[derive(Debug, Clone, Copy, Default, Deserialize, JsonSchema)]
pub enum HeaderName {
    /// `X-Forwarded-For`, walked from the nearest hop.
    #[default]
    #[serde(rename = "x-forwarded-for")]
    XForwardedFor,
    /// The `for=` parameters of RFC 7239 `Forwarded`.
    #[serde(rename = "forwarded")]
    Forwarded,
    /// `X-Real-IP`: exactly one well-formed header line.
    #[serde(rename = "x-real-ip")]
    XRealIp,
}

/// The `ip_rules` section, applied to the resolved client IP before routing.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawIpRules {
    /// Networks whose clients get a 403.
    #[serde(default)]
    pub deny: Vec<String>,
    /// When non-empty, the only networks whose clients are let through.
    #[serde(default)]
    pub allow: Vec<String>,
}

/// The `auth` section: the key header and the credentials.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    /// Header carrying the API key; `authorization` (as `Bearer <key>`) when absent.
    pub header: Option<String>,
    /// Path of a file with more `keys`, relative to the policy file's
    /// directory: YAML when named `.yaml` or `.yml`, else one credential a
    /// line (`<sha256> <id> <tenant> [<plan>]`).
    pub keys_file: Option<String>,
    /// Credentials written in the policy itself.
    #[serde(default)]
    pub keys: Vec<RawKey>,
    /// Whether the upstream receives the key header; removed by default.
    #[serde(default)]
    pub forward_key: bool,
    /// Issuers of JSON Web Tokens whose callers are admitted: a bearer
    /// token of three base64url segments is verified against them.
    #[serde(default)]
    pub jwt: Vec<RawJwt>,
    /// Credentials provisioned at runtime through `/admin/credentials`,
    /// kept in the store and looked up on first use.
    pub store_keys: Option<RawStoreKeys>,
    /// Ask an existing service who the caller is, for a key no other
    /// source knows.
    pub forward_auth: Option<RawForwardAuth>,
}

/// `auth.store_keys`: how an instance caches the store's credentials.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawStoreKeys {
    /// The most credentials cached, 1-100000000; default 100000. Unknown
    /// keys have a tenth of it (at least 1000) of their own.
    #[schemars(transform = bounds::STORE_KEYS_CACHE_ENTRIES.schema())]
    pub cache_entries: Option<u64>,
    /// How long a key the store does not know is remembered, 0-3600 s;
    /// default 10.
    #[schemars(transform = bounds::STORE_KEYS_NEGATIVE_TTL_S.schema())]
    pub negative_ttl_s: Option<u64>,
}

/// `auth.forward_auth`: one `GET` to an existing service for a key the
/// keys do not know; its answer's headers name the caller.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawForwardAuth {
    /// The service: `http://` or `https://`, with a path (and query).
    pub url: String,
    /// Request headers sent along; the auth header when absent.
    pub headers: Option<Vec<String>>,
    /// The answer's header naming the tenant.
    pub tenant_header: String,
    /// The answer's header naming the caller: credentials `fwd:<id>`.
    pub credential_header: String,
    /// The answer's header naming a plan; a value naming none leaves the
    /// limits unchanged.
    pub plan_header: Option<String>,
    /// How long a call may take, 1-60000 ms; default 200.
    #[schemars(transform = bounds::FORWARD_AUTH_TIMEOUT_MS.schema())]
    pub timeout_ms: Option<u64>,
    /// How long a known caller's answer is kept, 0-86400 s; default 60.
    #[schemars(transform = bounds::FORWARD_AUTH_CACHE_TTL_S.schema())]
    pub cache_ttl_s: Option<u64>,
    /// How long an unknown caller's answer (401/403) is kept, 0-3600 s;
    /// default 10.
    #[schemars(transform = bounds::FORWARD_AUTH_NEGATIVE_TTL_S.schema())]
    pub negative_ttl_s: Option<u64>,
    /// The most known callers kept; unknown ones have a tenth of it (at
    /// least 1000) of their own. Default 1000000.
    #[schemars(transform = bounds::FORWARD_AUTH_MAX_ENTRIES.schema())]
    pub max_entries: Option<u64>,
    /// The most calls at once; beyond it a lookup is answered 503. Default 64.
    #[schemars(transform = bounds::FORWARD_AUTH_MAX_IN_FLIGHT.schema())]
    pub max_in_flight: Option<u64>,
}

/// One `auth.jwt` issuer.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawJwt {
    /// The issuer's name: its callers' credentials are `jwt:<name>:<sub>`.
    pub name: String,
    /// The `iss` its tokens carry.
    pub issuer: String,
    /// Accepted `aud` values; a token must name one.
    pub audiences: Vec<String>,
    /// A JWKS file (JSON, public keys with a `kid` each), relative to the
    /// policy file's directory; read again on reload. Or `jwks_url`.
    pub jwks_file: Option<String>,
    /// Where the running gateway fetches the JWKS: `https://`, or
    /// `http://` to a loopback address. Fetched at start, every
    /// `refresh_s`, and when a token names an unknown `kid` (at most once
    /// every 10 s); a failed fetch keeps the last good keys.
    pub jwks_url: Option<String>,
    /// Seconds between fetches of `jwks_url`, 1-86400; default 300.
    #[schemars(transform = bounds::JWKS_REFRESH_S.schema())]
    pub refresh_s: Option<u64>,
    /// Signature algorithms its tokens may use: RS256-512, PS256-512,
    /// ES256, ES384, EdDSA. HMAC and `none` are refused.
    pub algorithms: Vec<String>,
    /// The claim holding the tenant.
    pub tenant_claim: String,
    /// Put before the tenant claim's value; give each issuer its own when
    /// several share a deployment. Default empty.
    #[serde(default)]
    pub tenant_prefix: String,
    /// The claim holding the caller's id; default `sub`.
    pub credential_claim: Option<String>,
    /// A claim naming a plan of the policy; a value naming none leaves the
    /// limits unchanged.
    pub plan_claim: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`, 0-300 s; default 30.
    #[schemars(transform = bounds::JWT_LEEWAY_S.schema())]
    pub leeway_s: Option<u64>,
}

/// The schema of `auth.keys_file`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawKeysFile {
    /// The credentials, with the same entries as `auth.keys`.
    pub keys: Vec<RawKey>,
}

/// One entry of `auth.keys` or of the keys file.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    /// The credential id: stable, not secret, sent upstream.
    pub id: String,
    /// The tenant the credential acts for, 1-256 characters.
    pub tenant: String,
    /// The plan whose overrides apply to this credential, if any.
    pub plan: Option<String>,
    /// SHA-256 of the raw key as 64 hex digits (`tollgate hash-key`).
    pub sha256: String,
}

/// A plan's replacement numbers for one limit.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawOverride {
    /// Replacement `capacity` of a `token_bucket` or `gcra` limit.
    #[schemars(transform = bounds::amount)]
    pub capacity: Option<f64>,
    /// Replacement `refill_per_second` of a `token_bucket` or `gcra` limit.
    #[schemars(transform = bounds::amount)]
    pub refill_per_second: Option<f64>,
    /// Replacement `limit` of a window limit.
    #[schemars(transform = bounds::amount)]
    pub limit: Option<f64>,
    /// Replacement `window_seconds` of a window limit.
    pub window_seconds: Option<f64>,
    /// `quota`: `day` or `month` (calendar periods in UTC).
    pub period: Option<crate::limits::algorithm::Period>,
    /// Replacement `max_in_flight` of a `concurrency` limit.
    #[schemars(transform = bounds::LIMIT_MAX_IN_FLIGHT.schema())]
    pub max_in_flight: Option<u64>,
    /// `hold_ttl_ms` of a `concurrency` limit (not in plans or overrides:
    /// it is the limit's).
    #[schemars(transform = bounds::HOLD_TTL_MS.schema())]
    pub hold_ttl_ms: Option<u64>,
}

/// The values of `limits.*.scope`: when a limit runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Before authentication; the key may use `ip`, `route`, `header.*`
    /// and `path.*`.
    PreAuth,
    /// After authentication, with the other request limits.
    #[default]
    Request,
}

/// The values of `limits.*.algorithm`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmName {
    /// `capacity` tokens refilled at `refill_per_second`.
    #[default]
    TokenBucket,
    /// A token bucket with the same numbers, stored as one timestamp.
    Gcra,
    /// `limit` per window of `window_seconds`, aligned to its length.
    FixedWindow,
    /// A fixed window smoothed with the previous window's count.
    SlidingWindow,
    /// Exact: one entry per admitted request in the last `window_seconds`.
    SlidingLog,
    /// `limit` per calendar `period` (UTC), with no refill.
    Quota,
    /// At most `max_in_flight` requests at once, each holding one unit
    /// until it ends.
    Concurrency,
}

impl fmt::Display for AlgorithmName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AlgorithmName::TokenBucket => "token_bucket",
            AlgorithmName::Gcra => "gcra",
            AlgorithmName::FixedWindow => "fixed_window",
            AlgorithmName::SlidingWindow => "sliding_window",
            AlgorithmName::SlidingLog => "sliding_log",
            AlgorithmName::Quota => "quota",
            AlgorithmName::Concurrency => "concurrency",
        })
    }
}

/// The values of `limits.*.store`: where a limit is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// In this instance, with no store call.
    Local,
    /// In the shared store, across instances.
    Shared,
}

/// One entry of `limits`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    /// `pre_auth` or `request`; `request` when absent.
    #[serde(default)]
    pub scope: Scope,
    /// What budgets are counted per; `[]` is one global budget. Each part
    /// is `ip`, `credential`, `tenant`, `route`, or a value the request
    /// carries: `header.NAME`, `path.PARAM` (a `{PARAM}` of the route's
    /// template), `query.NAME`, `claim.NAME` (the caller's JWT),
    /// `auth.NAME` (a header of forward auth's answer) or `body.FIELD` (a
    /// JSON body's member, by dotted path).
    #[serde(default)]
    pub key: Vec<String>,
    /// With a key read from the request: what a request without a value
    /// gets: `skip` (the limit does not apply; the default), `bucket` (one
    /// bucket for all of them) or `reject` (400 `missing-key-value`).
    pub absent: Option<crate::key_values::Absent>,
    /// With a key of one value read from the request: parameters per value,
    /// as a plan overrides a limit's.
    pub values: Option<UniqueMap<RawOverride>>,
    /// With `values`: a value not listed uses the limit's own parameters
    /// (`default`) or is refused 400 `unknown-key-value` (`reject`).
    pub other: Option<crate::key_values::Other>,
    /// The algorithm; `token_bucket` when absent.
    #[serde(default)]
    pub algorithm: AlgorithmName,
    /// `token_bucket`, `gcra`: the largest burst, 1 to 1e9.
    #[schemars(transform = bounds::amount)]
    pub capacity: Option<f64>,
    /// `token_bucket`, `gcra`: tokens added per second, at most 1e9.
    #[schemars(transform = bounds::amount)]
    pub refill_per_second: Option<f64>,
    /// Window algorithms: the cost admitted per window, a whole number.
    #[schemars(transform = bounds::amount)]
    pub limit: Option<f64>,
    /// Window algorithms: the window length, at most 86400.
    pub window_seconds: Option<f64>,
    /// `quota`: `day` or `month` (calendar periods in UTC).
    pub period: Option<crate::limits::algorithm::Period>,
    /// `concurrency`: requests in flight at once per key, 1-1000000.
    #[schemars(transform = bounds::LIMIT_MAX_IN_FLIGHT.schema())]
    pub max_in_flight: Option<u64>,
    /// `concurrency`: a hold its instance has not renewed within this is
    /// reclaimed (the instance died), 1000-3600000 ms; default 30000.
    #[schemars(transform = bounds::HOLD_TTL_MS.schema())]
    pub hold_ttl_ms: Option<u64>,
    /// `local` or `shared`; `shared` when absent (`local` with `backend: memory`).
    pub store: Option<Placement>,
    /// What a shared limit does while the store fails; `closed` when absent.
    #[serde(default)]
    pub on_store_error: OnStoreError,
    /// `enforce`, or `shadow` to decide without ever denying; `enforce` when absent.
    #[serde(default)]
    pub mode: Mode,
    /// `exact` (one store decision per request) or `lease`; `exact` when absent.
    #[serde(default)]
    pub sync: LimitSync,
    /// With `sync: lease`: how many units an instance takes ahead, and for how long.
    pub lease: Option<RawLease>,
    /// `reject` (429 at once) or `delay`; `reject` when absent.
    #[serde(default)]
    pub on_limit: OnLimit,
    /// With `on_limit: delay`: the longest a request is held, 1-60000 ms.
    #[schemars(transform = bounds::MAX_DELAY_MS.schema())]
    pub max_delay_ms: Option<u64>,
}

/// The values of `limits.*.on_limit`: what a request over the limit gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnLimit {
    /// 429 at once.
    #[default]
    Reject,
    /// Held until the limit admits it, up to `max_delay_ms`; 429 beyond.
    Delay,
}

/// The values of `limits.*.sync`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LimitSync {
    /// Every decision in the shared store.
    #[default]
    Exact,
    /// Decided against units taken ahead from the shared store.
    Lease,
}

/// The `limits.*.lease` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawLease {
    /// Units an instance holds at most per key, 1 to the limit's capacity.
    #[schemars(transform = bounds::amount)]
    pub units: f64,
    /// Units unspent this long after they were taken go back, 10-60000 ms.
    #[schemars(transform = bounds::LEASE_TTL_MS.schema())]
    pub ttl_ms: f64,
    /// The most an instance may hold per key, `units` to the limit's
    /// capacity; default `units` (a fixed size). A lease grows towards it
    /// while its units are spent quickly, and shrinks back to `units` when
    /// the store refuses.
    pub max_units: Option<f64>,
}

/// One entry of `upstreams`: a pool of servers.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    /// The servers as `host:port`, resolved when the policy is loaded.
    pub servers: Vec<String>,
    /// Requests forwarded to the pool at once, 1-1000000; default 256.
    #[schemars(transform = bounds::MAX_IN_FLIGHT.schema())]
    pub max_in_flight: Option<u32>,
    /// Requests that may wait for a permit, and for how long (`queue`).
    pub queue: Option<RawQueue>,
    /// Bound on connecting to a server, 1-60000 ms; default 3500 (two SYN
    /// retransmissions, at 1 s and 3 s).
    #[schemars(transform = bounds::CONNECT_TIMEOUT_MS.schema())]
    pub connect_timeout_ms: Option<u64>,
    /// Further tries after a failed connect, or a reused connection that
    /// failed before any response byte, 0-10; default 2.
    #[schemars(transform = bounds::RETRIES.schema())]
    pub retries: Option<u32>,
    /// The `Host` the upstream receives: `preserve` (the client's, the
    /// default), `upstream` (the server's `host:port` as configured), or
    /// any other text, sent as it is.
    pub host_header: Option<String>,
    /// HTTPS to the servers (`upstreams.*.tls`); plain HTTP when absent.
    pub tls: Option<RawUpstreamTls>,
    /// `http1`, `h2` or `auto` (ALPN): the HTTP version over TLS; default
    /// `auto` with `tls`, `http1` without.
    pub protocol: Option<UpstreamProtocol>,
    /// Bound on reading from a server, 1-3600000 ms; default 30000.
    #[schemars(transform = bounds::READ_TIMEOUT_MS.schema())]
    pub read_timeout_ms: Option<u64>,
    /// An answer whose declared length is at most this is read whole
    /// before it goes on to the client, so its pool permit and holds end
    /// with the upstream's work, however slowly the client reads;
    /// 0-16777216 bytes (0: none); default 65536. Larger answers, and
    /// streamed ones, keep their permit while they stream.
    #[schemars(transform = bounds::RESPONSE_BUFFER_BYTES.schema())]
    pub response_buffer_bytes: Option<u64>,
    /// Active health checks; without them every server counts as healthy.
    pub health_check: Option<RawHealthCheck>,
    /// Shares of `max_in_flight` kept for a priority (`critical` only).
    pub reserve: Option<RawReserve>,
}

/// The `routes[].cost_from_response` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawCostFromResponse {
    /// The response header (or trailer) holding the actual cost, a whole
    /// number. Exactly one of `header`, `json` and `format`.
    pub header: Option<String>,
    /// Dotted paths of whole numbers in a JSON response body, summed
    /// (`usage.total_tokens`, or a list), read as the body streams past.
    pub json: Option<OneOrMany>,
    /// An LLM API's usage, from a JSON body or the events of a
    /// `text/event-stream`: `openai` or `anthropic`.
    pub format: Option<crate::limits::meter::FormatName>,
    /// With `format: openai`: a streamed chat/completions request is sent
    /// with `stream_options.include_usage: true`, so that its stream ends
    /// with the usage (its client then gets one more chunk, with
    /// `choices: []`).
    #[serde(default)]
    pub include_usage: bool,
    /// With `format`: the price of an input and of an output token.
    pub weights: Option<RawWeights>,
    /// The most a response may be charged, whatever it reports.
    #[schemars(transform = bounds::amount)]
    pub max: f64,
    /// Whether the client sees the header; `false` when absent.
    #[serde(default)]
    pub expose: bool,
    /// What a response the client abandoned before its cost arrived is
    /// charged: `max` (the default) or `estimate`.
    pub on_abandon: Option<OnAbandon>,
    /// What admission charges: `estimate` (the route's cost, the default)
    /// or `max` (the settlement gives back the difference).
    pub reserve: Option<Reserve>,
    /// How deep into debt settlements may push a limit, in units; default
    /// 10 × (`max` − cost), at least the limit's capacity.
    #[schemars(transform = bounds::amount)]
    pub max_debt: Option<f64>,
}

/// One dotted path, or a list of them.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One path.
    One(String),
    /// Several, summed.
    Many(Vec<String>),
}

/// The `cost_from_response.weights` section.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawWeights {
    /// Units charged per input (prompt) token; default 1.
    #[serde(default = "one")]
    pub input: u64,
    /// Units charged per output (completion) token; default 1.
    #[serde(default = "one")]
    pub output: u64,
}

fn one() -> u64 {
    1
}

/// The `upstreams.*.reserve` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawReserve {
    /// The share of `max_in_flight` only critical routes may take, 0 to
    /// below 1.
    pub critical: f64,
}

/// The `upstreams.*.tls` section.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawUpstreamTls {
    /// The name sent in SNI and verified; the first server's host when absent.
    pub sni: Option<String>,
    /// PEM CA certificates to verify the servers with, instead of the
    /// system's roots.
    pub ca_file: Option<String>,
    /// Whether the servers' certificates are verified; default true.
    pub verify: Option<bool>,
}

/// The `upstreams.*.health_check` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawHealthCheck {
    /// Time between probes of the pool's servers, 10-3600000 ms; default 2000.
    #[schemars(transform = bounds::HEALTH_INTERVAL_MS.schema())]
    pub interval_ms: Option<u64>,
    /// Bound on one probe, 1-60000 ms; default 1000.
    #[schemars(transform = bounds::HEALTH_TIMEOUT_MS.schema())]
    pub timeout_ms: Option<u64>,
    /// Path probed with `GET` (2xx or 3xx is healthy); a TCP connect when absent.
    pub path: Option<String>,
    /// Good probes in a row to return to the rotation, 1-100; default 1.
    #[schemars(transform = bounds::HEALTHY_AFTER.schema())]
    pub healthy_after: Option<u32>,
    /// Failed probes in a row to leave it, 1-100; default 2.
    #[schemars(transform = bounds::UNHEALTHY_AFTER.schema())]
    pub unhealthy_after: Option<u32>,
}

/// The `upstreams.*.queue` section: waiting for a pool permit.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawQueue {
    /// Requests that may wait for a permit, 0-1000000; `max_in_flight` when absent.
    #[schemars(transform = bounds::QUEUE_MAX_WAITING.schema())]
    pub max_waiting: Option<u32>,
    /// Longest wait for a permit before a 503, 0-60000 ms; default 100.
    #[schemars(transform = bounds::QUEUE_TIMEOUT_MS.schema())]
    pub timeout_ms: Option<u64>,
    /// `tenant`: within each priority, waiters are served in turn between
    /// tenants (one tenant's burst cannot starve another); arrival order
    /// when absent.
    pub fair: Option<Fairness>,
    /// The most waiters one tenant may have in the queue, 1-1000000;
    /// beyond it that tenant is answered 503 at once while others still
    /// queue. No bound when absent.
    #[schemars(transform = bounds::QUEUE_PER_TENANT_MAX.schema())]
    pub per_tenant_max: Option<u32>,
}

/// The values of `upstreams.*.queue.fair`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Fairness {
    /// In turn between tenants; a request without a credential (an
    /// `auth: none` route) takes its turns as its client's network.
    Tenant,
}

/// The values of `routes[].auth`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    /// The request needs a valid API key.
    #[default]
    Required,
    /// No key is read; limits keyed by `credential` or `tenant` are not allowed.
    None,
}

/// One entry of `routes`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    /// The route class: unique, used in metrics and sent upstream.
    pub name: String,
    /// HTTP methods matched, case-insensitive; `[]` matches any.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Path template: literal segments, `{name}` and a final `**`.
    pub path: String,
    /// `required` or `none`; `required` when absent.
    #[serde(default)]
    pub auth: AuthMode,
    /// The pool admitted requests go to; exactly one of this and `respond`.
    pub upstream: Option<String>,
    /// A fixed response given by the gateway itself, instead of an upstream.
    pub respond: Option<RawRespond>,
    /// What one request charges each of its limits, a whole number; default 1.
    #[schemars(transform = bounds::amount)]
    pub cost: Option<f64>,
    /// Names of the limits applied; `pre_auth` ones run before authentication.
    #[serde(default)]
    pub limits: Vec<String>,
    /// Largest request body (→ 413); `server.limits.max_body_bytes` when absent.
    #[schemars(transform = bounds::ROUTE_MAX_BODY_BYTES.schema())]
    pub max_body_bytes: Option<u64>,
    /// The protocols an `Upgrade` request may name: `true` (WebSocket),
    /// `false` (the default: the header is removed) or a list of tokens
    /// such as `[websocket, h2c]`.
    #[serde(default)]
    pub upgrade: RawUpgrade,
    /// Host names the route serves (`Host` / `:authority`, port ignored):
    /// exact names, or `*.example.com` for any subdomain; empty = any host.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// The longest wait for the upstream's response (to its first byte, and
    /// between reads), 1-3600000 ms; the pool's `read_timeout_ms` when absent.
    #[schemars(transform = bounds::ROUTE_TIMEOUT_MS.schema())]
    pub timeout_ms: Option<u64>,
    /// `critical`, `normal` or `sheddable` when its pool is full; `normal`
    /// when absent.
    #[serde(default)]
    pub priority: Priority,
    /// The cost as the upstream reports it in a response header (or
    /// trailer), charged or given back after the response.
    pub cost_from_response: Option<RawCostFromResponse>,
    /// The estimate charged at admission, as the request names it (e.g.
    /// its `max_tokens`), instead of `cost`: only beside
    /// `cost_from_response`, which corrects it.
    pub cost_from_request: Option<RawCostFromRequest>,
    /// On a route that reads its request body (`body.*` keys,
    /// `cost_from_request.json`, `include_usage`): a body larger than
    /// `server.limits.buffer_body_bytes` is `reject`ed (413, the default),
    /// or read as one with no values (`absent`; its estimate is `max`).
    pub oversize: Option<Oversize>,
}

/// The `routes[].cost_from_request` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawCostFromRequest {
    /// A request header holding a whole number. One of `header` and `json`.
    pub header: Option<String>,
    /// A whole number in a JSON request body, by dotted path.
    pub json: Option<String>,
    /// The most an estimate may be; larger ones are clamped to it.
    #[schemars(transform = bounds::amount)]
    pub max: f64,
    /// The estimate of a request that names none; the route's `cost` when
    /// absent.
    #[schemars(transform = bounds::amount)]
    pub default: Option<f64>,
}

/// The `routes[].respond` section: a response made by the gateway.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawRespond {
    /// The status code, 200-599.
    #[schemars(transform = bounds::RESPOND_STATUS.schema())]
    pub status: u16,
    /// The body; empty when absent, and must be empty with 204 and 304.
    #[serde(default)]
    pub body: String,
    /// The `Content-Type`; `text/plain; charset=utf-8` when absent.
    pub content_type: Option<String>,
}

/// The values of `responses.ratelimit_headers`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RateLimitHeaders {
    /// No rate-limit headers on responses.
    #[default]
    None,
    /// `RateLimit-Policy` and `RateLimit` as in draft-ietf-httpapi-ratelimit-headers.
    Draft,
}

/// The `responses` section.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawResponses {
    /// `none` or `draft`; `none` when absent.
    #[serde(default)]
    pub ratelimit_headers: RateLimitHeaders,
}

/// `routes[].oversize`: a body too large to read whole before the limits
/// (more than `server.limits.buffer_body_bytes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Oversize {
    /// 413.
    #[default]
    Reject,
    /// Its body values are absent, and a cost read from it is the most.
    Absent,
}

/// `cost_from_response.on_abandon`: what a response is settled at when its
/// client went away (connection closed, stream reset) before its cost
/// arrived. Hanging up just before the end of every answer must not make
/// a client pay only estimates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnAbandon {
    /// At `max`.
    #[default]
    Max,
    /// At the estimate (the route's cost).
    Estimate,
}

/// `cost_from_response.reserve`: what admission charges before the actual
/// cost is known.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Reserve {
    /// The estimate (the route's cost); the settlement charges the rest.
    #[default]
    Estimate,
    /// `max`; the settlement gives back what the response did not cost,
    /// so a tenant can never overspend.
    Max,
}

/// The values of `routes[].priority`: who waits first and is shed last when
/// a pool is full.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Served first, and alone in the reserved share.
    Critical,
    /// The default.
    #[default]
    Normal,
    /// Refused first.
    Sheddable,
}

impl Priority {
    /// The `priority` label.
    pub fn label(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Normal => "normal",
            Priority::Sheddable => "sheddable",
        }
    }
}

/// The HTTP version spoken to a pool's servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamProtocol {
    /// HTTP/1.1 only.
    Http1,
    /// HTTP/2 only (gRPC upstreams need it).
    H2,
    /// Whatever the server prefers by ALPN, h2 or HTTP/1.1 (TLS only).
    Auto,
}

/// What an admin token may do.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum AdminRole {
    /// Read: `GET /admin/*`.
    Read,
    /// Read and write: every `/admin/*` endpoint.
    Write,
}
