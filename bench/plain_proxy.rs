//! The framework's ceiling: a Pingora proxy that forwards every request to
//! one upstream and does nothing else. Built as an example so the benchmark
//! compares tollgate with the same Pingora, compiler and profile.
//!
//!   cargo run --release --example plain_proxy -- LISTEN UPSTREAM THREADS [contract]
//!
//! With `PLAIN_TLS_CERT` and `PLAIN_TLS_KEY` set, LISTEN is a TLS listener
//! (rustls, as tollgate's), offering h2 by ALPN too when `PLAIN_H2=1`.
//!
//! With `contract`, it also does the per-request work the design contract
//! asks of every forwarded request, with constant values and no limits at
//! all: SHA-256 of the presented API key, bounded upstream connect and read
//! times, the identity headers and `X-Forwarded-For` on the upstream
//! request, the `RateLimit` fields on the response. That is the floor under
//! any Pingora gateway that honours the contract, before it decides a
//! single limit.

use std::time::Duration;

use async_trait::async_trait;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;
use sha2::{Digest, Sha256};

// The same allocator as tollgate, so the comparison is of the proxy work.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Plain {
    upstream: String,
    contract: bool,
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
            upstream.insert_header("x-tenant-id", "bench-tenant")?;
            upstream.insert_header("x-credential-id", "bench")?;
            upstream.insert_header("x-route-class", "bench")?;
            let peer = session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map_or_else(String::new, |a| a.ip().to_string());
            upstream.insert_header("x-forwarded-for", format!("203.0.113.7, {peer}"))?;
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
    let conf = ServerConf {
        threads,
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = http_proxy_service(&server.configuration, Plain { upstream, contract });
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
