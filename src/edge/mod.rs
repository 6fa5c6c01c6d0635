//! The edge: what a client can send, bounded and normalized before any
//! policy sees it (docs/src/security.md, *What the edge guarantees*).
//!
//! - [`app`] accepts connections for one listener, within `max_connections`,
//!   and runs Pingora's HTTP/1.1 sessions over a [`conn::Guarded`] stream.
//! - [`conn`] enforces the size and time bounds of a connection at the
//!   transport and checks each request head's framing before Pingora
//!   parses it, handing it one request at a time ([`chunked`] finds where
//!   a chunked body ends).
//! - [`body`] holds bodies to their time bounds (HTTP/2 streams too) and
//!   bounds the memory of bodies read whole.
//! - [`target`] normalizes the request target once; routing and forwarding
//!   both use the result.
//! - [`headers`] keeps the headers the gateway owns out of client hands.
//! - [`replay`] hands an HTTP/2 server a preface the edge already read.

/// Implements, for a stream wrapper with an `inner: Stream` field, the
/// Pingora stream traits it passes straight through: all but reading,
/// writing and peeking, which are the wrapper's own.
macro_rules! pass_through_to_inner {
    ($wrapper:ty) => {
        #[async_trait::async_trait]
        impl pingora::protocols::Shutdown for $wrapper {
            async fn shutdown(&mut self) {
                self.inner.shutdown().await;
            }
        }

        impl pingora::protocols::UniqueID for $wrapper {
            fn id(&self) -> pingora::protocols::UniqueIDType {
                self.inner.id()
            }
        }

        impl pingora::protocols::Ssl for $wrapper {
            fn get_ssl(&self) -> Option<&pingora::protocols::tls::TlsRef> {
                self.inner.get_ssl()
            }

            fn get_ssl_digest(&self) -> Option<std::sync::Arc<pingora::protocols::tls::SslDigest>> {
                self.inner.get_ssl_digest()
            }

            fn selected_alpn_proto(&self) -> Option<pingora::protocols::ALPN> {
                self.inner.selected_alpn_proto()
            }
        }

        impl pingora::protocols::GetTimingDigest for $wrapper {
            fn get_timing_digest(&self) -> Vec<Option<pingora::protocols::TimingDigest>> {
                self.inner.get_timing_digest()
            }
        }

        impl pingora::protocols::GetProxyDigest for $wrapper {
            fn get_proxy_digest(
                &self,
            ) -> Option<std::sync::Arc<pingora::protocols::raw_connect::ProxyDigest>> {
                self.inner.get_proxy_digest()
            }
        }

        impl pingora::protocols::GetSocketDigest for $wrapper {
            fn get_socket_digest(
                &self,
            ) -> Option<std::sync::Arc<pingora::protocols::SocketDigest>> {
                self.inner.get_socket_digest()
            }
        }
    };
}

pub mod app;
pub mod body;
pub mod chunked;
pub mod conn;
pub mod headers;
pub mod listener;
pub mod replay;
pub mod target;

use std::time::Duration;

pub use target::{EncodedSlash, PathRules};

/// The most header lines a request may have, as in Pingora's parser.
const MAX_HEADERS: usize = 256;

/// Where the live bounds come from: the live policy's, read at each
/// connection and each request, so a reload applies from the next request.
pub type LiveSettings = std::sync::Arc<dyn Fn() -> EdgeSettings + Send + Sync>;

/// `server.limits` and `server.timeouts`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeSettings {
    /// Open client connections per listener; beyond, new ones are closed at once.
    pub max_connections: usize,
    /// Open connections of one client address; beyond, its new ones are
    /// closed at once (`usize::MAX`: no bound of its own).
    pub max_connections_per_ip: usize,
    /// Largest request line and headers (→ 431, connection closed).
    pub max_header_bytes: usize,
    /// The default of routes' `max_body_bytes`.
    pub max_body_bytes: u64,
    /// From a request's first byte to the end of its headers (→ 408, closed).
    pub header_read: Duration,
    /// Idle time allowed between requests on a connection.
    pub keepalive_idle: Duration,
    /// Longest wait for the next bytes of a request body (→ 408, closed).
    pub body_read: Duration,
    /// Longest time a client may leave a response write pending.
    pub send: Duration,
    /// Bodies up to this size are read whole before a pool permit.
    pub buffer_body_bytes: u64,
    /// Least average body rate, bytes a second, once `body_grace` passed.
    pub body_min_rate: u64,
    /// How long a body may run before its rate is held to `body_min_rate`,
    /// and how long a response may wait on its client before its rate is
    /// held to `send_min_rate`.
    pub body_grace: Duration,
    /// Least rate a client must take a response at, bytes a second of the
    /// time the gateway waits on it, once `body_grace` of waiting passed.
    pub send_min_rate: u64,
    /// Longest time a request body may take in all.
    pub body_total: Duration,
    /// How request paths are normalized and matched.
    pub path: PathRules,
    /// HTTP/2: h2 by ALPN on TLS listeners, h2c with prior knowledge on
    /// plain ones (`server.http2`).
    pub http2: bool,
}

