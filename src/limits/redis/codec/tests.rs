//! The wire format both ways, without a server: what is encoded reads back
//! as the script reads it, and replies decode to the verdicts they carry.

use proptest::prelude::*;

use super::*;

/// One request as read back: its gate, refund time, and keyed limits.
type ReadBack = (u8, u64, Vec<(String, Spec)>);

/// Reads a call's bytes as `lua/limits.lua` does: per request its gate,
/// count and refund time, then per limit its key index and numbers.
fn read_back(call: &Call<'_>) -> Vec<ReadBack> {
    let b = &call.bytes;
    let mut at = 0;
    let mut take = |n: usize| {
        let s = &b[at..at + n];
        at += n;
        s
    };
    let u64_of = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap());
    let mut out: Vec<ReadBack> = Vec::new();
    for _ in 0..call.requests {
        let gate = take(1)[0];
        if gate == SAME {
            let previous = out.last().expect("a repeat follows a request").clone();
            out.push(previous);
            continue;
        }
        let count = u16::from_le_bytes(take(2).try_into().unwrap());
        let refund = u64_of(take(8));
        let mut limits = Vec::new();
        for _ in 0..count {
            let key = u32::from_le_bytes(take(4).try_into().unwrap()) as usize;
            let kind = take(1)[0];
            let (a, bb, cost) = (u64_of(take(8)), u64_of(take(8)), u64_of(take(8)));
            let flags = take(1)[0];
            let mut field = |bit: u8| {
                if flags & bit != 0 {
                    u64_of(take(8))
                } else {
                    0
                }
            };
            let want = field(TAKES);
            let delay = field(DELAYS);
            let max_debt = field(FORCED);
            let hold = (flags & HOLDS != 0).then(|| {
                let mut member = [0u8; 16];
                member.copy_from_slice(take(16));
                u128::from_be_bytes(member)
            });
            let spec = Spec {
                kind,
                a,
                b: bb,
                cost,
                flags: flags & !(TAKES | DELAYS | FORCED | HOLDS),
                take: want,
                max_delay_ms: delay,
                force: flags & FORCED != 0,
                max_debt,
                hold,
            };
            limits.push((call.keys[key - 1].to_owned(), spec));
        }
        out.push((gate, refund, limits));
    }
    assert_eq!(at, b.len(), "nothing left over");
    out
}

fn spec(kind: u8, a: u64) -> Spec {
    Spec {
        kind,
        a,
        b: a * 3,
        cost: a + 1,
        flags: 3,
        // Every other limit takes units beyond its cost, as a lease does.
        take: if a % 2 == 0 { a * 5 } else { 0 },
        // Every third may be delayed; every fifth is forced.
        max_delay_ms: if a % 3 == 0 { a + 500 } else { 0 },
        force: a % 5 == 0,
        max_debt: if a % 5 == 0 { a * 7 } else { 0 },
        // Every fourth holds a unit of a concurrency limit.
        hold: (a % 4 == 0).then_some(u128::MAX - u128::from(a)),
    }
}

fn request(keys: &[&str], gate: u8, refund_at: u64) -> Request {
    Request {
        keys: keys.iter().map(|k| Arc::from(*k)).collect(),
        limits: keys
            .iter()
            .enumerate()
            .map(|(i, _)| spec(kind::GCRA, i as u64 + 7))
            .collect(),
        blocked_from: gate,
        refund_at,
    }
}

#[test]
fn a_batch_reads_back_as_encoded_with_each_key_once() {
    let requests = [
        request(&["k1", "k2"], 255, 0),
        request(&["k2", "k3"], 0, 42),
    ];
    let call = encode(requests.iter());
    assert_eq!(call.keys, ["k1", "k2", "k3"]);
    assert_eq!(call.requests, 2);
    let back = read_back(&call);
    for (r, (gate, refund, limits)) in requests.iter().zip(back) {
        assert_eq!(gate, r.blocked_from);
        assert_eq!(refund, r.refund_at);
        let keys: Vec<&str> = limits.iter().map(|(k, _)| k.as_str()).collect();
        let expected: Vec<&str> = r.keys.iter().map(|k| k.as_ref()).collect();
        assert_eq!(keys, expected);
        let specs: Vec<Spec> = limits.into_iter().map(|(_, s)| s).collect();
        assert_eq!(specs, r.limits);
    }
}

#[test]
fn a_request_equal_to_the_one_before_is_one_byte() {
    let one = request(&["k1", "k2"], 255, 0);
    let other = request(&["k1", "k2"], 0, 0);
    let requests = [one.clone(), one.clone(), one.clone(), other, one.clone()];
    let call = encode(requests.iter());
    let alone = |r: &Request| encode(std::iter::once(r)).bytes.len();
    // The first, fourth and fifth are written out (a repeat is of the
    // request just before, not of any earlier one), the second and third
    // are a byte each.
    assert_eq!(call.bytes.len(), 2 * alone(&one) + 2 + alone(&requests[3]));
    let back = read_back(&call);
    assert_eq!(back.len(), 5);
    for (r, (gate, refund, limits)) in requests.iter().zip(back) {
        assert_eq!((gate, refund), (r.blocked_from, r.refund_at));
        let specs: Vec<Spec> = limits.into_iter().map(|(_, s)| s).collect();
        assert_eq!(specs, r.limits);
    }
}

