//! The shared store on Redis. Every request's shared limits are decided by
//! `lua/decide.lua` in one round trip, over one multiplexed connection that
//! reconnects by itself.
//!
//! Requests that arrive while a call is in flight are queued and sent
//! together as the next call: one `EVALSHA` then decides a whole batch, one
//! request after the other, reading and writing each key once. At low load
//! a request goes out at once; under load the batches grow, and the work
//! per request (in Redis and in this process) falls. The batching serves
//! Redis Cluster too ([`super::cluster`]), with one queue per hash slot.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::RedisFuture;
use redis::{ErrorKind, RedisError, ServerErrorKind};
use tokio::sync::{mpsc, oneshot, OnceCell};

use super::algorithm::Params;
use super::keys::{KeyCache, KeyHasher, CACHED_KEYS};
use super::{Charge, LimitStore, Source, StoreError, Verdict, NONE_BLOCKED};
use crate::clock::{Clock, ManualClock};

/// The decision script, embedded at build time.
pub const DECIDE_LUA: &str = include_str!("../../lua/decide.lua");

/// Requests in one script call, at most.
const MAX_BATCH: usize = 128;
/// Script calls in flight at once. Measured on two cores (bench/): with one,
/// requests gather into larger batches while a call is out, and throughput
/// is higher than with two, whose smaller batches cost Redis more per request.
const MAX_CALLS_IN_FLIGHT: usize = 1;
/// Requests waiting for a call, at most; beyond that the store is failing.
const QUEUE: usize = 4096;

/// One limit as the script reads it.
pub(super) struct Spec {
    kind: u8,
    a: u64,
    b: u64,
    cost: u64,
    /// `group * 2 + 1` when enforced, `group * 2` for shadow limits.
    flags: u8,
}

/// One request's shared limits, as the script reads them.
pub(super) struct Request {
    pub keys: Vec<Arc<str>>,
    pub limits: Vec<Spec>,
    pub blocked_from: u8,
    /// 0 to decide; otherwise the store time at which these charges were
    /// spent by a decision since undone, to give them back.
    pub refund_at: u64,
}

impl Request {
    /// The script's view of some charges.
    pub fn new(keys: Vec<Arc<str>>, charges: &[&Charge], blocked_from: u8, refund_at: u64) -> Self {
        let limits = charges
            .iter()
            .map(|c| {
                debug_assert!(c.group < 128, "flags hold the group in 7 bits");
                let (kind, a, b) = encode(c.params);
                Spec {
                    kind,
                    a,
                    b,
                    cost: c.cost,
                    flags: c.group * 2 + u8::from(c.enforce),
                }
            })
            .collect();
        Self {
            keys,
            limits,
            blocked_from,
            refund_at,
        }
    }
}

/// The verdicts of a request and the store time they were reached at.
pub(super) type Decided = (Vec<Verdict>, u64);

/// A request waiting in a batch queue.
struct Job {
    request: Request,
    reply: oneshot::Sender<Result<Decided, StoreError>>,
}

/// Where script calls go.
enum Link {
    /// One server, over a connection made on first use and remade
    /// whenever it breaks.
    Single {
        client: redis::Client,
        config: ConnectionManagerConfig,
        conn: OnceCell<ConnectionManager>,
    },
    /// A cluster: each call goes to the node of its keys' slot.
    Cluster {
        client: ClusterClient,
        conn: OnceCell<ClusterConnection>,
    },
}

/// The connection and the script, shared by the drivers and their callers.
struct Connection {
    /// Connected on first use, inside the runtime that serves requests.
    link: Link,
    sha: String,
    timeout: Duration,
    /// Tests only: the script takes its time from here instead of `TIME`.
    clock: Option<ManualClock>,
}

/// Script calls batched per hash slot: requests that wait while a call for
/// their slot is in flight go out together in its next call. A standalone
/// server has one queue (slot 0).
pub(super) struct Batches {
    connection: Arc<Connection>,
    queues: std::sync::Mutex<HashMap<u16, mpsc::Sender<Job>, ahash::RandomState>>,
}

impl Batches {
    fn new(link: Link, timeout: Duration) -> Self {
        Self {
            connection: Arc::new(Connection {
                link,
                sha: redis::Script::new(DECIDE_LUA).get_hash().to_string(),
                timeout,
                clock: None,
            }),
            queues: Default::default(),
        }
    }

