//! The request target, normalized once at the door: what routing classifies
//! is byte for byte what the upstream receives.
//!
//! A target is accepted in origin-form (`/path?query`) or in absolute-form
//! whose authority is the request's Host (`http://host/path`, rewritten to
//! origin-form). Its path is then normalized: percent-encoded unreserved
//! characters are decoded (`%72` → `r`), the hex digits of every other
//! encoding are upper-cased, raw bytes that may not appear in a path are
//! encoded, and runs of `/` are merged. Nothing is resolved: a `.` or `..`
//! segment in any encoding is refused (404, as a path no route can have),
//! and an encoded `/`, a `\` in any form, a NUL or (unless allowed) a
//! segment ending in `.` or a space is a bad request (400), because an
//! upstream that decodes or strips them would see another path than the
//! one classified. The query string is kept exactly as sent.

use std::borrow::Cow;

/// What to do with `%2F` inside a segment (`server.encoded_slash`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EncodedSlash {
    /// A 400: an upstream that decodes it would route on another path.
    #[default]
    Reject,
    /// Kept encoded, matched and forwarded as part of its segment.
    Keep,
}

/// What `;` parameters in a path do (`server.path.params`): `/a;v=1/b`,
/// with `;` raw or written `%3B`. Servlet containers (Tomcat, Jetty,
/// Spring) drop them before routing, so `/v1/reports;x/3` is
/// `/v1/reports/3` to them while a gateway that kept them classifies
/// another path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PathParams {
    /// A 400: no upstream can read the path another way.
    #[default]
    Reject,
    /// Removed from every segment before routing and forwarding, as a
    /// servlet container would.
    Strip,
    /// Kept, matched and forwarded as part of their segment (for upstreams
    /// that read `;` as an ordinary character).
    Keep,
}

/// Whether a route's path template also matches the path with one trailing
/// `/` (`server.path.trailing_slash`): Express, Rails and older Spring
/// serve `/a/` as `/a`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TrailingSlash {
    /// `/a` matches `/a` only.
    #[default]
    Strict,
    /// `/a` matches `/a` and `/a/`.
    Ignore,
}

/// What a path segment ending in `.` or a space does
/// (`server.path.trailing_dots`): `/v1/admin.`, `/v1/x%20/y`. Windows
/// file systems, IIS and some servers on top of them strip both, so such a
/// segment is another route to them (`/v1/admin`) than to the gateway.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TrailingDots {
    /// A 400: no upstream can read the segment as another one.
    #[default]
    Refuse,
    /// Kept, matched and forwarded as sent (for upstreams that keep them).
    Allow,
}

/// Whether matching ignores ASCII case (`server.path.case`): IIS and
/// ASP.NET serve `/V1/REPORTS/3` as `/v1/reports/3`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Case {
    /// Literal segments match exactly.
    #[default]
    Sensitive,
    /// Literal segments match whatever their ASCII case.
    Insensitive,
}

/// How request paths are read: normalized (`server.encoded_slash`,
/// `server.path.params`, `server.path.trailing_dots`), then matched against routes
/// (`server.path.trailing_slash`, `server.path.case`). Normalization
/// changes what is forwarded; matching never does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathRules {
    /// What `%2F` inside a segment does.
    pub encoded_slash: EncodedSlash,
    /// What `;` parameters do.
    pub params: PathParams,
    /// Whether a segment may end in `.` or a space.
    pub trailing_dots: TrailingDots,
    /// Whether a template also matches its path with a trailing `/`.
    pub trailing_slash: TrailingSlash,
    /// Whether matching ignores ASCII case.
    pub case: Case,
}

/// Why a request target was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// Not origin-form, and not absolute-form naming this host.
    #[error("request target is not origin-form")]
    NotOriginForm,
    /// Absolute-form whose authority is not the Host header.
    #[error("absolute-form target names another host")]
    HostMismatch,
    /// A `%` not followed by two hex digits.
    #[error("malformed percent-encoding")]
    BadEncoding,
    /// `%2F` while `server.encoded_slash` is `reject`.
    #[error("encoded \"/\" in the path")]
    EncodedSlash,
    /// `\` or `%5C`.
    #[error("backslash in the path")]
    Backslash,
    /// A NUL byte, raw or `%00`.
    #[error("NUL in the path")]
    Nul,
    /// A `.` or `..` segment, literal or encoded.
    #[error("dot-segment in the path")]
    DotSegment,
    /// A `;` parameter, raw or `%3B`, while `server.path.params` is
    /// `reject`.
    #[error("\";\" parameter in the path")]
    PathParams,
    /// A segment ending in `.` or a space, raw or encoded, while
    /// `server.path.trailing_dots` is `refuse`.
    #[error("path segment ending in \".\" or a space")]
    TrailingDot,
}

