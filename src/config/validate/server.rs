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
    let threads = c.bounded(
        "server.threads",
        raw.threads.or(Some(default_threads)),
        bounds::THREADS,
    );
    let grace = c.bounded(
        "server.shutdown_grace_seconds",
        raw.shutdown_grace_seconds,
        bounds::SHUTDOWN_GRACE_SECONDS,
    );
    if let Some(env) = &raw.admin_token_env {
        env_name(c, "server.admin_token_env", env);
    }
    let tracing = raw.tracing.and_then(|t| tracing(c, t));
    let limits = raw.limits.unwrap_or_default();
    let buffered_bytes_total = c.bounded(
        "server.limits.buffered_bytes_total",
        limits.buffered_bytes_total,
        bounds::BUFFERED_BYTES_TOTAL,
    );
    ServerSettings {
        listen,
        admin_listen,
        admin_max_connections: c.bounded(
            "server.admin_max_connections",
            raw.admin_max_connections,
            bounds::ADMIN_MAX_CONNECTIONS,
        ) as usize,
        admin_max_connections_per_ip: c.bounded(
            "server.admin_max_connections_per_ip",
            raw.admin_max_connections_per_ip,
            bounds::ADMIN_MAX_CONNECTIONS_PER_IP,
        ) as usize,
        http2_max_streams: c.bounded(
            "server.http2_max_streams",
            raw.http2_max_streams,
            bounds::HTTP2_MAX_STREAMS,
        ),
        log_client_errors_per_s: c.bounded(
            "server.log_client_errors_per_s",
            raw.log_client_errors_per_s,
            bounds::LOG_CLIENT_ERRORS_PER_S,
        ),
        buffered_bytes_total,
        threads,
        admin_token_env: raw.admin_token_env,
        admin_tokens: admin_tokens(c, raw.admin_tokens),
        admin_refresh: Duration::from_millis(c.bounded(
            "server.admin_refresh_ms",
            raw.admin_refresh_ms,
            bounds::ADMIN_REFRESH_MS,
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
        watch: raw.watch.unwrap_or(true),
        access_log: raw.access_log.map(|a| access_log(c, a)),
        tracing,
        tls: raw.tls.map(|t| tls(c, t, base)),
        edge: EdgeSettings {
            http2: raw.http2,
            path: PathRules {
                encoded_slash: match raw.encoded_slash {
                    Some(EncodedSlashName::Keep) => EncodedSlash::Keep,
                    Some(EncodedSlashName::Reject) | None => EncodedSlash::Reject,
                },
                params: raw.path.params.unwrap_or_default(),
                trailing_dots: raw.path.trailing_dots.unwrap_or_default(),
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
        c.fail("server.tls", e.to_string());
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

/// `server.tracing`: an OTLP/HTTP endpoint, resolved now, and a sample.
pub(super) fn tracing(c: &mut Checker, raw: RawTracing) -> Option<crate::trace::Exporting> {
    let sample = match raw.sample {
        None => 1.0,
        Some(s) if (0.0..=1.0).contains(&s) => s,
        Some(s) => {
            c.fail(
                "server.tracing.sample",
                format!("must be from 0 to 1, got {s}"),
            );
            1.0
        }
    };
    let path = "server.tracing.otlp_endpoint";
    let Ok(url) = url::Url::parse(&raw.otlp_endpoint) else {
        c.fail(path, format!("{:?} is not a URL", raw.otlp_endpoint));
        return None;
    };
    if url.scheme() != "http" {
        c.fail(path, "must be http:// (a collector beside the gateway)");
        return None;
    }
    let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
        c.fail(path, "needs a host");
        return None;
    };
    // Resolved now only to refuse a name that does not resolve: the
    // exporter's client resolves it again when it connects.
    if (host, port)
        .to_socket_addrs()
        .map_or(true, |mut a| a.next().is_none())
    {
        c.fail(path, format!("cannot resolve {host}:{port}"));
        return None;
    }
    Some(crate::trace::Exporting {
        url: raw.otlp_endpoint,
        sample_ppm: (sample * 1e6).round() as u32,
    })
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

/// `server.limits` and `server.timeouts`, with the edge's defaults
/// ([`crate::edge::defaults`]).
pub(super) fn edge(
    c: &mut Checker,
    limits: RawServerLimits,
    timeouts: RawTimeouts,
) -> EdgeSettings {
    let ms = |c: &mut Checker, name: &str, value: Option<u64>, bound: Bound| {
        Duration::from_millis(c.bounded(&format!("server.timeouts.{name}"), value, bound))
    };
    EdgeSettings {
        max_connections: c.bounded(
            "server.limits.max_connections",
            limits.max_connections,
            bounds::MAX_CONNECTIONS,
        ) as usize,
        max_connections_per_ip: c.bounded(
            "server.limits.max_connections_per_ip",
            limits.max_connections_per_ip,
            bounds::MAX_CONNECTIONS_PER_IP,
        ) as usize,
        max_header_bytes: c.bounded(
            "server.limits.max_header_bytes",
            limits.max_header_bytes,
            bounds::MAX_HEADER_BYTES,
        ) as usize,
        max_body_bytes: c.bounded(
            "server.limits.max_body_bytes",
            limits.max_body_bytes,
            bounds::MAX_BODY_BYTES,
        ),
        header_read: ms(
            c,
            "header_read_ms",
            timeouts.header_read_ms,
            bounds::HEADER_READ_MS,
        ),
        keepalive_idle: ms(
            c,
            "keepalive_idle_ms",
            timeouts.keepalive_idle_ms,
            bounds::KEEPALIVE_IDLE_MS,
        ),
        body_read: ms(
            c,
            "body_read_ms",
            timeouts.body_read_ms,
            bounds::BODY_READ_MS,
        ),
        send: ms(c, "send_ms", timeouts.send_ms, bounds::SEND_MS),
        buffer_body_bytes: c.bounded(
            "server.limits.buffer_body_bytes",
            limits.buffer_body_bytes,
            bounds::BUFFER_BODY_BYTES,
        ),
        body_min_rate: c.bounded(
            "server.timeouts.body_min_rate",
            timeouts.body_min_rate,
            bounds::BODY_MIN_RATE,
        ),
        body_grace: ms(
            c,
            "body_grace_ms",
            timeouts.body_grace_ms,
            bounds::BODY_GRACE_MS,
        ),
        body_total: ms(
            c,
            "body_total_ms",
            timeouts.body_total_ms,
            bounds::BODY_TOTAL_MS,
        ),
        send_min_rate: c.bounded(
            "server.limits.send_min_rate",
            limits.send_min_rate,
            bounds::SEND_MIN_RATE,
        ),
        path: PathRules::default(),
        http2: false,
    }
}
