//! Admin records of one kind (revocations, overrides) as this instance
//! last read them: kept in the shared store when there is one, where every
//! instance reads them again within `server.admin_refresh_ms` once their
//! version moved, and applied at once on the instance that changed them;
//! on the memory store they are this instance's alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::limits::{RecordStore, StoreError};

/// One admin record: what it is about, and until when it holds.
pub trait Record: Clone + Serialize + DeserializeOwned + Send + Sync + 'static {
    /// What the record is about (a tenant, a credential id).
    fn id(&self) -> &str;
    /// Until then (ms since the epoch, wall clock) it is in force.
    fn expires_at_ms(&self) -> u64;
}

/// The records of one kind.
#[derive(Debug)]
pub struct Records<T> {
    kind: &'static str,
    current: ArcSwap<HashMap<String, T>>,
    /// The store's version they were read at; `u64::MAX` before the first
    /// read.
    version: AtomicU64,
}

impl<T: Record> Records<T> {
    /// No records of `kind` yet.
    pub fn new(kind: &'static str) -> Self {
        Self {
            kind,
            current: ArcSwap::default(),
            version: AtomicU64::new(u64::MAX),
        }
    }

    /// The record about `id` in force at `now_ms`.
    pub fn get(&self, id: &str, now_ms: u64) -> Option<T> {
        self.current
            .load()
            .get(id)
            .filter(|r| r.expires_at_ms() > now_ms)
            .cloned()
    }

    /// Every record, expired ones included (they are skipped by whoever
    /// reads them at a time).
    pub fn all(&self) -> Arc<HashMap<String, T>> {
        self.current.load_full()
    }

    /// The records in force at `now_ms`, by id.
    pub fn active(&self, now_ms: u64) -> Vec<T> {
        let mut out: Vec<T> = self
            .current
            .load()
            .values()
            .filter(|r| r.expires_at_ms() > now_ms)
            .cloned()
            .collect();
        out.sort_by(|a, b| a.id().cmp(b.id()));
        out
    }

    /// Puts (or, with `None`, removes) the record about `id`: in the shared
    /// store when there is one, and here at once. Returns the one in force
    /// before, if any.
    pub async fn set(
        &self,
        store: Option<&dyn RecordStore>,
        id: &str,
        record: Option<T>,
        now_ms: u64,
    ) -> Result<Option<T>, StoreError> {
        let before = self.get(id, now_ms);
        if let Some(store) = store {
            let text = record
                .as_ref()
                .map(|r| serde_json::to_string(r).unwrap_or_default());
            store.put_record(self.kind, id, text.as_deref()).await?;
        }
        self.current.rcu(|current| {
            let mut next = HashMap::clone(current);
            next.retain(|_, r| r.expires_at_ms() > now_ms);
            match &record {
                Some(r) => next.insert(id.to_string(), r.clone()),
                None => next.remove(id),
            };
            next
        });
        Ok(before)
    }

    /// Reads the store's records again when their version moved since the
    /// last read; whether they were read.
    pub async fn refresh(&self, store: &dyn RecordStore) -> Result<bool, StoreError> {
        let version = store.records_version().await?;
        if version == self.version.load(Ordering::Acquire) {
            return Ok(false);
        }
        let records = store.records(self.kind).await?;
        let all: HashMap<String, T> = records
            .iter()
            .filter_map(|text| serde_json::from_str::<T>(text).ok())
            .map(|r| (r.id().to_string(), r))
            .collect();
        self.current.store(Arc::new(all));
        self.version.store(version, Ordering::Release);
        Ok(true)
    }
}
