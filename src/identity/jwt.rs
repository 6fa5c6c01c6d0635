//! Callers identified by a JSON Web Token: a bearer token of
//! three base64url segments is verified against its issuer's public keys
//! (a JWKS, by `kid`) and its claims become the caller: credential
//! `jwt:<issuer name>:<sub>`, tenant `<tenant_prefix><tenant claim>`, and a
//! plan when a claim names one. A token that fails is refused (401), never
//! tried as an API key.
//!
//! What is refused: `alg: none` and every algorithm the issuer does not
//! list; HMAC (a shared secret, so a public key must never verify one);
//! tokens without `exp`, `iss` or `aud`, expired ones, ones not yet valid
//! (`nbf`), of another issuer or audience (each with `leeway_s`); tokens
//! over 8 KiB; identity claims over 256 bytes or not printable. The
//! `jku`, `x5u` and `jwk` headers are never read: keys come from the
//! policy's JWKS only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};

use arc_swap::ArcSwap;

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use super::auth::Credential;
use crate::limits::PlanId;

/// Tokens longer than this are refused unread.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// Claims that name a caller are at most this long.
const MAX_CLAIM_BYTES: usize = 256;

/// Why a token was refused: the `reason` of `tollgate_auth_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No issuer of the policy, or no key of its JWKS, matches the token.
    Unknown,
    /// Its `exp` (with leeway) has passed.
    Expired,
    /// The signature does not verify, or its algorithm is not allowed.
    BadSignature,
    /// Malformed, too large, missing or wrong claims (`nbf`, `iss`, `aud`,
    /// the identity claims).
    BadClaims,
}

impl Failure {
    /// The metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Failure::Unknown => "unknown",
            Failure::Expired => "expired",
            Failure::BadSignature => "bad_signature",
            Failure::BadClaims => "bad_claims",
        }
    }
}

/// Whether a presented key is a JWT: three non-empty base64url segments.
pub fn looks_like_jwt(key: &[u8]) -> bool {
    let b64url = |b: &u8| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_';
    let mut segments = 0;
    for segment in key.split(|&b| b == b'.') {
        if segment.is_empty() || !segment.iter().all(b64url) {
            return false;
        }
        segments += 1;
    }
    segments == 3
}

/// Where an issuer's keys come from.
#[derive(Debug)]
pub enum Jwks {
    /// A JWKS read with the policy (and again on every reload).
    Set(JwkSet),
    /// A JWKS fetched from a URL by the running gateway: at once, every
    /// `refresh`, and when a token names a `kid` it does not hold (at most
    /// once per [`DEMAND_INTERVAL`]). A failed fetch keeps the last good
    /// set.
    Url {
        /// `https://`, or `http://` to a loopback address.
        url: String,
        /// Time between fetches.
        refresh: std::time::Duration,
    },
}

/// The least time between fetches asked for by unknown `kid`s.
pub const DEMAND_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// The largest JWKS document fetched.
const MAX_JWKS_BYTES: u64 = 1 << 20;

