//! Forward auth (`auth.forward_auth`): who a caller is, asked of the
//! service that already knows, as Traefik's forwardAuth, NGINX's
//! `auth_request` and Envoy's `ext_authz` do.
//!
//! For a key no other source knows, one `GET` carries the listed request
//! headers to the service; a 2xx names the caller in its response headers,
//! a 401 or 403 says it is unknown, anything else (or no answer in time)
//! leaves the gateway unable to say. Answers are cached under a digest of
//! every forwarded header value, so a cookie or tenant header sent along
//! cannot let one caller's answer serve another; unknown callers are kept
//! apart, in a bound of their own, so a flood of random keys cannot evict
//! the callers who are known. Concurrent first requests of one entry share
//! one call, and no more than `max_in_flight` calls are made at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use http::{HeaderMap, HeaderName};
use lru::LruCache;
use pingora::connectors::http::v1::Connector;
use pingora::http::RequestHeader;
use pingora::upstreams::peer::HttpPeer;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use super::auth::{unknown_callers_bound, Credential};
use super::single_flight::SingleFlight;
use crate::limits::PlanId;

/// The longest identity value the service may answer with.
pub const MAX_VALUE: usize = 256;

/// How long an idle connection to the service is kept for the next call.
const IDLE: Duration = Duration::from_secs(60);

/// The most of a response body read (and dropped) to keep its connection.
const MAX_DRAINED: usize = 64 * 1024;

/// Where the service is and what it is asked, as validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The resolved address of the URL's host.
    pub addr: SocketAddr,
    /// Whether the URL is `https`.
    pub tls: bool,
    /// The URL's host (SNI and the `Host` header, with a non-default port).
    pub host: String,
    /// The `Host` header sent.
    pub authority: String,
    /// The URL's path and query.
    pub path: String,
    /// The request headers sent along.
    pub headers: Vec<HeaderName>,
    /// Where the answer names the tenant.
    pub tenant_header: HeaderName,
    /// Where the answer names the caller (`fwd:<id>`).
    pub credential_header: HeaderName,
    /// Where the answer names a plan, if anywhere.
    pub plan_header: Option<HeaderName>,
    /// How long a call may take.
    pub timeout: Duration,
    /// How long a known caller's answer is kept.
    pub cache_ttl: Duration,
    /// How long an unknown caller's answer is kept.
    pub negative_ttl: Duration,
    /// The most known callers kept.
    pub max_entries: usize,
    /// The most calls at once.
    pub max_in_flight: usize,
    /// The policy's plans by name.
    pub plans: HashMap<String, PlanId>,
    /// Headers of the answer the policy's limits key on (`auth.NAME`),
    /// kept with the caller it names.
    pub keyed_headers: Vec<HeaderName>,
}

/// What the service said of a caller.
#[derive(Debug, Clone)]
pub enum Answer {
    /// A 2xx naming the caller.
    Known(Arc<Credential>),
    /// A 401 or 403.
    Unknown,
    /// No usable answer: why, for the log.
    Unavailable(&'static str),
}

/// Whether an answer came from the cache or from a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Answered from the cache (or by a call another request made).
    Cache,
    /// Answered by a call this request made.
    Call,
}

/// A request's entry: the digest of its forwarded header values.
pub type Entry = [u8; 32];

/// The cached answers: known callers and unknown ones in separate bounds.
struct Cache {
    known: LruCache<Entry, (Arc<Credential>, Instant)>,
    unknown: LruCache<Entry, Instant>,
}

/// The forward-auth client of one policy.
pub struct ForwardAuth {
    settings: Settings,
    peer: HttpPeer,
    connector: Connector,
    cache: Mutex<Cache>,
    /// One call per entry at a time: later requests wait for its answer.
    calls: SingleFlight<Entry, Answer>,
    permits: Semaphore,
}

