//! A request's JSON body, read where a route needs it: the members at a
//! dotted path, read one way only (a name given twice on the path is a
//! duplicate, never the first or the last), and the one rewrite the
//! gateway makes, asking an OpenAI-compatible API for a stream's usage.
//!
//! A member is kept as its exact text (`RawValue`), so a rewrite changes
//! the bytes it must and no other: numbers, escapes, member order and
//! spacing reach the upstream as the client wrote them.

use serde_json::value::RawValue;

/// A request body that is not JSON (or not UTF-8, which JSON is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request body is not JSON")]
pub struct NotJson;

/// A member name given twice in one object, on a path that is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a member of the request body is named twice")]
pub struct Duplicate;

/// The members of a JSON object in their order, each with its exact
/// text, names decoded: a name given twice is kept twice, for the reader
/// to refuse.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut members = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    members.push((name, map.next_value::<&'de RawValue>()?));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(Visit)
    }
}

impl<'a> Members<'a> {
    /// The members of `value`, when it is an object.
    fn of(value: &'a RawValue) -> Option<Self> {
        if !value.get().starts_with('{') {
            return None;
        }
        serde_json::from_str(value.get()).ok()
    }

    /// The one member named `name`, if any.
    fn one(&self, name: &str) -> Result<Option<&'a RawValue>, Duplicate> {
        let mut found = self.0.iter().filter(|(n, _)| n == name).map(|(_, v)| *v);
        match (found.next(), found.next()) {
            (_, Some(_)) => Err(Duplicate),
            (one, None) => Ok(one),
        }
    }
}

/// A whole body as JSON.
pub fn parse(body: &[u8]) -> Result<&RawValue, NotJson> {
    let text = std::str::from_utf8(body).map_err(|_| NotJson)?;
    serde_json::from_str(text).map_err(|_| NotJson)
}

/// The member at `path` in `root`: `None` when a level is missing or not
/// an object.
pub fn member_at<'a>(
    root: &'a RawValue,
    path: &[Box<str>],
) -> Result<Option<&'a RawValue>, Duplicate> {
    let mut at = root;
    for name in path {
        let Some(members) = Members::of(at) else {
            return Ok(None);
        };
        match members.one(name)? {
            Some(value) => at = value,
            None => return Ok(None),
        }
    }
    Ok(Some(at))
}

/// A streamed chat/completions request `body` asking for its usage: with
/// `stream_options.include_usage: true` set, added or replacing what was
/// there. `None` when the body needs no change (not streamed, or already
/// asking); a body that is not a JSON object is left alone.
pub fn ask_for_usage(body: &[u8]) -> Result<Option<Vec<u8>>, Duplicate> {
    let Ok(root) = parse(body) else {
        return Ok(None);
    };
    let Some(top) = Members::of(root) else {
        return Ok(None);
    };
    if top.one("stream")?.map(RawValue::get) != Some("true") {
        return Ok(None);
    }
    let text = root.get();
    let at = |v: &RawValue| v.get().as_ptr() as usize - text.as_ptr() as usize;
    // (where, how many bytes it replaces, what goes there)
    let (start, replaced, with) = match top.one("stream_options")? {
        None => (
            1,
            0,
            r#""stream_options":{"include_usage":true},"#.to_owned(),
        ),
        Some(options) => match Members::of(options) {
            None => (
                at(options),
                options.get().len(),
                r#"{"include_usage":true}"#.to_owned(),
            ),
            Some(members) => match members.one("include_usage")? {
                Some(v) if v.get() == "true" => return Ok(None),
                Some(v) => (at(v), v.get().len(), "true".to_owned()),
                None => {
                    let comma = if members.0.is_empty() { "" } else { "," };
                    (
                        at(options) + 1,
                        0,
                        format!(r#""include_usage":true{comma}"#),
                    )
                }
            },
        },
    };
    // `root` may have spaces around it in `body`.
    let offset = text.as_ptr() as usize - body.as_ptr() as usize;
    let mut out = Vec::with_capacity(body.len() + with.len());
    out.extend_from_slice(&body[..offset + start]);
    out.extend_from_slice(with.as_bytes());
    out.extend_from_slice(&body[offset + start + replaced..]);
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(body: &str) -> Option<String> {
        ask_for_usage(body.as_bytes())
            .unwrap()
            .map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn a_stream_is_asked_for_its_usage_and_nothing_else_changes() {
        assert_eq!(
            asked(r#"{"model":"m","stream":true,"n":1.50}"#).as_deref(),
            Some(r#"{"stream_options":{"include_usage":true},"model":"m","stream":true,"n":1.50}"#)
        );
        assert_eq!(
            asked(r#" {"stream":true,"stream_options":{"include_usage":false}} "#).as_deref(),
            Some(r#" {"stream":true,"stream_options":{"include_usage":true}} "#)
        );
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":{"x":"\u0041"}}"#).as_deref(),
            Some(r#"{"stream":true,"stream_options":{"include_usage":true,"x":"\u0041"}}"#)
        );
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":{}}"#).as_deref(),
            Some(r#"{"stream":true,"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            asked(r#"{"stream":true,"stream_options":null}"#).as_deref(),
            Some(r#"{"stream":true,"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            asked(r#"{ "stream" : true , "stream_options" : { "include_usage" : 0 } }"#).as_deref(),
            Some(r#"{ "stream" : true , "stream_options" : { "include_usage" : true } }"#)
        );
    }

    #[test]
    fn what_needs_no_change_is_left_alone() {
        for body in [
            r#"{"stream":false}"#,
            r#"{"model":"m"}"#,
            r#"{"stream":"true"}"#,
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
            r#"[{"stream":true}]"#,
            "not json",
            "",
        ] {
            assert_eq!(asked(body), None, "{body}");
        }
    }

    #[test]
    fn a_member_named_twice_is_refused_not_guessed() {
        for body in [
            r#"{"stream":true,"stream":false}"#,
            r#"{"stream":true,"stream_options":{},"stream_options":{}}"#,
            r#"{"stream":true,"stream_options":{"include_usage":false,"include_usage":true}}"#,
            r#"{"stream":true,"str\u0065am":false}"#,
        ] {
            assert_eq!(ask_for_usage(body.as_bytes()), Err(Duplicate), "{body}");
        }
    }

    #[test]
    fn members_are_found_by_decoded_name_along_a_path() {
        let root = parse(br#"{"a":{"b":"x","c":[1]},"d":1}"#).unwrap();
        let path = |p: &str| p.split('.').map(Box::from).collect::<Vec<Box<str>>>();
        let get = |p: &str| member_at(root, &path(p)).unwrap().map(RawValue::get);
        assert_eq!(get("a.b"), Some(r#""x""#));
        assert_eq!(get("a.c"), Some("[1]"));
        assert_eq!(get("d.e"), None);
        assert_eq!(get("z"), None);
        let twice = parse(br#"{"a":{"b":1,"\u0062":2}}"#).unwrap();
        assert_eq!(member_at(twice, &path("a.b")).err(), Some(Duplicate));
        assert_eq!(parse(b"{\"a\":1} x").err(), Some(NotJson));
        assert_eq!(parse(b"\xff").err(), Some(NotJson));
    }
}
