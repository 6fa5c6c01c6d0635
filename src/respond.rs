//! Every rejection the gateway makes, mapped in one place to its status,
//! headers and `application/problem+json` body (RFC 9457).

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;
use pingora::http::ResponseHeader;
use pingora::Result;

use crate::limits::{Charge, Verdict};
use crate::metrics::Outcome;

/// Why a request is answered by the gateway instead of the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// Missing or unknown API key: one answer for both.
    Unauthorized,
    /// The client address is refused by the IP rules.
    Forbidden,
    /// No route matches (or the path has dot-segments).
    NotFound,
    /// The request cannot be read as sent: its framing, its target or its
    /// path (400).
    BadRequest {
        /// What is wrong, shown as the problem's `detail`.
        detail: &'static str,
    },
    /// A value a limit's key reads from the request cannot be used (400):
    /// given twice, missing, not one the limit accepts, or malformed.
    KeyValue {
        /// The problem type's last word (`ambiguous-key-value`, …).
        kind: &'static str,
        /// Which limit and dimension, and why (never the value).
        detail: String,
    },
    /// The request's head or body did not arrive in time (408).
    RequestTimeout,
    /// The request line and headers exceed `server.limits.max_header_bytes` (431).
    HeaderTooLarge,
    /// The body exceeds the route's `max_body_bytes` (413).
    PayloadTooLarge,
    /// A caller's limit denied; nothing was charged.
    RateLimited {
        /// Names of the limits that denied (`violated-policies`).
        violated: Vec<Arc<str>>,
        /// Seconds for `Retry-After`; `None` when the cost can never fit.
        retry_after: Option<u64>,
    },
    /// The limit store is failing and a limit says `closed`.
    StoreUnavailable {
        /// Seconds for `Retry-After`.
        retry_after: u64,
    },
    /// The forward-auth service failed, was too slow or too busy, or
    /// answered with an identity that cannot be used.
    AuthUnavailable,
    /// The usage ledger cannot record the request: its spool is full and
    /// says `refuse` (billing must not give work away).
    UsageUnavailable,
    /// The upstream pool has no room within its queue bound.
    Overloaded {
        /// Seconds for `Retry-After`.
        retry_after: u64,
    },
    /// Every server of the upstream pool fails its health checks.
    NoHealthyUpstream {
        /// Seconds for `Retry-After`.
        retry_after: u64,
    },
    /// The upstream could not be reached or failed (502), or the request
    /// could not be proxied for another reason (its own status: 400, 500…).
    ProxyFailed {
        /// The status of the response: 502, or the failure's own.
        status: u16,
    },
}

impl Rejection {
    /// The HTTP status of the response.
    pub fn status(&self) -> u16 {
        match self {
            Rejection::Unauthorized => 401,
            Rejection::Forbidden => 403,
            Rejection::NotFound => 404,
            Rejection::BadRequest { .. } | Rejection::KeyValue { .. } => 400,
            Rejection::RequestTimeout => 408,
            Rejection::PayloadTooLarge => 413,
            Rejection::HeaderTooLarge => 431,
            Rejection::RateLimited { .. } => 429,
            Rejection::ProxyFailed { status } => *status,
            Rejection::StoreUnavailable { .. }
            | Rejection::AuthUnavailable
            | Rejection::UsageUnavailable
            | Rejection::Overloaded { .. }
            | Rejection::NoHealthyUpstream { .. } => 503,
        }
    }

    /// The `outcome` label of `tollgate_requests_total`.
    pub fn outcome(&self) -> Outcome {
        match self {
            Rejection::Unauthorized => Outcome::Unauthorized,
            Rejection::Forbidden => Outcome::Forbidden,
            Rejection::NotFound => Outcome::NotFound,
            Rejection::BadRequest { .. }
            | Rejection::KeyValue { .. }
            | Rejection::RequestTimeout
            | Rejection::HeaderTooLarge
            | Rejection::PayloadTooLarge => Outcome::BadRequest,
            Rejection::RateLimited { .. } => Outcome::Limited,
            Rejection::StoreUnavailable { .. } => Outcome::StoreUnavailable,
            Rejection::AuthUnavailable => Outcome::AuthUnavailable,
            Rejection::UsageUnavailable => Outcome::UsageUnavailable,
            Rejection::Overloaded { .. } | Rejection::NoHealthyUpstream { .. } => {
                Outcome::Overloaded
            }
            // Forwarding failed after the request was admitted: the outcome
            // stays the admission's.
            Rejection::ProxyFailed { .. } => Outcome::Allowed,
        }
    }

