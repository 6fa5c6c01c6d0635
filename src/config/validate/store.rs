//! `store`: the backend of shared limits and how to call it.

use super::*;

pub(super) fn store(c: &mut Checker, raw: RawStore) -> StoreSettings {
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
        timeout: Duration::from_millis(c.bounded(
            "store.timeout_ms",
            raw.timeout_ms,
            bounds::STORE_TIMEOUT_MS,
        )),
        max_pending: c.bounded("store.max_pending", raw.max_pending, bounds::MAX_PENDING) as usize,
        key_prefix: raw.key_prefix.unwrap_or_else(|| "tg:".into()),
        key_secret_env,
        failure_threshold: c.bounded(
            "store.circuit_breaker.failure_threshold",
            breaker.failure_threshold,
            bounds::FAILURE_THRESHOLD,
        ),
        open_for: Duration::from_millis(c.bounded(
            "store.circuit_breaker.open_ms",
            breaker.open_ms,
            bounds::OPEN_MS,
        )),
        expected_instances: c.bounded(
            "store.expected_instances",
            raw.expected_instances,
            bounds::EXPECTED_INSTANCES,
        ),
    }
}
