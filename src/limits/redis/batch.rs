//! Script calls batched per hash slot. Requests that arrive while a call
//! for their slot is in flight are queued and sent together as the next
//! call: one `EVALSHA` then decides a whole batch, one request after the
//! other, reading and writing each key once. At low load a request goes
//! out at once; under load the batches grow, and the work per request (in
//! Redis and in this process) falls. A standalone server has one queue
//! (slot 0); Redis Cluster one per slot.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::codec::{self, Decided, Request};
use super::conn::Connection;
use crate::limits::StoreError;

/// Requests in one script call, at most.
const MAX_BATCH: usize = 128;
/// Script calls in flight at once. Measured on two cores (bench/): with one,
/// requests gather into larger batches while a call is out, and throughput
/// is higher than with two, whose smaller batches cost Redis more per request.
const MAX_CALLS_IN_FLIGHT: usize = 1;
/// Requests waiting for a call, at most; beyond that the store is failing.
const QUEUE: usize = 4096;

/// A request waiting in a batch queue.
struct Job {
    request: Request,
    reply: oneshot::Sender<Result<Decided, StoreError>>,
}

/// The queues of one link, one per hash slot in use.
pub struct Batches {
    connection: Arc<Connection>,
    queues: std::sync::Mutex<HashMap<u16, mpsc::Sender<Job>, ahash::RandomState>>,
}

impl Batches {
    /// Queues for script calls on `connection`.
    pub fn new(connection: Connection) -> Self {
        Self {
            connection: Arc::new(connection),
            queues: Default::default(),
        }
    }

    /// Queues one request (all its keys in `slot`) for the next script call
    /// of that slot, and waits for its part of the answer.
    pub async fn submit(&self, slot: u16, request: Request) -> Result<Decided, StoreError> {
        if request.limits.len() > usize::from(u16::MAX) {
            // The script reads a request's limit count as 16 bits.
            return Err(StoreError::Refused(format!(
                "{} shared limits on one request; at most {} fit one script call",
                request.limits.len(),
                u16::MAX
            )));
        }
        let (reply, rx) = oneshot::channel();
        let queue = {
            let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
            queues
                .entry(slot)
                .or_insert_with(|| {
                    let (tx, rx) = mpsc::channel(QUEUE);
                    tokio::spawn(drive(rx, self.connection.clone()));
                    tx
                })
                .clone()
        };
        queue
            .try_send(Job { request, reply })
            .map_err(|_| StoreError::Refused("the store queue is full".into()))?;
        rx.await
            .unwrap_or_else(|_| Err(StoreError::Refused("the store driver stopped".into())))
    }

    /// `PING` on the link, for readiness.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.connection.ping().await
    }
}

/// Sends queued jobs, as many as are waiting, in a bounded number of
/// concurrent calls.
async fn drive(mut rx: mpsc::Receiver<Job>, conn: Arc<Connection>) {
    let calls = Arc::new(tokio::sync::Semaphore::new(MAX_CALLS_IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        // Wait for a free call slot first: jobs keep queueing meanwhile and
        // join this batch.
        let Ok(slot) = calls.clone().acquire_owned().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        // Callers that gave up (their timeout passed) need no answer.
        batch.retain(|job| !job.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let conn = conn.clone();
        tokio::spawn(async move {
            let requests = batch.iter().map(|j| &j.request);
            let result = match tokio::time::timeout(conn.timeout, conn.call(requests)).await {
                Ok(result) => result,
                Err(_) => {
                    conn.forget();
                    Err(StoreError::Timeout)
                }
            };
            dispatch(batch, result);
            drop(slot);
        });
    }
}

/// Hands every job its part of the reply.
fn dispatch(batch: Vec<Job>, result: Result<Vec<u8>, StoreError>) {
    let limits: usize = batch.iter().map(|j| j.request.limits.len()).sum();
    let decoded = result.and_then(|reply| codec::decode(&reply, limits));
    let (verdicts, at) = match decoded {
        Ok(decoded) => decoded,
        Err(e) => {
            return batch
                .into_iter()
                .for_each(|j| drop(j.reply.send(Err(e.clone()))))
        }
    };
    let mut verdicts = verdicts.into_iter();
    for job in batch {
        let mine = verdicts.by_ref().take(job.request.limits.len()).collect();
        let _ = job.reply.send(Ok((mine, at)));
    }
}
