//! The pure core of admission: which limits a request is charged, keyed
//! for whom, at what cost. Every function here is a plain function of the
//! policy, the request's view and its caller: no store, no clock, no
//! metrics. The gateway, `simulate`, `explain` and the admin API's reset,
//! credit and usage all make their charges here, so they key and price a
//! charge alike.

use std::sync::Arc;

use crate::config::{LimitId, PlanId, Policy, Route};
use crate::identity::auth::Credential;
use crate::identity::overrides::Resolved;
use crate::key_values::{self as values, Refused, RequestView, Used};
use crate::limits::{Charge, Group, Identity, Op};

/// Who a request's limits count against, as far as it is known.
#[derive(Debug, Clone, Copy, Default)]
pub struct Caller<'a> {
    /// The client network, as IP keys name it.
    pub network: Option<ipnet::IpNet>,
    /// The credential a source named (`None`: none, or not yet).
    pub credential: Option<&'a Credential>,
    /// The tenant: the credential's, or one named alone (an operator's
    /// question about a tenant).
    pub tenant: Option<&'a Arc<str>>,
    /// The tenant's override in force, read by the identity stage.
    pub tuned: Option<&'a Resolved>,
    /// The plan its limits run under ([`plan_of`]).
    pub plan: Option<PlanId>,
}

impl<'a> Caller<'a> {
    /// A caller from `network`, with the credential a source named, its
    /// tenant's override `tuned`, and its plan as [`plan_of`] says.
    pub fn new(
        policy: &Policy,
        network: Option<ipnet::IpNet>,
        credential: Option<&'a Credential>,
        tuned: Option<&'a Resolved>,
    ) -> Self {
        Self::of_tenant(policy, network, credential, None, tuned)
    }

    /// As [`Caller::new`], with a tenant named (by an operator) beside or
    /// without a credential: the tenant named comes first.
    pub fn of_tenant(
        policy: &Policy,
        network: Option<ipnet::IpNet>,
        credential: Option<&'a Credential>,
        tenant: Option<&'a Arc<str>>,
        tuned: Option<&'a Resolved>,
    ) -> Self {
        let tenant = tenant.or(credential.map(|c| &c.tenant));
        Self {
            network,
            credential,
            tenant,
            tuned,
            plan: plan_of(policy, tuned, credential, tenant),
        }
    }

    /// The identity a charge on `route` keys by.
    pub fn identity(&self, route: &'a str) -> Identity<'a> {
        Identity {
            ip: self.network,
            credential: self.credential.map(|c| c.id.as_ref()),
            tenant: self.tenant,
            route,
        }
    }

    /// Whether the request may go past authentication on `route`.
    pub fn admitted_on(&self, route: &Route) -> bool {
        !route.auth_required || self.credential.is_some()
    }
}

/// Which of a route's limit groups to charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Groups {
    /// The pre-auth limits only: the caller, or the body, is not known yet.
    PreAuth,
    /// The request limits only, added once the caller or the body is.
    Request,
    /// Both, in order.
    Both,
}

/// What a request is charged on its route.
#[derive(Debug, Clone)]
pub struct Charges {
    /// The charges, pre-auth first.
    pub charges: Vec<Charge>,
    /// Whether the request may go past authentication.
    pub authenticated: bool,
    /// A value a request limit's key cannot use: the request charges are
    /// left out, and the request is refused (400) after the pre-auth
    /// limits and authentication, in their order.
    pub refused: Option<Refused>,
    /// The values its limits read, for its access-log line.
    pub used: Used,
}

/// What a request will be decided on: its route and its charges, as far
/// as they are known.
#[derive(Debug)]
pub struct Plan<'p> {
    /// The matched route.
    pub route: &'p Route,
    /// Pre-auth charges, then (once the caller may go past
    /// authentication, and its body is read where the route reads it) the
    /// request charges.
    pub charges: Vec<Charge>,
    /// Whether the request may go past authentication.
    pub authenticated: bool,
    /// A value a request limit's key cannot use (400): its request
    /// charges are not made, and the refusal comes after the pre-auth
    /// limits and authentication, in their order.
    pub refused: Option<Refused>,
    /// The request's estimate: what it names (`cost_from_request`), or the
    /// route's cost.
    pub estimate: u64,
}