impl std::fmt::Debug for ForwardAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardAuth")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl ForwardAuth {
    /// A client of the service `settings` describe.
    pub fn new(settings: Settings) -> Self {
        let peer = HttpPeer::new(settings.addr, settings.tls, settings.host.clone());
        let known = NonZeroUsize::new(settings.max_entries.max(1)).unwrap_or(NonZeroUsize::MIN);
        let unknown = unknown_callers_bound(settings.max_entries);
        Self {
            peer,
            connector: Connector::new(None),
            cache: Mutex::new(Cache {
                known: LruCache::new(known),
                unknown: LruCache::new(unknown),
            }),
            calls: SingleFlight::default(),
            permits: Semaphore::new(settings.max_in_flight),
            settings,
        }
    }

    /// The settings it was made with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The entry of a request: a digest of each forwarded header's name and
    /// every value it has, length-prefixed so no two lists digest alike.
    pub fn entry(&self, headers: &HeaderMap) -> Entry {
        let mut h = Sha256::new();
        for name in &self.settings.headers {
            h.update((name.as_str().len() as u32).to_be_bytes());
            h.update(name.as_str());
            let values = headers.get_all(name);
            h.update((values.iter().count() as u32).to_be_bytes());
            for v in values {
                h.update((v.len() as u32).to_be_bytes());
                h.update(v.as_bytes());
            }
        }
        h.finalize().into()
    }

    /// The cached answer for `entry`, if one is still fresh at `now`.
    pub fn cached(&self, entry: &Entry, now: Instant) -> Option<Answer> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((credential, until)) = cache.known.get(entry) {
            if *until > now {
                return Some(Answer::Known(credential.clone()));
            }
            cache.known.pop(entry);
        }
        if let Some(until) = cache.unknown.get(entry) {
            if *until > now {
                return Some(Answer::Unknown);
            }
            cache.unknown.pop(entry);
        }
        None
    }

    /// The service's answer for a request whose entry is `entry`: asked
    /// once however many requests wait for it, and cached.
    pub async fn ask(&self, entry: Entry, headers: &HeaderMap) -> (Answer, Via) {
        if let Some(answer) = self.cached(&entry, Instant::now()) {
            return (answer, Via::Cache);
        }
        let (answer, called) = self
            .calls
            .run(&entry, || self.call_and_keep(entry, headers))
            .await;
        (answer, if called { Via::Call } else { Via::Cache })
    }

    /// One call, its answer cached when it is one.
    async fn call_and_keep(&self, entry: Entry, headers: &HeaderMap) -> Answer {
        let Ok(_permit) = self.permits.try_acquire() else {
            return Answer::Unavailable("max_in_flight lookups are in progress");
        };
        let answer = match tokio::time::timeout(self.settings.timeout, self.call(headers)).await {
            Ok(answer) => answer,
            Err(_) => Answer::Unavailable("no answer within timeout_ms"),
        };
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        match &answer {
            Answer::Known(c) => {
                cache.unknown.pop(&entry);
                cache
                    .known
                    .put(entry, (c.clone(), now + self.settings.cache_ttl));
            }
            Answer::Unknown => {
                cache.known.pop(&entry);
                cache.unknown.put(entry, now + self.settings.negative_ttl);
            }
            Answer::Unavailable(_) => {}
        }
        answer
    }

    /// The `GET` itself.
    async fn call(&self, headers: &HeaderMap) -> Answer {
        let s = &self.settings;
        let Ok((mut session, _)) = self.connector.get_http_session(&self.peer).await else {
            return Answer::Unavailable("cannot connect");
        };
        let Ok(mut req) = RequestHeader::build("GET", s.path.as_bytes(), Some(s.headers.len() + 2))
        else {
            return Answer::Unavailable("cannot build the request");
        };
        let mut built = req.insert_header(http::header::HOST, &s.authority).is_ok()
            && req
                .insert_header(http::header::USER_AGENT, "tollgate-forward-auth")
                .is_ok();
        for name in &s.headers {
            for v in headers.get_all(name) {
                built &= req.append_header(name.clone(), v.clone()).is_ok();
            }
        }
        if !built {
            return Answer::Unavailable("cannot build the request");
        }
        if session.write_request_header(Box::new(req)).await.is_err()
            || session.read_response().await.is_err()
        {
            return Answer::Unavailable("the call failed");
        }
        let Some(resp) = session.resp_header() else {
            return Answer::Unavailable("the call failed");
        };
        let status = resp.status.as_u16();
        let answer = match status {
            200..=299 => self.identity(&resp.headers),
            401 | 403 => Answer::Unknown,
            _ => Answer::Unavailable("the service answered neither 2xx nor 401/403"),
        };
        // What is left of the body is read so the connection can serve the
        // next call; a long one closes it instead.
        let mut drained = 0;
        let reusable = loop {
            match session.read_body_ref().await {
                Ok(Some(chunk)) => {
                    drained += chunk.len();
                    if drained > MAX_DRAINED {
                        break false;
                    }
                }
                Ok(None) => break true,
                Err(_) => break false,
            }
        };
        if reusable {
            self.connector
                .release_http_session(session, &self.peer, Some(IDLE))
                .await;
        }
        answer
    }

    /// The caller a 2xx names, or why it names none usable.
    fn identity(&self, headers: &HeaderMap) -> Answer {
        let s = &self.settings;
        let value = |name: &HeaderName| {
            let v = headers.get(name)?.as_bytes();
            let printable = v.iter().all(|b| (0x20..0x7f).contains(b));
            (printable && !v.is_empty() && v.len() <= MAX_VALUE)
                .then(|| String::from_utf8_lossy(v).into_owned())
        };
        let (Some(tenant), Some(id)) = (value(&s.tenant_header), value(&s.credential_header))
        else {
            return Answer::Unavailable(
                "a 2xx without a printable tenant and credential of at most 256 bytes",
            );
        };
        let plan = s
            .plan_header
            .as_ref()
            .and_then(value)
            .and_then(|p| s.plans.get(&p).copied());
        match Credential::new(&format!("fwd:{id}"), &tenant, plan) {
            Some(mut c) => {
                if !s.keyed_headers.is_empty() {
                    c.vouched = Some(Arc::new(keyed_headers(headers, &s.keyed_headers)));
                }
                Answer::Known(Arc::new(c))
            }
            None => Answer::Unavailable("an identity that cannot be sent upstream"),
        }
    }
}

