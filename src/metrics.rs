//! The metrics handle: every series the gateway exports, registered once in
//! its own registry and passed to whoever records. Labels come only from
//! the bounded set (route class, limit name, pool, outcome, result, reason,
//! and the listener: a configured bind address); no tenant, credential,
//! key, client address or path is ever a label.

use std::sync::{Arc, OnceLock};

use crate::ids::{LimitId, RouteId};

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every series the gateway exports, in its own registry.
pub struct Metrics {
    registry: Registry,
    /// `tollgate_requests_total{route,outcome}`.
    pub requests: IntCounterVec,
    /// `tollgate_limit_decisions_total{limit,outcome}`.
    pub limit_decisions: IntCounterVec,
    /// `tollgate_store_call_seconds`: duration of limit store calls.
    pub store_call_seconds: Histogram,
    /// `tollgate_store_errors_total{reason}`: failed store calls.
    pub store_errors: IntCounterVec,
    /// `tollgate_store_circuit_open`: 1 while the store breaker is open.
    pub store_circuit_open: IntGauge,
    /// `tollgate_pool_in_flight{pool}`: requests holding a pool permit.
    pub pool_in_flight: IntGaugeVec,
    /// `tollgate_pool_waiting{pool}`: requests waiting for a permit.
    pub pool_waiting: IntGaugeVec,
    /// `tollgate_pool_rejections_total{pool,priority}`: requests refused by a
    /// saturated pool, by route priority.
    pub pool_rejections: IntCounterVec,
    /// `tollgate_pool_wait_seconds{pool}`: time spent waiting for a permit.
    pub pool_wait_seconds: HistogramVec,
    /// `tollgate_upstream_seconds{route}`: upstream response time.
    pub upstream_seconds: HistogramVec,
    /// `tollgate_upstream_responses_total{route,class}`: what the upstream
    /// answered forwarded requests, by status class (`1xx`-`5xx`), or
    /// `error` when it did not answer (connect or read failure, timeout).
    pub upstream_responses: IntCounterVec,
    /// `tollgate_config_reloads_total{result}`: policy reloads.
    pub config_reloads: IntCounterVec,
    /// `tollgate_config_info{policy_version}`: 1 for the live policy.
    pub config_info: IntGaugeVec,
    /// `tollgate_connections{listener}`: open client connections.
    pub connections: IntGaugeVec,
    /// `tollgate_connections_rejected_total{listener,reason}`: connections an edge
    /// bound refused or closed.
    pub connections_rejected: IntCounterVec,
    /// `tollgate_upstream_retries_total{pool,reason}`: forwarding tries after
    /// the first (`connect`, `reused_connection`).
    pub upstream_retries: IntCounterVec,
    /// `tollgate_build_info{version}`: 1, labelled with the crate version.
    pub build_info: IntGaugeVec,
    /// `tollgate_access_log_dropped_total`: access log lines dropped because
    /// the writer was behind.
    pub access_log_dropped: IntCounter,
    /// `tollgate_cost_reconciled_total{route,direction}`: costs settled after
    /// the response (`charged` more, or `refunded`), and responses that
    /// reported no cost (`missing`: settled at the estimate).
    pub cost_reconciled: IntCounterVec,
    /// `tollgate_admin_actions_total{action,result}`: admin writes (and
    /// refused reads, `read`), by what they asked and how they ended (`ok`,
    /// `rejected`, `refused`, `error`).
    pub admin_actions: IntCounterVec,
    /// `tollgate_revocations_active`: credentials revoked now, as this
    /// instance last read them.
    pub revocations_active: IntGauge,
    /// `tollgate_overrides_active`: tenant overrides in force now, as this
    /// instance last read them.
    pub overrides_active: IntGauge,
    /// `tollgate_cost_uncharged_total{route}`: units of settlements that a
    /// limit did not charge because it was at its deepest debt
    /// (`max_debt`), or that a failing store did not take.
    pub cost_uncharged: IntCounterVec,
    /// `tollgate_lease_units{limit}`: units this instance holds under
    /// `sync: lease`.
    pub lease_units: IntGaugeVec,
    /// `tollgate_auth_failures_total{reason}`: callers refused by
    /// authentication (`missing`, `unknown`, `expired`, `bad_signature`,
    /// `bad_claims`, `revoked`, `unavailable`).
    pub auth_failures: IntCounterVec,
    /// `tollgate_auth_lookups_total{source,result}`: identity lookups by
    /// source (`file`, `store`, `jwt`, `forward`) and result (`hit`: the
    /// source knew the caller, `miss`: it did not, `cached`: answered from
    /// the cache, `error`: the source could not answer).
    pub auth_lookups: AuthLookups,
    /// `tollgate_forward_auth_seconds`: calls to the forward-auth service.
    pub forward_auth_seconds: Histogram,
    /// `tollgate_lease_calls_total{limit,kind}`: lease store calls (`take`
    /// by a request, `renew` in the background, `return`).
    pub lease_calls: IntCounterVec,
    /// `tollgate_trace_spans_dropped_total`: spans not exported because the
    /// exporter was behind.
    pub trace_spans_dropped: IntCounter,
    /// `tollgate_concurrency_holds{limit}`: holds this instance's requests
    /// keep on concurrency limits.
    pub concurrency_holds: IntGaugeVec,
    /// `tollgate_concurrency_reclaimed_total{limit}`: holds found expired
    /// unrenewed (their instance died or lost the store) and dropped.
    pub concurrency_reclaimed: IntCounterVec,
    /// `tollgate_usage_records_total{sink,result}`: ledger records by sink
    /// and what became of them (`shipped`, `duplicate`: the sink had it
    /// already, `failed`: in a try that failed, counted at each try).
    pub usage_records: IntCounterVec,
    /// `tollgate_usage_spool_bytes`: bytes the ledger's spool holds.
    pub usage_spool_bytes: IntGauge,
    /// `tollgate_usage_lag_seconds{sink}`: age of the oldest record a sink
    /// has not shipped (0 when it has shipped all).
    pub usage_lag: GaugeVec,
    /// `tollgate_usage_dropped_total`: ledger records dropped unshipped
    /// because the spool was full (`on_full: drop`), or torn by a crash.
    pub usage_dropped: IntCounter,
    /// `tollgate_overload_shed_total{reason}`: requests the gateway shed
    /// because it was too busy (`store_pending`, `store_wait`,
    /// `body_buffer`), never a failure of the store.
    pub overload_shed: IntCounterVec,
    /// `tollgate_store_pending`: decisions waiting for a store call.
    pub store_pending: IntGauge,
    /// `tollgate_log_suppressed_total{kind}`: client-caused log lines held
    /// back by the log limiter.
    pub log_suppressed: IntCounterVec,
}

