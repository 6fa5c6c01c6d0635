//! The usage ledger: every admitted request of a recording route written
//! once, durably, where billing and metering read it.
//!
//! A request's [`Record`] is appended to the local [`spool`] when the
//! request is settled (at its end, once a reported cost is known), on the
//! request path: a write to the page cache, never a network call. A
//! thread makes it durable every `fsync_ms`; one thread per sink ships
//! what the spool holds, in order, on connections of its own (outside the
//! limit store's circuit breaker), retrying with backoff capped at 2 s, and
//! moves its cursor only after the sink took a batch. So every record
//! reaches every sink at least once; the Redis stream takes each id once
//! (a `SET NX` of the id beside the `XADD`, in one script), and a
//! CloudEvents receiver deduplicates on the event id. SIGTERM's drain
//! waits for the sinks to catch up within what is left of the drain time
//! and at most [`FLUSH_LIMIT`]; what is left is shipped after the next
//! start.

pub mod record;
pub mod report;
pub mod spool;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::config::{SinkSettings, UsageSettings};
use crate::metrics::Metrics;
pub use record::Record;
use spool::{Lines, Room, Spool};

/// The ledger of a running gateway.
pub struct Ledger {
    spool: Arc<Spool>,
    /// This instance's name in records and events.
    instance: String,
    /// `on_full: refuse`: recording routes reserve room at admission.
    refuse: bool,
    metrics: Arc<Metrics>,
    stopping: Arc<AtomicBool>,
    sinks: usize,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("instance", &self.instance)
            .finish()
    }
}

/// Whether a request can be recorded: room reserved, or none needed.
#[derive(Debug)]
pub enum Slot {
    /// Room was reserved (`on_full: refuse`).
    Reserved(Room),
    /// No room is reserved (`on_full: drop`).
    Unreserved,
}

impl Ledger {
    /// Opens the spool, recovers what a previous process left, and starts
    /// the syncing and shipping threads.
    pub fn start(
        settings: &UsageSettings,
        metrics: Arc<Metrics>,
        instance: String,
    ) -> std::io::Result<Arc<Self>> {
        let spool_settings = &settings.spool;
        let refuse = spool_settings.on_full == crate::config::schema::OnFull::Refuse;
        let (spool, recovered) = Spool::open(
            &spool_settings.path,
            spool_settings.max_bytes,
            !refuse,
            settings.sinks.len(),
        )?;
        if recovered.torn > 0 {
            tracing::warn!(
                torn = recovered.torn,
                spool = %spool_settings.path.display(),
                "a usage record was cut short by a crash and is dropped"
            );
            metrics.usage_dropped.inc_by(recovered.torn);
        }
        if recovered.bytes > 0 {
            tracing::info!(
                bytes = recovered.bytes,
                "the usage spool holds records from before; what the sinks have not taken is shipped"
            );
        }
        let ledger = Arc::new(Self {
            spool,
            instance,
            refuse,
            metrics,
            stopping: Arc::new(AtomicBool::new(false)),
            sinks: settings.sinks.len(),
        });
        let syncer = ledger.clone();
        let every = spool_settings.fsync;
        std::thread::Builder::new()
            .name("usage-spool".into())
            .spawn(move || syncer.keep_synced(every))?;
        for (i, sink) in settings.sinks.iter().enumerate() {
            let shipper = ledger.clone();
            let sink = Sink::new(sink, &ledger.instance);
            std::thread::Builder::new()
                .name(format!("usage-{}", sink.name()))
                .spawn(move || shipper.ship(i, sink))?;
        }
        Ok(ledger)
    }

    /// This instance's name in records.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Room for a recording route's request: `None` when the spool is
    /// full and says `refuse` (503 `usage-unavailable`).
    pub fn slot(&self) -> Option<Slot> {
        if !self.refuse {
            return Some(Slot::Unreserved);
        }
        self.spool.reserve().map(Slot::Reserved)
    }

