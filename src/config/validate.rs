//! Raw schema → [`Policy`]. Every check names the path of the offending
//! value; all problems of a file are reported together.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;

use super::policy::*;
use super::schema::*;
use super::{load_keys_file, ConfigError, Problem};
use crate::access_log::{AccessLogSettings, Destination};
use crate::auth::{parse_digest, Credential, KeyTable};
use crate::client_ip::{ClientIpConfig, ForwardHeader};
use crate::edge::{EdgeSettings, EncodedSlash};
use crate::limits::algorithm::{Bucket, Params, Quota, Window, MICRO};
use crate::limits::redis::redacted;
use crate::limits::LeaseTerms;
use crate::routes::{HostPattern, PathTemplate, Router};
use crate::tls::{Certificate, TlsSettings};

/// Capacities, limits and rates are bounded by this.
const MAX_AMOUNT: f64 = 1e9;
/// Sliding logs keep one entry per admitted request.
const MAX_LOG_LIMIT: f64 = 10_000.0;
/// Longest window: one day.
const MAX_WINDOW_SECONDS: f64 = 86_400.0;
/// The largest `max_body_bytes`: 1 TiB.
const MAX_BODY_BYTES: u64 = 1 << 40;
/// The most `server.limits.buffer_body_bytes` may be: what Pingora's retry
/// buffer holds, so that a body read whole can be sent on.
const MAX_BUFFER_BODY_BYTES: u64 = 65_536;
/// Products the Redis scripts compute must stay exact in a Lua double.
const MAX_EXACT: u64 = 1 << 53;

/// Limit names as declared: the limit's id when it validated, and its
/// algorithm (which decides what a plan override must contain).
type LimitNames = HashMap<String, (Option<LimitId>, AlgorithmName)>;

/// Collects problems while walking the raw document.
struct Checker {
    problems: Vec<Problem>,
}

