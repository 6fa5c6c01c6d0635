//! Keys provisioned at runtime (`auth.store_keys`): credentials created and
//! deleted through `/admin/credentials`, kept in the shared store and
//! resolved by each instance on first use.
//!
//! A credential is two records: one under an HMAC of its key's SHA-256
//! (the store's secret keys it, so a dump of the store cannot be used to
//! test guessed keys), read on the request path, and one under an HMAC of
//! its id, for the admin API. An instance asks the store about a digest it
//! does not know once (concurrent requests share the call) and caches the
//! answer, unknown keys for `negative_ttl_s`; every creation and deletion
//! is appended to the store's change feed, which each instance reads every
//! `server.admin_refresh_ms` to drop exactly the entries that changed (all
//! of them when it fell behind the feed). A million provisioned keys cost
//! an instance nothing until they are used.
//!
//! Without a shared store the records are this instance's own.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use lru::LruCache;
use serde::{Deserialize, Serialize};

use super::auth::{unknown_callers_bound, Credential};
use super::single_flight::SingleFlight;
use crate::limits::{PlanId, RecordStore, StoreError};

/// The record kind of credentials by key digest.
pub const BY_KEY: &str = "credentials";
/// The record kind of credentials by id.
pub const BY_ID: &str = "credential_ids";

/// The known credentials cached before a policy sets its own bound.
const DEFAULT_ENTRIES: usize = 100_000;

/// A credential as created through the admin API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stored {
    /// The credential id, in the keys' id space.
    pub id: String,
    /// Its tenant.
    pub tenant: String,
    /// Its plan, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
}

/// The record by id: the credential and the field of its record by key,
/// so that deleting by id finds it without the key.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ById {
    #[serde(flatten)]
    credential: Stored,
    key_field: String,
}

/// The cache's bounds, from `auth.store_keys`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// The most known credentials cached.
    pub cache_entries: usize,
    /// How long an unknown key is remembered.
    pub negative_ttl: Duration,
}

/// A known credential, with the plan name it was built against and the
/// policy generation that resolved it.
struct Known {
    credential: Arc<Credential>,
    plan: Option<Box<str>>,
    generation: u64,
}

struct Cache {
    known: LruCache<String, Known>,
    unknown: LruCache<String, Instant>,
    negative_ttl: Duration,
}

/// What the store said of a key: cloned to every request waiting for it.
#[derive(Debug, Clone)]
enum Found {
    Known(Stored),
    Unknown,
    Failed(StoreError),
}