impl<'p> Plan<'p> {
    /// The plan of `charged` on `route`, at `estimate`.
    pub fn new(route: &'p Route, charged: Charges, estimate: u64) -> Self {
        Self {
            route,
            charges: charged.charges,
            authenticated: charged.authenticated,
            refused: charged.refused,
            estimate,
        }
    }

    /// Adds the request charges of a caller, or a body, known only now,
    /// keyed by what `view` says (the values read noted in `used`), or the
    /// value that refuses them; where they start in `charges`.
    pub fn add_request_charges(
        &mut self,
        policy: &Policy,
        view: &RequestView<'_>,
        caller: &Caller<'_>,
        used: &mut Used,
    ) -> usize {
        let start = self.charges.len();
        match plan(policy, self.route, view, caller, Groups::Request) {
            Ok(charged) => {
                self.charges.extend(charged.charges);
                self.refused = charged.refused;
                used.extend(charged.used);
            }
            // Only a pre-auth limit refuses before anything is charged.
            Err(refused) => self.refused = Some(refused),
        }
        start
    }
}

/// The charges of `route`'s limits in `groups` for `caller`, each keyed by
/// what `view` says and charged the route's admission cost of the estimate
/// `view` names. The request limits are charged only when the caller may
/// go past authentication. A value a pre-auth limit cannot use refuses the
/// request before anything is charged (`Err`); one a request limit cannot
/// use leaves the request charges out, in [`Charges::refused`].
pub fn plan(
    policy: &Policy,
    route: &Route,
    view: &RequestView<'_>,
    caller: &Caller<'_>,
    groups: Groups,
) -> Result<Charges, Refused> {
    let cost = route.admission_cost_of(route.estimate(view.headers, view.body));
    let who = caller.identity(&route.name);
    let mut charged = Charges {
        charges: Vec::new(),
        authenticated: caller.admitted_on(route),
        refused: None,
        used: Used::default(),
    };
    if groups != Groups::Request {
        // A pre-auth limit runs for anyone, under no plan or override.
        let anyone = Caller {
            plan: None,
            tuned: None,
            ..*caller
        };
        for &id in &route.pre_auth {
            let used = &mut charged.used;
            let c = limit_charge(policy, id, &anyone, &who, cost, Group::PreAuth, view, used)?;
            charged.charges.extend(c);
        }
    }
    if groups != Groups::PreAuth && charged.authenticated {
        let mut request = Vec::with_capacity(route.request.len());
        let mut used = Used::default();
        for &id in &route.request {
            match limit_charge(
                policy,
                id,
                caller,
                &who,
                cost,
                Group::Request,
                view,
                &mut used,
            ) {
                Ok(c) => request.extend(c),
                Err(refused) => {
                    charged.refused = Some(refused);
                    request.clear();
                    break;
                }
            }
        }
        charged.charges.extend(request);
        charged.used.extend(used);
    }
    Ok(charged)
}

/// The charge of `cost` to limit `id` for `caller` (keyed as `who`), in
/// `group`, keyed by what the limit's key reads from `view` (noted in
/// `used`): `None` when a value it reads is absent and the limit says
/// `skip`; the value it cannot use, if any.
#[allow(clippy::too_many_arguments)]
pub fn limit_charge(
    policy: &Policy,
    id: LimitId,
    caller: &Caller<'_>,
    who: &Identity<'_>,
    cost: u64,
    group: Group,
    view: &RequestView<'_>,
    used: &mut Used,
) -> Result<Option<Charge>, Refused> {
    let l = &policy.limits[id];
    let c = charge(policy, id, who, caller.plan, caller.tuned, cost, group);
    if l.values.is_empty() {
        return Ok(Some(c));
    }
    match values::read(&l.values, view) {
        Ok(read) => {
            used.note(&l.name, &l.values, &read);
            let overridden = caller.tuned.and_then(|o| o.params(id)).is_some();
            Ok(read.keyed(c, overridden))
        }
        Err(problem) => {
            let dim = l.values.dims.iter().map(ToString::to_string);
            Err(Refused {
                limit: l.name.clone(),
                dim: dim.collect::<Vec<_>>().join(", "),
                problem,
            })
        }
    }
}

