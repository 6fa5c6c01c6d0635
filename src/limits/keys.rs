//! Store keys: `{prefix}{limit}:{h}` where `h` is a truncated HMAC-SHA-256
//! of the limit's key material under the operator's secret, so no tenant,
//! credential, key or address appears in the store. Tenant-scoped keys
//! carry a hash tag derived from the tenant (`{prefix}{limit}:{t}:{h}` with
//! `t` in braces), so one request's tenant keys share a cluster slot.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::Charge;

/// Hex digits of the identity hash (128 bits) and of the tenant tag (64 bits).
const HASH_HEX: usize = 32;
const TAG_HEX: usize = 16;

/// Builds store keys; holds the keyed HMAC state so each key costs one
/// clone and one hash, not a re-keying.
#[derive(Clone)]
pub struct KeyHasher {
    prefix: String,
    mac: Hmac<Sha256>,
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret-derived state.
        f.debug_struct("KeyHasher")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl KeyHasher {
    /// A hasher writing keys under `prefix`, keyed by the HMAC `secret`.
    pub fn new(prefix: &str, secret: &[u8]) -> Self {
        Self {
            prefix: prefix.to_string(),
            mac: Hmac::new_from_slice(secret).expect("HMAC accepts any key length"),
        }
    }

    fn hex(&self, domain: &[u8], material: &[u8], digits: usize, out: &mut String) {
        let mut mac = self.mac.clone();
        mac.update(domain);
        mac.update(material);
        let digest = mac.finalize().into_bytes();
        out.push_str(&hex::encode(&digest[..digits / 2]));
    }

    /// The hash of admin records of `kind` (revocations, …) and the field
    /// of the record about `id`: an HMAC, so that a dump of the store does
    /// not name it. The hash tag keeps every record on one cluster slot.
    pub fn record(&self, kind: &str, id: &str) -> (String, String) {
        let mut field = String::with_capacity(32);
        self.hex(b"record\x1f", id.as_bytes(), 32, &mut field);
        (self.records(kind), field)
    }

    /// The hash of admin records of `kind`.
    pub fn records(&self, kind: &str) -> String {
        format!("{}{{tollgate-admin}}:{kind}", self.prefix)
    }

    /// The stream every change of an admin record is appended to: the
    /// change feed instances read to drop what they cached.
    pub fn records_feed(&self) -> String {
        format!("{}{{tollgate-admin}}:changes", self.prefix)
    }

    /// The number every change of an admin record moves.
    pub fn records_version(&self) -> String {
        format!("{}{{tollgate-admin}}:version", self.prefix)
    }

    /// The store key of one charge.
    pub fn key(&self, charge: &Charge) -> String {
        let mut key = String::with_capacity(self.prefix.len() + charge.name.len() + 56);
        key.push_str(&self.prefix);
        key.push_str(&charge.name);
        key.push(':');
        if let Some(tenant) = &charge.tenant {
            key.push('{');
            self.hex(b"tenant\x1f", tenant.as_bytes(), TAG_HEX, &mut key);
            key.push_str("}:");
        }
        self.hex(b"key\x1f", charge.key.as_bytes(), HASH_HEX, &mut key);
        key
    }
}

/// Store keys a shared store remembers per generation of its [`KeyCache`].
pub const CACHED_KEYS: usize = 16_384;

/// Store keys of recent callers: a repeat caller costs one map lookup
/// instead of two HMACs and a string. Two generations bound it: when the
/// young one is full it becomes the old one (dropping the previous old
/// one), and a hit in the old one moves back, so keys in use stay while the
/// cache never holds more than twice `capacity` entries.
pub struct KeyCache {
    hasher: KeyHasher,
    capacity: usize,
    generations: Mutex<Generations>,
}

#[derive(Default)]
struct Generations {
    young: HashMap<Box<str>, Cached, ahash::RandomState>,
    old: HashMap<Box<str>, Cached, ahash::RandomState>,
}

/// A store key and the tenant its hash tag was made from: a reload may move
/// a credential to another tenant, which makes the entry stale.
#[derive(Clone)]
struct Cached {
    tenant: Option<Arc<str>>,
    key: Arc<str>,
}

impl KeyCache {
    /// A cache of at most twice `capacity` keys (at least 1), made by `hasher`.
    pub fn new(hasher: KeyHasher, capacity: usize) -> Self {
        Self {
            hasher,
            capacity: capacity.max(1),
            generations: Mutex::default(),
        }
    }

