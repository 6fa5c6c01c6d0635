//! Route matching: maps a request's method and path to a configured route.
//!
//! The first route in file order whose method list (empty = any method) and
//! path template both match wins; no match means 404. The matched route's
//! name is the route class used in rate-limit keys, metrics and logs, so raw
//! paths (which carry IDs and tokens) never reach label sets. Request paths
//! are matched once normalized by [`crate::edge::target`], which is also
//! the path the upstream receives.
//!
//! Template segments are literals (exact, case-sensitive), `{name}` (exactly
//! one non-empty segment) or `**` (only last; zero or more segments). A
//! trailing slash is significant: `/a` matches `/a` only and `/a/` matches
//! `/a/` only, because the empty final segment is compared literally.
//! `server.path` relaxes both for upstreams that read paths that way
//! ([`Matching`]): the path the upstream receives is the same either way.

use crate::edge::target::{Case, PathRules, TrailingSlash};

/// How paths match templates: the matching half of [`PathRules`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Matching {
    /// Whether a template also matches its path with one trailing `/`.
    pub trailing_slash: TrailingSlash,
    /// Whether literal segments ignore ASCII case.
    pub case: Case,
}

impl From<PathRules> for Matching {
    fn from(rules: PathRules) -> Self {
        Self {
            trailing_slash: rules.trailing_slash,
            case: rules.case,
        }
    }
}

pub use crate::ids::RouteId;

/// One parsed template segment.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param(String),
    Rest,
}

/// A parsed path template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate {
    text: String,
    segments: Vec<Segment>,
}

/// Why a path template was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template does not begin with `/`.
    #[error("path must start with \"/\"")]
    NotAbsolute,
    /// `**` appeared before the final segment.
    #[error("\"**\" may only be the last segment")]
    RestNotLast,
    /// A segment mixes braces with other text or names a placeholder badly.
    #[error("segment \"{0}\" is not a valid placeholder")]
    InvalidPlaceholder(String),
    /// The same placeholder name (without braces) appears twice.
    #[error("duplicate placeholder \"{{{0}}}\"")]
    DuplicatePlaceholder(String),
    /// A `.` or `..` segment, which no normalised path can contain.
    #[error("dot-segment \"{0}\" is not allowed")]
    DotSegment(String),
    /// A `{}` segment.
    #[error("empty placeholder name")]
    EmptyPlaceholder,
}

impl PathTemplate {
    /// Parses a template such as `/v1/users/{id}` or `/static/**`.
    pub fn parse(template: &str) -> Result<PathTemplate, TemplateError> {
        let body = template
            .strip_prefix('/')
            .ok_or(TemplateError::NotAbsolute)?;
        let mut segments: Vec<Segment> = Vec::new();
        let mut raw_parts = body.split('/').peekable();
        while let Some(raw) = raw_parts.next() {
            // Collapse `//` as paths are, but keep a final empty segment so
            // a trailing slash stays significant.
            if raw.is_empty() && raw_parts.peek().is_some() {
                continue;
            }
            if segments.last() == Some(&Segment::Rest) {
                return Err(TemplateError::RestNotLast);
            }
            let segment = parse_segment(raw)?;
            if let Segment::Param(name) = &segment {
                let seen = segments
                    .iter()
                    .any(|s| matches!(s, Segment::Param(other) if other == name));
                if seen {
                    return Err(TemplateError::DuplicatePlaceholder(name.clone()));
                }
            }
            segments.push(segment);
        }
        Ok(PathTemplate {
            text: template.to_owned(),
            segments,
        })
    }

    /// Whether a normalised path (as returned by `normalize_path`) matches,
    /// exactly.
    pub fn matches(&self, path: &str) -> bool {
        self.matches_as(path, Matching::default())
    }

    /// Whether a normalised path matches under `how`.
    pub fn matches_as(&self, path: &str, how: Matching) -> bool {
        if self.matches_one(path, how.case) {
            return true;
        }
        how.trailing_slash == TrailingSlash::Ignore
            && path.len() > 1
            && path
                .strip_suffix('/')
                .is_some_and(|p| self.matches_one(p, how.case))
    }

    fn matches_one(&self, path: &str, case: Case) -> bool {
        let Some(body) = path.strip_prefix('/') else {
            return false;
        };
        let same = |lit: &str, part: &str| match case {
            Case::Sensitive => lit == part,
            Case::Insensitive => lit.eq_ignore_ascii_case(part),
        };
        // Iterating the split directly keeps the per-request path allocation-free.
        let mut parts = body.split('/');
        for segment in &self.segments {
            let ok = match segment {
                Segment::Rest => return true,
                Segment::Literal(lit) => parts.next().is_some_and(|p| same(lit, p)),
                Segment::Param(_) => parts.next().is_some_and(|p| !p.is_empty()),
            };
            if !ok {
                return false;
            }
        }
        parts.next().is_none()
    }