/// `tollgate_auth_lookups_total`, every series resolved once (and shown
/// from the start): a lookup is counted on every authenticated request.
pub struct AuthLookups([[IntCounter; 4]; 4]);

impl AuthLookups {
    /// The `source` label values.
    pub const SOURCES: [&'static str; 4] = ["file", "store", "jwt", "forward"];
    /// The `result` label values.
    pub const RESULTS: [&'static str; 4] = ["hit", "miss", "cached", "error"];

    fn new(family: IntCounterVec) -> Self {
        Self(Self::SOURCES.map(|s| Self::RESULTS.map(|r| family.with_label_values(&[s, r]))))
    }

    fn inc(&self, source: &str, result: &str) {
        let s = Self::SOURCES.iter().position(|&x| x == source);
        let r = Self::RESULTS.iter().position(|&x| x == result);
        if let (Some(s), Some(r)) = (s, r) {
            self.0[s][r].inc();
        }
    }
}

/// The `reason` values of `tollgate_overload_shed_total`.
pub const SHED_REASONS: [&str; 3] = ["store_pending", "store_wait", "body_buffer"];

/// `collector`, registered in `registry`: the handle to record with.
fn registered<C>(registry: &Registry, collector: C) -> C
where
    C: prometheus::core::Collector + Clone + 'static,
{
    registry
        .register(Box::new(collector.clone()))
        .expect("registered once");
    collector
}

/// A registered counter without labels.
fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    registered(registry, IntCounter::new(name, help).expect("valid metric"))
}

/// A registered counter family with the given label names.
fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    registered(registry, c)
}

