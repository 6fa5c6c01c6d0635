//! Key parts read from what a request says: a header, a path segment, a
//! query parameter, a claim of the caller's JWT, a header of the
//! forward-auth service's answer, or a field of a JSON body.
//!
//! A value becomes part of a limit's key, so it is read one way only, the
//! way the upstream cannot read differently: a header sent twice, a query
//! parameter given twice or a JSON member named twice is ambiguous (400,
//! not the first or the last); a path segment is compared percent-decoded
//! and a JSON member decoded; values over [`MAX_VALUE_BYTES`] or with
//! control bytes are refused. Everything here is pure: the admission plan
//! reads a [`RequestView`] and gets parts or a [`ValueProblem`].

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use serde_json::value::RawValue;

use crate::request_json::{self, NotJson};

use crate::limits::algorithm::Params;
use crate::limits::Charge;
use crate::routes::PathTemplate;

/// The longest value a key takes, in bytes.
pub const MAX_VALUE_BYTES: usize = 256;

/// A part of a limit's key read from the request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ValueDim {
    /// `header.NAME`: a request header (one field line).
    Header(HeaderName),
    /// `path.PARAM`: a `{PARAM}` segment of the route's template.
    Path(Box<str>),
    /// `query.NAME`: a query parameter.
    Query(Box<str>),
    /// `claim.NAME`: a top-level claim of the caller's JWT.
    Claim(Box<str>),
    /// `auth.NAME`: a header of the forward-auth service's 2xx answer.
    Auth(HeaderName),
    /// `body.FIELD`: a member of a JSON request body, by dotted path.
    Body(Box<[Box<str>]>),
}

/// Why the name of a `kind.NAME` dimension was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DimError {
    /// `header.NAME` or `auth.NAME` with a name no header can have.
    #[error("{name:?} is not a header name")]
    HeaderName {
        /// The name as given.
        name: String,
    },
    /// A name (or a part of a body field's dotted path) that is empty or
    /// holds more than letters, digits, `_ - $ @ :`.
    #[error("{name:?} is not a name (letters, digits, _ - $ @ :)")]
    Name {
        /// The name (or part) as given.
        name: String,
    },
}

impl ValueDim {
    /// Parses `kind.NAME`; `None` for a word that names no such dimension
    /// (the caller reports it with the dimensions it could have meant).
    pub fn parse(text: &str) -> Option<Result<ValueDim, DimError>> {
        let (kind, name) = text.split_once('.')?;
        let header = |name: &str| {
            HeaderName::from_bytes(name.as_bytes()).map_err(|_| DimError::HeaderName {
                name: name.to_owned(),
            })
        };
        let word = |name: &str| {
            let ok = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-$@:".contains(&b));
            ok.then(|| Box::from(name)).ok_or_else(|| DimError::Name {
                name: name.to_owned(),
            })
        };
        Some(match kind {
            "header" => header(name).map(ValueDim::Header),
            "auth" => header(name).map(ValueDim::Auth),
            "path" => word(name).map(ValueDim::Path),
            "query" => word(name).map(ValueDim::Query),
            "claim" => word(name).map(ValueDim::Claim),
            "body" => name
                .split('.')
                .map(word)
                .collect::<Result<Box<[_]>, _>>()
                .map(ValueDim::Body),
            _ => return None,
        })
    }

    /// Whether the client chooses the value freely: a header, a path
    /// segment, a query parameter or a body field (a claim or a
    /// forward-auth header is vouched for by the identity source).
    pub fn client_chosen(&self) -> bool {
        !matches!(self, ValueDim::Claim(_) | ValueDim::Auth(_))
    }

    /// Whether a pre-auth limit may use it: read from the request head, at
    /// no cost and before anyone is identified.
    pub fn before_identity(&self) -> bool {
        matches!(self, ValueDim::Header(_) | ValueDim::Path(_))
    }

    /// Whether it is read from the request body.
    pub fn in_body(&self) -> bool {
        matches!(self, ValueDim::Body(_))
    }
}

impl std::fmt::Display for ValueDim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ValueDim::Header(n) => write!(f, "header.{n}"),
            ValueDim::Path(n) => write!(f, "path.{n}"),
            ValueDim::Query(n) => write!(f, "query.{n}"),
            ValueDim::Claim(n) => write!(f, "claim.{n}"),
            ValueDim::Auth(n) => write!(f, "auth.{n}"),
            ValueDim::Body(p) => write!(f, "body.{}", p.join(".")),
        }
    }
}