impl Checker {
    fn fail(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    /// A finite number in `(0, max]`.
    fn amount(&mut self, path: &str, value: f64, max: f64) -> Option<f64> {
        if !value.is_finite() {
            self.fail(path, format!("must be a finite number, got {value}"));
        } else if value <= 0.0 {
            self.fail(path, format!("must be positive, got {value}"));
        } else if value > max {
            self.fail(path, format!("must be at most {max}, got {value}"));
        } else {
            return Some(value);
        }
        None
    }

    /// A whole number in `[1, max]`.
    fn whole(&mut self, path: &str, value: f64, max: f64) -> Option<u64> {
        let v = self.amount(path, value, max)?;
        if v.fract() != 0.0 {
            self.fail(path, format!("must be a whole number, got {v}"));
            return None;
        }
        Some(v as u64)
    }

    fn range<T: PartialOrd + std::fmt::Display + Copy>(
        &mut self,
        path: &str,
        value: T,
        min: T,
        max: T,
    ) -> T {
        if value < min || value > max {
            self.fail(
                path,
                format!("must be between {min} and {max}, got {value}"),
            );
        }
        value
    }

    fn required<T>(&mut self, path: &str, what: &str, value: Option<T>) -> Option<T> {
        if value.is_none() {
            self.fail(path, format!("missing `{what}`"));
        }
        value
    }

    fn name(&mut self, path: &str, name: &str) {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !ok {
            self.fail(
                path,
                format!("name {name:?} must be 1-64 characters of A-Z a-z 0-9 - _ ."),
            );
        }
    }
}

pub(super) fn policy(raw: RawConfig, file: &Path, base: &Path) -> Result<Policy, ConfigError> {
    let mut c = Checker {
        problems: Vec::new(),
    };
    if raw.version != 1 {
        c.fail(
            "version",
            format!("unsupported version {} (expected 1)", raw.version),
        );
    }
    let server = server(&mut c, raw.server, base);
    let store = store(&mut c, raw.store);
    let client_ip = client_ip(&mut c, raw.client_ip);
    let ip_rules = IpRules {
        deny: nets(&mut c, "ip_rules.deny", &raw.ip_rules.deny),
        allow: nets(&mut c, "ip_rules.allow", &raw.ip_rules.allow),
    };
    let memory = store.backend == Backend::Memory;
    let (limits, limit_ids) = limits(&mut c, raw.limits, memory);
    let (plans, plan_ids) = plans(&mut c, raw.plans, &limits, &limit_ids);
    let auth = auth(&mut c, raw.auth, base, &plan_ids)?;
    let (upstreams, pool_ids) = upstreams(&mut c, raw.upstreams, base);
    let ctx = RouteContext {
        limits: &limits,
        limit_ids: &limit_ids,
        plans: &plans,
        pool_ids: &pool_ids,
    };
    let routes = routes(&mut c, raw.routes, &ctx, server.edge.max_body_bytes);
    if !c.problems.is_empty() {
        return Err(ConfigError::Invalid {
            file: file.display().to_string(),
            problems: c.problems,
        });
    }
    Ok(Policy {
        file: file.to_path_buf(),
        policy_version: raw.policy_version.unwrap_or_else(|| "unversioned".into()),
        server,
        store,
        client_ip,
        ip_rules,
        auth,
        plans,
        limits,
        upstreams,
        routes,
        ratelimit_headers: raw.responses.ratelimit_headers == RateLimitHeaders::Draft,
    })
}

fn socket_addr(c: &mut Checker, path: &str, text: &str) -> Option<SocketAddr> {
    match text.parse() {
        Ok(addr) => Some(addr),
        Err(_) => {
            c.fail(path, format!("{text:?} is not an ip:port address"));
            None
        }
    }
}

fn server(c: &mut Checker, raw: RawServer, base: &Path) -> ServerSettings {
    let listen_raw = raw.listen.unwrap_or_else(|| vec!["0.0.0.0:8080".into()]);
    if listen_raw.is_empty() {
        c.fail("server.listen", "needs at least one address");
    }
    let listen = listen_raw
        .iter()
        .enumerate()
        .filter_map(|(i, a)| socket_addr(c, &format!("server.listen[{i}]"), a))
        .collect();
    let admin_listen = raw
        .admin_listen
        .and_then(|a| socket_addr(c, "server.admin_listen", &a));
    let default_threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = c.range(
        "server.threads",
        raw.threads.unwrap_or(default_threads),
        1,
        256,
    );
    let grace = c.range(
        "server.shutdown_grace_seconds",
        raw.shutdown_grace_seconds.unwrap_or(10),
        0,
        3600,
    );
    if let Some(env) = &raw.admin_token_env {
        env_name(c, "server.admin_token_env", env);
    }
    let limits = raw.limits.unwrap_or_default();
    let buffered_bytes_total = c.range(
        "server.limits.buffered_bytes_total",
        limits.buffered_bytes_total.unwrap_or(256 << 20),
        0,
        16 << 30,
    );
    ServerSettings {
        listen,
        admin_listen,
        admin_max_connections: c.range(
            "server.admin_max_connections",
            raw.admin_max_connections.unwrap_or(256),
            1,
            100_000,
        ) as usize,
        http2_max_streams: c.range(
            "server.http2_max_streams",
            raw.http2_max_streams.unwrap_or(100),
            1,
            10_000,
        ),
        log_client_errors_per_s: c.range(
            "server.log_client_errors_per_s",
            raw.log_client_errors_per_s.unwrap_or(1),
            0,
            10_000,
        ),
        buffered_bytes_total,
        threads,
        admin_token_env: raw.admin_token_env,
        shutdown_grace: Duration::from_secs(grace),
        access_log: raw.access_log.map(|a| access_log(c, a)),
        tls: raw.tls.map(|t| tls(c, t, base)),
        edge: EdgeSettings {
            http2: raw.http2,
            ..edge(
                c,
                limits,
                raw.timeouts.unwrap_or_default(),
                raw.encoded_slash,
            )
        },
    }
}

/// `server.tls`: the listeners, and a certificate and key that load.
fn tls(c: &mut Checker, raw: RawTls, base: &Path) -> TlsSettings {
    if raw.listen.is_empty() {
        c.fail("server.tls.listen", "needs at least one address");
    }
    let listen = raw
        .listen
        .iter()
        .enumerate()
        .filter_map(|(i, a)| socket_addr(c, &format!("server.tls.listen[{i}]"), a))
        .collect();
    let (cert_file, key_file) = (base.join(&raw.cert_file), base.join(&raw.key_file));
    if let Err(e) = Certificate::load(&cert_file, &key_file) {
        c.fail("server.tls", e);
    }
    TlsSettings {
        listen,
        cert_file,
        key_file,
    }
}

/// `server.access_log`.
fn access_log(c: &mut Checker, raw: RawAccessLog) -> AccessLogSettings {
    let destination = match raw.path.as_str() {
        "stdout" => Destination::Stdout,
        "" => {
            c.fail("server.access_log.path", "needs a file or stdout");
            Destination::Stdout
        }
        path => Destination::File(path.into()),
    };
    let sample = raw
        .sample
        .and_then(|s| c.amount("server.access_log.sample", s, 1.0))
        .unwrap_or(1.0);
    AccessLogSettings {
        destination,
        every: (1.0 / sample).round().max(1.0) as u64,
    }
}

/// `server.limits`, `server.timeouts` and `server.encoded_slash`, with the
/// defaults of DESIGN §11.
fn edge(
    c: &mut Checker,
    limits: RawServerLimits,
    timeouts: RawTimeouts,
    slash: Option<EncodedSlashName>,
) -> EdgeSettings {
    let d = EdgeSettings::default();
    let ms = |c: &mut Checker, name: &str, value: Option<u64>, default: Duration| {
        let path = format!("server.timeouts.{name}");
        let v = c.range(
            &path,
            value.unwrap_or(default.as_millis() as u64),
            1,
            3_600_000,
        );
        Duration::from_millis(v)
    };
    EdgeSettings {
        max_connections: c.range(
            "server.limits.max_connections",
            limits.max_connections.unwrap_or(d.max_connections as u64),
            1,
            1_000_000,
        ) as usize,
        max_header_bytes: c.range(
            "server.limits.max_header_bytes",
            limits.max_header_bytes.unwrap_or(d.max_header_bytes as u64),
            1_024,
            1_048_576,
        ) as usize,
        max_body_bytes: c.range(
            "server.limits.max_body_bytes",
            limits.max_body_bytes.unwrap_or(d.max_body_bytes),
            0,
            MAX_BODY_BYTES,
        ),
        header_read: ms(c, "header_read_ms", timeouts.header_read_ms, d.header_read),
        keepalive_idle: ms(
            c,
            "keepalive_idle_ms",
            timeouts.keepalive_idle_ms,
            d.keepalive_idle,
        ),
        body_read: ms(c, "body_read_ms", timeouts.body_read_ms, d.body_read),
        send: ms(c, "send_ms", timeouts.send_ms, d.send),
        buffer_body_bytes: c.range(
            "server.limits.buffer_body_bytes",
            limits.buffer_body_bytes.unwrap_or(d.buffer_body_bytes),
            0,
            MAX_BUFFER_BODY_BYTES,
        ),
        body_min_rate: c.range(
            "server.timeouts.body_min_rate",
            timeouts.body_min_rate.unwrap_or(d.body_min_rate),
            1,
            1 << 30,
        ),
        body_grace: ms(c, "body_grace_ms", timeouts.body_grace_ms, d.body_grace),
        body_total: ms(c, "body_total_ms", timeouts.body_total_ms, d.body_total),
        encoded_slash: match slash {
            Some(EncodedSlashName::Keep) => EncodedSlash::Keep,
            Some(EncodedSlashName::Reject) | None => EncodedSlash::Reject,
        },
        http2: false,
    }
}

fn env_name(c: &mut Checker, path: &str, name: &str) {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        c.fail(
            path,
            format!("{name:?} is not an environment variable name"),
        );
    }
}

