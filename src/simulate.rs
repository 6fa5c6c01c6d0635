//! `tollgate simulate`: what a policy would have done to the traffic of an
//! access log, before it ships.
//!
//! Each line of the log (this gateway's JSON access log) is replayed in
//! virtual time, in the in-process store on a clock moved by hand to the
//! line's time: no sleeping, a day of traffic in seconds. A line goes
//! through the planning code the gateway runs (route by method, host and
//! path; the caller by its credential id; costs, plans, all-or-nothing
//! groups) and the verdicts are counted per limit, per route and per
//! tenant, with refusals per minute. Memory grows with the distinct keys
//! and minutes, not with the length of the log.

use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use crate::admission;
use crate::auth::Credential;
use crate::clock::{Clock, ManualClock};
use crate::config::Policy;
use crate::limits::memory::MemoryStore;
use crate::limits::{combine, Decision, Gate, Group};
use crate::routes::request_host;

/// The fields of an access log line the replay reads.
#[derive(Debug, Deserialize)]
pub struct LogLine {
    /// RFC 3339 time of the request.
    pub time: String,
    /// Request method.
    pub method: String,
    /// Host the request named.
    pub host: Option<String>,
    /// Normalized path; lines without one (refused targets) are skipped.
    pub path: Option<String>,
    /// The credential id, when the request was authenticated.
    pub credential: Option<String>,
    /// The client network as keyed (`203.0.113.7/32`).
    pub client: Option<String>,
}

/// What happened to a set of requests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Requests admitted, and their cost.
    pub admitted: (u64, u64),
    /// Requests refused by an enforced limit (or without a valid key).
    pub refused: (u64, u64),
    /// Requests a shadow limit would have refused.
    pub flagged: (u64, u64),
}

impl Tally {
    fn add(&mut self, which: Outcome, cost: u64) {
        let slot = match which {
            Outcome::Admitted => &mut self.admitted,
            Outcome::Refused => &mut self.refused,
            Outcome::Flagged => &mut self.flagged,
        };
        slot.0 += 1;
        slot.1 += cost;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Admitted,
    Refused,
    Flagged,
}

/// One policy replayed over a log.
pub struct Simulation {
    policy: Policy,
    clock: ManualClock,
    store: MemoryStore<ManualClock>,
    credentials: HashMap<Arc<str>, Arc<Credential>>,
    /// Per limit name, per route class, per tenant (or client network).
    pub limits: BTreeMap<String, Tally>,
    /// Per route class.
    pub routes: BTreeMap<String, Tally>,
    /// Per tenant, or per client network before authentication.
    pub callers: HashMap<String, Tally>,
    /// Refused requests per minute (minutes since the epoch).
    pub refusals_per_minute: BTreeMap<u64, u64>,
    /// Lines replayed, and lines skipped (unreadable, no path, no route).
    pub replayed: u64,
    /// Lines that could not be replayed.
    pub skipped: u64,
}

impl Simulation {
    /// A simulation of `policy`, every limit decided in this process.
    pub fn new(policy: Policy) -> Self {
        let clock = ManualClock::new(0);
        let credentials = policy
            .auth
            .keys
            .credentials()
            .map(|c| (c.id.clone(), c.clone()))
            .collect();
        Self {
            store: MemoryStore::new(clock.clone()),
            clock,
            policy,
            credentials,
            limits: BTreeMap::new(),
            routes: BTreeMap::new(),
            callers: HashMap::new(),
            refusals_per_minute: BTreeMap::new(),
            replayed: 0,
            skipped: 0,
        }
    }

    /// Replays one request at `at_ms` (ms since the epoch); the clock never
    /// goes back, so lines slightly out of order are taken at the latest
    /// time seen.
    pub fn replay(&mut self, line: &LogLine, at_ms: u64) {
        self.clock.set(self.clock.now_ms().max(at_ms));
        let now = self.clock.now_ms();
        let Some(path) = line.path.as_deref() else {
            self.skipped += 1;
            return;
        };
        let host = line.host.as_deref().map(request_host);
        let Some(route) = self.policy.routes.find(&line.method, host.as_deref(), path) else {
            self.skipped += 1;
            return;
        };
        self.replayed += 1;
        let network = line
            .client
            .as_deref()
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| {
                ipnet::IpNet::from(std::net::IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED))
            });
        let credential = line
            .credential
            .as_deref()
            .and_then(|id| self.credentials.get(id))
            .cloned();
        let (charges, authenticated) =
            admission::charges(&self.policy, route, network, credential.as_deref());
        let verdicts = self.store.decide_now(&charges, Gate::Open).0;
        let cost = route.cost;
        let mut outcome = Outcome::Admitted;
        for group in [Group::PreAuth, Group::Request] {
            if outcome != Outcome::Admitted {
                break;
            }
            if group == Group::Request && !authenticated {
                outcome = Outcome::Refused;
                break;
            }
            if let Decision::Deny { .. } | Decision::Unavailable =
                combine(&charges, &verdicts, group)
            {
                outcome = Outcome::Refused;
            }
        }
        for (c, v) in charges.iter().zip(&verdicts) {
            let limit = match (v.allowed, c.enforce) {
                (true, _) => Outcome::Admitted,
                (false, true) => Outcome::Refused,
                (false, false) => Outcome::Flagged,
            };
            self.limits
                .entry(c.name.to_string())
                .or_default()
                .add(limit, c.cost);
        }
        let flagged = charges
            .iter()
            .zip(&verdicts)
            .any(|(c, v)| !c.enforce && !v.allowed);
        let whole = match outcome {
            Outcome::Admitted if flagged => Outcome::Flagged,
            other => other,
        };
        self.routes
            .entry(route.name.to_string())
            .or_default()
            .add(whole, cost);
        let caller = match &credential {
            Some(c) => c.tenant.to_string(),
            None => network.to_string(),
        };
        self.callers.entry(caller).or_default().add(whole, cost);
        if outcome == Outcome::Refused {
            *self.refusals_per_minute.entry(now / 60_000).or_default() += 1;
        }
    }

    /// The minute with the most refusals, and their number.
    pub fn peak_minute(&self) -> Option<(u64, u64)> {
        self.refusals_per_minute
            .iter()
            .max_by_key(|(minute, n)| (**n, std::cmp::Reverse(**minute)))
            .map(|(m, n)| (*m, *n))
    }

    /// The callers with the most refused cost, most first.
    pub fn most_refused(&self, n: usize) -> Vec<(&str, Tally)> {
        let mut all: Vec<(&str, Tally)> = self
            .callers
            .iter()
            .filter(|(_, t)| t.refused.0 > 0)
            .map(|(k, t)| (k.as_str(), *t))
            .collect();
        all.sort_by(|a, b| b.1.refused.1.cmp(&a.1.refused.1).then(a.0.cmp(b.0)));
        all.truncate(n);
        all
    }

    /// Sweeps expired keys, so memory follows live keys only.
    pub fn sweep(&self) {
        self.store.sweep();
    }
}

