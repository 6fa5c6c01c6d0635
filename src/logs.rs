//! Lines a client can cause are the client's doing: a flood of bad requests
//! must not become a flood of log lines. Every such line goes through one
//! limiter, with a budget per kind of line: at most
//! `server.log_client_errors_per_s` lines a second each (a reload changes
//! the rate); the others are counted in `tollgate_log_suppressed_total`
//! and summarized once a second.
//!
//! The kinds, by where a line comes from:
//! - `proxy`: the proxy library's warnings and errors (a broken, timed-out
//!   or malformed request). Pingora logs through the `log` crate, whose
//!   events reach the subscriber with the target `log`; their own target
//!   is read back from the event (`tracing_log`).
//! - `store`: per-call store warnings ([`STORE`]), which a flood multiplies.
//! - `request`: lines about single requests of ours ([`REQUEST`]), such as
//!   sampled denials.
//!
//! The summary and lines of other targets (start-up, reloads, the audit
//! trail) are never limited.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use prometheus::IntCounterVec;
use tracing::Metadata;
use tracing_log::NormalizeEvent;

use crate::clock;

/// The target of per-call store warnings.
pub const STORE: &str = "tollgate::store";
/// The target of lines about single requests.
pub const REQUEST: &str = "tollgate::request";

/// A kind of client-caused line, with its own budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The proxy library's warnings and errors.
    Proxy,
    /// Store call warnings.
    Store,
    /// Lines about single requests.
    Request,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Proxy, Kind::Store, Kind::Request];

    /// The `kind` label of `tollgate_log_suppressed_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Proxy => "proxy",
            Kind::Store => "store",
            Kind::Request => "request",
        }
    }

    /// The kind of a line, if it is one a client can cause.
    pub fn of(meta: &Metadata<'_>) -> Option<Kind> {
        let target = meta.target();
        if target.starts_with("pingora") {
            return (*meta.level() <= tracing::Level::WARN).then_some(Kind::Proxy);
        }
        match target {
            STORE => Some(Kind::Store),
            REQUEST => Some(Kind::Request),
            _ => None,
        }
    }
}

/// One kind's budget in the current second.
#[derive(Debug, Default)]
struct Budget {
    /// The second (since the limiter's start) the count is for.
    second: AtomicU64,
    count: AtomicU32,
    suppressed: AtomicU64,
}

/// The limiter of client-caused lines.
#[derive(Debug)]
pub struct ClientLog {
    start: Instant,
    per_s: AtomicU32,
    budgets: [Budget; 3],
    /// `tollgate_log_suppressed_total{kind}`, once the metrics exist.
    counter: OnceLock<IntCounterVec>,
}

impl ClientLog {
    /// A limiter letting `per_s` lines of each kind through a second.
    pub fn new(per_s: u32) -> Arc<Self> {
        Arc::new(Self {
            start: clock::instant(),
            per_s: AtomicU32::new(per_s),
            budgets: Default::default(),
            counter: OnceLock::new(),
        })
    }

    /// Lines of each kind a second from now on (a reload).
    pub fn set_rate(&self, per_s: u32) {
        self.per_s.store(per_s, Ordering::Relaxed);
    }

    /// Counts suppressed lines in `counter` from now on.
    pub fn attach(&self, counter: IntCounterVec) {
        for kind in Kind::ALL {
            counter.with_label_values(&[kind.as_str()]);
        }
        let _ = self.counter.set(counter);
    }

    /// Whether a line of `kind` may be written at `now`.
    pub fn admit(&self, kind: Kind, now: Instant) -> bool {
        let budget = &self.budgets[kind as usize];
        let second = now.saturating_duration_since(self.start).as_secs();
        let seen = budget.second.load(Ordering::Relaxed);
        if seen != second
            && budget
                .second
                .compare_exchange(seen, second, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            budget.count.store(0, Ordering::Relaxed);
        }
        if budget.count.fetch_add(1, Ordering::Relaxed) < self.per_s.load(Ordering::Relaxed) {
            return true;
        }
        budget.suppressed.fetch_add(1, Ordering::Relaxed);
        if let Some(counter) = self.counter.get() {
            counter.with_label_values(&[kind.as_str()]).inc();
        }
        false
    }

    /// Lines held back since the last call, by kind (only kinds with some).
    pub fn take_suppressed(&self) -> Vec<(Kind, u64)> {
        Kind::ALL
            .into_iter()
            .map(|k| {
                (
                    k,
                    self.budgets[k as usize]
                        .suppressed
                        .swap(0, Ordering::Relaxed),
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// The log layer that applies the limit, and a thread that writes the
    /// count of held-back lines once a second.
    pub fn install(self: &Arc<Self>) -> ClientLogFilter {
        let reporter = self.clone();
        std::thread::Builder::new()
            .name("client-log".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_secs(1));
                for (kind, n) in reporter.take_suppressed() {
                    tracing::warn!(
                        kind = kind.as_str(),
                        suppressed = n,
                        "client-caused log lines suppressed"
                    );
                }
            })
            .expect("spawn the log reporter");
        ClientLogFilter(self.clone())
    }
}

/// A layer that drops the lines [`ClientLog`] holds back, for every writer
/// behind it.
pub struct ClientLogFilter(Arc<ClientLog>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ClientLogFilter {
    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        // A `log` record's own target and level, not the bridge's.
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        match Kind::of(meta) {
            Some(kind) => self.0.admit(kind, clock::instant()),
            None => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_own_budget_a_second_and_the_rest_is_counted() {
        let log = ClientLog::new(2);
        let t0 = log.start;
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(log.admit(Kind::Proxy, at(0)));
        assert!(log.admit(Kind::Proxy, at(10)));
        assert!(!log.admit(Kind::Proxy, at(20)));
        assert!(
            log.admit(Kind::Store, at(30)),
            "another kind, another budget"
        );
        assert!(!log.admit(Kind::Proxy, at(999)));
        assert!(log.admit(Kind::Proxy, at(1_000)), "a new second");
        assert_eq!(log.take_suppressed(), vec![(Kind::Proxy, 2)]);
        assert!(log.take_suppressed().is_empty());
        log.set_rate(0);
        assert!(!log.admit(Kind::Request, at(2_000)));
        assert_eq!(log.take_suppressed(), vec![(Kind::Request, 1)]);
    }
}
