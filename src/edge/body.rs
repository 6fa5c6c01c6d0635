//! Request bodies under bounds: the time a body may take, and the memory
//! bodies read whole may hold.
//!
//! A body must keep up a least average rate (`body_min_rate` bytes a
//! second since it started, once `body_grace_ms` passed), must never stall
//! longer than `body_read_ms`, and must end within `body_total_ms`
//! ([`deadline`]). Over HTTP/1.1 the guarded stream enforces it at the
//! transport ([`super::conn`]). An HTTP/2 stream has no read timeout in
//! Pingora, so each stream with a body runs beside a [`BodyWatch`]: the
//! proxy reports the body's progress to it ([`started`], [`read`]), and
//! when a bound fails the stream's task is dropped, which resets the
//! stream (`CANCEL`) and releases whatever the request held, its pool
//! permit first ([`Watched`]).
//!
//! Bodies small enough to be read whole before a request takes a pool
//! permit hold memory meanwhile; [`BodyBudget`] bounds it over the process
//! (`buffered_bytes_total`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, HttpServerOptions, ReusedHttpStream};
use pingora::protocols::http::v2::server::H2Options;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::listener::{Listener, Reason};
use super::{EdgeSettings, LiveSettings};

/// When a body that started at `started`, last made progress at
/// `progress` and has brought `bytes` fails its bounds if no more of it
/// comes, and which bound that is: the gap since its last progress
/// (`BodyTimeout`), or its average rate or total time (`BodyTooSlow`).
pub fn deadline(
    settings: &EdgeSettings,
    started: Instant,
    progress: Instant,
    bytes: u64,
) -> (Instant, Reason) {
    let gap = progress + settings.body_read;
    // The bytes so far keep up the rate until `bytes / rate` seconds in.
    let slow = started + settings.body_allowance(bytes);
    if gap <= slow {
        (gap, Reason::BodyTimeout)
    } else {
        (slow, Reason::BodyTooSlow)
    }
}

/// Bytes of bodies read whole, over the process, and by each caller.
#[derive(Debug, Default)]
pub struct BodyBudget {
    used: AtomicU64,
    /// Bytes held by each caller that has some, by a digest of its name.
    shares: Mutex<std::collections::HashMap<u64, u64>>,
}

/// One caller's share of the budget: at most [`SHARE_DIVISOR`]th of it,
/// so that one caller's slow bodies cannot take it all.
pub const SHARE_DIVISOR: u64 = 8;

/// Bytes of the budget one body holds, given back when dropped.
#[derive(Debug)]
pub struct BodyReservation {
    budget: Arc<BodyBudget>,
    bytes: u64,
    /// The caller whose share it is part of.
    caller: Option<u64>,
}

impl BodyBudget {
    /// A budget of which nothing is used.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// `bytes` more, unless that takes the total past `max`.
    pub fn reserve(self: &Arc<Self>, bytes: u64, max: u64) -> Option<BodyReservation> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= max)
            })
            .ok()
            .map(|_| BodyReservation {
                budget: self.clone(),
                bytes,
                caller: None,
            })
    }

    /// `bytes` more for `caller` (a digest of who it is), unless that takes
    /// the total past `max` or the caller's share past `max /`
    /// [`SHARE_DIVISOR`] (a share always holds one body of `floor`).
    pub fn reserve_for(
        self: &Arc<Self>,
        caller: u64,
        bytes: u64,
        max: u64,
        floor: u64,
    ) -> Option<BodyReservation> {
        let share = (max / SHARE_DIVISOR).max(floor);
        let mut shares = self.shares.lock().unwrap_or_else(|e| e.into_inner());
        let held = shares.get(&caller).copied().unwrap_or(0);
        if held.saturating_add(bytes) > share {
            return None;
        }
        let mut reservation = self.reserve(bytes, max)?;
        shares.insert(caller, held + bytes);
        reservation.caller = Some(caller);
        Some(reservation)
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

impl Drop for BodyReservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        if let Some(caller) = self.caller {
            let mut shares = self.budget.shares.lock().unwrap_or_else(|e| e.into_inner());
            if let std::collections::hash_map::Entry::Occupied(mut held) = shares.entry(caller) {
                *held.get_mut() = held.get().saturating_sub(self.bytes);
                if *held.get() == 0 {
                    held.remove();
                }
            }
        }
    }
}

