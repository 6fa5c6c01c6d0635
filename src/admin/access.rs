//! Who may do what on `/admin/*`: the tokens of `server.admin_tokens` and
//! the one `server.admin_token_env` names, each read or write.
//!
//! GETs need a token once any is configured; every write needs a `write`
//! token and `Content-Type: application/json`, always. With no token at
//! all the admin API is read-only: nothing that can reach the admin port
//! (a browser on the operator's machine posting a form included, which
//! cannot send that content type without a preflight) can change state.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{HeaderMap, Method};

use crate::config::{AdminRole, AdminToken};

/// Writes a second, at most, per token.
pub const WRITES_PER_SECOND: u32 = 10;
/// The largest admin request body.
pub const MAX_BODY_BYTES: u64 = 64 * 1024;

/// The token `server.admin_token_env` names, read once at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvToken {
    /// No variable named.
    None,
    /// A variable is named but unset or empty: `/admin/*` is closed.
    Missing,
    /// The SHA-256 of its value: a `write` token named `env`.
    Token([u8; 32]),
}

impl EnvToken {
    /// From `server.admin_token_env` and the environment.
    pub fn from_env(var: Option<&str>) -> Self {
        match var.map(std::env::var) {
            None => EnvToken::None,
            Some(Ok(token)) if !token.is_empty() => {
                EnvToken::Token(crate::identity::auth::digest(token.as_bytes()))
            }
            Some(_) => EnvToken::Missing,
        }
    }
}

/// Who is asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// No token, and none is configured.
    Anonymous,
    /// A configured token.
    Token {
        /// Its name, the audit log's `actor`.
        name: Arc<str>,
        /// What it may do.
        role: AdminRole,
    },
    /// A token is configured and the request carries none that matches.
    Unknown,
}

impl Caller {
    /// The audit log's `actor`.
    pub fn actor(&self) -> &str {
        match self {
            Caller::Anonymous => "anonymous",
            Caller::Token { name, .. } => name,
            Caller::Unknown => "unknown",
        }
    }

    /// Whether a token identified the caller (reports then show
    /// identities).
    pub fn identified(&self) -> bool {
        matches!(self, Caller::Token { .. })
    }
}

/// Why a request was refused: status and the problem's detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// 401, 403, 413, 415 or 429.
    pub status: u16,
    /// The problem's `type` suffix and its detail.
    pub kind: &'static str,
    /// What to do about it.
    pub detail: &'static str,
}

/// Whether a method changes state.
pub fn is_write(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD)
}

/// The caller of a request: the token whose digest matches the presented
/// one. Every configured token is compared, with no early exit, so the
/// time taken says nothing about which (if any) matched.
pub fn caller(env: EnvToken, tokens: &[AdminToken], headers: &HeaderMap) -> Caller {
    let env_token = match env {
        EnvToken::Token(digest) => Some(AdminToken {
            name: Arc::from("env"),
            digest,
            role: AdminRole::Write,
        }),
        EnvToken::None | EnvToken::Missing => None,
    };
    let all: Vec<&AdminToken> = env_token.iter().chain(tokens).collect();
    if all.is_empty() {
        return Caller::Anonymous;
    }
    let Some(presented) =
        crate::identity::auth::presented_key(headers, &http::header::AUTHORIZATION)
    else {
        return Caller::Unknown;
    };
    let digest = crate::identity::auth::digest(presented);
    let mut found = None;
    for t in all {
        let same = t
            .digest
            .iter()
            .zip(&digest)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
        if same && found.is_none() {
            found = Some(Caller::Token {
                name: t.name.clone(),
                role: t.role,
            });
        }
    }
    found.unwrap_or(Caller::Unknown)
}

/// Whether `caller` may make this request: a read, or a write with its
/// content type and declared length.
pub fn check(
    env: EnvToken,
    caller: &Caller,
    method: &Method,
    headers: &HeaderMap,
) -> Result<(), Refusal> {
    if env == EnvToken::Missing {
        return Err(Refusal {
            status: 403,
            kind: "admin-closed",
            detail: "server.admin_token_env names a variable that is not set: /admin/* is closed.",
        });
    }
    if *caller == Caller::Unknown {
        return Err(Refusal {
            status: 401,
            kind: "admin-token-required",
            detail: "An admin token is required: Authorization: Bearer <token>.",
        });
    }
    if !is_write(method) {
        return Ok(());
    }
    match caller {
        Caller::Anonymous => {
            return Err(Refusal {
                status: 403,
                kind: "admin-read-only",
                detail: "No admin token is configured, so the admin API is read-only: \
                         add a write token to server.admin_tokens.",
            })
        }
        Caller::Token {
            role: AdminRole::Read,
            ..
        } => {
            return Err(Refusal {
                status: 403,
                kind: "admin-write-token-required",
                detail: "This token may read; a write needs a token with role write.",
            })
        }
        _ => {}
    }
    let json = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(Refusal {
            status: 415,
            kind: "admin-json-required",
            detail: "An admin write needs Content-Type: application/json.",
        });
    }
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES) {
        return Err(Refusal {
            status: 413,
            kind: "admin-body-too-large",
            detail: "An admin request body may hold at most 64 KiB.",
        });
    }
    Ok(())
}