    /// The segment of a path this template matched that its `{name}`
    /// placeholder stands for.
    pub fn param<'p>(&self, path: &'p str, name: &str) -> Option<&'p str> {
        let mut parts = path.strip_prefix('/')?.split('/');
        for segment in &self.segments {
            let part = parts.next()?;
            match segment {
                Segment::Param(p) if p == name => return Some(part),
                Segment::Rest => return None,
                _ => {}
            }
        }
        None
    }

    /// Whether the template has a `{name}` placeholder.
    pub fn has_param(&self, name: &str) -> bool {
        self.segments
            .iter()
            .any(|s| matches!(s, Segment::Param(p) if p == name))
    }

    /// The original template text.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// Parses one non-collapsed template segment.
fn parse_segment(raw: &str) -> Result<Segment, TemplateError> {
    if raw == "**" {
        return Ok(Segment::Rest);
    }
    if is_dot_segment(raw) {
        return Err(TemplateError::DotSegment(raw.to_owned()));
    }
    if let Some(name) = raw.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
        if name.is_empty() {
            return Err(TemplateError::EmptyPlaceholder);
        }
        if name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Ok(Segment::Param(name.to_owned()));
        }
    }
    // Braces anywhere else (bad name, "{a", "a{b}") are a typo, not a literal.
    if raw.contains(['{', '}']) {
        return Err(TemplateError::InvalidPlaceholder(raw.to_owned()));
    }
    Ok(Segment::Literal(raw.to_owned()))
}

/// Whether a segment is `.` or `..`, with any dot optionally written `%2e`.
fn is_dot_segment(segment: &str) -> bool {
    // At most two dots: "..." and longer are ordinary names.
    match strip_dot(segment) {
        Some("") => true,
        Some(rest) => strip_dot(rest) == Some(""),
        None => false,
    }
}

/// Strips one leading `.` or case-insensitive `%2e`.
fn strip_dot(s: &str) -> Option<&str> {
    s.strip_prefix('.').or_else(|| {
        s.get(..3)
            .filter(|p| p.eq_ignore_ascii_case("%2e"))
            .and_then(|_| s.get(3..))
    })
}

/// A host name a route serves: exact, or `*.suffix` for any subdomain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// This name exactly (lower-case).
    Exact(String),
    /// Any name ending in this suffix, which starts with `.` (lower-case).
    Subdomains(String),
}

/// Why a host pattern was rejected: not a host name, nor `*.` before one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a host name (letters, digits, - and ., or *. before them; no port)")]
pub struct HostError {
    /// The pattern as given.
    pub text: String,
}

impl HostPattern {
    /// Parses `api.example.com` or `*.example.com`.
    pub fn parse(text: &str) -> Result<Self, HostError> {
        let lower = text.to_ascii_lowercase();
        let (wild, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, lower.as_str()),
        };
        let valid = !name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        if !valid {
            return Err(HostError {
                text: text.to_owned(),
            });
        }
        Ok(if wild {
            HostPattern::Subdomains(format!(".{name}"))
        } else {
            HostPattern::Exact(name.to_owned())
        })
    }

    /// Whether `host` (lower-case, without its port) is served.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(name) => host == name,
            HostPattern::Subdomains(suffix) => {
                host.len() > suffix.len() && host.ends_with(suffix.as_str())
            }
        }
    }
}

/// The host a request names (`Host` or `:authority`): lower-case, without
/// its port or an IPv6 literal's brackets' port.
pub fn request_host(authority: &str) -> std::borrow::Cow<'_, str> {
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        std::borrow::Cow::Owned(host.to_ascii_lowercase())
    } else {
        std::borrow::Cow::Borrowed(host)
    }
}

/// One route: allowed methods (empty = any), hosts (empty = any), template
/// and the caller's payload.
#[derive(Debug, Clone)]
struct Entry<R> {
    methods: Vec<String>,
    hosts: Vec<HostPattern>,
    template: PathTemplate,
    route: R,
}

/// Route matching over an ordered list: generic so the caller's route type can hold anything.
#[derive(Debug, Clone)]
pub struct Router<R> {
    entries: Vec<Entry<R>>,
    matching: Matching,
}

impl<R> Router<R> {
    /// Creates an empty router that matches paths exactly.
    pub fn new() -> Self {
        Self::matching(Matching::default())
    }