/// Why a credential cannot be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// Its id or key is taken.
    #[error("{0}")]
    Conflict(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A lookup's outcome for a request.
#[derive(Debug)]
pub enum Lookup {
    /// A credential of the store.
    Known(Arc<Credential>),
    /// No credential has this key.
    Unknown,
}

/// The credentials of the store, as this instance knows them.
pub struct StoreKeys {
    cache: Mutex<Cache>,
    /// One store read per key at a time: later requests wait for it.
    calls: SingleFlight<String, Found>,
    /// Where the change feed is read from next; empty before the first
    /// read.
    cursor: tokio::sync::Mutex<String>,
    /// Without a shared store, the records themselves.
    local: Mutex<HashMap<(&'static str, String), String>>,
}

impl Default for StoreKeys {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for StoreKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreKeys").finish_non_exhaustive()
    }
}

impl StoreKeys {
    /// Nothing cached, nothing kept.
    pub fn new() -> Self {
        let known = NonZeroUsize::new(DEFAULT_ENTRIES).unwrap_or(NonZeroUsize::MIN);
        Self {
            cache: Mutex::new(Cache {
                known: LruCache::new(known),
                unknown: LruCache::new(unknown_callers_bound(DEFAULT_ENTRIES)),
                negative_ttl: Duration::from_secs(10),
            }),
            calls: SingleFlight::default(),
            cursor: tokio::sync::Mutex::new(String::new()),
            local: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a policy's bounds (at start and on every reload).
    pub fn configure(&self, settings: Settings) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let entries = NonZeroUsize::new(settings.cache_entries).unwrap_or(NonZeroUsize::MIN);
        cache.known.resize(entries);
        cache
            .unknown
            .resize(unknown_callers_bound(settings.cache_entries));
        cache.negative_ttl = settings.negative_ttl;
    }

    /// The field a key digest's record is kept under.
    pub fn field(store: Option<&dyn RecordStore>, digest: &[u8; 32]) -> String {
        let hex = hex::encode(digest);
        match store {
            Some(store) => store.record_field(BY_KEY, &hex),
            None => hex,
        }
    }

    /// What the cache says of the key kept under `field`: `None` when the
    /// store must be asked.
    pub fn cached(
        &self,
        field: &str,
        generation: u64,
        plans: impl Fn(&str) -> Option<PlanId>,
        taken: impl Fn(&str) -> bool,
        now: Instant,
    ) -> Option<Lookup> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(known) = cache.known.get_mut(field) {
            if known.generation != generation && taken(&known.credential.id) {
                // A new policy's keys took its id: read it again, refused.
                cache.known.pop(field);
                return None;
            }
            if known.generation != generation {
                // Built under another policy: its plan may have moved.
                let c = &known.credential;
                let plan = known.plan.as_deref().and_then(&plans);
                if let Some(rebuilt) = Credential::new(&c.id, &c.tenant, plan) {
                    known.credential = Arc::new(rebuilt);
                }
                known.generation = generation;
            }
            return Some(Lookup::Known(known.credential.clone()));
        }
        match cache.unknown.get(field) {
            Some(until) if *until > now => Some(Lookup::Unknown),
            Some(_) => {
                cache.unknown.pop(field);
                None
            }
            None => None,
        }
    }

    /// Asks the store about the key kept under `field` (one call however
    /// many requests ask), caching the answer; and whether this request
    /// made the call.
    pub async fn look_up(
        &self,
        store: Option<&dyn RecordStore>,
        field: &str,
        generation: u64,
        plans: impl Fn(&str) -> Option<PlanId>,
        taken: impl Fn(&str) -> bool,
    ) -> (Result<Lookup, StoreError>, bool) {
        if let Some(found) = self.cached(field, generation, &plans, &taken, Instant::now()) {
            return (Ok(found), false);
        }
        let (found, called) = self
            .calls
            .run(&field.to_owned(), || {
                self.read_and_keep(store, field, generation, &plans, &taken)
            })
            .await;
        let lookup = match found {
            Found::Known(stored) => self
                .cached(field, generation, &plans, &taken, Instant::now())
                .ok_or_else(|| StoreError::Reply(format!("credential {:?}", stored.id))),
            Found::Unknown => Ok(Lookup::Unknown),
            Found::Failed(e) => Err(e),
        };
        (lookup, called)
    }

    async fn read_and_keep(
        &self,
        store: Option<&dyn RecordStore>,
        field: &str,
        generation: u64,
        plans: impl Fn(&str) -> Option<PlanId>,
        taken: impl Fn(&str) -> bool,
    ) -> Found {
        let read = match store {
            Some(store) => store.record_at(BY_KEY, field).await,
            None => Ok(self.local_get(BY_KEY, field)),
        };
        let stored = match read {
            Ok(Some(text)) => match serde_json::from_str::<Stored>(&text) {
                Ok(stored) => Some(stored),
                Err(e) => return Found::Failed(StoreError::Reply(format!("a credential: {e}"))),
            },
            Ok(None) => None,
            Err(e) => return Found::Failed(e),
        };
        // The policy's keys took the id since the credential was created
        // (a keys file deployed later): one id space, so the policy's keys
        // win and this credential is refused until one of them goes.
        let stored = stored.filter(|s| {
            let free = !taken(&s.id);
            if !free {
                tracing::warn!(target: crate::logs::STORE, "a credential of the store has the id of one of the policy's keys; it is refused");
            }
            free
        });
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        match stored {
            Some(stored) => {
                let plan = stored.plan.as_deref().and_then(&plans);
                let Some(credential) = Credential::new(&stored.id, &stored.tenant, plan) else {
                    return Found::Failed(StoreError::Reply(format!(
                        "credential {:?} cannot be sent upstream",
                        stored.id
                    )));
                };
                cache.unknown.pop(field);
                cache.known.put(
                    field.to_owned(),
                    Known {
                        credential: Arc::new(credential),
                        plan: stored.plan.as_deref().map(Box::from),
                        generation,
                    },
                );
                Found::Known(stored)
            }
            None => {
                let until = now + cache.negative_ttl;
                cache.known.pop(field);
                cache.unknown.put(field.to_owned(), until);
                Found::Unknown
            }
        }
    }

    /// Drops what this instance cached of the key under `field`.
    fn forget(&self, field: &str) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.known.pop(field);
        cache.unknown.pop(field);
    }

    fn forget_all(&self) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.known.clear();
        cache.unknown.clear();
    }

    fn local_get(&self, kind: &'static str, field: &str) -> Option<String> {
        let local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        local.get(&(kind, field.to_owned())).cloned()
    }

    async fn get_record(
        &self,
        store: Option<&dyn RecordStore>,
        kind: &'static str,
        field: &str,
    ) -> Result<Option<String>, StoreError> {
        match store {
            Some(store) => store.record_at(kind, field).await,
            None => Ok(self.local_get(kind, field)),
        }
    }

    async fn put_record(
        &self,
        store: Option<&dyn RecordStore>,
        kind: &'static str,
        field: &str,
        value: Option<&str>,
    ) -> Result<(), StoreError> {
        match store {
            Some(store) => store.put_record_at(kind, field, value).await.map(drop),
            None => {
                let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
                match value {
                    Some(v) => local.insert((kind, field.to_owned()), v.to_owned()),
                    None => local.remove(&(kind, field.to_owned())),
                };
                Ok(())
            }
        }
    }

    fn id_field(store: Option<&dyn RecordStore>, id: &str) -> String {
        match store {
            Some(store) => store.record_field(BY_ID, id),
            None => id.to_owned(),
        }
    }

    /// The credential with id `id`.
    pub async fn get(
        &self,
        store: Option<&dyn RecordStore>,
        id: &str,
    ) -> Result<Option<Stored>, StoreError> {
        let text = self
            .get_record(store, BY_ID, &Self::id_field(store, id))
            .await?;
        Ok(text
            .and_then(|t| serde_json::from_str::<ById>(&t).ok())
            .map(|r| r.credential))
    }

    /// Creates `credential` for the key whose SHA-256 is `digest`; refused
    /// when its id or key is already the store's.
    pub async fn create(
        &self,
        store: Option<&dyn RecordStore>,
        credential: &Stored,
        digest: &[u8; 32],
    ) -> Result<(), CreateError> {
        let id_field = Self::id_field(store, &credential.id);
        let key_field = Self::field(store, digest);
        if self.get_record(store, BY_ID, &id_field).await?.is_some() {
            return Err(CreateError::Conflict(format!(
                "credential {:?} exists",
                credential.id
            )));
        }
        if self.get_record(store, BY_KEY, &key_field).await?.is_some() {
            return Err(CreateError::Conflict(
                "the key belongs to another credential".into(),
            ));
        }
        let by_key = serde_json::to_string(credential).unwrap_or_default();
        let by_id = serde_json::to_string(&ById {
            credential: credential.clone(),
            key_field: key_field.clone(),
        })
        .unwrap_or_default();
        self.put_record(store, BY_ID, &id_field, Some(&by_id))
            .await?;
        self.put_record(store, BY_KEY, &key_field, Some(&by_key))
            .await?;
        // Here at once; elsewhere through the change feed.
        self.forget(&key_field);
        Ok(())
    }

    /// Deletes the credential with id `id`; the one deleted, if any.
    pub async fn delete(
        &self,
        store: Option<&dyn RecordStore>,
        id: &str,
    ) -> Result<Option<Stored>, StoreError> {
        let id_field = Self::id_field(store, id);
        let Some(text) = self.get_record(store, BY_ID, &id_field).await? else {
            return Ok(None);
        };
        let record: ById = serde_json::from_str(&text)
            .map_err(|e| StoreError::Reply(format!("a credential: {e}")))?;
        self.put_record(store, BY_KEY, &record.key_field, None)
            .await?;
        self.put_record(store, BY_ID, &id_field, None).await?;
        self.forget(&record.key_field);
        Ok(Some(record.credential))
    }

    /// Reads the store's change feed and drops every cached answer about a
    /// key that changed since the last read (all of them, once, when
    /// changes were lost: trimmed from the feed before they were read, or
    /// the feed itself gone with a store that restarted or failed over).
    pub async fn refresh(&self, store: &dyn RecordStore) -> Result<(), StoreError> {
        let mut cursor = self.cursor.lock().await;
        if cursor.is_empty() {
            // The first read only finds the feed's end: a change made before
            // it, after a key was cached, would never be read. What was
            // cached until now is dropped instead (at start, little or nothing).
            *cursor = store.record_changes("").await?.cursor;
            self.forget_all();
        }
        loop {
            let changes = store.record_changes(&cursor).await?;
            if !changes.complete {
                tracing::warn!(target: crate::logs::STORE, "the credentials change feed moved past this instance; its cached credentials are read again");
                // The feed is followed again from where it ends now, as at
                // the first read: the cursor it lost would be lost at every
                // later read too (a feed that was emptied has nothing after
                // it), and every read would drop the cache again.
                *cursor = store.record_changes("").await?.cursor;
                self.forget_all();
                return Ok(());
            }
            let more = !changes.changed.is_empty();
            for (kind, field) in &changes.changed {
                if kind == BY_KEY {
                    self.forget(field);
                }
            }
            *cursor = changes.cursor;
            if !more {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plans(name: &str) -> Option<PlanId> {
        (name == "pro").then_some(PlanId::new(0))
    }

    fn free(_: &str) -> bool {
        false
    }

    #[tokio::test]
    async fn a_credential_whose_id_the_policy_took_is_refused() {
        let keys = StoreKeys::new();
        let digest = crate::identity::auth::digest(b"k1");
        let field = StoreKeys::field(None, &digest);
        keys.create(None, &stored("s-1", None), &digest)
            .await
            .unwrap();
        let taken = |id: &str| id == "s-1";
        let (found, _) = keys.look_up(None, &field, 0, plans, taken).await;
        assert!(matches!(found, Ok(Lookup::Unknown)), "{found:?}");
    }

    fn stored(id: &str, plan: Option<&str>) -> Stored {
        Stored {
            id: id.into(),
            tenant: "acme".into(),
            plan: plan.map(Into::into),
        }
    }

    #[tokio::test]
    async fn a_created_key_is_found_and_a_deleted_one_is_not() {
        let keys = StoreKeys::new();
        let digest = crate::identity::auth::digest(b"k1");
        let field = StoreKeys::field(None, &digest);
        let (unknown, called) = keys.look_up(None, &field, 0, plans, free).await;
        assert!(matches!(unknown, Ok(Lookup::Unknown)) && called);
        keys.create(None, &stored("s-1", Some("pro")), &digest)
            .await
            .unwrap();
        let (known, _) = keys.look_up(None, &field, 0, plans, free).await;
        let Ok(Lookup::Known(c)) = known else {
            panic!("{known:?}")
        };
        assert_eq!((&*c.id, c.plan), ("s-1", Some(PlanId::new(0))));
        assert!(matches!(
            keys.create(
                None,
                &stored("s-1", None),
                &crate::identity::auth::digest(b"k2")
            )
            .await,
            Err(CreateError::Conflict(_))
        ));
        assert!(matches!(
            keys.create(None, &stored("s-2", None), &digest).await,
            Err(CreateError::Conflict(_))
        ));
        assert_eq!(
            keys.delete(None, "s-1").await.unwrap(),
            Some(stored("s-1", Some("pro")))
        );
        let (gone, _) = keys.look_up(None, &field, 0, plans, free).await;
        assert!(matches!(gone, Ok(Lookup::Unknown)));
    }

    /// A store with a change feed of entries `N-0`, each about one field,
    /// which a test can empty (as a store that restarted without its data,
    /// or a feed trimmed past the cursor); every field holds `s-1`.
    #[derive(Default)]
    struct Feed {
        entries: Mutex<Vec<(u64, String)>>,
        /// Reads of a cursor no longer in the feed.
        lost: std::sync::atomic::AtomicUsize,
    }

    impl Feed {
        fn append(&self, id: u64, field: &str) {
            self.entries.lock().unwrap().push((id, field.into()));
        }
    }

    #[async_trait::async_trait]
    impl RecordStore for Feed {
        async fn record_at(&self, _: &str, _: &str) -> Result<Option<String>, StoreError> {
            Ok(Some(serde_json::to_string(&stored("s-1", None)).unwrap()))
        }

        async fn record_changes(
            &self,
            cursor: &str,
        ) -> Result<crate::limits::RecordChanges, StoreError> {
            let entries = self.entries.lock().unwrap();
            let id = |n: u64| format!("{n}-0");
            if cursor.is_empty() {
                let end = entries.last().map_or(0, |(n, _)| *n);
                return Ok(crate::limits::RecordChanges {
                    cursor: id(end),
                    changed: Vec::new(),
                    complete: true,
                });
            }
            let at: u64 = cursor.trim_end_matches("-0").parse().unwrap();
            let complete = at == 0 || entries.iter().any(|(n, _)| *n == at);
            if !complete {
                self.lost.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            let after: Vec<_> = entries.iter().filter(|(n, _)| *n > at).collect();
            Ok(crate::limits::RecordChanges {
                cursor: after.last().map_or(cursor.to_owned(), |(n, _)| id(*n)),
                changed: after
                    .iter()
                    .map(|(_, f)| (BY_KEY.to_owned(), f.clone()))
                    .collect(),
                complete,
            })
        }
    }

    #[tokio::test]
    async fn a_lost_change_feed_is_read_again_once_then_followed() {
        let keys = StoreKeys::new();
        let feed = Feed::default();
        let store: &dyn RecordStore = &feed;
        let is_cached = |field: &str| keys.cached(field, 0, plans, free, Instant::now()).is_some();
        feed.append(1, "other");
        keys.refresh(store).await.unwrap();
        for field in ["a", "b"] {
            let (found, called) = keys.look_up(Some(store), field, 0, plans, free).await;
            assert!(matches!(found, Ok(Lookup::Known(_))) && called, "{field}");
        }

        // The store lost its feed: what was cached is dropped, once.
        feed.entries.lock().unwrap().clear();
        keys.refresh(store).await.unwrap();
        assert!(!is_cached("a") && !is_cached("b"));
        let _ = keys.look_up(Some(store), "a", 0, plans, free).await;
        for _ in 0..3 {
            keys.refresh(store).await.unwrap();
            assert!(is_cached("a"), "read again at every refresh");
        }
        assert_eq!(feed.lost.load(std::sync::atomic::Ordering::SeqCst), 1);

        // Then the feed is followed: a change drops only its key.
        let _ = keys.look_up(Some(store), "b", 0, plans, free).await;
        feed.append(7, "a");
        keys.refresh(store).await.unwrap();
        assert!(!is_cached("a") && is_cached("b"));
        assert_eq!(feed.lost.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_cached_credential_takes_the_plan_of_a_new_policy() {
        let keys = StoreKeys::new();
        let digest = crate::identity::auth::digest(b"k1");
        let field = StoreKeys::field(None, &digest);
        keys.create(None, &stored("s-1", Some("pro")), &digest)
            .await
            .unwrap();
        let _ = keys.look_up(None, &field, 0, plans, free).await;
        let moved = |name: &str| (name == "pro").then_some(PlanId::new(3));
        let Some(Lookup::Known(c)) = keys.cached(&field, 1, moved, free, Instant::now()) else {
            panic!("not cached")
        };
        assert_eq!(c.plan, Some(PlanId::new(3)));
    }
}