    /// The hasher the keys are made by.
    pub fn hasher(&self) -> &KeyHasher {
        &self.hasher
    }

    /// The store key of one charge.
    pub fn key(&self, charge: &Charge) -> Arc<str> {
        let fresh = |c: &Cached| c.tenant == charge.tenant;
        {
            let mut g = self.lock();
            if let Some(hit) = g.young.get(charge.key.as_str()).filter(|c| fresh(c)) {
                return hit.key.clone();
            }
            if let Some(hit) = g.old.remove(charge.key.as_str()).filter(fresh) {
                return g.insert(&charge.key, hit, self.capacity);
            }
        }
        // Hashed outside the lock.
        let made = Cached {
            tenant: charge.tenant.clone(),
            key: self.hasher.key(charge).into(),
        };
        self.lock().insert(&charge.key, made, self.capacity)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Generations> {
        self.generations.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        let g = self.lock();
        g.young.len() + g.old.len()
    }
}

impl Generations {
    fn insert(&mut self, material: &str, entry: Cached, capacity: usize) -> Arc<str> {
        if self.young.len() >= capacity {
            self.old = std::mem::take(&mut self.young);
        }
        let key = entry.key.clone();
        self.young.insert(material.into(), entry);
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, bucket_params};

    /// A charge of the `per-tenant` limit for `key`, scoped to `tenant`.
    fn charge(key: &str, tenant: Option<&str>) -> Charge {
        Charge {
            tenant: tenant.map(Into::into),
            ..testing::charge("per-tenant", key, bucket_params(1, 1), 1)
        }
    }

    #[test]
    fn keys_hide_identities_and_tag_tenants() {
        let h = KeyHasher::new("tg:", b"secret");
        let k = h.key(&charge("per-tenant\x1facme", Some("acme")));
        assert!(k.starts_with("tg:per-tenant:{"), "{k}");
        assert!(!k.contains("acme"));
        assert_eq!(
            k.len(),
            "tg:per-tenant:{".len() + TAG_HEX + "}:".len() + HASH_HEX
        );
        // Same tenant, other credential: same tag, other hash.
        let other = h.key(&charge("per-credential\x1fci\x1facme", Some("acme")));
        assert_eq!(k[14..32], other[14..32]);
        assert_ne!(k, other);
        // Another secret gives other keys.
        assert_ne!(
            KeyHasher::new("tg:", b"other").key(&charge("per-tenant\x1facme", Some("acme"))),
            k
        );
        // Untagged keys have no braces at all.
        assert!(!h.key(&charge("global", None)).contains('{'));
    }

    #[test]
    fn cached_keys_match_hashed_ones_and_stay_bounded() {
        let h = KeyHasher::new("tg:", b"secret");
        let cache = KeyCache::new(h.clone(), 4);
        for round in 0..3 {
            for i in 0..10 {
                let c = charge(&format!("per-tenant\x1f{i}"), Some("acme"));
                assert_eq!(*cache.key(&c), h.key(&c), "round {round}, caller {i}");
                assert!(cache.len() <= 8, "{} entries", cache.len());
            }
        }
        // A key in steady use survives generations of other callers.
        let hot = charge("per-tenant\x1fhot", Some("acme"));
        let first = cache.key(&hot);
        for i in 0..20 {
            cache.key(&charge(&format!("per-tenant\x1fcold{i}"), None));
            if i % 3 == 0 {
                assert!(Arc::ptr_eq(&cache.key(&hot), &first));
            }
        }
        // The same material under another tenant gets that tenant's tag.
        let moved = charge("per-tenant\x1fhot", Some("other"));
        assert_eq!(*cache.key(&moved), h.key(&moved));
        assert_ne!(cache.key(&moved), first);
    }
}