/// What a limit does with a request that has no value for one of its
/// dimensions (`absent`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Absent {
    /// The limit does not apply to the request: one shared bucket for
    /// every request without a value would let one caller starve the rest.
    #[default]
    Skip,
    /// One bucket for every request without a value.
    Bucket,
    /// 400 `missing-key-value`.
    Reject,
}

/// What a value not in a limit's `values` gets (`other`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Other {
    /// The limit's own parameters.
    #[default]
    Default,
    /// 400 `unknown-key-value`.
    Reject,
}

/// The part of a limit's key read from requests, as validated.
#[derive(Debug, Clone, Default)]
pub struct ValueKey {
    /// The dimensions, in the order the key lists them (none: the limit
    /// reads nothing from the request).
    pub dims: Box<[ValueDim]>,
    /// What a request without a value gets.
    pub absent: Absent,
    /// Parameters per value (`values`), for a key of one such dimension.
    pub values: Option<Arc<HashMap<Box<str>, Params>>>,
    /// What a value not listed gets.
    pub other: Other,
}

impl ValueKey {
    /// Whether the key reads nothing from the request.
    pub fn is_empty(&self) -> bool {
        self.dims.is_empty()
    }

    /// Whether the client chooses a value without bound: a client-chosen
    /// dimension that no value list with `other: reject` closes.
    pub fn unbounded(&self) -> bool {
        let closed = self.values.is_some() && self.other == Other::Reject;
        !closed && self.dims.iter().any(ValueDim::client_chosen)
    }
}

/// Why a request's value cannot key a limit: each a 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueProblem {
    /// Given twice (a header, a query parameter, a JSON member).
    Ambiguous,
    /// Absent, and the limit says `absent: reject`.
    Missing,
    /// Not in the limit's `values`, which says `other: reject`.
    Unknown,
    /// Over 256 bytes, with control bytes, or not UTF-8.
    Invalid,
}

impl ValueProblem {
    /// The problem type's last word (`urn:tollgate:problem:…`).
    pub fn kind(self) -> &'static str {
        match self {
            ValueProblem::Ambiguous => "ambiguous-key-value",
            ValueProblem::Missing => "missing-key-value",
            ValueProblem::Unknown => "unknown-key-value",
            ValueProblem::Invalid => "invalid-key-value",
        }
    }

    /// What the problem's detail says of it (never the value itself).
    pub fn says(self) -> &'static str {
        match self {
            ValueProblem::Ambiguous => "is given more than once",
            ValueProblem::Missing => "is required",
            ValueProblem::Unknown => "is not one this limit accepts",
            ValueProblem::Invalid => "is over 256 bytes, holds control bytes or is not UTF-8",
        }
    }
}

/// A request's value for one limit that cannot be used: which limit and
/// dimension, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The limit's name.
    pub limit: Arc<str>,
    /// The dimension, as the policy names it.
    pub dim: String,
    /// Why.
    pub problem: ValueProblem,
}

impl Refused {
    /// The problem's detail: which limit and dimension, and why.
    pub fn detail(&self) -> String {
        format!(
            "The request's {} for the {} limit {}.",
            self.dim,
            self.limit,
            self.problem.says()
        )
    }
}

/// Values an identity source vouched for beside the caller it named (a
/// JWT's claims, forward auth's headers), by the dimension that reads them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vouched(Box<[(ValueDim, Box<str>)]>);

impl Vouched {
    /// From `(dimension, value)` pairs.
    pub fn new(pairs: Vec<(ValueDim, String)>) -> Self {
        Self(pairs.into_iter().map(|(d, v)| (d, v.into())).collect())
    }

    /// The value `dim` reads.
    pub fn get(&self, dim: &ValueDim) -> Option<&str> {
        self.0.iter().find(|(d, _)| d == dim).map(|(_, v)| &**v)
    }
}

