//! What a running gateway holds for one policy: the validated policy, the
//! in-process limit store and the pools' run-time state.

use std::sync::Arc;

use crate::config::Policy;
use crate::limits::memory::MemoryStore;
use crate::pools::Pool;

/// One live policy with its state. Requests hold an `Arc` of it from start
/// to finish, so a request always completes under the policy it began with.
pub struct Runtime {
    pub policy: Policy,
    pub local: Arc<MemoryStore>,
    pub pools: Vec<Pool>,
}

impl Runtime {
    pub fn new(policy: Policy, local: Arc<MemoryStore>) -> Self {
        let pools = policy.upstreams.iter().map(Pool::new).collect();
        Self {
            policy,
            local,
            pools,
        }
    }
}
