//! The shared store on Redis: one `EVALSHA` of `lua/decide.lua` per request
//! decides all of its shared limits, over one multiplexed connection that
//! pipelines concurrent requests and reconnects by itself.

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, ServerErrorKind};

use super::algorithm::Params;
use super::keys::KeyHasher;
use super::{Charge, LimitStore, Source, StoreError, Verdict};
use crate::clock::{Clock, ManualClock};

/// The decision script, embedded at build time.
pub const DECIDE_LUA: &str = include_str!("../../lua/decide.lua");

/// Limit state in one Redis server (or one primary).
pub struct RedisStore {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// Made on first use, inside the runtime that serves requests.
    conn: tokio::sync::OnceCell<ConnectionManager>,
    sha: String,
    keys: KeyHasher,
    /// Tests only: the script takes its time from here instead of `TIME`.
    clock: Option<ManualClock>,
}

impl RedisStore {
    /// Prepares a connection; it is made on first use and remade whenever it
    /// breaks, so a gateway can start while Redis is down.
    pub fn new(url: &str, keys: KeyHasher, timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(backend)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(100))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200));
        Ok(Self {
            client,
            config,
            conn: tokio::sync::OnceCell::new(),
            sha: redis::Script::new(DECIDE_LUA).get_hash().to_string(),
            keys,
            clock: None,
        })
    }

    /// Makes the script use this clock instead of the server's `TIME`, so
    /// that tests can hold it against the in-process store step by step.
    pub fn with_test_clock(mut self, clock: ManualClock) -> Self {
        self.clock = Some(clock);
        self
    }

    fn evalsha(&self, charges: &[Charge], blocked_from: u8) -> redis::Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.sha).arg(charges.len());
        for c in charges {
            cmd.arg(self.keys.key(c));
        }
        cmd.arg(self.clock.as_ref().map_or(0, |c| c.now_ms()));
        cmd.arg(blocked_from);
        for c in charges {
            let (kind, a, b) = encode(c.params);
            let flags = u64::from(c.group) * 2 + u64::from(c.enforce);
            cmd.arg(kind).arg(a).arg(b).arg(c.cost).arg(flags);
        }
        cmd
    }

    async fn connection(&self) -> Result<ConnectionManager, RedisError> {
        let conn = self
            .conn
            .get_or_try_init(|| async {
                ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone())
            })
            .await?;
        Ok(conn.clone())
    }

    async fn call(&self, charges: &[Charge], blocked_from: u8) -> Result<Vec<i64>, RedisError> {
        let mut conn = self.connection().await?;
        let first = self
            .evalsha(charges, blocked_from)
            .query_async(&mut conn)
            .await;
        match first {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                // The server lost its script cache (a restart, SCRIPT FLUSH):
                // load it again and retry once.
                redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(DECIDE_LUA)
                    .query_async::<String>(&mut conn)
                    .await?;
                self.evalsha(charges, blocked_from)
                    .query_async(&mut conn)
                    .await
            }
            other => other,
        }
    }
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
    StoreError::Backend(e.to_string())
}

#[async_trait]
impl LimitStore for RedisStore {
    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.connection().await.map_err(backend)?;
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .map(drop)
            .map_err(backend)
    }

    async fn decide(
        &self,
        charges: &[Charge],
        blocked_from: u8,
    ) -> Result<Vec<Verdict>, StoreError> {
        let reply = self.call(charges, blocked_from).await.map_err(|e| {
            if e.is_timeout() {
                StoreError::Timeout
            } else {
                backend(e)
            }
        })?;
        if reply.len() != charges.len() * 4 + 1 {
            return Err(StoreError::Backend(format!(
                "decide.lua replied {} numbers for {} limits",
                reply.len(),
                charges.len()
            )));
        }
        Ok(reply
            .chunks_exact(4)
            .map(|r| Verdict {
                allowed: r[0] == 1,
                remaining: r[1].max(0) as u64,
                wait_ms: u64::try_from(r[2]).ok(),
                reset_ms: r[3].max(0) as u64,
                source: Source::Store,
            })
            .collect())
    }
}