impl TargetError {
    /// A sentence for the client.
    pub fn detail(self) -> &'static str {
        match self {
            TargetError::NotOriginForm => "The request target must be an absolute path.",
            TargetError::HostMismatch => "The request target names another host.",
            TargetError::BadEncoding => "The path has a malformed percent-encoding.",
            TargetError::EncodedSlash => "The path has an encoded \"/\".",
            TargetError::Backslash => "The path has a backslash.",
            TargetError::Nul => "The path has a NUL.",
            TargetError::DotSegment => "The path has a dot-segment.",
            TargetError::PathParams => "The path has a \";\" parameter.",
            TargetError::TrailingDot => "A path segment ends in \".\" or a space.",
        }
    }

    /// Dot segments are paths no route has (404); everything else is a
    /// malformed request (400).
    pub fn is_not_found(self) -> bool {
        self == TargetError::DotSegment
    }
}

/// A request target, normalized: the path that routing sees and the
/// upstream receives, and the query as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target<'a> {
    /// The normalized path, borrowed when nothing changed.
    pub path: Cow<'a, str>,
    /// Without its `?`; `None` when the target had no `?`.
    pub query: Option<&'a str>,
    /// Whether `path?query` differs from the target as received, so the
    /// upstream request needs a new one.
    pub rewritten: bool,
}

impl Target<'_> {
    /// The origin-form target to forward.
    pub fn origin_form(&self) -> String {
        let mut out = String::with_capacity(self.path.len() + 1 + self.query.map_or(0, str::len));
        out.push_str(&self.path);
        if let Some(q) = self.query {
            out.push('?');
            out.push_str(q);
        }
        out
    }
}

/// Validates and normalizes a raw request target. `host` is the request's
/// Host header (or HTTP/2 `:authority`), used to accept absolute-form.
pub fn parse<'a>(
    raw: &'a [u8],
    host: Option<&[u8]>,
    rules: PathRules,
) -> Result<Target<'a>, TargetError> {
    let (origin, absolute) = match raw.first() {
        Some(b'/') => (raw, false),
        _ => (strip_absolute(raw, host)?, true),
    };
    let (path, query) = match origin.iter().position(|&b| b == b'?') {
        Some(i) => (&origin[..i], Some(&origin[i + 1..])),
        None => (origin, None),
    };
    // The query is forwarded as sent; it must still be text for the URI.
    let query = query
        .map(|q| std::str::from_utf8(q).map_err(|_| TargetError::BadEncoding))
        .transpose()?;
    let path = normalize(path, rules.encoded_slash)?;
    let path = match rules.params {
        PathParams::Keep => path,
        _ if !has_params(&path) => path,
        PathParams::Reject => return Err(TargetError::PathParams),
        PathParams::Strip => Cow::Owned(strip_params(&path)),
    };
    if rules.trailing_dots == TrailingDots::Refuse && path.split('/').any(ends_in_dot_or_space) {
        return Err(TargetError::TrailingDot);
    }
    let rewritten = absolute || matches!(path, Cow::Owned(_));
    Ok(Target {
        path,
        query,
        rewritten,
    })
}

/// The origin-form part of an absolute-form target whose authority equals
/// `host` (compared without case, as host names are).
fn strip_absolute<'a>(raw: &'a [u8], host: Option<&[u8]>) -> Result<&'a [u8], TargetError> {
    let rest = strip_prefix_ignore_case(raw, b"http://")
        .or_else(|| strip_prefix_ignore_case(raw, b"https://"))
        .ok_or(TargetError::NotOriginForm)?;
    let end = rest
        .iter()
        .position(|&b| b == b'/' || b == b'?')
        .unwrap_or(rest.len());
    let (authority, origin) = rest.split_at(end);
    if authority.is_empty() || authority.contains(&b'@') {
        return Err(TargetError::NotOriginForm);
    }
    if !host.is_some_and(|h| h.eq_ignore_ascii_case(authority)) {
        return Err(TargetError::HostMismatch);
    }
    match origin.first() {
        Some(b'/') => Ok(origin),
        // `http://host` is the root.
        None => Ok(b"/"),
        // `http://host?q` has no path to forward as it was sent.
        Some(_) => Err(TargetError::NotOriginForm),
    }
}

fn strip_prefix_ignore_case<'a>(s: &'a [u8], prefix: &[u8]) -> Option<&'a [u8]> {
    (s.len() >= prefix.len() && s[..prefix.len()].eq_ignore_ascii_case(prefix))
        .then(|| &s[prefix.len()..])
}