/// What a request says, as the key dimensions read it.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// The request's headers.
    pub headers: &'a HeaderMap,
    /// The normalized path the route matched.
    pub path: &'a str,
    /// The matched route's template, for `path.*`.
    pub template: Option<&'a PathTemplate>,
    /// The query string, without its `?`.
    pub query: Option<&'a str>,
    /// What the caller's identity source vouched for (`claim.*`, `auth.*`).
    pub vouched: Option<&'a Vouched>,
    /// The JSON body's values, when the route reads them.
    pub body: Option<&'a BodyValues>,
    /// Values named by dimension (`header.x-end-user` → its value), read
    /// in place of the request's: a replayed log line's.
    pub named: Option<&'a HashMap<String, String>>,
}

impl<'a> RequestView<'a> {
    /// A view of the head alone.
    pub fn of_head(headers: &'a HeaderMap, path: &'a str, query: Option<&'a str>) -> Self {
        Self {
            headers,
            path,
            template: None,
            query,
            vouched: None,
            body: None,
            named: None,
        }
    }
}

/// The values of a JSON body at the paths the route's limits read: each
/// decoded, or why it cannot be used.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyValues {
    /// The values, by path.
    pub fields: Vec<(FieldPath, BodyValue)>,
    /// The body was too large to read (`oversize: absent`): every value
    /// is absent, and a cost read from it is the most.
    pub oversize: bool,
}

/// A JSON body member's dotted path, one name per level.
pub type FieldPath = Box<[Box<str>]>;

/// A JSON body member's value as a key reads it (`Ok(None)`: absent).
pub type BodyValue = Result<Option<String>, ValueProblem>;

impl BodyValues {
    /// Reads the members at `paths` of a JSON `body`; an empty body has
    /// none. A body that is not a JSON object holds no members.
    pub fn parse(body: &[u8], paths: &[FieldPath]) -> Result<Self, NotJson> {
        let fields = if body.trim_ascii().is_empty() {
            paths.iter().map(|p| (p.clone(), Ok(None))).collect()
        } else {
            let root = request_json::parse(body)?;
            paths.iter().map(|p| (p.clone(), field(root, p))).collect()
        };
        Ok(Self {
            fields,
            oversize: false,
        })
    }

    /// A body too large to read: every value absent.
    pub fn oversize() -> Self {
        Self {
            fields: Vec::new(),
            oversize: true,
        }
    }

    /// The value at `path` (`Ok(None)`: absent).
    pub fn get(&self, path: &[Box<str>]) -> Result<Option<&str>, ValueProblem> {
        match self.fields.iter().find(|(p, _)| &**p == path) {
            Some((_, Ok(v))) => Ok(v.as_deref()),
            Some((_, Err(e))) => Err(*e),
            None => Ok(None),
        }
    }
}

/// The value at `path` in `root`: absent when a level is missing or not
/// an object, ambiguous when a level names a member twice.
fn field(root: &RawValue, path: &[Box<str>]) -> BodyValue {
    let Some(at) = request_json::member_at(root, path).map_err(|_| ValueProblem::Ambiguous)? else {
        return Ok(None);
    };
    // Only a string or a number can be a value: a large object or array
    // at the path is not decoded to be found absent.
    let text = at.get().trim_start();
    if !text.starts_with(|c: char| c == '"' || c == '-' || c.is_ascii_digit()) {
        return Ok(None);
    }
    let value: serde_json::Value = serde_json::from_str(text).map_err(|_| ValueProblem::Invalid)?;
    Ok(json_value(&value))
}

/// One part of a key: a value, or `None` for an absent one in a limit
/// that says `absent: bucket`.
pub type Part<'a> = Option<Cow<'a, str>>;

/// What one limit reads from a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read<'a> {
    /// The limit does not apply: a value is absent and it says `skip`.
    Skip,
    /// Its key's parts, in order, and the parameters of a `values` entry
    /// that matched.
    Key {
        /// The parts.
        parts: Vec<Part<'a>>,
        /// A matched entry's parameters.
        params: Option<Params>,
    },
}

impl Read<'_> {
    /// `charge` keyed by these parts, with a matched value's numbers
    /// unless the tenant's override sets its own (`overridden`); `None`
    /// when the limit does not apply.
    pub fn keyed(self, mut charge: Charge, overridden: bool) -> Option<Charge> {
        let Read::Key { parts, params } = self else {
            return None;
        };
        push_parts(&mut charge.key, &parts);
        if let Some(p) = params.filter(|_| !overridden) {
            charge.params = p;
        }
        Some(charge)
    }
}

