//! tollgate: a rate-limiting reverse-proxy gateway for multi-tenant HTTP APIs.
//!
//! The modules are declared in the order a request meets them;
//! `ARCHITECTURE.md` beside this crate is the map.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

// 1. The connection and the request head, bounded and normalized.
pub mod edge;

// 2. Pingora's hooks, thin: each calls the stages below.
pub mod proxy;

// 3. The request path up to pool admission (head, identity, plan,
//    decision, conclusion), and what it reads the request with.
pub mod admission;
pub mod client_ip;
pub mod identity;
pub mod key_values;
pub mod request_json;
pub mod routes;

// 4. Deciding limits, in this process and in the shared store.
pub mod limits;

// 5. Upstream pools and their health.
pub mod health;
pub mod pools;

// 6. Refusals and the `RateLimit` fields.
pub mod respond;

// 7. After the response: the usage ledger, the access log, traces.
pub mod access_log;
pub mod trace;
pub mod usage;

// The policy, and what lives as long as the process.
pub mod changes;
pub mod clock;
pub mod config;
pub mod drain;
pub mod ids;
pub mod reload;
pub mod runtime;
pub mod tls;
pub mod watch;

// Operators' views.
pub mod admin;
pub mod explain;
pub mod logs;
pub mod metrics;
pub mod simulate;
pub mod top;

#[cfg(any(test, feature = "test-util"))]
pub mod testing;
