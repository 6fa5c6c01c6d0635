//! The link to Redis: one server's multiplexed connection that remakes
//! itself, a cluster's, or the primary that Redis Sentinel names, found
//! again after every failure; and the decision call on it.
//!
//! On a server that has functions (Redis 7), `decide.lua` is loaded once as
//! a function library (`FUNCTION LOAD`) and called with `FCALL`: its
//! helpers are made once, not on every call, which takes about a fifth off
//! the script time (bench/script_time.py). The library's name carries the
//! script's hash, so gateways of different versions can share a server.
//! Elsewhere (older servers, a user without the right to load functions,
//! Redis Cluster, whose shards would each need the library) it is `EVALSHA`,
//! with `EVAL` once when the server has lost the script.

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
use super::codec::{self, Decided, Request, DECIDE_LUA};
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
    sha: String,
    /// Where the script's time comes from: the server's `TIME` when `None`.
    clock: Option<Arc<dyn Clock>>,
    /// The function library's source and the function's name.
    library: String,
    function: String,
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
        let sha = redis::Script::new(DECIDE_LUA).get_hash().to_string();
        let tag = &sha[..12];
        let function = format!("tollgate_decide_{tag}");
        let library =
            format!("#!lua name=tollgate_{tag}\nlocal FUNCTION_NAME = '{function}'\n{DECIDE_LUA}");
        let mode = match link {
            Target::Cluster { .. } => EVALSHA,
            Target::Single { .. } | Target::Sentinel { .. } => UNKNOWN,
        };
        Self {
            link,
            sha,
            clock,
            library,
            function,
            mode: AtomicU8::new(mode),
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

    /// The script call for some requests, `EVALSHA` with the script's hash
    /// or `EVAL` with its text.
    fn script<'a>(
        &self,
        command: &str,
        script: &str,
        requests: impl Iterator<Item = &'a Request> + Clone,
    ) -> redis::Cmd {
        let now = self.clock.as_ref().map_or(0, |c| c.now_ms());
        let call = codec::encode(requests);
        let mut cmd = redis::cmd(command);
        cmd.arg(script).arg(call.keys.len()).arg(&call.keys);
        cmd.arg(now).arg(call.requests).arg(&call.bytes[..]);
        cmd
    }

    /// Decides some requests in one script call; the raw reply.
    pub async fn eval<'a>(
        &self,
        requests: impl Iterator<Item = &'a Request> + Clone,
    ) -> Result<Vec<u8>, StoreError> {
        let result = self.call_once(requests).await;
        if result.is_err() {
            self.drop_primary();
        }
        result
    }

    async fn call_once<'a>(
        &self,
        requests: impl Iterator<Item = &'a Request> + Clone,
    ) -> Result<Vec<u8>, StoreError> {
        let mut conn = self.connect().await?;
        if self.mode.load(Ordering::Relaxed) != EVALSHA {
            match self.fcall(&mut conn, requests.clone()).await {
                Some(result) => return result,
                // Functions are out of reach here: scripts from now on.
                None => self.mode.store(EVALSHA, Ordering::Relaxed),
            }
        }
        match self
            .script("EVALSHA", &self.sha, requests.clone())
            .query_async(&mut conn)
            .await
        {
            // The server lost its script cache (a restart, SCRIPT FLUSH) or a
            // cluster node never had it: EVAL sends the text, which the
            // server then keeps for the next EVALSHA.
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => self
                .script("EVAL", DECIDE_LUA, requests)
                .query_async(&mut conn)
                .await
                .map_err(backend),
            other => other.map_err(backend),
        }
    }
}

#[async_trait]
impl Link for Connection {
    type Request = Request;
    type Reply = Decided;

    async fn call(&self, batch: &[&Request]) -> Result<Vec<Decided>, StoreError> {
        let reply = self.eval(batch.iter().copied()).await?;
        codec::split(&reply, batch)
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
        self.eval(std::iter::empty()).await.map(drop)
    }
}

impl Connection {
    /// The decision as a function call, loading the library when the
    /// server does not have it (a first call, a restart, `FUNCTION FLUSH`);
    /// `None` when this server cannot run or load functions.
    async fn fcall<'a>(
        &self,
        conn: &mut Conn,
        requests: impl Iterator<Item = &'a Request> + Clone,
    ) -> Option<Result<Vec<u8>, StoreError>> {
        match self
            .script("FCALL", &self.function, requests.clone())
            .query_async(conn)
            .await
        {
            Ok(reply) => {
                self.mode.store(FCALL, Ordering::Relaxed);
                return Some(Ok(reply));
            }
            Err(e) if unsupported(&e) => return None,
            Err(e) if !missing_function(&e) => return Some(Err(backend(e))),
            Err(_) => {}
        }
        let loaded = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&self.library)
            .query_async::<String>(conn)
            .await;
        match loaded {
            Ok(_) => {}
            Err(e) if unsupported(&e) => return None,
            Err(e) => return Some(Err(backend(e))),
        }
        let reply = self
            .script("FCALL", &self.function, requests)
            .query_async(conn)
            .await
            .map_err(backend);
        if reply.is_ok() {
            self.mode.store(FCALL, Ordering::Relaxed);
        }
        Some(reply)
    }
}

/// The server has no functions (before Redis 7), or this user may not use
/// them.
fn unsupported(e: &RedisError) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    text.contains("unknown command") || text.contains("noperm")
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
        ErrorKind::Server(_) => StoreError::Script(e.to_string()),
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => StoreError::Reply(e.to_string()),
        _ => StoreError::Connection(e.to_string()),
    }
}
