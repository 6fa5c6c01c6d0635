//! The access log (`server.access_log`): one JSON object per request, with
//! identities in the clear, so the file is created mode 0600. It is the
//! input of `tollgate simulate`.
//!
//! Lines are written off the request path: a request hands its line to a
//! bounded channel and a writer thread writes them out. When the channel is
//! full the line is dropped and counted (`tollgate_access_log_dropped_total`),
//! never waited for. SIGHUP reopens the file, for log rotation.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus::IntCounter;
use serde::Serialize;

/// Lines waiting for the writer, at most.
const QUEUE: usize = 16_384;

/// Where lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// Standard output.
    Stdout,
    /// This file, appended to (created mode 0600).
    File(PathBuf),
}

/// `server.access_log`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessLogSettings {
    /// Where lines go.
    pub destination: Destination,
    /// One request in this many is logged (`sample` 0.25 → 4).
    pub every: u64,
}

/// One request, as logged. The field names are what log pipelines read
/// (docs/src/operating.md, *Access log*): renaming one breaks them.
#[derive(Debug, Serialize)]
pub struct Line<'a> {
    /// RFC 3339, UTC, milliseconds.
    pub time: String,
    /// The live policy's `policy_version`.
    pub policy_version: &'a str,
    /// The request method.
    pub method: &'a str,
    /// The host the request named, lower-case, without its port.
    pub host: Option<&'a str>,
    /// The normalized path, without the query string.
    pub path: Option<&'a str>,
    /// The route class, or null when no route matched.
    pub route: Option<&'a str>,
    /// The status answered (0 when none was).
    pub status: u16,
    /// The `outcome` label of `tollgate_requests_total`.
    pub outcome: Option<&'a str>,
    /// The credential's tenant, null before authentication.
    pub tenant: Option<&'a str>,
    /// The credential id, null before authentication.
    pub credential: Option<&'a str>,
    /// Which source identified the caller (`file`, `jwt`), null when none.
    pub auth_source: Option<&'a str>,
    /// The client's network as limits key it (`203.0.113.7/32`, an IPv6 /64).
    pub client: Option<String>,
    /// The request's cost.
    pub cost: u64,
    /// The limits that denied it.
    pub violated: Vec<&'a str>,
    /// The upstream server, or null when none was chosen.
    pub upstream: Option<String>,
    /// From the request's head to the end of its response.
    pub duration_ms: f64,
    /// Request body bytes read.
    pub bytes_in: u64,
    /// Response body bytes sent.
    pub bytes_out: u64,
    /// The request's trace (W3C Trace Context), 32 hex digits.
    pub trace_id: Option<String>,
    /// The values its limits' keys read from it (`header.x-end-user`…),
    /// each as a keyed digest of this process, never in the clear;
    /// omitted when none did.
    #[serde(skip_serializing_if = "Vec::is_empty", serialize_with = "as_map")]
    pub key_values: Vec<(String, String)>,
    /// The `values` entries of its limits that matched, by limit, as the
    /// policy names them; omitted when none did.
    #[serde(skip_serializing_if = "Vec::is_empty", serialize_with = "as_map")]
    pub values: Vec<(&'a str, &'a str)>,
}

/// Pairs written as a JSON object.
fn as_map<S: serde::Serializer, K: serde::Serialize, V: serde::Serialize>(
    pairs: &[(K, V)],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(pairs.iter().map(|(k, v)| (k, v)))
}

/// The access log of the process.
pub struct AccessLog {
    tx: SyncSender<Vec<u8>>,
    /// Lines handed to the writer and not yet written out and flushed.
    pending: Arc<AtomicU64>,
    /// Signalled by the writer whenever `pending` falls to zero.
    drained: Arc<tokio::sync::Notify>,
    reopen: Arc<AtomicBool>,
    /// Keep one request in this many (1 = all), by a per-process counter.
    every: u64,
    seen: AtomicU64,
    dropped: IntCounter,
}

impl AccessLog {
    /// Opens the destination (a file is created mode 0600) and starts the
    /// writer thread.
    pub fn open(settings: &AccessLogSettings, dropped: IntCounter) -> std::io::Result<Self> {
        let destination = settings.destination.clone();
        let mut out = Output::open(&destination)?;
        let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(QUEUE);
        let reopen = Arc::new(AtomicBool::new(false));
        let flag = reopen.clone();
        let pending = Arc::new(AtomicU64::new(0));
        let written = pending.clone();
        let drained = Arc::new(tokio::sync::Notify::new());
        let signal = drained.clone();
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || loop {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(line) => {
                        if flag.swap(false, Ordering::AcqRel) {
                            out.reopen(&destination);
                        }
                        out.write(&line);
                        let mut lines = 1;
                        // Write what waits, then flush once it is all out.
                        while let Ok(line) = rx.try_recv() {
                            out.write(&line);
                            lines += 1;
                        }
                        out.flush();
                        if written.fetch_sub(lines, Ordering::AcqRel) == lines {
                            signal.notify_waiters();
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        if flag.swap(false, Ordering::AcqRel) {
                            out.reopen(&destination);
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        out.flush();
                        return;
                    }
                }
            })?;
        Ok(Self {
            tx,
            pending,
            drained,
            reopen,
            every: settings.every.max(1),
            seen: AtomicU64::new(0),
            dropped,
        })
    }

    /// Whether this request is one of the sampled ones.
    pub fn wants(&self) -> bool {
        self.every == 1 || self.seen.fetch_add(1, Ordering::Relaxed) % self.every == 0
    }

