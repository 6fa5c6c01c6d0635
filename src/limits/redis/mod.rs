//! The shared store on Redis. Every request's shared limits are decided by
//! `lua/decide.lua` in one round trip, over one multiplexed connection that
//! reconnects by itself.
//!
//! - [`scripts`]: the scripts of `lua/`, one per concern;
//! - [`codec`]: the script's arguments and reply, as bytes;
//! - [`batch`]: requests that wait while a call is in flight share the
//!   next one (per hash slot, so Redis Cluster uses it too), driven on the
//!   store's own thread, late decisions told from a failing store;
//! - [`cluster`]: Redis Cluster, a request decided one slot at a time and
//!   settled as one decision;
//! - [`conn`]: the link to one server or a cluster, and the script call.

pub mod batch;
pub mod cluster;
pub mod codec;
pub mod conn;
pub mod records;
pub mod scripts;

use std::sync::Arc;

use async_trait::async_trait;

use super::keys::{KeyCache, KeyHasher, CACHED_KEYS};
use super::{Charge, Gate, LimitStore, RecordChanges, RecordStore, StoreError, Verdict};
use crate::clock::Clock;
use batch::Batches;
pub use batch::Bounds;
use codec::Request;
use conn::Connection;

/// A Redis URL fit for messages and logs: its password replaced by `***`.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            let hidden = if userinfo.contains(':') { ":***" } else { "" };
            let user = if userinfo.contains(':') { user } else { "***" };
            format!("{scheme}://{user}{hidden}@{host}{path}")
        }
        None => url.to_owned(),
    }
}

/// Limit state in one Redis server (or one primary).
pub struct RedisStore {
    batches: Batches<Connection>,
    keys: KeyCache,
}

impl RedisStore {
    /// Prepares a connection; it is made on first use and remade whenever it
    /// breaks, so a gateway can start while Redis is down. The script reads
    /// the server's `TIME`.
    pub fn new(url: &str, keys: KeyHasher, bounds: Bounds) -> Result<Self, StoreError> {
        Self::connect(url, keys, bounds, None)
    }

    /// As [`RedisStore::new`], with the script's time read from `clock`
    /// instead of the server: to hold the script against the in-process
    /// store step by step. A gateway never does this: a decision's time comes
    /// from the Redis server, so every instance reads one clock.
    pub fn with_clock(
        url: &str,
        keys: KeyHasher,
        bounds: Bounds,
        clock: impl Clock,
    ) -> Result<Self, StoreError> {
        Self::connect(url, keys, bounds, Some(Arc::new(clock)))
    }

    fn connect(
        url: &str,
        keys: KeyHasher,
        bounds: Bounds,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, StoreError> {
        let link = Connection::single(url, bounds.timeout, clock)?;
        Ok(Self {
            batches: Batches::new(link, bounds)?,
            keys: KeyCache::new(keys, CACHED_KEYS),
        })
    }

    /// A store on the primary that the sentinels at `sentinels` know as
    /// `master_name`: found on first use, and found again whenever the link
    /// fails or the node refuses writes (a failover demoted it), so a
    /// failover is followed without a restart.
    pub fn sentinel(
        sentinels: &[String],
        master_name: &str,
        keys: KeyHasher,
        bounds: Bounds,
    ) -> Result<Self, StoreError> {
        let link = Connection::sentinel(sentinels, master_name, bounds.timeout)?;
        Ok(Self {
            batches: Batches::new(link, bounds)?,
            keys: KeyCache::new(keys, CACHED_KEYS),
        })
    }

    async fn submit(
        &self,
        charges: &[&Charge],
        blocked_from: Gate,
        refund_at: u64,
    ) -> Result<Vec<Verdict>, StoreError> {
        let keys = charges.iter().map(|c| self.keys.key(c)).collect();
        let request = Request::new(keys, charges, blocked_from, refund_at);
        codec::fits(&request)?;
        self.batches.submit(0, request).await.map(|(v, _)| v)
    }
}

#[async_trait]
impl LimitStore for RedisStore {
    async fn decide(
        &self,
        charges: &[&Charge],
        blocked_from: Gate,
    ) -> Result<Vec<Verdict>, StoreError> {
        self.submit(charges, blocked_from, 0).await
    }

    /// Gives back what a decision at store time `spent_at` charged for these
    /// charges, as [`MemoryStore::refund`] does.
    ///
    /// [`MemoryStore::refund`]: super::memory::MemoryStore::refund
    async fn give_back(&self, charges: &[&Charge], spent_at: u64) -> Result<(), StoreError> {
        if charges.is_empty() {
            return Ok(());
        }
        self.submit(charges, Gate::Open, spent_at.max(1))
            .await
            .map(drop)
    }

    fn release_now(&self, charges: &[&Charge], failed: super::ReleaseFailed) -> bool {
        let keys = charges.iter().map(|c| self.keys.key(c)).collect();
        let request = Request::new(keys, charges, Gate::Open, 1);
        codec::fits(&request).is_ok()
            && self.batches.queue_now(0, request, move |e| {
                released_badly(&e);
                failed(e);
            })
    }

    async fn peek(&self, charges: &[&Charge]) -> Result<Vec<Verdict>, StoreError> {
        if charges.is_empty() {
            return Ok(Vec::new());
        }
        self.submit(charges, Gate::Open, codec::PEEK).await
    }

    async fn reset(&self, charges: &[&Charge]) -> Result<(), StoreError> {
        if charges.is_empty() {
            return Ok(());
        }
        self.submit(charges, Gate::Open, codec::RESET)
            .await
            .map(drop)
    }

    async fn credit(&self, charges: &[&Charge]) -> Result<Vec<Verdict>, StoreError> {
        if charges.is_empty() {
            return Ok(Vec::new());
        }
        self.submit(charges, Gate::Open, codec::CREDIT).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.batches.ping().await
    }

    fn pending(&self) -> usize {
        self.batches.pending()
    }
}

#[async_trait]
impl RecordStore for RedisStore {
    async fn records_version(&self) -> Result<u64, StoreError> {
        records::version(&self.batches, self.keys.hasher()).await
    }

    async fn records(&self, kind: &str) -> Result<Vec<String>, StoreError> {
        records::all(&self.batches, self.keys.hasher(), kind).await
    }

    fn record_field(&self, kind: &str, id: &str) -> String {
        self.keys.hasher().record(kind, id).1
    }

    async fn record_at(&self, kind: &str, field: &str) -> Result<Option<String>, StoreError> {
        records::get(&self.batches, self.keys.hasher(), kind, field).await
    }

    async fn put_record_at(
        &self,
        kind: &str,
        field: &str,
        value: Option<&str>,
    ) -> Result<bool, StoreError> {
        records::put(&self.batches, self.keys.hasher(), kind, field, value).await
    }

    async fn record_changes(&self, cursor: &str) -> Result<RecordChanges, StoreError> {
        records::changes(&self.batches, self.keys.hasher(), cursor).await
    }
}

/// A release queued at once failed: it is tried again while the holds
/// may still be held (they expire in the store otherwise).
pub(crate) fn released_badly(e: &StoreError) {
    tracing::warn!(target: crate::logs::STORE, error = %e, "releasing holds failed; tried again while the store may hold them");
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_are_hidden_in_urls() {
        let table = [
            ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
            ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
            ("rediss://:pw@h:1", "rediss://:***@h:1"),
            ("redis://pw@h", "redis://***@h"),
            ("http://u:p@a:b@h/x", "http://u:***@h/x"),
            ("not a url", "not a url"),
        ];
        for (url, want) in table {
            assert_eq!(redacted(url), want, "{url}");
        }
    }
}