/// The answer's headers limits key on, each when it has one line that is
/// text; a header given twice keeps the pair out (its value would be
/// ambiguous), so the limit reads it as absent.
fn keyed_headers(headers: &HeaderMap, names: &[HeaderName]) -> crate::key_values::Vouched {
    let pairs = names
        .iter()
        .filter_map(|name| {
            let mut lines = headers.get_all(name).iter();
            let first = lines.next()?;
            if lines.next().is_some() {
                return None;
            }
            let value = first.to_str().ok()?;
            Some((
                crate::key_values::ValueDim::Auth(name.clone()),
                value.to_owned(),
            ))
        })
        .collect();
    crate::key_values::Vouched::new(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(headers: &[&'static str]) -> ForwardAuth {
        ForwardAuth::new(Settings {
            addr: "127.0.0.1:9".parse().unwrap(),
            tls: false,
            host: "127.0.0.1".into(),
            authority: "127.0.0.1:9".into(),
            path: "/whoami".into(),
            headers: headers
                .iter()
                .map(|&h| HeaderName::from_static(h))
                .collect(),
            tenant_header: HeaderName::from_static("x-tenant-id"),
            credential_header: HeaderName::from_static("x-credential-id"),
            plan_header: Some(HeaderName::from_static("x-plan")),
            timeout: Duration::from_millis(200),
            cache_ttl: Duration::from_secs(60),
            negative_ttl: Duration::from_secs(10),
            max_entries: 100,
            max_in_flight: 4,
            plans: HashMap::from([("pro".to_string(), PlanId::new(0))]),
            keyed_headers: Vec::new(),
        })
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn every_forwarded_value_is_part_of_the_entry_and_nothing_else() {
        let fa = client(&["authorization", "cookie"]);
        let base = fa.entry(&headers(&[("authorization", "Bearer k")]));
        let other_cookie = fa.entry(&headers(&[("authorization", "Bearer k"), ("cookie", "a")]));
        let unlisted = fa.entry(&headers(&[("authorization", "Bearer k"), ("x-other", "a")]));
        let two_values = fa.entry(&headers(&[
            ("authorization", "Bearer k"),
            ("cookie", "a"),
            ("cookie", "b"),
        ]));
        let joined = fa.entry(&headers(&[("authorization", "Bearer k"), ("cookie", "ab")]));
        assert_ne!(base, other_cookie);
        assert_eq!(base, unlisted);
        assert_ne!(two_values, joined);
    }

    #[test]
    fn identities_are_bounded_printable_and_prefixed() {
        let fa = client(&["authorization"]);
        let known = fa.identity(&headers(&[
            ("x-tenant-id", "acme"),
            ("x-credential-id", "u-1"),
            ("x-plan", "pro"),
        ]));
        let Answer::Known(c) = known else {
            panic!("{known:?}")
        };
        assert_eq!(
            (&*c.id, &*c.tenant, c.plan),
            ("fwd:u-1", "acme", Some(PlanId::new(0)))
        );
        let no_plan = fa.identity(&headers(&[
            ("x-tenant-id", "acme"),
            ("x-credential-id", "u-1"),
            ("x-plan", "gold"),
        ]));
        assert!(matches!(no_plan, Answer::Known(c) if c.plan.is_none()));
        let long = "t".repeat(MAX_VALUE + 1);
        let mut h = headers(&[("x-credential-id", "u-1")]);
        h.insert("x-tenant-id", long.parse().unwrap());
        assert!(matches!(fa.identity(&h), Answer::Unavailable(_)));
        assert!(matches!(
            fa.identity(&headers(&[("x-tenant-id", "acme")])),
            Answer::Unavailable(_)
        ));
    }

    #[test]
    fn unknown_callers_have_a_bound_of_their_own() {
        let fa = client(&["authorization"]);
        let known = [7u8; 32];
        let c = Arc::new(Credential::new("fwd:a", "acme", None).unwrap());
        {
            let mut cache = fa.cache.lock().unwrap();
            let until = Instant::now() + Duration::from_secs(60);
            cache.known.put(known, (c, until));
            for i in 0..5_000u32 {
                let mut e = [0u8; 32];
                e[..4].copy_from_slice(&i.to_be_bytes());
                cache.unknown.put(e, until);
            }
        }
        assert!(matches!(
            fa.cached(&known, Instant::now()),
            Some(Answer::Known(_))
        ));
        assert_eq!(fa.cache.lock().unwrap().unknown.len(), 1_000);
    }
}
