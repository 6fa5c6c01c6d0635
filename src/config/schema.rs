//! The YAML schema as written by operators: plain serde structs that reject
//! unknown keys. Nothing here is trusted; `validate` turns it into a policy.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub version: u32,
    #[serde(default)]
    pub policy_version: Option<String>,
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub client_ip: RawClientIp,
    #[serde(default)]
    pub ip_rules: RawIpRules,
    #[serde(default)]
    pub auth: RawAuth,
    #[serde(default)]
    pub plans: UniqueMap<UniqueMap<RawOverride>>,
    #[serde(default)]
    pub limits: UniqueMap<RawLimit>,
    #[serde(default)]
    pub upstreams: UniqueMap<RawUpstream>,
    pub routes: Vec<RawRoute>,
    #[serde(default)]
    pub responses: RawResponses,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<Vec<String>>,
    pub admin_listen: Option<String>,
    pub threads: Option<usize>,
    pub admin_token_env: Option<String>,
    pub shutdown_grace_seconds: Option<u64>,
    pub limits: Option<RawServerLimits>,
    pub timeouts: Option<RawTimeouts>,
    pub encoded_slash: Option<EncodedSlashName>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServerLimits {
    pub max_connections: Option<u64>,
    pub max_header_bytes: Option<u64>,
    pub max_body_bytes: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTimeouts {
    pub header_read_ms: Option<u64>,
    pub keepalive_idle_ms: Option<u64>,
    pub body_read_ms: Option<u64>,
    pub send_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EncodedSlashName {
    Reject,
    Keep,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    #[default]
    Memory,
    Redis,
    RedisCluster,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::RedisCluster => "redis_cluster",
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    #[serde(default)]
    pub backend: Backend,
    #[serde(default)]
    pub urls: Vec<String>,
    pub timeout_ms: Option<u64>,
    pub key_prefix: Option<String>,
    pub key_secret_env: Option<String>,
    pub circuit_breaker: Option<RawBreaker>,
    pub expected_instances: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBreaker {
    pub failure_threshold: Option<u32>,
    pub open_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClientIp {
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    #[serde(default)]
    pub header: HeaderName,
    pub ipv6_prefix: Option<u8>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub enum HeaderName {
    #[default]
    #[serde(rename = "x-forwarded-for")]
    XForwardedFor,
    #[serde(rename = "forwarded")]
    Forwarded,
    #[serde(rename = "x-real-ip")]
    XRealIp,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawIpRules {
    #[serde(default)]
    pub deny: Vec<String>,
    #[serde(default)]
    pub allow: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    pub header: Option<String>,
    pub keys_file: Option<String>,
    #[serde(default)]
    pub keys: Vec<RawKey>,
    #[serde(default)]
    pub forward_key: bool,
}

/// The schema of `auth.keys_file`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKeysFile {
    pub keys: Vec<RawKey>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    pub id: String,
    pub tenant: String,
    pub plan: Option<String>,
    pub sha256: String,
}

/// A plan's replacement numbers for one limit.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOverride {
    pub capacity: Option<f64>,
    pub refill_per_second: Option<f64>,
    pub limit: Option<f64>,
    pub window_seconds: Option<f64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    PreAuth,
    #[default]
    Request,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dimension {
    Ip,
    Credential,
    Tenant,
    Route,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmName {
    #[default]
    TokenBucket,
    Gcra,
    FixedWindow,
    SlidingWindow,
    SlidingLog,
}

impl fmt::Display for AlgorithmName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AlgorithmName::TokenBucket => "token_bucket",
            AlgorithmName::Gcra => "gcra",
            AlgorithmName::FixedWindow => "fixed_window",
            AlgorithmName::SlidingWindow => "sliding_window",
            AlgorithmName::SlidingLog => "sliding_log",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    Local,
    Shared,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    #[serde(default)]
    pub scope: Scope,
    #[serde(default)]
    pub key: Vec<Dimension>,
    #[serde(default)]
    pub algorithm: AlgorithmName,
    pub capacity: Option<f64>,
    pub refill_per_second: Option<f64>,
    pub limit: Option<f64>,
    pub window_seconds: Option<f64>,
    pub store: Option<Placement>,
    #[serde(default)]
    pub on_store_error: OnStoreError,
    #[serde(default)]
    pub mode: Mode,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub servers: Vec<String>,
    pub max_in_flight: Option<u32>,
    pub queue: Option<RawQueue>,
    pub connect_timeout_ms: Option<u64>,
    pub read_timeout_ms: Option<u64>,
    pub health_check: Option<RawHealthCheck>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealthCheck {
    pub interval_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    pub path: Option<String>,
    pub healthy_after: Option<u32>,
    pub unhealthy_after: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawQueue {
    pub max_waiting: Option<u32>,
    pub timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    #[default]
    Required,
    None,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: String,
    #[serde(default)]
    pub methods: Vec<String>,
    pub path: String,
    #[serde(default)]
    pub auth: AuthMode,
    pub upstream: Option<String>,
    pub respond: Option<RawRespond>,
    pub cost: Option<f64>,
    #[serde(default)]
    pub limits: Vec<String>,
    pub max_body_bytes: Option<u64>,
    #[serde(default)]
    pub upgrade: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRespond {
    pub status: u16,
    #[serde(default)]
    pub body: String,
    pub content_type: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RateLimitHeaders {
    #[default]
    None,
    Draft,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawResponses {
    #[serde(default)]
    pub ratelimit_headers: RateLimitHeaders,
}