/// Writes allowed per token: a fixed one-second window each.
#[derive(Debug, Default)]
pub struct WriteLimiter {
    windows: Mutex<HashMap<Arc<str>, (u64, u32)>>,
}

impl WriteLimiter {
    /// Counts a write by `actor` at `now` (ms of the process clock);
    /// refuses it beyond [`WRITES_PER_SECOND`].
    pub fn admit(&self, actor: &str, now: Duration) -> Result<(), Refusal> {
        let second = now.as_secs();
        let mut windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        // Tokens are few; windows of past seconds are dropped as they pass.
        windows.retain(|_, (s, _)| *s == second);
        let entry = windows.entry(Arc::from(actor)).or_insert((second, 0));
        if entry.1 >= WRITES_PER_SECOND {
            return Err(Refusal {
                status: 429,
                kind: "admin-writes-limited",
                detail: "At most 10 admin writes a second per token.",
            });
        }
        entry.1 += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn token(name: &str, secret: &str, role: AdminRole) -> AdminToken {
        AdminToken {
            name: name.into(),
            digest: crate::identity::auth::digest(secret.as_bytes()),
            role,
        }
    }

    #[test]
    fn without_tokens_reads_pass_and_writes_never_do() {
        let none = headers(&[("content-type", "application/json")]);
        let who = caller(EnvToken::None, &[], &none);
        assert_eq!(who, Caller::Anonymous);
        assert!(check(EnvToken::None, &who, &Method::GET, &none).is_ok());
        let refused = check(EnvToken::None, &who, &Method::POST, &none).unwrap_err();
        assert_eq!(refused.status, 403);
    }

    #[test]
    fn roles_decide_and_writes_need_json() {
        let tokens = [
            token("ops", "r-secret", AdminRole::Read),
            token("oncall", "w-secret", AdminRole::Write),
        ];
        let env = EnvToken::None;
        let read = headers(&[("authorization", "Bearer r-secret")]);
        let who = caller(env, &tokens, &read);
        assert_eq!(who.actor(), "ops");
        assert!(check(env, &who, &Method::GET, &read).is_ok());
        assert_eq!(
            check(env, &who, &Method::POST, &read).unwrap_err().status,
            403
        );

        let write = headers(&[("authorization", "Bearer w-secret")]);
        let who = caller(env, &tokens, &write);
        assert_eq!(who.actor(), "oncall");
        // A form's content type is refused: no browser sends JSON cross-site
        // without asking first.
        for form in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data",
        ] {
            let h = headers(&[("authorization", "Bearer w-secret"), ("content-type", form)]);
            assert_eq!(
                check(env, &who, &Method::POST, &h).unwrap_err().status,
                415,
                "{form}"
            );
        }
        let json = headers(&[
            ("authorization", "Bearer w-secret"),
            ("content-type", "application/json; charset=utf-8"),
        ]);
        assert!(check(env, &who, &Method::POST, &json).is_ok());
        let big = headers(&[
            ("authorization", "Bearer w-secret"),
            ("content-type", "application/json"),
            ("content-length", "65537"),
        ]);
        assert_eq!(
            check(env, &who, &Method::POST, &big).unwrap_err().status,
            413
        );

        for wrong in ["Bearer nope", "Basic w-secret", ""] {
            let h = headers(&[("authorization", wrong)]);
            let who = caller(env, &tokens, &h);
            assert_eq!(who, Caller::Unknown, "{wrong}");
            assert_eq!(check(env, &who, &Method::GET, &h).unwrap_err().status, 401);
        }
    }

    #[test]
    fn the_env_token_writes_and_a_missing_one_closes_everything() {
        let env = EnvToken::Token(crate::identity::auth::digest(b"from-env"));
        let h = headers(&[("authorization", "Bearer from-env")]);
        let who = caller(env, &[], &h);
        assert_eq!(
            who,
            Caller::Token {
                name: "env".into(),
                role: AdminRole::Write
            }
        );
        let who = caller(EnvToken::Missing, &[], &h);
        assert_eq!(
            check(EnvToken::Missing, &who, &Method::GET, &h)
                .unwrap_err()
                .status,
            403
        );
    }

    #[test]
    fn writes_are_limited_per_token_and_second() {
        let limiter = WriteLimiter::default();
        let at = Duration::from_millis(5_000);
        for _ in 0..WRITES_PER_SECOND {
            assert!(limiter.admit("a", at).is_ok());
        }
        assert_eq!(limiter.admit("a", at).unwrap_err().status, 429);
        assert!(limiter.admit("b", at).is_ok(), "another token has its own");
        assert!(
            limiter.admit("a", Duration::from_millis(6_000)).is_ok(),
            "a new second"
        );
    }
}