    /// Calls for one server.
    fn single(url: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(backend)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(100))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200));
        let link = Link::Single {
            client,
            config,
            conn: OnceCell::new(),
        };
        Ok(Self::new(link, timeout))
    }

    /// Calls for a cluster reached through `seeds`.
    pub fn cluster(seeds: &[String], timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::cluster::ClusterClientBuilder::new(seeds.to_vec())
            .connection_timeout(timeout.max(Duration::from_millis(100)))
            .response_timeout(timeout)
            .retries(1)
            .build()
            .map_err(backend)?;
        let link = Link::Cluster {
            client,
            conn: OnceCell::new(),
        };
        Ok(Self::new(link, timeout))
    }

    /// Queues one request (all its keys in `slot`) for the next script call
    /// of that slot, and waits for its part of the answer.
    pub async fn submit(&self, slot: u16, request: Request) -> Result<Decided, StoreError> {
        if request.limits.len() > usize::from(u16::MAX) {
            // The script reads a request's limit count as 16 bits.
            return Err(StoreError::Backend(format!(
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
            .map_err(|_| StoreError::Backend("the store queue is full".into()))?;
        rx.await
            .unwrap_or_else(|_| Err(StoreError::Backend("the store driver stopped".into())))
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.connection.connect().await?;
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .map(drop)
            .map_err(backend)
    }
}

/// Limit state in one Redis server (or one primary).
pub struct RedisStore {
    batches: Batches,
    keys: KeyCache,
}

impl RedisStore {
    /// Prepares a connection; it is made on first use and remade whenever it
    /// breaks, so a gateway can start while Redis is down.
    pub fn new(url: &str, keys: KeyHasher, timeout: Duration) -> Result<Self, StoreError> {
        Ok(Self {
            batches: Batches::single(url, timeout)?,
            keys: KeyCache::new(keys, CACHED_KEYS),
        })
    }

    /// Makes the script use this clock instead of the server's `TIME`, so
    /// that tests can hold it against the in-process store step by step.
    pub fn with_test_clock(mut self, clock: ManualClock) -> Self {
        if let Some(conn) = Arc::get_mut(&mut self.batches.connection) {
            conn.clock = Some(clock);
        }
        self
    }

    async fn submit(
        &self,
        charges: &[&Charge],
        blocked_from: u8,
        refund_at: u64,
    ) -> Result<Vec<Verdict>, StoreError> {
        let keys = charges.iter().map(|c| self.keys.key(c)).collect();
        let request = Request::new(keys, charges, blocked_from, refund_at);
        self.batches.submit(0, request).await.map(|(v, _)| v)
    }

    /// Gives back what a decision at store time `spent_at` charged for these
    /// charges, as [`MemoryStore::refund`] does.
    ///
    /// [`MemoryStore::refund`]: super::memory::MemoryStore::refund
    pub async fn refund(&self, charges: &[&Charge], spent_at: u64) -> Result<(), StoreError> {
        if charges.is_empty() {
            return Ok(());
        }
        self.submit(charges, NONE_BLOCKED, spent_at.max(1))
            .await
            .map(drop)
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
            let result = match tokio::time::timeout(conn.timeout, conn.call(&batch)).await {
                Ok(result) => result,
                Err(_) => Err(StoreError::Timeout),
            };
            dispatch(batch, result);
            drop(slot);
        });
    }
}

/// Bytes of one number in the script's reply.
const NUMBER: usize = 8;
/// Bytes of one limit's verdict in the script's reply.
const VERDICT: usize = 4 * NUMBER;

/// Hands every job its part of the reply.
fn dispatch(batch: Vec<Job>, result: Result<Vec<u8>, StoreError>) {
    let limits: usize = batch.iter().map(|j| j.request.limits.len()).sum();
    let decoded = result.and_then(|reply| decode(&reply, limits));
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

/// The script's reply for `limits` limits: their verdicts in order, and the
/// store time they were decided at.
fn decode(reply: &[u8], limits: usize) -> Result<(Vec<Verdict>, u64), StoreError> {
    let expected = limits * VERDICT + NUMBER;
    if reply.len() != expected {
        return Err(StoreError::Backend(format!(
            "decide.lua replied {} bytes, expected {expected}",
            reply.len()
        )));
    }
    let (verdicts, time) = reply.split_at(limits * VERDICT);
    let verdicts = verdicts.chunks_exact(VERDICT).map(verdict).collect();
    Ok((verdicts, number(time, 0).max(0) as u64))
}

/// The `i`th little-endian `i64` of `bytes`.
fn number(bytes: &[u8], i: usize) -> i64 {
    let mut word = [0u8; NUMBER];
    word.copy_from_slice(&bytes[i * NUMBER..(i + 1) * NUMBER]);
    i64::from_le_bytes(word)
}

/// One limit's verdict: four little-endian `i64`s.
fn verdict(bytes: &[u8]) -> Verdict {
    let n = |i: usize| number(bytes, i);
    Verdict {
        allowed: n(0) == 1,
        remaining: n(1).max(0) as u64,
        wait_ms: u64::try_from(n(2)).ok(),
        reset_ms: n(3).max(0) as u64,
        source: Source::Store,
    }
}

impl Connection {
    /// The connection, made on first use (and, for a standalone server,
    /// remade by the manager whenever it breaks).
    async fn connect(&self) -> Result<Conn, StoreError> {
        match &self.link {
            Link::Single {
                client,
                config,
                conn,
            } => conn
                .get_or_try_init(|| async {
                    ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                })
                .await
                .map(|c| Conn::Single(c.clone())),
            Link::Cluster { client, conn } => conn
                .get_or_try_init(|| client.get_async_connection())
                .await
                .map(|c| Conn::Cluster(c.clone())),
        }
        .map_err(backend)
    }

    /// The script call for a batch (see [`script_call`]), `EVALSHA` with the
    /// script's hash or `EVAL` with its text.
    fn script(&self, command: &str, script: &str, batch: &[Job]) -> redis::Cmd {
        let now = self.clock.as_ref().map_or(0, |c| c.now_ms());
        script_call(command, script, batch.iter().map(|j| &j.request), now)
    }

    async fn call(&self, batch: &[Job]) -> Result<Vec<u8>, StoreError> {
        let mut conn = self.connect().await?;
        match self
            .script("EVALSHA", &self.sha, batch)
            .query_async(&mut conn)
            .await
        {
            // The server lost its script cache (a restart, SCRIPT FLUSH) or a
            // cluster node never had it: EVAL sends the text, which the
            // server then keeps for the next EVALSHA.
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => self
                .script("EVAL", DECIDE_LUA, batch)
                .query_async(&mut conn)
                .await
                .map_err(backend),
            other => other.map_err(backend),
        }
    }
}

/// A connection of either kind.
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The script call (`EVALSHA` with the script's hash, or `EVAL` with its
/// text) for some requests: their distinct keys, then all their numbers in
/// one binary argument (see `lua/decide.lua`). `now` 0 means Redis's time.
fn script_call<'a>(
    command: &str,
    script: &str,
    requests: impl Iterator<Item = &'a Request> + Clone,
    now: u64,
) -> redis::Cmd {
    let mut index: HashMap<&str, u32, ahash::RandomState> = HashMap::default();
    let mut keys: Vec<&str> = Vec::new();
    let size = requests.clone().map(|r| 11 + r.limits.len() * 30).sum();
    let mut bytes = Vec::with_capacity(size);
    let mut count = 0;
    for r in requests {
        count += 1;
        bytes.push(r.blocked_from);
        bytes.extend_from_slice(&(r.limits.len() as u16).to_le_bytes());
        bytes.extend_from_slice(&r.refund_at.to_le_bytes());
        for (key, l) in r.keys.iter().zip(&r.limits) {
            let k = *index.entry(key).or_insert_with(|| {
                keys.push(key);
                keys.len() as u32
            });
            bytes.extend_from_slice(&k.to_le_bytes());
            bytes.push(l.kind);
            for n in [l.a, l.b, l.cost] {
                bytes.extend_from_slice(&n.to_le_bytes());
            }
            bytes.push(l.flags);
        }
    }
    let mut cmd = redis::cmd(command);
    cmd.arg(script).arg(keys.len()).arg(&keys);
    cmd.arg(now).arg(count).arg(&bytes[..]);
    cmd
}

/// The script's numbers for one limit: kind, a, b.
fn encode(params: Params) -> (u8, u64, u64) {
    match params {
        Params::TokenBucket(b) => (1, b.capacity, b.per_ms),
        Params::Gcra(b) => (2, b.capacity, b.per_ms),
        Params::FixedWindow(w) => (3, w.limit, w.window_ms),
        Params::SlidingWindow(w) => (4, w.limit, w.window_ms),
        Params::SlidingLog(w) => (5, w.limit, w.window_ms),
    }
}

fn backend(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout
    } else {
        StoreError::Backend(e.to_string())
    }
}

#[async_trait]
impl LimitStore for RedisStore {
    async fn decide(
        &self,
        charges: &[&Charge],
        blocked_from: u8,
    ) -> Result<Vec<Verdict>, StoreError> {
        self.submit(charges, blocked_from, 0).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.batches.ping().await
    }
}
