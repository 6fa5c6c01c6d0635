//! Script calls batched per hash slot, driven on the store's own thread.
//!
//! Requests that arrive while a call for their slot is in flight are
//! queued and sent together as the next call: one script call then decides
//! a whole batch, one request after the other, reading and writing each key
//! once. At low load a request goes out at once; under load the batches
//! grow, and the work per request (in Redis and in this process) falls. A
//! standalone server has one queue (slot 0); Redis Cluster one per slot.
//!
//! # Under a flood
//!
//! A flood saturates the gateway's threads, not Redis: under `h2load` on
//! both cores (`bench/flood.py`), Redis answered each script call in 58 to
//! 137 µs while thousands of decisions a second waited longer than
//! `timeout_ms`, because the driver that sends batches and reads replies
//! was a task on a proxy runtime, queued behind thousands of request
//! tasks, and three timers (the decision's, the call's, the client
//! library's) each counted that wait. Every late decision was taken for a
//! store failure: the breaker opened and `on_store_error` decided everyone
//! (390 000 `fail_open` decisions in 8 s, bench/RESULTS.md). So:
//!
//! - **The driver has its own thread** ([`StoreThread`]): a current-thread
//!   runtime on which the connection is made and every call is sent and
//!   read. The proxy threads only queue a request and wait for its reply;
//!   however busy they are, replies are read as Redis sends them. The
//!   kernel favours a thread that mostly sleeps, so it gets the CPU it
//!   needs on a saturated machine.
//! - **Late is not failing.** The store is judged on its calls alone: a
//!   call with no reply `timeout_ms` after it was sent, a broken
//!   connection or an error reply is a store failure. A decision still
//!   queued `timeout_ms` after it arrived waited because calls ahead of it
//!   were out, which is the gateway's load, not the store's silence (that
//!   the calls' own bounds tell): it is shed ([`Overload::Wait`]), counts
//!   neither for nor against the breaker, and no failure mode decides it.
//!   Unless the store itself has answered no call for as long: then the
//!   calls ahead are failing, not slow, and the job fails with them
//!   (`Timeout`), so its limits follow their `on_store_error` rather than
//!   being refused as overload.
//!   A call's bound runs on the store's thread, which reads whatever
//!   replies have arrived before it concludes (a timer that fires in the
//!   same wake-up as a reply does not win over it); when that timer fired
//!   late (the thread, or the whole machine, could not run for a moment),
//!   the call gets one more full `timeout_ms`, since the store has that
//!   stall to catch up on too. The caller awaits its answer with no timer
//!   of its own: a decision waits at most `timeout_ms` to be sent and its
//!   call's bound after.
//! - **Waiting is bounded by count**: at most `max_pending` decisions are
//!   queued or in flight; one more is shed at once ([`Overload::Pending`]).
//!   A job whose caller gave up, or whose deadline passed before it could
//!   be sent, is answered without costing Redis anything.
//!
//! # Batch size and calls in flight
//!
//! Batches size themselves: a call carries whatever arrived while the one
//! before was out, up to [`MAX_BATCH`], so the batch grows with the arrival
//! rate and Redis does less per request exactly when there are more. One
//! call is in flight at a time, since on two cores (bench/) one larger batch
//! costs Redis less than two smaller ones; but when a full batch is already
//! waiting behind the one being formed, a second call goes out at once,
//! pipelined on the same connection: the next batch could not grow any
//! more, and waiting would only add a round trip (a distant Redis, a burst
//! beyond `MAX_BATCH` per round trip).
//!
//! While a call is out the store's thread does not watch its queue: a
//! request queued then waits for the call's end either way, and waking the
//! thread for each, only to put it in line, was a context switch per
//! request (and on a virtual machine an interrupt to the other core) that
//! cost the thread more than its calls (bench/NOTES.md). What was queued
//! meanwhile is taken in at once when the call ends; the thread is woken
//! before that only when a full batch waits (`Signal`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::limits::{Overload, StoreError};
use crate::trace::otlp::CallSpan;
use crate::trace::CallRef;

/// Requests in one script call, at most.
pub const MAX_BATCH: usize = 128;
/// Script calls in flight on one queue at once (the second only when a
/// full batch waits).
const MAX_CALLS_IN_FLIGHT: usize = 2;

/// The bounds on waiting for the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// `store.timeout_ms`: a call without a reply for this long means the
    /// store is failing; a decision waiting this long is late.
    pub timeout: Duration,
    /// `store.max_pending`: decisions queued or in flight, at most.
    pub max_pending: usize,
}

