//! The metrics handle: every series the gateway exports, registered once in
//! its own registry and passed to whoever records. Labels come only from
//! the bounded set (route class, limit name, pool, outcome, result, reason);
//! no tenant, credential, key, address or path is ever a label.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::limits::StoreError;

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub limit_decisions: IntCounterVec,
    pub store_call_seconds: Histogram,
    pub store_errors: IntCounterVec,
    pub store_circuit_open: IntGauge,
    pub pool_in_flight: IntGaugeVec,
    pub pool_waiting: IntGaugeVec,
    pub pool_rejections: IntCounterVec,
    pub pool_wait_seconds: HistogramVec,
    pub upstream_seconds: HistogramVec,
    pub config_reloads: IntCounterVec,
    pub config_info: IntGaugeVec,
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry
        .register(Box::new(c.clone()))
        .expect("registered once");
    c
}

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry
        .register(Box::new(g.clone()))
        .expect("registered once");
    g
}

fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> HistogramVec {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("valid metric");
    registry
        .register(Box::new(h.clone()))
        .expect("registered once");
    h
}

/// Latency buckets from 100 µs to 10 s.
const SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0,
];

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let store_call_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "tollgate_store_call_seconds",
                "Duration of limit store calls.",
            )
            .buckets(SECONDS.to_vec()),
        )
        .expect("valid metric");
        r.register(Box::new(store_call_seconds.clone()))
            .expect("registered once");
        let store_circuit_open = IntGauge::new(
            "tollgate_store_circuit_open",
            "1 while the store circuit breaker is open.",
        )
        .expect("valid metric");
        r.register(Box::new(store_circuit_open.clone()))
            .expect("registered once");
        Self {
            requests: counter(
                &r,
                "tollgate_requests_total",
                "Requests by route class and outcome.",
                &["route", "outcome"],
            ),
            limit_decisions: counter(
                &r,
                "tollgate_limit_decisions_total",
                "Limit decisions by limit and outcome.",
                &["limit", "outcome"],
            ),
            store_call_seconds,
            store_errors: counter(
                &r,
                "tollgate_store_errors_total",
                "Failed limit store calls by reason.",
                &["reason"],
            ),
            store_circuit_open,
            pool_in_flight: gauge(
                &r,
                "tollgate_pool_in_flight",
                "Requests holding a pool permit.",
                &["pool"],
            ),
            pool_waiting: gauge(
                &r,
                "tollgate_pool_waiting",
                "Requests waiting for a pool permit.",
                &["pool"],
            ),
            pool_rejections: counter(
                &r,
                "tollgate_pool_rejections_total",
                "Requests refused by a saturated pool.",
                &["pool"],
            ),
            pool_wait_seconds: histogram(
                &r,
                "tollgate_pool_wait_seconds",
                "Time spent waiting for a pool permit.",
                &["pool"],
                SECONDS,
            ),
            upstream_seconds: histogram(
                &r,
                "tollgate_upstream_seconds",
                "Upstream response time by route class.",
                &["route"],
                SECONDS,
            ),
            config_reloads: counter(
                &r,
                "tollgate_config_reloads_total",
                "Policy reloads by result.",
                &["result"],
            ),
            config_info: gauge(
                &r,
                "tollgate_config_info",
                "The live policy version (value 1).",
                &["policy_version"],
            ),
            registry: r,
        }
    }

    pub fn store_error(&self, e: &StoreError) {
        self.store_errors.with_label_values(&[e.reason()]).inc();
    }

    /// The text exposition of every series.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for well-formed families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
