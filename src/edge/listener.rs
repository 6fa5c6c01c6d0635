//! One listener's connection accounting: the open-connection gauge, the
//! `max_connections` bound, and the counts of connections an edge bound
//! closed, with their label values resolved once. The bound counts the
//! connections of every listener that shares it: the proxy's listeners
//! (plain and TLS) share one, so `max_connections` bounds the instance.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use prometheus::{IntCounter, IntGauge};

use crate::metrics::Metrics;

/// Why the edge refused or closed a connection (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Refused at accept: the listener already holds `max_connections`.
    MaxConnections,
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
    const ALL: [Reason; 9] = [
        Reason::MaxConnections,
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

/// The accounting of one listener (its address is the `listener` label).
#[derive(Debug)]
pub struct Listener {
    /// Open connections of every listener sharing the bound.
    open: Arc<AtomicUsize>,
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
    pub fn sharing(name: &str, metrics: &Metrics, open: Arc<AtomicUsize>) -> Arc<Self> {
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
        let taken = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            });
        if taken.is_err() {
            self.rejected(Reason::MaxConnections);
            return None;
        }
        self.gauge.inc();
        Some(Slot(self.clone()))
    }

    /// How many connections were refused or closed for `reason`.
    pub fn rejections(&self, reason: Reason) -> u64 {
        self.rejected[reason as usize].get()
    }

    /// Connections open now, on every listener sharing the bound.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// An open connection's slot, given back when dropped.
#[derive(Debug)]
pub struct Slot(Arc<Listener>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.gauge.dec();
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
        let open = Arc::new(AtomicUsize::new(0));
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
}
