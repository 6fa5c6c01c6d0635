//! The simulation as one self-contained HTML page: refusals over time per
//! limit and per most refused tenant as inline SVG charts, and the tables
//! of the text report. Nothing is fetched when the page opens.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::{Duration, UNIX_EPOCH};

use super::{changes, Simulation, Tally};

/// Chart size, in CSS pixels.
const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 160.0;
const PAD: f64 = 36.0;
/// Points per chart at most; longer spans are summed into wider buckets.
const MAX_POINTS: u64 = 720;

/// The page for the simulations of `names`.
pub fn page(names: &[String], sims: &[Simulation], top: usize) -> String {
    let mut out = String::from(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>tollgate simulate</title><style>\
         body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:940px}\
         h1{font-size:22px}h2{font-size:18px;margin-top:32px}h3{font-size:15px;margin:18px 0 4px}\
         table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #ddd}\
         td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}\
         svg{background:#fafafa;border:1px solid #e4e4e4}.axis{font-size:11px;fill:#666}\
         </style></head><body>\n<h1>What the policy would have done</h1>\n",
    );
    // One time axis for every chart: the span of the log replayed.
    let span = sims
        .iter()
        .filter_map(|s| s.span)
        .reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)));
    if let [old, new] = sims {
        out += &difference(&names[1], &names[0], &changes(old, new, top));
    }
    for (name, sim) in names.iter().zip(sims) {
        let _ = writeln!(
            out,
            "<h2>{}</h2>\n<p>{} requests replayed, {} lines skipped.</p>",
            escape(name),
            sim.replayed,
            sim.skipped
        );
        match span.filter(|_| !sim.refusals_per_minute.is_empty()) {
            Some(span) => {
                out.push_str("<h3>Refused requests per minute, by limit</h3>\n");
                for (limit, series) in &sim.limit_minutes {
                    out += &chart(limit, series, span);
                }
                let mut tenants: Vec<(&String, u64)> = sim
                    .tenant_minutes
                    .iter()
                    .map(|(t, m)| (t, m.values().sum()))
                    .collect();
                tenants.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
                if !tenants.is_empty() {
                    let _ = writeln!(
                        out,
                        "<h3>Refused requests per minute, the {} most refused tenants</h3>",
                        top.min(tenants.len())
                    );
                }
                for (tenant, _) in tenants.into_iter().take(top) {
                    out += &chart(tenant, &sim.tenant_minutes[tenant], span);
                }
            }
            None => out.push_str("<p>No request would have been refused.</p>\n"),
        }
        out += &table(
            "Per limit",
            sim.limits.iter().map(|(k, t)| (k.as_str(), *t)),
        );
        out += &table(
            "Per route",
            sim.routes.iter().map(|(k, t)| (k.as_str(), *t)),
        );
        out += &table("Most refused callers", sim.most_refused(top).into_iter());
    }
    out.push_str("</body></html>\n");
    out
}

/// A line chart of counts per minute over `span` (first and last minute).
fn chart(title: &str, series: &BTreeMap<u64, u64>, span: (u64, u64)) -> String {
    let (first, last) = span;
    // A long log is drawn in buckets of whole minutes so the page stays
    // small: at most MAX_POINTS points per chart.
    let bucket = (last - first) / MAX_POINTS + 1;
    let buckets = (last - first) / bucket + 1;
    let mut counts = vec![0u64; buckets as usize];
    for (&m, &n) in series.range(first..=last) {
        counts[((m - first) / bucket) as usize] += n;
    }
    let peak = counts.iter().copied().max().unwrap_or(0).max(1) as f64;
    let steps = (buckets - 1).max(1) as f64;
    let x = |i: usize| PAD + i as f64 / steps * (WIDTH - 2.0 * PAD);
    let y = |n: u64| HEIGHT - PAD / 2.0 - n as f64 / peak * (HEIGHT - PAD);
    // Every bucket of the span, zero where nothing was refused.
    let mut points = String::new();
    for (i, &n) in counts.iter().enumerate() {
        let _ = write!(points, "{:.1},{:.1} ", x(i), y(n));
    }
    let per = if bucket == 1 {
        "a minute".to_string()
    } else {
        format!("{bucket} minutes")
    };
    let time = |m: u64| {
        humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(m * 60)).to_string()
    };
    format!(
        "<p><b>{}</b>: {} refused, at most {} in {per}</p>\n\
         <svg width=\"{WIDTH}\" height=\"{HEIGHT}\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\">\
         <line x1=\"{PAD}\" y1=\"{base}\" x2=\"{right}\" y2=\"{base}\" stroke=\"#999\"/>\
         <polyline fill=\"none\" stroke=\"#c0392b\" stroke-width=\"1.5\" points=\"{points}\"/>\
         <text class=\"axis\" x=\"{PAD}\" y=\"{label}\">{}</text>\
         <text class=\"axis\" x=\"{right}\" y=\"{label}\" text-anchor=\"end\">{}</text>\
         <text class=\"axis\" x=\"4\" y=\"{top}\">{}</text></svg>\n",
        escape(title),
        series.values().sum::<u64>(),
        peak as u64,
        time(first),
        time(last),
        peak as u64,
        base = HEIGHT - PAD / 2.0,
        right = WIDTH - PAD,
        label = HEIGHT - 4.0,
        top = PAD / 2.0 + 4.0,
    )
}

/// Who gains and who loses from the first policy to the second.
fn difference(new: &str, old: &str, changes: &[(&str, i128)]) -> String {
    let mut out = format!(
        "<h2>Refused cost under {} against {}</h2>\n",
        escape(new),
        escape(old)
    );
    if changes.is_empty() {
        out.push_str("<p>No caller's refusals change.</p>\n");
        return out;
    }
    out.push_str("<table><tr><th>caller</th><th class=n>change</th><th></th></tr>\n");
    for (caller, d) in changes {
        let verdict = if *d > 0 { "loses" } else { "gains" };
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=n>{d:+}</td><td>{verdict}</td></tr>",
            escape(caller)
        );
    }
    out.push_str("</table>\n");
    out
}

fn table<'a>(title: &str, rows: impl Iterator<Item = (&'a str, Tally)>) -> String {
    let mut out = format!(
        "<h3>{title}</h3>\n<table><tr><th></th><th class=n>admitted</th><th class=n>(cost)</th>\
         <th class=n>refused</th><th class=n>(cost)</th><th class=n>flagged</th><th class=n>(cost)</th></tr>\n"
    );
    for (name, t) in rows {
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td>\
             <td class=n>{}</td><td class=n>{}</td><td class=n>{}</td></tr>",
            escape(name),
            t.admitted.0,
            t.admitted.1,
            t.refused.0,
            t.refused.1,
            t.flagged.0,
            t.flagged.1
        );
    }
    out.push_str("</table>\n");
    out
}

/// Text for HTML: tenant names and file names come from the operator's
/// files, never trusted as markup.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_span_is_drawn_in_wider_buckets() {
        // Thirty days of minutes, one refusal at each end.
        let (first, last) = (1_000_000, 1_000_000 + 30 * 24 * 60);
        let series = BTreeMap::from([(first, 1), (last, 2)]);
        let svg = chart("t", &series, (first, last));
        let points = svg
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        let n = points.split_whitespace().count() as u64;
        assert!(n <= MAX_POINTS && n > MAX_POINTS / 2, "{n} points");
        assert!(svg.contains("3 refused, at most 2 in 61 minutes"), "{svg}");
    }
}
