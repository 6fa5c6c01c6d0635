//! One admitted request, as the ledger records it: the fields a bill and a
//! metering pipeline read, under names that are the ledger's contract.

use serde::{Deserialize, Serialize};

/// The longest path kept in a record; a longer one is cut (on a character
/// boundary).
pub const MAX_PATH: usize = 2048;

/// One admitted request, settled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Unique across the fleet (a UUIDv7): sinks deduplicate on it.
    pub id: String,
    /// When the request was settled, RFC 3339, UTC, milliseconds.
    pub time: String,
    /// The instance that admitted it.
    pub instance: String,
    /// The credential's tenant (null on a route without authentication).
    pub tenant: Option<String>,
    /// The credential id.
    pub credential: Option<String>,
    /// The credential's plan, if it has one.
    pub plan: Option<String>,
    /// The route class.
    pub route: String,
    /// The request method.
    pub method: String,
    /// The host it named, lower-case, without its port.
    pub host: Option<String>,
    /// The normalized path, without the query string.
    pub path: String,
    /// The client's network as limits key it.
    pub client: Option<String>,
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
    pub cost_source: String,
    /// The `values` entries of its limits' keys that matched, by limit.
    pub values: std::collections::BTreeMap<String, String>,
    /// The request's trace, 32 hex digits.
    pub trace_id: Option<String>,
}

impl Record {
    /// The record as one line of JSON (no newline inside: JSON escapes
    /// them), with its newline.
    pub fn line(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec(self).unwrap_or_default();
        out.push(b'\n');
        out
    }
}

/// `path`, cut to at most [`MAX_PATH`] bytes.
pub fn bounded_path(path: &str) -> String {
    if path.len() <= MAX_PATH {
        return path.to_owned();
    }
    let mut end = MAX_PATH;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    path[..end].to_owned()
}

/// A new record id: a UUIDv7.
pub fn new_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_one_line_of_json_with_the_contract_s_names() {
        let record = Record {
            id: new_id(),
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
            values: [("model-tokens".to_string(), "gpt-4o".to_string())].into(),
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
    fn ids_are_unique_and_paths_bounded() {
        let ids: std::collections::HashSet<_> = (0..1000).map(|_| new_id()).collect();
        assert_eq!(ids.len(), 1000);
        assert_eq!(bounded_path(&"é".repeat(2000)).len(), MAX_PATH);
        assert_eq!(bounded_path("/v1/x"), "/v1/x");
    }
}
