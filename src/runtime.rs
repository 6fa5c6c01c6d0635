//! What a running gateway holds for one policy: the validated policy, the
//! in-process limit store and the pools' run-time state.

use std::sync::Arc;

use crate::config::Policy;
use crate::limits::limiter::Limiter;
use crate::metrics::Metrics;
use crate::pools::Pool;

/// One live policy with its state. Requests hold an `Arc` of it from start
/// to finish, so a request always completes under the policy it began with.
/// The limiter and metrics outlive policies: limit state survives a reload.
pub struct Runtime {
    pub policy: Policy,
    pub limiter: Arc<Limiter>,
    pub metrics: Arc<Metrics>,
    pub pools: Vec<Pool>,
}

impl Runtime {
    pub fn new(policy: Policy, limiter: Arc<Limiter>, metrics: Arc<Metrics>) -> Self {
        let pools = policy.upstreams.iter().map(Pool::new).collect();
        Self {
            policy,
            limiter,
            metrics,
            pools,
        }
    }
}
