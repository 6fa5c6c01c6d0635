//! An admin write's JSON body: read within [`MAX_BODY_BYTES`], and parsed
//! strictly. serde_json keeps the last of two members of the same name
//! without a word, so a body could say one thing to a reviewer reading
//! its first `tenant` and another to the gateway: a body with a name twice
//! in one object, at any depth, is refused instead.

use std::collections::HashSet;
use std::fmt;

use http::Response;
use pingora::protocols::http::ServerSession;
use serde::de::{DeserializeOwned, Error as _, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::access::MAX_BODY_BYTES;

/// A write's JSON body, at most [`MAX_BODY_BYTES`].
pub async fn read(session: &mut ServerSession) -> Result<Vec<u8>, Box<Response<Vec<u8>>>> {
    let mut body = Vec::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                body.extend_from_slice(&chunk);
                if body.len() as u64 > MAX_BODY_BYTES {
                    return Err(Box::new(super::problem(
                        413,
                        "admin-body-too-large",
                        "An admin request body may hold at most 64 KiB.",
                    )));
                }
            }
            Ok(None) => return Ok(body),
            Err(_) => {
                return Err(Box::new(super::problem(
                    400,
                    "admin-bad-body",
                    "The request body could not be read.",
                )))
            }
        }
    }
}

/// Why a write's body was refused; shown as serde_json's message.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Not JSON, or a member named twice in one object.
    #[error(transparent)]
    Unreadable(serde_json::Error),
    /// JSON, but not the shape the write takes: a member missing, unknown
    /// or of the wrong type.
    #[error(transparent)]
    Shape(serde_json::Error),
}

/// `body` as a `T`, refusing a member name given twice in one object
/// (serde_json's error, or the name repeated, as the message).
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, BodyError> {
    serde_json::from_slice::<Unique>(body).map_err(BodyError::Unreadable)?;
    serde_json::from_slice(body).map_err(BodyError::Shape)
}

/// Any JSON value whose objects name each member once.
struct Unique;

impl<'de> Deserialize<'de> for Unique {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueVisitor)
    }
}

struct UniqueVisitor;

impl<'de> Visitor<'de> for UniqueVisitor {
    type Value = Unique;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Unique, E> {
        Ok(Unique)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Unique, E> {
        Ok(Unique)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Unique, E> {
        Ok(Unique)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Unique, E> {
        Ok(Unique)
    }

    fn visit_str<E>(self, _: &str) -> Result<Unique, E> {
        Ok(Unique)
    }

    fn visit_unit<E>(self) -> Result<Unique, E> {
        Ok(Unique)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Unique, A::Error> {
        while seq.next_element::<Unique>()?.is_some() {}
        Ok(Unique)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Unique, A::Error> {
        let mut seen = HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            if seen.contains(&name) {
                return Err(A::Error::custom(format_args!(
                    "the member {name:?} is given twice"
                )));
            }
            map.next_value::<Unique>()?;
            seen.insert(name);
        }
        Ok(Unique)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Body {
        tenant: String,
        #[serde(default)]
        limits: std::collections::BTreeMap<String, serde_json::Value>,
    }

    #[test]
    fn a_member_named_twice_at_any_depth_is_refused() {
        let ok: Body = parse(br#"{"tenant": "a", "limits": {"x": {"capacity": 1}}}"#).unwrap();
        assert_eq!(ok.tenant, "a");
        for twice in [
            r#"{"tenant": "a", "tenant": "b"}"#,
            r#"{"tenant": "a", "limits": {"x": {}, "x": {}}}"#,
            r#"{"tenant": "a", "limits": {"x": {"capacity": 1, "capacity": 9}}}"#,
            r#"{"tenant": "a", "limits": {"x": [{"k": 1, "k": 2}]}}"#,
            // The same name, escaped differently.
            r#"{"tenant": "a", "ten\u0061nt": "b"}"#,
        ] {
            let e = parse::<Body>(twice.as_bytes()).unwrap_err();
            assert!(matches!(e, BodyError::Unreadable(_)), "{twice}: {e}");
            assert!(e.to_string().contains("given twice"), "{twice}: {e}");
        }
        // serde_json's own errors are kept.
        let e = parse::<Body>(b"not json").unwrap_err();
        assert!(matches!(e, BodyError::Unreadable(_)), "{e}");
        assert!(e.to_string().contains("expected"), "{e}");
        let e = parse::<Body>(b"{}").unwrap_err();
        assert!(matches!(e, BodyError::Shape(_)), "{e}");
        assert!(e.to_string().contains("tenant"), "{e}");
    }
}
