//! Micro-benchmarks of the hot pure functions on the request path.
//!
//!   cargo bench --bench hot_paths

use std::net::IpAddr;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use http::HeaderMap;
use tollgate::client_ip::{self, ClientIpConfig};
use tollgate::clock::ManualClock;
use tollgate::config::OnStoreError;
use tollgate::edge::target::{normalize, EncodedSlash};
use tollgate::limits::keys::KeyHasher;
use tollgate::limits::memory::MemoryStore;
use tollgate::limits::{Charge, Gate};
use tollgate::routes::{PathTemplate, Router};
use tollgate::testing::{self, bucket_params};

fn client_ip(c: &mut Criterion) {
    let config = ClientIpConfig {
        trusted_proxies: vec![
            "10.0.0.0/8".parse().unwrap(),
            "127.0.0.1/32".parse().unwrap(),
        ],
        ..ClientIpConfig::default()
    };
    let mut headers = HeaderMap::new();
    headers.insert(
        "x-forwarded-for",
        "203.0.113.7, 10.1.2.3, 10.4.5.6".parse().unwrap(),
    );
    let peer: IpAddr = "127.0.0.1".parse().unwrap();
    c.bench_function("client_ip_resolve_3_hops", |b| {
        b.iter(|| client_ip::resolve(black_box(peer), black_box(&headers), &config))
    });
}

fn routes(c: &mut Criterion) {
    let mut router = Router::new();
    for (i, t) in [
        "/healthz",
        "/v1/tenants/{tenant}/reports/{id}",
        "/v1/users/{id}",
        "/v2/**",
        "/**",
    ]
    .iter()
    .enumerate()
    {
        router.push(vec![], vec![], PathTemplate::parse(t).unwrap(), i);
    }
    c.bench_function("route_match_placeholders", |b| {
        b.iter(|| {
            let path = normalize(
                black_box(b"/v1/tenants/acme/reports/42"),
                EncodedSlash::Reject,
            )
            .unwrap();
            router.find("GET", None, &path).copied()
        })
    });
}

/// A tenant-scoped charge, decided in this process.
fn charge(name: &str, key: &str) -> Charge {
    Charge {
        tenant: Some("acme".into()),
        on_store_error: OnStoreError::Local,
        ..testing::local_charge(name, key, bucket_params(1_000, 1_000), 1)
    }
}

fn decisions(c: &mut Criterion) {
    let p = bucket_params(100, 50);
    let mut state = p.fresh(0);
    let mut now = 0;
    c.bench_function("token_bucket_refresh_check_spend", |b| {
        b.iter(|| {
            now += 1;
            p.refresh(&mut state, now);
            let check = p.check(&state, 1, now);
            if check.allowed {
                p.spend(&mut state, 1, now);
            }
            check
        })
    });
    let store = MemoryStore::new(ManualClock::new(1_000));
    let charges = [
        charge("per-credential", "c"),
        charge("per-tenant", "t"),
        charge("global", "g"),
    ];
    c.bench_function("memory_store_decide_3_limits", |b| {
        b.iter(|| store.decide_now(black_box(&charges), Gate::Open))
    });
}

fn key_hashing(c: &mut Criterion) {
    let hasher = KeyHasher::new("tg:", b"a secret of reasonable length");
    let ch = charge("per-tenant", "per-tenant\u{1f}acme");
    c.bench_function("store_key_hmac", |b| b.iter(|| hasher.key(black_box(&ch))));
}

criterion_group!(benches, client_ip, routes, decisions, key_hashing);
criterion_main!(benches);
