//! `usage`: the ledger's routes, spool and sinks.

use super::*;

/// The ledger's settings, for the routes of `routes`.
pub(super) fn usage(
    c: &mut Checker,
    raw: RawUsage,
    base: &Path,
    store: &StoreSettings,
    routes: &Router<Route>,
) -> UsageSettings {
    let records = match raw.routes {
        RawUsageRoutes::All(word) => {
            if word != "all" {
                c.fail(
                    "usage.routes",
                    format!("{word:?}: `all` or a list of route names"),
                );
            }
            vec![true; routes.len()]
        }
        RawUsageRoutes::Named(names) => {
            let mut records = vec![false; routes.len()];
            for (i, name) in names.iter().enumerate() {
                match routes.iter().find(|r| *r.name == **name) {
                    Some(r) => records[r.id.index()] = true,
                    None => c.fail(
                        format!("usage.routes[{i}]"),
                        with_nearest(
                            format!("no route named {name:?}"),
                            name,
                            routes.iter().map(|r| &*r.name),
                        ),
                    ),
                }
            }
            records
        }
    };
    let spool = raw.spool;
    if spool.path.is_empty() {
        c.fail("usage.spool.path", "names no directory");
    }
    let spool = SpoolSettings {
        path: base.join(&spool.path),
        max_bytes: c.bounded(
            "usage.spool.max_bytes",
            spool.max_bytes,
            bounds::SPOOL_MAX_BYTES,
        ),
        fsync: Duration::from_millis(c.bounded(
            "usage.spool.fsync_ms",
            spool.fsync_ms,
            bounds::SPOOL_FSYNC_MS,
        )),
        on_full: spool.on_full,
    };
    if raw.sinks.is_empty() {
        c.fail("usage.sinks", "needs at least one sink");
    }
    let sinks: Vec<SinkSettings> = raw
        .sinks
        .into_iter()
        .enumerate()
        .filter_map(|(i, s)| sink(c, &format!("usage.sinks[{i}]"), s, store))
        .collect();
    for (i, s) in sinks.iter().enumerate() {
        if sinks[..i].iter().any(|o| o.kind() == s.kind()) {
            c.fail(
                "usage.sinks",
                format!(
                    "a second {} sink: one of each kind (a sink is named by its kind in metrics)",
                    s.kind()
                ),
            );
        }
    }
    UsageSettings {
        records,
        spool,
        sinks,
    }
}

fn sink(c: &mut Checker, path: &str, raw: RawSink, store: &StoreSettings) -> Option<SinkSettings> {
    match (raw.redis_stream, raw.http) {
        (Some(stream), None) => {
            let key = stream.key.unwrap_or_else(|| "tollgate:usage".into());
            if key.is_empty() || key.bytes().any(|b| b.is_ascii_control()) {
                c.fail(
                    format!("{path}.redis_stream.key"),
                    format!("{key:?} is not a key"),
                );
            }
            let (urls, cluster) = match stream.urls {
                Some(urls) => {
                    if urls.len() != 1 {
                        c.fail(
                            format!("{path}.redis_stream.urls"),
                            format!("takes one url, got {}", urls.len()),
                        );
                    }
                    for (i, url) in urls.iter().enumerate() {
                        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                            c.fail(
                                format!("{path}.redis_stream.urls[{i}]"),
                                format!("{:?} is not a redis:// or rediss:// url", redacted(url)),
                            );
                        }
                    }
                    (urls, false)
                }
                None => match store.backend {
                    Backend::Redis => (store.urls.clone(), false),
                    Backend::RedisCluster => (store.urls.clone(), true),
                    other => {
                        c.fail(
                            format!("{path}.redis_stream"),
                            format!(
                                "needs urls: the store ({other}) is not a Redis the stream can \
                                 use"
                            ),
                        );
                        return None;
                    }
                },
            };
            Some(SinkSettings::RedisStream { key, urls, cluster })
        }
        (None, Some(http)) => {
            let at = format!("{path}.http");
            let url = match url::Url::parse(&http.url) {
                Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => Some(u),
                _ => {
                    c.fail(
                        format!("{at}.url"),
                        format!("{:?} is not an http:// or https:// url", http.url),
                    );
                    None
                }
            };
            if let Some(format) = http.format.as_deref().filter(|f| *f != "cloudevents") {
                c.fail(
                    format!("{at}.format"),
                    format!("{format:?}: only cloudevents"),
                );
            }
            if let Some(name) = &http.token_env {
                env_name(c, &format!("{at}.token_env"), name);
                let clear = url.as_ref().is_some_and(|u| {
                    u.scheme() == "http"
                        && !matches!(u.host(), Some(url::Host::Ipv4(ip)) if ip.is_loopback())
                        && !matches!(u.host(), Some(url::Host::Ipv6(ip)) if ip.is_loopback())
                        && u.host_str() != Some("localhost")
                });
                if clear {
                    c.fail(
                        format!("{at}.token_env"),
                        "would send the token in the clear: use an https:// url (http:// only \
                         to a loopback address)",
                    );
                }
            }
            let batch = c.bounded(&format!("{at}.batch"), http.batch, bounds::SINK_BATCH);
            let timeout = c.bounded(
                &format!("{at}.timeout_ms"),
                http.timeout_ms,
                bounds::SINK_TIMEOUT_MS,
            );
            Some(SinkSettings::Http {
                url: url?.to_string(),
                batch: batch as usize,
                timeout: Duration::from_millis(timeout),
                token_env: http.token_env,
            })
        }
        _ => {
            c.fail(path, "takes exactly one of redis_stream and http");
            None
        }
    }
}