impl Bounds {
    /// The default `store.max_pending`.
    pub const MAX_PENDING: usize = 4096;

    /// Calls bounded by `timeout`, with the default pending bound.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            max_pending: Self::MAX_PENDING,
        }
    }
}

/// Where batches go: one call decides a batch of requests.
#[async_trait]
pub trait Link: Send + Sync + 'static {
    /// One request's part of a call.
    type Request: Send + Sync + 'static;
    /// One request's part of the reply.
    type Reply: Send + 'static;

    /// Decides `batch` in one call: one answer per request, in order. A
    /// request's own error says that its part of the call failed while
    /// others' went through; an error for the whole call, that none did.
    async fn call(
        &self,
        batch: &[&Self::Request],
    ) -> Result<Vec<Result<Self::Reply, StoreError>>, StoreError>;

    /// Whether the store answers at all.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Makes the link ready for its first call (connected, scripts
    /// loaded), so that the first decisions do not pay for it.
    async fn warm(&self) -> Result<(), StoreError> {
        self.ping().await
    }

    /// A call got no reply in time: the link may want a new connection.
    fn forget(&self) {}

    /// One plain command (admin records, never a decision).
    async fn query(&self, cmd: redis::Cmd) -> Result<redis::Value, StoreError> {
        let _ = cmd;
        Err(StoreError::Refused("this link runs scripts only".into()))
    }
}

/// A job's answer, with the call that made it when its request is traced.
type Answer<R> = (Result<R, StoreError>, Option<CallRef>);

/// A request waiting in a batch queue.
struct Job<L: Link> {
    request: L::Request,
    reply: oneshot::Sender<Answer<L::Reply>>,
    /// Its request is sampled for tracing: the call is exported as a span.
    traced: bool,
    /// `timeout` after it was queued.
    deadline: Instant,
    /// Counts the job as pending until the driver is done with it.
    _pending: Pending,
}

/// One pending decision, counted until dropped.
struct Pending(Arc<AtomicUsize>);

impl Pending {
    /// Counts one more, unless `max` are pending already.
    fn enter(count: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(count.clone()))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the drivers of every queue share.
struct Core<L> {
    link: L,
    bounds: Bounds,
    pending: Arc<AtomicUsize>,
    /// When the store last answered a call.
    heard: Mutex<Instant>,
}

/// The queues of one link, one per hash slot in use.
pub struct Batches<L: Link> {
    core: Arc<Core<L>>,
    queues: Mutex<HashMap<u16, Queue<L>, ahash::RandomState>>,
    /// Where the drivers and the connection run.
    runtime: Handle,
    /// Stops the store's thread when the batches go.
    _thread: Option<StoreThread>,
}

impl<L: Link> Batches<L> {
    /// Queues for calls on `link`, driven on a thread of their own. The
    /// link warms up at once, in the background (connects, loads its
    /// script), so that the first decisions do not wait for that.
    pub fn new(link: L, bounds: Bounds) -> Result<Self, StoreError> {
        let (runtime, thread) = StoreThread::start()?;
        let batches = Self::with(runtime, Some(thread), link, bounds);
        let core = batches.core.clone();
        batches.runtime.spawn(async move {
            let _ = core.link.warm().await;
        });
        Ok(batches)
    }

    /// Queues driven on `runtime` (tests in paused time).
    pub fn on(runtime: Handle, link: L, bounds: Bounds) -> Self {
        Self::with(runtime, None, link, bounds)
    }

    fn with(runtime: Handle, thread: Option<StoreThread>, link: L, bounds: Bounds) -> Self {
        Self {
            core: Arc::new(Core {
                link,
                bounds,
                pending: Arc::default(),
                heard: Mutex::new(Instant::now()),
            }),
            queues: Default::default(),
            runtime,
            _thread: thread,
        }
    }

    /// Decisions queued or in flight.
    pub fn pending(&self) -> usize {
        self.core.pending.load(Ordering::Relaxed)
    }