/// The edge's defaults, which the policy's bounds state and `check` applies.
pub mod defaults {
    /// `server.limits.max_connections`.
    pub const MAX_CONNECTIONS: u64 = 10_000;
    /// `server.limits.max_header_bytes`.
    pub const MAX_HEADER_BYTES: u64 = 65_536;
    /// `server.limits.max_body_bytes`.
    pub const MAX_BODY_BYTES: u64 = 10 << 20;
    /// `server.limits.buffer_body_bytes`.
    pub const BUFFER_BODY_BYTES: u64 = 65_536;
    /// `server.timeouts.header_read_ms`.
    pub const HEADER_READ_MS: u64 = 10_000;
    /// `server.timeouts.keepalive_idle_ms`.
    pub const KEEPALIVE_IDLE_MS: u64 = 60_000;
    /// `server.timeouts.body_read_ms`.
    pub const BODY_READ_MS: u64 = 30_000;
    /// `server.timeouts.send_ms`.
    pub const SEND_MS: u64 = 30_000;
    /// `server.timeouts.body_min_rate`.
    pub const BODY_MIN_RATE: u64 = 1_024;
    /// `server.limits.send_min_rate`.
    pub const SEND_MIN_RATE: u64 = 1_024;
    /// `server.timeouts.body_grace_ms`.
    pub const BODY_GRACE_MS: u64 = 5_000;
    /// `server.timeouts.body_total_ms`.
    pub const BODY_TOTAL_MS: u64 = 300_000;
}

impl EdgeSettings {
    /// How long a request body that brought `bytes` may have run: the
    /// grace, or longer once the bytes kept up `body_min_rate` (at most
    /// `body_total`).
    pub fn body_allowance(&self, bytes: u64) -> Duration {
        let earned = Duration::from_secs_f64(bytes as f64 / self.body_min_rate as f64);
        self.body_total.min(self.body_grace.max(earned))
    }

    /// How long a response whose client took `sent` bytes may have waited
    /// on it in all: the grace, or longer once the bytes kept up
    /// `send_min_rate`.
    pub fn send_allowance(&self, sent: u64) -> Duration {
        let earned = Duration::from_secs_f64(sent as f64 / self.send_min_rate as f64);
        self.body_grace.max(earned)
    }
}

impl Default for EdgeSettings {
    /// The policy's defaults ([`defaults`]).
    fn default() -> Self {
        use defaults::*;
        Self {
            max_connections: MAX_CONNECTIONS as usize,
            max_connections_per_ip: usize::MAX,
            max_header_bytes: MAX_HEADER_BYTES as usize,
            max_body_bytes: MAX_BODY_BYTES,
            header_read: Duration::from_millis(HEADER_READ_MS),
            keepalive_idle: Duration::from_millis(KEEPALIVE_IDLE_MS),
            body_read: Duration::from_millis(BODY_READ_MS),
            send: Duration::from_millis(SEND_MS),
            buffer_body_bytes: BUFFER_BODY_BYTES,
            body_min_rate: BODY_MIN_RATE,
            body_grace: Duration::from_millis(BODY_GRACE_MS),
            send_min_rate: SEND_MIN_RATE,
            body_total: Duration::from_millis(BODY_TOTAL_MS),
            path: PathRules::default(),
            http2: false,
        }
    }
}

/// How a request's body is delimited (RFC 9112 §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body.
    None,
    /// A body of exactly this many bytes (`Content-Length`).
    Length(u64),
    /// A chunked body (`Transfer-Encoding: chunked`).
    Chunked,
}

/// The headers that frame or route a request. A name that reads as one of
/// them only once `_` is read as `-` (CGI, WSGI and most frameworks fold
/// the two together) is the same header to such a server and another one
/// to the gateway: `Transfer_Encoding: chunked` beside a `Content-Length`
/// would be framed two ways.
const FRAMING_NAMES: [&str; 4] = ["transfer-encoding", "content-length", "host", "connection"];

/// Whether `name` is one of [`FRAMING_NAMES`] spelled with `_` for `-`
/// (ASCII case aside, as HTTP names are).
fn is_framing_look_alike(name: &str) -> bool {
    name.as_bytes().contains(&b'_')
        && FRAMING_NAMES.iter().any(|target| {
            name.len() == target.len()
                && name
                    .bytes()
                    .zip(target.bytes())
                    .all(|(a, b)| a.eq_ignore_ascii_case(&b) || (a == b'_' && b == b'-'))
        })
}

