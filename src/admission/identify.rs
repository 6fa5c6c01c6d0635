//! The identity stage: the caller a request's key names, asked of the
//! sources in order — the policy's keys and the answers cached in memory
//! first ([`authenticate`]), then, once the pre-auth limits admitted the
//! request, the work that costs (a JWT's signature, the store's
//! credentials, the forward-auth service: [`look_up`]) — and accepted
//! unless revoked ([`accept`]). Each lookup is counted by source and
//! result; each refusal by reason.

use std::sync::Arc;

use crate::identity::auth::{self, Credential};
use crate::identity::{forward_auth, store_keys, AuthSource};
use crate::respond::Rejection;
use crate::runtime::Runtime;

use super::Facts;

/// The work that may name a caller the local lookups do not know, made
/// only once the pre-auth limits admitted the request: a JWT's signature
/// check, or in order the store's credentials, then the forward-auth
/// service.
#[derive(Debug, Clone, Default)]
pub struct Pending {
    /// The key is a JWT, to verify.
    pub jwt: bool,
    /// The field of the key's record among the store's credentials.
    pub store: Option<String>,
    /// The request's entry at the forward-auth service.
    pub forward: Option<forward_auth::Entry>,
}

/// What the sources at hand say of a request's caller.
#[derive(Debug)]
pub enum Identified {
    /// Known to this source (the policy's keys, or a cached answer).
    Known(Arc<Credential>, AuthSource),
    /// Refused, for this `tollgate_auth_failures_total` reason.
    Refused(&'static str),
    /// Only a lookup can say.
    Ask(Pending),
}

/// The caller a request's key names, and the source that knew it (`file`
/// for the policy's keys and its keys file, `jwt`, `forward` when the
/// service's answer is cached); else the failure's reason, or the entry to
/// ask the forward-auth service about. A cached answer counts if it is
/// still fresh at `now`. A JWT that fails is refused, never tried as an
/// API key.
pub fn authenticate(
    rt: &Runtime,
    headers: &http::HeaderMap,
    now: tokio::time::Instant,
) -> Identified {
    let policy = &rt.policy;
    let metrics = rt.all_metrics();
    let Some(key) = auth::presented_key(headers, &policy.auth.header) else {
        return Identified::Refused("missing");
    };
    if !policy.auth.jwt.is_empty() && crate::identity::jwt::looks_like_jwt(key) {
        // A signature check costs many times a key's lookup (and an
        // unknown `kid` a key-set fetch): it waits for the pre-auth limits,
        // so a flood of forged tokens is bounded by them first.
        return Identified::Ask(Pending {
            jwt: true,
            ..Pending::default()
        });
    }
    let digest = auth::digest(key);
    if let Some(c) = policy.auth.keys.verify_digest(&digest) {
        metrics.auth_lookup(AuthSource::File.as_str(), "hit");
        return Identified::Known(c, AuthSource::File);
    }
    metrics.auth_lookup(AuthSource::File.as_str(), "miss");
    let mut pending = Pending::default();
    if policy.auth.store_keys.is_some() {
        let store = rt.limiter().records();
        let field = store_keys::StoreKeys::field(store, &digest);
        let plans = |name: &str| policy.plan_id(name);
        let taken = |id: &str| policy.auth.keys.has_id(id);
        match rt
            .services
            .store_keys
            .cached(&field, rt.generation, plans, taken, now)
        {
            Some(store_keys::Lookup::Known(c)) => {
                metrics.auth_lookup(AuthSource::Store.as_str(), "cached");
                return Identified::Known(c, AuthSource::Store);
            }
            Some(store_keys::Lookup::Unknown) => {
                metrics.auth_lookup(AuthSource::Store.as_str(), "cached")
            }
            None => pending.store = Some(field),
        }
    }
    if let Some(service) = &policy.auth.forward {
        let entry = service.entry(headers);
        // The store comes first: its answer is not known yet.
        let cached = pending.store.is_none().then(|| service.cached(&entry, now));
        match cached.flatten() {
            Some(forward_auth::Answer::Known(c)) => {
                metrics.auth_lookup(AuthSource::Forward.as_str(), "cached");
                return Identified::Known(c, AuthSource::Forward);
            }
            Some(_) => metrics.auth_lookup(AuthSource::Forward.as_str(), "cached"),
            None => pending.forward = Some(entry),
        }
    }
    if pending.store.is_none() && pending.forward.is_none() {
        Identified::Refused("unknown")
    } else {
        Identified::Ask(pending)
    }
}

/// The caller a JWT names at `now_ms` (wall clock), or the reason it is
/// refused.
fn verify_jwt(
    rt: &Runtime,
    headers: &http::HeaderMap,
    now_ms: u64,
) -> Result<Arc<Credential>, &'static str> {
    let policy = &rt.policy;
    let key = auth::presented_key(headers, &policy.auth.header).ok_or("missing")?;
    let plans = |name: &str| policy.plan_id(name);
    let verified = policy.auth.jwt.verify(key, plans, now_ms / 1000);
    let result = if verified.is_ok() { "hit" } else { "miss" };
    rt.all_metrics()
        .auth_lookup(AuthSource::Jwt.as_str(), result);
    verified.map(Arc::new).map_err(|failure| failure.reason())
}

