//! Client errors are the client's doing: a flood of bad requests must not
//! become a flood of log lines. Pingora reports each broken, timed-out or
//! malformed request as an error line; at most one such line a second gets
//! through, and the number held back is reported once a second beside it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Metadata;

/// Lines of the proxy library's error and warning levels, at most one per
/// `every`; the others are counted.
#[derive(Debug)]
pub struct ClientErrorLog {
    start: Instant,
    every: Duration,
    /// When the last line went through, in ms since `start` (+1; 0 = never).
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl ClientErrorLog {
    /// A limiter letting one line through per `every`.
    pub fn new(every: Duration) -> Arc<Self> {
        Arc::new(Self {
            start: Instant::now(),
            every,
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        })
    }

    /// Whether a line is one this limits: the proxy library's warnings and
    /// errors, which describe what a client or upstream did to one request.
    pub fn applies_to(meta: &Metadata<'_>) -> bool {
        meta.target().starts_with("pingora") && *meta.level() <= tracing::Level::WARN
    }

    /// Whether this line may be written now.
    pub fn admit(&self, now: Instant) -> bool {
        let now_ms = now.saturating_duration_since(self.start).as_millis() as u64 + 1;
        let every = self.every.as_millis() as u64;
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == 0 || now_ms >= last + every;
        if due
            && self
                .last_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return true;
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// How many lines were held back since the last call.
    pub fn take_suppressed(&self) -> u64 {
        self.suppressed.swap(0, Ordering::Relaxed)
    }

    /// The log layer that applies the limit, and a thread that reports the
    /// count of held-back lines once a second.
    pub fn install(self: &Arc<Self>) -> ClientErrorFilter {
        let reporter = self.clone();
        std::thread::Builder::new()
            .name("client-error-log".into())
            .spawn(move || loop {
                std::thread::sleep(reporter.every);
                let n = reporter.take_suppressed();
                if n > 0 {
                    tracing::warn!(suppressed = n, "client error lines suppressed");
                }
            })
            .expect("spawn the log reporter");
        ClientErrorFilter(self.clone())
    }
}

/// A layer that drops the lines [`ClientErrorLog`] holds back, for every
/// writer behind it.
pub struct ClientErrorFilter(Arc<ClientErrorLog>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ClientErrorFilter {
    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        !ClientErrorLog::applies_to(event.metadata()) || self.0.admit(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_second_and_the_rest_counted() {
        let log = ClientErrorLog::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert!(log.admit(t0));
        for ms in [1, 200, 999] {
            assert!(!log.admit(t0 + Duration::from_millis(ms)));
        }
        assert!(log.admit(t0 + Duration::from_millis(1001)));
        assert!(!log.admit(t0 + Duration::from_millis(1500)));
        assert_eq!(log.take_suppressed(), 4);
        assert_eq!(log.take_suppressed(), 0);
    }
}