    fn problem(&self) -> (&'static str, &'static str, String) {
        if let Rejection::ProxyFailed { status } = self {
            return proxy_failure(*status);
        }
        match self {
            Rejection::Unauthorized => (
                "unauthorized",
                "Unauthorized",
                "A valid API key is required.".into(),
            ),
            Rejection::Forbidden => (
                "forbidden",
                "Forbidden",
                "Requests from this address are not accepted.".into(),
            ),
            Rejection::NotFound => (
                "not-found",
                "Not Found",
                "No route matches this request.".into(),
            ),
            Rejection::BadRequest { detail } => ("bad-request", "Bad Request", (*detail).into()),
            Rejection::KeyValue { kind, detail } => (kind, "Bad Request", detail.clone()),
            Rejection::RequestTimeout => (
                "request-timeout",
                "Request Timeout",
                "The request was not received in time.".into(),
            ),
            Rejection::HeaderTooLarge => (
                "header-too-large",
                "Request Header Fields Too Large",
                "The request line and headers are too large.".into(),
            ),
            Rejection::PayloadTooLarge => (
                "payload-too-large",
                "Content Too Large",
                "The request body is larger than this route accepts.".into(),
            ),
            Rejection::RateLimited { violated, .. } => (
                "rate-limited",
                "Rate limit exceeded",
                format!(
                    "The {} policy has no available capacity.",
                    violated.join(", ")
                ),
            ),
            Rejection::StoreUnavailable { .. } => (
                "store-unavailable",
                "Service Unavailable",
                "Rate limits cannot be checked right now.".into(),
            ),
            Rejection::AuthUnavailable => (
                "auth-unavailable",
                "Service Unavailable",
                "Callers cannot be identified right now.".into(),
            ),
            Rejection::UsageUnavailable => (
                "usage-unavailable",
                "Service Unavailable",
                "Usage cannot be recorded right now.".into(),
            ),
            Rejection::Overloaded { .. } => (
                "overloaded",
                "Service Unavailable",
                "The service is at capacity.".into(),
            ),
            Rejection::NoHealthyUpstream { .. } => (
                "no-healthy-upstream",
                "Service Unavailable",
                "No healthy upstream server is available.".into(),
            ),
            Rejection::ProxyFailed { .. } => proxy_failure(500),
        }
    }

    fn retry_after(&self) -> Option<u64> {
        match self {
            Rejection::RateLimited { retry_after, .. } => *retry_after,
            Rejection::StoreUnavailable { retry_after }
            | Rejection::Overloaded { retry_after }
            | Rejection::NoHealthyUpstream { retry_after } => Some(*retry_after),
            Rejection::AuthUnavailable | Rejection::UsageUnavailable => Some(1),
            _ => None,
        }
    }

    /// The problem+json body.
    pub fn body(&self) -> Bytes {
        let (kind, title, detail) = self.problem();
        let mut body = serde_json::json!({
            "type": format!("urn:tollgate:problem:{kind}"),
            "title": title,
            "status": self.status(),
            "detail": detail,
        });
        if let Rejection::RateLimited { violated, .. } = self {
            body["violated-policies"] = violated.iter().map(|v| v.as_ref()).collect();
        }
        Bytes::from(body.to_string())
    }

    /// The response header, with `extra` headers (e.g. the draft rate-limit
    /// fields) added.
    pub fn header(&self, body_len: usize, extra: Option<&RateHeaders>) -> Result<ResponseHeader> {
        let mut h = ResponseHeader::build(self.status(), Some(6))?;
        h.insert_header("content-type", "application/problem+json")?;
        h.insert_header("content-length", body_len.to_string())?;
        h.insert_header("cache-control", "no-store")?;
        if let Some(secs) = self.retry_after() {
            h.insert_header("retry-after", secs.to_string())?;
        }
        if *self == Rejection::Unauthorized {
            h.insert_header("www-authenticate", "Bearer")?;
        }
        if let Some(extra) = extra {
            extra.apply(&mut h)?;
        }
        Ok(h)
    }
}

fn proxy_failure(status: u16) -> (&'static str, &'static str, String) {
    match status {
        504 => (
            "gateway-timeout",
            "Gateway Timeout",
            "The upstream service did not answer in time.".into(),
        ),
        502 => (
            "bad-gateway",
            "Bad Gateway",
            "The upstream service did not answer.".into(),
        ),
        413 => Rejection::PayloadTooLarge.problem(),
        400..=499 => (
            "bad-request",
            "Bad Request",
            "The request could not be read.".into(),
        ),
        _ => (
            "internal-error",
            "Internal Server Error",
            "The gateway could not process the request.".into(),
        ),
    }
}