    /// Creates an empty router that matches paths as `how` says.
    pub fn matching(how: Matching) -> Self {
        Router {
            entries: Vec::new(),
            matching: how,
        }
    }

    /// Appends a route. `methods` empty means any method; names are compared
    /// case-sensitively, so pass them upper-case as HTTP sends them. `hosts`
    /// empty means any host.
    pub fn push(
        &mut self,
        methods: Vec<String>,
        hosts: Vec<HostPattern>,
        template: PathTemplate,
        route: R,
    ) {
        self.entries.push(Entry {
            methods,
            hosts,
            template,
            route,
        });
    }

    /// First match in insertion order: method, then host (as given by
    /// [`request_host`]; `None` matches only routes without hosts), then the
    /// path, which must already be normalized.
    pub fn find(&self, method: &str, host: Option<&str>, path: &str) -> Option<&R> {
        self.find_with_template(method, host, path).map(|(r, _)| r)
    }

    /// [`Router::find`], with the template that matched (its placeholders
    /// name segments of the path).
    pub fn find_with_template(
        &self,
        method: &str,
        host: Option<&str>,
        path: &str,
    ) -> Option<(&R, &PathTemplate)> {
        self.entries
            .iter()
            .find(|e| {
                (e.methods.is_empty() || e.methods.iter().any(|m| m == method))
                    && (e.hosts.is_empty()
                        || host.is_some_and(|h| e.hosts.iter().any(|p| p.matches(h))))
                    && e.template.matches_as(path, self.matching)
            })
            .map(|e| (&e.route, &e.template))
    }

    /// The route at `index`, in insertion order.
    pub fn get(&self, id: RouteId) -> Option<&R> {
        self.entries.get(id.index()).map(|e| &e.route)
    }

    /// The template of the route at `index`, in insertion order.
    pub fn template(&self, id: RouteId) -> Option<&PathTemplate> {
        self.entries.get(id.index()).map(|e| &e.template)
    }

    /// Routes with their templates, in insertion order.
    pub fn with_templates(&self) -> impl Iterator<Item = (&R, &PathTemplate)> {
        self.entries.iter().map(|e| (&e.route, &e.template))
    }

    /// Number of routes.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no routes.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Routes in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = &R> {
        self.entries.iter().map(|e| &e.route)
    }
}

