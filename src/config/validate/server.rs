//! `server`: listeners, threads, TLS, the access log and the edge's bounds.

use super::*;

pub(super) fn socket_addr(c: &mut Checker, path: &str, text: &str) -> Option<SocketAddr> {
    match text.parse() {
        Ok(addr) => Some(addr),
        Err(_) => {
            c.fail(path, format!("{text:?} is not an ip:port address"));
            None
        }
    }
}

pub(super) fn server(c: &mut Checker, raw: RawServer, base: &Path) -> ServerSettings {
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
        admin_tokens: admin_tokens(c, raw.admin_tokens),
        admin_refresh: Duration::from_millis(c.range(
            "server.admin_refresh_ms",
            raw.admin_refresh_ms.unwrap_or(1_000),
            100,
            60_000,
        )),
        audit_log: raw.audit_log.and_then(|a| match a.path.as_str() {
            "" => {
                c.fail(
                    "server.audit_log.path",
                    "needs a file (or leave out audit_log for the process log)",
                );
                None
            }
            path => Some(base.join(path)),
        }),
        shutdown_grace: Duration::from_secs(grace),
        access_log: raw.access_log.map(|a| access_log(c, a)),
        tls: raw.tls.map(|t| tls(c, t, base)),
        edge: EdgeSettings {
            http2: raw.http2,
            path: PathRules {
                encoded_slash: match raw.encoded_slash {
                    Some(EncodedSlashName::Keep) => EncodedSlash::Keep,
                    Some(EncodedSlashName::Reject) | None => EncodedSlash::Reject,
                },
                params: raw.path.params.unwrap_or_default(),
                trailing_slash: raw.path.trailing_slash.unwrap_or_default(),
                case: raw.path.case.unwrap_or_default(),
            },
            ..edge(c, limits, raw.timeouts.unwrap_or_default())
        },
    }
}

/// `server.tls`: the listeners, and a certificate and key that load.
pub(super) fn tls(c: &mut Checker, raw: RawTls, base: &Path) -> TlsSettings {
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

/// `server.admin_tokens`: unique names, SHA-256 digests.
fn admin_tokens(c: &mut Checker, raw: Vec<RawAdminToken>) -> Vec<AdminToken> {
    let mut names = HashSet::new();
    raw.into_iter()
        .enumerate()
        .filter_map(|(i, t)| {
            let path = format!("server.admin_tokens[{i}]");
            c.name(&format!("{path}.name"), &t.name);
            if t.name == "env" || !names.insert(t.name.clone()) {
                c.fail(
                    format!("{path}.name"),
                    format!(
                        "{:?} is taken (by another token, or `env` by admin_token_env)",
                        t.name
                    ),
                );
            }
            let Some(digest) = parse_digest(&t.sha256) else {
                c.fail(
                    format!("{path}.sha256"),
                    "must be 64 hex digits: the SHA-256 of the token (tollgate hash-key)",
                );
                return None;
            };
            Some(AdminToken {
                name: t.name.into(),
                digest,
                role: t.role,
            })
        })
        .collect()
}

/// `server.access_log`.
pub(super) fn access_log(c: &mut Checker, raw: RawAccessLog) -> AccessLogSettings {
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

/// `server.limits` and `server.timeouts`, with the defaults of DESIGN §11.
pub(super) fn edge(
    c: &mut Checker,
    limits: RawServerLimits,
    timeouts: RawTimeouts,
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
        path: PathRules::default(),
        http2: false,
    }
}
