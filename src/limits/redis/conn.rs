//! The link to Redis: one server's multiplexed connection that remakes
//! itself, a cluster's, or the primary that Redis Sentinel names, found
//! again after every failure; and the decision call on it.
//!
//! On a server that has functions (Redis 7), the scripts of `lua/` are
//! loaded once as a function library (`FUNCTION LOAD`), a function per
//! concern, and called with `FCALL`: their helpers are made once, not on
//! every call, where a script runs its whole text on every call (half the
//! script time: bench/script_time.py). The library's name carries the
//! scripts' hash, so gateways of different versions can share a server. On
//! Redis Cluster the library is loaded on every primary at once (replicas
//! get it from theirs; a node that joins without it is loaded again the
//! first time a call finds it missing). Elsewhere (older servers, a user
//! without the right to load functions) each concern is a script called by
//! `EVALSHA`, with `EVAL` once when the server has lost it.
//!
//! A batch holding requests of several concerns (decisions and the holds
//! released beside them) is one call per concern, give-backs first
//! ([`Concern`]): as functions, sent together in one pipeline (one round
//! trip, in an order the server keeps); on a cluster or as scripts, one
//! after the other.
//! Each request is answered by its own call: one call failing fails its
//! requests alone.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::RedisFuture;
use redis::{AsyncConnectionConfig, IntoConnectionInfo};
use redis::{ErrorKind, RedisError, ServerErrorKind};
use tokio::sync::OnceCell;

use async_trait::async_trait;

use super::batch::Link;
use super::codec::{self, Decided, Request};
use super::scripts::{Concern, Scripts};
use crate::clock::Clock;
use crate::limits::StoreError;

/// Where script calls go.
enum Target {
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
    /// The primary the sentinels name, asked for on first use and again
    /// after any failure: a failover is followed, and a node that a
    /// failover demoted (it refuses writes) is left at once.
    Sentinel {
        client: tokio::sync::Mutex<SentinelClient>,
        config: AsyncConnectionConfig,
        conn: std::sync::Mutex<Option<MultiplexedConnection>>,
    },
}

/// The connection and the script, shared by the batch drivers.
///
/// Calls are bounded by the batch driver that makes them, on the store's
/// own thread: the connection sets no response timeout of its own, so one
/// call has one bound. (A cluster's client keeps one of the same length for
/// the slot-map refreshes it makes by itself.)
pub struct Connection {
    /// Connected on first use, on the store's thread.
    link: Target,
    scripts: Scripts,
    /// Where the script's time comes from: the server's `TIME` when `None`.
    clock: Option<Arc<dyn Clock>>,
    /// Whether calls go through the function: [`UNKNOWN`], [`FCALL`] or
    /// [`EVALSHA`].
    mode: AtomicU8,
}

/// Not tried yet: the first call tries the function.
const UNKNOWN: u8 = 0;
/// The server runs the function.
const FCALL: u8 = 1;
/// The server cannot (or may not) load functions: scripts only.
const EVALSHA: u8 = 2;

impl Connection {
    fn new(link: Target, clock: Option<Arc<dyn Clock>>) -> Self {
        Self {
            link,
            scripts: Scripts::new(),
            clock,
            mode: AtomicU8::new(UNKNOWN),
        }
    }