fn store(c: &mut Checker, raw: RawStore) -> StoreSettings {
    if raw.backend != Backend::Memory {
        if raw.urls.is_empty() {
            c.fail(
                "store.urls",
                format!("backend {} needs at least one url", raw.backend),
            );
        }
        if raw.backend == Backend::Redis && raw.urls.len() > 1 {
            c.fail(
                "store.urls",
                format!(
                    "backend redis takes one url, got {}; several seed nodes are for redis_cluster",
                    raw.urls.len()
                ),
            );
        }
        for (i, url) in raw.urls.iter().enumerate() {
            if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                c.fail(
                    format!("store.urls[{i}]"),
                    format!("{:?} is not a redis:// or rediss:// url", redacted(url)),
                );
            }
        }
    }
    match (&raw.master_name, raw.backend) {
        (None, Backend::RedisSentinel) => c.fail(
            "store.master_name",
            "backend redis_sentinel needs the primary's name at the sentinels",
        ),
        (Some(name), Backend::RedisSentinel) => {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic()) {
                c.fail(
                    "store.master_name",
                    format!("{name:?} is not a sentinel master name"),
                );
            }
        }
        (Some(_), backend) => c.fail(
            "store.master_name",
            format!("is for backend redis_sentinel, not {backend}"),
        ),
        (None, _) => {}
    }
    let key_secret_env = raw
        .key_secret_env
        .unwrap_or_else(|| "TOLLGATE_KEY_SECRET".into());
    env_name(c, "store.key_secret_env", &key_secret_env);
    let breaker = raw.circuit_breaker.unwrap_or(RawBreaker {
        failure_threshold: None,
        open_ms: None,
    });
    StoreSettings {
        backend: raw.backend,
        urls: raw.urls,
        master_name: raw.master_name,
        timeout: Duration::from_millis(c.range(
            "store.timeout_ms",
            raw.timeout_ms.unwrap_or(20),
            1,
            10_000,
        )),
        max_pending: c.range(
            "store.max_pending",
            raw.max_pending.unwrap_or(4_096),
            1,
            1_000_000,
        ) as usize,
        key_prefix: raw.key_prefix.unwrap_or_else(|| "tg:".into()),
        key_secret_env,
        failure_threshold: c.range(
            "store.circuit_breaker.failure_threshold",
            breaker.failure_threshold.unwrap_or(5),
            1,
            1_000,
        ),
        open_for: Duration::from_millis(c.range(
            "store.circuit_breaker.open_ms",
            breaker.open_ms.unwrap_or(1_000),
            1,
            600_000,
        )),
        expected_instances: c.range(
            "store.expected_instances",
            raw.expected_instances.unwrap_or(1),
            1,
            10_000,
        ),
    }
}

fn nets(c: &mut Checker, path: &str, raw: &[String]) -> Vec<IpNet> {
    raw.iter()
        .enumerate()
        .filter_map(|(i, text)| {
            let parsed = text
                .parse::<IpNet>()
                .ok()
                .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from));
            if parsed.is_none() {
                c.fail(
                    format!("{path}[{i}]"),
                    format!("{text:?} is not an IP network"),
                );
            }
            parsed.map(|n| canonical_net(n.trunc()))
        })
        .collect()
}

/// An IPv4-mapped IPv6 network (`::ffff:10.0.0.0/104`) is its IPv4
/// network: addresses are compared in their canonical form, so the mapped
/// one could never match.
fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(net, IpNet::V4),
            None => net,
        },
        _ => net,
    }
}

fn client_ip(c: &mut Checker, raw: RawClientIp) -> ClientIpConfig {
    ClientIpConfig {
        trusted_proxies: nets(c, "client_ip.trusted_proxies", &raw.trusted_proxies),
        header: match raw.header {
            HeaderName::XForwardedFor => ForwardHeader::XForwardedFor,
            HeaderName::Forwarded => ForwardHeader::Forwarded,
            HeaderName::XRealIp => ForwardHeader::XRealIp,
        },
        ipv6_prefix: c.range(
            "client_ip.ipv6_prefix",
            raw.ipv6_prefix.unwrap_or(64),
            1,
            128,
        ),
    }
}

