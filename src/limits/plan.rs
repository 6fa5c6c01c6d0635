//! The all-or-nothing arithmetic of a decision made in parts, as plain
//! functions over charges and verdicts.
//!
//! A request's charges are decided in parts: leased units spent in this
//! process, local limits, one store call, or on Redis Cluster one call per
//! hash slot. Each part charges what it admits below a gate of its own
//! (the first group it saw denied, or where it was told to stop). Once
//! every part has answered, [`settle`] finds where the whole decision
//! stops charging, and what each part spent beyond it and must give back.
//! The limiter and the Cluster store both settle this way; neither holds
//! the rule itself.
//!
//! The rest of a decision's plan lives here too, so that the limiter only
//! makes the calls: which part decides each charge ([`Split`]), what a
//! failing store leaves to each limit's failure mode ([`Fallback`]), and
//! what settles a cost learnt after the response ([`settlement`]).

use super::algorithm::Params;
use super::{gate, undone, Charge, Gate, OnStoreError, Op, Source, SyncMode, Verdict};

/// Where each of a decision's charges is decided: spent from (or refused
/// by) a lease this instance holds, in this process, or in the store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// Charges a lease settled.
    pub held: Vec<usize>,
    /// Local charges.
    pub local: Vec<usize>,
    /// Shared charges for the store call (a lease short of units joins it
    /// as a take).
    pub remote: Vec<usize>,
}

impl Split {
    /// Splits `charges`, of which `held(i)` says a lease settled charge i.
    pub fn new(charges: &[Charge], held: impl Fn(usize) -> bool) -> Self {
        let mut split = Self::default();
        for (i, c) in charges.iter().enumerate() {
            match (held(i), c.is_local()) {
                (true, _) => split.held.push(i),
                (false, true) => split.local.push(i),
                (false, false) => split.remote.push(i),
            }
        }
        split
    }
}

/// A decision while the store fails, planned: local limits as usual,
/// leased units already spent stay spent, and each other shared limit
/// follows its `on_store_error`.
#[derive(Debug, Clone)]
pub struct Fallback {
    /// Verdicts known already: a lease's, or a limit that fails open or
    /// closed.
    pub fixed: Vec<Option<Verdict>>,
    /// Charges to decide in this process, with their index: local limits
    /// and the `local` fallbacks, each holding `1/instances` of its
    /// budget under a key of its own.
    pub run: Vec<(usize, Charge)>,
    /// The first group not to charge: a refusal a lease remembers or a
    /// closed limit blocks its group.
    pub blocked: Gate,
}

impl Fallback {
    /// Plans the decision of `charges` of which `held` are settled by
    /// leases, for a fleet of `instances`.
    pub fn new(charges: &[Charge], held: &[Option<Verdict>], instances: u32) -> Self {
        let mut fixed = held.to_vec();
        let mut run = Vec::new();
        let mut blocked = gate(charges, |i| fixed[i].is_none_or(|v| v.allowed), Gate::Open);
        for (i, c) in charges.iter().enumerate() {
            if fixed[i].is_some() {
                continue;
            }
            match (c.is_local(), c.on_store_error) {
                (true, _) => run.push((i, c.clone())),
                (false, OnStoreError::Local) => run.push((i, fallback_charge(c, instances))),
                (false, OnStoreError::Open) => {
                    fixed[i] = Some(Verdict::undecided(true, Source::FailOpen));
                }
                (false, OnStoreError::Closed) => {
                    fixed[i] = Some(Verdict::undecided(false, Source::FailClosed));
                    if c.enforced() {
                        blocked = blocked.min(Gate::At(c.group));
                    }
                }
            }
        }
        Self {
            fixed,
            run,
            blocked,
        }
    }

    /// The charges to decide in this process.
    pub fn to_run(&self) -> Vec<&Charge> {
        self.run.iter().map(|(_, c)| c).collect()
    }

    /// The decision, once `decided` holds one verdict per charge of `run`
    /// (decided below `blocked`): a shared limit's local verdict is marked
    /// as its fallback's.
    pub fn conclude(self, charges: &[Charge], decided: Vec<Verdict>) -> Vec<Verdict> {
        let mut verdicts = self.fixed;
        for ((i, _), mut v) in self.run.iter().zip(decided) {
            if !charges[*i].is_local() {
                v.source = Source::Fallback;
            }
            verdicts[*i] = Some(v);
        }
        verdicts.into_iter().flatten().collect()
    }
}