    /// Appends a settled request's record; `slot`, its reserved room, is
    /// given back once it is written.
    pub fn record(&self, record: &Record<'_>, slot: Slot) {
        // Each worker thread writes its records' lines in a buffer of its
        // own, kept from record to record.
        thread_local! {
            static LINE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let appended = LINE.with_borrow_mut(|line| {
            line.clear();
            record.write_line(line);
            let appended = self.spool.append(line);
            if line.capacity() > 64 << 10 {
                // A record with a long path: not kept for the next.
                *line = Vec::new();
            }
            appended
        });
        if let Err(e) = appended {
            tracing::error!(error = %e, "cannot write a usage record to the spool");
            self.metrics.usage_dropped.inc();
        }
        drop(slot);
    }

    /// Waits, at most `limit`, for every sink to ship what the spool holds
    /// (SIGTERM's drain); what is left is shipped after the next start.
    pub async fn flush(&self, limit: Duration) {
        let _ = self.spool.sync();
        let deadline = crate::clock::instant() + limit;
        while crate::clock::instant() < deadline
            && !(0..self.sinks).all(|i| self.spool.caught_up(i))
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stopping.store(true, Ordering::Release);
        let _ = self.spool.sync();
        let behind: Vec<usize> = (0..self.sinks)
            .filter(|&i| !self.spool.caught_up(i))
            .collect();
        if !behind.is_empty() {
            tracing::warn!(
                sinks = ?behind,
                "usage records are left in the spool: they are shipped after the next start"
            );
        }
    }

    fn keep_synced(&self, every: Duration) {
        let mut dropped = self.spool.dropped();
        loop {
            std::thread::sleep(every);
            if let Err(e) = self.spool.sync() {
                tracing::error!(error = %e, "cannot sync the usage spool");
            }
            self.metrics.usage_spool_bytes.set(self.spool.used() as i64);
            let now = self.spool.dropped();
            self.metrics.usage_dropped.inc_by(now - dropped);
            dropped = now;
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
        }
    }

    /// Ships what the spool holds to `sink` (the `i`th), for ever.
    fn ship(&self, i: usize, mut sink: Sink) {
        let name = sink.name();
        let lag = self.metrics.usage_lag.with_label_values(&[name]);
        let count = |result: &str, n: u64| {
            self.metrics
                .usage_records
                .with_label_values(&[name, result])
                .inc_by(n);
        };
        let mut backoff = BACKOFF_MIN;
        let mut warned = false;
        loop {
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            let mut read = self.spool.read(i, sink.batch(), Duration::from_millis(200));
            if read
                .as_ref()
                .is_ok_and(|(l, _)| !l.is_empty() && l.len() < sink.batch())
            {
                // A few records: more are likely on their way, and a batch
                // costs a sink about as much as one record.
                std::thread::sleep(LINGER);
                read = self.spool.read(i, sink.batch(), Duration::ZERO);
            }
            let (lines, at) = match read {
                Ok(read) => read,
                Err(e) => {
                    tracing::error!(error = %e, sink = name, "cannot read the usage spool");
                    std::thread::sleep(BACKOFF_MAX);
                    continue;
                }
            };
            let Some(first) = lines.first() else {
                lag.set(0.0);
                continue;
            };
            lag.set(age_seconds(first));
            match sink.ship(&lines) {
                Ok(duplicates) => {
                    if let Err(e) = self.spool.advance(i, at) {
                        tracing::error!(error = %e, "cannot write the usage spool's cursor");
                    }
                    count("shipped", lines.len() as u64 - duplicates);
                    count("duplicate", duplicates);
                    if warned {
                        tracing::info!(sink = name, "usage records are shipped again");
                    }
                    backoff = BACKOFF_MIN;
                    warned = false;
                }
                Err(e) => {
                    count("failed", lines.len() as u64);
                    if !warned {
                        tracing::warn!(sink = name, error = %e, "cannot ship usage records; retrying");
                        warned = true;
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }
}

/// How long SIGTERM's drain waits, once requests are drained, for the
/// sinks to ship what the spool holds; what is left is shipped after the
/// next start.
pub const FLUSH_LIMIT: Duration = Duration::from_secs(5);

const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// How long a sink waits for a batch to fill once it has a record.
const LINGER: Duration = Duration::from_millis(100);
/// The longest wait between tries: a sink that comes back is caught up
/// within seconds.
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// How old a record line is, by its `time`.
fn age_seconds(line: &[u8]) -> f64 {
    #[derive(serde::Deserialize)]
    struct Time {
        time: String,
    }
    let Ok(Time { time }) = serde_json::from_slice::<Time>(line) else {
        return 0.0;
    };
    let Ok(at) = humantime::parse_rfc3339(&time) else {
        return 0.0;
    };
    crate::clock::wall()
        .duration_since(at)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What a sink reads of a record line: its id, tenant and time.
#[derive(serde::Deserialize)]
struct Head<'a> {
    #[serde(borrow)]
    id: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    tenant: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    time: std::borrow::Cow<'a, str>,
}

/// The id of a record line: where this gateway writes it (first, a string
/// without escapes), else wherever the JSON has it.
fn id_of(line: &[u8]) -> Option<std::borrow::Cow<'_, str>> {
    let written = member(line, &mut 0, br#"{"id":"#)
        .and_then(|id| id.strip_prefix(b"\"")?.strip_suffix(b"\""))
        .filter(|id| !id.contains(&b'\\'))
        .and_then(|id| std::str::from_utf8(id).ok());
    match written {
        Some(id) => Some(std::borrow::Cow::Borrowed(id)),
        None => serde_json::from_slice::<Head<'_>>(line).ok().map(|h| h.id),
    }
}

/// Where records go.
enum Sink {
    Redis(RedisSink),
    Http(HttpSink),
}

impl Sink {
    fn new(settings: &SinkSettings, instance: &str) -> Self {
        match settings {
            SinkSettings::RedisStream { key, urls, cluster } => Sink::Redis(RedisSink {
                key: key.clone(),
                seen: seen_prefix(key),
                urls: urls.clone(),
                cluster: *cluster,
                conn: None,
            }),
            SinkSettings::Http {
                url,
                batch,
                timeout,
                token_env,
            } => Sink::Http(HttpSink {
                agent: ureq::Agent::config_builder()
                    .timeout_global(Some(*timeout))
                    .max_redirects(0)
                    .http_status_as_error(false)
                    .build()
                    .into(),
                url: url.clone(),
                batch: *batch,
                token: token_env.as_ref().and_then(|name| {
                    let token = std::env::var(name).ok().filter(|t| !t.is_empty());
                    if token.is_none() {
                        tracing::warn!(
                            token_env = %name,
                            "the usage sink's token variable is unset or empty: batches go without one"
                        );
                    }
                    token
                }),
                instance: instance.to_owned(),
            }),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Sink::Redis(_) => "redis_stream",
            Sink::Http(_) => "http",
        }
    }

    fn batch(&self) -> usize {
        match self {
            Sink::Redis(_) => 500,
            Sink::Http(h) => h.batch,
        }
    }

    /// Ships `lines`; the number the sink already had.
    fn ship(&mut self, lines: &Lines) -> Result<u64, ShipError> {
        match self {
            Sink::Redis(r) => r.ship(lines),
            Sink::Http(h) => h.ship(lines),
        }
    }
}

/// Why a sink did not take a batch (it is tried again).
#[derive(Debug, thiserror::Error)]
enum ShipError {
    /// No connection to the Redis stream's server could be made.
    #[error(transparent)]
    Connect(Box<redis::RedisError>),
    /// A line of the spool holds no record id.
    #[error("a spool record without an id")]
    NoId,
    /// The append script failed (the connection is made again).
    #[error(transparent)]
    Append(Box<redis::RedisError>),
    /// A line of the spool is not a record a CloudEvent can be made of.
    #[error(transparent)]
    Event(serde_json::Error),
    /// The batch could not be sent to the HTTP sink, or no answer came.
    #[error(transparent)]
    Send(Box<ureq::Error>),
    /// The HTTP sink answered with a status other than 2xx.
    #[error("the sink answered {status}")]
    Status {
        /// The status it answered.
        status: http::StatusCode,
    },
}

/// Appends each record to the stream once: the script sets the id's key
/// (a day) and appends only if it was not set.
const APPEND_ONCE: &str = r"
local added = 0
for i = 1, #ARGV do
  if redis.call('SET', KEYS[i + 1], '1', 'NX', 'EX', 86400) then
    redis.call('XADD', KEYS[1], '*', 'record', ARGV[i])
    added = added + 1
  end
end
return added
";

struct RedisSink {
    key: String,
    /// What each record's seen key starts with ([`seen_prefix`]).
    seen: String,
    urls: Vec<String>,
    cluster: bool,
    conn: Option<Box<dyn redis::ConnectionLike + Send>>,
}

impl RedisSink {
    fn connect(&self) -> redis::RedisResult<Box<dyn redis::ConnectionLike + Send>> {
        let timeout = Duration::from_secs(2);
        if self.cluster {
            let client = redis::cluster::ClusterClient::builder(self.urls.clone())
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .build()?;
            return Ok(Box::new(client.get_connection()?));
        }
        let client = redis::Client::open(self.urls[0].as_str())?;
        let conn = client.get_connection_with_timeout(timeout)?;
        conn.set_read_timeout(Some(timeout))?;
        conn.set_write_timeout(Some(timeout))?;
        Ok(Box::new(conn))
    }

    fn ship(&mut self, lines: &Lines) -> Result<u64, ShipError> {
        if self.conn.is_none() {
            self.conn = Some(
                self.connect()
                    .map_err(|e| ShipError::Connect(Box::new(e)))?,
            );
        }
        let conn = self.conn.as_mut().expect("connected");
        let script = redis::Script::new(APPEND_ONCE);
        let mut call = script.key(&self.key);
        for line in lines.iter() {
            let id = id_of(line).ok_or(ShipError::NoId)?;
            let mut seen = String::with_capacity(self.seen.len() + id.len());
            seen.push_str(&self.seen);
            seen.push_str(&id);
            call.key(seen).arg(line);
        }
        match call.invoke::<u64>(conn.as_mut()) {
            Ok(added) => Ok(lines.len() as u64 - added),
            Err(e) => {
                // A broken connection is made again for the next try.
                self.conn = None;
                Err(ShipError::Append(Box::new(e)))
            }
        }
    }
}

/// The key that marks record `id` as appended to `stream`: in the
/// stream's hash slot on a cluster (under its hash tag, or the stream's
/// whole name as one).
pub fn seen_key(stream: &str, id: &str) -> String {
    seen_prefix(stream) + id
}

/// What the seen keys of `stream`'s records start with, their id after.
fn seen_prefix(stream: &str) -> String {
    let tagged = stream
        .find('{')
        .and_then(|open| stream[open + 1..].find('}').map(|len| len > 0))
        .unwrap_or(false);
    if tagged {
        format!("{stream}:seen:")
    } else {
        format!("{{{stream}}}:seen:")
    }
}

struct HttpSink {
    agent: ureq::Agent,
    url: String,
    batch: usize,
    token: Option<String>,
    instance: String,
}

impl HttpSink {
    fn ship(&mut self, lines: &Lines) -> Result<u64, ShipError> {
        let mut body = Vec::with_capacity(lines.bytes() + lines.len() * 200);
        body.push(b'[');
        for line in lines.iter() {
            if body.len() > 1 {
                body.push(b',');
            }
            cloud_event(&mut body, line, &self.instance).map_err(ShipError::Event)?;
        }
        body.push(b']');
        let mut request = self
            .agent
            .post(&self.url)
            .header("content-type", "application/cloudevents-batch+json");
        if let Some(token) = &self.token {
            request = request.header("authorization", &format!("Bearer {token}"));
        }
        let response = request
            .send(&body[..])
            .map_err(|e| ShipError::Send(Box::new(e)))?;
        let status = response.status();
        if status.is_success() {
            Ok(0)
        } else {
            Err(ShipError::Status { status })
        }
    }
}

/// Writes a record `line` as a CloudEvent 1.0 (structured, for a batch):
/// its id, this instance as the source, its tenant as the subject (left
/// out when it has none), its time, and the record itself as the data,
/// copied as it is.
pub fn cloud_event(out: &mut Vec<u8>, line: &[u8], instance: &str) -> serde_json::Result<()> {
    // The id, tenant and time as JSON, copied from where this gateway
    // writes them; a line laid out otherwise is parsed.
    let parsed;
    let (id, tenant, time) = match written_head(line) {
        Some(head) => head,
        None => {
            let head: Head<'_> = serde_json::from_slice(line)?;
            parsed = (
                serde_json::to_vec(&head.id)?,
                head.tenant.as_ref().map(serde_json::to_vec).transpose()?,
                serde_json::to_vec(&head.time)?,
            );
            (&parsed.0[..], parsed.1.as_deref(), &parsed.2[..])
        }
    };
    out.extend_from_slice(br#"{"specversion":"1.0","id":"#);
    out.extend_from_slice(id);
    out.extend_from_slice(br#","source":"#);
    serde_json::to_writer(&mut *out, instance)?;
    out.extend_from_slice(br#","type":"tollgate.request""#);
    if let Some(tenant) = tenant {
        out.extend_from_slice(br#","subject":"#);
        out.extend_from_slice(tenant);
    }
    out.extend_from_slice(br#","time":"#);
    out.extend_from_slice(time);
    out.extend_from_slice(br#","datacontenttype":"application/json","data":"#);
    out.extend_from_slice(line);
    out.push(b'}');
    Ok(())
}

/// A record's id, tenant (`None` when null) and time, as JSON strings.
type JsonHead<'a> = (&'a [u8], Option<&'a [u8]>, &'a [u8]);

/// A record line's id, tenant (`None` when null) and time, each as the
/// JSON string it is written as, read where this gateway writes them (the
/// record's first four members: `id`, `time`, `instance`, `tenant`);
/// `None` for a line laid out otherwise.
fn written_head(line: &[u8]) -> Option<JsonHead<'_>> {
    let mut at = 0;
    let id = member(line, &mut at, br#"{"id":"#)?;
    let time = member(line, &mut at, br#","time":"#)?;
    member(line, &mut at, br#","instance":"#)?;
    let tenant = member(line, &mut at, br#","tenant":"#)?;
    let string = |v: &[u8]| v.first() == Some(&b'"');
    if !string(id) || !string(time) {
        return None;
    }
    Some((id, Some(tenant).filter(|t| string(t)), time))
}

/// The value after `name` (the member's name with what comes before it,
/// as the gateway writes it) at `at` of `line`: a JSON string or `null`,
/// as written; `at` moves past it. `None` when `line` has no such member
/// there.
fn member<'a>(line: &'a [u8], at: &mut usize, name: &[u8]) -> Option<&'a [u8]> {
    let rest = line.get(*at..)?.strip_prefix(name)?;
    let len = if rest.starts_with(b"null") {
        4
    } else {
        json_string_len(rest)?
    };
    *at += name.len() + len;
    Some(&rest[..len])
}

/// The length of the JSON string `bytes` starts with, its quotes and
/// escapes included; `None` when it does not start with one, or it does
/// not end.
fn json_string_len(bytes: &[u8]) -> Option<usize> {
    if bytes.first() != Some(&b'"') {
        return None;
    }
    let mut at = 1;
    loop {
        at += memchr::memchr2(b'"', b'\\', &bytes[at..])?;
        if bytes[at] == b'"' {
            return Some(at + 1);
        }
        // An escape: the byte after the backslash is never the end.
        at += 2;
        if at > bytes.len() {
            return None;
        }
    }
}

/// This instance's name: `TOLLGATE_INSTANCE`, else the host's name.
pub fn instance_name() -> String {
    std::env::var("TOLLGATE_INSTANCE")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "tollgate".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seen_keys_share_the_stream_s_slot() {
        assert_eq!(seen_key("tollgate:usage", "x"), "{tollgate:usage}:seen:x");
        assert_eq!(seen_key("{bill}:usage", "x"), "{bill}:usage:seen:x");
        assert_eq!(seen_key("a{}b", "x"), "{a{}b}:seen:x");
        let slot = crate::limits::redis::cluster::slot;
        assert_eq!(
            slot("tollgate:usage"),
            slot(&seen_key("tollgate:usage", "x"))
        );
        assert_eq!(slot("{bill}:usage"), slot(&seen_key("{bill}:usage", "x")));
    }

    /// A record of a `GET /`, at `time`, by `instance`, for `tenant`.
    fn a_record(
        time: &'static str,
        instance: &'static str,
        tenant: Option<&'static str>,
    ) -> Record<'static> {
        Record {
            id: record::new_id(&mut [0; 36]).to_owned().into(),
            time: time.into(),
            instance: instance.into(),
            tenant: tenant.map(Into::into),
            credential: None,
            plan: None,
            route: "r".into(),
            method: "GET".into(),
            host: None,
            path: "/".into(),
            client: None,
            status: 200,
            cost_admitted: 1,
            cost_settled: 1,
            cost_source: "route".into(),
            values: Default::default(),
            trace_id: None,
        }
    }

    #[test]
    fn a_record_s_id_is_read_where_it_is_written_or_wherever_it_is() {
        let record = a_record("t", "i", None);
        let line = record.line();
        assert_eq!(id_of(&line).as_deref(), Some(&*record.id));
        assert_eq!(id_of(br#"{"time":"t","id":"x1"}"#).as_deref(), Some("x1"));
        assert_eq!(
            id_of(br#"{"id":"\u0078","time":"t"}"#).as_deref(),
            Some("x")
        );
        assert_eq!(id_of(b"{}"), None);
    }

    #[test]
    fn an_event_reads_a_written_record_where_it_was_written_as_a_parser_would() {
        let mut record = a_record(
            "2026-12-03T00:00:00.000Z",
            "gw \"1\"\\",
            Some("ac\"me\\\n\u{e9}"),
        );
        for tenant in [record.tenant.clone(), None] {
            record.tenant = tenant;
            let line = record.line();
            let line = &line[..line.len() - 1];
            assert!(written_head(line).is_some(), "read where written");
            let mut fast = Vec::new();
            cloud_event(&mut fast, line, "gw-1").unwrap();
            // The same record, its members in another order: parsed.
            let reordered: serde_json::Value = serde_json::from_slice(line).unwrap();
            let reordered = reordered.to_string();
            assert!(written_head(reordered.as_bytes()).is_none());
            let mut parsed = Vec::new();
            cloud_event(&mut parsed, reordered.as_bytes(), "gw-1").unwrap();
            let event = |bytes: &[u8]| {
                let mut v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
                v.as_object_mut().unwrap().remove("data");
                v
            };
            assert_eq!(event(&fast), event(&parsed));
            assert_eq!(event(&fast)["subject"].as_str(), record.tenant.as_deref());
        }
        for broken in [
            &br#"{"id":"x","time":"t","instance":"i"#[..],
            br#"{"id":"x\"#,
            b"{",
        ] {
            assert!(written_head(broken).is_none());
        }
    }

    #[test]
    fn an_event_carries_the_record_under_its_id() {
        let record =
            serde_json::json!({ "id": "r1", "tenant": "acme", "time": "2026-12-03T00:00:00.000Z" });
        let mut out = Vec::new();
        cloud_event(&mut out, record.to_string().as_bytes(), "gw-1").unwrap();
        let event: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(event["id"], "r1");
        assert_eq!(event["specversion"], "1.0");
        assert_eq!(event["source"], "gw-1");
        assert_eq!(event["subject"], "acme");
        assert_eq!(event["type"], "tollgate.request");
        assert_eq!(event["data"], record);
        // No tenant: no subject (CloudEvents attributes are never null).
        let record = serde_json::json!({ "id": "r2", "tenant": null, "time": "t" });
        let mut out = Vec::new();
        cloud_event(&mut out, record.to_string().as_bytes(), "gw-1").unwrap();
        let event: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert!(event.get("subject").is_none());
    }
}