/// Turns a limit's (or an override's) numbers into algorithm parameters.
fn params(
    c: &mut Checker,
    path: &str,
    algorithm: AlgorithmName,
    n: &RawOverride,
) -> Option<Params> {
    if algorithm == AlgorithmName::Quota {
        return quota(c, path, n);
    }
    if n.period.is_some() {
        c.fail(
            path,
            format!("`period` does not apply to {algorithm}; it is for quota"),
        );
    }
    let bucket = matches!(algorithm, AlgorithmName::TokenBucket | AlgorithmName::Gcra);
    let (wanted, unwanted) = if bucket {
        (
            ["capacity", "refill_per_second"],
            [("limit", n.limit), ("window_seconds", n.window_seconds)],
        )
    } else {
        (
            ["limit", "window_seconds"],
            [
                ("capacity", n.capacity),
                ("refill_per_second", n.refill_per_second),
            ],
        )
    };
    for (field, value) in unwanted {
        if value.is_some() {
            c.fail(
                path,
                format!(
                    "`{field}` does not apply to {algorithm}; it takes `{}` and `{}`",
                    wanted[0], wanted[1]
                ),
            );
        }
    }
    if bucket {
        let capacity = c.required(path, "capacity", n.capacity);
        let rate = c.required(path, "refill_per_second", n.refill_per_second);
        let capacity = c.amount(&format!("{path}.capacity"), capacity?, MAX_AMOUNT)?;
        let rate = c.amount(&format!("{path}.refill_per_second"), rate?, MAX_AMOUNT)?;
        let per_ms = (rate * 1000.0).round() as u64;
        if per_ms == 0 {
            c.fail(
                format!("{path}.refill_per_second"),
                format!("must be at least 0.001, got {rate}"),
            );
            return None;
        }
        if capacity < 1.0 {
            c.fail(
                format!("{path}.capacity"),
                format!("must be at least 1, got {capacity}"),
            );
            return None;
        }
        let b = Bucket {
            capacity: (capacity * MICRO as f64).round() as u64,
            per_ms,
        };
        Some(if algorithm == AlgorithmName::Gcra {
            Params::Gcra(b)
        } else {
            Params::TokenBucket(b)
        })
    } else {
        let limit = c.required(path, "limit", n.limit);
        let seconds = c.required(path, "window_seconds", n.window_seconds);
        let max = if algorithm == AlgorithmName::SlidingLog {
            MAX_LOG_LIMIT
        } else {
            MAX_AMOUNT
        };
        let limit = c.whole(&format!("{path}.limit"), limit?, max)?;
        let seconds = c.amount(
            &format!("{path}.window_seconds"),
            seconds?,
            MAX_WINDOW_SECONDS,
        )?;
        let window_ms = (seconds * 1000.0).round().max(1.0) as u64;
        if algorithm == AlgorithmName::SlidingWindow && limit * window_ms >= MAX_EXACT {
            c.fail(
                path,
                format!(
                    "limit × window in ms must stay below 2^53, got {}",
                    limit * window_ms
                ),
            );
            return None;
        }
        let w = Window { limit, window_ms };
        Some(match algorithm {
            AlgorithmName::FixedWindow => Params::FixedWindow(w),
            AlgorithmName::SlidingWindow => Params::SlidingWindow(w),
            _ => Params::SlidingLog(w),
        })
    }
}

fn limits(c: &mut Checker, raw: UniqueMap<RawLimit>, memory: bool) -> (Vec<Limit>, LimitNames) {
    let mut out = Vec::new();
    let mut ids = HashMap::new();
    for (name, l) in raw.0 {
        let path = format!("limits.{name}");
        c.name(&path, &name);
        let mut key = KeyDims::default();
        for (i, dim) in l.key.iter().enumerate() {
            let slot = match dim {
                Dimension::Ip => &mut key.ip,
                Dimension::Credential => &mut key.credential,
                Dimension::Tenant => &mut key.tenant,
                Dimension::Route => &mut key.route,
            };
            if std::mem::replace(slot, true) {
                c.fail(
                    format!("{path}.key[{i}]"),
                    format!("duplicate key dimension {dim:?}"),
                );
            }
        }
        if l.scope == Scope::PreAuth && (key.credential || key.tenant) {
            c.fail(
                format!("{path}.key"),
                "a pre_auth limit runs before authentication: its key may only use ip and route",
            );
        }
        let numbers = RawOverride {
            capacity: l.capacity,
            refill_per_second: l.refill_per_second,
            limit: l.limit,
            window_seconds: l.window_seconds,
            period: l.period,
        };
        let Some(params) = params(c, &path, l.algorithm, &numbers) else {
            // Known but invalid: references to it are not a second error.
            ids.insert(name, (None, l.algorithm));
            continue;
        };
        let lease = lease(c, &path, &l, &params);
        let max_delay_ms = delay(c, &path, &l, &params);
        ids.insert(name.clone(), (Some(out.len()), l.algorithm));
        out.push(Limit {
            name: name.into(),
            scope: l.scope,
            key,
            params,
            local: memory || l.store.unwrap_or(Placement::Shared) == Placement::Local,
            on_store_error: l.on_store_error,
            mode: l.mode,
            lease,
            max_delay_ms,
        });
    }
    (out, ids)
}

/// `on_limit: delay` and its bound, for the algorithms that can schedule an
/// admission ahead: a bucket going into debt, a GCRA's arrival time.
fn delay(c: &mut Checker, path: &str, l: &RawLimit, params: &Params) -> u64 {
    match (l.on_limit, l.max_delay_ms) {
        (OnLimit::Reject, None) => 0,
        (OnLimit::Reject, Some(_)) => {
            c.fail(
                format!("{path}.max_delay_ms"),
                "only read with on_limit: delay",
            );
            0
        }
        (OnLimit::Delay, None) => {
            c.fail(
                format!("{path}.max_delay_ms"),
                "on_limit: delay needs max_delay_ms, the longest a request is held",
            );
            0
        }
        (OnLimit::Delay, Some(ms)) => {
            if !matches!(params, Params::TokenBucket(_) | Params::Gcra(_)) {
                c.fail(
                    format!("{path}.on_limit"),
                    "delay schedules an admission ahead, which token_bucket and gcra can; \
                     a window's count belongs to the window it is made in",
                );
            }
            if l.sync == LimitSync::Lease {
                c.fail(
                    format!("{path}.on_limit"),
                    "a leased limit admits from what an instance holds: use sync: exact to delay",
                );
            }
            c.range(&format!("{path}.max_delay_ms"), ms, 1, 60_000)
        }
    }
}

