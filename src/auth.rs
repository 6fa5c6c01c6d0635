//! API keys: the table of credentials, looked up by the SHA-256 of the raw
//! key. The configuration never holds a plaintext key, and the raw key never
//! leaves this module: it is hashed and forgotten.

use std::collections::HashMap;
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
}

impl Credential {
    /// A credential, or `None` when the id or tenant cannot be sent to the
    /// upstream as a header value.
    pub fn new(id: &str, tenant: &str, plan: Option<PlanId>) -> Option<Self> {
        Some(Self {
            id_header: HeaderValue::from_str(id).ok()?,
            tenant_header: HeaderValue::from_str(tenant).ok()?,
            id: id.into(),
            tenant: tenant.into(),
            plan,
        })
    }
}

/// Credentials by the SHA-256 digest of their raw key.
#[derive(Debug, Default)]
pub struct KeyTable {
    by_digest: HashMap<[u8; 32], Arc<Credential>, ahash::RandomState>,
}

impl KeyTable {
    /// Adds a credential; returns false when the digest is already present.
    pub fn insert(&mut self, digest: [u8; 32], credential: Credential) -> bool {
        use std::collections::hash_map::Entry;
        match self.by_digest.entry(digest) {
            Entry::Occupied(_) => false,
            Entry::Vacant(slot) => {
                slot.insert(Arc::new(credential));
                true
            }
        }
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
        self.by_digest.values()
    }

    /// The credential a raw key belongs to, if any.
    pub fn verify(&self, raw_key: &[u8]) -> Option<Arc<Credential>> {
        self.by_digest.get(&digest(raw_key)).cloned()
    }
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
        let mut t = KeyTable::default();
        let c = Credential::new("ci", "acme", None).unwrap();
        assert!(t.insert(digest(b"secret-key"), c.clone()));
        assert!(!t.insert(digest(b"secret-key"), c), "duplicate digest");
        t
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
