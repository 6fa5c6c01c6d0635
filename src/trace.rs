//! W3C Trace Context: each request's `traceparent`, continued when a
//! trusted proxy sent one and started here otherwise, forwarded upstream
//! with this gateway's span as the parent, and written in the access log
//! as `trace_id`.
//!
//! A client that is not a trusted proxy cannot choose the trace its
//! requests join: its `traceparent` is replaced and its `tracestate`
//! dropped, as forwarding headers from it are ignored.

pub mod otlp;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;

use http::HeaderValue;

/// Where request spans go (`server.tracing`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exporting {
    /// The OTLP/HTTP traces endpoint, as configured.
    pub url: String,
    /// Traces started here that are sampled, per million.
    pub sample_ppm: u32,
}

/// The trace a request belongs to, and this gateway's span in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace, 16 bytes, never all zero.
    pub trace_id: [u8; 16],
    /// The span that called this gateway, when a trusted proxy named one.
    pub parent_id: Option<[u8; 8]>,
    /// This gateway's span for the request: the upstream's parent.
    pub span_id: [u8; 8],
    /// Whether the trace is sampled (flag `01`).
    pub sampled: bool,
}

/// A store call's span, which the decisions it served link to: one call
/// decides up to a batch of requests, from several traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallRef {
    /// The call's own trace.
    pub trace_id: [u8; 16],
    /// Its span.
    pub span_id: [u8; 8],
}

tokio::task_local! {
    /// Set around the decision of a sampled request: the store calls that
    /// decided it are noted here, and a call that serves a sampled request
    /// is exported as a span of its own.
    ///
    /// A task-local, not an argument: the calls are made by the store's
    /// batch driver, which serves many requests in one call behind
    /// `LimitStore::decide`; threading a log through that seam would put
    /// tracing into every store and every caller of it (settlement,
    /// operators' resets), for the one caller that traces. What the log
    /// holds is handed back explicitly (`admission::decide` puts it in
    /// the request's `Telemetry`).
    pub static STORE_CALLS: std::cell::RefCell<Vec<CallRef>>;
}

/// Whether the running task decides a sampled request.
pub fn traced() -> bool {
    STORE_CALLS.try_with(|_| ()).is_ok()
}

/// Notes a store call that served the running task's sampled request.
pub fn note_call(call: CallRef) {
    let _ = STORE_CALLS.try_with(|calls| calls.borrow_mut().push(call));
}

/// A new trace id (never zero).
pub fn trace_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&random_u64().to_be_bytes());
    id[8..].copy_from_slice(&random_u64().to_be_bytes());
    id
}

/// Random ids from a per-process random key and a counter: unique, not
/// guessable from outside, and cheap (no system call per request).
static IDS: LazyLock<ahash::RandomState> = LazyLock::new(ahash::RandomState::new);
static COUNTER: AtomicU64 = AtomicU64::new(0);

fn random_u64() -> u64 {
    loop {
        let n = IDS.hash_one(COUNTER.fetch_add(1, Ordering::Relaxed));
        if n != 0 {
            return n;
        }
    }
}

/// A new span id (never zero).
pub fn span_id() -> [u8; 8] {
    random_u64().to_be_bytes()
}

/// What a `traceparent` value says: its trace, its parent span and its
/// flags; `None` when it is not a valid one (W3C Trace Context, level 1:
/// version 00 exactly, a later version read by its first four fields,
/// `ff` refused, all-zero ids refused).
pub fn parse(value: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    if value.len() < 55 || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let version = hex_byte(&value[0..2])?;
    match version {
        0xff => return None,
        0 if value.len() != 55 => return None,
        0 => {}
        // A later version may append fields after a dash.
        _ if value.len() > 55 && value[55] != b'-' => return None,
        _ => {}
    }
    let mut trace_id = [0u8; 16];
    let mut parent_id = [0u8; 8];
    hex_into(&value[3..35], &mut trace_id)?;
    hex_into(&value[36..52], &mut parent_id)?;
    let flags = hex_byte(&value[53..55])?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some((trace_id, parent_id, flags))
}

impl TraceContext {
    /// The request's trace: continued from `traceparent` when the peer is
    /// a trusted proxy and the value is valid, started otherwise (sampled
    /// `sample_ppm` times in a million).
    pub fn of(traceparent: Option<&[u8]>, peer_trusted: bool, sample_ppm: u32) -> Self {
        let continued = traceparent.filter(|_| peer_trusted).and_then(parse);
        match continued {
            Some((trace_id, parent, flags)) => Self {
                trace_id,
                parent_id: Some(parent),
                span_id: span_id(),
                sampled: flags & 1 == 1,
            },
            None => Self {
                trace_id: trace_id(),
                parent_id: None,
                span_id: span_id(),
                sampled: random_u64() % 1_000_000 < u64::from(sample_ppm),
            },
        }
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        hex::encode(self.trace_id)
    }

    /// The `traceparent` the upstream receives: this trace, with this
    /// gateway's span as the parent.
    pub fn header(&self) -> HeaderValue {
        // Written in place: one allocation, no formatting machinery (this
        // runs on every forwarded request).
        let mut text = *b"00-00000000000000000000000000000000-0000000000000000-00";
        hex::encode_to_slice(self.trace_id, &mut text[3..35]).expect("32 digits");
        hex::encode_to_slice(self.span_id, &mut text[36..52]).expect("16 digits");
        text[54] = if self.sampled { b'1' } else { b'0' };
        HeaderValue::from_bytes(&text).expect("hex digits and dashes are a header value")
    }
}

fn hex_byte(two: &[u8]) -> Option<u8> {
    let mut out = [0u8; 1];
    hex_into(two, &mut out)?;
    Some(out[0])
}

/// Lowercase hex only, as the specification writes it.
fn hex_into(text: &[u8], out: &mut [u8]) -> Option<()> {
    if text.iter().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    hex::decode_to_slice(text, out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_read_and_others_are_not() {
        let (trace, parent, flags) = parse(VALID.as_bytes()).unwrap();
        assert_eq!(hex::encode(trace), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex::encode(parent), "00f067aa0ba902b7");
        assert_eq!(flags, 1);
        let later = format!("01{}-extra", &VALID[2..]);
        assert!(
            parse(later.as_bytes()).is_some(),
            "a later version's first fields"
        );
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736x00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ] {
            assert!(parse(bad.as_bytes()).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn only_a_trusted_proxy_continues_a_trace() {
        let trusted = TraceContext::of(Some(VALID.as_bytes()), true, 0);
        assert_eq!(trusted.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(trusted.sampled && trusted.parent_id.is_some());
        assert_ne!(hex::encode(trusted.span_id), "00f067aa0ba902b7");
        let header = trusted.header();
        let text = header.to_str().unwrap();
        assert!(text.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-") && text.ends_with("-01"));
        assert_eq!(parse(text.as_bytes()).unwrap().1, trusted.span_id);

        let untrusted = TraceContext::of(Some(VALID.as_bytes()), false, 0);
        assert_ne!(untrusted.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(!untrusted.sampled && untrusted.parent_id.is_none());
        let header = untrusted.header();
        let (trace, span, flags) = parse(header.as_bytes()).unwrap();
        assert_eq!(
            (trace, span, flags),
            (untrusted.trace_id, untrusted.span_id, 0)
        );
        let started = TraceContext::of(None, true, 1_000_000);
        assert!(started.sampled);
        assert_ne!(started.trace_id, untrusted.trace_id);
    }
}
