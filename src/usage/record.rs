//! One admitted request, as the ledger records it: the fields a bill and a
//! metering pipeline read, under names that are the ledger's contract.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

/// The longest path kept in a record; a longer one is cut (on a character
/// boundary).
pub const MAX_PATH: usize = 2048;

/// One admitted request, settled. Its text is borrowed where the request
/// path already holds it (the route, the caller, the path), so that
/// writing a record copies each only into its line; read back (`tollgate
/// usage`), it owns its text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record<'a> {
    /// Unique across the fleet (a UUIDv7): sinks deduplicate on it.
    pub id: Cow<'a, str>,
    /// When the request was settled, RFC 3339, UTC, milliseconds.
    pub time: Cow<'a, str>,
    /// The instance that admitted it.
    pub instance: Cow<'a, str>,
    /// The credential's tenant (null on a route without authentication).
    pub tenant: Option<Cow<'a, str>>,
    /// The credential id.
    pub credential: Option<Cow<'a, str>>,
    /// The credential's plan, if it has one.
    pub plan: Option<Cow<'a, str>>,
    /// The route class.
    pub route: Cow<'a, str>,
    /// The request method.
    pub method: Cow<'a, str>,
    /// The host it named, lower-case, without its port.
    pub host: Option<Cow<'a, str>>,
    /// The normalized path, without the query string.
    pub path: Cow<'a, str>,
    /// The client's network as limits key it.
    pub client: Option<Cow<'a, str>>,
    /// The status answered.
    pub status: u16,
    /// What admission charged.
    pub cost_admitted: u64,
    /// What the request cost in the end: admission's charge, or what the
    /// response reported.
    pub cost_settled: u64,
    /// Where `cost_settled` comes from: `route` (the route's cost or the
    /// request's estimate, nothing to settle), `reported` (the response
    /// reported it), `estimate` or `max` (it reported none, and the
    /// request was settled so).
    pub cost_source: Cow<'a, str>,
    /// The `values` entries of its limits' keys that matched, by limit.
    pub values: std::collections::BTreeMap<Cow<'a, str>, Cow<'a, str>>,
    /// The request's trace, 32 hex digits.
    pub trace_id: Option<Cow<'a, str>>,
}

impl Record<'_> {
    /// The record as one line of JSON (no newline inside: JSON escapes
    /// them), with its newline.
    pub fn line(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        self.write_line(&mut out);
        out
    }

    /// Appends the record's [`line`](Self::line) to `out`.
    pub fn write_line(&self, out: &mut Vec<u8>) {
        // Strings, numbers and a map of strings: writing cannot fail.
        let _ = serde_json::to_writer(&mut *out, self);
        out.push(b'\n');
    }
}

/// `path`, cut to at most [`MAX_PATH`] bytes.
pub fn bounded_path(path: &str) -> &str {
    if path.len() <= MAX_PATH {
        return path;
    }
    let mut end = MAX_PATH;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    &path[..end]
}

/// A new record id, a UUIDv7, written in `room`.
pub fn new_id(room: &mut [u8; uuid::fmt::Hyphenated::LENGTH]) -> &str {
    uuid::Uuid::now_v7().hyphenated().encode_lower(room)
}

/// Room on the stack for the fields of a record that are formatted (its
/// id, time, client network and trace), so that writing a record on the
/// request path allocates for none of them.
pub struct Formatted {
    id: [u8; uuid::fmt::Hyphenated::LENGTH],
    time: [u8; 32],
    client: [u8; 64],
    trace: [u8; 32],
}

/// The formatted fields, borrowed from a [`Formatted`].
pub struct Fields<'a> {
    /// A new id (a UUIDv7).
    pub id: &'a str,
    /// The time given, RFC 3339 with milliseconds.
    pub time: Cow<'a, str>,
    /// The client network given.
    pub client: Option<Cow<'a, str>>,
    /// The trace id given, as 32 hex digits.
    pub trace: Option<&'a str>,
}

impl Formatted {
    /// Room for one record's fields.
    pub fn new() -> Self {
        Formatted {
            id: [0; uuid::fmt::Hyphenated::LENGTH],
            time: [0; 32],
            client: [0; 64],
            trace: [0; 32],
        }
    }

