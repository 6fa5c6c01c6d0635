//! The one place that reads the system clock (`clippy.toml` bans reading it
//! anywhere else).
//!
//! Decision maths takes `now` as an argument; in-process state reads it from
//! a [`Clock`] so tests can drive time by hand instead of sleeping. Timers
//! and measurements of I/O use tokio's clock, which tests pause.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

/// The wall clock, for timestamps people read (log lines), where no
/// runtime is wired (a thread of its own, the command line); with one,
/// read its [`WallClock`].
#[allow(clippy::disallowed_methods)]
pub fn wall() -> SystemTime {
    SystemTime::now()
}

/// The wall clock in ms since the epoch, for expiries people set (a
/// revocation's): comparable across instances, as a monotonic clock is
/// not. Where a runtime is wired, read its [`WallClock`] instead.
pub fn wall_ms() -> u64 {
    wall()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The monotonic clock, for code that runs outside any runtime (a log
/// filter on whatever thread logs).
#[allow(clippy::disallowed_methods)]
pub fn instant() -> Instant {
    Instant::now()
}

/// The wall clock a runtime reads, for expiries people set (a
/// revocation's, an override's) and timestamps people read: the system's
/// in the gateway ([`SystemWall`]), one set by hand in tests
/// ([`ManualClock`]).
pub trait WallClock: Send + Sync + 'static {
    /// The time now.
    fn wall(&self) -> SystemTime;

    /// The time now, in ms since the epoch (0 before it).
    fn wall_ms(&self) -> u64 {
        self.wall()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemWall;

impl WallClock for SystemWall {
    fn wall(&self) -> SystemTime {
        wall()
    }
}

/// A source of milliseconds that never goes backwards.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since an arbitrary, fixed origin.
    fn now_ms(&self) -> u64;
}

/// The process's monotonic clock, reading milliseconds since the Unix
/// epoch as of its start: calendar periods (quotas) fall on UTC days and
/// months as in Redis, and a wall clock stepped back never moves it back.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    origin: Instant,
    epoch_ms: u64,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        let epoch_ms = wall()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Self {
            origin: instant(),
            epoch_ms,
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[allow(clippy::disallowed_methods)]
    fn now_ms(&self) -> u64 {
        // Never zero, even on a machine whose clock reads 1970: "time zero"
        // must not collide with a fresh state's timestamp arithmetic.
        self.epoch_ms.max(1_000) + self.origin.elapsed().as_millis() as u64
    }
}

/// A clock moved by hand, for tests. Cloning shares the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock that reads `start_ms` until moved.
    pub fn new(start_ms: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_ms)))
    }

    /// Sets the time to `ms`, for every clone.
    pub fn set(&self, ms: u64) {
        self.0.store(ms, Ordering::SeqCst);
    }

    /// Moves the time forward by `ms`, for every clone.
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl WallClock for ManualClock {
    fn wall(&self) -> SystemTime {
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(self.now_ms())
    }
}
