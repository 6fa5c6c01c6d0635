//! One listener's connection accounting: the open-connection gauge, the
//! `max_connections` bound and the bound per client address, and the counts
//! of connections an edge bound closed, with their label values resolved
//! once. The bounds count the connections of every listener that shares
//! them: the proxy's listeners (plain and TLS) share one, so
//! `max_connections` bounds the instance.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use prometheus::{IntCounter, IntGauge};

use crate::metrics::Metrics;

/// Why the edge refused or closed a connection (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Refused at accept: the listener already holds `max_connections`.
    MaxConnections,
    /// Refused at accept: the client's address already holds its share.
    MaxConnectionsPerIp,
    /// No complete request head within `header_read_ms`.
    HeaderTimeout,
    /// No next request within `keepalive_idle_ms`.
    IdleTimeout,
    /// A request body stalled longer than `body_read_ms`.
    BodyTimeout,
    /// A request body slower than `body_min_rate` after `body_grace_ms`,
    /// or longer than `body_total_ms` (HTTP/1.1 and HTTP/2 alike).
    BodyTooSlow,
    /// The client left a response write pending longer than `send_ms`.
    SendTimeout,
    /// The client took a response slower than `send_min_rate` over the
    /// time the gateway waited on it, once that passed the grace
    /// (HTTP/1.1 and HTTP/2 alike).
    SendTooSlow,
    /// A request head larger than `max_header_bytes`.
    HeaderTooLarge,
    /// A request head that cannot be read as HTTP/1.1 or is framed ambiguously.
    BadRequest,
}

impl Reason {
    const ALL: [Reason; 10] = [
        Reason::MaxConnections,
        Reason::MaxConnectionsPerIp,
        Reason::HeaderTimeout,
        Reason::IdleTimeout,
        Reason::BodyTimeout,
        Reason::BodyTooSlow,
        Reason::SendTimeout,
        Reason::SendTooSlow,
        Reason::HeaderTooLarge,
        Reason::BadRequest,
    ];

    /// The `reason` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::MaxConnections => "max_connections",
            Reason::MaxConnectionsPerIp => "max_connections_per_ip",
            Reason::HeaderTimeout => "header_timeout",
            Reason::IdleTimeout => "idle_timeout",
            Reason::BodyTimeout => "body_timeout",
            Reason::BodyTooSlow => "body_too_slow",
            Reason::SendTimeout => "send_timeout",
            Reason::SendTooSlow => "send_too_slow",
            Reason::HeaderTooLarge => "header_too_large",
            Reason::BadRequest => "bad_request",
        }
    }
}

/// The open connections of the listeners sharing a bound: in all, and per
/// client address (an address leaves the table with its last connection).
#[derive(Debug, Default)]
pub struct Open {
    total: AtomicUsize,
    by_address: Mutex<HashMap<IpAddr, usize>>,
}

impl Open {
    /// Counts a connection from `peer` unless it already holds `max`.
    fn take_address(&self, peer: IpAddr, max: usize) -> bool {
        let mut by_address = self.by_address.lock().unwrap_or_else(|e| e.into_inner());
        let held = by_address.entry(peer).or_insert(0);
        if *held >= max {
            if *held == 0 {
                by_address.remove(&peer);
            }
            return false;
        }
        *held += 1;
        true
    }

    fn give_address(&self, peer: IpAddr) {
        let mut by_address = self.by_address.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = by_address.get_mut(&peer) {
            *held -= 1;
            if *held == 0 {
                by_address.remove(&peer);
            }
        }
    }
}

/// The accounting of one listener (its address is the `listener` label).
#[derive(Debug)]
pub struct Listener {
    /// Open connections of every listener sharing the bounds.
    open: Arc<Open>,
    gauge: IntGauge,
    rejected: [IntCounter; Reason::ALL.len()],
}

impl Listener {
    /// The accounting of the listener `name`, with its metric series
    /// resolved once, bounding its own connections.
    pub fn new(name: &str, metrics: &Metrics) -> Arc<Self> {
        Self::sharing(name, metrics, Arc::default())
    }

    /// As [`Listener::new`], bounding the connections counted in `open`
    /// together with every other listener given it.
    pub fn sharing(name: &str, metrics: &Metrics, open: Arc<Open>) -> Arc<Self> {
        Arc::new(Self {
            open,
            gauge: metrics.connections.with_label_values(&[name]),
            rejected: Reason::ALL.map(|r| {
                metrics
                    .connections_rejected
                    .with_label_values(&[name, r.as_str()])
            }),
        })
    }

