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

use super::{gate, undone, Charge, Gate, Verdict};

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
        owned[2].enforce = false;
        owned[3].op = crate::limits::Op::Force;
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
}
