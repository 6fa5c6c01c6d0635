//! The metrics handle: every series the gateway exports, registered once in
//! its own registry and passed to whoever records. Labels come only from
//! the bounded set (route class, limit name, pool, outcome, result, reason);
//! no tenant, credential, key, address or path is ever a label.

use std::sync::{Arc, OnceLock};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

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
    pub connections: IntGaugeVec,
    pub connections_rejected: IntCounterVec,
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
            connections: gauge(
                &r,
                "tollgate_connections",
                "Open client connections by listener.",
                &["listener"],
            ),
            connections_rejected: counter(
                &r,
                "tollgate_connections_rejected_total",
                "Client connections refused or closed by an edge bound, by listener and reason.",
                &["listener", "reason"],
            ),
            registry: r,
        }
    }

    /// One failed store call, by its `reason` label.
    pub fn store_error(&self, reason: &str) {
        self.store_errors.with_label_values(&[reason]).inc();
    }

    /// The text exposition of every series.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for well-formed families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

/// Declares an outcome label: its values, in order, as an enum.
macro_rules! outcomes {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $label:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name { $($variant),+ }

        impl $name {
            const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $label),+ }
            }
        }
    };
}

outcomes! {
    /// The `outcome` label of `tollgate_requests_total`.
    Outcome {
        Allowed => "allowed",
        Limited => "limited",
        Unauthorized => "unauthorized",
        Forbidden => "forbidden",
        NotFound => "not_found",
        BadRequest => "bad_request",
        StoreUnavailable => "store_unavailable",
        Overloaded => "overloaded",
    }
}

outcomes! {
    /// The `outcome` label of `tollgate_limit_decisions_total`.
    DecisionOutcome {
        Allowed => "allowed",
        Limited => "limited",
        ShadowLimited => "shadow_limited",
        FailOpen => "fail_open",
        FailClosed => "fail_closed",
        LocalFallback => "local_fallback",
    }
}

/// The labeled series requests touch under one policy, reached by route and
/// limit index instead of by hashing label values on every request. Each
/// is resolved on first use, so the exposition still shows only series that
/// have happened.
pub struct PolicyMetrics {
    metrics: Arc<Metrics>,
    /// Route class names, then `unmatched`.
    routes: Vec<Arc<str>>,
    limits: Vec<Arc<str>>,
    requests: Vec<Vec<OnceLock<IntCounter>>>,
    upstream: Vec<OnceLock<Histogram>>,
    decisions: Vec<Vec<OnceLock<IntCounter>>>,
}

fn cells<T>(n: usize) -> Vec<OnceLock<T>> {
    (0..n).map(|_| OnceLock::new()).collect()
}

impl PolicyMetrics {
    /// The series of a policy's route classes and limits, in the policy's
    /// order (their indices are the policy's route and limit ids).
    pub fn new(metrics: Arc<Metrics>, mut routes: Vec<Arc<str>>, limits: Vec<Arc<str>>) -> Self {
        routes.push("unmatched".into());
        Self {
            requests: routes.iter().map(|_| cells(Outcome::ALL.len())).collect(),
            upstream: cells(routes.len()),
            decisions: limits
                .iter()
                .map(|_| cells(DecisionOutcome::ALL.len()))
                .collect(),
            metrics,
            routes,
            limits,
        }
    }

    fn route(&self, route: Option<usize>) -> usize {
        route.map_or(self.routes.len() - 1, |r| r.min(self.routes.len() - 1))
    }

    /// One finished request of a route class (`None`: no route matched).
    pub fn request(&self, route: Option<usize>, outcome: Outcome) {
        let r = self.route(route);
        self.requests[r][outcome as usize]
            .get_or_init(|| {
                self.metrics
                    .requests
                    .with_label_values(&[self.routes[r].as_ref(), outcome.as_str()])
            })
            .inc();
    }

    /// The upstream response time of a route class.
    pub fn upstream_seconds(&self, route: Option<usize>, seconds: f64) {
        let r = self.route(route);
        self.upstream[r]
            .get_or_init(|| {
                self.metrics
                    .upstream_seconds
                    .with_label_values(&[self.routes[r].as_ref()])
            })
            .observe(seconds);
    }

    /// One decision of a limit.
    pub fn decision(&self, limit: usize, outcome: DecisionOutcome) {
        let Some(cells) = self.decisions.get(limit) else {
            return;
        };
        cells[outcome as usize]
            .get_or_init(|| {
                self.metrics
                    .limit_decisions
                    .with_label_values(&[self.limits[limit].as_ref(), outcome.as_str()])
            })
            .inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