/// The body framing of a request head, in one pass over its headers,
/// refusing every framing that two HTTP parsers could read differently
/// (the ground of request smuggling): `Transfer-Encoding` with
/// `Content-Length`, any coding but a lone `chunked`, several or malformed
/// lengths, `Transfer-Encoding` on HTTP/1.0 (`version` 0), a framing or
/// routing header spelled with `_` for `-`; and every head whose authority
/// is not one: no `Host` on HTTP/1.1 (`version` 1, RFC 9112 §3.2), or
/// one the authority check refuses.
pub fn framing(
    version: u8,
    method: &str,
    target: &[u8],
    headers: &[httparse::Header<'_>],
) -> Result<Framing, &'static str> {
    let mut length: Option<u64> = None;
    let mut codings = 0usize;
    let mut host: Option<&[u8]> = None;
    for h in headers {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if version == 0 {
                return Err("An HTTP/1.0 request cannot carry Transfer-Encoding.");
            }
            for coding in h.value.split(|&b| b == b',') {
                let coding = coding.trim_ascii();
                if coding.is_empty() {
                    continue;
                }
                if !coding.eq_ignore_ascii_case(b"chunked") {
                    return Err("Only the chunked transfer coding is accepted.");
                }
                codings += 1;
            }
            if codings == 0 {
                return Err("Transfer-Encoding is empty.");
            }
        } else if h.name.eq_ignore_ascii_case("content-length") {
            let value = h.value.trim_ascii();
            if value.is_empty() || value.len() > 18 || !value.iter().all(u8::is_ascii_digit) {
                return Err("Content-Length is not a number.");
            }
            let n = value.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
            if length.is_some_and(|prior| prior != n) {
                return Err("Content-Length is given twice with different values.");
            }
            length = Some(n);
        } else if h.name.eq_ignore_ascii_case("host") {
            if host.replace(h.value).is_some() {
                return Err("The request has more than one Host header.");
            }
        } else if is_framing_look_alike(h.name) {
            return Err("A header name spells Transfer-Encoding, Content-Length, Host or Connection with \"_\" for \"-\".");
        }
    }
    if version == 1 && host.is_none() {
        return Err("An HTTP/1.1 request must carry a Host header.");
    }
    authority(method, target, host)?;
    match (codings, length) {
        (0, None | Some(0)) => Ok(Framing::None),
        (0, Some(n)) => Ok(Framing::Length(n)),
        (1, None) => Ok(Framing::Chunked),
        (_, None) => Err("The chunked coding is applied more than once."),
        (_, Some(_)) => Err("Transfer-Encoding and Content-Length are both present."),
    }
}

/// Refuses, with the gateway's own answer, the heads Pingora's parse would
/// answer with a bare 400 (RFC 9112 §3.2, RFC 9110 §4.2.4), beside several
/// `Host` fields and `Transfer-Encoding` on HTTP/1.0 ([`framing`]):
/// userinfo in the (one) `host` or in the target, and an absolute-form
/// target whose authority is ambiguous, malformed, or not byte for byte
/// the `host`.
fn authority(method: &str, target: &[u8], host: Option<&[u8]>) -> Result<(), &'static str> {
    use pingora::http::authority::RawTargetAuthority;
    use pingora::http::authority::{is_http_family_scheme, raw_target_authority};

    if host.is_some_and(|h| h.contains(&b'@')) {
        return Err("The Host header carries userinfo.");
    }
    if method == "CONNECT" {
        // Its target is an authority of its own, refused later.
        return Ok(());
    }
    match raw_target_authority(target) {
        RawTargetAuthority::None => Ok(()),
        RawTargetAuthority::AmbiguousAuthority => {
            Err("The request target's authority is ambiguous.")
        }
        RawTargetAuthority::Absolute {
            scheme, authority, ..
        } => {
            if authority.contains(&b'@') {
                Err("The request target carries userinfo.")
            } else if is_http_family_scheme(scheme)
                && http::uri::Authority::try_from(authority).is_err()
            {
                Err("The request target's authority is malformed.")
            } else if host.is_some_and(|h| h != authority) {
                Err("The Host header differs from the request target's authority.")
            } else {
                Ok(())
            }
        }
    }
}

