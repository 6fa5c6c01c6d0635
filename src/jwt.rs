//! Callers identified by a JSON Web Token (DESIGN §20): a bearer token of
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

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use crate::auth::Credential;
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
    /// Its public keys.
    pub jwks: JwkSet,
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
    keys: HashMap<String, DecodingKey>,
    tenant_claim: String,
    tenant_prefix: String,
    credential_claim: String,
    plan_claim: Option<String>,
}

impl std::fmt::Debug for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer")
            .field("name", &self.name)
            .field("issuer", &self.issuer)
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl Issuer {
    /// The issuer, or why its keys cannot be used.
    pub fn new(s: IssuerSettings) -> Result<Self, String> {
        let mut keys = HashMap::new();
        for (i, jwk) in s.jwks.keys.iter().enumerate() {
            let Some(kid) = &jwk.common.key_id else {
                return Err(format!("key {i} of the JWKS has no `kid`"));
            };
            if matches!(jwk.algorithm, AlgorithmParameters::OctetKey(_)) {
                return Err(format!(
                    "key {kid:?} is a shared secret (`oct`); only public keys verify callers"
                ));
            }
            let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("key {kid:?}: {e}"))?;
            if keys.insert(kid.clone(), key).is_some() {
                return Err(format!("two keys of the JWKS have kid {kid:?}"));
            }
        }
        if keys.is_empty() {
            return Err("the JWKS holds no key".into());
        }
        if s.algorithms.is_empty() {
            return Err("needs at least one algorithm".into());
        }
        let validations = s
            .algorithms
            .iter()
            .map(|&alg| {
                let mut v = Validation::new(alg);
                v.leeway = s.leeway_s;
                v.validate_nbf = true;
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
            tenant_claim: s.tenant_claim,
            tenant_prefix: s.tenant_prefix,
            credential_claim: s.credential_claim,
            plan_claim: s.plan_claim,
        })
    }
}

/// The issuers of a policy.
#[derive(Debug, Default)]
pub struct Issuers {
    issuers: Vec<Issuer>,
}

impl Issuers {
    /// The policy's issuers.
    pub fn new(issuers: Vec<Issuer>) -> Self {
        Self { issuers }
    }

    /// Whether the policy accepts JWTs at all.
    pub fn is_empty(&self) -> bool {
        self.issuers.is_empty()
    }

    /// The caller a token names, or why it is refused. `plans` names the
    /// policy's plans.
    pub fn verify(
        &self,
        token: &[u8],
        plans: impl Fn(&str) -> Option<PlanId>,
    ) -> Result<Credential, Failure> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Failure::BadClaims);
        }
        let token = std::str::from_utf8(token).map_err(|_| Failure::BadClaims)?;
        // `alg: none`, and any name outside the standard set, cannot be
        // verified: a signature failure, whatever else the header holds.
        if !names_an_algorithm(token) {
            return Err(Failure::BadSignature);
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| Failure::BadClaims)?;
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
        let key = header
            .kid
            .as_deref()
            .and_then(|kid| issuer.keys.get(kid))
            .ok_or(Failure::Unknown)?;
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
        let claim = |name: &str| {
            let value = data.claims.get(name)?.as_str()?;
            (!value.is_empty() && value.len() <= MAX_CLAIM_BYTES).then_some(value)
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
        Credential::new(&id, &tenant, plan).ok_or(Failure::BadClaims)
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

/// The algorithms an issuer may list: public-key signatures only.
pub fn algorithm(name: &str) -> Result<Algorithm, String> {
    let alg: Algorithm = name
        .parse()
        .map_err(|_| format!("unknown algorithm {name:?}"))?;
    match alg {
        Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512 => Err(format!(
            "{name} is HMAC, a shared secret: tollgate verifies callers with public keys only"
        )),
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
        for name in ["HS256", "HS512", "none", "rs256", ""] {
            assert!(algorithm(name).is_err(), "{name}");
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
            jwks,
            tenant_claim: "org_id".into(),
            tenant_prefix: String::new(),
            credential_claim: "sub".into(),
            plan_claim: None,
            leeway_s: 30,
        })
        .unwrap();
        Issuers::new(vec![issuer])
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
            prop_assert!(issuers.verify(&bytes, |_| None).is_err());
            let token = segments.join(".");
            prop_assert!(issuers.verify(token.as_bytes(), |_| None).is_err());
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
            prop_assert!(issuers.verify(forged.as_bytes(), |_| None).is_err());
        }
    }
}
