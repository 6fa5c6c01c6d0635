//! API keys: the table of credentials, looked up by the SHA-256 of the raw
//! key. The configuration never holds a plaintext key, and the raw key never
//! leaves this module: it is hashed and forgotten.

use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

use crate::limits::PlanId;

/// A validated credential: who is calling, on behalf of which tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credential {
    /// Stable, non-secret credential id.
    pub id: Arc<str>,
    /// The tenant the credential acts for.
    pub tenant: Arc<str>,
    /// The plan whose limit overrides apply, if any.
    pub plan: Option<PlanId>,
    /// `x-credential-id` for the upstream, made once.
    pub id_header: HeaderValue,
    /// `x-tenant-id` for the upstream, made once.
    pub tenant_header: HeaderValue,
    /// What the identity source vouched for beside the caller's name (a
    /// JWT's claims, forward auth's headers) that the policy's limits key
    /// on; `None` for the policy's own keys.
    pub vouched: Option<Arc<crate::key_values::Vouched>>,
}

impl Credential {
    /// A credential, or `None` when the id or tenant cannot be sent to the
    /// upstream as a header value.
    pub fn new(id: &str, tenant: &str, plan: Option<PlanId>) -> Option<Self> {
        Self::of_tenant(id, &Tenant::new(tenant)?, plan)
    }

    /// A credential of a tenant made once for all its credentials (a keys
    /// file of a million keys has far fewer tenants); `None` when the id
    /// cannot be sent to the upstream as a header value.
    pub fn of_tenant(id: &str, tenant: &Tenant, plan: Option<PlanId>) -> Option<Self> {
        Some(Self {
            id_header: HeaderValue::from_str(id).ok()?,
            tenant_header: tenant.header.clone(),
            id: id.into(),
            tenant: tenant.name.clone(),
            plan,
            vouched: None,
        })
    }
}

/// A tenant's name and its `x-tenant-id` value, shared by its credentials.
#[derive(Debug, Clone)]
pub struct Tenant {
    name: Arc<str>,
    header: HeaderValue,
}

impl Tenant {
    /// `None` when the name cannot be sent to the upstream as a header value.
    pub fn new(name: &str) -> Option<Self> {
        Some(Self {
            header: HeaderValue::from_str(name).ok()?,
            name: name.into(),
        })
    }
}

/// Credentials by the SHA-256 digest of their raw key: built with
/// [`KeyTable::builder`], then read only.
///
/// A million keys must fit in a few hundred megabytes, so the table is one
/// array sorted by digest (40 bytes a key, where a hash map spends about
/// twice that in empty buckets) with an index of where each leading-bits
/// prefix starts. SHA-256 digests are uniform, so a prefix holds about
/// eight entries and a lookup is one index read and a short binary search.
#[derive(Debug, Default)]
pub struct KeyTable {
    by_digest: Vec<([u8; 32], Arc<Credential>)>,
    /// `starts[p]..starts[p + 1]`: the entries whose digest begins with
    /// prefix `p` of `bits` bits.
    starts: Vec<u32>,
    bits: u32,
    /// A 64-bit hash of every credential id, sorted: whether an id is taken
    /// (by credentials of other sources, which share the id space) in 8
    /// bytes a key.
    ids: Vec<u64>,
}

/// The hash [`KeyTable::has_id`] looks ids up by (SipHash with fixed keys:
/// the same in every process).
fn id_hash(id: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    id.hash(&mut h);
    h.finish()
}

/// Two credentials listed with one key digest: the one kept, and the other.
pub type SameDigest = (Arc<Credential>, Arc<Credential>);

/// Credentials being added to a [`KeyTable`].
#[derive(Debug, Default)]
pub struct KeyTableBuilder {
    entries: Vec<([u8; 32], Arc<Credential>)>,
}

impl KeyTableBuilder {
    /// Adds a credential.
    pub fn insert(&mut self, digest: [u8; 32], credential: Credential) {
        self.entries.push((digest, Arc::new(credential)));
    }

    /// The table, and the pairs of credentials listed with the same digest
    /// (the first of each pair is kept).
    pub fn build(mut self) -> (KeyTable, Vec<SameDigest>) {
        self.entries.sort_unstable_by_key(|e| e.0);
        let mut twice = Vec::new();
        self.entries.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                twice.push((kept.1.clone(), later.1.clone()));
            }
            same
        });
        self.entries.shrink_to_fit();
        // About eight entries a prefix; at most 2^20 prefixes (4 MiB).
        let bits = (self.entries.len() / 8).max(1).ilog2().min(20);
        let mut starts = vec![0u32; (1 << bits) + 1];
        for (digest, _) in &self.entries {
            starts[prefix(digest, bits) + 1] += 1;
        }
        for p in 1..starts.len() {
            starts[p] += starts[p - 1];
        }
        let mut ids: Vec<u64> = self.entries.iter().map(|(_, c)| id_hash(&c.id)).collect();
        ids.sort_unstable();
        let table = KeyTable {
            by_digest: self.entries,
            starts,
            bits,
            ids,
        };
        (table, twice)
    }
}

/// The first `bits` bits of a digest.
fn prefix(digest: &[u8; 32], bits: u32) -> usize {
    let lead = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    lead.checked_shr(32 - bits).unwrap_or(0) as usize
}

impl KeyTable {
    /// An empty builder.
    pub fn builder() -> KeyTableBuilder {
        KeyTableBuilder::default()
    }

    /// Number of credentials.
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Whether the table holds no credential.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// Every credential, in no particular order.
    pub fn credentials(&self) -> impl Iterator<Item = &Arc<Credential>> {
        self.by_digest.iter().map(|(_, c)| c)
    }

