//! Rate limits: the algorithms, the charges a request makes against its
//! limits, the store seam, and the all-or-nothing decision over them.
//!
//! Shared logic (key material, combining verdicts into one decision) lives
//! here; stores only hold state and apply [`algorithm`] to it.

pub mod algorithm;
pub mod memory;

use std::net::IpAddr;
use std::sync::Arc;

use async_trait::async_trait;

use crate::config::{KeyDims, LimitId};
use algorithm::Params;

/// One request's charge against one limit.
#[derive(Debug, Clone)]
pub struct Charge {
    pub limit: LimitId,
    pub name: Arc<str>,
    pub params: Params,
    /// The limit's key for this caller: the identity dimensions joined.
    pub key: String,
    pub cost: u64,
    /// `false` for shadow limits: decided and counted, never denying.
    pub enforce: bool,
}

/// What a store says about one charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// The limit itself admits the cost (whether or not it was charged).
    pub allowed: bool,
    /// Whole units left after the decision.
    pub remaining: u64,
    /// Milliseconds until the cost fits; `None` when it never can.
    pub wait_ms: Option<u64>,
    /// Milliseconds until the key is back to its initial state.
    pub reset_ms: u64,
}

/// The decision for a request over all its charges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow,
    /// At least one enforced limit denied; nothing was charged.
    Deny {
        violated: Vec<Arc<str>>,
        /// Whole seconds (at least 1) until a retry could succeed, or `None`
        /// when the cost can never fit one of the limits.
        retry_after: Option<u64>,
    },
}

/// Why a store could not decide.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store call timed out")]
    Timeout,
    #[error("store circuit is open")]
    CircuitOpen,
    #[error("store error: {0}")]
    Backend(String),
}

/// The seam between the decision logic and where limit state lives.
///
/// `decide` refreshes every charge's key, checks every one without spending,
/// and spends on all enforced charges only if all of them admit (shadow
/// charges are spent when they themselves admit and the gate passed).
#[async_trait]
pub trait LimitStore: Send + Sync {
    async fn decide(&self, charges: &[Charge]) -> Result<Vec<Verdict>, StoreError>;
}

/// The identity a request presents to its limits.
#[derive(Debug, Clone, Copy)]
pub struct Identity<'a> {
    /// The client network (an IPv4 /32 or an IPv6 prefix), already keyed.
    pub ip: Option<ipnet::IpNet>,
    pub credential: Option<&'a str>,
    pub tenant: Option<&'a str>,
    pub route: &'a str,
}

impl Identity<'_> {
    /// The raw key material of a limit for this caller: its name and the
    /// selected dimensions, unit-separated. It never leaves the process in
    /// the clear; shared stores hash it.
    pub fn key(&self, name: &str, dims: KeyDims) -> String {
        let mut key = String::with_capacity(64);
        key.push_str(name);
        let parts = [
            (dims.ip, self.ip.map(|n| n.to_string())),
            (dims.credential, self.credential.map(str::to_owned)),
            (dims.tenant, self.tenant.map(str::to_owned)),
            (dims.route, Some(self.route.to_owned())),
        ];
        for (selected, value) in parts {
            if selected {
                key.push('\u{1f}');
                key.push_str(value.as_deref().unwrap_or(""));
            }
        }
        key
    }
}

/// Combines per-charge verdicts into the request's decision.
pub fn combine(charges: &[Charge], verdicts: &[Verdict]) -> Decision {
    let mut violated = Vec::new();
    let mut wait = Some(0u64);
    for (c, v) in charges.iter().zip(verdicts) {
        if c.enforce && !v.allowed {
            violated.push(c.name.clone());
            wait = wait.zip(v.wait_ms).map(|(a, b)| a.max(b));
        }
    }
    if violated.is_empty() {
        return Decision::Allow;
    }
    Decision::Deny {
        violated,
        retry_after: wait.map(|ms| ms.div_ceil(1000).max(1)),
    }
}

/// Keys an address the way limits see it (IPv6 by prefix).
pub fn ip_key(ip: IpAddr, ipv6_prefix: u8) -> ipnet::IpNet {
    crate::client_ip::key_network(ip, ipv6_prefix)
}