    /// Hands a line to the writer, or drops and counts it when the writer is
    /// behind.
    pub fn log(&self, line: &Line<'_>) {
        let mut bytes = Vec::with_capacity(384);
        if serde_json::to_writer(&mut bytes, line).is_err() {
            return;
        }
        bytes.push(b'\n');
        // Counted before the send, so the writer never counts it down first.
        self.pending.fetch_add(1, Ordering::AcqRel);
        match self.tx.try_send(bytes) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.pending.fetch_sub(1, Ordering::AcqRel);
                self.dropped.inc();
            }
        }
    }

    /// Waits, at most `limit`, until every line handed over is written and
    /// flushed (before the process exits).
    pub async fn flush(&self, limit: Duration) {
        let all_out =
            crate::drain::until(&self.drained, || self.pending.load(Ordering::Acquire) == 0);
        let _ = tokio::time::timeout(limit, all_out).await;
    }

    /// Reopens the file before the next line (after a rotation).
    pub fn reopen(&self) {
        self.reopen.store(true, Ordering::Release);
    }
}

/// `2026-12-01T00:00:00.123Z`.
pub fn timestamp(at: SystemTime) -> String {
    time(at).to_string()
}

/// `at` as [`timestamp`] writes it, to be written where it is wanted.
pub fn time(at: SystemTime) -> impl std::fmt::Display {
    humantime::format_rfc3339_millis(at)
}

/// The writer thread's end.
enum Output {
    Stdout(std::io::Stdout),
    File(BufWriter<File>),
}

impl Output {
    fn open(destination: &Destination) -> std::io::Result<Self> {
        Ok(match destination {
            Destination::Stdout => Output::Stdout(std::io::stdout()),
            Destination::File(path) => {
                let mut options = OpenOptions::new();
                options.create(true).append(true);
                #[cfg(unix)]
                std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
                Output::File(BufWriter::new(options.open(path)?))
            }
        })
    }

    fn reopen(&mut self, destination: &Destination) {
        self.flush();
        match Output::open(destination) {
            Ok(out) => *self = out,
            Err(e) => tracing::error!(error = %e, "cannot reopen the access log; writing on"),
        }
    }

    fn write(&mut self, line: &[u8]) {
        let _ = match self {
            Output::Stdout(out) => out.write_all(line),
            Output::File(out) => out.write_all(line),
        };
    }

    fn flush(&mut self) {
        let _ = match self {
            Output::Stdout(out) => out.flush(),
            Output::File(out) => out.flush(),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc_with_milliseconds() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_764_547_200_123);
        assert_eq!(timestamp(at), "2025-12-01T00:00:00.123Z");
    }

    #[test]
    fn lines_go_to_a_private_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.jsonl");
        let metrics = crate::metrics::Metrics::new();
        let settings = AccessLogSettings {
            destination: Destination::File(path.clone()),
            every: 1,
        };
        let log = AccessLog::open(&settings, metrics.access_log_dropped.clone()).unwrap();
        let line = Line {
            time: timestamp(crate::clock::wall()),
            policy_version: "v1",
            method: "GET",
            host: Some("api.test"),
            path: Some("/v1/x"),
            route: Some("api"),
            status: 200,
            outcome: Some("allowed"),
            tenant: Some("acme"),
            credential: Some("c1"),
            auth_source: Some("file"),
            client: Some("203.0.113.7/32".into()),
            cost: 1,
            violated: vec![],
            upstream: Some("127.0.0.1:9000".into()),
            duration_ms: 1.5,
            bytes_in: 0,
            bytes_out: 12,
            trace_id: None,
            key_values: vec![("header.x-end-user".into(), "4f1c2a9b0e3d".into())],
            values: vec![("per-model", "gpt-4o")],
        };
        log.log(&line);
        let written = || std::fs::read_to_string(&path).unwrap_or_default();
        let deadline = crate::clock::instant() + Duration::from_secs(5);
        while written().is_empty() && crate::clock::instant() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let parsed: serde_json::Value = serde_json::from_str(written().trim()).unwrap();
        assert_eq!(parsed["credential"], "c1");
        assert_eq!(parsed["violated"], serde_json::json!([]));
        assert_eq!(
            parsed["key_values"],
            serde_json::json!({ "header.x-end-user": "4f1c2a9b0e3d" })
        );
        assert_eq!(
            parsed["values"],
            serde_json::json!({ "per-model": "gpt-4o" })
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(log.wants());
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let metrics = crate::metrics::Metrics::new();
        let (tx, _rx) = mpsc::sync_channel(2);
        let log = AccessLog {
            tx,
            pending: Arc::default(),
            drained: Arc::default(),
            reopen: Arc::default(),
            every: 1,
            seen: AtomicU64::new(0),
            dropped: metrics.access_log_dropped.clone(),
        };
        let line = Line {
            time: String::new(),
            policy_version: "v1",
            method: "GET",
            host: None,
            path: None,
            route: None,
            status: 404,
            outcome: Some("not_found"),
            tenant: None,
            credential: None,
            auth_source: None,
            client: None,
            cost: 1,
            violated: vec![],
            upstream: None,
            key_values: vec![],
            values: vec![],
            duration_ms: 0.1,
            bytes_in: 0,
            bytes_out: 0,
            trace_id: None,
        };
        for _ in 0..5 {
            log.log(&line);
        }
        assert_eq!(metrics.access_log_dropped.get(), 3);
    }

    #[test]
    fn sampling_keeps_one_in_n() {
        let metrics = crate::metrics::Metrics::new();
        let (tx, _rx) = mpsc::sync_channel(1);
        let log = AccessLog {
            tx,
            pending: Arc::default(),
            drained: Arc::default(),
            reopen: Arc::default(),
            every: 4,
            seen: AtomicU64::new(0),
            dropped: metrics.access_log_dropped.clone(),
        };
        assert_eq!((0..100).filter(|_| log.wants()).count(), 25);
    }
}
