//! Builders for tests and benchmarks: limits in whole units and charges with
//! the defaults most tests want, so that a test states only what it is about.
//! Compiled for the crate's own tests and with the `test-util` feature
//! (integration tests and benches), never into the gateway.
//!
//! A charge that differs from the defaults in a field or two is written with
//! struct update syntax: `Charge { mode: Mode::Shadow, ..charge(..) }`.

use crate::config::OnStoreError;
use crate::limits::algorithm::{Bucket, Params, Window};
use crate::limits::{Charge, Group, Mode, Op, SyncMode};

/// A bucket of `capacity` whole tokens refilling `per_second` whole tokens a
/// second.
pub fn bucket(capacity: u64, per_second: u64) -> Bucket {
    Bucket::per_second(capacity, per_second)
}

/// A token-bucket limit: [`bucket`] as the parameters of a charge.
pub fn bucket_params(capacity: u64, per_second: u64) -> Params {
    Params::TokenBucket(bucket(capacity, per_second))
}

/// A window admitting a cost of `limit` per `secs` whole seconds.
pub fn window(limit: u64, secs: u64) -> Window {
    Window::seconds(limit, secs)
}

/// A charge of `cost` to limit `name` for the caller `key`, decided by the
/// shared store: enforced, in the request group (after authentication), not
/// tenant-scoped, and refused while the store fails (`on_store_error:
/// closed`).
pub fn charge(name: &str, key: &str, params: Params, cost: u64) -> Charge {
    Charge {
        limit: crate::ids::LimitId::default(),
        name: name.into(),
        params,
        key: key.into(),
        tenant: None,
        cost,
        mode: Mode::Enforce,
        group: Group::Request,
        sync: SyncMode::Exact,
        on_store_error: OnStoreError::Closed,
        op: Op::DECIDE,
        hold: None,
    }
}

/// The same [`charge`] decided in this process (`SyncMode::Local`), as
/// the memory store's limits are.
pub fn local_charge(name: &str, key: &str, params: Params, cost: u64) -> Charge {
    Charge {
        sync: SyncMode::Local,
        ..charge(name, key, params, cost)
    }
}

/// Runs `f` to its end on a runtime of its own, one thread, with timers:
/// a property test's async steps, one case after the other.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
        .block_on(f)
}
