//! `tollgate simulate`: what a policy would have done to the traffic of an
//! access log, before it ships.
//!
//! Each line of the log (this gateway's JSON access log, or NGINX's
//! `combined` format with the caller in a named field) is replayed in
//! virtual time, in the in-process store on a clock moved by hand to the
//! line's time: no sleeping, a day of traffic in seconds. A line goes
//! through the planning code the gateway runs (route by method, host and
//! path; the caller by its credential id; costs, plans, all-or-nothing
//! groups) and the verdicts are counted per limit, per route and per
//! tenant, with refusals per minute. Memory grows with the distinct keys
//! and minutes, not with the length of the log.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::io::BufRead;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use crate::admission;
use crate::client_ip::key_network;
use crate::clock::{Clock, ManualClock};
use crate::config::Policy;
use crate::edge::target;
use crate::identity::auth::Credential;
use crate::identity::AuthSource;
use crate::limits::memory::MemoryStore;
use crate::limits::{gate, Charge, Gate};
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
    /// The credential's tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Which source identified the caller (`file`, `jwt`, `forward`,
    /// `store`). Callers of sources the policy holds no list of are
    /// replayed as the line names them: its credential and tenant, no plan.
    #[serde(default)]
    pub auth_source: Option<String>,
    /// The client network as keyed (`203.0.113.7/32`), or a bare address
    /// (keyed here as the policy's `client_ip` would).
    pub client: Option<String>,
    /// The request target as received (`combined` logs), normalized here
    /// as the gateway's edge would; used when `path` is absent.
    #[serde(skip)]
    pub target: Option<String>,
    /// How long the request took, in ms: it started `duration_ms` before
    /// `time`. Concurrency limits are modelled from it.
    #[serde(default)]
    pub duration_ms: Option<f64>,
    /// The values its limits' keys read, by dimension, as digests: a
    /// replay keys each value by its digest, one budget per value as the
    /// gateway had.
    #[serde(default)]
    pub key_values: HashMap<String, String>,
    /// The `values` entries that matched, by limit, in the clear: a
    /// replay gives them their own numbers.
    #[serde(default)]
    pub values: HashMap<String, String>,
}

impl LogLine {
    /// When the request started (ms since the epoch), given that it ended
    /// at `end`: `None` when the line has no duration.
    pub fn start(&self, end: u64) -> Option<u64> {
        let ms = self.duration_ms.filter(|d| d.is_finite() && *d >= 0.0)?;
        Some(end.saturating_sub(ms.round() as u64))
    }
}

/// Holds taken by a replayed request, released when it ended.
#[derive(Debug)]
struct Ending {
    end: u64,
    seq: u64,
    holds: Vec<Charge>,
}

impl PartialEq for Ending {
    fn eq(&self, other: &Self) -> bool {
        (self.end, self.seq) == (other.end, other.seq)
    }
}

impl Eq for Ending {}

impl PartialOrd for Ending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Ending {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.end, self.seq).cmp(&(other.end, other.seq))
    }
}

/// The formats of access logs `simulate` reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// This gateway's JSON lines (`server.access_log`).
    #[default]
    Tollgate,
    /// NGINX's `combined` format, optionally followed by `name=value`
    /// fields (`log_format ... 'key=$http_x_credential'`).
    Combined,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tollgate" => Ok(Self::Tollgate),
            "combined" => Ok(Self::Combined),
            other => Err(format!("unknown log format {other:?} (tollgate, combined)")),
        }
    }
}

/// How the lines of a log are read: their format, and which field names
/// the caller's credential id.
#[derive(Debug, Clone, Default)]
pub struct LogReader {
    /// The format of every line.
    pub format: LogFormat,
    /// The field holding the credential id: a JSON member (default
    /// `credential`), or a `name=value` field after the `combined` ones
    /// (default `$remote_user`).
    pub key_field: Option<String>,
}

impl LogReader {
    /// The request of one line and its time (ms since the epoch), or
    /// `None` when the line cannot be read.
    pub fn parse(&self, line: &str) -> Option<(LogLine, u64)> {
        match self.format {
            LogFormat::Tollgate => self.json(line),
            LogFormat::Combined => self.combined(line),
        }
    }

    fn json(&self, line: &str) -> Option<(LogLine, u64)> {
        let parsed = match &self.key_field {
            None => serde_json::from_str(line).ok()?,
            // Only when asked: the line as a tree, for the named member.
            Some(field) => {
                let value: serde_json::Value = serde_json::from_str(line).ok()?;
                let mut parsed = LogLine::deserialize(&value).ok()?;
                parsed.credential = value.get(field).and_then(|v| v.as_str()).map(str::to_owned);
                parsed
            }
        };
        let at = humantime::parse_rfc3339(&parsed.time).ok()?;
        Some((parsed, epoch_ms(at)))
    }