/// A client-facing sentence for a head the parser refused.
fn parse_error(e: httparse::Error) -> &'static str {
    match e {
        httparse::Error::HeaderName => "A header name is malformed.",
        httparse::Error::HeaderValue => "A header value is malformed.",
        httparse::Error::NewLine => "A line ending is malformed.",
        httparse::Error::Status | httparse::Error::Token => "The request line is malformed.",
        httparse::Error::Version => "The HTTP version is not supported.",
        httparse::Error::TooManyHeaders => "The request has too many header lines.",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(lines: &[(&str, &str)]) -> Result<Framing, &'static str> {
        let headers: Vec<_> = [("Host", "api.test")]
            .iter()
            .chain(lines)
            .map(|(name, value)| httparse::Header {
                name,
                value: value.as_bytes(),
            })
            .collect();
        framing(1, "GET", b"/", &headers)
    }

    fn authority_of(version: u8, target: &str, hosts: &[&str]) -> Result<(), &'static str> {
        let headers: Vec<_> = hosts
            .iter()
            .map(|value| httparse::Header {
                name: "Host",
                value: value.as_bytes(),
            })
            .collect();
        framing(version, "GET", target.as_bytes(), &headers).map(drop)
    }

    #[test]
    fn heads_pingora_would_refuse_bare_are_refused_here() {
        assert_eq!(authority_of(1, "/x", &["api.test"]), Ok(()));
        assert_eq!(authority_of(0, "/x", &[]), Ok(()));
        assert_eq!(authority_of(1, "http://api.test/x", &["api.test"]), Ok(()));
        assert_eq!(authority_of(0, "http://api.test/x", &[]), Ok(()));
        for (target, hosts) in [
            ("/x", &[][..]),
            ("http://api.test/x", &[][..]),
            ("/x", &["a.test", "b.test"][..]),
            ("/x", &["user@api.test"][..]),
            ("http://user@api.test/x", &["api.test"][..]),
            ("http://other.test/x", &["api.test"][..]),
            ("http://API.test/x", &["api.test"][..]),
            ("http:/\\api.test/x", &["api.test"][..]),
        ] {
            assert!(
                authority_of(1, target, hosts).is_err(),
                "{target} {hosts:?}"
            );
        }
        let te = [
            httparse::Header {
                name: "Host",
                value: b"api.test",
            },
            httparse::Header {
                name: "Transfer-Encoding",
                value: b"chunked",
            },
        ];
        assert!(framing(0, "POST", b"/x", &te).is_err());
        assert_eq!(framing(1, "POST", b"/x", &te), Ok(Framing::Chunked));
    }

    #[test]
    fn framing_headers_spelled_with_underscores_are_refused() {
        for name in [
            "Transfer_Encoding",
            "transfer_encoding",
            "Content_Length",
            "CONTENT_length",
        ] {
            assert!(
                framed(&[(name, "chunked"), ("content-length", "3")]).is_err(),
                "{name}"
            );
        }
        // Case is no other spelling; other underscores are no framing.
        assert_eq!(
            framed(&[("CONTENT-LENGTH", "3"), ("x_content_length", "9")]),
            Ok(Framing::Length(3))
        );
        assert_eq!(framed(&[("content_type", "text/plain")]), Ok(Framing::None));
        assert!(is_framing_look_alike("Transfer_Encoding"));
        assert!(is_framing_look_alike("content_length"));
        assert!(!is_framing_look_alike("Content-Length"));
        assert!(!is_framing_look_alike("content_lengths"));
    }

    #[test]
    fn plain_framings_are_read() {
        assert_eq!(framed(&[]), Ok(Framing::None));
        assert_eq!(framed(&[("content-length", "0")]), Ok(Framing::None));
        assert_eq!(
            framed(&[("Content-Length", " 12 ")]),
            Ok(Framing::Length(12))
        );
        assert_eq!(
            framed(&[("content-length", "5"), ("content-length", "5")]),
            Ok(Framing::Length(5))
        );
        assert_eq!(
            framed(&[("Transfer-Encoding", "Chunked")]),
            Ok(Framing::Chunked)
        );
    }

    #[test]
    fn ambiguous_framings_are_refused() {
        for lines in [
            &[("transfer-encoding", "chunked"), ("content-length", "3")][..],
            &[("content-length", "3"), ("content-length", "4")],
            &[("content-length", "-1")],
            &[("content-length", "+3")],
            &[("content-length", "3,3")],
            &[("content-length", "")],
            &[("content-length", "99999999999999999999")],
            &[("transfer-encoding", "gzip, chunked")],
            &[("transfer-encoding", "chunked, chunked")],
            &[("transfer-encoding", "xchunked")],
            &[("transfer-encoding", "")],
            &[
                ("transfer-encoding", "chunked"),
                ("transfer-encoding", "chunked"),
            ],
        ] {
            assert!(framed(lines).is_err(), "{lines:?}");
        }
    }
}