impl<R> Default for Router<R> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> PathTemplate {
        PathTemplate::parse(s).unwrap()
    }

    fn err(s: &str) -> String {
        PathTemplate::parse(s).unwrap_err().to_string()
    }

    #[test]
    fn matching_can_ignore_a_trailing_slash_and_case() {
        let loose = Matching {
            trailing_slash: TrailingSlash::Ignore,
            case: Case::Insensitive,
        };
        let reports = t("/v1/reports/{id}");
        for (path, strict, relaxed) in [
            ("/v1/reports/3", true, true),
            ("/v1/reports/3/", false, true),
            ("/V1/REPORTS/3", false, true),
            ("/V1/Reports/3/", false, true),
            ("/v1/reports/3//", false, false),
            ("/v1/reports/", false, false),
            ("/v1/reportsx/3", false, false),
        ] {
            assert_eq!(reports.matches(path), strict, "{path}");
            assert_eq!(reports.matches_as(path, loose), relaxed, "{path}");
        }
        assert!(t("/").matches_as("/", loose));
        assert!(
            !t("/a").matches_as("/", loose),
            "the root is not a trailing slash"
        );

        // First match in file order, now that the specific route also
        // matches what used to fall through to the catch-all.
        let mut router = Router::matching(loose);
        router.push(vec![], vec![], t("/v1/reports/{id}"), "reports");
        router.push(vec![], vec![], t("/**"), "catch-all");
        assert_eq!(router.find("GET", None, "/V1/REPORTS/3/"), Some(&"reports"));
        let mut strict = Router::new();
        strict.push(vec![], vec![], t("/v1/reports/{id}"), "reports");
        strict.push(vec![], vec![], t("/**"), "catch-all");
        assert_eq!(
            strict.find("GET", None, "/V1/REPORTS/3"),
            Some(&"catch-all")
        );
    }

    #[test]
    fn literal_match_and_mismatch() {
        let tpl = t("/healthz");
        assert_eq!(tpl.as_str(), "/healthz");
        assert!(tpl.matches("/healthz"));
        assert!(!tpl.matches("/healthz/"));
        assert!(!tpl.matches("/Healthz"));
        assert!(!tpl.matches("/healthz/x"));
        assert!(!tpl.matches("healthz"));
        assert!(t("/a/").matches("/a/"));
        assert!(!t("/a/").matches("/a"));
        assert!(t("/").matches("/"));
        assert!(!t("/").matches("/a"));
        assert!(t("/a//b").matches("/a/b"));
        assert!(t("/a//").matches("/a/"));
    }

    #[test]
    fn placeholder_matches_exactly_one_segment() {
        let tpl = t("/users/{id}");
        assert!(tpl.matches("/users/42"));
        assert!(!tpl.matches("/users"));
        assert!(!tpl.matches("/users/"));
        assert!(!tpl.matches("/users/42/posts"));
        assert!(t("/users/{id}/posts/{post_id}").matches("/users/1/posts/2"));
    }

    #[test]
    fn rest_matches_zero_or_more_segments() {
        let tpl = t("/v1/**");
        for path in ["/v1", "/v1/", "/v1/a", "/v1/a/b/c"] {
            assert!(tpl.matches(path), "{path}");
        }
        assert!(!tpl.matches("/v2/a"));
        assert!(!tpl.matches("/v10"));
        let all = t("/**");
        assert!(all.matches("/"));
        assert!(all.matches("/x/y"));
    }

    #[test]
    fn template_error_messages() {
        assert_eq!(err("/a/**/b"), r#""**" may only be the last segment"#);
        assert_eq!(err("/**/"), r#""**" may only be the last segment"#);
        assert_eq!(err("v1/x"), r#"path must start with "/""#);
        assert_eq!(err("/a/{a"), r#"segment "{a" is not a valid placeholder"#);
        assert_eq!(err("/a{b}"), r#"segment "a{b}" is not a valid placeholder"#);
        assert_eq!(err("/{-}"), r#"segment "{-}" is not a valid placeholder"#);
        assert_eq!(err("/{id}/x/{id}"), r#"duplicate placeholder "{id}""#);
        assert_eq!(err("/a/../b"), r#"dot-segment ".." is not allowed"#);
        assert_eq!(err("/a/./b"), r#"dot-segment "." is not allowed"#);
        assert_eq!(err("/a/{}"), "empty placeholder name");
    }

    #[test]
    fn first_match_wins_with_method_filter() {
        let mut router = Router::new();
        router.push(vec!["GET".to_owned()], vec![], t("/items/{id}"), "read");
        router.push(Vec::new(), vec![], t("/**"), "catch_all");
        assert_eq!(router.find("GET", None, "/items/1"), Some(&"read"));
        assert_eq!(router.find("POST", None, "/items/1"), Some(&"catch_all"));
        assert_eq!(router.find("get", None, "/items/1"), Some(&"catch_all"));
        assert_eq!(router.len(), 2);
        assert!(!router.is_empty());
        let names: Vec<_> = router.iter().copied().collect();
        assert_eq!(names, ["read", "catch_all"]);
    }

    #[test]
    fn no_match_is_none() {
        let mut router = Router::default();
        assert!(router.is_empty());
        assert_eq!(router.find("GET", None, "/"), None);
        router.push(vec!["GET".to_owned()], vec![], t("/healthz"), 1);
        assert_eq!(router.find("GET", None, "/other"), None);
        assert_eq!(router.find("DELETE", None, "/healthz"), None);
    }

    #[test]
    fn hosts_match_exactly_or_as_subdomains() {
        let exact = HostPattern::parse("API.example.com").unwrap();
        let wild = HostPattern::parse("*.example.com").unwrap();
        assert!(exact.matches("api.example.com"));
        assert!(!exact.matches("www.example.com"));
        assert!(wild.matches("a.example.com") && wild.matches("a.b.example.com"));
        assert!(!wild.matches("example.com") && !wild.matches("badexample.com"));
        for bad in [
            "",
            "*",
            "a..b",
            "a:80",
            "*.",
            "ex ample.com",
            "a.*.com",
            "-_-",
        ] {
            assert!(HostPattern::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(request_host("API.Example.com:8443"), "api.example.com");
        assert_eq!(request_host("example.com."), "example.com");
        assert_eq!(request_host("[::1]:80"), "::1");
        assert_eq!(request_host("10.0.0.1"), "10.0.0.1");
    }

    #[test]
    fn routes_with_hosts_are_chosen_by_host_first() {
        let mut router = Router::new();
        let api = vec![HostPattern::parse("api.test").unwrap()];
        router.push(Vec::new(), api, t("/**"), "api");
        router.push(Vec::new(), vec![], t("/**"), "any");
        assert_eq!(router.find("GET", Some("api.test"), "/x"), Some(&"api"));
        assert_eq!(router.find("GET", Some("www.test"), "/x"), Some(&"any"));
        assert_eq!(router.find("GET", None, "/x"), Some(&"any"));
    }
}