/// Replays every line of `log` (within `[from, to)` when given) against
/// each simulation, in the log's order.
pub fn run(
    log: impl BufRead,
    sims: &mut [Simulation],
    from: Option<SystemTime>,
    to: Option<SystemTime>,
) -> std::io::Result<()> {
    let ms = |t: SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    let (from, to) = (from.map(ms), to.map(ms));
    for (i, line) in log.lines().enumerate() {
        let line = line?;
        let parsed: Option<(LogLine, u64)> =
            serde_json::from_str::<LogLine>(&line).ok().and_then(|l| {
                let at = humantime::parse_rfc3339(&l.time).ok().map(ms)?;
                Some((l, at))
            });
        let Some((line, at)) = parsed else {
            sims.iter_mut().for_each(|s| s.skipped += 1);
            continue;
        };
        if from.is_some_and(|f| at < f) || to.is_some_and(|t| at >= t) {
            continue;
        }
        for sim in sims.iter_mut() {
            sim.replay(&line, at);
            if i % 100_000 == 0 {
                sim.sweep();
            }
        }
    }
    Ok(())
}

/// The report of one simulation, as text tables.
pub fn report(name: &str, sim: &Simulation, top: usize) -> String {
    let mut out = format!(
        "policy {name}: {} requests replayed, {} lines skipped\n\n",
        sim.replayed, sim.skipped
    );
    let row = |label: &str, t: &Tally| {
        format!(
            "  {label:<28} {:>10} {:>12} {:>10} {:>12} {:>10} {:>12}\n",
            t.admitted.0, t.admitted.1, t.refused.0, t.refused.1, t.flagged.0, t.flagged.1
        )
    };
    let header = format!(
        "  {:<28} {:>10} {:>12} {:>10} {:>12} {:>10} {:>12}\n",
        "", "admitted", "(cost)", "refused", "(cost)", "flagged", "(cost)"
    );
    out.push_str("per limit\n");
    out.push_str(&header);
    for (name, t) in &sim.limits {
        out.push_str(&row(name, t));
    }
    out.push_str("\nper route\n");
    out.push_str(&header);
    for (name, t) in &sim.routes {
        out.push_str(&row(name, t));
    }
    out.push_str(&format!("\nmost refused callers (top {top})\n"));
    out.push_str(&header);
    for (caller, t) in sim.most_refused(top) {
        out.push_str(&row(caller, &t));
    }
    match sim.peak_minute() {
        Some((minute, n)) => {
            let at = UNIX_EPOCH + std::time::Duration::from_secs(minute * 60);
            out.push_str(&format!(
                "\npeak refusal minute: {} ({n} refused)\n",
                humantime::format_rfc3339_seconds(at)
            ));
        }
        None => out.push_str("\nno request would have been refused\n"),
    }
    out
}

/// Who gains and who loses from `old` to `new`: callers whose refused
/// cost changed, most changed first.
pub fn difference(old: &Simulation, new: &Simulation, top: usize) -> String {
    let mut changes: Vec<(&str, i128)> = new
        .callers
        .iter()
        .map(|(k, t)| {
            let before = old.callers.get(k).map_or(0, |o| o.refused.1);
            (k.as_str(), i128::from(t.refused.1) - i128::from(before))
        })
        .chain(
            old.callers
                .iter()
                .filter(|(k, _)| !new.callers.contains_key(*k))
                .map(|(k, t)| (k.as_str(), -i128::from(t.refused.1))),
        )
        .filter(|(_, d)| *d != 0)
        .collect();
    changes.sort_by(|a, b| b.1.abs().cmp(&a.1.abs()).then(a.0.cmp(b.0)));
    changes.truncate(top);
    let mut out = String::from("\nrefused cost, second policy against the first\n");
    if changes.is_empty() {
        out.push_str("  no caller's refusals change\n");
    }
    for (caller, d) in changes {
        let verdict = if d > 0 { "loses" } else { "gains" };
        out.push_str(&format!("  {caller:<28} {d:>+12}  ({verdict})\n"));
    }
    out
}

#[cfg(test)]
mod tests;