/// The caller the store's credentials, then the forward-auth service,
/// name; `None` when neither knows the key. A store that cannot answer
/// leaves the caller to the forward-auth service; 503 only when no source
/// that answered named it and one could not answer.
async fn identify(
    rt: &Runtime,
    pending: Pending,
    headers: &http::HeaderMap,
) -> Result<Option<(Arc<Credential>, AuthSource)>, Rejection> {
    let metrics = rt.all_metrics();
    let unavailable = |why: &dyn std::fmt::Display| {
        metrics.auth_failure("unavailable");
        tracing::warn!(target: crate::logs::REQUEST, reason = %why, "a source of identities gave no answer");
        Rejection::AuthUnavailable
    };
    let mut store_down = None;
    if let Some(field) = pending.store {
        let store = rt.limiter().records();
        let plans = |name: &str| rt.policy.plan_id(name);
        let (found, called) = rt
            .services
            .store_keys
            .look_up(store, &field, rt.generation, plans, |id| {
                rt.policy.auth.keys.has_id(id)
            })
            .await;
        let result = match (&found, called) {
            (Err(_), _) => "error",
            (_, false) => "cached",
            (Ok(store_keys::Lookup::Known(_)), true) => "hit",
            (Ok(store_keys::Lookup::Unknown), true) => "miss",
        };
        metrics.auth_lookup(AuthSource::Store.as_str(), result);
        match found {
            Ok(store_keys::Lookup::Known(c)) => return Ok(Some((c, AuthSource::Store))),
            Ok(store_keys::Lookup::Unknown) => {}
            // One source down is not the gate: the next may name the
            // caller. Only a key no source could answer for is refused.
            Err(e) => store_down = Some(e),
        }
    }
    let (Some(entry), Some(service)) = (pending.forward, &rt.policy.auth.forward) else {
        return match store_down {
            Some(e) => Err(unavailable(&e)),
            None => Ok(None),
        };
    };
    let started = tokio::time::Instant::now();
    let (answer, via) = service.ask(entry, headers).await;
    if via == forward_auth::Via::Call {
        metrics
            .forward_auth_seconds
            .observe(started.elapsed().as_secs_f64());
    }
    let result = match (&answer, via) {
        (forward_auth::Answer::Unavailable(_), _) => "error",
        (_, forward_auth::Via::Cache) => "cached",
        (forward_auth::Answer::Known(_), _) => "hit",
        (forward_auth::Answer::Unknown, _) => "miss",
    };
    metrics.auth_lookup(AuthSource::Forward.as_str(), result);
    match (answer, store_down) {
        (forward_auth::Answer::Known(c), _) => Ok(Some((c, AuthSource::Forward))),
        // The store, which could not answer, may know the key.
        (forward_auth::Answer::Unknown, Some(e)) => Err(unavailable(&e)),
        (forward_auth::Answer::Unknown, None) => Ok(None),
        (forward_auth::Answer::Unavailable(why), _) => Err(unavailable(&why)),
    }
}

/// Makes the pending lookups of a request whose pre-auth limits admitted
/// it (a JWT checked at `now_ms`, wall clock): the caller they name and
/// its source, `None` for a key none of them
/// knows (counted as `unknown`), or the 503 of sources that could not
/// answer.
pub async fn look_up(
    rt: &Runtime,
    pending: Pending,
    headers: &http::HeaderMap,
    now_ms: u64,
) -> Result<Option<(Arc<Credential>, AuthSource)>, Rejection> {
    let identified = if pending.jwt {
        match verify_jwt(rt, headers, now_ms) {
            Ok(credential) => Some((credential, AuthSource::Jwt)),
            Err(reason) => {
                rt.all_metrics().auth_failure(reason);
                return Ok(None);
            }
        }
    } else {
        identify(rt, pending, headers).await?
    };
    if identified.is_none() {
        rt.all_metrics().auth_failure("unknown");
    }
    Ok(identified)
}

/// The caller a source verified, unless revoked at `now_ms` (wall clock),
/// when it is refused as an unknown key is; noted in `facts`.
pub fn accept(
    rt: &Runtime,
    verified: Option<(Arc<Credential>, AuthSource)>,
    now_ms: u64,
    facts: &mut Facts,
) -> Option<Arc<Credential>> {
    let (credential, source) = verified?;
    if rt.services.revocations.revoked(&credential.id, now_ms) {
        rt.all_metrics().auth_failure("revoked");
        return None;
    }
    facts.auth_source = Some(source);
    facts.credential = Some(credential.clone());
    Some(credential)
}