    /// Queues one request (all its keys in `slot`) for the next call of
    /// that slot, and waits for its part of the answer.
    ///
    /// The store's thread answers every job, in time: one still queued
    /// `timeout` after it arrived is shed (then, or as the call it waited
    /// behind ends, itself within its bound); one sent is answered by its
    /// call, itself bounded. So the caller needs no timer of its own.
    pub async fn submit(&self, slot: u16, request: L::Request) -> Result<L::Reply, StoreError> {
        let bounds = self.core.bounds;
        let pending = Pending::enter(&self.core.pending, bounds.max_pending)
            .ok_or(StoreError::Overloaded(Overload::Pending))?;
        let (reply, rx) = oneshot::channel();
        let job = Job {
            request,
            reply,
            traced: crate::trace::traced(),
            deadline: Instant::now() + bounds.timeout,
            _pending: pending,
        };
        self.queue(slot).send(job).map_err(|()| stopped())?;
        let (answer, call) = rx.await.unwrap_or_else(|_| (Err(stopped()), None));
        if let Some(call) = call {
            crate::trace::note_call(call);
        }
        answer
    }

    /// Queues one request for the next call of `slot` now, before this
    /// returns, so that anything queued after it is decided after it;
    /// its answer is awaited on the store's thread, and `failed` told if
    /// it fails. `false` when `max_pending` decisions are pending already.
    pub fn queue_now(
        &self,
        slot: u16,
        request: L::Request,
        failed: impl FnOnce(StoreError) + Send + 'static,
    ) -> bool {
        let bounds = self.core.bounds;
        let Some(pending) = Pending::enter(&self.core.pending, bounds.max_pending) else {
            return false;
        };
        let (reply, rx) = oneshot::channel();
        let job = Job {
            request,
            reply,
            traced: false,
            deadline: Instant::now() + bounds.timeout,
            _pending: pending,
        };
        if self.queue(slot).send(job).is_err() {
            return false;
        }
        self.runtime.spawn(async move {
            match rx.await {
                Ok((Ok(_), _)) => {}
                Ok((Err(e), _)) => failed(e),
                Err(_) => failed(stopped()),
            }
        });
        true
    }

    /// The queue of `slot`, with its driver started on first use.
    fn queue(&self, slot: u16) -> Queue<L> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        queues
            .entry(slot)
            .or_insert_with(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                let signal = Arc::new(Signal {
                    queued: AtomicUsize::new(0),
                    room: AtomicUsize::new(usize::MAX),
                    full: Notify::new(),
                    #[cfg(test)]
                    wakes: AtomicUsize::new(0),
                });
                self.runtime
                    .spawn(drive(rx, signal.clone(), self.core.clone()));
                Queue { tx, signal }
            })
            .clone()
    }

    /// Whether the store answers, at most `timeout`; sent from the store's
    /// thread like every call.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let core = self.core.clone();
        self.runtime
            .spawn(async move {
                bounded(core.bounds.timeout, core.link.ping())
                    .await
                    .unwrap_or(Err(StoreError::Timeout))
            })
            .await
            .unwrap_or_else(|_| Err(stopped()))
    }
}

impl<L: Link> Batches<L> {
    /// One plain command, sent from the store's thread and bounded by
    /// `timeout` like every call; never batched with decisions.
    pub async fn query(&self, cmd: redis::Cmd) -> Result<redis::Value, StoreError> {
        let core = self.core.clone();
        self.runtime
            .spawn(async move {
                bounded(core.bounds.timeout, core.link.query(cmd))
                    .await
                    .unwrap_or(Err(StoreError::Timeout))
            })
            .await
            .unwrap_or_else(|_| Err(stopped()))
    }
}

/// One slot's queue, as its senders hold it.
struct Queue<L: Link> {
    tx: mpsc::UnboundedSender<Job<L>>,
    signal: Arc<Signal>,
}

impl<L: Link> Clone for Queue<L> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            signal: self.signal.clone(),
        }
    }
}

/// What a queue's senders tell its driver beside the jobs themselves. The
/// driver does not watch the channel while a call is out: a job sent then
/// waits for the call's end either way, and waking the store's thread for
/// each (a context switch, and on a virtual machine an interrupt to the
/// other core) cost it more than the calls did. It is woken only when a
/// full batch waits, which may go out beside the call.
struct Signal {
    /// Jobs sent and not yet taken in by the driver.
    queued: AtomicUsize,
    /// Jobs that make a full batch with those the driver holds, while one
    /// call is out (`usize::MAX` otherwise: no wake-up wanted).
    room: AtomicUsize,
    /// Woken when `queued` reaches `room`.
    full: Notify,
    /// The driver's wake-ups.
    #[cfg(test)]
    wakes: AtomicUsize,
}