/// Normalizes a raw path (starting with `/`, without its query). Borrows
/// when the path is already normal, which is the common case.
pub fn normalize(raw: &[u8], slash: EncodedSlash) -> Result<Cow<'_, str>, TargetError> {
    if raw.first() != Some(&b'/') {
        return Err(TargetError::NotOriginForm);
    }
    let clean = raw
        .iter()
        .zip(raw.iter().skip(1).chain([&0xFF]))
        .all(|(&b, &next)| is_plain(b) && !(b == b'/' && next == b'/'));
    let path = if clean {
        // Only ASCII passed `is_plain`.
        Cow::Borrowed(std::str::from_utf8(raw).map_err(|_| TargetError::BadEncoding)?)
    } else {
        Cow::Owned(rewrite(raw, slash)?)
    };
    if path.split('/').any(is_dot_segment) {
        return Err(TargetError::DotSegment);
    }
    Ok(path)
}

/// Whether a normalized path has a `;` parameter (normalization writes an
/// encoded `;` as `%3B`, upper-case).
fn has_params(path: &str) -> bool {
    let bytes = path.as_bytes();
    bytes.contains(&b';') || (bytes.contains(&b'%') && path.contains("%3B"))
}

/// A normalized path without its `;` parameters: each segment cut at its
/// first `;` or `%3B`. A segment that was only parameters goes, as the
/// `//` it would leave would be merged; a trailing `/` stays.
fn strip_params(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut segments = path.split('/').skip(1).peekable();
    while let Some(segment) = segments.next() {
        let base = segment.split(';').next().unwrap_or_default();
        let base = base.split("%3B").next().unwrap_or_default();
        if base.is_empty() && segments.peek().is_some() {
            continue;
        }
        out.push('/');
        out.push_str(base);
    }
    out
}

/// Whether a normalized segment acts as `.` or `..` for some server: as
/// it is, before `;` parameters (which Tomcat and Jetty strip, so `..;` is
/// `..` to them), or in any piece between kept `%2F`s (which an upstream
/// that decodes them splits on).
fn is_dot_segment(segment: &str) -> bool {
    // Most segments hold neither: compared as they are, with no search.
    if !segment.bytes().any(|b| b == b'%' || b == b';') {
        return segment == "." || segment == "..";
    }
    segment.split("%2F").any(|piece| {
        // `;` raw or encoded (`%3B`, which a decoding upstream turns back).
        let base = piece.split([';']).next().unwrap_or(piece);
        let base = base.split("%3B").next().unwrap_or(base);
        base == "." || base == ".."
    })
}

/// Whether a normalized segment ends in `.` or a space (normalization
/// writes one as `%20`) for some server: as it is, before `;` parameters,
/// or in any piece between kept `%2F`s, as [`is_dot_segment`] reads it.
fn ends_in_dot_or_space(segment: &str) -> bool {
    let ends = |s: &str| s.ends_with('.') || s.ends_with("%20");
    if ends(segment) {
        return true;
    }
    if !segment.bytes().any(|b| b == b'%' || b == b';') {
        return false;
    }
    segment.split("%2F").any(|piece| {
        let base = piece.split(';').next().unwrap_or(piece);
        let base = base.split("%3B").next().unwrap_or(base);
        ends(piece) || ends(base)
    })
}

/// Bytes that need no work: unreserved characters and the sub-delimiters,
/// `:`, `@` and `/` (RFC 3986 `pchar` and the separator), but not `%`.
fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'-' | b'.'
                | b'_'
                | b'~'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'@'
                | b'/'
        )
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn push_encoded(out: &mut String, b: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(b >> 4)]));
    out.push(char::from(HEX[usize::from(b & 0xF)]));
}

/// The slow path of [`normalize`]: one pass that decodes, encodes and
/// merges slashes.
fn rewrite(raw: &[u8], slash: EncodedSlash) -> Result<String, TargetError> {
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let b = raw[i];
        i += 1;
        match b {
            0 => return Err(TargetError::Nul),
            b'\\' => return Err(TargetError::Backslash),
            b'/' if out.ends_with('/') => {}
            b'%' => {
                let (Some(hi), Some(lo)) = (
                    raw.get(i).copied().and_then(hex),
                    raw.get(i + 1).copied().and_then(hex),
                ) else {
                    return Err(TargetError::BadEncoding);
                };
                i += 2;
                match hi << 4 | lo {
                    0 => return Err(TargetError::Nul),
                    b'\\' => return Err(TargetError::Backslash),
                    b'/' if slash == EncodedSlash::Reject => return Err(TargetError::EncodedSlash),
                    v if is_unreserved(v) => out.push(char::from(v)),
                    v => push_encoded(&mut out, v),
                }
            }
            b if is_plain(b) => out.push(char::from(b)),
            b => push_encoded(&mut out, b),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
