//! `upstreams`: pools, servers, TLS, retries and health checks.

use super::*;

pub(super) fn upstreams(
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
        let max_in_flight = c.bounded(
            &format!("{path}.max_in_flight"),
            u.max_in_flight,
            bounds::MAX_IN_FLIGHT,
        );
        let (waiting, wait_ms) = u
            .queue
            .as_ref()
            .map_or((None, None), |q| (q.max_waiting, q.timeout_ms));
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
        ids.insert(name.clone(), PoolId::new(out.len()));
        out.push(Upstream {
            name: name.into(),
            servers,
            max_in_flight,
            queue_max_waiting: c.bounded(
                &format!("{path}.queue.max_waiting"),
                waiting.or(Some(max_in_flight)),
                bounds::QUEUE_MAX_WAITING,
            ),
            queue_timeout: Duration::from_millis(c.bounded(
                &format!("{path}.queue.timeout_ms"),
                wait_ms,
                bounds::QUEUE_TIMEOUT_MS,
            )),
            connect_timeout: Duration::from_millis(c.bounded(
                &format!("{path}.connect_timeout_ms"),
                u.connect_timeout_ms,
                bounds::CONNECT_TIMEOUT_MS,
            )),
            retries: c.bounded(&format!("{path}.retries"), u.retries, bounds::RETRIES),
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
            read_timeout: Duration::from_millis(c.bounded(
                &format!("{path}.read_timeout_ms"),
                u.read_timeout_ms,
                bounds::READ_TIMEOUT_MS,
            )),
            response_buffer_bytes: c.bounded(
                &format!("{path}.response_buffer_bytes"),
                u.response_buffer_bytes,
                bounds::RESPONSE_BUFFER_BYTES,
            ),
            health: u
                .health_check
                .map(|h| health_check(c, &format!("{path}.health_check"), h)),
            reserved_critical: reserve(c, &path, u.reserve, max_in_flight),
            queue_order: match u.queue.as_ref().and_then(|q| q.fair) {
                Some(Fairness::Tenant) => QueueOrder::FairByTenant,
                None => QueueOrder::Arrival,
            },
            queue_per_tenant_max: u.queue.as_ref().and_then(|q| q.per_tenant_max).map(|n| {
                c.bounded(
                    &format!("{path}.queue.per_tenant_max"),
                    Some(n),
                    bounds::QUEUE_PER_TENANT_MAX,
                )
            }),
        });
    }
    (out, ids)
}

/// `upstreams.*.reserve`: the permits only critical routes may take, of
/// `max_in_flight`; at least one is left to the others.
pub(super) fn reserve(
    c: &mut Checker,
    path: &str,
    raw: Option<RawReserve>,
    max_in_flight: u32,
) -> u32 {
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
pub(super) fn upstream_tls(
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

pub(super) fn health_check(c: &mut Checker, path: &str, h: RawHealthCheck) -> HealthCheck {
    if let Some(p) = &h.path {
        if !p.starts_with('/') || p.bytes().any(|b| b.is_ascii_control() || b == b' ') {
            c.fail(
                format!("{path}.path"),
                format!("{p:?} is not an absolute request path"),
            );
        }
    }
    let interval = c.bounded(
        &format!("{path}.interval_ms"),
        h.interval_ms,
        bounds::HEALTH_INTERVAL_MS,
    );
    let timeout = c.bounded(
        &format!("{path}.timeout_ms"),
        h.timeout_ms,
        bounds::HEALTH_TIMEOUT_MS,
    );
    HealthCheck {
        interval: Duration::from_millis(interval),
        timeout: Duration::from_millis(timeout),
        path: h.path,
        healthy_after: c.bounded(
            &format!("{path}.healthy_after"),
            h.healthy_after,
            bounds::HEALTHY_AFTER,
        ),
        unhealthy_after: c.bounded(
            &format!("{path}.unhealthy_after"),
            h.unhealthy_after,
            bounds::UNHEALTHY_AFTER,
        ),
    }
}
