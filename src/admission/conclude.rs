//! The conclusion of a request's limits: the pre-auth limits, then
//! authentication, then the request limits, acted on in that order from
//! their verdicts. Plain inputs only, so that the gateway and `simulate`
//! conclude alike.

use crate::config::Target;
use crate::key_values::Refused;
use crate::limits::{combine, Charge, Decision, Group, Source, SyncMode, Verdict};
use crate::respond::{RateHeaders, Rejection};
use crate::runtime::Runtime;

use super::plan::Plan;
use super::settle::Reconcile;
use super::{Admitted, Facts};

/// What [`conclude`] needs to know beyond the request: plain values, so
/// that the gateway and `simulate` conclude alike.
#[derive(Debug, Clone, Copy, Default)]
pub struct Conclusion {
    /// Whether to work out the `RateLimit` fields
    /// (`responses.ratelimit_headers: draft`).
    pub ratelimit_headers: bool,
    /// `Retry-After` of a 503 when the store is failing and a limit says
    /// `closed`.
    pub unavailable_retry_after: u64,
    /// The instances sharing the store (`store.expected_instances`): a
    /// charge the local fallback decided is settled against its share.
    pub instances: u32,
}

impl Conclusion {
    /// As the live policy and limiter say.
    pub fn of(rt: &Runtime) -> Self {
        Self {
            ratelimit_headers: rt.policy.ratelimit_headers,
            unavailable_retry_after: rt.limiter().unavailable_retry_after(),
            instances: rt.policy.store.expected_instances,
        }
    }
}

/// Acts on the limits' verdicts, group by group: the pre-auth limits, then
/// authentication, then the request limits. Plain inputs only: the
/// gateway and `simulate` both conclude here.
pub fn conclude(
    plan: &Plan<'_>,
    verdicts: &[Verdict],
    how: Conclusion,
    facts: &mut Facts,
) -> Result<Admitted, Rejection> {
    if how.ratelimit_headers {
        facts.rate_headers = RateHeaders::most_constrained(&plan.charges, verdicts);
    }
    let check = |group| check_group(&plan.charges, verdicts, group, how.unavailable_retry_after);
    check(Group::PreAuth).inspect_err(|r| facts.note(r))?;
    if !plan.authenticated {
        return Err(Rejection::Unauthorized);
    }
    if let Some(refused) = &plan.refused {
        return Err(key_value(refused));
    }
    check(Group::Request).inspect_err(|r| facts.note(r))?;
    if let Some(spec) = &plan.route.cost_from_response {
        facts.hidden_cost_header = spec.source.header().filter(|_| !spec.expose).cloned();
        facts.reconcile = Some(Reconcile {
            spec: spec.clone(),
            estimate: plan.estimate,
            reserved: plan.route.admission_cost_of(plan.estimate),
            route: plan.route.name.clone(),
            // What the store charged is settled in the store; what the
            // local fallback charged (the store failing), in this
            // process's share of the budget, where it was charged.
            charged: plan
                .charges
                .iter()
                .zip(verdicts)
                .filter(|(_, v)| v.allowed)
                .filter_map(|(c, v)| match v.source {
                    Source::Store => Some((c.clone(), v.at)),
                    Source::Fallback => Some((
                        Charge {
                            sync: SyncMode::Local,
                            ..crate::limits::plan::fallback_charge(c, how.instances.max(1))
                        },
                        v.at,
                    )),
                    _ => None,
                })
                .collect(),
        });
    }
    // Admitted after the longest wait an enforced limit scheduled it for.
    facts.delay_ms = plan
        .charges
        .iter()
        .zip(verdicts)
        .filter(|(c, _)| c.enforced())
        .map(|(_, v)| v.delay_ms)
        .max()
        .unwrap_or(0);
    Ok(match &plan.route.target {
        Target::Upstream(pool) => Admitted::Forward(*pool),
        Target::Respond {
            status,
            body,
            content_type,
        } => Admitted::Respond {
            status: *status,
            body: body.clone(),
            content_type: content_type.clone(),
        },
    })
}

fn check_group(
    charges: &[Charge],
    verdicts: &[Verdict],
    group: Group,
    unavailable_retry_after: u64,
) -> Result<(), Rejection> {
    match combine(charges, verdicts, group) {
        Decision::Allow => Ok(()),
        Decision::Deny {
            violated,
            retry_after,
        } => Err(Rejection::RateLimited {
            violated,
            retry_after,
        }),
        Decision::Unavailable => Err(Rejection::StoreUnavailable {
            retry_after: unavailable_retry_after,
        }),
        Decision::Shed(_) => Err(Rejection::Overloaded { retry_after: 1 }),
    }
}

/// The 400 of a value a limit's key cannot use.
pub fn key_value(refused: &Refused) -> Rejection {
    Rejection::KeyValue {
        kind: refused.problem.kind(),
        detail: refused.detail(),
    }
}

impl Facts {
    fn note(&mut self, rejection: &Rejection) {
        if let Rejection::RateLimited { violated, .. } = rejection {
            self.violated.clone_from(violated);
        }
    }
}

/// Whether the verdicts of `plan`'s charges in `group` admit the request.
pub fn admits(plan: &Plan<'_>, verdicts: &[Verdict], group: Group) -> bool {
    check_group(&plan.charges, verdicts, group, 0).is_ok()
}