/// A registered gauge without labels.
fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    registered(registry, IntGauge::new(name, help).expect("valid metric"))
}

/// A registered gauge family with the given label names.
fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    registered(registry, g)
}

/// A registered histogram without labels, with the given buckets.
fn histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("valid metric");
    registered(registry, h)
}

/// A registered histogram family with the given label names and buckets.
fn histogram_vec(
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
    registered(registry, h)
}

/// Resolves one series of a one-label family per value, so that each is
/// exported from the start (at zero) and alerts see zeros.
fn export_zeros(family: &IntCounterVec, values: &[&str]) {
    for &value in values {
        family.with_label_values(&[value]);
    }
}

/// Latency buckets from 100 µs to 10 s.
const SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0,
];

/// Buckets of calls to the forward-auth service, from 1 ms to 2.5 s.
const FORWARD_AUTH_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// The families of the edge: requests and how they ended, client
/// connections, and what the gateway shed because it was too busy.
struct EdgeFamilies {
    /// `tollgate_requests_total{route,outcome}`.
    requests: IntCounterVec,
    /// `tollgate_connections{listener}`.
    connections: IntGaugeVec,
    /// `tollgate_connections_rejected_total{listener,reason}`.
    connections_rejected: IntCounterVec,
    /// `tollgate_overload_shed_total{reason}`, every reason at zero.
    overload_shed: IntCounterVec,
}

impl EdgeFamilies {
    /// Registers the edge's families in `r`.
    fn register(r: &Registry) -> Self {
        let overload_shed = counter_vec(
            r,
            "tollgate_overload_shed_total",
            "Requests shed because the gateway itself was overloaded, by reason.",
            &["reason"],
        );
        export_zeros(&overload_shed, &SHED_REASONS);
        Self {
            requests: counter_vec(
                r,
                "tollgate_requests_total",
                "Requests by route class and outcome.",
                &["route", "outcome"],
            ),
            connections: gauge_vec(
                r,
                "tollgate_connections",
                "Open client connections by listener.",
                &["listener"],
            ),
            connections_rejected: counter_vec(
                r,
                "tollgate_connections_rejected_total",
                "Client connections refused or closed by an edge bound, by listener and reason.",
                &["listener", "reason"],
            ),
            overload_shed,
        }
    }
}

/// The families of forwarding: upstream response times, answers and
/// retries.
struct UpstreamFamilies {
    /// `tollgate_upstream_seconds{route}`.
    upstream_seconds: HistogramVec,
    /// `tollgate_upstream_responses_total{route,class}`.
    upstream_responses: IntCounterVec,
    /// `tollgate_upstream_retries_total{pool,reason}`.
    upstream_retries: IntCounterVec,
}

impl UpstreamFamilies {
    /// Registers the forwarding families in `r`.
    fn register(r: &Registry) -> Self {
        Self {
            upstream_seconds: histogram_vec(
                r,
                "tollgate_upstream_seconds",
                "Upstream response time by route class.",
                &["route"],
                SECONDS,
            ),
            upstream_responses: counter_vec(
                r,
                "tollgate_upstream_responses_total",
                "Upstream answers to forwarded requests by route and status class (error: none).",
                &["route", "class"],
            ),
            upstream_retries: counter_vec(
                r,
                "tollgate_upstream_retries_total",
                "Forwarding tries after the first, by pool and reason.",
                &["pool", "reason"],
            ),
        }
    }
}

/// The families of limits: decisions, settled costs, leases and
/// concurrency holds.
struct LimitFamilies {
    /// `tollgate_limit_decisions_total{limit,outcome}`.
    limit_decisions: IntCounterVec,
    /// `tollgate_cost_reconciled_total{route,direction}`.
    cost_reconciled: IntCounterVec,
    /// `tollgate_cost_uncharged_total{route}`.
    cost_uncharged: IntCounterVec,
    /// `tollgate_lease_units{limit}`.
    lease_units: IntGaugeVec,
    /// `tollgate_lease_calls_total{limit,kind}`.
    lease_calls: IntCounterVec,
    /// `tollgate_concurrency_holds{limit}`.
    concurrency_holds: IntGaugeVec,
    /// `tollgate_concurrency_reclaimed_total{limit}`.
    concurrency_reclaimed: IntCounterVec,
}

