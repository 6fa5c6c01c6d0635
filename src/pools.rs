//! Upstream pools: which server of a pool the next request goes to.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::config::Upstream;

/// Run-time state of one upstream pool.
#[derive(Debug)]
pub struct Pool {
    servers: Vec<SocketAddr>,
    next: AtomicUsize,
}

impl Pool {
    pub fn new(upstream: &Upstream) -> Self {
        Self {
            servers: upstream.servers.clone(),
            next: AtomicUsize::new(0),
        }
    }

    /// The next server, round robin.
    pub fn pick(&self) -> Option<SocketAddr> {
        if self.servers.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        Some(self.servers[i % self.servers.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn servers_take_turns() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let pool = Pool::new(&Upstream {
            name: "api".into(),
            servers: vec![a, b],
            max_in_flight: 1,
            queue_max_waiting: 0,
            queue_timeout: Duration::ZERO,
            connect_timeout: Duration::from_secs(1),
            read_timeout: Duration::from_secs(1),
        });
        let picks: Vec<_> = (0..4).filter_map(|_| pool.pick()).collect();
        assert_eq!(picks, vec![a, b, a, b]);
    }
}
