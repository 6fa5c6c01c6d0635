//! tollgate: a rate-limiting reverse-proxy gateway for multi-tenant HTTP APIs.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod access_log;
pub mod admin;
pub mod admission;
pub mod changes;
pub mod client_ip;
pub mod clock;
pub mod config;
pub mod drain;
pub mod edge;
pub mod explain;
pub mod health;
pub mod identity;
pub mod key_values;
pub mod limits;
pub mod logs;
pub mod metrics;
pub mod pools;
pub mod proxy;
pub mod reload;
pub mod request_json;
pub mod respond;
pub mod routes;
pub mod runtime;
pub mod simulate;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod tls;
pub mod top;
pub mod trace;
pub mod usage;
pub mod watch;
