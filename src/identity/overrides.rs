//! Per-tenant overrides at runtime (`/admin/overrides`): another plan, or
//! other numbers for some limits, until an expiry — a boost after an
//! incident, a trial of a bigger plan.
//!
//! An override is kept as it was put (plan and limit names, the numbers as
//! a plan writes them) and resolved against the live policy: again after
//! every reload, so that one naming a limit or plan the policy no longer
//! has is dropped (with a warning), and one whose numbers no longer fit
//! the limit's algorithm is too. Like revocations, overrides live in the
//! shared store when there is one, read by every instance within
//! `server.admin_refresh_ms`; on the memory store they are this
//! instance's.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};

use super::records::{Record, Records};
use crate::limits::algorithm::Params;
use crate::limits::{LimitId, PlanId, RecordStore, StoreError};

/// One tenant's override, as put.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Override {
    /// The tenant it applies to.
    pub tenant: String,
    /// A plan of the policy to apply instead of the credential's.
    pub plan: Option<String>,
    /// Numbers for some limits, as a plan writes them.
    #[serde(default)]
    pub limits: BTreeMap<String, serde_json::Value>,
    /// Until then (ms since the epoch, wall clock).
    pub expires_at_ms: u64,
    /// Why, as the operator said.
    pub reason: String,
    /// Who put it.
    pub actor: String,
}

impl Record for Override {
    fn id(&self) -> &str {
        &self.tenant
    }

    fn expires_at_ms(&self) -> u64 {
        self.expires_at_ms
    }
}

/// An override resolved against one policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resolved {
    /// The plan to apply instead of the credential's.
    pub plan: Option<PlanId>,
    /// Parameters by limit, before any plan's.
    pub limits: HashMap<LimitId, Params>,
    /// Until then (wall clock, ms).
    pub expires_at_ms: u64,
}

impl Resolved {
    /// The parameters of `limit` under this override, if it sets them.
    pub fn params(&self, limit: LimitId) -> Option<Params> {
        self.limits.get(&limit).copied()
    }
}

/// The overrides of one policy, by tenant.
#[derive(Debug, Default)]
struct Resolution {
    /// The policy's generation they were resolved for.
    generation: u64,
    by_tenant: HashMap<String, Arc<Resolved>>,
}

/// The overrides this instance applies.
#[derive(Debug)]
pub struct Overrides {
    records: Records<Override>,
    resolved: ArcSwap<Resolution>,
}

impl Default for Overrides {
    fn default() -> Self {
        Self {
            records: Records::new("overrides"),
            resolved: ArcSwap::from_pointee(Resolution::stale()),
        }
    }
}

impl Resolution {
    /// Resolved for no policy: the next lookup resolves the records again.
    fn stale() -> Self {
        Self {
            generation: u64::MAX,
            by_tenant: HashMap::new(),
        }
    }
}

impl Overrides {
    /// The override of `tenant` in force at `now_ms` under the policy of
    /// reload generation `generation`, which `resolve` checks records
    /// against.
    pub fn of(
        &self,
        resolve: impl Fn(&Override) -> Result<Resolved, Vec<String>>,
        generation: u64,
        tenant: &str,
        now_ms: u64,
    ) -> Option<Arc<Resolved>> {
        let resolved = self.resolved.load();
        let resolved = if resolved.generation == generation {
            resolved
        } else {
            self.resolve_all(resolve, generation);
            self.resolved.load()
        };
        resolved
            .by_tenant
            .get(tenant)
            .filter(|r| r.expires_at_ms > now_ms)
            .cloned()
    }

    /// The overrides in force at `now_ms`, as put.
    pub fn active(&self, now_ms: u64) -> Vec<Override> {
        self.records.active(now_ms)
    }

    /// Resolves every record with `resolve`; those that no longer fit
    /// are dropped with a warning.
    fn resolve_all(
        &self,
        resolve: impl Fn(&Override) -> Result<Resolved, Vec<String>>,
        generation: u64,
    ) {
        let mut by_tenant = HashMap::new();
        for (tenant, o) in self.records.all().iter() {
            match resolve(o) {
                Ok(r) => {
                    by_tenant.insert(tenant.clone(), Arc::new(r));
                }
                Err(problems) => tracing::warn!(
                    tenant = tenant.as_str(),
                    problems = problems.join("; "),
                    "an override no longer fits the policy and is not applied"
                ),
            }
        }
        self.resolved.store(Arc::new(Resolution {
            generation,
            by_tenant,
        }));
    }

    /// Puts (or, with `None`, removes) the override of `tenant`, everywhere;
    /// the one in force before, if any.
    pub async fn set(
        &self,
        store: Option<&dyn RecordStore>,
        tenant: &str,
        o: Option<Override>,
        now_ms: u64,
    ) -> Result<Option<Override>, StoreError> {
        let before = self.records.set(store, tenant, o, now_ms).await?;
        self.resolved.store(Arc::new(Resolution::stale()));
        Ok(before)
    }

    /// Reads the store's overrides again when they changed.
    pub async fn refresh(&self, store: &dyn RecordStore) -> Result<(), StoreError> {
        if self.records.refresh(store).await? {
            self.resolved.store(Arc::new(Resolution::stale()));
        }
        Ok(())
    }
}