/// The values a request's limits read, for its access log line: each
/// dimension's value (shown there only as a keyed digest), and the
/// `values` entries that matched (shown as they are: the operator named
/// them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Used {
    /// Each dimension read, once, with its value.
    pub values: Vec<(String, String)>,
    /// Each limit whose `values` entry matched, with the entry.
    pub matched: Vec<(Arc<str>, String)>,
}

impl Used {
    /// Notes what limit `name` (keyed by `key`) read.
    pub fn note(&mut self, name: &Arc<str>, key: &ValueKey, read: &Read<'_>) {
        let Read::Key { parts, params } = read else {
            return;
        };
        for (dim, part) in key.dims.iter().zip(parts) {
            if let Some(value) = part {
                self.value(dim.to_string(), value.to_string());
            }
        }
        if let (Some(_), [Some(value)]) = (params, parts.as_slice()) {
            self.matched.push((name.clone(), value.to_string()));
        }
    }

    /// Adds what `other` noted.
    pub fn extend(&mut self, other: Used) {
        for (dim, value) in other.values {
            self.value(dim, value);
        }
        self.matched.extend(other.matched);
    }

    /// Notes `dim`'s value, unless a limit read it already.
    fn value(&mut self, dim: String, value: String) {
        if !self.values.iter().any(|(d, _)| *d == dim) {
            self.values.push((dim, value));
        }
    }
}

/// Reads a limit's key parts from a request.
pub fn read<'a>(key: &ValueKey, view: &RequestView<'a>) -> Result<Read<'a>, ValueProblem> {
    match view.named {
        Some(named) => given(key, named),
        None => read_with(key, |dim| value(dim, view)),
    }
}

/// A limit's key parts from values an operator names by dimension
/// (`header.x-end-user` → `alice`), for explain, reset and credit: read as
/// a request's would be, a dimension not named being absent.
pub fn given<'a>(
    key: &ValueKey,
    named: &'a HashMap<String, String>,
) -> Result<Read<'a>, ValueProblem> {
    read_with(key, |dim| match named.get(&dim.to_string()) {
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => check(v).map(|()| Some(Cow::Borrowed(v.as_str()))),
        None => Ok(None),
    })
}

/// Whether `name` names a dimension read from requests (`header.…`).
pub fn names_a_value(name: &str) -> bool {
    ValueDim::parse(name).is_some()
}

fn read_with<'a>(
    key: &ValueKey,
    mut value: impl FnMut(&ValueDim) -> Result<Option<Cow<'a, str>>, ValueProblem>,
) -> Result<Read<'a>, ValueProblem> {
    let mut parts = Vec::with_capacity(key.dims.len());
    for dim in key.dims.iter() {
        match value(dim)? {
            Some(v) => parts.push(Some(v)),
            None => match key.absent {
                Absent::Skip => return Ok(Read::Skip),
                Absent::Bucket => parts.push(None),
                Absent::Reject => return Err(ValueProblem::Missing),
            },
        }
    }
    let params = match (&key.values, parts.as_slice()) {
        (Some(values), [Some(v)]) => match values.get(&**v) {
            Some(p) => Some(*p),
            None if key.other == Other::Reject => return Err(ValueProblem::Unknown),
            None => None,
        },
        _ => None,
    };
    Ok(Read::Key { parts, params })
}

/// One dimension's value in a request (`None`: absent).
fn value<'a>(dim: &ValueDim, view: &RequestView<'a>) -> Result<Option<Cow<'a, str>>, ValueProblem> {
    let found: Option<Cow<'a, str>> = match dim {
        ValueDim::Header(name) => {
            let mut lines = view.headers.get_all(name).iter();
            let first = lines.next();
            if lines.next().is_some() {
                return Err(ValueProblem::Ambiguous);
            }
            match first {
                Some(v) => Some(Cow::Borrowed(
                    std::str::from_utf8(v.as_bytes()).map_err(|_| ValueProblem::Invalid)?,
                )),
                None => None,
            }
        }
        ValueDim::Path(param) => match view.template.and_then(|t| t.param(view.path, param)) {
            Some(raw) => Some(percent_decoded(raw)?),
            None => None,
        },
        ValueDim::Query(name) => {
            let mut found = None;
            for (k, v) in form_urlencoded::parse(view.query.unwrap_or("").as_bytes()) {
                if k == **name {
                    if found.is_some() {
                        return Err(ValueProblem::Ambiguous);
                    }
                    found = Some(Cow::Owned(v.into_owned()));
                }
            }
            found
        }
        ValueDim::Claim(_) | ValueDim::Auth(_) => {
            view.vouched.and_then(|v| v.get(dim)).map(Cow::Borrowed)
        }
        ValueDim::Body(path) => match view.body {
            Some(body) => body.get(path)?.map(|v| Cow::Owned(v.to_owned())),
            None => None,
        },
    };
    match found {
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => {
            check(&v)?;
            Ok(Some(v))
        }
        None => Ok(None),
    }
}