impl LimitFamilies {
    /// Registers the limits' families in `r`.
    fn register(r: &Registry) -> Self {
        Self {
            limit_decisions: counter_vec(
                r,
                "tollgate_limit_decisions_total",
                "Limit decisions by limit and outcome.",
                &["limit", "outcome"],
            ),
            cost_reconciled: counter_vec(
                r,
                "tollgate_cost_reconciled_total",
                "Costs settled after the response, by route and direction (charged, refunded, missing).",
                &["route", "direction"],
            ),
            cost_uncharged: counter_vec(
                r,
                "tollgate_cost_uncharged_total",
                "Units of settled costs not charged: beyond a limit's max_debt, or lost to a failing store.",
                &["route"],
            ),
            lease_units: gauge_vec(
                r,
                "tollgate_lease_units",
                "Units this instance holds under sync: lease.",
                &["limit"],
            ),
            lease_calls: counter_vec(
                r,
                "tollgate_lease_calls_total",
                "Lease store calls by limit and kind (take, renew, return).",
                &["limit", "kind"],
            ),
            concurrency_holds: gauge_vec(
                r,
                "tollgate_concurrency_holds",
                "Holds this instance's requests keep on concurrency limits, by limit.",
                &["limit"],
            ),
            concurrency_reclaimed: counter_vec(
                r,
                "tollgate_concurrency_reclaimed_total",
                "Holds of concurrency limits found expired unrenewed and dropped, by limit.",
                &["limit"],
            ),
        }
    }
}

/// The families of the limit store: call times, failures, the circuit
/// breaker and the decisions waiting for a call.
struct StoreFamilies {
    /// `tollgate_store_call_seconds`.
    store_call_seconds: Histogram,
    /// `tollgate_store_errors_total{reason}`, every reason at zero.
    store_errors: IntCounterVec,
    /// `tollgate_store_circuit_open`.
    store_circuit_open: IntGauge,
    /// `tollgate_store_pending`.
    store_pending: IntGauge,
}

impl StoreFamilies {
    /// Registers the store's families in `r`.
    fn register(r: &Registry) -> Self {
        let store_errors = counter_vec(
            r,
            "tollgate_store_errors_total",
            "Failed limit store calls by reason.",
            &["reason"],
        );
        export_zeros(
            &store_errors,
            &[
                "timeout",
                "circuit_open",
                "connection",
                "script",
                "reply",
                "refused",
            ],
        );
        Self {
            store_call_seconds: histogram(
                r,
                "tollgate_store_call_seconds",
                "Duration of limit store calls.",
                SECONDS,
            ),
            store_errors,
            store_circuit_open: gauge(
                r,
                "tollgate_store_circuit_open",
                "1 while the store circuit breaker is open.",
            ),
            store_pending: gauge(
                r,
                "tollgate_store_pending",
                "Decisions waiting for a store call (queued or in flight).",
            ),
        }
    }
}

/// The families of authentication: refusals, identity lookups and calls
/// to the forward-auth service.
struct AuthFamilies {
    /// `tollgate_auth_failures_total{reason}`, every reason at zero.
    auth_failures: IntCounterVec,
    /// `tollgate_auth_lookups_total{source,result}`, every series at zero.
    auth_lookups: AuthLookups,
    /// `tollgate_forward_auth_seconds`.
    forward_auth_seconds: Histogram,
}

impl AuthFamilies {
    /// Registers the authentication families in `r`.
    fn register(r: &Registry) -> Self {
        let auth_failures = counter_vec(
            r,
            "tollgate_auth_failures_total",
            "Callers refused by authentication, by reason.",
            &["reason"],
        );
        export_zeros(
            &auth_failures,
            &[
                "missing",
                "unknown",
                "expired",
                "bad_signature",
                "bad_claims",
                "revoked",
                "unavailable",
            ],
        );
        Self {
            auth_failures,
            auth_lookups: AuthLookups::new(counter_vec(
                r,
                "tollgate_auth_lookups_total",
                "Identity lookups by source and result.",
                &["source", "result"],
            )),
            forward_auth_seconds: histogram(
                r,
                "tollgate_forward_auth_seconds",
                "Calls to the forward-auth service, from connect to answer.",
                FORWARD_AUTH_SECONDS,
            ),
        }
    }
}

