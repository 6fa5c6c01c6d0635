//! Settlement: a request whose cost the response reports (in a header,
//! or its body's usage) was charged an estimate at admission; what the
//! response reported, or the rule for one that never did, settles it.

use std::sync::Arc;

use crate::config::OnAbandon;
use crate::limits::Charge;

/// The charges of an admitted request whose actual cost the response
/// reports: each with the store time it was charged at.
#[derive(Debug, Clone)]
pub struct Reconcile {
    /// Where the actual cost is read, and its bound.
    pub spec: crate::config::CostFromResponse,
    /// The route's cost.
    pub estimate: u64,
    /// What admission charged: the estimate, or `max` (`reserve: max`).
    pub reserved: u64,
    /// The route class, for the metric.
    pub route: Arc<str>,
    /// The charges made, with their store times.
    pub charged: Vec<(Charge, u64)>,
}

impl Reconcile {
    /// The actual cost a response reports in `headers`, at most `max`:
    /// the largest of its values when it reports several (several header
    /// lines, or a list), `max` for a whole number too large to hold, and
    /// the estimate in place of a value that is not a whole number
    /// (negative, fractional, malformed). `None` when the header is absent
    /// or holds no whole number at all (the estimate stands).
    pub fn actual(&self, headers: &http::HeaderMap) -> Option<u64> {
        let mut largest: Option<u64> = None;
        let mut unreadable = false;
        let header = self.spec.source.header()?;
        for value in headers.get_all(header) {
            for item in value.as_bytes().split(|&b| b == b',') {
                match reported_cost(item, self.spec.max) {
                    Reported::Empty => {}
                    Reported::Cost(n) => largest = Some(largest.map_or(n, |l| l.max(n))),
                    Reported::Unreadable => unreadable = true,
                }
            }
        }
        let largest = largest?;
        Some(if unreadable {
            largest.max(self.estimate.min(self.spec.max))
        } else {
            largest
        })
    }

    /// What a response that ended without reporting its cost is settled
    /// at.
    pub fn unreported(&self, end: Unreported) -> u64 {
        let metered = self.metered();
        match (end, self.spec.on_abandon) {
            (Unreported::Abandoned, OnAbandon::Max) => self.spec.max,
            // A body that completes without its usage, or that the upstream
            // breaks off, is charged the most: otherwise a client would
            // hide its usage by asking for none.
            (Unreported::Missing, _) if metered => self.spec.max,
            _ => self.estimate,
        }
    }

    /// Whether the cost is read from the response's body.
    pub fn metered(&self) -> bool {
        matches!(self.spec.source, crate::config::CostSource::Body(_))
    }

    /// A meter for the response's body, when the cost is read from it;
    /// `event_stream` says whether the body is a `text/event-stream`.
    pub fn meter(&self, event_stream: bool) -> Option<crate::limits::meter::Meter> {
        match &self.spec.source {
            crate::config::CostSource::Body(reader) => Some(crate::limits::meter::Meter::new(
                reader.clone(),
                event_stream,
            )),
            crate::config::CostSource::Header(_) => None,
        }
    }

    /// The settlement of a response that cost `settled`: the difference
    /// from what admission charged.
    pub fn delta(&self, settled: u64) -> i64 {
        settled as i64 - self.reserved as i64
    }
}

/// How a response whose cost the upstream reports ended without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreported {
    /// The client went away (connection closed, stream reset) before the
    /// cost arrived, whether or not the upstream had answered yet.
    Abandoned,
    /// The response completed without the header, or the upstream broke
    /// it after its headers: counted as `missing`.
    Missing,
    /// The upstream never answered (the request failed before a response).
    Unanswered,
}

/// One value of a reported cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reported {
    /// Nothing between two commas (a list may have empty items).
    Empty,
    /// A whole number, at most the route's `max`.
    Cost(u64),
    /// Negative, fractional or not a number.
    Unreadable,
}

/// Reads one value of a reported cost: decimal digits, with spaces around
/// them. A number beyond what a `u64` holds is more than any `max`, so it
/// is `max`: an upstream that reports it spent that much is not let off
/// with the estimate.
fn reported_cost(item: &[u8], max: u64) -> Reported {
    if item.trim_ascii().is_empty() {
        return Reported::Empty;
    }
    match crate::config::decimal(item) {
        Some(n) => Reported::Cost(n.map_or(max, |n| n.min(max))),
        None => Reported::Unreadable,
    }
}

#[cfg(test)]
mod reported_costs {
    use super::*;

    fn reconcile() -> Reconcile {
        Reconcile {
            spec: crate::config::CostFromResponse {
                source: crate::config::CostSource::Header(http::HeaderName::from_static(
                    "x-usage-tokens",
                )),
                include_usage: false,
                max: 1000,
                expose: false,
                on_abandon: OnAbandon::Max,
                reserve: crate::config::Reserve::Estimate,
                max_debt: crate::limits::plan::DebtBound {
                    explicit: None,
                    default: 10_000,
                },
            },
            estimate: 10,
            reserved: 10,
            route: "r".into(),
            charged: Vec::new(),
        }
    }

    fn actual(lines: &[&str]) -> Option<u64> {
        let mut headers = http::HeaderMap::new();
        for line in lines {
            headers.append("x-usage-tokens", line.parse().unwrap());
        }
        reconcile().actual(&headers)
    }

    #[test]
    fn one_value_is_read_within_max() {
        assert_eq!(actual(&[]), None);
        assert_eq!(actual(&["42"]), Some(42));
        assert_eq!(actual(&[" 42 "]), Some(42));
        assert_eq!(actual(&["0"]), Some(0));
        assert_eq!(actual(&["5000"]), Some(1000));
        assert_eq!(actual(&["18446744073709551615"]), Some(1000));
    }

    #[test]
    fn a_value_beyond_what_the_gateway_holds_is_max() {
        assert_eq!(actual(&["18446744073709551616"]), Some(1000));
        assert_eq!(actual(&["99999999999999999999999"]), Some(1000));
        assert_eq!(actual(&["7", "99999999999999999999999"]), Some(1000));
    }

    #[test]
    fn several_values_are_the_largest() {
        assert_eq!(actual(&["3", "40"]), Some(40));
        assert_eq!(actual(&["40", "3"]), Some(40));
        assert_eq!(actual(&["3, 40, 7"]), Some(40));
        assert_eq!(actual(&["3,", "", ", 5"]), Some(5));
    }

    #[test]
    fn values_that_are_not_whole_numbers_keep_the_estimate() {
        for value in ["-5", "1.5", "abc", "+3", "0x10", "", ",", "1e3", "5 5"] {
            assert_eq!(actual(&[value]), None, "{value:?}");
        }
        // Beside a whole number, an unreadable value counts as the
        // estimate: the largest of the two is charged.
        assert_eq!(actual(&["3", "abc"]), Some(10));
        assert_eq!(actual(&["30, -1"]), Some(30));
    }
}