    /// Calls for one server at `url`.
    pub fn single(
        url: &str,
        timeout: Duration,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(backend)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(100))))
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200));
        let link = Target::Single {
            client,
            config,
            conn: OnceCell::new(),
        };
        Ok(Self::new(link, clock))
    }

    /// Calls for a cluster reached through `seeds`.
    pub fn cluster(seeds: &[String], timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::cluster::ClusterClientBuilder::new(seeds.to_vec())
            .connection_timeout(timeout.max(Duration::from_millis(100)))
            .response_timeout(timeout)
            .retries(1)
            .build()
            .map_err(backend)?;
        let link = Target::Cluster {
            client,
            conn: OnceCell::new(),
        };
        Ok(Self::new(link, None))
    }

    /// Calls for the primary that the sentinels at `sentinels` know as
    /// `master_name`. The URLs' user, password and database serve for the
    /// sentinels and the primary alike; `rediss://` means TLS to both.
    pub fn sentinel(
        sentinels: &[String],
        master_name: &str,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let first = sentinels
            .first()
            .ok_or_else(|| StoreError::Connection("no sentinel url".into()))?;
        let info = first.as_str().into_connection_info().map_err(backend)?;
        let mut node = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(info.redis_settings().clone());
        if first.starts_with("rediss://") {
            node = node.set_tls_mode(redis::TlsMode::Secure);
        }
        let client = SentinelClient::build(
            sentinels.iter().map(String::as_str).collect(),
            master_name,
            Some(node),
            SentinelServerType::Master,
        )
        .map_err(backend)?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(100))))
            .set_response_timeout(None);
        let link = Target::Sentinel {
            client: tokio::sync::Mutex::new(client),
            config,
            conn: std::sync::Mutex::new(None),
        };
        Ok(Self::new(link, None))
    }

    /// Drops a sentinel link's connection after a failure, so that the next
    /// call asks the sentinels for the primary again.
    fn drop_primary(&self) {
        if let Target::Sentinel { conn, .. } = &self.link {
            *conn.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// The connection, made on first use (and, for a standalone server,
    /// remade by the manager whenever it breaks).
    async fn connect(&self) -> Result<Conn, StoreError> {
        match &self.link {
            Target::Sentinel {
                client,
                config,
                conn,
            } => {
                let cached = || conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
                if let Some(c) = cached() {
                    return Ok(Conn::Sentinel(c));
                }
                let mut client = client.lock().await;
                // Another call may have found the primary meanwhile.
                if let Some(c) = cached() {
                    return Ok(Conn::Sentinel(c));
                }
                // The sentinels name the primary; its `ROLE` is checked.
                let primary = client.async_get_client().await.map_err(backend)?;
                let c = primary
                    .get_multiplexed_async_connection_with_config(config)
                    .await
                    .map_err(backend)?;
                *conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(c.clone());
                return Ok(Conn::Sentinel(c));
            }
            Target::Single { .. } | Target::Cluster { .. } => {}
        }
        match &self.link {
            Target::Single {
                client,
                config,
                conn,
            } => conn
                .get_or_try_init(|| async {
                    ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                })
                .await
                .map(|c| Conn::Single(c.clone())),
            Target::Cluster { client, conn } => conn
                .get_or_try_init(|| client.get_async_connection())
                .await
                .map(|c| Conn::Cluster(c.clone())),
            Target::Sentinel { .. } => unreachable!("handled above"),
        }
        .map_err(backend)
    }

    /// The script call of `part`, by `how`.
    fn command(&self, how: How, part: &Part<'_>) -> redis::Cmd {
        let (command, script) = match how {
            How::Fcall => ("FCALL", self.scripts.function(part.concern)),
            How::Evalsha => ("EVALSHA", self.scripts.script(part.concern).sha.as_str()),
            How::Eval => ("EVAL", self.scripts.script(part.concern).text.as_str()),
        };
        let now = self.clock.as_ref().map_or(0, |c| c.now_ms());
        let call = codec::encode(part.requests.iter().map(|&(_, r)| r));
        let mut cmd = redis::cmd(command);
        cmd.arg(script).arg(call.keys.len()).arg(&call.keys);
        cmd.arg(now).arg(call.requests).arg(&call.bytes[..]);
        cmd
    }

    /// One call per part, in order; each call's raw reply, or its own
    /// error when the others went through.
    pub async fn eval(&self, parts: &[Part<'_>]) -> Result<Vec<RawReply>, StoreError> {
        let result = self.call_once(parts).await;
        if result
            .as_ref()
            .map_or(true, |r| r.iter().any(Result::is_err))
        {
            self.drop_primary();
        }
        result
    }

    async fn call_once(&self, parts: &[Part<'_>]) -> Result<Vec<RawReply>, StoreError> {
        let mut conn = self.connect().await?;
        if self.mode.load(Ordering::Relaxed) != EVALSHA {
            if let Some(replies) = self.fcall(&mut conn, parts).await? {
                return Ok(replies);
            }
            // Functions are out of reach here: scripts from now on.
            self.mode.store(EVALSHA, Ordering::Relaxed);
        }
        // Scripts go one call at a time, each once the one before has
        // answered: pipelined, a call could run before an earlier one that
        // the server had no script for (and that goes again by EVAL), and
        // a cluster's client sends a whole pipeline again when one of its
        // calls is redirected, running the others twice.
        let results = self.one_by_one(&mut conn, How::Evalsha, parts).await;
        Ok(results.into_iter().map(|r| r.map_err(backend)).collect())
    }

    /// One call per part, each once the one before has answered. A call
    /// that failed on the link leaves the rest unsent, answered with its
    /// error: the link is gone, and whether that call ran is unknown.
    async fn one_by_one(
        &self,
        conn: &mut Conn,
        how: How,
        parts: &[Part<'_>],
    ) -> Vec<redis::RedisResult<Vec<u8>>> {
        let mut results: Vec<redis::RedisResult<Vec<u8>>> = Vec::with_capacity(parts.len());
        for part in parts {
            let result = match results.last() {
                Some(Err(e)) if on_the_link(e) => Err(e.clone()),
                _ => self.call_part(conn, how, part).await,
            };
            results.push(result);
        }
        results
    }

    /// One part's call by `how`; by script, `EVALSHA`, and `EVAL` when the
    /// server has lost the script (a restart, `SCRIPT FLUSH`) or a cluster
    /// node never had it, which the server then keeps for the next
    /// `EVALSHA`.
    async fn call_part(
        &self,
        conn: &mut Conn,
        how: How,
        part: &Part<'_>,
    ) -> redis::RedisResult<Vec<u8>> {
        match self.command(how, part).query_async(&mut *conn).await {
            Err(e)
                if how == How::Evalsha
                    && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
            {
                self.command(How::Eval, part).query_async(&mut *conn).await
            }
            other => other,
        }
    }

    /// Every part's function call, in order; each call's outcome. In one
    /// pipeline, one round trip; on a cluster one call after the other,
    /// since its client sends a whole pipeline again when one call in it
    /// is redirected (a slot moving), running the others twice.
    async fn functions(
        &self,
        conn: &mut Conn,
        parts: &[Part<'_>],
    ) -> Result<Vec<redis::RedisResult<Vec<u8>>>, StoreError> {
        if matches!(conn, Conn::Cluster(_)) {
            return Ok(self.one_by_one(conn, How::Fcall, parts).await);
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for part in parts {
            pipe.add_command(self.command(How::Fcall, part));
        }
        let results: Vec<redis::RedisResult<Vec<u8>>> =
            pipe.query_async(conn).await.map_err(backend)?;
        if results.len() != parts.len() {
            return Err(StoreError::Reply(format!(
                "{} replies for {} script calls",
                results.len(),
                parts.len()
            )));
        }
        Ok(results)
    }
}

/// One script call's raw reply, or why it failed.
pub type RawReply = Result<Vec<u8>, StoreError>;

/// How a script is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// As the library's function.
    Fcall,
    /// By the script's hash.
    Evalsha,
    /// With the script's text.
    Eval,
}

/// The requests of one concern in a batch: one script call.
#[derive(Debug)]
pub struct Part<'a> {
    /// What the call is for.
    pub concern: Concern,
    /// Its requests, each with its place in the batch, in the order they
    /// were queued.
    pub requests: Vec<(usize, &'a Request)>,
}

/// A batch's calls: its requests grouped by concern, in the order the
/// calls are sent ([`Concern::ALL`]), each group in queue order.
pub fn parts<'a>(batch: &[&'a Request]) -> Vec<Part<'a>> {
    let mut parts: Vec<Part<'a>> = Vec::with_capacity(1);
    for (i, &request) in batch.iter().enumerate() {
        let concern = Concern::of(request);
        match parts.iter_mut().find(|p| p.concern == concern) {
            Some(part) => part.requests.push((i, request)),
            None => parts.push(Part {
                concern,
                requests: vec![(i, request)],
            }),
        }
    }
    parts.sort_by_key(|p| p.concern);
    parts
}

#[async_trait]
impl Link for Connection {
    type Request = Request;
    type Reply = Decided;

    async fn call(
        &self,
        batch: &[&Request],
    ) -> Result<Vec<Result<Decided, StoreError>>, StoreError> {
        let parts = parts(batch);
        let replies = self.eval(&parts).await?;
        // (Every request is in one part, and every part has its reply.)
        let mut decided: Vec<Option<Result<Decided, StoreError>>> =
            std::iter::repeat_with(|| None).take(batch.len()).collect();
        for (part, reply) in parts.iter().zip(replies) {
            let requests: Vec<&Request> = part.requests.iter().map(|&(_, r)| r).collect();
            match reply.and_then(|reply| codec::split(&reply, &requests)) {
                Ok(answers) => {
                    for (&(i, _), answer) in part.requests.iter().zip(answers) {
                        decided[i] = Some(Ok(answer));
                    }
                }
                Err(e) => {
                    for &(i, _) in &part.requests {
                        decided[i] = Some(Err(e.clone()));
                    }
                }
            }
        }
        Ok(decided
            .into_iter()
            .map(|d| {
                d.unwrap_or_else(|| Err(StoreError::Reply("no call answered this request".into())))
            })
            .collect())
    }

    /// `PING`, for readiness.
    async fn ping(&self) -> Result<(), StoreError> {
        let result = async {
            let mut conn = self.connect().await?;
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map(drop)
                .map_err(backend)
        }
        .await;
        if result.is_err() {
            self.drop_primary();
        }
        result
    }

    fn forget(&self) {
        self.drop_primary();
    }

    async fn query(&self, cmd: redis::Cmd) -> Result<redis::Value, StoreError> {
        let result = async {
            let mut conn = self.connect().await?;
            cmd.query_async::<redis::Value>(&mut conn)
                .await
                .map_err(backend)
        }
        .await;
        if result.is_err() {
            self.drop_primary();
        }
        result
    }

    /// A call that decides nothing: it connects, and loads the function
    /// library where the server has functions.
    async fn warm(&self) -> Result<(), StoreError> {
        let nothing = Part {
            concern: Concern::Decide,
            requests: Vec::new(),
        };
        self.eval(&[nothing])
            .await?
            .pop()
            .unwrap_or(Ok(Vec::new()))
            .map(drop)
    }
}

impl Connection {
    /// The calls as function calls, in one pipeline, loading the library
    /// when the server does not have it (a first call, a restart,
    /// `FUNCTION FLUSH`); `None` when this server cannot run or load
    /// functions. One library holds every concern's function, so a server
    /// has all of them or none: a call refused for a missing function or
    /// for want of functions ran nowhere, and neither did the others of
    /// its pipeline, which are sent again (by function, or as scripts).
    async fn fcall(
        &self,
        conn: &mut Conn,
        parts: &[Part<'_>],
    ) -> Result<Option<Vec<RawReply>>, StoreError> {
        let refused = |results: &[redis::RedisResult<Vec<u8>>], why: fn(&RedisError) -> bool| {
            results.iter().all(|r| r.as_ref().is_err_and(why))
        };
        let mut results = self.functions(conn, parts).await?;
        if refused(&results, unsupported) {
            return Ok(None);
        }
        if refused(&results, missing_function) {
            let loaded = redis::cmd("FUNCTION")
                .arg("LOAD")
                .arg("REPLACE")
                .arg(self.scripts.library())
                .query_async::<String>(&mut *conn)
                .await;
            match loaded {
                Ok(_) => {}
                Err(e) if unsupported(&e) => return Ok(None),
                Err(e) => return Err(backend(e)),
            }
            results = self.functions(conn, parts).await?;
        }
        self.mode.store(FCALL, Ordering::Relaxed);
        Ok(Some(
            results.into_iter().map(|r| r.map_err(backend)).collect(),
        ))
    }
}

/// The server has no functions (before Redis 7), or this user may not use
/// them.
fn unsupported(e: &RedisError) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    // ("NOPERM ... to run the 'fcall' command"; a key the user may not
    // touch is the script's error, not this.)
    text.contains("unknown command")
        || (text.contains("noperm") && (text.contains("'fcall'") || text.contains("'function")))
}

/// The server has functions but not this library.
fn missing_function(e: &RedisError) -> bool {
    e.to_string().contains("Function not found")
}

/// A connection of any kind.
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(MultiplexedConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Sentinel(c) => c.req_packed_command(cmd),
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
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

/// A Redis error, by what went wrong: the link, the server's own answer, or
/// a reply this gateway cannot read.
fn backend(e: RedisError) -> StoreError {
    match e.kind() {
        _ if e.is_timeout() => StoreError::Timeout,
        _ if on_the_link(&e) => StoreError::Connection(e.to_string()),
        ErrorKind::Server(_) => StoreError::Script(e.to_string()),
        _ => StoreError::Reply(e.to_string()),
    }
}

/// Whether a call failed on the link (no answer came: a timeout or a
/// broken connection), rather than with the server's answer or a reply
/// this gateway cannot read.
fn on_the_link(e: &RedisError) -> bool {
    e.is_timeout()
        || !matches!(
            e.kind(),
            ErrorKind::Server(_) | ErrorKind::Parse | ErrorKind::UnexpectedReturnType
        )
}