/// The charge of `cost` to limit `id` for caller `who`, under `plan` and
/// the tenant's override (`tuned`), whose numbers come first; before any
/// key read from the request ([`limit_charge`] adds those).
pub fn charge(
    policy: &Policy,
    id: LimitId,
    who: &Identity<'_>,
    plan: Option<PlanId>,
    tuned: Option<&Resolved>,
    cost: u64,
    group: Group,
) -> Charge {
    let l = &policy.limits[id];
    let tenant_scoped = l.key.tenant || l.key.credential;
    // A concurrency limit holds one unit per request, whatever its cost.
    let hold = l
        .params
        .is_concurrency()
        .then(crate::limits::holds::next_id);
    Charge {
        limit: id,
        name: l.name.clone(),
        params: tuned
            .and_then(|o| o.params(id))
            .unwrap_or_else(|| policy.params(id, plan)),
        key: who.key(&l.name, l.key),
        tenant: who.tenant.filter(|_| tenant_scoped).cloned(),
        cost: if hold.is_some() { 1 } else { cost },
        mode: l.mode,
        group,
        sync: l.sync,
        on_store_error: l.on_store_error,
        op: Op::Decide {
            on_limit: l.on_limit,
        },
        hold,
    }
}

/// The plan a caller's limits run under: its tenant's override's, else
/// its credential's, else (for a tenant named alone) the plan of the
/// tenant's first credential.
pub fn plan_of(
    policy: &Policy,
    tuned: Option<&Resolved>,
    credential: Option<&Credential>,
    tenant: Option<&Arc<str>>,
) -> Option<PlanId> {
    tuned
        .and_then(|o| o.plan)
        .or_else(|| credential.and_then(|c| c.plan))
        .or_else(|| {
            let t = tenant?;
            policy
                .auth
                .keys
                .credentials()
                .find(|c| c.tenant == *t)
                .and_then(|c| c.plan)
        })
}

/// What the key of a charge an operator asks about lacks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Lacks {
    /// A dimension of the caller the operator did not name: `ip`,
    /// `credential` or `tenant`.
    #[error("{0}")]
    Caller(&'static str),
    /// Values of these dimensions read from requests (absent, and the
    /// limit says `skip`).
    #[error("{0}")]
    Values(String),
    /// A value of these dimensions that cannot be used, and why.
    #[error("{dims} that {why}")]
    Unusable {
        /// The dimensions, as the policy names them.
        dims: String,
        /// What is wrong with the value (never the value itself).
        why: &'static str,
    },
}

/// The charge of `cost` to limit `id` for `caller` on `route`, in `group`,
/// keyed by the values an operator named by dimension (`named`:
/// `header.x-end-user` → its value) instead of a request's: what
/// `explain`, and the admin API's reset, credit and usage, act on; or
/// what the key lacks.
pub fn named_charge(
    policy: &Policy,
    id: LimitId,
    caller: &Caller<'_>,
    route: &str,
    cost: u64,
    group: Group,
    named: &std::collections::HashMap<String, String>,
) -> Result<Charge, Lacks> {
    let headers = http::HeaderMap::new();
    let view = RequestView {
        named: Some(named),
        ..RequestView::of_head(&headers, "", None)
    };
    let who = caller.identity(route);
    let mut used = Used::default();
    match limit_charge(policy, id, caller, &who, cost, group, &view, &mut used) {
        Ok(Some(charge)) => Ok(charge),
        Ok(None) => Err(Lacks::Values(
            policy.limits[id]
                .values
                .dims
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        )),
        Err(refused) => Err(Lacks::Unusable {
            dims: refused.dim,
            why: refused.problem.says(),
        }),
    }
}
