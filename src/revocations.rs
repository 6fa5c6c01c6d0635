//! Credentials shut out at runtime (`/admin/revocations`): a key that
//! leaked answers 401 on every instance until its revocation expires,
//! before the keys file is redeployed.
//!
//! With a shared store the revocations live there, as admin records; each
//! instance re-reads them when their version moved, every
//! `server.admin_refresh_ms`, so a revocation made on one instance holds on
//! all of them within that time (and at once on the one that made it). On
//! the memory store they are this instance's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};

use crate::limits::{LimitStore, StoreError};

/// The kind of admin record revocations are.
const KIND: &str = "revocations";

/// One revoked credential.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revocation {
    /// The credential's id.
    pub credential: String,
    /// Until then (ms since the epoch, wall clock) it is refused.
    pub expires_at_ms: u64,
    /// Why, as the operator said.
    pub reason: String,
    /// Who revoked it (the admin token's name).
    pub actor: String,
}

/// The revocations this instance enforces.
#[derive(Debug)]
pub struct Revocations {
    current: ArcSwap<HashMap<String, Revocation>>,
    /// The store's version they were read at; `u64::MAX` before the first
    /// read.
    version: AtomicU64,
}

impl Default for Revocations {
    fn default() -> Self {
        Self {
            current: ArcSwap::default(),
            version: AtomicU64::new(u64::MAX),
        }
    }
}

impl Revocations {
    /// Whether `credential` is refused at `now_ms`.
    pub fn revoked(&self, credential: &str, now_ms: u64) -> bool {
        self.current
            .load()
            .get(credential)
            .is_some_and(|r| r.expires_at_ms > now_ms)
    }

    /// The revocations in force at `now_ms`, by credential.
    pub fn active(&self, now_ms: u64) -> Vec<Revocation> {
        let mut out: Vec<Revocation> = self
            .current
            .load()
            .values()
            .filter(|r| r.expires_at_ms > now_ms)
            .cloned()
            .collect();
        out.sort_by(|a, b| a.credential.cmp(&b.credential));
        out
    }

    /// Revokes (or, with `None`, restores) a credential: in the shared
    /// store when there is one, and here at once. Returns the revocation
    /// that was in force before, if any.
    pub async fn set(
        &self,
        store: Option<&dyn LimitStore>,
        credential: &str,
        revocation: Option<Revocation>,
        now_ms: u64,
    ) -> Result<Option<Revocation>, StoreError> {
        let before = self
            .current
            .load()
            .get(credential)
            .filter(|r| r.expires_at_ms > now_ms)
            .cloned();
        if let Some(store) = store {
            let text = revocation
                .as_ref()
                .map(|r| serde_json::to_string(r).unwrap_or_default());
            store.put_record(KIND, credential, text.as_deref()).await?;
        }
        self.current.rcu(|current| {
            let mut next = HashMap::clone(current);
            next.retain(|_, r| r.expires_at_ms > now_ms);
            match &revocation {
                Some(r) => next.insert(credential.to_string(), r.clone()),
                None => next.remove(credential),
            };
            next
        });
        Ok(before)
    }

    /// Reads the store's revocations again when their version moved since
    /// the last read.
    pub async fn refresh(&self, store: &dyn LimitStore) -> Result<(), StoreError> {
        let version = store.records_version().await?;
        if version == self.version.load(Ordering::Acquire) {
            return Ok(());
        }
        let records = store.records(KIND).await?;
        let all: HashMap<String, Revocation> = records
            .iter()
            .filter_map(|text| serde_json::from_str::<Revocation>(text).ok())
            .map(|r| (r.credential.clone(), r))
            .collect();
        self.current.store(Arc::new(all));
        self.version.store(version, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revocation(credential: &str, expires_at_ms: u64) -> Revocation {
        Revocation {
            credential: credential.into(),
            expires_at_ms,
            reason: "leaked".into(),
            actor: "oncall".into(),
        }
    }

    #[tokio::test]
    async fn a_revocation_holds_until_it_expires_or_is_lifted() {
        let r = Revocations::default();
        assert!(!r.revoked("c1", 1_000));
        let before = r
            .set(None, "c1", Some(revocation("c1", 5_000)), 1_000)
            .await
            .unwrap();
        assert_eq!(before, None);
        assert!(r.revoked("c1", 4_999));
        assert!(!r.revoked("c1", 5_000), "expired");
        assert!(!r.revoked("c2", 1_000));
        assert_eq!(r.active(1_000).len(), 1);
        let before = r.set(None, "c1", None, 2_000).await.unwrap();
        assert_eq!(before.map(|b| b.reason), Some("leaked".into()));
        assert!(!r.revoked("c1", 2_000));
        assert!(r.active(2_000).is_empty());
    }
}