    /// `$remote_addr - $remote_user [$time_local] "$request" $status
    /// $body_bytes_sent "$http_referer" "$http_user_agent"` and, after
    /// them, any `name=value` or `name="value"` fields.
    fn combined(&self, line: &str) -> Option<(LogLine, u64)> {
        let (addr, rest) = line.split_once(' ')?;
        let (_ident, rest) = rest.split_once(' ')?;
        let (user, rest) = rest.split_once(" [")?;
        let (time, rest) = rest.split_once("] \"")?;
        // NGINX writes a `"` inside a field as `\x22`: the next quote ends it.
        let (request, rest) = rest.split_once('"')?;
        let mut words = request.split(' ');
        let (method, target) = (words.next()?, words.next()?);
        let at = chrono::DateTime::parse_from_str(time, "%d/%b/%Y:%H:%M:%S %z").ok()?;
        let at = u64::try_from(at.timestamp_millis()).ok()?;
        let present = |v: &str| (!v.is_empty() && v != "-").then(|| v.to_owned());
        let credential = match &self.key_field {
            None => present(user),
            Some(name) => fields(rest)
                .find_map(|f| f.strip_prefix(name.as_str())?.strip_prefix('='))
                .and_then(|v| present(v.trim_matches('"'))),
        };
        let line = LogLine {
            time: String::new(),
            method: method.to_owned(),
            host: None,
            path: None,
            credential,
            tenant: None,
            auth_source: None,
            client: Some(addr.to_owned()),
            target: Some(target.to_owned()),
            duration_ms: None,
            key_values: HashMap::new(),
            values: HashMap::new(),
        };
        Some((line, at))
    }
}

/// The space-separated fields of a `combined` line's tail; a quoted part
/// (`"Mozilla/5.0 (X11)"`, `key="a b"`) stays within its field.
fn fields(tail: &str) -> impl Iterator<Item = &str> {
    let mut rest = tail;
    std::iter::from_fn(move || {
        rest = rest.trim_start_matches(' ');
        if rest.is_empty() {
            return None;
        }
        let mut quoted = false;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                if c == '"' {
                    quoted = !quoted;
                }
                c == ' ' && !quoted
            })
            .map_or(rest.len(), |(i, _)| i);
        let (field, tail) = rest.split_at(end);
        rest = tail;
        Some(field)
    })
}