    /// Counts a connection closed by an edge bound.
    pub fn rejected(&self, reason: Reason) {
        self.rejected[reason as usize].inc();
    }

    /// Takes one of `max` connection slots, or counts the refusal.
    pub fn admit(self: &Arc<Self>, max: usize) -> Option<Slot> {
        self.admit_from(None, max, usize::MAX)
    }

    /// Takes one of `max` connection slots, and one of the `per_address`
    /// slots of `peer` (when known), or counts the refusal: one address
    /// cannot take the slots every other one needs.
    pub fn admit_from(
        self: &Arc<Self>,
        peer: Option<IpAddr>,
        max: usize,
        per_address: usize,
    ) -> Option<Slot> {
        let taken = self
            .open
            .total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            });
        if taken.is_err() {
            self.rejected(Reason::MaxConnections);
            return None;
        }
        // Unbounded addresses are not counted: the table stays empty.
        let peer = peer.filter(|_| per_address < usize::MAX);
        if let Some(ip) = peer {
            if !self.open.take_address(ip, per_address) {
                self.open.total.fetch_sub(1, Ordering::AcqRel);
                self.rejected(Reason::MaxConnectionsPerIp);
                return None;
            }
        }
        self.gauge.inc();
        Some(Slot {
            listener: self.clone(),
            peer,
        })
    }

    /// How many connections were refused or closed for `reason`.
    pub fn rejections(&self, reason: Reason) -> u64 {
        self.rejected[reason as usize].get()
    }

    /// Connections open now, on every listener sharing the bound.
    pub fn open(&self) -> usize {
        self.open.total.load(Ordering::Acquire)
    }
}

/// An open connection's slot (and its address's), given back when dropped.
#[derive(Debug)]
pub struct Slot {
    listener: Arc<Listener>,
    peer: Option<IpAddr>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(ip) = self.peer {
            self.listener.open.give_address(ip);
        }
        self.listener.open.total.fetch_sub(1, Ordering::AcqRel);
        self.listener.gauge.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_counted_and_given_back() {
        let metrics = Metrics::new();
        let listener = Listener::new("127.0.0.1:1", &metrics);
        let a = listener.admit(2).unwrap();
        let _b = listener.admit(2).unwrap();
        assert!(listener.admit(2).is_none());
        assert_eq!(listener.open(), 2);
        let text = String::from_utf8(metrics.render()).unwrap();
        assert!(text.contains(
            "tollgate_connections_rejected_total{listener=\"127.0.0.1:1\",reason=\"max_connections\"} 1"
        ));
        assert!(text.contains("tollgate_connections{listener=\"127.0.0.1:1\"} 2"));
        drop(a);
        assert_eq!(listener.open(), 1);
        assert!(listener.admit(2).is_some());
    }

    #[test]
    fn listeners_sharing_a_bound_count_together() {
        let metrics = Metrics::new();
        let open = Arc::new(Open::default());
        let plain = Listener::sharing("127.0.0.1:1", &metrics, open.clone());
        let tls = Listener::sharing("127.0.0.1:2", &metrics, open);
        let a = plain.admit(2).unwrap();
        let _b = tls.admit(2).unwrap();
        assert!(plain.admit(2).is_none());
        assert!(tls.admit(2).is_none());
        assert_eq!(tls.rejections(Reason::MaxConnections), 1);
        drop(a);
        let _c = tls.admit(2).unwrap();
        // Each listener's gauge is its own.
        let text = String::from_utf8(metrics.render()).unwrap();
        assert!(text.contains("tollgate_connections{listener=\"127.0.0.1:1\"} 0"));
        assert!(text.contains("tollgate_connections{listener=\"127.0.0.1:2\"} 2"));
    }

    #[test]
    fn each_address_holds_at_most_its_share() {
        let metrics = Metrics::new();
        let listener = Listener::new("admin", &metrics);
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
        let first = listener.admit_from(Some(a), 10, 2).unwrap();
        let _second = listener.admit_from(Some(a), 10, 2).unwrap();
        assert!(listener.admit_from(Some(a), 10, 2).is_none());
        assert_eq!(listener.rejections(Reason::MaxConnectionsPerIp), 1);
        assert_eq!(listener.open(), 2, "a refused address takes no slot");
        let _other = listener.admit_from(Some(b), 10, 2).unwrap();
        drop(first);
        assert!(listener.admit_from(Some(a), 10, 2).is_some(), "given back");
        // The table forgets an address with its last connection.
        drop(_other);
        assert!(!listener.open.by_address.lock().unwrap().contains_key(&b));
    }
}
