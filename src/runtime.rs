//! What a running gateway holds: the parts that live as long as the process
//! (limit state, metrics, pools, heavy hitters) and, per policy, a
//! [`Runtime`] that requests use from start to finish.

use std::sync::Arc;

use crate::config::Policy;
use crate::limits::limiter::Limiter;
use crate::metrics::{Metrics, PolicyMetrics};
use crate::pools::{Pool, Pools};
use crate::top::{Redactor, Top};

/// The process-long parts, shared by every policy that goes live.
pub struct Services {
    pub limiter: Arc<Limiter>,
    pub metrics: Arc<Metrics>,
    pub pools: Pools,
    pub top: Top,
    pub redactor: Redactor,
}

/// One live policy with its pools. Requests hold an `Arc` of it from start
/// to finish, so a request always completes under the policy it began with.
pub struct Runtime {
    pub policy: Policy,
    /// The policy's pools, indexed by [`crate::config::PoolId`].
    pub pools: Vec<Arc<Pool>>,
    pub services: Arc<Services>,
    metrics: PolicyMetrics,
}

impl Runtime {
    pub fn new(policy: Policy, services: Arc<Services>) -> Self {
        let pools = services.pools.reconcile(&policy.upstreams);
        let metrics = PolicyMetrics::new(
            services.metrics.clone(),
            policy.routes.iter().map(|r| r.name.clone()).collect(),
            policy.limits.iter().map(|l| l.name.clone()).collect(),
        );
        Self {
            policy,
            pools,
            services,
            metrics,
        }
    }

    pub fn limiter(&self) -> &Limiter {
        &self.services.limiter
    }

    /// The metrics, with this policy's series at hand.
    pub fn metrics(&self) -> &PolicyMetrics {
        &self.metrics
    }

    /// The process-wide metrics.
    pub fn all_metrics(&self) -> &Metrics {
        &self.services.metrics
    }
}