fn epoch_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
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
    /// Refusals per minute, per enforced limit that refused.
    pub limit_minutes: BTreeMap<String, BTreeMap<u64, u64>>,
    /// Refusals per minute, per tenant (authenticated callers only: their
    /// number is bounded by the key table).
    pub tenant_minutes: HashMap<String, BTreeMap<u64, u64>>,
    /// The first and last minute replayed (minutes since the epoch).
    pub span: Option<(u64, u64)>,
    /// Lines replayed, and lines skipped (unreadable, no path, no route).
    pub replayed: u64,
    /// Lines that could not be replayed.
    pub skipped: u64,
    /// Whether the policy has concurrency limits, modelled from each
    /// line's start and end.
    pub models_holds: bool,
    /// Lines replayed without a duration: their holds could not be
    /// modelled (each is taken to end as it starts).
    pub undated: u64,
    /// Holds of replayed requests still running, soonest end first.
    ending: BinaryHeap<Reverse<Ending>>,
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
        let models_holds = policy.limits.iter().any(|l| l.params.is_concurrency());
        Self {
            store: MemoryStore::new(clock.clone()),
            clock,
            models_holds,
            undated: 0,
            ending: BinaryHeap::new(),
            policy,
            credentials,
            limits: BTreeMap::new(),
            routes: BTreeMap::new(),
            callers: HashMap::new(),
            refusals_per_minute: BTreeMap::new(),
            limit_minutes: BTreeMap::new(),
            tenant_minutes: HashMap::new(),
            span: None,
            replayed: 0,
            skipped: 0,
        }
    }

    /// The values a line's limits read, by dimension: digests, and in
    /// place of its digest the listed value a limit keyed by that
    /// dimension alone matched.
    fn named(&self, line: &LogLine) -> HashMap<String, String> {
        let mut named = line.key_values.clone();
        for (limit, value) in &line.values {
            let listed = self.policy.limits.iter().find(|l| *l.name == **limit);
            if let Some([dim]) = listed.map(|l| &*l.values.dims) {
                named.insert(dim.to_string(), value.clone());
            }
        }
        named
    }

    /// Replays one request at `at_ms` (ms since the epoch); the clock never
    /// goes back, so lines slightly out of order are taken at the latest
    /// time seen.
    ///
    /// With concurrency limits, a request is decided at its start
    /// (`time` − `duration_ms`), its holds released at its end, and the
    /// lines should come in order of start ([`run`] re-sorts them).
    pub fn replay(&mut self, line: &LogLine, at_ms: u64) {
        let start = if self.models_holds {
            line.start(at_ms).unwrap_or_else(|| {
                self.undated += 1;
                at_ms
            })
        } else {
            at_ms
        };
        self.clock.set(self.clock.now_ms().max(start));
        let now = self.clock.now_ms();
        self.end_before(now);
        let path = match (&line.path, &line.target) {
            (Some(path), _) => Some(Cow::Borrowed(path.as_str())),
            // A target the edge refuses (400, 404) never reaches a limit.
            (None, Some(raw)) => target::parse(raw.as_bytes(), None, self.policy.server.edge.path)
                .ok()
                .map(|t| t.path),
            (None, None) => None,
        };
        let Some(path) = path else {
            self.skipped += 1;
            return;
        };
        let path = path.as_ref();
        let host = line.host.as_deref().map(request_host);
        let found = self
            .policy
            .routes
            .find_with_template(&line.method, host.as_deref(), path);
        let Some((route, template)) = found else {
            self.skipped += 1;
            return;
        };
        self.replayed += 1;
        let minute = now / 60_000;
        self.span = Some(
            self.span
                .map_or((minute, minute), |(first, _)| (first, minute)),
        );
        let network = line
            .client
            .as_deref()
            .and_then(|c| {
                c.parse().ok().or_else(|| {
                    let ip = c.parse().ok()?;
                    Some(key_network(ip, self.policy.client_ip.ipv6_prefix))
                })
            })
            .unwrap_or_else(|| {
                ipnet::IpNet::from(std::net::IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED))
            });
        let source = line.auth_source.as_deref().and_then(AuthSource::parse);
        let credential = match (line.credential.as_deref(), source) {
            // A caller the policy does not list (a JWT's, forward auth's,
            // the store's) replays as the line names it.
            (Some(id), Some(source)) if !source.listed() => line
                .tenant
                .as_deref()
                .and_then(|tenant| Credential::new(id, tenant, None))
                .map(Arc::new),
            (Some(id), _) => self.credentials.get(id).cloned().or_else(|| {
                // A ledger record names no source: a caller the policy does
                // not list replays as it names it.
                let tenant = line
                    .tenant
                    .as_deref()
                    .filter(|_| line.auth_source.is_none())?;
                Credential::new(id, tenant, None).map(Arc::new)
            }),
            (None, _) => None,
        };
        // A log line has the path, not the headers, query or body: limits
        // keyed by those read the digests of their values, or a listed
        // value's name.
        let headers = http::HeaderMap::new();
        let named = self.named(line);
        let view = crate::key_values::RequestView {
            template: Some(template),
            named: Some(&named),
            ..crate::key_values::RequestView::of_head(&headers, path, None)
        };
        let caller =
            admission::Caller::new(&self.policy, Some(network), credential.as_deref(), None);
        let charged =
            admission::plan::plan(&self.policy, route, &view, &caller, admission::Groups::Both)
                .unwrap_or_else(|refused| admission::Charges {
                    // Refused before any limit is charged, as the gateway refuses
                    // it (a pre-auth key's value it must have): nothing to decide.
                    charges: Vec::new(),
                    authenticated: caller.admitted_on(route),
                    refused: Some(refused),
                    used: Default::default(),
                });
        let verdicts = self.store.decide_now(&charged.charges, Gate::Open).0;
        if self.models_holds {
            let gated = gate(&charged.charges, |i| verdicts[i].allowed, Gate::Open);
            let holds: Vec<Charge> = charged
                .charges
                .iter()
                .zip(&verdicts)
                .filter(|(c, v)| c.hold.is_some() && v.allowed && gated.admits(c.group))
                .map(|(c, _)| c.clone())
                .collect();
            if !holds.is_empty() {
                let seq = self.replayed;
                self.ending.push(Reverse(Ending {
                    end: at_ms.max(now),
                    seq,
                    holds,
                }));
            }
        }
        let cost = route.cost;
        // Concluded exactly as the gateway concludes.
        let plan = admission::Plan::new(route, charged, route.cost);
        let concluded = admission::conclude(
            &plan,
            &verdicts,
            admission::Conclusion::default(),
            &mut admission::Facts::default(),
        );
        let outcome = match concluded {
            Ok(_) => Outcome::Admitted,
            Err(_) => Outcome::Refused,
        };
        let charges = plan.charges;
        for (c, v) in charges.iter().zip(&verdicts) {
            if !v.allowed && c.enforced() {
                *self
                    .limit_minutes
                    .entry(c.name.to_string())
                    .or_default()
                    .entry(minute)
                    .or_default() += 1;
            }
            let limit = match (v.allowed, c.enforced()) {
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
            .any(|(c, v)| !c.enforced() && !v.allowed);
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
            *self.refusals_per_minute.entry(minute).or_default() += 1;
            if let Some(c) = &credential {
                *self
                    .tenant_minutes
                    .entry(c.tenant.to_string())
                    .or_default()
                    .entry(minute)
                    .or_default() += 1;
            }
        }
    }

    /// Releases the holds of the replayed requests that ended by `now`.
    fn end_before(&mut self, now: u64) {
        while self.ending.peek().is_some_and(|e| e.0.end <= now) {
            if let Some(Reverse(done)) = self.ending.pop() {
                self.store.refund(&done.holds, done.end);
            }
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

/// The least span of log (ms) that [`run`] re-sorts by start.
pub const REORDER_MS: u64 = 10_000;

/// Replays every line of `log` (within `[from, to)` when given), read by
/// `reader`, against each simulation, in the log's order; or, when a policy
/// has concurrency limits, in order of the requests' starts.
///
/// A log is written as requests end. Lines wait in a buffer until no line
/// still to come can have started before them: one ending at `e` started
/// no earlier than `e` less the longest duration, taken as the longest seen
/// so far and at least [`REORDER_MS`]. So the buffer holds that much of
/// the log, not all of it; a request longer than both may be replayed
/// later than it started.
pub fn run(
    log: impl BufRead,
    reader: &LogReader,
    sims: &mut [Simulation],
    from: Option<SystemTime>,
    to: Option<SystemTime>,
) -> std::io::Result<()> {
    let (from, to) = (from.map(epoch_ms), to.map(epoch_ms));
    let by_start = sims.iter().any(|s| s.models_holds);
    let mut waiting: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
    let mut lines: HashMap<u64, (LogLine, u64)> = HashMap::new();
    let mut longest = REORDER_MS;
    let mut replayed = 0u64;
    let mut replay = |sims: &mut [Simulation], line: &LogLine, at: u64| {
        for sim in sims.iter_mut() {
            sim.replay(line, at);
            if replayed % 100_000 == 0 {
                sim.sweep();
            }
        }
        replayed += 1;
    };
    for (i, line) in log.lines().enumerate() {
        let line = line?;
        let Some((line, at)) = reader.parse(&line) else {
            sims.iter_mut().for_each(|s| s.skipped += 1);
            continue;
        };
        if from.is_some_and(|f| at < f) || to.is_some_and(|t| at >= t) {
            continue;
        }
        if !by_start {
            replay(sims, &line, at);
            continue;
        }
        let start = line.start(at).unwrap_or(at);
        longest = longest.max(at - start);
        waiting.push(Reverse((start, i as u64)));
        lines.insert(i as u64, (line, at));
        let settled = at.saturating_sub(longest);
        while let Some(&Reverse((start, seq))) = waiting.peek() {
            if start > settled {
                break;
            }
            waiting.pop();
            if let Some((line, at)) = lines.remove(&seq) {
                replay(sims, &line, at);
            }
        }
    }
    while let Some(Reverse((_, seq))) = waiting.pop() {
        if let Some((line, at)) = lines.remove(&seq) {
            replay(sims, &line, at);
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
    if sim.models_holds {
        out.push_str(
            "\nconcurrency limits: each request held from its start (time - duration_ms) to its end (time)\n",
        );
        if sim.undated > 0 {
            out.push_str(&format!(
                "concurrency limits cannot be modelled for {} lines without duration_ms: \
                 each was taken to end as it started, so their holds are not counted\n",
                sim.undated
            ));
        }
    }
    out
}

/// Who gains and who loses from `old` to `new`: callers whose refused
/// cost changed, most changed first.
pub fn difference(old: &Simulation, new: &Simulation, top: usize) -> String {
    let changes = changes(old, new, top);
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

/// The `top` callers whose refused cost changes most from `old` to `new`,
/// with the change (positive: refused more under `new`).
pub fn changes<'a>(old: &'a Simulation, new: &'a Simulation, top: usize) -> Vec<(&'a str, i128)> {
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
    changes
}

pub mod html;

#[cfg(test)]
mod tests;