/// A calendar quota: `limit` and `period`, nothing else.
fn quota(c: &mut Checker, path: &str, n: &RawOverride) -> Option<Params> {
    for (field, value) in [
        ("capacity", n.capacity),
        ("refill_per_second", n.refill_per_second),
        ("window_seconds", n.window_seconds),
    ] {
        if value.is_some() {
            c.fail(
                path,
                format!("`{field}` does not apply to quota; it takes `limit` and `period`"),
            );
        }
    }
    let limit = c.required(path, "limit", n.limit);
    let period = c.required(path, "period", n.period);
    let limit = c.whole(&format!("{path}.limit"), limit?, MAX_AMOUNT)?;
    Some(Params::Quota(Quota {
        limit,
        period: period?,
    }))
}

/// The terms of `sync: lease`, checked against the limit they belong to.
fn lease(c: &mut Checker, path: &str, l: &RawLimit, params: &Params) -> Option<LeaseTerms> {
    let raw = match (l.sync, &l.lease) {
        (LimitSync::Exact, None) => return None,
        (LimitSync::Exact, Some(_)) => {
            c.fail(format!("{path}.lease"), "only read with sync: lease");
            return None;
        }
        (LimitSync::Lease, None) => {
            c.fail(
                format!("{path}.lease"),
                "sync: lease needs lease: { units, ttl_ms }",
            );
            return None;
        }
        (LimitSync::Lease, Some(raw)) => raw,
    };
    if l.store == Some(Placement::Local) {
        c.fail(
            format!("{path}.sync"),
            "a lease is taken from the shared store; a limit with store: local has none",
        );
    }
    if matches!(params, Params::Quota(_)) {
        c.fail(
            format!("{path}.sync"),
            "a quota counts a calendar period; a lease's units would outlive it: use sync: exact",
        );
    }
    if matches!(params, Params::SlidingLog(_)) {
        c.fail(
            format!("{path}.sync"),
            "a sliding_log records the time of each admission, and a lease spends units \
             later than the store charged them: use sliding_window, or sync: exact",
        );
    }
    let capacity = params.quota();
    let units = whole(c, &format!("{path}.lease.units"), raw.units, 1, capacity);
    let ttl_ms = whole(c, &format!("{path}.lease.ttl_ms"), raw.ttl_ms, 10, 60_000);
    Some(LeaseTerms {
        units: units?,
        ttl_ms: ttl_ms?,
    })
}

/// A whole number in `min..=max`, or a problem at `path`.
fn whole(c: &mut Checker, path: &str, value: f64, min: u64, max: u64) -> Option<u64> {
    if value.fract() != 0.0 || value < min as f64 || value > max as f64 {
        c.fail(
            path,
            format!("must be a whole number from {min} to {max}, got {value}"),
        );
        return None;
    }
    Some(value as u64)
}

fn plans(
    c: &mut Checker,
    raw: UniqueMap<UniqueMap<RawOverride>>,
    limits: &[Limit],
    limit_ids: &LimitNames,
) -> (Vec<Plan>, HashMap<String, PlanId>) {
    let mut out = Vec::new();
    let mut ids = HashMap::new();
    for (name, overrides) in raw.0 {
        c.name(&format!("plans.{name}"), &name);
        let mut plan = Plan {
            name: name.clone(),
            overrides: Vec::new(),
        };
        for (limit, numbers) in overrides.0 {
            let path = format!("plans.{name}.{limit}");
            let Some(&(id, algorithm)) = limit_ids.get(&limit) else {
                c.fail(path, format!("unknown limit {limit:?}"));
                continue;
            };
            let Some(id) = id else { continue };
            if limits[id].scope == Scope::PreAuth {
                c.fail(
                    &path,
                    "a pre_auth limit runs before the plan is known and cannot be overridden",
                );
            }
            let mut numbers = numbers;
            if let Params::Quota(q) = limits[id].params {
                // A plan changes a quota's amount; the period is the limit's.
                if numbers.period.is_some() {
                    c.fail(
                        format!("{path}.period"),
                        "a plan changes a quota's limit; its period is the limit's",
                    );
                }
                numbers.period = Some(q.period);
            }
            if let Some(p) = params(c, &path, algorithm, &numbers) {
                plan.overrides.push((id, p));
            }
        }
        ids.insert(name, out.len());
        out.push(plan);
    }
    (out, ids)
}