#[test]
fn charges_become_the_scripts_numbers() {
    use crate::limits::algorithm::{Bucket, Window};
    use crate::testing::charge;
    let cases = [
        (
            Params::TokenBucket(Bucket::per_second(10, 2)),
            kind::TOKEN_BUCKET,
        ),
        (Params::Gcra(Bucket::per_second(10, 2)), kind::GCRA),
        (
            Params::FixedWindow(Window::seconds(5, 60)),
            kind::FIXED_WINDOW,
        ),
        (
            Params::SlidingWindow(Window::seconds(5, 60)),
            kind::SLIDING_WINDOW,
        ),
        (
            Params::SlidingLog(Window::seconds(5, 60)),
            kind::SLIDING_LOG,
        ),
    ];
    for (params, want) in cases {
        let c = Charge {
            group: crate::limits::Group::PreAuth,
            mode: crate::limits::Mode::Shadow,
            ..charge("l", "k", params, 3)
        };
        let s = Spec::of(&c);
        assert_eq!((s.kind, s.cost, s.flags), (want, 3, 0));
    }
    let enforced_in_group_1 = charge("l", "k", cases[0].0, 1);
    assert_eq!(Spec::of(&enforced_in_group_1).flags, 3);
    let with = |op| {
        Spec::of(&Charge {
            op,
            ..charge("l", "k", cases[0].0, 1)
        })
    };
    let taking = with(crate::limits::Op::Take { units: 40 });
    assert_eq!(
        (taking.take, taking.max_delay_ms, taking.force),
        (40, 0, false)
    );
    let delaying = with(crate::limits::Op::Decide {
        on_limit: crate::limits::OnLimit::Delay { max_ms: 500 },
    });
    assert_eq!(
        (delaying.take, delaying.max_delay_ms, delaying.force),
        (0, 500, false)
    );
    let forced = with(crate::limits::Op::Force { max_debt: 70 });
    assert_eq!(
        (
            forced.take,
            forced.max_delay_ms,
            forced.force,
            forced.max_debt
        ),
        (0, 0, true, 70)
    );
}

/// A reply as the script writes it.
fn reply(verdicts: &[(i64, i64, i64, i64, i64)], time: i64) -> Vec<u8> {
    let mut out = Vec::new();
    for &(a, r, w, t, g) in verdicts {
        for n in [a, r, w, t, g] {
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
    out.extend_from_slice(&time.to_le_bytes());
    out
}

#[test]
fn replies_decode_to_verdicts_and_the_store_time() {
    let bytes = reply(
        &[(1, 4, 0, 900, 12), (0, 0, 1500, 3000, 0), (0, 0, -1, 10, 0)],
        77,
    );
    let (verdicts, at) = decode(&bytes, 3).unwrap();
    assert_eq!(at, 77);
    let summary: Vec<_> = verdicts
        .iter()
        .map(|v| {
            (
                v.allowed,
                v.remaining,
                v.wait_ms,
                v.reset_ms,
                v.granted,
                v.at,
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (true, 4, Some(0), 900, 12, 77),
            (false, 0, Some(1500), 3000, 0, 77),
            (false, 0, None, 10, 0, 77),
        ]
    );
}

#[test]
fn a_reply_of_the_wrong_size_is_an_error() {
    let bytes = reply(&[(1, 1, 0, 0, 0)], 1);
    assert!(matches!(decode(&bytes, 2), Err(StoreError::Reply(_))));
    assert!(matches!(decode(&bytes[1..], 1), Err(StoreError::Reply(_))));
}

proptest! {
    #[test]
    fn any_batch_reads_back(
        shapes in prop::collection::vec(
            (prop::collection::vec(0u8..6, 0..5), prop::sample::select(vec![0u8, 1, 255]),
             any::<u64>(), 1usize..4),
            1..6),
    ) {
        // Each request written out 1-3 times in a row, as one busy
        // caller's requests come.
        let requests: Vec<Request> = shapes
            .iter()
            .flat_map(|(keys, gate, refund, times)| {
                let r = Request {
                    keys: keys.iter().map(|k| Arc::from(format!("key{k}"))).collect(),
                    limits: keys.iter().map(|&k| spec(k % 5 + 1, u64::from(k) * 1_000_003)).collect(),
                    blocked_from: *gate,
                    refund_at: *refund,
                };
                std::iter::repeat_n(r, *times)
            })
            .collect();
        let call = encode(requests.iter());
        let back = read_back(&call);
        prop_assert_eq!(back.len(), requests.len());
        for (r, (gate, refund, limits)) in requests.iter().zip(back) {
            prop_assert_eq!(gate, r.blocked_from);
            prop_assert_eq!(refund, r.refund_at);
            let specs: Vec<Spec> = limits.iter().map(|(_, s)| *s).collect();
            prop_assert_eq!(&specs, &r.limits);
        }
    }
}

#[test]
fn a_forced_charge_reports_what_it_left_uncharged() {
    // Limits a = 5 (forced), 6 (a take): the fifth number means each.
    let mut forced = request(&["k1"], 0, 0);
    forced.limits = vec![spec(kind::TOKEN_BUCKET, 5), spec(kind::TOKEN_BUCKET, 6)];
    let bytes = reply(&[(1, 0, 0, 10, 3), (1, 4, 0, 10, 30)], 77);
    let split = split(&bytes, &[&forced]).unwrap();
    let (verdicts, at) = &split[0];
    assert_eq!(*at, 77);
    assert_eq!((verdicts[0].uncharged, verdicts[0].granted), (3, 0));
    assert_eq!((verdicts[1].uncharged, verdicts[1].granted), (0, 30));
}
