//! Target normalization: a table of paths, the request-target forms refused,
//! and properties over arbitrary encodings of plain paths.

use proptest::prelude::*;

use super::*;

fn norm(raw: &str) -> Result<String, TargetError> {
    normalize(raw.as_bytes(), EncodedSlash::Reject).map(Cow::into_owned)
}

#[test]
fn normal_paths_are_borrowed_unchanged() {
    for path in [
        "/",
        "/v1/reports/1",
        "/a/b/",
        "/a/.hidden",
        "/a/.../b",
        "/x:y@z;p=1,2",
    ] {
        let got = normalize(path.as_bytes(), EncodedSlash::Reject).unwrap();
        assert!(matches!(got, Cow::Borrowed(_)), "{path}");
        assert_eq!(got, path);
    }
}

#[test]
fn normalization_table() {
    let table = [
        ("/v1/%72eports/1", "/v1/reports/1"),
        ("/v1/%72%65%70%6F%72%74%73/1", "/v1/reports/1"),
        ("/%7e%2D%5f%2e%41", "/~-_.A"),
        ("//a///b", "/a/b"),
        ("/a//b/", "/a/b/"),
        ("/a%20b", "/a%20b"),
        ("/a%3fb", "/a%3Fb"),
        ("/a%25b", "/a%25b"),
        ("/a%2e%2E%2e", "/a..."),
        ("/a b", "/a%20b"),
        ("/caf\u{e9}", "/caf%C3%A9"),
        ("/a|b{c}", "/a%7Cb%7Bc%7D"),
    ];
    for (raw, want) in table {
        assert_eq!(norm(raw).as_deref(), Ok(want), "{raw}");
    }
}

#[test]
fn dot_segments_in_any_encoding_are_not_found() {
    for raw in [
        "/a/../b",
        "/a/./b",
        "/..",
        "/.",
        "/a/%2e%2e/b",
        "/a/%2E./b",
        "/a/.%2E/b",
        "/a/%2e",
        "/public/%2e%2e/v1/reports/1",
        "/a//../b",
        "/public/..;/admin",
        "/public/.;x/admin",
        "/a/%2e%2e;jsessionid=1/b",
        "/a/..%3bx/b",
    ] {
        assert_eq!(norm(raw), Err(TargetError::DotSegment), "{raw}");
        assert!(TargetError::DotSegment.is_not_found());
    }
}

#[test]
fn encoded_separators_and_nul_are_bad_requests() {
    let table = [
        ("/public/%2e%2e%2fv1/reports/1", TargetError::EncodedSlash),
        ("/a%2Fb", TargetError::EncodedSlash),
        ("/a\\b", TargetError::Backslash),
        ("/a%5cb", TargetError::Backslash),
        ("/a%5Cb", TargetError::Backslash),
        ("/a%00b", TargetError::Nul),
        ("/a\0b", TargetError::Nul),
        ("/a%2", TargetError::BadEncoding),
        ("/a%zz", TargetError::BadEncoding),
        ("/a%", TargetError::BadEncoding),
    ];
    for (raw, want) in table {
        assert_eq!(norm(raw), Err(want), "{raw}");
        assert!(!want.is_not_found());
    }
}

#[test]
fn encoded_slash_can_be_kept() {
    let keep = |raw: &str| normalize(raw.as_bytes(), EncodedSlash::Keep).map(Cow::into_owned);
    assert_eq!(
        keep("/projects/group%2fname").as_deref(),
        Ok("/projects/group%2Fname")
    );
    // An upstream that decodes it would split there: a dot piece between
    // kept slashes is a dot segment all the same.
    assert_eq!(keep("/a/%2e%2e%2fb"), Err(TargetError::DotSegment));
    assert_eq!(
        keep("/projects/x/..%2F..%2Fadmin"),
        Err(TargetError::DotSegment)
    );
    assert_eq!(keep("/a/b%2F.c").as_deref(), Ok("/a/b%2F.c"));
    assert_eq!(keep("/a%5cb"), Err(TargetError::Backslash));
}