    /// Whether a credential of the table has id `id` (very rarely, for an
    /// id whose 64-bit hash another's shares, a false yes).
    pub fn has_id(&self, id: &str) -> bool {
        self.ids.binary_search(&id_hash(id)).is_ok()
    }

    /// The credential a raw key belongs to, if any.
    pub fn verify(&self, raw_key: &[u8]) -> Option<Arc<Credential>> {
        self.verify_digest(&digest(raw_key))
    }

    /// The credential of the key whose SHA-256 is `digest`, if any.
    pub fn verify_digest(&self, digest: &[u8; 32]) -> Option<Arc<Credential>> {
        let p = prefix(digest, self.bits);
        let (from, to) = match (self.starts.get(p), self.starts.get(p + 1)) {
            (Some(&from), Some(&to)) => (from as usize, to as usize),
            _ => return None,
        };
        let run = &self.by_digest[from..to];
        run.binary_search_by(|(d, _)| d.cmp(digest))
            .ok()
            .map(|i| run[i].1.clone())
    }
}

/// The most unknown callers a cache of `known` callers keeps beside them,
/// in a bound of their own so a flood of random keys cannot push known
/// callers out: a tenth of `known`, at least 1 000.
pub fn unknown_callers_bound(known: usize) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new((known / 10).max(1_000)).unwrap_or(std::num::NonZeroUsize::MIN)
}

/// SHA-256 of a raw key.
pub fn digest(raw_key: &[u8]) -> [u8; 32] {
    Sha256::digest(raw_key).into()
}

/// Parses a hex SHA-256 digest as written in the configuration.
pub fn parse_digest(hex_digest: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex_digest, &mut out).ok()?;
    Some(out)
}

/// Extracts the presented key from the request headers: the `Bearer` token
/// of `Authorization`, or the whole value of a custom header. Exactly one
/// header line is accepted; several are treated as no key.
pub fn presented_key<'h>(headers: &'h HeaderMap, header: &HeaderName) -> Option<&'h [u8]> {
    let mut values = headers.get_all(header).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let value = value.as_bytes();
    let key = if header == http::header::AUTHORIZATION {
        let (scheme, rest) = split_once(value, b' ')?;
        if !scheme.eq_ignore_ascii_case(b"bearer") {
            return None;
        }
        rest
    } else {
        value
    };
    let key = key.trim_ascii();
    (!key.is_empty()).then_some(key)
}

fn split_once(bytes: &[u8], sep: u8) -> Option<(&[u8], &[u8])> {
    let at = bytes.iter().position(|&b| b == sep)?;
    Some((&bytes[..at], &bytes[at + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> KeyTable {
        let mut t = KeyTable::builder();
        let c = Credential::new("ci", "acme", None).unwrap();
        t.insert(digest(b"secret-key"), c.clone());
        t.insert(digest(b"secret-key"), c);
        let (table, twice) = t.build();
        assert_eq!(twice.len(), 1, "the duplicate digest is reported");
        assert_eq!(table.len(), 1);
        table
    }

    #[test]
    fn every_key_of_a_large_table_is_found_and_no_other() {
        for n in [0usize, 1, 7, 100, 5_000] {
            let mut t = KeyTable::builder();
            for i in 0..n {
                let id = format!("c{i}");
                t.insert(
                    digest(id.as_bytes()),
                    Credential::new(&id, "t", None).unwrap(),
                );
            }
            let (table, twice) = t.build();
            assert!(twice.is_empty());
            assert_eq!(table.len(), n);
            for i in 0..n {
                let id = format!("c{i}");
                assert_eq!(
                    table.verify(id.as_bytes()).map(|c| c.id.clone()),
                    Some(id.into())
                );
            }
            for i in n..n + 200 {
                assert!(table.verify(format!("c{i}").as_bytes()).is_none());
            }
        }
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn bearer_token_is_found_and_verified() {
        let h = headers(&[("authorization", "Bearer secret-key")]);
        let key = presented_key(&h, &http::header::AUTHORIZATION).unwrap();
        assert_eq!(table().verify(key).unwrap().tenant.as_ref(), "acme");
        let h = headers(&[("authorization", "bearer   secret-key  ")]);
        assert!(presented_key(&h, &http::header::AUTHORIZATION).is_some());
    }

    #[test]
    fn other_schemes_and_empty_tokens_are_no_key() {
        for v in ["Basic c2VjcmV0", "Bearer ", "Bearer", "secret-key"] {
            let h = headers(&[("authorization", v)]);
            assert_eq!(presented_key(&h, &http::header::AUTHORIZATION), None, "{v}");
        }
        let h = headers(&[("authorization", "Bearer a"), ("authorization", "Bearer b")]);
        assert_eq!(presented_key(&h, &http::header::AUTHORIZATION), None);
    }

    #[test]
    fn custom_header_carries_the_raw_key() {
        let name = HeaderName::from_static("x-api-key");
        let h = headers(&[("x-api-key", "secret-key")]);
        assert!(table().verify(presented_key(&h, &name).unwrap()).is_some());
        assert!(table().verify(b"wrong").is_none());
    }

    #[test]
    fn identities_that_cannot_be_headers_are_refused() {
        assert!(Credential::new("ci", "acme\nx-admin: 1", None).is_none());
        assert!(Credential::new("ci", "Acme Corp (EU)", None).is_some());
    }

    #[test]
    fn digests_parse_from_hex() {
        let hex = hex::encode(digest(b"k"));
        assert_eq!(parse_digest(&hex), Some(digest(b"k")));
        assert_eq!(parse_digest(&hex.to_uppercase()), Some(digest(b"k")));
        assert_eq!(parse_digest("abc"), None);
        assert_eq!(parse_digest(&"zz".repeat(32)), None);
    }
}