/// Refuses a value over [`MAX_VALUE_BYTES`] or with control bytes.
pub fn check(value: &str) -> Result<(), ValueProblem> {
    let control = value.bytes().any(|b| b < 0x20 || b == 0x7f);
    if value.len() > MAX_VALUE_BYTES || control {
        return Err(ValueProblem::Invalid);
    }
    Ok(())
}

/// A path segment with its `%XX` escapes decoded, as the upstream reads
/// it: `%61bc` and `abc` are one project.
fn percent_decoded(raw: &str) -> Result<Cow<'_, str>, ValueProblem> {
    if !raw.contains('%') {
        return Ok(Cow::Borrowed(raw));
    }
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).and_then(|&b| hex(b)),
            bytes.get(i + 2).and_then(|&b| hex(b)),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out)
        .map(Cow::Owned)
        .map_err(|_| ValueProblem::Invalid)
}

/// Appends a key's parts to its raw key, each length-prefixed so that no
/// value can imitate another split: `3:abc`, or `-` for an absent one.
pub fn push_parts(key: &mut String, parts: &[Part<'_>]) {
    for part in parts {
        key.push('\u{1f}');
        match part {
            Some(v) => {
                key.push_str(itoa::Buffer::new().format(v.len()));
                key.push(':');
                key.push_str(v);
            }
            None => key.push('-'),
        }
    }
}

/// A JSON member's value as a key reads it: a string decoded, an integer
/// in its one canonical form; anything else (a float, an object, an array,
/// `null`, `true`) is absent.
pub fn json_value(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dim(text: &str) -> ValueDim {
        ValueDim::parse(text).unwrap().unwrap()
    }

    fn key(dims: &[&str], absent: Absent) -> ValueKey {
        ValueKey {
            dims: dims.iter().map(|d| dim(d)).collect(),
            absent,
            values: None,
            other: Other::Default,
        }
    }

    fn headers(lines: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in lines {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn parts(read: Read<'_>) -> Vec<Option<String>> {
        match read {
            Read::Key { parts, .. } => parts
                .into_iter()
                .map(|p| p.map(|v| v.into_owned()))
                .collect(),
            Read::Skip => panic!("skipped"),
        }
    }

    #[test]
    fn dimensions_parse_by_kind_and_name() {
        assert_eq!(
            dim("header.X-End-User"),
            ValueDim::Header(HeaderName::from_static("x-end-user"))
        );
        assert_eq!(dim("path.project"), ValueDim::Path("project".into()));
        assert_eq!(
            dim("body.metadata.user"),
            ValueDim::Body(vec!["metadata".into(), "user".into()].into())
        );
        assert_eq!(dim("body.model").to_string(), "body.model");
        assert!(ValueDim::parse("tenant").is_none());
        assert!(ValueDim::parse("cookie.x").is_none());
        assert_eq!(
            ValueDim::parse("header.bad name"),
            Some(Err(DimError::HeaderName {
                name: "bad name".into()
            }))
        );
        assert_eq!(
            ValueDim::parse("body.a..b"),
            Some(Err(DimError::Name { name: "".into() }))
        );
        assert_eq!(
            ValueDim::parse("path."),
            Some(Err(DimError::Name { name: "".into() }))
        );
        assert_eq!(
            DimError::Name { name: "".into() }.to_string(),
            "\"\" is not a name (letters, digits, _ - $ @ :)"
        );
    }

    #[test]
    fn a_header_is_read_from_its_one_line() {
        let k = key(&["header.x-end-user"], Absent::Skip);
        let h = headers(&[("x-end-user", "alice")]);
        let view = RequestView::of_head(&h, "/", None);
        assert_eq!(parts(read(&k, &view).unwrap()), [Some("alice".into())]);

        let twice = headers(&[("x-end-user", "alice"), ("x-end-user", "bob")]);
        let view = RequestView::of_head(&twice, "/", None);
        assert_eq!(read(&k, &view), Err(ValueProblem::Ambiguous));
    }

    #[test]
    fn absent_values_skip_share_a_bucket_or_are_refused() {
        let h = HeaderMap::new();
        let view = RequestView::of_head(&h, "/", None);
        assert_eq!(
            read(&key(&["header.x-u"], Absent::Skip), &view),
            Ok(Read::Skip)
        );
        assert_eq!(
            parts(read(&key(&["header.x-u"], Absent::Bucket), &view).unwrap()),
            [None]
        );
        assert_eq!(
            read(&key(&["header.x-u"], Absent::Reject), &view),
            Err(ValueProblem::Missing)
        );
        // An empty value is absent too.
        let empty = headers(&[("x-u", "")]);
        let view = RequestView::of_head(&empty, "/", None);
        assert_eq!(
            read(&key(&["header.x-u"], Absent::Skip), &view),
            Ok(Read::Skip)
        );
    }

    #[test]
    fn long_or_control_values_are_refused() {
        let k = key(&["query.user"], Absent::Skip);
        let h = HeaderMap::new();
        let long = format!("user={}", "a".repeat(257));
        let view = RequestView::of_head(&h, "/", Some(&long));
        assert_eq!(read(&k, &view), Err(ValueProblem::Invalid));
        let just = format!("user={}", "a".repeat(256));
        let view = RequestView::of_head(&h, "/", Some(&just));
        assert!(read(&k, &view).is_ok());
        let view = RequestView::of_head(&h, "/", Some("user=a%0Ab"));
        assert_eq!(read(&k, &view), Err(ValueProblem::Invalid));
        let view = RequestView::of_head(&h, "/", Some("user=a&user=b"));
        assert_eq!(read(&k, &view), Err(ValueProblem::Ambiguous));
        let view = RequestView::of_head(&h, "/", Some("other=1&user=a+b"));
        assert_eq!(parts(read(&k, &view).unwrap()), [Some("a b".into())]);
    }

    #[test]
    fn a_path_segment_is_read_decoded() {
        let t = PathTemplate::parse("/v1/projects/{project}/items").unwrap();
        let k = key(&["path.project"], Absent::Skip);
        let h = HeaderMap::new();
        let mut view = RequestView::of_head(&h, "/v1/projects/%61bc/items", None);
        view.template = Some(&t);
        assert_eq!(parts(read(&k, &view).unwrap()), [Some("abc".into())]);
        view.path = "/v1/projects/abc/items";
        assert_eq!(parts(read(&k, &view).unwrap()), [Some("abc".into())]);
        view.path = "/v1/projects/%FF/items";
        assert_eq!(read(&k, &view), Err(ValueProblem::Invalid));
    }

    #[test]
    fn vouched_values_key_claims_and_forward_auth_headers() {
        let vouched = Vouched::new(vec![
            (dim("claim.org_id"), "42".into()),
            (dim("auth.x-org"), "acme".into()),
        ]);
        let h = HeaderMap::new();
        let mut view = RequestView::of_head(&h, "/", None);
        view.vouched = Some(&vouched);
        let k = key(&["claim.org_id", "auth.x-org"], Absent::Reject);
        assert_eq!(
            parts(read(&k, &view).unwrap()),
            [Some("42".into()), Some("acme".into())]
        );
        assert_eq!(
            read(&key(&["claim.sub"], Absent::Reject), &view),
            Err(ValueProblem::Missing)
        );
    }

    #[test]
    fn values_choose_parameters_and_other_may_refuse() {
        let gpt = Params::TokenBucket(crate::limits::algorithm::Bucket {
            capacity: 40_000_000_000,
            per_ms: 400,
        });
        let mut k = key(&["header.x-model"], Absent::Skip);
        k.values = Some(Arc::new(HashMap::from([(Box::from("gpt-4o"), gpt)])));
        let h = headers(&[("x-model", "gpt-4o")]);
        let view = RequestView::of_head(&h, "/", None);
        assert!(matches!(read(&k, &view), Ok(Read::Key { params: Some(p), .. }) if p == gpt));
        let h = headers(&[("x-model", "gpt-5")]);
        let view = RequestView::of_head(&h, "/", None);
        assert!(matches!(
            read(&k, &view),
            Ok(Read::Key { params: None, .. })
        ));
        assert!(k.unbounded());
        k.other = Other::Reject;
        assert_eq!(read(&k, &view), Err(ValueProblem::Unknown));
        assert!(!k.unbounded());
    }

    #[test]
    fn parts_are_length_prefixed_so_no_value_imitates_a_split() {
        let key_of = |parts: &[Option<&str>]| {
            let parts: Vec<Part<'_>> = parts.iter().map(|p| p.map(Cow::Borrowed)).collect();
            let mut key = String::from("l");
            push_parts(&mut key, &parts);
            key
        };
        assert_ne!(
            key_of(&[Some("a\u{1f}1:b")]),
            key_of(&[Some("a"), Some("b")])
        );
        assert_ne!(key_of(&[Some("-")]), key_of(&[None]));
        assert_ne!(
            key_of(&[Some("ab"), Some("c")]),
            key_of(&[Some("a"), Some("bc")])
        );
    }

    #[test]
    fn a_body_is_read_at_its_paths_decoded_and_one_way_only() {
        let paths: Vec<FieldPath> = ["model", "meta.user", "n", "gone.deeper"]
            .iter()
            .map(|p| p.split('.').map(Box::from).collect())
            .collect();
        let read = |body: &str| BodyValues::parse(body.as_bytes(), &paths);
        let values = read(r#"{"model":"gpt-\u0034o","meta":{"user":12},"n":[1]}"#).unwrap();
        assert_eq!(values.get(&paths[0]), Ok(Some("gpt-4o")));
        assert_eq!(values.get(&paths[1]), Ok(Some("12")));
        assert_eq!(values.get(&paths[2]), Ok(None), "an array is absent");
        assert_eq!(values.get(&paths[3]), Ok(None));
        // A name given twice on a read path is ambiguous; elsewhere, not.
        let twice = read(r#"{"model":"a","mod\u0065l":"b","x":1,"x":2}"#).unwrap();
        assert_eq!(twice.get(&paths[0]), Err(ValueProblem::Ambiguous));
        assert_eq!(twice.get(&paths[1]), Ok(None));
        let nested = read(r#"{"meta":{"user":"a","user":"b"}}"#).unwrap();
        assert_eq!(nested.get(&paths[1]), Err(ValueProblem::Ambiguous));
        // An empty body has no values; one that is not JSON is refused.
        assert_eq!(read(" ").unwrap().get(&paths[0]), Ok(None));
        assert_eq!(read("[1,2]").unwrap().get(&paths[0]), Ok(None));
        assert_eq!(read(r#"{"model":"a""#), Err(NotJson));
        assert_eq!(
            BodyValues::parse(b"{\"model\":\"\xff\"}", &paths),
            Err(NotJson)
        );
        // Floats, booleans and null are absent; a value is checked as any.
        for absent in [r#"{"model":1.0}"#, r#"{"model":true}"#, r#"{"model":null}"#] {
            assert_eq!(read(absent).unwrap().get(&paths[0]), Ok(None), "{absent}");
        }
        let long = format!(r#"{{"model":"{}"}}"#, "a".repeat(300));
        let view = |values: &BodyValues| {
            let h = HeaderMap::new();
            let key = key(&["body.model"], Absent::Skip);
            let mut view = RequestView::of_head(&h, "/", None);
            view.body = Some(values);
            read_with(&key, |d| value(d, &view)).map(|r| r == Read::Skip)
        };
        assert_eq!(view(&read(&long).unwrap()), Err(ValueProblem::Invalid));
    }

    #[test]
    fn json_values_are_strings_or_whole_numbers() {
        use serde_json::json;
        assert_eq!(json_value(&json!("gpt-4o")), Some("gpt-4o".into()));
        assert_eq!(json_value(&json!(42)), Some("42".into()));
        assert_eq!(json_value(&json!(-7)), Some("-7".into()));
        for absent in [
            json!(1.5),
            json!(null),
            json!(true),
            json!([1]),
            json!({"a": 1}),
        ] {
            assert_eq!(json_value(&absent), None, "{absent}");
        }
    }
}
