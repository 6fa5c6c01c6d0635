//! The framework's ceiling: a Pingora proxy that forwards every request to
//! one upstream and does nothing else. Built as an example so the benchmark
//! compares tollgate with the same Pingora, compiler and profile.
//!
//!   cargo run --release --example plain_proxy -- LISTEN UPSTREAM THREADS

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;

// The same allocator as tollgate, so the comparison is of the proxy work.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Plain {
    upstream: String,
}

#[async_trait]
impl ProxyHttp for Plain {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(
            self.upstream.as_str(),
            false,
            String::new(),
        )))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (listen, upstream) = (args[1].clone(), args[2].clone());
    let threads = args.get(3).and_then(|t| t.parse().ok()).unwrap_or(1);
    let conf = ServerConf {
        threads,
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = http_proxy_service(&server.configuration, Plain { upstream });
    proxy.add_tcp(&listen);
    server.add_service(proxy);
    server.run_forever()
}