/// The families of the upstream pools: permits held, waits and refusals.
struct PoolFamilies {
    /// `tollgate_pool_in_flight{pool}`.
    pool_in_flight: IntGaugeVec,
    /// `tollgate_pool_waiting{pool}`.
    pool_waiting: IntGaugeVec,
    /// `tollgate_pool_rejections_total{pool,priority}`.
    pool_rejections: IntCounterVec,
    /// `tollgate_pool_wait_seconds{pool}`.
    pool_wait_seconds: HistogramVec,
}

impl PoolFamilies {
    /// Registers the pools' families in `r`.
    fn register(r: &Registry) -> Self {
        Self {
            pool_in_flight: gauge_vec(
                r,
                "tollgate_pool_in_flight",
                "Requests holding a pool permit.",
                &["pool"],
            ),
            pool_waiting: gauge_vec(
                r,
                "tollgate_pool_waiting",
                "Requests waiting for a pool permit.",
                &["pool"],
            ),
            pool_rejections: counter_vec(
                r,
                "tollgate_pool_rejections_total",
                "Requests refused by a saturated pool.",
                &["pool", "priority"],
            ),
            pool_wait_seconds: histogram_vec(
                r,
                "tollgate_pool_wait_seconds",
                "Time spent waiting for a pool permit.",
                &["pool"],
                SECONDS,
            ),
        }
    }
}

/// The families of the admin API: its actions, and the revocations and
/// overrides its writes put in force.
struct AdminFamilies {
    /// `tollgate_admin_actions_total{action,result}`.
    admin_actions: IntCounterVec,
    /// `tollgate_revocations_active`.
    revocations_active: IntGauge,
    /// `tollgate_overrides_active`.
    overrides_active: IntGauge,
}

impl AdminFamilies {
    /// Registers the admin API's families in `r`.
    fn register(r: &Registry) -> Self {
        Self {
            admin_actions: counter_vec(
                r,
                "tollgate_admin_actions_total",
                "Admin writes and refused reads, by action and result (ok, rejected, refused, error).",
                &["action", "result"],
            ),
            revocations_active: gauge(
                r,
                "tollgate_revocations_active",
                "Credentials revoked now (admin revocations in force), as this instance last read them.",
            ),
            overrides_active: gauge(
                r,
                "tollgate_overrides_active",
                "Tenant overrides in force now, as this instance last read them.",
            ),
        }
    }
}

/// The families of the usage ledger: records shipped or not, the spool,
/// how far each sink lags, and what was dropped.
struct UsageFamilies {
    /// `tollgate_usage_records_total{sink,result}`, every series at zero.
    usage_records: IntCounterVec,
    /// `tollgate_usage_spool_bytes`.
    usage_spool_bytes: IntGauge,
    /// `tollgate_usage_lag_seconds{sink}`, every sink at zero.
    usage_lag: GaugeVec,
    /// `tollgate_usage_dropped_total`.
    usage_dropped: IntCounter,
}

impl UsageFamilies {
    /// Registers the usage ledger's families in `r`.
    fn register(r: &Registry) -> Self {
        let usage_records = counter_vec(
            r,
            "tollgate_usage_records_total",
            "Usage ledger records by sink and result (shipped, duplicate, failed: in a failed try, at each try).",
            &["sink", "result"],
        );
        let usage_lag = GaugeVec::new(
            Opts::new(
                "tollgate_usage_lag_seconds",
                "Age of the oldest usage record a sink has not shipped.",
            ),
            &["sink"],
        )
        .expect("valid metric");
        let usage_lag = registered(r, usage_lag);
        // Known label values are exported from the start, at zero.
        for sink in ["redis_stream", "http"] {
            usage_lag.with_label_values(&[sink]);
            for result in ["shipped", "duplicate", "failed"] {
                usage_records.with_label_values(&[sink, result]);
            }
        }
        Self {
            usage_records,
            usage_spool_bytes: gauge(
                r,
                "tollgate_usage_spool_bytes",
                "Bytes the usage ledger's spool holds.",
            ),
            usage_lag,
            usage_dropped: counter(
                r,
                "tollgate_usage_dropped_total",
                "Usage records dropped unshipped: the spool was full (on_full: drop) or a crash tore them.",
            ),
        }
    }
}