fn auth(
    c: &mut Checker,
    raw: RawAuth,
    base: &Path,
    plan_ids: &HashMap<String, PlanId>,
) -> Result<AuthSettings, ConfigError> {
    let header_text = raw.header.unwrap_or_else(|| "authorization".into());
    let header = match http::HeaderName::from_bytes(header_text.to_ascii_lowercase().as_bytes()) {
        Ok(h) => h,
        Err(_) => {
            c.fail(
                "auth.header",
                format!("{header_text:?} is not a header name"),
            );
            http::header::AUTHORIZATION
        }
    };
    let mut keys = KeyTable::default();
    let mut ids = HashSet::new();
    add_keys(c, "auth.keys", raw.keys, plan_ids, &mut keys, &mut ids);
    if let Some(file) = raw.keys_file {
        let path: PathBuf = base.join(file);
        match load_keys_file(&path) {
            Ok(extra) => {
                let prefix = format!("{}: keys", path.display());
                add_keys(c, &prefix, extra.keys, plan_ids, &mut keys, &mut ids);
            }
            // A missing file is a problem of this one; a broken one names itself.
            Err(ConfigError::Read { file, source }) => {
                c.fail("auth.keys_file", format!("cannot read {file}: {source}"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(AuthSettings {
        header,
        keys,
        forward_key: raw.forward_key,
    })
}

fn add_keys(
    c: &mut Checker,
    prefix: &str,
    raw: Vec<RawKey>,
    plan_ids: &HashMap<String, PlanId>,
    table: &mut KeyTable,
    ids: &mut HashSet<String>,
) {
    for (i, k) in raw.into_iter().enumerate() {
        let path = format!("{prefix}[{i}]");
        c.name(&format!("{path}.id"), &k.id);
        if k.tenant.is_empty() || k.tenant.len() > 256 {
            c.fail(format!("{path}.tenant"), "must be 1-256 characters");
        }
        if !ids.insert(k.id.clone()) {
            c.fail(
                format!("{path}.id"),
                format!("duplicate credential id {:?}", k.id),
            );
        }
        let plan = k.plan.as_ref().and_then(|p| {
            let id = plan_ids.get(p).copied();
            if id.is_none() {
                c.fail(format!("{path}.plan"), format!("unknown plan {p:?}"));
            }
            id
        });
        let Some(digest) = parse_digest(&k.sha256).filter(|_| k.sha256.len() == 64) else {
            c.fail(
                format!("{path}.sha256"),
                "must be 64 hex digits (the SHA-256 of the raw key; see `tollgate hash-key`)",
            );
            continue;
        };
        let Some(credential) = Credential::new(&k.id, &k.tenant, plan) else {
            c.fail(
                format!("{path}.tenant"),
                "must be printable text: it is sent to the upstream in x-tenant-id",
            );
            continue;
        };
        if !table.insert(digest, credential) {
            c.fail(
                format!("{path}.sha256"),
                "the same key digest is listed twice",
            );
        }
    }
}

fn upstreams(
    c: &mut Checker,
    raw: UniqueMap<RawUpstream>,
    base: &Path,
) -> (Vec<Upstream>, HashMap<String, PoolId>) {
    let mut out = Vec::new();
    let mut ids = HashMap::new();
    for (name, u) in raw.0 {
        let path = format!("upstreams.{name}");
        c.name(&path, &name);
        if u.servers.is_empty() {
            c.fail(format!("{path}.servers"), "needs at least one server");
        }
        let mut servers = Vec::new();
        let mut server_names = Vec::new();
        for (i, s) in u.servers.iter().enumerate() {
            match s.to_socket_addrs().ok().and_then(|mut a| a.next()) {
                Some(addr) if servers.contains(&addr) => c.fail(
                    format!("{path}.servers[{i}]"),
                    format!("duplicate server {s:?}"),
                ),
                Some(addr) => {
                    servers.push(addr);
                    server_names.push(s.clone());
                }
                None => c.fail(
                    format!("{path}.servers[{i}]"),
                    format!("{s:?} is not a resolvable host:port"),
                ),
            }
        }
        let max_in_flight = c.range(
            &format!("{path}.max_in_flight"),
            u.max_in_flight.unwrap_or(256),
            1,
            1_000_000,
        );
        let (waiting, wait_ms) = match u.queue {
            Some(q) => (
                q.max_waiting.unwrap_or(max_in_flight),
                q.timeout_ms.unwrap_or(100),
            ),
            None => (max_in_flight, 100),
        };
        if u.protocol == Some(UpstreamProtocol::Auto) && u.tls.is_none() {
            c.fail(
                format!("{path}.protocol"),
                "auto chooses by ALPN, which needs tls; use http1 or h2 (h2c) on plain HTTP",
            );
        }
        if u.tls.is_some() && u.health_check.as_ref().is_some_and(|h| h.path.is_some()) {
            c.fail(
                format!("{path}.health_check.path"),
                "probes speak plain HTTP; with tls, leave out path (a TCP connect probe)",
            );
        }
        ids.insert(name.clone(), out.len());
        out.push(Upstream {
            name: name.into(),
            servers,
            max_in_flight,
            queue_max_waiting: c.range(&format!("{path}.queue.max_waiting"), waiting, 0, 1_000_000),
            queue_timeout: Duration::from_millis(c.range(
                &format!("{path}.queue.timeout_ms"),
                wait_ms,
                0,
                60_000,
            )),
            connect_timeout: Duration::from_millis(c.range(
                &format!("{path}.connect_timeout_ms"),
                u.connect_timeout_ms.unwrap_or(3_500),
                1,
                60_000,
            )),
            retries: c.range(&format!("{path}.retries"), u.retries.unwrap_or(2), 0, 10),
            protocol: u.protocol.unwrap_or(if u.tls.is_some() {
                UpstreamProtocol::Auto
            } else {
                UpstreamProtocol::Http1
            }),
            tls: u
                .tls
                .map(|t| upstream_tls(c, &path, t, &server_names, base)),
            server_names,
            host_header: match u.host_header.as_deref() {
                None | Some("preserve") => HostHeader::Preserve,
                Some("upstream") => HostHeader::Upstream,
                Some(text) => match http::HeaderValue::from_str(text) {
                    Ok(v) if !text.is_empty() && !text.contains(' ') => HostHeader::Literal(v),
                    _ => {
                        c.fail(
                            format!("{path}.host_header"),
                            format!("{text:?} is not preserve, upstream or a host"),
                        );
                        HostHeader::Preserve
                    }
                },
            },
            read_timeout: Duration::from_millis(c.range(
                &format!("{path}.read_timeout_ms"),
                u.read_timeout_ms.unwrap_or(30_000),
                1,
                3_600_000,
            )),
            health: u
                .health_check
                .map(|h| health_check(c, &format!("{path}.health_check"), h)),
            reserved_critical: reserve(c, &path, u.reserve, max_in_flight),
        });
    }
    (out, ids)
}

/// `upstreams.*.reserve`: the permits only critical routes may take, of
/// `max_in_flight`; at least one is left to the others.
fn reserve(c: &mut Checker, path: &str, raw: Option<RawReserve>, max_in_flight: u32) -> u32 {
    let Some(raw) = raw else { return 0 };
    if !(0.0..1.0).contains(&raw.critical) {
        c.fail(
            format!("{path}.reserve.critical"),
            format!("must be a share from 0 to below 1, got {}", raw.critical),
        );
        return 0;
    }
    ((f64::from(max_in_flight) * raw.critical).round() as u32).min(max_in_flight.saturating_sub(1))
}

/// `upstreams.*.tls`: SNI (the first server's host by default), and the CA
/// file read now.
fn upstream_tls(
    c: &mut Checker,
    path: &str,
    raw: RawUpstreamTls,
    servers: &[String],
    base: &Path,
) -> UpstreamTls {
    let first_host = servers
        .first()
        .map(|s| s.rsplit_once(':').map_or(s.as_str(), |(h, _)| h))
        .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
        .unwrap_or_default();
    let sni = raw.sni.unwrap_or(first_host);
    if rustls::pki_types::ServerName::try_from(sni.as_str()).is_err() {
        c.fail(
            format!("{path}.tls.sni"),
            format!("{sni:?} is not a server name"),
        );
    }
    let ca = raw.ca_file.and_then(|file| {
        use rustls::pki_types::pem::PemObject;
        let file = base.join(file);
        let certs: Result<Vec<_>, _> = rustls::pki_types::CertificateDer::pem_file_iter(&file)
            .and_then(|certs| certs.collect());
        match certs {
            Ok(certs) if !certs.is_empty() => Some(
                certs
                    .into_iter()
                    .map(|der| {
                        pingora::utils::tls::WrappedX509::new(der.to_vec(), |raw| {
                            pingora::utils::tls::parse_x509(raw)
                        })
                    })
                    .collect::<Vec<_>>()
                    .into(),
            ),
            Ok(_) => {
                c.fail(
                    format!("{path}.tls.ca_file"),
                    format!("{}: no certificate", file.display()),
                );
                None
            }
            Err(e) => {
                c.fail(
                    format!("{path}.tls.ca_file"),
                    format!("{}: {e}", file.display()),
                );
                None
            }
        }
    });
    UpstreamTls {
        sni,
        ca,
        verify: raw.verify.unwrap_or(true),
    }
}

fn health_check(c: &mut Checker, path: &str, h: RawHealthCheck) -> HealthCheck {
    if let Some(p) = &h.path {
        if !p.starts_with('/') || p.bytes().any(|b| b.is_ascii_control() || b == b' ') {
            c.fail(
                format!("{path}.path"),
                format!("{p:?} is not an absolute request path"),
            );
        }
    }
    let interval = c.range(
        &format!("{path}.interval_ms"),
        h.interval_ms.unwrap_or(2_000),
        10,
        3_600_000,
    );
    let timeout = c.range(
        &format!("{path}.timeout_ms"),
        h.timeout_ms.unwrap_or(1_000),
        1,
        60_000,
    );
    HealthCheck {
        interval: Duration::from_millis(interval),
        timeout: Duration::from_millis(timeout),
        path: h.path,
        healthy_after: c.range(
            &format!("{path}.healthy_after"),
            h.healthy_after.unwrap_or(1),
            1,
            100,
        ),
        unhealthy_after: c.range(
            &format!("{path}.unhealthy_after"),
            h.unhealthy_after.unwrap_or(2),
            1,
            100,
        ),
    }
}

/// `routes[].cost_from_response`: a header name, a bound no smaller than
/// the estimate, and limits whose charges can be given back in part.
fn cost_from_response<'a>(
    c: &mut Checker,
    path: &str,
    raw: RawCostFromResponse,
    estimate: u64,
    limits: impl Iterator<Item = &'a Limit>,
) -> Option<CostFromResponse> {
    let path = format!("{path}.cost_from_response");
    let header = http::HeaderName::from_bytes(raw.header.as_bytes())
        .map_err(|_| {
            c.fail(
                format!("{path}.header"),
                format!("{:?} is not a header name", raw.header),
            )
        })
        .ok();
    let max = c.whole(&format!("{path}.max"), raw.max, MAX_AMOUNT);
    if let Some(max) = max.filter(|&m| m < estimate) {
        c.fail(
            format!("{path}.max"),
            format!("must be at least the route's cost {estimate} (the estimate), got {max}"),
        );
    }
    for l in limits {
        if matches!(l.params, Params::SlidingLog(_)) {
            c.fail(
                &path,
                format!(
                    "limit {:?} is a sliding_log, whose entries cannot be given back in part",
                    l.name
                ),
            );
        }
    }
    Some(CostFromResponse {
        header: header?,
        max: max?,
        expose: raw.expose,
    })
}

struct RouteContext<'a> {
    limits: &'a [Limit],
    limit_ids: &'a LimitNames,
    plans: &'a [Plan],
    pool_ids: &'a HashMap<String, PoolId>,
}

fn routes(
    c: &mut Checker,
    raw: Vec<RawRoute>,
    ctx: &RouteContext<'_>,
    max_body_bytes: u64,
) -> Router<Route> {
    let mut router = Router::new();
    let mut names = HashSet::new();
    if raw.is_empty() {
        c.fail("routes", "needs at least one route");
    }
    for (i, r) in raw.into_iter().enumerate() {
        let path = format!("routes[{i}]");
        c.name(&format!("{path}.name"), &r.name);
        if !names.insert(r.name.clone()) {
            c.fail(
                format!("{path}.name"),
                format!("duplicate route name {:?}", r.name),
            );
        }
        let template = PathTemplate::parse(&r.path)
            .map_err(|e| c.fail(format!("{path}.path"), e.to_string()))
            .ok();
        let methods = methods(c, &path, &r.methods);
        let hosts = hosts(c, &path, &r.hosts);
        let target = target(c, &path, r.upstream, r.respond, ctx.pool_ids);
        let cost = match r.cost {
            Some(v) => c.whole(&format!("{path}.cost"), v, MAX_AMOUNT).unwrap_or(1),
            None => 1,
        };
        let auth_required = r.auth == AuthMode::Required;
        let (pre_auth, request) = route_limits(c, &path, &r.limits, cost, auth_required, ctx);
        let cost_from_response = r.cost_from_response.and_then(|raw| {
            let limits = pre_auth.iter().chain(&request).map(|&id| &ctx.limits[id]);
            cost_from_response(c, &path, raw, cost, limits)
        });
        let max_body_bytes = c.range(
            &format!("{path}.max_body_bytes"),
            r.max_body_bytes.unwrap_or(max_body_bytes),
            0,
            MAX_BODY_BYTES,
        );
        if let (Some(template), Some(target)) = (template, target) {
            // A name that is no header value already failed the name check,
            // so the policy is rejected before this placeholder could be used.
            let class_header = http::HeaderValue::from_str(&r.name)
                .unwrap_or(http::HeaderValue::from_static("invalid"));
            let route = Route {
                id: router.len(),
                class_header,
                name: r.name.into(),
                auth_required,
                target,
                cost,
                pre_auth,
                request,
                max_body_bytes,
                upgrade: r.upgrade,
                timeout: r.timeout_ms.map(|ms| {
                    Duration::from_millis(c.range(&format!("{path}.timeout_ms"), ms, 1, 3_600_000))
                }),
                priority: r.priority,
                cost_from_response,
            };
            router.push(methods, hosts, template, route);
        }
    }
    router
}

fn hosts(c: &mut Checker, path: &str, raw: &[String]) -> Vec<HostPattern> {
    raw.iter()
        .enumerate()
        .filter_map(|(i, h)| {
            HostPattern::parse(h)
                .map_err(|e| c.fail(format!("{path}.hosts[{i}]"), e))
                .ok()
        })
        .collect()
}

fn methods(c: &mut Checker, path: &str, raw: &[String]) -> Vec<String> {
    raw.iter()
        .enumerate()
        .map(|(i, m)| {
            let upper = m.to_ascii_uppercase();
            if http::Method::from_bytes(upper.as_bytes()).is_err() || upper.is_empty() {
                c.fail(
                    format!("{path}.methods[{i}]"),
                    format!("{m:?} is not an HTTP method"),
                );
            }
            upper
        })
        .collect()
}

fn target(
    c: &mut Checker,
    path: &str,
    upstream: Option<String>,
    respond: Option<RawRespond>,
    pool_ids: &HashMap<String, PoolId>,
) -> Option<Target> {
    match (upstream, respond) {
        (Some(_), Some(_)) => {
            c.fail(path, "a route has either `upstream` or `respond`, not both");
            None
        }
        (None, None) => {
            c.fail(path, "a route needs `upstream` or `respond`");
            None
        }
        (Some(name), None) => {
            let id = pool_ids.get(&name).copied();
            if id.is_none() {
                c.fail(
                    format!("{path}.upstream"),
                    format!("unknown upstream {name:?}"),
                );
            }
            id.map(Target::Upstream)
        }
        (None, Some(r)) => {
            // 1xx and 101 would switch or hold the connection; 204 and 304
            // have no body by definition.
            c.range(&format!("{path}.respond.status"), r.status, 200, 599);
            if matches!(r.status, 204 | 304) && !r.body.is_empty() {
                c.fail(
                    format!("{path}.respond.body"),
                    format!("status {} has no body", r.status),
                );
            }
            let content_type = r
                .content_type
                .unwrap_or_else(|| "text/plain; charset=utf-8".into());
            if content_type.bytes().any(|b| b.is_ascii_control()) || content_type.is_empty() {
                c.fail(
                    format!("{path}.respond.content_type"),
                    "must be a header value without control characters",
                );
            }
            Some(Target::Respond {
                status: r.status,
                body: r.body.into(),
                content_type,
            })
        }
    }
}

fn route_limits(
    c: &mut Checker,
    path: &str,
    names: &[String],
    cost: u64,
    auth_required: bool,
    ctx: &RouteContext<'_>,
) -> (Vec<LimitId>, Vec<LimitId>) {
    let (mut pre, mut req) = (Vec::new(), Vec::new());
    for (i, name) in names.iter().enumerate() {
        let at = format!("{path}.limits[{i}]");
        let Some(&(id, _)) = ctx.limit_ids.get(name) else {
            c.fail(at, format!("unknown limit {name:?}"));
            continue;
        };
        let Some(id) = id else { continue };
        if pre.contains(&id) || req.contains(&id) {
            c.fail(at, format!("limit {name:?} is listed twice"));
            continue;
        }
        let limit = &ctx.limits[id];
        if !auth_required && (limit.key.credential || limit.key.tenant) {
            c.fail(&at, format!("limit {name:?} is keyed by credential or tenant but the route has `auth: none`"));
        }
        let plan_params = ctx
            .plans
            .iter()
            .filter_map(|p| p.params_for(id).map(|x| (Some(&p.name), x)));
        for (plan, params) in std::iter::once((None, limit.params)).chain(plan_params) {
            if cost > params.quota() {
                let whose = plan.map_or(String::new(), |p| format!(" (plan {p:?})"));
                c.fail(&at, format!("route cost {cost} exceeds the capacity {} of limit {name:?}{whose}: it could never be admitted", params.quota()));
            }
        }
        if limit.scope == Scope::PreAuth {
            pre.push(id)
        } else {
            req.push(id)
        }
    }
    (pre, req)
}