impl<L: Link> Queue<L> {
    /// Sends `job` to the driver; `Err` when it has stopped.
    fn send(&self, job: Job<L>) -> Result<(), ()> {
        let signal = &self.signal;
        // (Counted before it is sent, so that the driver, which counts it
        // out once received, never sees it uncounted.)
        let queued = signal.queued.fetch_add(1, Ordering::SeqCst) + 1;
        if self.tx.send(job).is_err() {
            signal.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(());
        }
        if queued >= signal.room.load(Ordering::SeqCst) {
            signal.full.notify_one();
        }
        Ok(())
    }
}

fn stopped() -> StoreError {
    StoreError::Refused("the store driver stopped".into())
}

impl<L: Link> Core<L> {
    /// One call for `batch`, bounded by `timeout` from now.
    async fn call(
        &self,
        batch: &[Job<L>],
    ) -> Result<Vec<Result<L::Reply, StoreError>>, StoreError> {
        let requests: Vec<&L::Request> = batch.iter().map(|j| &j.request).collect();
        let result = bounded(self.bounds.timeout, self.link.call(&requests))
            .await
            .unwrap_or_else(|| {
                self.link.forget();
                Err(StoreError::Timeout)
            });
        if result.is_ok() {
            *self.heard.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
        result
    }

    /// What a job that waited its whole `timeout` in the queue is told:
    /// while the store answers, it waited behind the gateway's own load
    /// and is shed; when the store has been silent for as long, its calls
    /// are failing, and the job's limits follow their `on_store_error`.
    fn expired(&self, now: Instant) -> StoreError {
        let heard = *self.heard.lock().unwrap_or_else(|e| e.into_inner());
        if now.saturating_duration_since(heard) >= self.bounds.timeout {
            StoreError::Timeout
        } else {
            StoreError::Overloaded(Overload::Wait)
        }
    }

    /// The next batch from the front of `waiting`: jobs that still want an
    /// answer and still have time for one, up to [`MAX_BATCH`]; the others
    /// are answered on the way.
    fn take_batch(&self, waiting: &mut VecDeque<Job<L>>, now: Instant) -> Vec<Job<L>> {
        let mut batch = Vec::with_capacity(waiting.len().min(MAX_BATCH));
        while batch.len() < MAX_BATCH {
            let Some(job) = waiting.pop_front() else {
                break;
            };
            if job.reply.is_closed() {
                // Its caller went away.
            } else if job.deadline <= now {
                let _ = job.reply.send((Err(self.expired(now)), None));
            } else {
                batch.push(job);
            }
        }
        batch
    }

    /// Answers the waiting jobs whose deadline has passed by `now`: they
    /// waited behind calls that were out ([`Core::expired`]).
    fn expire(&self, waiting: &mut VecDeque<Job<L>>, now: Instant) {
        while waiting.front().is_some_and(|j| j.deadline <= now) {
            if let Some(job) = waiting.pop_front() {
                let _ = job.reply.send((Err(self.expired(now)), None));
            }
        }
    }
}

/// Sends queued jobs in batches, one call at a time (two when a full batch
/// waits), and sheds the jobs that wait past their deadline, until the
/// queue closes.
async fn drive<L: Link>(
    mut rx: mpsc::UnboundedReceiver<Job<L>>,
    signal: Arc<Signal>,
    core: Arc<Core<L>>,
) {
    let mut waiting: VecDeque<Job<L>> = VecDeque::new();
    let mut calls: JoinSet<()> = JoinSet::new();
    // One timer for the oldest waiting job's deadline, moved as it changes.
    let mut armed: Option<Instant> = None;
    let expiry = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(expiry);
    loop {
        // What was sent while calls were out, all at once.
        let mut taken = 0;
        while let Ok(job) = rx.try_recv() {
            waiting.push_back(job);
            taken += 1;
        }
        if taken > 0 {
            signal.queued.fetch_sub(taken, Ordering::SeqCst);
        }
        while may_send(calls.len(), waiting.len()) {
            let batch = core.take_batch(&mut waiting, Instant::now());
            if !batch.is_empty() {
                let core = core.clone();
                calls.spawn(async move {
                    // A call serving a sampled request is a span of its own.
                    let span = batch
                        .iter()
                        .any(|j| j.traced)
                        .then(|| CallSpan::start(batch.len()));
                    let result = core.call(&batch).await;
                    let call = span.as_ref().map(CallSpan::call);
                    if let Some(span) = span {
                        span.finish(result.as_ref().err().map(StoreError::reason));
                    }
                    dispatch(batch, result, call);
                });
            }
        }
        let deadline = waiting.front().map(|job| job.deadline);
        if deadline.is_some() && deadline != armed {
            expiry.as_mut().reset(deadline.unwrap_or_else(Instant::now));
        }
        armed = deadline;
        let room = match calls.len() {
            1 => MAX_BATCH.saturating_sub(waiting.len()).max(1),
            _ => usize::MAX,
        };
        signal.room.store(room, Ordering::SeqCst);
        tokio::select! {
            job = rx.recv(), if calls.is_empty() => match job {
                Some(job) => {
                    signal.queued.fetch_sub(1, Ordering::SeqCst);
                    waiting.push_back(job);
                }
                // The batches were dropped.
                None => return,
            },
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
            () = signal.full.notified(), if calls.len() == 1 => {}
            () = &mut expiry, if armed.is_some() => {
                core.expire(&mut waiting, Instant::now());
                armed = None;
            }
        }
        #[cfg(test)]
        signal.wakes.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether a batch may go out with `in_flight` calls out and `waiting`
/// jobs queued: when no call is out, or a full batch waits beside one.
fn may_send(in_flight: usize, waiting: usize) -> bool {
    waiting > 0 && (in_flight == 0 || (in_flight < MAX_CALLS_IN_FLIGHT && waiting >= MAX_BATCH))
}

/// How late a timer of the store's thread may fire before the thread is
/// taken to have been kept from running.
const SLACK: Duration = Duration::from_millis(2);

/// Awaits `call` for `bound`. When the bound passes, the tasks already
/// woken on this thread run first (a reply read in the same wake-up as the
/// timer counts), then `call` is looked at once more. When the timer fired
/// late (the thread could not run: the gateway's own load, or the machine
/// stopped), the call gets one more full `bound`: the store has the same
/// stall to catch up on, and a store is judged silent only over time the
/// gateway was there to hear it.
async fn bounded<F: std::future::Future>(bound: Duration, call: F) -> Option<F::Output> {
    let mut call = std::pin::pin!(call);
    let mut deadline = Instant::now() + bound;
    let mut extended = false;
    loop {
        if let Ok(out) = tokio::time::timeout_at(deadline, call.as_mut()).await {
            return Some(out);
        }
        tokio::task::yield_now().await;
        if let Ok(out) = tokio::time::timeout(Duration::ZERO, call.as_mut()).await {
            return Some(out);
        }
        let late = Instant::now().saturating_duration_since(deadline);
        if extended || late <= SLACK {
            return None;
        }
        extended = true;
        deadline = Instant::now() + bound;
    }
}

/// Hands every job its part of the reply, and a traced one the call.
fn dispatch<L: Link>(
    batch: Vec<Job<L>>,
    result: Result<Vec<Result<L::Reply, StoreError>>, StoreError>,
    call: Option<CallRef>,
) {
    let replies = result.and_then(|replies| {
        if replies.len() == batch.len() {
            Ok(replies)
        } else {
            Err(StoreError::Reply(format!(
                "{} replies for {} requests",
                replies.len(),
                batch.len()
            )))
        }
    });
    match replies {
        Ok(replies) => {
            for (job, reply) in batch.into_iter().zip(replies) {
                let call = call.filter(|_| job.traced);
                let _ = job.reply.send((reply, call));
            }
        }
        Err(e) => {
            for job in batch {
                let call = call.filter(|_| job.traced);
                let _ = job.reply.send((Err(e.clone()), call));
            }
        }
    }
}

/// The store's own thread: a current-thread runtime where its connection
/// lives and its batches are driven, out of reach of the proxy threads'
/// load. It stops when this is dropped.
pub struct StoreThread {
    _stop: oneshot::Sender<()>,
}

impl StoreThread {
    /// Starts the thread; the handle of its runtime.
    pub fn start() -> Result<(Handle, Self), StoreError> {
        let (stop, stopped) = oneshot::channel::<()>();
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("tollgate-store".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match runtime {
                    Ok(runtime) => {
                        let _ = handle_tx.send(Ok(runtime.handle().clone()));
                        runtime.block_on(async {
                            let _ = stopped.await;
                        });
                    }
                    Err(e) => drop(handle_tx.send(Err(e.to_string()))),
                }
            })
            .map_err(|e| StoreError::Refused(format!("cannot start the store thread: {e}")))?;
        let handle = handle_rx
            .recv()
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|e| StoreError::Refused(format!("cannot start the store runtime: {e}")))?;
        Ok((handle, Self { _stop: stop }))
    }
}

#[cfg(test)]
mod tests;
