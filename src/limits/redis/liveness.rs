//! Whether the store is alive, as the gateway observes it, and what that
//! makes of a decision that missed its deadline.
//!
//! A store is failing when it answers nothing: no reply to any call for
//! `timeout_ms`. A decision that waited `timeout_ms` while the store kept
//! answering other calls was late because the gateway was busy (its queue
//! was long, its threads saturated); it is shed as overload, never counted
//! against the store. The batch driver, on the store's own thread, notes
//! the time of every reply; the verdict on a late decision reads it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::limits::{Overload, StoreError};

/// When the store last answered.
#[derive(Debug)]
pub struct Liveness {
    timeout: Duration,
    epoch: Instant,
    /// Microseconds after `epoch` of the last reply, plus one; 0 before the
    /// first.
    last_answer: AtomicU64,
}

impl Liveness {
    /// A store that has not answered yet, whose calls are bounded by
    /// `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            epoch: Instant::now(),
            last_answer: AtomicU64::new(0),
        }
    }

    /// The store answered a call at `at` (a decision, an error reply of its
    /// own, a `PONG`): it is alive.
    pub fn answered(&self, at: Instant) {
        let micros = at.saturating_duration_since(self.epoch).as_micros() as u64 + 1;
        self.last_answer.fetch_max(micros, Ordering::Relaxed);
    }

    /// Whether the store answered within `timeout` before `now` (or after
    /// it: `now` may be a moment already past).
    pub fn alive(&self, now: Instant) -> bool {
        match self.last_answer.load(Ordering::Relaxed) {
            0 => false,
            at => {
                let last = self.epoch + Duration::from_micros(at - 1);
                now.saturating_duration_since(last) <= self.timeout
            }
        }
    }

    /// What a decision whose deadline passed at `now` unanswered was: shed
    /// overload while the store answers, a store timeout when it does not.
    pub fn late(&self, now: Instant) -> StoreError {
        if self.alive(now) {
            StoreError::Overloaded(Overload::Wait)
        } else {
            StoreError::Timeout
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_late_decision_is_overload_only_while_the_store_answers() {
        let t = Duration::from_millis(20);
        let live = Liveness::new(t);
        let start = Instant::now();
        assert_eq!(
            live.late(start),
            StoreError::Timeout,
            "a store that never answered is not known to be alive"
        );
        live.answered(start);
        assert_eq!(live.late(start), StoreError::Overloaded(Overload::Wait));
        assert_eq!(
            live.late(start + t),
            StoreError::Overloaded(Overload::Wait),
            "an answer exactly timeout_ms ago still counts"
        );
        assert_eq!(
            live.late(start + t + Duration::from_millis(1)),
            StoreError::Timeout
        );
        // Replies noted out of order keep the latest.
        live.answered(start + Duration::from_millis(30));
        live.answered(start + Duration::from_millis(5));
        assert_eq!(
            live.late(start + Duration::from_millis(45)),
            StoreError::Overloaded(Overload::Wait)
        );
        assert_eq!(
            live.late(start + Duration::from_millis(51)),
            StoreError::Timeout
        );
    }
}