/// The charge a shared limit's local fallback decides in this process:
/// `1/instances` of its budget, under a key of its own.
pub fn fallback_charge(c: &Charge, instances: u32) -> Charge {
    Charge {
        params: c.params.share(instances),
        key: format!("\u{1e}fallback\u{1f}{}", c.key),
        ..c.clone()
    }
}

/// How deep into debt a settlement may push each limit
/// (`cost_from_response.max_debt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DebtBound {
    /// The bound the route sets, in units, for every limit.
    pub explicit: Option<u64>,
    /// Otherwise this many units (10 × (`max` − the estimate)), or the
    /// limit's capacity when that is more.
    pub default: u64,
}

impl DebtBound {
    /// The deepest debt a settlement may leave under a limit of `params`.
    pub fn of(self, params: &Params) -> u64 {
        self.explicit
            .unwrap_or_else(|| self.default.max(params.quota()))
    }
}

/// What settles a request's charges (each with the store time it was made
/// at) once its actual cost is known, `delta` away from what was charged:
/// `delta` more forced on each, into debt of at most `debt`, or `-delta`
/// given back. Leases are not involved: a settlement goes to the limit's
/// own state.
pub fn settlement(charged: &[(Charge, u64)], delta: i64, debt: DebtBound) -> Vec<(Charge, u64)> {
    if delta == 0 {
        return Vec::new();
    }
    charged
        .iter()
        // A hold is one unit whatever the request cost.
        .filter(|(c, _)| c.hold.is_none())
        .map(|(c, at)| {
            let c = Charge {
                cost: delta.unsigned_abs(),
                op: if delta > 0 {
                    Op::Force {
                        max_debt: debt.of(&c.params),
                    }
                } else {
                    Op::DECIDE
                },
                // A lease's units are taken ahead, not settled: what a
                // leased limit owes is settled in the store.
                sync: if c.is_local() {
                    SyncMode::Local
                } else {
                    SyncMode::Exact
                },
                ..c.clone()
            };
            (c, *at)
        })
        .collect()
}

/// One part of a decision: which of the request's charges it decided,
/// what it said of each, and the gate below which it charged.
#[derive(Debug, Clone)]
pub struct Part {
    /// Indices into the request's charges.
    pub members: Vec<usize>,
    /// One verdict per member.
    pub verdicts: Vec<Verdict>,
    /// The part charged what it admitted in the groups below this.
    pub spent_below: Gate,
}

/// Where a decision made in parts stops charging, and what to give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    /// The whole decision charges the groups below this.
    pub gate: Gate,
    /// Per part, in order: the members it charged beyond `gate`, to be
    /// given back. Forced charges (costs learnt after a response) gate
    /// nothing and are never given back.
    pub undo: Vec<Vec<usize>>,
}

/// Settles the parts of one decision over `charges`, none of which may
/// charge at or beyond `blocked_from`.
pub fn settle(charges: &[&Charge], parts: &[Part], blocked_from: Gate) -> Settled {
    let verdicts = in_order(parts, charges.len());
    let allowed = |i: usize| verdicts[i].is_none_or(|v| v.allowed);
    let gate = gate(charges.iter().copied(), allowed, blocked_from);
    let undo = parts
        .iter()
        .map(|part| {
            part.members
                .iter()
                .zip(&part.verdicts)
                .filter(|(&i, v)| {
                    !charges[i].op.is_force() && undone(charges[i], v, part.spent_below, gate)
                })
                .map(|(&i, _)| i)
                .collect()
        })
        .collect();
    Settled { gate, undo }
}

/// The parts' verdicts back in the charges' order: one per charge of
/// `count`, `None` for a charge no part decided.
pub fn in_order(parts: &[Part], count: usize) -> Vec<Option<Verdict>> {
    let mut verdicts = vec![None; count];
    for part in parts {
        for (&i, v) in part.members.iter().zip(&part.verdicts) {
            verdicts[i] = Some(*v);
        }
    }
    verdicts
}