/// The families of configuration: reloads, the live policy and the
/// running build.
struct ConfigFamilies {
    /// `tollgate_config_reloads_total{result}`, both results at zero.
    config_reloads: IntCounterVec,
    /// `tollgate_config_info{policy_version}`.
    config_info: IntGaugeVec,
    /// `tollgate_build_info{version}`.
    build_info: IntGaugeVec,
}

impl ConfigFamilies {
    /// Registers the configuration families in `r`.
    fn register(r: &Registry) -> Self {
        let config_reloads = counter_vec(
            r,
            "tollgate_config_reloads_total",
            "Policy reloads by result.",
            &["result"],
        );
        export_zeros(&config_reloads, &["ok", "error"]);
        Self {
            config_reloads,
            config_info: gauge_vec(
                r,
                "tollgate_config_info",
                "The live policy version (value 1).",
                &["policy_version"],
            ),
            build_info: gauge_vec(
                r,
                "tollgate_build_info",
                "The running build (value 1).",
                &["version"],
            ),
        }
    }
}

/// The families of the gateway's own output: access log lines, trace
/// spans and log lines it dropped or held back.
struct OutputFamilies {
    /// `tollgate_access_log_dropped_total`.
    access_log_dropped: IntCounter,
    /// `tollgate_trace_spans_dropped_total`.
    trace_spans_dropped: IntCounter,
    /// `tollgate_log_suppressed_total{kind}`.
    log_suppressed: IntCounterVec,
}

impl OutputFamilies {
    /// Registers the families of the gateway's own output in `r`.
    fn register(r: &Registry) -> Self {
        Self {
            access_log_dropped: counter(
                r,
                "tollgate_access_log_dropped_total",
                "Access log lines dropped because the writer was behind.",
            ),
            trace_spans_dropped: counter(
                r,
                "tollgate_trace_spans_dropped_total",
                "Spans not exported because the exporter was behind.",
            ),
            log_suppressed: counter_vec(
                r,
                "tollgate_log_suppressed_total",
                "Client-caused log lines held back by the log limiter, by kind.",
                &["kind"],
            ),
        }
    }
}

impl Metrics {
    /// Registers every series in a fresh registry, the process's own
    /// (`process_*`) among them: each area registers its own families.
    pub fn new() -> Self {
        let registry = Registry::new();
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("registered once");
        let edge = EdgeFamilies::register(&registry);
        let upstream = UpstreamFamilies::register(&registry);
        let limits = LimitFamilies::register(&registry);
        let store = StoreFamilies::register(&registry);
        let auth = AuthFamilies::register(&registry);
        let pools = PoolFamilies::register(&registry);
        let admin = AdminFamilies::register(&registry);
        let usage = UsageFamilies::register(&registry);
        let config = ConfigFamilies::register(&registry);
        let output = OutputFamilies::register(&registry);
        Self {
            registry,
            requests: edge.requests,
            connections: edge.connections,
            connections_rejected: edge.connections_rejected,
            overload_shed: edge.overload_shed,
            upstream_seconds: upstream.upstream_seconds,
            upstream_responses: upstream.upstream_responses,
            upstream_retries: upstream.upstream_retries,
            limit_decisions: limits.limit_decisions,
            cost_reconciled: limits.cost_reconciled,
            cost_uncharged: limits.cost_uncharged,
            lease_units: limits.lease_units,
            lease_calls: limits.lease_calls,
            concurrency_holds: limits.concurrency_holds,
            concurrency_reclaimed: limits.concurrency_reclaimed,
            store_call_seconds: store.store_call_seconds,
            store_errors: store.store_errors,
            store_circuit_open: store.store_circuit_open,
            store_pending: store.store_pending,
            auth_failures: auth.auth_failures,
            auth_lookups: auth.auth_lookups,
            forward_auth_seconds: auth.forward_auth_seconds,
            pool_in_flight: pools.pool_in_flight,
            pool_waiting: pools.pool_waiting,
            pool_rejections: pools.pool_rejections,
            pool_wait_seconds: pools.pool_wait_seconds,
            admin_actions: admin.admin_actions,
            revocations_active: admin.revocations_active,
            overrides_active: admin.overrides_active,
            usage_records: usage.usage_records,
            usage_spool_bytes: usage.usage_spool_bytes,
            usage_lag: usage.usage_lag,
            usage_dropped: usage.usage_dropped,
            config_reloads: config.config_reloads,
            config_info: config.config_info,
            build_info: config.build_info,
            access_log_dropped: output.access_log_dropped,
            trace_spans_dropped: output.trace_spans_dropped,
            log_suppressed: output.log_suppressed,
        }
    }

