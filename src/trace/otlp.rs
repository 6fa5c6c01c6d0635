//! Request spans exported over OTLP/HTTP (`server.tracing`), protobuf
//! encoded with the OpenTelemetry project's own message types.
//!
//! The request path only hands finished spans to a bounded queue; a thread
//! of its own batches them (up to 512 spans, or what a second
//! brings) and posts each batch to the collector. A full queue drops spans
//! (counted in `tollgate_trace_spans_dropped_total`) rather than slow a
//! request; a collector that fails loses its batch, with a warning.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::span::{Link, SpanKind};
use opentelemetry_proto::tonic::trace::v1::{status, ResourceSpans, ScopeSpans, Span, Status};
use prometheus::IntCounter;
use prost::Message;

use super::{CallRef, Exporting, TraceContext};

/// The process's exporter, once `server.tracing` started it: the store's
/// thread exports its calls' spans through it too.
static INSTALLED: OnceLock<Exporter> = OnceLock::new();

/// Starts the exporter of the process (at most once), posting to `to`.
pub fn install(to: &Exporting, dropped: IntCounter) -> std::io::Result<&'static Exporter> {
    if let Some(running) = INSTALLED.get() {
        return Ok(running);
    }
    let exporter = Exporter::start(to, dropped)?;
    Ok(INSTALLED.get_or_init(|| exporter))
}

/// The process's exporter, when one runs.
pub fn installed() -> Option<&'static Exporter> {
    INSTALLED.get()
}

/// A store call being made for at least one sampled request.
#[derive(Debug)]
pub struct CallSpan {
    call: CallRef,
    start: SystemTime,
    requests: usize,
}

impl CallSpan {
    /// A call starting now, deciding `requests` requests.
    pub fn start(requests: usize) -> Self {
        Self {
            call: CallRef {
                trace_id: super::trace_id(),
                span_id: super::span_id(),
            },
            start: crate::clock::wall(),
            requests,
        }
    }

    /// What the requests it served link to.
    pub fn call(&self) -> CallRef {
        self.call
    }

    /// Exports the call, ended now (`error`: why it failed).
    pub fn finish(self, error: Option<&str>) {
        let Some(exporter) = installed() else { return };
        let mut attributes = vec![
            text("db.system", "redis"),
            text("db.operation.name", "decide"),
            int("tollgate.requests", self.requests as i64),
        ];
        if let Some(e) = error {
            attributes.push(text("error.type", e));
        }
        let span = Span {
            trace_id: self.call.trace_id.to_vec(),
            span_id: self.call.span_id.to_vec(),
            flags: 1,
            name: "store call".into(),
            kind: SpanKind::Client as i32,
            start_time_unix_nano: nanos(self.start),
            end_time_unix_nano: nanos(crate::clock::wall()),
            attributes,
            status: error.map(|e| Status {
                message: e.to_owned(),
                code: status::StatusCode::Error as i32,
            }),
            ..Span::default()
        };
        exporter.send(vec![span]);
    }
}

/// Spans waiting for the exporter, at most.
const QUEUE: usize = 8_192;
/// Spans per post, at most.
const BATCH: usize = 512;
/// A post waits this long for the collector, at most.
const POST_TIMEOUT: Duration = Duration::from_secs(5);

/// What one request did, for its spans.
#[derive(Debug, Clone)]
pub struct RequestSpans {
    /// The request's method.
    pub method: String,
    /// Its route class (`unmatched` when none).
    pub route: String,
    /// The response status (0: none was written).
    pub status: u16,
    /// `tollgate_requests_total`'s outcome.
    pub outcome: Option<&'static str>,
    /// The limits that refused it.
    pub violated: Vec<String>,
    /// From the request's head to the end of its response.
    pub request: (SystemTime, SystemTime),
    /// The decision of its limits, when one was made.
    pub decision: Option<(SystemTime, SystemTime)>,
    /// The store calls that made the decision.
    pub store_calls: Vec<CallRef>,
    /// Its time with the upstream, when it was forwarded.
    pub upstream: Option<(SystemTime, SystemTime, String)>,
}

/// Hands finished spans to the exporter thread.
pub struct Exporter {
    tx: SyncSender<Vec<Span>>,
    dropped: IntCounter,
}

