//! Credentials shut out at runtime (`/admin/revocations`): a key that
//! leaked answers 401 on every instance until its revocation expires,
//! before the keys file is redeployed.
//!
//! With a shared store the revocations live there, as admin records; each
//! instance re-reads them when their version moved, every
//! `server.admin_refresh_ms`, so a revocation made on one instance holds on
//! all of them within that time (and at once on the one that made it). On
//! the memory store they are this instance's.

use serde::{Deserialize, Serialize};

use super::records::{Record, Records};
use crate::limits::{RecordStore, StoreError};

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

impl Record for Revocation {
    fn id(&self) -> &str {
        &self.credential
    }

    fn expires_at_ms(&self) -> u64 {
        self.expires_at_ms
    }
}

/// The revocations this instance enforces.
#[derive(Debug)]
pub struct Revocations(Records<Revocation>);

impl Default for Revocations {
    fn default() -> Self {
        Self(Records::new("revocations"))
    }
}

impl Revocations {
    /// Whether `credential` is refused at `now_ms`.
    pub fn revoked(&self, credential: &str, now_ms: u64) -> bool {
        self.0.get(credential, now_ms).is_some()
    }

    /// The revocations in force at `now_ms`, by credential.
    pub fn active(&self, now_ms: u64) -> Vec<Revocation> {
        self.0.active(now_ms)
    }

    /// Revokes (or, with `None`, restores) a credential, everywhere; the
    /// revocation in force before, if any.
    pub async fn set(
        &self,
        store: Option<&dyn RecordStore>,
        credential: &str,
        revocation: Option<Revocation>,
        now_ms: u64,
    ) -> Result<Option<Revocation>, StoreError> {
        self.0.set(store, credential, revocation, now_ms).await
    }

    /// Reads the store's revocations again when they changed.
    pub async fn refresh(&self, store: &dyn RecordStore) -> Result<(), StoreError> {
        self.0.refresh(store).await.map(drop)
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
