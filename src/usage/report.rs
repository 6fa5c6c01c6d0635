//! `tollgate usage tail|summary`: what the ledger's Redis stream holds,
//! for operators.

use std::collections::BTreeMap;

use super::Record;

/// Whether a summary may group records by `field`: one of [`GROUPS`], or
/// `values.LIMIT` (the `values` entry of that limit's key a record matched,
/// such as the model of a per-model token budget).
pub fn groups_by(field: &str) -> bool {
    GROUPS.contains(&field) || field.strip_prefix("values.").is_some_and(|l| !l.is_empty())
}

/// The fields a summary may group records by, beside `values.LIMIT`.
pub const GROUPS: &[&str] = &[
    "tenant",
    "credential",
    "plan",
    "route",
    "method",
    "status",
    "cost_source",
    "instance",
];

/// One group's sums.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Sums {
    /// Records.
    pub requests: u64,
    /// Their `cost_admitted`, summed.
    pub admitted: u64,
    /// Their `cost_settled`, summed.
    pub settled: u64,
}

/// `by`'s fields of a record, as the summary shows them (`-` for none).
fn group_of(record: &Record<'_>, by: &[String]) -> Vec<String> {
    let text = |t: &Option<std::borrow::Cow<'_, str>>| t.as_deref().unwrap_or("-").to_owned();
    by.iter()
        .map(|field| match field.as_str() {
            "tenant" => text(&record.tenant),
            "credential" => text(&record.credential),
            "plan" => text(&record.plan),
            "route" => record.route.to_string(),
            "method" => record.method.to_string(),
            "status" => record.status.to_string(),
            "cost_source" => record.cost_source.to_string(),
            "instance" => record.instance.to_string(),
            other => text(
                &other
                    .strip_prefix("values.")
                    .and_then(|limit| record.values.get(limit).cloned()),
            ),
        })
        .collect()
}

/// `by`'s fields of a record as one JSON object, in `by`'s order, for
/// `tail --by` (`null` for a field the record has none of).
pub fn fields_of(record: &Record<'_>, by: &[String]) -> String {
    let whole = serde_json::to_value(record).unwrap_or_default();
    let fields: Vec<String> = by
        .iter()
        .map(|field| {
            let value = match field.strip_prefix("values.") {
                Some(limit) => whole["values"][limit].clone(),
                None => whole[field.as_str()].clone(),
            };
            format!("{}:{value}", serde_json::Value::from(field.as_str()))
        })
        .collect();
    format!("{{{}}}", fields.join(","))
}

/// Records summed by the fields `by`.
pub fn summarize<'a>(
    records: impl IntoIterator<Item = &'a Record<'a>>,
    by: &[String],
) -> BTreeMap<Vec<String>, Sums> {
    let mut out: BTreeMap<Vec<String>, Sums> = BTreeMap::new();
    for record in records {
        let sums = out.entry(group_of(record, by)).or_default();
        sums.requests += 1;
        sums.admitted = sums.admitted.saturating_add(record.cost_admitted);
        sums.settled = sums.settled.saturating_add(record.cost_settled);
    }
    out
}

/// A summary as a table: one row per group, the most settled cost first.
pub fn table(sums: &BTreeMap<Vec<String>, Sums>, by: &[String]) -> String {
    let mut rows: Vec<Vec<String>> = vec![by
        .iter()
        .cloned()
        .chain([
            "requests".into(),
            "cost_admitted".into(),
            "cost_settled".into(),
        ])
        .collect()];
    let mut groups: Vec<_> = sums.iter().collect();
    groups.sort_by(|a, b| b.1.settled.cmp(&a.1.settled).then(a.0.cmp(b.0)));
    for (group, s) in groups {
        let mut row = group.clone();
        row.extend([
            s.requests.to_string(),
            s.admitted.to_string(),
            s.settled.to_string(),
        ]);
        rows.push(row);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (cell, w))| {
                if i >= by.len() {
                    format!("{cell:>w$}")
                } else {
                    format!("{cell:<w$}")
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The records of a stream's entries (`XRANGE` replies): each entry's
/// `record` field; entries that hold none are skipped.
pub fn records_of(entries: &[(String, Vec<(String, String)>)]) -> Vec<Record<'static>> {
    entries
        .iter()
        .filter_map(|(_, fields)| {
            let (_, json) = fields.iter().find(|(name, _)| name == "record")?;
            serde_json::from_str(json).ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tenant: &str, route: &str, settled: u64) -> Record<'static> {
        Record {
            id: super::super::record::new_id(&mut [0; 36]).to_owned().into(),
            time: "2026-12-03T00:00:00.000Z".into(),
            instance: "gw".into(),
            tenant: Some(tenant.to_owned().into()),
            credential: None,
            plan: None,
            route: route.to_owned().into(),
            method: "GET".into(),
            host: None,
            path: "/".into(),
            client: None,
            status: 200,
            cost_admitted: 10,
            cost_settled: settled,
            cost_source: "reported".into(),
            values: BTreeMap::new(),
            trace_id: None,
        }
    }

    #[test]
    fn records_are_summed_by_the_fields_named() {
        let records = [
            record("acme", "chat", 5),
            record("acme", "chat", 7),
            record("acme", "embed", 1),
            record("globex", "chat", 100),
        ];
        let by = vec!["tenant".to_string(), "route".to_string()];
        let sums = summarize(&records, &by);
        assert_eq!(
            sums[&vec!["acme".to_string(), "chat".to_string()]],
            Sums {
                requests: 2,
                admitted: 20,
                settled: 12
            }
        );
        let by_model = vec!["values.model-tokens".to_string()];
        let mut priced = records[0].clone();
        priced.values.insert("model-tokens".into(), "gpt-4o".into());
        let sums_by_model = summarize([&priced, &records[1]], &by_model);
        assert_eq!(sums_by_model[&vec!["gpt-4o".to_string()]].settled, 5);
        assert_eq!(sums_by_model[&vec!["-".to_string()]].settled, 7);
        assert!(groups_by("values.model-tokens") && groups_by("tenant"));
        let fields = fields_of(
            &priced,
            &["route".into(), "values.model-tokens".into(), "plan".into()],
        );
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&fields).unwrap(),
            serde_json::json!({"route": "chat", "values.model-tokens": "gpt-4o", "plan": null})
        );
        assert!(!groups_by("values.") && !groups_by("tenantt"));
        let text = table(&sums, &by);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0].split_whitespace().collect::<Vec<_>>(),
            [
                "tenant",
                "route",
                "requests",
                "cost_admitted",
                "cost_settled"
            ]
        );
        assert!(
            lines[1].starts_with("globex"),
            "the most settled first: {text}"
        );
        assert_eq!(lines.len(), 4);
    }
}