fn target(raw: &str, host: Option<&str>) -> Result<(String, Option<String>, bool), TargetError> {
    parse(
        raw.as_bytes(),
        host.map(str::as_bytes),
        PathRules::default(),
    )
    .map(|t| (t.path.into_owned(), t.query.map(str::to_owned), t.rewritten))
}

#[test]
fn targets_that_are_not_origin_form_are_refused() {
    for raw in [
        "v1/secret",
        "x:1/v1/secret",
        "?",
        "*",
        "",
        "host:443",
        "ftp://h/x",
    ] {
        assert_eq!(
            target(raw, Some("h")),
            Err(TargetError::NotOriginForm),
            "{raw}"
        );
    }
    assert_eq!(
        target("http://user@h/x", Some("h")),
        Err(TargetError::NotOriginForm)
    );
    assert_eq!(
        target("http://h?x", Some("h")),
        Err(TargetError::NotOriginForm)
    );
}

#[test]
fn absolute_form_must_name_the_host() {
    assert_eq!(
        target("http://api.test:8080/v1/x?q=1", Some("API.test:8080")),
        Ok(("/v1/x".into(), Some("q=1".into()), true))
    );
    assert_eq!(target("HTTPS://h", Some("h")), Ok(("/".into(), None, true)));
    assert_eq!(
        target("http://other/v1/x", Some("h")),
        Err(TargetError::HostMismatch)
    );
    assert_eq!(
        target("http://h/v1/x", None),
        Err(TargetError::HostMismatch)
    );
}

#[test]
fn the_query_is_kept_as_sent() {
    assert_eq!(
        target("/a//%62?x=%2F..//&y=%zz", None),
        Ok(("/a/b".into(), Some("x=%2F..//&y=%zz".into()), true))
    );
    assert_eq!(
        target("/a?", None),
        Ok(("/a".into(), Some("".into()), false))
    );
    assert_eq!(target("/a", None), Ok(("/a".into(), None, false)));
    let t = parse(b"/a%62?q", None, PathRules::default()).unwrap();
    assert_eq!(t.origin_form(), "/ab?q");
}

/// A path of plain segments: what a client means.
fn plain_path() -> impl Strategy<Value = String> {
    let segment = "[A-Za-z0-9_~-][A-Za-z0-9._~-]{0,8}"
        .prop_filter("no dot segment", |s| s != "." && s != "..");
    prop::collection::vec(segment, 0..6).prop_map(|segs| format!("/{}", segs.join("/")))
}

/// The same path with some unreserved characters percent-encoded (in either
/// hex case) and some slashes doubled: how an attacker may write it.
fn encode(path: &str, picks: &[u8]) -> String {
    let mut out = String::new();
    for (i, c) in path.chars().enumerate() {
        let pick = picks.get(i % picks.len().max(1)).copied().unwrap_or(0);
        match (c, pick % 4) {
            ('/', 3) => out.push_str("//"),
            ('/', _) => out.push('/'),
            (c, 1) => out.push_str(&format!("%{:02x}", c as u8)),
            (c, 2) => out.push_str(&format!("%{:02X}", c as u8)),
            (c, _) => out.push(c),
        }
    }
    out
}

proptest! {
    #[test]
    fn any_encoding_normalizes_to_the_plain_path(
        path in plain_path(),
        picks in prop::collection::vec(any::<u8>(), 1..32),
    ) {
        let encoded = encode(&path, &picks);
        prop_assert_eq!(norm(&encoded), Ok(path.clone()));
        prop_assert_eq!(norm(&path), Ok(path));
    }

    #[test]
    fn normalizing_is_idempotent_and_never_panics(raw in prop::collection::vec(any::<u8>(), 0..64)) {
        let mut raw = raw;
        raw.insert(0, b'/');
        if let Ok(once) = normalize(&raw, EncodedSlash::Reject) {
            let twice = normalize(once.as_bytes(), EncodedSlash::Reject).unwrap();
            prop_assert_eq!(&twice, &once);
            prop_assert!(twice.is_ascii());
        }
        let keep = PathRules {
            encoded_slash: EncodedSlash::Keep,
            params: PathParams::Keep,
            ..PathRules::default()
        };
        let _ = parse(&raw[1..], Some(b"h"), keep);
    }
}

