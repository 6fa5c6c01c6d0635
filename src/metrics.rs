//! The metrics handle: every series the gateway exports, registered once in
//! its own registry and passed to whoever records. Labels come only from
//! the bounded set (route class, limit name, pool, outcome, result, reason,
//! and the listener: a configured bind address); no tenant, credential,
//! key, client address or path is ever a label.

use std::sync::{Arc, OnceLock};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
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
    pub usage_lag: prometheus::GaugeVec,
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
    /// Registers every series in a fresh registry, the process's own
    /// (`process_*`) among them.
    pub fn new() -> Self {
        let r = Registry::new();
        #[cfg(target_os = "linux")]
        r.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("registered once");
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
        let access_log_dropped = IntCounter::new(
            "tollgate_access_log_dropped_total",
            "Access log lines dropped because the writer was behind.",
        )
        .expect("valid metric");
        r.register(Box::new(access_log_dropped.clone()))
            .expect("registered once");
        let store_pending = IntGauge::new(
            "tollgate_store_pending",
            "Decisions waiting for a store call (queued or in flight).",
        )
        .expect("valid metric");
        r.register(Box::new(store_pending.clone()))
            .expect("registered once");
        let revocations_active = IntGauge::new(
            "tollgate_revocations_active",
            "Credentials revoked now (admin revocations in force), as this instance last read them.",
        )
        .expect("valid metric");
        r.register(Box::new(revocations_active.clone()))
            .expect("registered once");
        let overrides_active = IntGauge::new(
            "tollgate_overrides_active",
            "Tenant overrides in force now, as this instance last read them.",
        )
        .expect("valid metric");
        r.register(Box::new(overrides_active.clone()))
            .expect("registered once");
        let overload_shed = counter(
            &r,
            "tollgate_overload_shed_total",
            "Requests shed because the gateway itself was overloaded, by reason.",
            &["reason"],
        );
        for reason in SHED_REASONS {
            overload_shed.with_label_values(&[reason]);
        }
        let metrics = Self {
            log_suppressed: counter(
                &r,
                "tollgate_log_suppressed_total",
                "Client-caused log lines held back by the log limiter, by kind.",
                &["kind"],
            ),
            overload_shed,
            store_pending,
            revocations_active,
            overrides_active,
            access_log_dropped,
            cost_reconciled: counter(
                &r,
                "tollgate_cost_reconciled_total",
                "Costs settled after the response, by route and direction (charged, refunded, missing).",
                &["route", "direction"],
            ),
            admin_actions: counter(
                &r,
                "tollgate_admin_actions_total",
                "Admin writes and refused reads, by action and result (ok, rejected, refused, error).",
                &["action", "result"],
            ),
            cost_uncharged: counter(
                &r,
                "tollgate_cost_uncharged_total",
                "Units of settled costs not charged: beyond a limit's max_debt, or lost to a failing store.",
                &["route"],
            ),
            lease_units: gauge(
                &r,
                "tollgate_lease_units",
                "Units this instance holds under sync: lease.",
                &["limit"],
            ),
            auth_failures: {
                let c = counter(
                    &r,
                    "tollgate_auth_failures_total",
                    "Callers refused by authentication, by reason.",
                    &["reason"],
                );
                // Every reason from the start, so alerts see zeros.
                for reason in [
                    "missing",
                    "unknown",
                    "expired",
                    "bad_signature",
                    "bad_claims",
                    "revoked",
                    "unavailable",
                ] {
                    c.with_label_values(&[reason]);
                }
                c
            },
            auth_lookups: AuthLookups::new(counter(
                &r,
                "tollgate_auth_lookups_total",
                "Identity lookups by source and result.",
                &["source", "result"],
            )),
            forward_auth_seconds: {
                let h = Histogram::with_opts(
                    HistogramOpts::new(
                        "tollgate_forward_auth_seconds",
                        "Calls to the forward-auth service, from connect to answer.",
                    )
                    .buckets(vec![
                        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    ]),
                )
                .expect("valid metric");
                r.register(Box::new(h.clone())).expect("registered once");
                h
            },
            lease_calls: counter(
                &r,
                "tollgate_lease_calls_total",
                "Lease store calls by limit and kind (take, renew, return).",
                &["limit", "kind"],
            ),
            trace_spans_dropped: {
                let c = IntCounter::new(
                    "tollgate_trace_spans_dropped_total",
                    "Spans not exported because the exporter was behind.",
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("registered once");
                c
            },
            concurrency_holds: gauge(
                &r,
                "tollgate_concurrency_holds",
                "Holds this instance's requests keep on concurrency limits, by limit.",
                &["limit"],
            ),
            concurrency_reclaimed: counter(
                &r,
                "tollgate_concurrency_reclaimed_total",
                "Holds of concurrency limits found expired unrenewed and dropped, by limit.",
                &["limit"],
            ),
            usage_records: counter(
                &r,
                "tollgate_usage_records_total",
                "Usage ledger records by sink and result (shipped, duplicate, failed: in a failed try, at each try).",
                &["sink", "result"],
            ),
            usage_spool_bytes: {
                let g = IntGauge::new(
                    "tollgate_usage_spool_bytes",
                    "Bytes the usage ledger's spool holds.",
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("registered once");
                g
            },
            usage_lag: {
                let g = prometheus::GaugeVec::new(
                    prometheus::Opts::new(
                        "tollgate_usage_lag_seconds",
                        "Age of the oldest usage record a sink has not shipped.",
                    ),
                    &["sink"],
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("registered once");
                g
            },
            usage_dropped: {
                let c = IntCounter::new(
                    "tollgate_usage_dropped_total",
                    "Usage records dropped unshipped: the spool was full (on_full: drop) or a crash tore them.",
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("registered once");
                c
            },
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
            store_errors: {
                let c = counter(
                    &r,
                    "tollgate_store_errors_total",
                    "Failed limit store calls by reason.",
                    &["reason"],
                );
                for reason in ["timeout", "circuit_open", "connection", "script", "reply", "refused"] {
                    c.with_label_values(&[reason]);
                }
                c
            },
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
                &["pool", "priority"],
            ),
            pool_wait_seconds: histogram(
                &r,
                "tollgate_pool_wait_seconds",
                "Time spent waiting for a pool permit.",
                &["pool"],
                SECONDS,
            ),
            upstream_responses: counter(
                &r,
                "tollgate_upstream_responses_total",
                "Upstream answers to forwarded requests by route and status class (error: none).",
                &["route", "class"],
            ),
            upstream_seconds: histogram(
                &r,
                "tollgate_upstream_seconds",
                "Upstream response time by route class.",
                &["route"],
                SECONDS,
            ),
            config_reloads: {
                let c = counter(
                    &r,
                    "tollgate_config_reloads_total",
                    "Policy reloads by result.",
                    &["result"],
                );
                for result in ["ok", "error"] {
                    c.with_label_values(&[result]);
                }
                c
            },
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
            upstream_retries: counter(
                &r,
                "tollgate_upstream_retries_total",
                "Forwarding tries after the first, by pool and reason.",
                &["pool", "reason"],
            ),
            build_info: gauge(
                &r,
                "tollgate_build_info",
                "The running build (value 1).",
                &["version"],
            ),
            registry: r,
        };
        // Known label values are exported from the start, at zero.
        for sink in ["redis_stream", "http"] {
            metrics.usage_lag.with_label_values(&[sink]);
            for result in ["shipped", "duplicate", "failed"] {
                metrics.usage_records.with_label_values(&[sink, result]);
            }
        }
        metrics
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

    /// What the upstream answered a request of a route class: its status,
    /// or `None` when it did not answer.
    pub fn upstream_response(&self, route: Option<usize>, status: Option<u16>) {
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