/// One HTTP/2 stream's body, as far as it came.
#[derive(Debug, Default)]
struct Progress {
    started: Option<Instant>,
    last: Option<Instant>,
    bytes: u64,
    done: bool,
}

/// Watches one HTTP/2 stream's body against the bounds.
#[derive(Debug)]
pub struct BodyWatch {
    settings: EdgeSettings,
    progress: Mutex<Progress>,
    changed: Notify,
    /// The proxy cut the stream's response for its client's pace: the
    /// bound's reason, counted on the listener when the stream ends.
    send_cut: Mutex<Option<Reason>>,
}

tokio::task_local! {
    /// The watch of the stream whose task this is, if it is watched.
    ///
    /// A task-local, not an argument: Pingora reads an HTTP/2 stream's
    /// body inside its own session (`read_request_body`), called from the
    /// proxy's hooks, and gives neither the stream nor the request's
    /// context a place for it; the edge runs each stream's task inside
    /// this scope (`Watched`), so the proxy's reads report to it.
    static WATCH: Arc<BodyWatch>;
}

/// The current stream's body starts being read (no-op outside a watched
/// HTTP/2 stream).
pub fn started() {
    let _ = WATCH.try_with(|w| w.start(Instant::now()));
}

/// `bytes` more of the current stream's body came; `end` when it is over.
pub fn read(bytes: usize, end: bool) {
    let _ = WATCH.try_with(|w| w.read(bytes as u64, end, Instant::now()));
}

/// The current HTTP/2 stream's response was cut because its client did
/// not take it in time, for `reason` (no-op outside a watched stream).
pub fn send_cut(reason: Reason) {
    let _ =
        WATCH.try_with(|w| *w.send_cut.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason));
}

impl BodyWatch {
    /// A watch under `settings`, of a body not started yet.
    pub fn new(settings: EdgeSettings) -> Self {
        Self {
            settings,
            progress: Mutex::default(),
            changed: Notify::new(),
            send_cut: Mutex::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The body starts at `now` (again: no-op).
    pub fn start(&self, now: Instant) {
        let mut p = self.state();
        if p.started.is_none() {
            p.started = Some(now);
            p.last = Some(now);
            drop(p);
            self.changed.notify_one();
        }
    }

    /// `bytes` more came at `now`; `end` when the body is over.
    pub fn read(&self, bytes: u64, end: bool, now: Instant) {
        let mut p = self.state();
        p.started.get_or_insert(now);
        p.last = Some(now);
        p.bytes += bytes;
        p.done |= end;
    }

    /// When the body fails its bounds if no more comes; `None` while it
    /// has not started or once it is over.
    fn next(&self) -> Option<(Instant, Reason)> {
        let p = self.state();
        match (p.started, p.last) {
            (Some(started), Some(last)) if !p.done => {
                Some(deadline(&self.settings, started, last, p.bytes))
            }
            _ => None,
        }
    }

    /// Resolves when the body fails a bound, with the bound; never while
    /// it keeps up, or once it is over.
    pub async fn expired(&self) -> Reason {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.next() {
                None => changed.await,
                Some((at, _)) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(at) => {
                            if let Some((at, reason)) = self.next() {
                                if at <= Instant::now() {
                                    return reason;
                                }
                            }
                        }
                        () = &mut changed => {}
                    }
                }
            }
        }
    }
}

/// The proxy app with every HTTP/2 stream's body watched (streams that
/// carry one): a stream whose body fails a bound is dropped (reset) and
/// counted on the listener.
/// HTTP/1.1 sessions pass through: their stream is guarded.
pub struct Watched<A> {
    inner: Arc<A>,
    settings: LiveSettings,
    listener: Arc<Listener>,
}

impl<A> Watched<A> {
    /// Watches the HTTP/2 streams `inner` serves for one listener.
    pub fn new(inner: Arc<A>, settings: LiveSettings, listener: Arc<Listener>) -> Self {
        Self {
            inner,
            settings,
            listener,
        }
    }
}