fn with_params(raw: &str, params: PathParams) -> Result<(String, bool), TargetError> {
    let rules = PathRules {
        params,
        ..PathRules::default()
    };
    parse(raw.as_bytes(), None, rules).map(|t| (t.origin_form(), t.rewritten))
}

#[test]
fn path_parameters_are_refused_stripped_or_kept() {
    for raw in [
        "/v1/reports;x/3",
        "/v1/reports%3Bx/3",
        "/v1/reports%3bx/3",
        "/a;",
    ] {
        assert_eq!(
            with_params(raw, PathParams::Reject),
            Err(TargetError::PathParams),
            "{raw}"
        );
    }
    // A query may hold `;`: it is not the path.
    assert_eq!(
        with_params("/a?x=1;y=2", PathParams::Reject),
        Ok(("/a?x=1;y=2".into(), false))
    );
    for (raw, stripped) in [
        ("/v1/reports;x/3", "/v1/reports/3"),
        ("/v1/reports%3Bx=1/3?q=;", "/v1/reports/3?q=;"),
        ("/v1/reports;jsessionid=1", "/v1/reports"),
        ("/a/;x/b", "/a/b"),
        ("/a/b/;x", "/a/b/"),
        ("/;x", "/"),
        ("/a;x/", "/a/"),
    ] {
        assert_eq!(
            with_params(raw, PathParams::Strip),
            Ok((stripped.to_string(), true)),
            "{raw}"
        );
    }
    assert_eq!(
        with_params("/v1/reports;x/3", PathParams::Keep),
        Ok(("/v1/reports;x/3".into(), false))
    );
    assert_eq!(
        with_params("/v1/..;x/admin", PathParams::Strip),
        Err(TargetError::DotSegment),
        "a dot-segment behind a parameter is still one"
    );
}

fn with_trailing_dots(raw: &str, trailing_dots: TrailingDots) -> Result<String, TargetError> {
    let rules = PathRules {
        trailing_dots,
        params: PathParams::Keep,
        encoded_slash: EncodedSlash::Keep,
        ..PathRules::default()
    };
    parse(raw.as_bytes(), None, rules).map(|t| t.origin_form())
}

#[test]
fn segments_ending_in_a_dot_or_a_space_are_refused_unless_allowed() {
    for raw in [
        "/v1/admin.",
        "/v1/admin%2e",
        "/v1/admin%2E",
        "/v1/a./b",
        "/v1/x%20/y",
        "/v1/x%20",
        "/v1/x.%20",
        "/v1/x%20./y",
        "/v1/a.;x/b",
        "/v1/a.%3Bx/b",
        "/v1/a.%2Fb",
        "/v1/a...",
    ] {
        assert_eq!(
            with_trailing_dots(raw, TrailingDots::Refuse),
            Err(TargetError::TrailingDot),
            "{raw}"
        );
        assert!(
            with_trailing_dots(raw, TrailingDots::Allow).is_ok(),
            "{raw} allowed"
        );
    }
    for raw in [
        "/v1/a.b",
        "/v1/.hidden",
        "/v1/a%20b",
        "/v1/a/",
        "/",
        "/v1/a?x=1.",
        "/v1/a?x=%20",
    ] {
        assert!(
            with_trailing_dots(raw, TrailingDots::Refuse).is_ok(),
            "{raw}"
        );
    }
    // Dot segments stay what they were: paths no route has.
    for raw in ["/v1/./a", "/v1/../a", "/v1/%2e%2e/a"] {
        assert_eq!(
            with_trailing_dots(raw, TrailingDots::Refuse),
            Err(TargetError::DotSegment),
            "{raw}"
        );
    }
    // A `;` parameter stripped first leaves what is checked.
    let strip = PathRules {
        params: PathParams::Strip,
        ..PathRules::default()
    };
    assert_eq!(
        parse(b"/v1/a.;x/b", None, strip).map(|t| t.origin_form()),
        Err(TargetError::TrailingDot)
    );
}