    /// A new id, and `time`, `client` and `trace` formatted.
    pub fn fields(
        &mut self,
        time: std::time::SystemTime,
        client: Option<ipnet::IpNet>,
        trace: Option<&[u8; 16]>,
    ) -> Fields<'_> {
        let Formatted {
            id,
            time: time_room,
            client: client_room,
            trace: trace_room,
        } = self;
        Fields {
            id: new_id(id),
            time: displayed(time_room, crate::access_log::time(time)),
            client: client.map(|net| displayed(client_room, net)),
            trace: trace.and_then(|t| {
                hex::encode_to_slice(t, trace_room).ok()?;
                std::str::from_utf8(trace_room).ok()
            }),
        }
    }
}

impl Default for Formatted {
    fn default() -> Self {
        Self::new()
    }
}

/// `value` written in `room`, or in a string of its own when it does not
/// fit.
fn displayed(room: &mut [u8], value: impl std::fmt::Display) -> Cow<'_, str> {
    use std::io::Write;
    let mut cursor = std::io::Cursor::new(&mut room[..]);
    if write!(cursor, "{value}").is_ok() {
        let len = cursor.position() as usize;
        if let Ok(text) = std::str::from_utf8(&room[..len]) {
            return Cow::Borrowed(text);
        }
    }
    Cow::Owned(value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_one_line_of_json_with_the_contract_s_names() {
        let record = Record {
            id: new_id(&mut [0; 36]).to_owned().into(),
            time: "2026-12-03T00:00:00.000Z".into(),
            instance: "gw-1".into(),
            tenant: Some("acme".into()),
            credential: Some("c1".into()),
            plan: None,
            route: "chat".into(),
            method: "POST".into(),
            host: None,
            path: "/v1/chat\n".into(),
            client: Some("203.0.113.7/32".into()),
            status: 200,
            cost_admitted: 500,
            cost_settled: 77,
            cost_source: "reported".into(),
            values: [("model-tokens".into(), "gpt-4o".into())].into(),
            trace_id: None,
        };
        let line = record.line();
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        assert_eq!(line.last(), Some(&b'\n'));
        let back: serde_json::Value = serde_json::from_slice(&line).unwrap();
        for field in [
            "id",
            "time",
            "instance",
            "tenant",
            "credential",
            "plan",
            "route",
            "method",
            "host",
            "path",
            "client",
            "status",
            "cost_admitted",
            "cost_settled",
            "cost_source",
            "values",
            "trace_id",
        ] {
            assert!(back.get(field).is_some(), "{field}");
        }
        assert_eq!(back["cost_settled"], 77, "a JSON number");
        assert_eq!(serde_json::from_slice::<Record>(&line).unwrap(), record);
    }

    #[test]
    fn formatted_fields_read_as_their_own_formatting_would() {
        let time = std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_764_720_000_123);
        let v6: ipnet::IpNet = "2001:db8:ffff:ffff:ffff:ffff:255.255.255.255/128"
            .parse()
            .unwrap();
        let mut room = Formatted::new();
        let fields = room.fields(time, Some(v6), Some(&[0xab; 16]));
        assert_eq!(
            fields.time,
            humantime::format_rfc3339_millis(time).to_string()
        );
        assert_eq!(fields.client.as_deref(), Some(v6.to_string().as_str()));
        assert_eq!(fields.trace, Some("ab".repeat(16).as_str()));
        assert_eq!(
            uuid::Uuid::parse_str(fields.id).unwrap().get_version_num(),
            7
        );
        // What does not fit is written anyway.
        assert_eq!(displayed(&mut [0; 4], "longer"), "longer");
    }

    #[test]
    fn ids_are_unique_and_paths_bounded() {
        let ids: std::collections::HashSet<_> =
            (0..1000).map(|_| new_id(&mut [0; 36]).to_owned()).collect();
        assert_eq!(ids.len(), 1000);
        assert_eq!(bounded_path(&"é".repeat(2000)).len(), MAX_PATH);
        assert_eq!(bounded_path("/v1/x"), "/v1/x");
    }
}