/// The gate below which a part charged: its first enforced denial, or
/// `blocked_from` when that comes first.
pub fn part_gate(
    charges: &[&Charge],
    part: &[usize],
    verdicts: &[Verdict],
    blocked_from: Gate,
) -> Gate {
    gate(
        part.iter().map(|&i| charges[i]),
        |j| verdicts[j].allowed,
        blocked_from,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::{Group, Source};
    use crate::testing::{bucket_params, charge};

    fn verdict(allowed: bool) -> Verdict {
        Verdict {
            allowed,
            remaining: 0,
            wait_ms: None,
            reset_ms: 0,
            source: Source::Store,
            granted: 0,
            at: 0,
            delay_ms: 0,
            uncharged: 0,
            reclaimed: 0,
        }
    }

    fn charges() -> Vec<Charge> {
        let pre = |k: &str| Charge {
            group: Group::PreAuth,
            ..charge(k, k, bucket_params(1, 1), 1)
        };
        let req = |k: &str| charge(k, k, bucket_params(1, 1), 1);
        vec![pre("ip"), req("tenant"), req("global"), req("credential")]
    }

    fn part(members: &[usize], allowed: &[bool], charges: &[&Charge], blocked: Gate) -> Part {
        let verdicts: Vec<Verdict> = allowed.iter().map(|&a| verdict(a)).collect();
        Part {
            spent_below: part_gate(charges, members, &verdicts, blocked),
            members: members.to_vec(),
            verdicts,
        }
    }

    #[test]
    fn parts_that_all_admit_keep_what_they_charged() {
        let owned = charges();
        let c: Vec<&Charge> = owned.iter().collect();
        let parts = [
            part(&[0, 1], &[true, true], &c, Gate::Open),
            part(&[2, 3], &[true, true], &c, Gate::Open),
        ];
        let s = settle(&c, &parts, Gate::Open);
        assert_eq!(s.gate, Gate::Open);
        assert_eq!(s.undo, vec![Vec::<usize>::new(), vec![]]);
    }

    #[test]
    fn a_denial_in_one_part_takes_back_its_group_from_the_others() {
        let owned = charges();
        let c: Vec<&Charge> = owned.iter().collect();
        // Slot A admits the IP and the tenant; slot B denies the global
        // limit: the request group is refused, the pre-auth group stands.
        let parts = [
            part(&[0, 1], &[true, true], &c, Gate::Open),
            part(&[2, 3], &[false, true], &c, Gate::Open),
        ];
        let s = settle(&c, &parts, Gate::Open);
        assert_eq!(s.gate, Gate::At(Group::Request));
        assert_eq!(
            s.undo,
            vec![vec![1], vec![]],
            "B charged nothing past its own denial"
        );
    }

    #[test]
    fn a_pre_auth_denial_takes_back_everything() {
        let owned = charges();
        let c: Vec<&Charge> = owned.iter().collect();
        let parts = [
            part(&[1, 2, 3], &[true, true, true], &c, Gate::Open),
            part(&[0], &[false], &c, Gate::Open),
        ];
        let s = settle(&c, &parts, Gate::Open);
        assert_eq!(s.gate, Gate::SHUT);
        assert_eq!(s.undo, vec![vec![1, 2, 3], vec![]]);
    }

    #[test]
    fn what_a_part_was_told_not_to_charge_needs_no_refund() {
        let owned = charges();
        let c: Vec<&Charge> = owned.iter().collect();
        // The store call was told the request group is already refused
        // (an earlier part denied it).
        let told = Gate::At(Group::Request);
        let parts = [
            part(&[3], &[false], &c, Gate::Open),
            part(&[0, 1, 2], &[true, true, true], &c, told),
        ];
        let s = settle(&c, &parts, Gate::Open);
        assert_eq!(s.gate, told);
        assert_eq!(s.undo, vec![Vec::<usize>::new(), vec![]]);
    }

    #[test]
    fn shadow_limits_gate_nothing_and_forced_charges_stay() {
        let mut owned = charges();
        owned[2].mode = crate::limits::Mode::Shadow;
        owned[3].op = crate::limits::Op::Force { max_debt: 1 };
        let c: Vec<&Charge> = owned.iter().collect();
        let parts = [
            part(&[0, 1, 3], &[true, true, true], &c, Gate::Open),
            part(&[2], &[false], &c, Gate::Open),
        ];
        let s = settle(&c, &parts, Gate::Open);
        assert_eq!(s.gate, Gate::Open, "a shadow denial refuses nothing");
        let denied = [
            part(&[0, 1, 3], &[true, true, true], &c, Gate::Open),
            part(&[2], &[true], &c, Gate::At(Group::Request)),
        ];
        let s = settle(&c, &denied, Gate::At(Group::Request));
        assert_eq!(s.undo[0], vec![1], "the forced charge is never given back");
    }

    #[test]
    fn each_charge_is_decided_by_one_part() {
        let mut owned = charges();
        owned[1].sync = SyncMode::Local;
        let split = Split::new(&owned, |i| i == 2);
        assert_eq!(split.held, vec![2]);
        assert_eq!(split.local, vec![1]);
        assert_eq!(split.remote, vec![0, 3], "in the charges' order");
    }

    #[test]
    fn a_failing_store_leaves_each_limit_to_its_failure_mode() {
        let mut owned = charges();
        // ip: local fallback; tenant: open; global: closed; credential:
        // a local limit.
        owned[0].on_store_error = OnStoreError::Local;
        owned[1].on_store_error = OnStoreError::Open;
        owned[3].sync = SyncMode::Local;
        let plan = Fallback::new(&owned, &[None; 4], 4);
        assert_eq!(
            plan.fixed[1].map(|v| (v.allowed, v.source)),
            Some((true, Source::FailOpen))
        );
        assert_eq!(
            plan.fixed[2].map(|v| (v.allowed, v.source)),
            Some((false, Source::FailClosed))
        );
        assert_eq!(
            plan.blocked,
            Gate::At(Group::Request),
            "the closed limit blocks its group"
        );
        let run: Vec<usize> = plan.run.iter().map(|(i, _)| *i).collect();
        assert_eq!(run, vec![0, 3]);
        let (_, fallback) = &plan.run[0];
        assert_ne!(
            fallback.key, owned[0].key,
            "a fallback counts under a key of its own"
        );
        assert_eq!(
            fallback.params,
            owned[0].params.share(4),
            "a quarter of the budget"
        );
        assert_eq!(plan.run[1].1.key, owned[3].key, "a local limit is itself");

        let verdicts = plan.conclude(&owned, vec![verdict(true), verdict(true)]);
        let sources: Vec<Source> = verdicts.iter().map(|v| v.source).collect();
        assert_eq!(
            sources,
            vec![
                Source::Fallback,
                Source::FailOpen,
                Source::FailClosed,
                Source::Store
            ],
            "a shared limit decided here is marked as its fallback"
        );
    }

    #[test]
    fn what_leases_settled_stays_and_a_refusal_blocks_its_group() {
        let mut owned = charges();
        owned[0].on_store_error = OnStoreError::Open;
        let held = [None, None, Some(verdict(false)), Some(verdict(true))];
        let plan = Fallback::new(&owned, &held, 2);
        assert_eq!(plan.blocked, Gate::At(Group::Request));
        assert_eq!(plan.fixed[2].map(|v| v.allowed), Some(false));
        assert_eq!(plan.fixed[3].map(|v| v.allowed), Some(true));
        assert!(
            plan.run.is_empty(),
            "the undecided charges fail open and closed"
        );
    }

    #[test]
    fn a_cost_learnt_later_is_forced_or_given_back() {
        let owned = charges();
        let charged: Vec<(Charge, u64)> = owned.iter().cloned().zip([10, 10, 20, 20]).collect();
        let debt = DebtBound {
            explicit: None,
            default: 0,
        };
        assert!(settlement(&charged, 0, debt).is_empty());
        let more = settlement(&charged, 7, debt);
        // Capacity 1 each: the default bound is at least the capacity.
        let forced = Op::Force { max_debt: 1 };
        assert!(more
            .iter()
            .all(|(c, _)| c.cost == 7 && c.op == forced && c.lease().is_none()));
        let deep = DebtBound {
            explicit: None,
            default: 90,
        };
        let more = settlement(&charged, 7, deep);
        assert!(more.iter().all(|(c, _)| c.op == Op::Force { max_debt: 90 }));
        let set = DebtBound {
            explicit: Some(0),
            default: 90,
        };
        let more = settlement(&charged, 7, set);
        assert!(more.iter().all(|(c, _)| c.op == Op::Force { max_debt: 0 }));
        assert_eq!(
            more.iter().map(|(_, at)| *at).collect::<Vec<_>>(),
            vec![10, 10, 20, 20]
        );
        let less = settlement(&charged, -3, debt);
        assert!(less.iter().all(|(c, _)| c.cost == 3 && c.op == Op::DECIDE));
    }
}