    /// One caller refused by authentication, by `reason`.
    pub fn auth_failure(&self, reason: &str) {
        self.auth_failures.with_label_values(&[reason]).inc();
    }

    /// One identity lookup of `source` (`file`, `store`, `jwt`, `forward`)
    /// with `result` (`hit`, `miss`, `cached`, `error`).
    pub fn auth_lookup(&self, source: &str, result: &str) {
        self.auth_lookups.inc(source, result);
    }

    /// One request shed by the gateway's own overload, by `reason`.
    pub fn overload_shed(&self, reason: &str) {
        self.overload_shed.with_label_values(&[reason]).inc();
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
    (
        $(#[$doc:meta])*
        $name:ident { $($(#[$vdoc:meta])* $variant:ident => $label:literal),+ $(,)? }
    ) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name { $($(#[$vdoc])* $variant),+ }

        impl $name {
            const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $label),+ }
            }
        }
    };
}

outcomes! {
    /// The `outcome` label of `tollgate_requests_total`.
    Outcome {
        /// Admitted (the outcome stays so if forwarding then fails).
        Allowed => "allowed",
        /// Denied by a rate limit (429).
        Limited => "limited",
        /// No valid API key (401).
        Unauthorized => "unauthorized",
        /// Refused by the IP rules (403).
        Forbidden => "forbidden",
        /// No route matched (404).
        NotFound => "not_found",
        /// Malformed, too large or too slow a request (400, 408, 413, 431).
        BadRequest => "bad_request",
        /// The limit store failed and a limit says `closed` (503).
        StoreUnavailable => "store_unavailable",
        /// The forward-auth service could not say who the caller is (503).
        AuthUnavailable => "auth_unavailable",
        /// The usage ledger's spool was full and says `refuse` (503).
        UsageUnavailable => "usage_unavailable",
        /// The gateway itself was too busy to decide in time, or the
        /// upstream pool had no room or no healthy server (503).
        Overloaded => "overloaded",
    }
}

outcomes! {
    /// The `outcome` label of `tollgate_limit_decisions_total`.
    DecisionOutcome {
        /// The limit admitted the cost.
        Allowed => "allowed",
        /// An enforced limit denied.
        Limited => "limited",
        /// A shadow limit would have denied; the request was not refused for it.
        ShadowLimited => "shadow_limited",
        /// The store failed and the limit admitted (`on_store_error: open`).
        FailOpen => "fail_open",
        /// The store failed and the limit refused (`on_store_error: closed`).
        FailClosed => "fail_closed",
        /// The store failed; decided by this instance's share of the budget.
        LocalFallback => "local_fallback",
        /// Admitted after a wait (`on_limit: delay`).
        Delayed => "delayed",
    }
}

/// The `class` values of `tollgate_upstream_responses_total`.
pub const RESPONSE_CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "error"];

/// The labeled series requests touch under one policy, reached by route and
/// limit index instead of by hashing label values on every request. Every
/// one is resolved when the policy loads, so a fresh gateway's `/metrics`
/// already names each series (at zero) that a dashboard or an alert reads.
pub struct PolicyMetrics {
    metrics: Arc<Metrics>,
    /// Route class names, then `unmatched`.
    routes: Vec<Arc<str>>,
    limits: Vec<Arc<str>>,
    requests: Vec<Vec<OnceLock<IntCounter>>>,
    upstream: Vec<OnceLock<Histogram>>,
    responses: Vec<Vec<OnceLock<IntCounter>>>,
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
        let this = Self {
            requests: routes.iter().map(|_| cells(Outcome::ALL.len())).collect(),
            upstream: cells(routes.len()),
            responses: routes
                .iter()
                .map(|_| cells(RESPONSE_CLASSES.len()))
                .collect(),
            decisions: limits
                .iter()
                .map(|_| cells(DecisionOutcome::ALL.len()))
                .collect(),
            metrics,
            routes,
            limits,
        };
        this.export_all();
        this
    }

    /// Resolves every series of the policy, so each is exported from the
    /// start (at zero).
    fn export_all(&self) {
        let m = &self.metrics;
        for (r, route) in self.routes.iter().enumerate() {
            for &outcome in Outcome::ALL {
                self.requests[r][outcome as usize].get_or_init(|| {
                    m.requests
                        .with_label_values(&[route.as_ref(), outcome.as_str()])
                });
            }
            if r + 1 == self.routes.len() {
                // `unmatched` is never forwarded.
                continue;
            }
            self.upstream[r]
                .get_or_init(|| m.upstream_seconds.with_label_values(&[route.as_ref()]));
            m.cost_uncharged.with_label_values(&[route.as_ref()]);
            for direction in ["charged", "refunded", "missing"] {
                m.cost_reconciled
                    .with_label_values(&[route.as_ref(), direction]);
            }
            for (class, name) in RESPONSE_CLASSES.iter().enumerate() {
                self.responses[r][class].get_or_init(|| {
                    m.upstream_responses
                        .with_label_values(&[route.as_ref(), name])
                });
            }
        }
        for (l, limit) in self.limits.iter().enumerate() {
            for &outcome in DecisionOutcome::ALL {
                self.decisions[l][outcome as usize].get_or_init(|| {
                    m.limit_decisions
                        .with_label_values(&[limit.as_ref(), outcome.as_str()])
                });
            }
        }
    }

    fn route(&self, route: Option<RouteId>) -> usize {
        route.map_or(self.routes.len() - 1, |r| {
            r.index().min(self.routes.len() - 1)
        })
    }

    /// One finished request of a route class (`None`: no route matched).
    pub fn request(&self, route: Option<RouteId>, outcome: Outcome) {
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
    pub fn upstream_seconds(&self, route: Option<RouteId>, seconds: f64) {
        let r = self.route(route);
        self.upstream[r]
            .get_or_init(|| {
                self.metrics
                    .upstream_seconds
                    .with_label_values(&[self.routes[r].as_ref()])
            })
            .observe(seconds);
    }

    /// What the upstream answered a request of a route class: its status,
    /// or `None` when it did not answer.
    pub fn upstream_response(&self, route: Option<RouteId>, status: Option<u16>) {
        let r = self.route(route);
        let class = match status {
            Some(s @ 100..=599) => usize::from(s / 100 - 1),
            _ => RESPONSE_CLASSES.len() - 1,
        };
        self.responses[r][class]
            .get_or_init(|| {
                self.metrics
                    .upstream_responses
                    .with_label_values(&[self.routes[r].as_ref(), RESPONSE_CLASSES[class]])
            })
            .inc();
    }

    /// Exports a leased limit's series from the start.
    pub fn export_lease(&self, limit: &str) {
        self.metrics.lease_units.with_label_values(&[limit]);
        for kind in ["take", "renew", "return"] {
            self.metrics.lease_calls.with_label_values(&[limit, kind]);
        }
    }

    /// Exports the series of a concurrency limit from the start.
    pub fn export_concurrency(&self, limit: &str) {
        self.metrics.concurrency_holds.with_label_values(&[limit]);
        self.metrics
            .concurrency_reclaimed
            .with_label_values(&[limit]);
    }

    /// One decision of a limit.
    pub fn decision(&self, limit: LimitId, outcome: DecisionOutcome) {
        let Some(cells) = self.decisions.get(limit.index()) else {
            return;
        };
        cells[outcome as usize]
            .get_or_init(|| {
                self.metrics
                    .limit_decisions
                    .with_label_values(&[self.limits[limit.index()].as_ref(), outcome.as_str()])
            })
            .inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
