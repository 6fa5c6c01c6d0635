//! A circuit breaker for the shared store: after `failure_threshold`
//! consecutive failures no calls are made for `open_for`, then exactly one
//! probe is let through; its success closes the circuit, its failure opens
//! it again. Time is passed in, so the state machine is tested without
//! sleeping.
//!
//! It counts failed calls, not the decisions they carried: decisions that
//! arrive together share one store call, and when it fails each of them
//! reports the failure. A failure reported by a decision that started
//! before the last failure was counted rode on that call (or one beside
//! it) and is not counted again.

use std::sync::Mutex;
use std::time::Duration;

/// Whether a call may go to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// The circuit is closed: call.
    Call,
    /// The circuit was open long enough: this call is the one probe.
    Probe,
    /// The circuit is open: do not call.
    Refuse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        since_ms: u64,
    },
    /// The probe is out; everyone else is refused until it reports.
    Probing,
}

/// The breaker of one store; shared by every call to it.
#[derive(Debug)]
pub struct Breaker {
    threshold: u32,
    open_ms: u64,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: State,
    /// When the last failure was counted.
    counted_ms: u64,
}

impl Breaker {
    /// A closed breaker that opens after `threshold` failures in a row (at least 1)
    /// and stays open for `open_for`.
    pub fn new(threshold: u32, open_for: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            open_ms: open_for.as_millis() as u64,
            inner: Mutex::new(Inner {
                state: State::Closed { failures: 0 },
                counted_ms: 0,
            }),
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a call made at `now_ms` may go to the store; a `Probe` must be
    /// reported with [`Breaker::record`] before any other call is let through.
    pub fn permit(&self, now_ms: u64) -> Permit {
        let mut inner = self.inner();
        match inner.state {
            State::Closed { .. } => Permit::Call,
            State::Open { since_ms } if now_ms >= since_ms + self.open_ms => {
                inner.state = State::Probing;
                Permit::Probe
            }
            State::Open { .. } | State::Probing => Permit::Refuse,
        }
    }

    /// Reports how a permitted call went.
    pub fn record(&self, permit: Permit, ok: bool, now_ms: u64) {
        self.record_since(permit, ok, now_ms, now_ms);
    }

    /// Reports how the call of a decision that started at `started_ms`
    /// went: a failure is not counted again for a decision that was
    /// already waiting when the last one was counted (it rode on that
    /// call).
    pub fn record_since(&self, permit: Permit, ok: bool, now_ms: u64, started_ms: u64) {
        let mut inner = self.inner();
        if !ok && permit == Permit::Call {
            if started_ms < inner.counted_ms {
                return;
            }
            inner.counted_ms = now_ms;
        }
        inner.state = match (permit, ok, inner.state) {
            (_, true, _) => State::Closed { failures: 0 },
            (Permit::Probe, false, _) => State::Open { since_ms: now_ms },
            (_, false, State::Closed { failures }) if failures + 1 >= self.threshold => {
                State::Open { since_ms: now_ms }
            }
            (_, false, State::Closed { failures }) => State::Closed {
                failures: failures + 1,
            },
            // A late failure of a call made before the circuit opened.
            (_, false, other) => other,
        };
    }

    /// Reports a permitted call that says nothing about the store (the
    /// gateway shed it before the store could answer): neither a success
    /// nor a failure. A probe that learned nothing lets the next call probe.
    pub fn release(&self, permit: Permit, now_ms: u64) {
        let mut inner = self.inner();
        if permit == Permit::Probe && inner.state == State::Probing {
            inner.state = State::Open {
                since_ms: now_ms.saturating_sub(self.open_ms),
            };
        }
    }

    /// How long the circuit stays open before a probe.
    pub fn open_for(&self) -> Duration {
        Duration::from_millis(self.open_ms)
    }

    /// Whether calls are currently refused (open or probing).
    pub fn is_open(&self) -> bool {
        !matches!(self.inner().state, State::Closed { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_and_probes_once() {
        let b = Breaker::new(3, Duration::from_millis(1_000));
        for t in 0..2 {
            assert_eq!(b.permit(t), Permit::Call);
            b.record(Permit::Call, false, t);
        }
        assert!(!b.is_open(), "two failures are below the threshold");
        b.record(Permit::Call, false, 2);
        assert!(b.is_open());
        assert_eq!(b.permit(500), Permit::Refuse);
        assert_eq!(b.permit(1_002), Permit::Probe);
        assert_eq!(b.permit(1_003), Permit::Refuse, "only one probe at a time");
        b.record(Permit::Probe, false, 1_010);
        assert_eq!(b.permit(2_000), Permit::Refuse, "a failed probe reopens");
        assert_eq!(b.permit(2_010), Permit::Probe);
        b.record(Permit::Probe, true, 2_011);
        assert!(!b.is_open());
        assert_eq!(b.permit(2_012), Permit::Call);
    }

    #[test]
    fn a_released_call_counts_neither_way() {
        let b = Breaker::new(2, Duration::from_millis(100));
        b.record(Permit::Call, false, 0);
        b.release(Permit::Call, 1);
        b.record(Permit::Call, false, 2);
        assert!(b.is_open(), "the release did not reset the failure count");
        assert_eq!(b.permit(102), Permit::Probe);
        b.release(Permit::Probe, 103);
        assert!(b.is_open(), "a probe that learned nothing closes nothing");
        assert_eq!(b.permit(104), Permit::Probe, "the next call probes at once");
        b.record(Permit::Probe, true, 105);
        assert!(!b.is_open());
    }

    #[test]
    fn the_decisions_of_one_failed_call_count_once() {
        let b = Breaker::new(3, Duration::from_millis(1_000));
        // Fifty decisions that started at 10 share a call that fails at 30.
        for _ in 0..50 {
            b.record_since(Permit::Call, false, 30, 10);
        }
        assert!(!b.is_open(), "one failed call is below the threshold");
        // Two more calls, each made after the one before failed.
        b.record_since(Permit::Call, false, 60, 31);
        assert!(!b.is_open());
        b.record_since(Permit::Call, false, 90, 61);
        assert!(b.is_open(), "three failed calls open it");
    }

    #[test]
    fn a_success_resets_the_failure_count() {
        let b = Breaker::new(2, Duration::from_millis(10));
        b.record(Permit::Call, false, 0);
        b.record(Permit::Call, true, 1);
        b.record(Permit::Call, false, 2);
        assert!(!b.is_open());
    }
}