#[async_trait]
impl<A: HttpServerApp + Send + Sync + 'static> HttpServerApp for Watched<A> {
    async fn process_new_http(
        self: &Arc<Self>,
        session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        // HTTP/1.1 is guarded at the transport. Every HTTP/2 stream is
        // watched: its body, when it has one, and the pace its client
        // takes the response at.
        if !session.is_http2() {
            return self.inner.process_new_http(session, shutdown).await;
        }
        let watch = Arc::new(BodyWatch::new((self.settings)()));
        let request = WATCH.scope(
            watch.clone(),
            self.inner.process_new_http(session, shutdown),
        );
        let reused = tokio::select! {
            reused = request => reused,
            reason = watch.expired() => {
                // Dropping the request resets its stream and frees what it
                // held.
                self.listener.rejected(reason);
                return None;
            }
        };
        let cut = *watch.send_cut.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reason) = cut {
            self.listener.rejected(reason);
        }
        reused
    }

    fn h2_options(&self) -> Option<H2Options> {
        self.inner.h2_options()
    }

    fn server_options(&self) -> Option<&HttpServerOptions> {
        self.inner.server_options()
    }

    async fn http_cleanup(&self) {
        self.inner.http_cleanup().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn settings() -> EdgeSettings {
        EdgeSettings {
            body_read: Duration::from_secs(3),
            body_min_rate: 1_000,
            body_grace: Duration::from_secs(5),
            body_total: Duration::from_secs(60),
            ..EdgeSettings::default()
        }
    }

    #[test]
    fn one_caller_holds_at_most_its_share_and_gets_it_back() {
        let budget = BodyBudget::new();
        // A total of 800: each caller's share is 100.
        let a: Vec<_> = (0..4)
            .map(|_| budget.reserve_for(1, 25, 800, 10))
            .collect::<Option<_>>()
            .expect("four of 25 fit a share of 100");
        assert!(
            budget.reserve_for(1, 1, 800, 10).is_none(),
            "the share is full"
        );
        let b = budget
            .reserve_for(2, 100, 800, 10)
            .expect("another caller has its own");
        assert_eq!(budget.used(), 200);
        drop(a);
        assert!(budget.reserve_for(1, 100, 800, 10).is_some(), "given back");
        drop(b);
        assert_eq!(budget.used(), 0);
        assert!(
            budget.shares.lock().unwrap().is_empty(),
            "no caller is remembered"
        );
        // A share always holds one body of the floor.
        assert!(budget.reserve_for(3, 64, 80, 64).is_some());
    }

    #[test]
    fn the_first_bound_a_body_would_fail_is_its_deadline() {
        let s = settings();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        // Nothing yet: the gap comes first (3 s), before the grace (5 s).
        assert_eq!(deadline(&s, t0, t0, 0), (at(3_000), Reason::BodyTimeout));
        // Recent progress but little data: the grace ends it.
        assert_eq!(
            deadline(&s, t0, at(4_000), 10),
            (at(5_000), Reason::BodyTooSlow)
        );
        // 20 000 bytes keep up 1 000 a second for 20 s.
        assert_eq!(
            deadline(&s, t0, at(19_000), 20_000),
            (at(20_000), Reason::BodyTooSlow)
        );
        // However fast, never past the total.
        assert_eq!(
            deadline(&s, t0, at(59_000), 1 << 40),
            (at(60_000), Reason::BodyTooSlow)
        );
    }

    #[test]
    fn the_budget_holds_what_reservations_hold() {
        let budget = BodyBudget::new();
        let a = budget.reserve(60, 100).unwrap();
        assert!(budget.reserve(41, 100).is_none());
        let b = budget.reserve(40, 100).unwrap();
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        drop(b);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_watched_body_expires_when_it_falls_behind_and_never_once_over() {
        let watch = Arc::new(BodyWatch::new(settings()));
        let t0 = Instant::now();
        // Not started: nothing to watch.
        let idle = tokio::time::timeout(Duration::from_secs(600), watch.expired()).await;
        assert!(idle.is_err());
        watch.start(Instant::now());
        let feeder = {
            let watch = watch.clone();
            tokio::spawn(async move {
                // 100 bytes a second: within the gap, below the rate.
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    watch.read(100, false, Instant::now());
                }
            })
        };
        assert_eq!(watch.expired().await, Reason::BodyTooSlow);
        assert_eq!(Instant::now() - t0, Duration::from_secs(600 + 5));
        feeder.abort();

        let done = BodyWatch::new(settings());
        done.start(Instant::now());
        done.read(10, true, Instant::now());
        let over = tokio::time::timeout(Duration::from_secs(600), done.expired()).await;
        assert!(over.is_err(), "a finished body is never late");
    }
}