/// One issuer's settings, validated by the policy loader.
#[derive(Debug)]
pub struct IssuerSettings {
    /// The issuer's name in the policy: credentials are `jwt:<name>:<sub>`.
    pub name: String,
    /// The `iss` its tokens carry.
    pub issuer: String,
    /// Accepted `aud` values; a token must name one.
    pub audiences: Vec<String>,
    /// The algorithms its tokens may be signed with (no HMAC, no `none`).
    pub algorithms: Vec<Algorithm>,
    /// Where its public keys come from.
    pub jwks: Jwks,
    /// The claim holding the tenant.
    pub tenant_claim: String,
    /// Put before the tenant claim, to keep issuers apart.
    pub tenant_prefix: String,
    /// The claim holding the caller's id (`sub`).
    pub credential_claim: String,
    /// The claim naming a plan, if any.
    pub plan_claim: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`, seconds.
    pub leeway_s: u64,
}

/// An issuer ready to verify tokens.
pub struct Issuer {
    name: String,
    issuer: String,
    /// One validation per algorithm listed: a validation's algorithms must
    /// all be of the verifying key's family.
    validations: Vec<(Algorithm, Validation)>,
    keys: Arc<Keys>,
    remote: Option<Arc<Remote>>,
    tenant_claim: String,
    tenant_prefix: String,
    credential_claim: String,
    plan_claim: Option<String>,
    /// Seconds a token's `exp` and `nbf` are stretched by.
    leeway_s: u64,
}

impl std::fmt::Debug for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer")
            .field("name", &self.name)
            .field("issuer", &self.issuer)
            .field("keys", &self.keys.current.load().len())
            .finish()
    }
}

/// An issuer's keys by `kid`, replaced whole when a fetch brings new ones.
struct Keys {
    current: ArcSwap<HashMap<String, DecodingKey>>,
}

/// Why a JWKS cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum JwksError {
    /// A key without a `kid`, which no token could name.
    #[error("key {index} of the JWKS has no `kid`")]
    NoKid {
        /// The key's place in the set, from 0.
        index: usize,
    },
    /// A shared secret (`kty: oct`), which must never verify a caller.
    #[error("key {kid:?} is a shared secret (`oct`); only public keys verify callers")]
    SharedSecret {
        /// The key's `kid`.
        kid: String,
    },
    /// A key that is not a usable public key.
    #[error("key {kid:?}: {source}")]
    BadKey {
        /// The key's `kid`.
        kid: String,
        /// Why the key cannot verify.
        source: jsonwebtoken::errors::Error,
    },
    /// Two keys with the same `kid`.
    #[error("two keys of the JWKS have kid {kid:?}")]
    DuplicateKid {
        /// The `kid` given twice.
        kid: String,
    },
    /// A set without keys.
    #[error("the JWKS holds no key")]
    Empty,
}

/// The keys of a JWKS, or why it cannot be used.
fn parse_keys(jwks: &JwkSet) -> Result<HashMap<String, DecodingKey>, JwksError> {
    let mut keys = HashMap::new();
    for (index, jwk) in jwks.keys.iter().enumerate() {
        let Some(kid) = &jwk.common.key_id else {
            return Err(JwksError::NoKid { index });
        };
        if matches!(jwk.algorithm, AlgorithmParameters::OctetKey(_)) {
            return Err(JwksError::SharedSecret { kid: kid.clone() });
        }
        let key = DecodingKey::from_jwk(jwk).map_err(|source| JwksError::BadKey {
            kid: kid.clone(),
            source,
        })?;
        if keys.insert(kid.clone(), key).is_some() {
            return Err(JwksError::DuplicateKid { kid: kid.clone() });
        }
    }
    if keys.is_empty() {
        return Err(JwksError::Empty);
    }
    Ok(keys)
}

/// Why a fetch of an issuer's JWKS brought no keys.
#[derive(Debug, thiserror::Error)]
enum FetchError {
    /// The request failed: no connection, a redirect, an error status.
    #[error(transparent)]
    Request(Box<ureq::Error>),
    /// The body could not be read, or is over [`MAX_JWKS_BYTES`].
    #[error(transparent)]
    Body(Box<ureq::Error>),
    /// The body is not a JWKS document.
    #[error("not a JWKS: {0}")]
    NotAJwks(serde_json::Error),
    /// The JWKS has no usable keys.
    #[error(transparent)]
    Keys(JwksError),
}

/// A JWKS fetched by the running gateway.
struct Remote {
    url: String,
    refresh: std::time::Duration,
    /// Set when a token names an unknown `kid`; the fetcher wakes on it.
    wanted: Mutex<bool>,
    wake: Condvar,
    /// When a fetch was last asked for by an unknown `kid` (wall-clock
    /// ms), to ask at most once per [`DEMAND_INTERVAL`].
    demanded_at: AtomicU64,
    fetches: AtomicU64,
}

impl Remote {
    /// Asks for a fetch now, unless one was asked for lately or the first
    /// one has not been made yet (it is on its way).
    fn demand(&self) {
        if self.fetches.load(Ordering::Relaxed) == 0 {
            return;
        }
        let now = crate::clock::wall_ms();
        let last = self.demanded_at.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= DEMAND_INTERVAL.as_millis() as u64;
        if due
            && self
                .demanded_at
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            *self.wanted.lock().unwrap_or_else(|e| e.into_inner()) = true;
            self.wake.notify_one();
        }
    }

    /// One fetch: the keys, or why there are none.
    fn fetch(&self) -> Result<HashMap<String, DecodingKey>, FetchError> {
        self.fetches.fetch_add(1, Ordering::Relaxed);
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(std::time::Duration::from_secs(5)))
            .max_redirects(0)
            .build()
            .into();
        let mut response = agent
            .get(&self.url)
            .call()
            .map_err(|e| FetchError::Request(Box::new(e)))?;
        let body = response
            .body_mut()
            .with_config()
            .limit(MAX_JWKS_BYTES)
            .read_to_vec()
            .map_err(|e| FetchError::Body(Box::new(e)))?;
        let set: JwkSet = serde_json::from_slice(&body).map_err(FetchError::NotAJwks)?;
        parse_keys(&set).map_err(FetchError::Keys)
    }
}

/// Why an issuer cannot verify tokens.
#[derive(Debug, thiserror::Error)]
pub enum IssuerError {
    /// Its JWKS (read with the policy) cannot be used.
    #[error(transparent)]
    Keys(#[from] JwksError),
    /// It lists no algorithm.
    #[error("needs at least one algorithm")]
    NoAlgorithm,
}

impl Issuer {
    /// The issuer, or why its keys cannot be used.
    pub fn new(s: IssuerSettings) -> Result<Self, IssuerError> {
        let (keys, remote) = match s.jwks {
            Jwks::Set(set) => (parse_keys(&set)?, None),
            Jwks::Url { url, refresh } => {
                let remote = Remote {
                    url,
                    refresh,
                    wanted: Mutex::new(true),
                    wake: Condvar::new(),
                    demanded_at: AtomicU64::new(0),
                    fetches: AtomicU64::new(0),
                };
                (HashMap::new(), Some(Arc::new(remote)))
            }
        };
        let keys = Arc::new(Keys {
            current: ArcSwap::from_pointee(keys),
        });
        if s.algorithms.is_empty() {
            return Err(IssuerError::NoAlgorithm);
        }
        let validations = s
            .algorithms
            .iter()
            .map(|&alg| {
                let mut v = Validation::new(alg);
                // Time is checked by `verify` against the `now` it is
                // given, not by the library against the system clock.
                v.validate_exp = false;
                v.validate_nbf = false;
                v.set_issuer(&[&s.issuer]);
                v.set_audience(&s.audiences);
                v.set_required_spec_claims(&["exp", "iss", "aud"]);
                (alg, v)
            })
            .collect();
        Ok(Self {
            name: s.name,
            issuer: s.issuer,
            validations,
            keys,
            remote,
            tenant_claim: s.tenant_claim,
            tenant_prefix: s.tenant_prefix,
            credential_claim: s.credential_claim,
            plan_claim: s.plan_claim,
            leeway_s: s.leeway_s,
        })
    }
}

/// The issuers of a policy.
#[derive(Debug, Default)]
pub struct Issuers {
    issuers: Vec<Issuer>,
    /// The claims the policy's limits key on (`claim.NAME`), kept with the
    /// caller a token names.
    keyed_claims: Vec<Box<str>>,
}

impl Issuers {
    /// The policy's issuers.
    pub fn new(issuers: Vec<Issuer>) -> Self {
        Self {
            issuers,
            keyed_claims: Vec::new(),
        }
    }

    /// Keeps these claims of a verified token with its caller.
    pub fn keep_claims(&mut self, names: Vec<Box<str>>) {
        self.keyed_claims = names;
    }

    /// Starts a fetcher thread for each issuer whose keys come from a
    /// URL. Each ends once this policy is dropped (within a second).
    pub fn start_fetching(&self) {
        for issuer in &self.issuers {
            let Some(remote) = &issuer.remote else {
                continue;
            };
            let (remote, keys) = (Arc::downgrade(remote), Arc::downgrade(&issuer.keys));
            let name = issuer.name.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("jwks-{name}"))
                .spawn(move || fetch_loop(&name, &remote, &keys));
            if let Err(e) = spawned {
                tracing::error!(issuer = %issuer.name, error = %e, "cannot start the JWKS fetcher");
            }
        }
    }

    /// Takes over the keys `old` holds for each issuer of the same name
    /// and URL: a reloaded policy serves the last good set while its own
    /// first fetch is out, or failing, instead of refusing every token.
    pub fn keep_keys_of(&self, old: &Issuers) {
        for issuer in &self.issuers {
            let Some(remote) = &issuer.remote else {
                continue;
            };
            let same = old.issuers.iter().find(|o| {
                o.name == issuer.name && o.remote.as_ref().is_some_and(|r| r.url == remote.url)
            });
            if let Some(old) = same {
                issuer.keys.current.store(old.keys.current.load_full());
            }
        }
    }

    /// Fetches made for the issuer named `name` so far.
    pub fn fetches(&self, name: &str) -> u64 {
        self.issuers
            .iter()
            .find(|i| i.name == name)
            .and_then(|i| i.remote.as_ref())
            .map_or(0, |r| r.fetches.load(Ordering::Relaxed))
    }

    /// Whether `id` is in a name space of this policy's issuers
    /// (`jwt:<name>:<sub>`): such a caller can be revoked before its
    /// token expires.
    pub fn names(&self, id: &str) -> bool {
        self.issuers.iter().any(|i| {
            id.strip_prefix("jwt:")
                .and_then(|rest| rest.strip_prefix(i.name.as_str()))
                .and_then(|rest| rest.strip_prefix(':'))
                .is_some_and(|sub| !sub.is_empty())
        })
    }

    /// Whether the policy accepts JWTs at all.
    pub fn is_empty(&self) -> bool {
        self.issuers.is_empty()
    }

    /// The caller a token names at `now_s` (wall clock, seconds since the
    /// epoch), or why it is refused. `plans` names the policy's plans.
    pub fn verify(
        &self,
        token: &[u8],
        plans: impl Fn(&str) -> Option<PlanId>,
        now_s: u64,
    ) -> Result<Credential, Failure> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Failure::BadClaims);
        }
        let token = std::str::from_utf8(token).map_err(|_| Failure::BadClaims)?;
        // A header that does not parse is read once more, only to tell
        // `alg: none` or a name outside the standard set (which cannot be
        // verified: a signature failure) from a malformed header.
        let header = jsonwebtoken::decode_header(token).map_err(|_| {
            if names_an_algorithm(token) {
                Failure::BadClaims
            } else {
                Failure::BadSignature
            }
        })?;
        // The issuer is read unverified only to choose whose keys verify
        // the token; the verification checks it again.
        let claims: Value = jsonwebtoken::dangerous::insecure_decode_claims(token)
            .map_err(|_| Failure::BadClaims)?;
        let iss = claims
            .get("iss")
            .and_then(Value::as_str)
            .ok_or(Failure::BadClaims)?;
        let issuer = self
            .issuers
            .iter()
            .find(|i| i.issuer == iss)
            .ok_or(Failure::Unknown)?;
        let keys = issuer.keys.current.load();
        let Some(key) = header.kid.as_deref().and_then(|kid| keys.get(kid)) else {
            // Perhaps a key published since the last fetch.
            if let Some(remote) = &issuer.remote {
                remote.demand();
            }
            return Err(Failure::Unknown);
        };
        let validation = issuer
            .validations
            .iter()
            .find(|(alg, _)| *alg == header.alg)
            .map(|(_, v)| v)
            .ok_or(Failure::BadSignature)?;
        let data =
            jsonwebtoken::decode::<Value>(token, key, validation).map_err(|e| match e.kind() {
                ErrorKind::ExpiredSignature => Failure::Expired,
                ErrorKind::InvalidSignature
                | ErrorKind::InvalidAlgorithm
                | ErrorKind::InvalidKeyFormat
                | ErrorKind::InvalidEcdsaKey
                | ErrorKind::InvalidEddsaKey
                | ErrorKind::InvalidRsaKey(_) => Failure::BadSignature,
                _ => Failure::BadClaims,
            })?;
        in_time(&data.claims, now_s, issuer.leeway_s)?;
        // Identity claims: printable ASCII (they become header values and
        // log fields), as forward auth's identity headers are.
        let claim = |name: &str| {
            let value = data.claims.get(name)?.as_str()?;
            let printable = value.bytes().all(|b| (0x20..0x7f).contains(&b));
            (printable && !value.is_empty() && value.len() <= MAX_CLAIM_BYTES).then_some(value)
        };
        let sub = claim(&issuer.credential_claim).ok_or(Failure::BadClaims)?;
        let tenant = claim(&issuer.tenant_claim).ok_or(Failure::BadClaims)?;
        let plan = issuer
            .plan_claim
            .as_deref()
            .and_then(claim)
            .and_then(&plans);
        let id = format!("jwt:{}:{sub}", issuer.name);
        let tenant = format!("{}{tenant}", issuer.tenant_prefix);
        // Header values: printable, or refused.
        let mut caller = Credential::new(&id, &tenant, plan).ok_or(Failure::BadClaims)?;
        if !self.keyed_claims.is_empty() {
            caller.vouched = Some(Arc::new(keyed_claims(&data.claims, &self.keyed_claims)));
        }
        Ok(caller)
    }
}

/// Whether a token's `exp` and `nbf` (both whole seconds since the epoch)
/// hold at `now_s`, each stretched by `leeway_s`: `exp` is required, `nbf`
/// optional. An `exp` passed is `Expired`; a time that is not a whole
/// number, or an `nbf` still to come, is a bad claim.
fn in_time(claims: &Value, now_s: u64, leeway_s: u64) -> Result<(), Failure> {
    let seconds = |name: &str| match claims.get(name) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or(Failure::BadClaims),
    };
    let exp = seconds("exp")?.ok_or(Failure::BadClaims)?;
    if exp.saturating_add(leeway_s) < now_s {
        return Err(Failure::Expired);
    }
    if seconds("nbf")?.is_some_and(|nbf| nbf > now_s.saturating_add(leeway_s)) {
        return Err(Failure::BadClaims);
    }
    Ok(())
}

/// The claims limits key on, as their keys read them: a string as it is,
/// an integer in its one decimal form; other values are absent.
fn keyed_claims(claims: &Value, names: &[Box<str>]) -> crate::key_values::Vouched {
    let pairs = names
        .iter()
        .filter_map(|name| {
            let value = crate::key_values::json_value(claims.get(&**name)?)?;
            Some((crate::key_values::ValueDim::Claim(name.clone()), value))
        })
        .collect();
    crate::key_values::Vouched::new(pairs)
}

/// Fetches an issuer's JWKS at once, every `refresh`, and when asked;
/// keeps the last good set when a fetch fails; ends when the issuer is
/// dropped.
fn fetch_loop(name: &str, remote: &Weak<Remote>, keys: &Weak<Keys>) {
    let mut fetched_at: Option<std::time::Instant> = None;
    loop {
        let Some(r) = remote.upgrade() else { return };
        let due = fetched_at
            .is_none_or(|at| crate::clock::instant().saturating_duration_since(at) >= r.refresh);
        // Wait for a demand or the refresh time, waking each second to see
        // whether the policy is still live.
        let wanted = {
            let mut wanted = r.wanted.lock().unwrap_or_else(|e| e.into_inner());
            if !*wanted && !due {
                wanted = r
                    .wake
                    .wait_timeout(wanted, std::time::Duration::from_secs(1))
                    .map(|(w, _)| w)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
            std::mem::take(&mut *wanted)
        };
        if !wanted && !due {
            continue;
        }
        fetched_at = Some(crate::clock::instant());
        let fetched = r.fetch();
        let Some(k) = keys.upgrade() else { return };
        match fetched {
            Ok(fresh) => {
                tracing::info!(issuer = %name, keys = fresh.len(), "JWKS fetched");
                k.current.store(Arc::new(fresh));
            }
            Err(e) => {
                tracing::warn!(issuer = %name, url = %r.url, error = %e, "JWKS fetch failed; the last good keys stay");
            }
        }
    }
}

/// Whether the token's header names a signature algorithm (not `none`).
fn names_an_algorithm(token: &str) -> bool {
    use base64::Engine;
    let Some(segment) = token.split('.').next() else {
        return false;
    };
    let Ok(json) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(segment) else {
        return false;
    };
    serde_json::from_slice::<Value>(&json)
        .ok()
        .and_then(|h| {
            h.get("alg")?
                .as_str()
                .map(|alg| alg.parse::<Algorithm>().is_ok())
        })
        .unwrap_or(false)
}

/// Why an issuer may not list an algorithm.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AlgorithmError {
    /// Not the name of a JWS algorithm (names are case-sensitive; `none`
    /// is none).
    #[error("unknown algorithm {name:?}")]
    Unknown {
        /// The name as listed.
        name: String,
    },
    /// An HMAC algorithm: a shared secret, never a public key.
    #[error("{name} is HMAC, a shared secret: tollgate verifies callers with public keys only")]
    Hmac {
        /// The name as listed.
        name: String,
    },
}

/// The algorithms an issuer may list: public-key signatures only.
pub fn algorithm(name: &str) -> Result<Algorithm, AlgorithmError> {
    let alg: Algorithm = name.parse().map_err(|_| AlgorithmError::Unknown {
        name: name.to_owned(),
    })?;
    match alg {
        Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512 => Err(AlgorithmError::Hmac {
            name: name.to_owned(),
        }),
        _ => Ok(alg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn only_three_base64url_segments_look_like_a_jwt() {
        for (key, jwt) in [
            (&b"eyJh.eyJz.c2ln"[..], true),
            (b"a-_.b.c", true),
            (b"tg_demo_4f1c2a", false),
            (b"a.b", false),
            (b"a.b.c.d", false),
            (b"a..c", false),
            (b"a.b.", false),
            (b"a.b+c.d", false),
        ] {
            assert_eq!(looks_like_jwt(key), jwt, "{}", String::from_utf8_lossy(key));
        }
    }

    #[test]
    fn hmac_and_unknown_algorithms_cannot_be_listed() {
        assert!(algorithm("RS256").is_ok());
        assert!(algorithm("EdDSA").is_ok());
        for name in ["HS256", "HS512"] {
            assert!(
                matches!(algorithm(name), Err(AlgorithmError::Hmac { .. })),
                "{name}"
            );
        }
        for name in ["none", "rs256", ""] {
            assert!(
                matches!(algorithm(name), Err(AlgorithmError::Unknown { .. })),
                "{name}"
            );
        }
    }

    fn issuers() -> Issuers {
        let jwks: JwkSet = serde_json::from_value(serde_json::json!({ "keys": [{
            "kty": "EC", "crv": "P-256", "kid": "k1",
            "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
            "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"
        }]}))
        .unwrap();
        let issuer = Issuer::new(IssuerSettings {
            name: "main".into(),
            issuer: "https://auth.example.com/".into(),
            audiences: vec!["api".into()],
            algorithms: vec![Algorithm::ES256],
            jwks: Jwks::Set(jwks),
            tenant_claim: "org_id".into(),
            tenant_prefix: String::new(),
            credential_claim: "sub".into(),
            plan_claim: None,
            leeway_s: 30,
        })
        .unwrap();
        Issuers::new(vec![issuer])
    }

    #[test]
    fn unknown_kids_ask_for_a_fetch_at_most_once_per_interval() {
        let remote = Remote {
            url: "http://127.0.0.1:9/jwks".into(),
            refresh: std::time::Duration::from_secs(300),
            wanted: Mutex::new(false),
            wake: Condvar::new(),
            demanded_at: AtomicU64::new(0),
            fetches: AtomicU64::new(0),
        };
        // Before the first fetch: it is on its way already.
        remote.demand();
        assert!(!*remote.wanted.lock().unwrap());
        remote.fetches.store(1, Ordering::Relaxed);
        remote.demand();
        assert!(std::mem::take(&mut *remote.wanted.lock().unwrap()));
        for _ in 0..100 {
            remote.demand();
        }
        assert!(
            !*remote.wanted.lock().unwrap(),
            "asked again within the interval"
        );
        // Once the interval has passed, one more.
        let long_ago = crate::clock::wall_ms() - DEMAND_INTERVAL.as_millis() as u64;
        remote.demanded_at.store(long_ago, Ordering::Relaxed);
        remote.demand();
        assert!(*remote.wanted.lock().unwrap());
    }

    #[test]
    fn a_token_is_in_time_by_the_now_it_is_given_with_leeway() {
        let claims = |exp: serde_json::Value, nbf: Option<u64>| {
            let mut c = serde_json::json!({ "exp": exp });
            if let Some(nbf) = nbf {
                c["nbf"] = nbf.into();
            }
            c
        };
        let now = 1_000;
        // `exp` passed more than the leeway ago is expired; within it, not.
        assert_eq!(
            in_time(&claims(969.into(), None), now, 30),
            Err(Failure::Expired)
        );
        assert_eq!(in_time(&claims(970.into(), None), now, 30), Ok(()));
        assert_eq!(in_time(&claims(2_000.into(), None), now, 0), Ok(()));
        // The same token a second later, by the clock it is given.
        assert_eq!(in_time(&claims(1_000.into(), None), 1_000, 0), Ok(()));
        assert_eq!(
            in_time(&claims(1_000.into(), None), 1_001, 0),
            Err(Failure::Expired)
        );
        // `nbf` still to come beyond the leeway is refused.
        assert_eq!(
            in_time(&claims(2_000.into(), Some(1_031)), now, 30),
            Err(Failure::BadClaims)
        );
        assert_eq!(in_time(&claims(2_000.into(), Some(1_030)), now, 30), Ok(()));
        // `exp` is required, and a whole number.
        assert_eq!(
            in_time(&serde_json::json!({}), now, 30),
            Err(Failure::BadClaims)
        );
        assert_eq!(
            in_time(&claims("2000".into(), None), now, 30),
            Err(Failure::BadClaims)
        );
        assert_eq!(
            in_time(&claims((-1).into(), None), now, 30),
            Err(Failure::BadClaims)
        );
    }

    proptest! {
        /// Whatever a client sends, verification answers with a refusal,
        /// never a panic and never a caller.
        #[test]
        fn arbitrary_tokens_are_refused_without_panicking(
            bytes in prop::collection::vec(any::<u8>(), 0..300),
            segments in prop::collection::vec("[A-Za-z0-9_-]{0,60}", 3),
        ) {
            let issuers = issuers();
            prop_assert!(issuers.verify(&bytes, |_| None, 1_700_000_000).is_err());
            let token = segments.join(".");
            prop_assert!(issuers.verify(token.as_bytes(), |_| None, 1_700_000_000).is_err());
            // A well-formed header and claims, and a signature made up.
            use base64::Engine;
            let b64 = |v: &serde_json::Value| {
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
            };
            let forged = format!(
                "{}.{}.{}",
                b64(&serde_json::json!({ "alg": "ES256", "kid": "k1" })),
                b64(&serde_json::json!({ "iss": "https://auth.example.com/", "aud": "api",
                    "sub": segments[0], "org_id": "t", "exp": u32::MAX })),
                segments[2]
            );
            prop_assert!(issuers.verify(forged.as_bytes(), |_| None, 1_700_000_000).is_err());
        }
    }
}
