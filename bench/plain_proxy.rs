//! The framework's ceiling: a Pingora proxy that forwards every request to
//! one upstream and does nothing else. Built as an example so the benchmark
//! compares tollgate with the same Pingora, compiler and profile.
//!
//!   cargo run --release --example plain_proxy -- LISTEN UPSTREAM THREADS [contract]
//!
//! With `PLAIN_TLS_CERT` and `PLAIN_TLS_KEY` set, LISTEN is a TLS listener
//! (rustls, as tollgate's), offering h2 by ALPN too when `PLAIN_H2=1`.
//!
//! With `contract`, it also does the per-request work the gateway's contract
//! asks of every forwarded request, with constant values and no limits at
//! all: SHA-256 of the presented API key, bounded upstream connect and read
//! times; on the upstream request, client copies of the headers the gateway
//! owns dropped in every spelling that folds to them, the key removed, the
//! identity headers, `X-Forwarded-For`, `X-Real-IP`, `X-Forwarded-Proto`
//! and a new `traceparent` set; the `RateLimit` fields on the response.
//! That is the floor under any Pingora gateway that honours the contract,
//! before it decides a single limit.
//!
//! With `PLAIN_SPIN_NS=N`, each request also does N ns of arithmetic in
//! `request_filter` (calibrated at start-up): work of a known size and
//! nothing else, to see what N ns more of a gateway's own work per request
//! costs it in all, beside the contenders of the same run.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;
use sha2::{Digest, Sha256};

// The same allocator as tollgate, so the comparison is of the proxy work.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Headers a gateway sets itself, or that only a trusted proxy may send:
/// client copies go, in any spelling that folds to these.
const OWNED: [&str; 13] = [
    "x-tenant-id",
    "x-credential-id",
    "x-route-class",
    "x-real-ip",
    "x-original-url",
    "x-rewrite-url",
    "x-http-method-override",
    "x-method-override",
    "x-http-method",
    "forwarded",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-forwarded-port",
];

/// Whether a (lower-case) header name reads as `owned` once `_` and `-`
/// are folded together.
fn folds_to(name: &str, owned: &str) -> bool {
    name.len() == owned.len()
        && name
            .bytes()
            .zip(owned.bytes())
            .all(|(a, b)| a == b || (a == b'_' && b == b'-'))
}

/// A new W3C `traceparent`: random trace and span ids, not sampled.
fn traceparent() -> String {
    static IDS: LazyLock<std::collections::hash_map::RandomState> =
        LazyLock::new(std::collections::hash_map::RandomState::new);
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let id = || IDS.hash_one(COUNTER.fetch_add(1, Ordering::Relaxed));
    format!("00-{:016x}{:016x}-{:016x}-00", id(), id(), id())
}

/// `steps` of arithmetic the compiler cannot remove: a fixed amount of
/// CPU work, which a clock-bound spin is not on a shared machine (a spin
/// preempted half-way ends having worked half as much), and no PAUSE loop,
/// which a hypervisor may deschedule.
fn work(steps: u64) {
    let mut x = 0u64;
    for _ in 0..steps {
        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
    }
}

/// Steps of [`work`] in a millisecond on this machine: the best of a few
/// timed runs, at start-up, before any load.
fn steps_per_ms() -> u64 {
    const STEPS: u64 = 4_000_000;
    let best = (0..5)
        .map(|_| {
            let start = tokio::time::Instant::now();
            work(STEPS);
            start.elapsed()
        })
        .min()
        .unwrap_or(Duration::from_millis(1));
    (STEPS as f64 / best.as_secs_f64() / 1000.0) as u64
}

struct Plain {
    upstream: String,
    contract: bool,
    /// Steps of [`work`] per request (`PLAIN_SPIN_NS`, calibrated).
    spin: u64,
}

#[async_trait]
impl ProxyHttp for Plain {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn request_filter(&self, session: &mut Session, _ctx: &mut ()) -> Result<bool> {
        if self.contract {
            let key = session.req_header().headers.get("authorization");
            let digest = Sha256::digest(key.map_or(&b""[..], |v| v.as_bytes()));
            std::hint::black_box(digest);
        }
        if self.spin > 0 {
            work(self.spin);
        }
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        let mut peer = HttpPeer::new(self.upstream.as_str(), false, String::new());
        if self.contract {
            peer.options.connection_timeout = Some(Duration::from_secs(1));
            peer.options.read_timeout = Some(Duration::from_secs(30));
        }
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        _ctx: &mut (),
    ) -> Result<()> {
        if self.contract {
            let owned: Vec<http::HeaderName> = upstream
                .headers
                .keys()
                .filter(|n| OWNED.iter().any(|o| folds_to(n.as_str(), o)))
                .cloned()
                .collect();
            for name in &owned {
                upstream.remove_header(name);
            }
            upstream.remove_header("authorization");
            upstream.insert_header("x-tenant-id", "bench-tenant")?;
            upstream.insert_header("x-credential-id", "bench")?;
            upstream.insert_header("x-route-class", "bench")?;
            let peer = session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map_or_else(String::new, |a| a.ip().to_string());
            upstream.insert_header("x-forwarded-for", format!("203.0.113.7, {peer}"))?;
            upstream.insert_header("x-real-ip", "203.0.113.7")?;
            upstream.insert_header("x-forwarded-proto", "http")?;
            upstream.insert_header("traceparent", traceparent())?;
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        response: &mut ResponseHeader,
        _ctx: &mut (),
    ) -> Result<()> {
        if self.contract {
            response.insert_header("ratelimit-policy", "\"global\";q=1000000000;w=1")?;
            response.insert_header("ratelimit", "\"global\";r=999999999;t=1")?;
        }
        Ok(())
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (listen, upstream) = (args[1].clone(), args[2].clone());
    let threads = args.get(3).and_then(|t| t.parse().ok()).unwrap_or(1);
    let contract = args.get(4).is_some_and(|a| a == "contract");
    let spin = std::env::var("PLAIN_SPIN_NS")
        .ok()
        .and_then(|n| n.parse::<u64>().ok())
        .map_or(0, |ns| ns * steps_per_ms() / 1_000_000);
    let conf = ServerConf {
        threads,
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = http_proxy_service(
        &server.configuration,
        Plain {
            upstream,
            contract,
            spin,
        },
    );
    match (
        std::env::var("PLAIN_TLS_CERT"),
        std::env::var("PLAIN_TLS_KEY"),
    ) {
        (Ok(cert), Ok(key)) => {
            let mut tls = pingora::listeners::tls::TlsSettings::intermediate(&cert, &key)
                .expect("certificate and key");
            if std::env::var("PLAIN_H2").is_ok_and(|v| v == "1") {
                tls.enable_h2();
            }
            proxy.add_tls_with_settings(&listen, None, tls);
        }
        _ => proxy.add_tcp(&listen),
    }
    server.add_service(proxy);
    server.run_forever()
}