impl Exporter {
    /// Starts the thread that posts spans to `to`.
    fn start(to: &Exporting, dropped: IntCounter) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let url = to.url.clone();
        std::thread::Builder::new()
            .name("tollgate-otlp".into())
            .spawn(move || post_batches(&url, &rx))?;
        Ok(Self { tx, dropped })
    }

    /// Exports the spans of one sampled request: the request (a server
    /// span, the child of the caller's span when a trusted proxy named
    /// one), and its decision and upstream as its children.
    pub fn export(&self, trace: &TraceContext, r: &RequestSpans) {
        self.send(spans(trace, r));
    }

    /// Queues spans, or counts them dropped when the queue is full.
    fn send(&self, spans: Vec<Span>) {
        let n = spans.len() as u64;
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(spans)
        {
            self.dropped.inc_by(n);
        }
    }
}

/// The spans of one request.
fn spans(trace: &TraceContext, r: &RequestSpans) -> Vec<Span> {
    let trace_id = trace.trace_id.to_vec();
    let flags = u32::from(trace.sampled);
    let child = |name: &str, kind: SpanKind, (start, end): (SystemTime, SystemTime)| Span {
        trace_id: trace_id.clone(),
        span_id: super::span_id().to_vec(),
        parent_span_id: trace.span_id.to_vec(),
        flags,
        name: name.to_owned(),
        kind: kind as i32,
        start_time_unix_nano: nanos(start),
        end_time_unix_nano: nanos(end),
        ..Span::default()
    };
    let mut attributes = vec![
        text("http.request.method", &r.method),
        text("http.route", &r.route),
        int("http.response.status_code", i64::from(r.status)),
    ];
    if let Some(outcome) = r.outcome {
        attributes.push(text("tollgate.outcome", outcome));
    }
    if !r.violated.is_empty() {
        attributes.push(text("tollgate.violated", &r.violated.join(",")));
    }
    let mut out = vec![Span {
        trace_id: trace_id.clone(),
        span_id: trace.span_id.to_vec(),
        parent_span_id: trace.parent_id.map(|p| p.to_vec()).unwrap_or_default(),
        flags,
        name: format!("{} {}", r.method, r.route),
        kind: SpanKind::Server as i32,
        start_time_unix_nano: nanos(r.request.0),
        end_time_unix_nano: nanos(r.request.1),
        attributes,
        ..Span::default()
    }];
    if let Some(times) = r.decision {
        let mut decide = child("decide limits", SpanKind::Internal, times);
        decide.attributes.push(text("http.route", &r.route));
        // The batched store calls that decided it, each a span of its own
        // trace (one call serves requests of many traces).
        decide.links = r
            .store_calls
            .iter()
            .map(|c| Link {
                trace_id: c.trace_id.to_vec(),
                span_id: c.span_id.to_vec(),
                flags: 1,
                ..Link::default()
            })
            .collect();
        if !r.violated.is_empty() {
            decide
                .attributes
                .push(text("tollgate.violated", &r.violated.join(",")));
        }
        out.push(decide);
    }
    if let Some((start, end, server)) = &r.upstream {
        let mut upstream = child("upstream", SpanKind::Client, (*start, *end));
        upstream.attributes.push(text("server.address", server));
        out.push(upstream);
    }
    out
}

/// The body of one post: `spans` from this service.
fn request_of(spans: Vec<Span>) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![text("service.name", "tollgate")],
                ..Resource::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "tollgate".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..InstrumentationScope::default()
                }),
                spans,
                ..ScopeSpans::default()
            }],
            ..ResourceSpans::default()
        }],
    }
}

/// The exporter thread: collects spans for up to a second (or a full
/// batch) and posts them, until the gateway stops.
fn post_batches(url: &str, rx: &Receiver<Vec<Span>>) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(POST_TIMEOUT))
        .max_redirects(0)
        .http_status_as_error(false)
        .build()
        .into();
    loop {
        let mut batch = match rx.recv() {
            Ok(spans) => spans,
            Err(_) => return,
        };
        let deadline = crate::clock::instant() + Duration::from_secs(1);
        while batch.len() < BATCH {
            let left = deadline.saturating_duration_since(crate::clock::instant());
            match rx.recv_timeout(left) {
                Ok(more) => batch.extend(more),
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let body = request_of(batch).encode_to_vec();
        let sent = agent
            .post(url)
            .header("content-type", "application/x-protobuf")
            .send(&body[..]);
        match sent {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => {
                tracing::warn!(target: crate::logs::STORE, status = r.status().as_u16(), "the trace collector refused spans; they are lost")
            }
            Err(e) => {
                tracing::warn!(target: crate::logs::STORE, error = %e, "the trace collector could not be reached; spans are lost")
            }
        }
    }
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn text(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.into())),
        }),
        ..KeyValue::default()
    }
}

fn int(key: &str, value: i64) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue {
            value: Some(any_value::Value::IntValue(value)),
        }),
        ..KeyValue::default()
    }
}