/// One item of a `RateLimit` field, `"name";a=1;b=2`: written byte by
/// byte (this runs on every response), and a header value without a copy.
/// Limit names are validated header-safe, so the value is valid.
fn item(name: &str, (a, x): (u8, u64), (b, y): (u8, u64)) -> Option<HeaderValue> {
    let mut numbers = itoa::Buffer::new();
    let mut out = Vec::with_capacity(name.len() + 48);
    out.push(b'"');
    out.extend_from_slice(name.as_bytes());
    out.push(b'"');
    for (key, n) in [(a, x), (b, y)] {
        out.push(b';');
        out.push(key);
        out.push(b'=');
        out.extend_from_slice(numbers.format(n).as_bytes());
    }
    HeaderValue::from_maybe_shared(bytes::Bytes::from(out)).ok()
}

/// `RateLimit-Policy` and `RateLimit` fields (draft-ietf-httpapi-ratelimit-headers)
/// describing the most constrained limit of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateHeaders {
    /// `RateLimit-Policy`: `"name";q=QUOTA;w=SECONDS`.
    pub policy: HeaderValue,
    /// `RateLimit`: `"name";r=REMAINING;t=SECONDS`.
    pub limit: HeaderValue,
}

impl RateHeaders {
    /// Picks the enforced limit with the smallest share of its quota left.
    pub fn most_constrained(charges: &[Charge], verdicts: &[Verdict]) -> Option<Self> {
        let (c, v) = charges
            .iter()
            .zip(verdicts)
            // Concurrency limits count requests in flight, not a rate.
            .filter(|(c, _)| c.enforced() && c.hold.is_none())
            .min_by_key(|(c, v)| {
                (v.remaining as u128 * 1_000_000) / c.params.quota().max(1) as u128
            })?;
        Some(Self {
            policy: item(
                &c.name,
                (b'q', c.params.quota()),
                (b'w', c.params.period_secs()),
            )?,
            limit: item(
                &c.name,
                (b'r', v.remaining),
                (b't', v.reset_ms.div_ceil(1000)),
            )?,
        })
    }

    /// Sets both fields on a response.
    pub fn apply(&self, h: &mut ResponseHeader) -> Result<()> {
        // `&'static str` names: kept as given, without a title-cased copy.
        h.insert_header("ratelimit-policy", self.policy.clone())?;
        h.insert_header("ratelimit", self.limit.clone())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_value(h: &ResponseHeader, name: &str) -> Option<String> {
        h.headers.get(name).map(|v| v.to_str().unwrap().to_string())
    }

    #[test]
    fn rate_limited_carries_retry_after_and_policies() {
        let r = Rejection::RateLimited {
            violated: vec!["per-tenant".into()],
            retry_after: Some(3),
        };
        let body: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(body["status"], 429);
        assert_eq!(body["violated-policies"][0], "per-tenant");
        let h = r.header(10, None).unwrap();
        assert_eq!(h.status.as_u16(), 429);
        assert_eq!(header_value(&h, "retry-after").as_deref(), Some("3"));
        assert_eq!(
            header_value(&h, "cache-control").as_deref(),
            Some("no-store")
        );
    }

    #[test]
    fn ratelimit_items_are_written_exactly() {
        let v = item("per-tenant", (b'q', 0), (b'w', u64::MAX)).unwrap();
        assert_eq!(v, "\"per-tenant\";q=0;w=18446744073709551615");
        let v = item("a", (b'r', 1_000_000), (b't', 7)).unwrap();
        assert_eq!(v, "\"a\";r=1000000;t=7");
    }

    #[test]
    fn a_cost_that_never_fits_has_no_retry_after() {
        let r = Rejection::RateLimited {
            violated: vec!["x".into()],
            retry_after: None,
        };
        assert_eq!(
            header_value(&r.header(1, None).unwrap(), "retry-after"),
            None
        );
    }

    #[test]
    fn unauthorized_challenges_for_a_bearer_token() {
        let h = Rejection::Unauthorized.header(1, None).unwrap();
        assert_eq!(
            header_value(&h, "www-authenticate").as_deref(),
            Some("Bearer")
        );
        assert_eq!(
            header_value(&h, "content-type").as_deref(),
            Some("application/problem+json")
        );
    }

    #[test]
    fn overload_is_a_503_with_retry_after() {
        let h = Rejection::Overloaded { retry_after: 1 }
            .header(1, None)
            .unwrap();
        assert_eq!(h.status.as_u16(), 503);
        assert_eq!(header_value(&h, "retry-after").as_deref(), Some("1"));
    }
}
