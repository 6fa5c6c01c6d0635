//! The wire format of the scripts of `lua/`: what a script call carries and what
//! it answers, as plain bytes. Nothing here talks to Redis, so the format is
//! tested on its own, in both directions.
//!
//! A call carries its distinct keys as `KEYS`, then `ARGV[1]` the time (0:
//! the server's `TIME`), `ARGV[2]` the number of requests and `ARGV[3]` one
//! binary string: per request its gate (1 byte), its limit count (2 bytes)
//! and its refund time (8 bytes), then per limit the key's index (4 bytes),
//! the algorithm (1 byte), its two parameters and the cost (8 bytes each),
//! its flags (1 byte: bit 0 enforced, bit 1 the group, bit 2 a take
//! follows, bit 3 a longest delay follows, bit 4 forced, bit 5 a hold
//! follows) and then, as the flags say, the units to take beyond the cost,
//! the longest delay in ms and a forced charge's deepest debt in units (8
//! bytes each), and a concurrency limit's hold (16 bytes, big-endian: the
//! member of its sorted set). All numbers are little-endian. The reply is
//! one binary string: five `i64`s per limit (admitted: 1, 0, or 2 when
//! after a delay; remaining; wait or -1, or the delay when 2; reset; units
//! taken, for a forced charge the units left uncharged, for a hold the
//! expired holds reclaimed), then the store time of the decision.

use std::collections::HashMap;
use std::sync::Arc;

use super::super::algorithm::Params;
use super::super::{Charge, Gate, StoreError, Verdict};

/// The algorithm numbers the scripts know (`ALGORITHMS` in `lua/limits.lua`).
pub mod kind {
    /// `token_bucket`: a = capacity in micro-tokens, b = micro-tokens per ms.
    pub const TOKEN_BUCKET: u8 = 1;
    /// `gcra`: a and b as for a token bucket.
    pub const GCRA: u8 = 2;
    /// `fixed_window`: a = limit, b = window in ms.
    pub const FIXED_WINDOW: u8 = 3;
    /// `sliding_window`: a and b as for a fixed window.
    pub const SLIDING_WINDOW: u8 = 4;
    /// `sliding_log`: a and b as for a fixed window.
    pub const SLIDING_LOG: u8 = 5;
    /// `quota`: a = limit, b = the period (1 day, 2 month, UTC).
    pub const QUOTA: u8 = 6;
    /// `concurrency`: a = max_in_flight, b = hold_ttl_ms.
    pub const CONCURRENCY: u8 = 7;
}

/// The refund time that asks the script to peek: read every limit, charge
/// and write nothing (`-1` as the script reads it).
pub const PEEK: u64 = u64::MAX;
/// The refund time that asks the script to start every limit's key afresh
/// (`-2`).
pub const RESET: u64 = u64::MAX - 1;
/// The refund time that asks the script to give each limit's cost back
/// now (`-3`).
pub const CREDIT: u64 = u64::MAX - 2;

/// Bytes of one request's header in the call.
const REQUEST_HEAD: usize = 1 + 2 + 8;
/// A request that is the one before it again, byte for byte: sent as this
/// one byte in place of a gate (never a group's number, nor 255).
const SAME: u8 = 254;
/// Bytes of one limit in the call, without a take.
const LIMIT: usize = 4 + 1 + 3 * 8 + 1;
/// Flag bit: a take follows the limit's flags.
const TAKES: u8 = 4;
/// Flag bit: a longest delay follows (after the take, if any).
const DELAYS: u8 = 8;
/// Flag bit: charged whatever the state (a cost learnt after the response).
const FORCED: u8 = 16;
/// Flag bit: a hold follows (after the debt, if any).
const HOLDS: u8 = 32;
/// Bytes of one number in the script's reply.
const NUMBER: usize = 8;
/// Bytes of one limit's verdict in the script's reply.
const VERDICT: usize = 5 * NUMBER;

/// One limit as the script reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// The algorithm, one of [`kind`].
    pub kind: u8,
    /// The first parameter: a capacity or a limit.
    pub a: u64,
    /// The second parameter: a rate or a window length.
    pub b: u64,
    /// Whole units charged.
    pub cost: u64,
    /// `group * 2 + 1` when enforced, `group * 2` for shadow limits.
    pub flags: u8,
    /// Units to take beyond the cost, as many as fit (a lease); 0 for none.
    pub take: u64,
    /// The longest delay a cost may be admitted after, in ms; 0 for none.
    pub max_delay_ms: u64,
    /// Charged whatever the state, gating nothing.
    pub force: bool,
    /// A forced charge's deepest debt, in units.
    pub max_debt: u64,
    /// A concurrency limit's hold.
    pub hold: Option<u128>,
}

impl Spec {
    /// The script's numbers for one charge.
    pub fn of(charge: &Charge) -> Self {
        let (kind, a, b) = match charge.params {
            Params::TokenBucket(b) => (kind::TOKEN_BUCKET, b.capacity, b.per_ms),
            Params::Gcra(b) => (kind::GCRA, b.capacity, b.per_ms),
            Params::FixedWindow(w) => (kind::FIXED_WINDOW, w.limit, w.window_ms),
            Params::SlidingWindow(w) => (kind::SLIDING_WINDOW, w.limit, w.window_ms),
            Params::SlidingLog(w) => (kind::SLIDING_LOG, w.limit, w.window_ms),
            Params::Quota(q) => (kind::QUOTA, q.limit, q.period.code()),
            Params::Concurrency(c) => (kind::CONCURRENCY, c.max_in_flight, c.hold_ttl_ms),
        };
        Spec {
            kind,
            a,
            b,
            cost: charge.cost,
            flags: charge.group.wire() * 2 + u8::from(charge.enforced()),
            take: charge.op.units(),
            max_delay_ms: charge.op.max_delay_ms(),
            force: charge.op.is_force(),
            max_debt: charge.op.max_debt(),
            hold: charge.hold,
        }
    }
}

/// One request's shared limits, as the script reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The store key of each limit.
    pub keys: Vec<Arc<str>>,
    /// The limits, in the request's order.
    pub limits: Vec<Spec>,
    /// The first group that may not be charged.
    pub blocked_from: u8,
    /// 0 to decide; otherwise the store time at which these charges were
    /// spent by a decision since undone, to give them back.
    pub refund_at: u64,
}

impl Request {
    /// The script's view of some charges, stored under `keys`.
    pub fn new(
        keys: Vec<Arc<str>>,
        charges: &[&Charge],
        blocked_from: Gate,
        refund_at: u64,
    ) -> Self {
        Self {
            keys,
            limits: charges.iter().map(|c| Spec::of(c)).collect(),
            blocked_from: blocked_from.wire(),
            refund_at,
        }
    }
}

/// The verdicts of a request and the store time they were reached at.
pub type Decided = (Vec<Verdict>, u64);

/// The arguments of one script call for some requests.
#[derive(Debug, PartialEq, Eq)]
pub struct Call<'a> {
    /// Distinct keys, in first-use order.
    pub keys: Vec<&'a str>,
    /// How many requests the bytes hold.
    pub requests: usize,
    /// Every request's numbers.
    pub bytes: Vec<u8>,
}

/// Encodes some requests as one call.
pub fn encode<'a>(requests: impl Iterator<Item = &'a Request> + Clone) -> Call<'a> {
    let mut index: HashMap<&str, u32, ahash::RandomState> = HashMap::default();
    let mut keys: Vec<&str> = Vec::new();
    let size = requests
        .clone()
        .map(|r| REQUEST_HEAD + r.limits.len() * (LIMIT + 32))
        .sum();
    let mut bytes = Vec::with_capacity(size);
    let mut count = 0;
    // Where the last request written out lies in `bytes`.
    let mut previous = 0..0;
    for r in requests {
        count += 1;
        debug_assert_ne!(r.blocked_from, SAME, "a gate is a group's number or 255");
        let start = bytes.len();
        bytes.push(r.blocked_from);
        bytes.extend_from_slice(&(r.limits.len() as u16).to_le_bytes());
        bytes.extend_from_slice(&r.refund_at.to_le_bytes());
        for (key, l) in r.keys.iter().zip(&r.limits) {
            let k = *index.entry(key).or_insert_with(|| {
                keys.push(key);
                keys.len() as u32
            });
            bytes.extend_from_slice(&k.to_le_bytes());
            bytes.push(l.kind);
            for n in [l.a, l.b, l.cost] {
                bytes.extend_from_slice(&n.to_le_bytes());
            }
            let mut flags = l.flags;
            if l.take > 0 {
                flags |= TAKES;
            }
            if l.max_delay_ms > 0 {
                flags |= DELAYS;
            }
            if l.force {
                flags |= FORCED;
            }
            if l.hold.is_some() {
                flags |= HOLDS;
            }
            bytes.push(flags);
            if l.take > 0 {
                bytes.extend_from_slice(&l.take.to_le_bytes());
            }
            if l.max_delay_ms > 0 {
                bytes.extend_from_slice(&l.max_delay_ms.to_le_bytes());
            }
            if l.force {
                bytes.extend_from_slice(&l.max_debt.to_le_bytes());
            }
            if let Some(hold) = l.hold {
                bytes.extend_from_slice(&hold.to_be_bytes());
            }
        }
        // One caller's requests of a batch are often the same (a hold's id
        // never is): the script reads a repeat as one byte.
        if bytes[start..] == bytes[previous.clone()] {
            bytes.truncate(start);
            bytes.push(SAME);
        } else {
            previous = start..bytes.len();
        }
    }
    Call {
        keys,
        requests: count,
        bytes,
    }
}

/// Refuses a request the script cannot read: it reads a request's limit
/// count as 16 bits.
pub fn fits(request: &Request) -> Result<(), StoreError> {
    if request.limits.len() > usize::from(u16::MAX) {
        return Err(StoreError::Refused(format!(
            "{} shared limits on one request; at most {} fit one script call",
            request.limits.len(),
            u16::MAX
        )));
    }
    Ok(())
}

/// The reply of one call for `batch`, split into each request's part.
pub fn split(reply: &[u8], batch: &[&Request]) -> Result<Vec<Decided>, StoreError> {
    let limits = batch.iter().map(|r| r.limits.len()).sum();
    let (verdicts, at) = decode(reply, limits)?;
    let mut verdicts = verdicts.into_iter();
    Ok(batch
        .iter()
        .map(|r| {
            let verdicts = r
                .limits
                .iter()
                .zip(verdicts.by_ref())
                .map(|(l, v)| match (l.hold, l.force) {
                    (Some(_), _) => held(v),
                    (None, true) => forced(v),
                    (None, false) => v,
                })
                .collect();
            (verdicts, at)
        })
        .collect())
}

/// A forced charge's verdict: its fifth number is the units it left
/// uncharged, not units taken.
fn forced(v: Verdict) -> Verdict {
    v.with_uncharged(v.granted).with_granted(0)
}

/// A hold's verdict: its fifth number is the expired holds reclaimed.
fn held(v: Verdict) -> Verdict {
    v.with_reclaimed(v.granted).with_granted(0)
}

/// The script's reply for `limits` limits: their verdicts in order, and the
/// store time they were decided at.
pub fn decode(reply: &[u8], limits: usize) -> Result<Decided, StoreError> {
    let expected = limits * VERDICT + NUMBER;
    if reply.len() != expected {
        return Err(StoreError::Reply(format!(
            "the script replied {} bytes, expected {expected}",
            reply.len()
        )));
    }
    let (verdicts, time) = reply.split_at(limits * VERDICT);
    let at = number(time, 0).max(0) as u64;
    let verdicts = verdicts
        .chunks_exact(VERDICT)
        .map(|v| verdict(v, at))
        .collect();
    Ok((verdicts, at))
}

/// The `i`th little-endian `i64` of `bytes`.
fn number(bytes: &[u8], i: usize) -> i64 {
    let mut word = [0u8; NUMBER];
    word.copy_from_slice(&bytes[i * NUMBER..(i + 1) * NUMBER]);
    i64::from_le_bytes(word)
}

/// One limit's verdict, reached at store time `at`: five little-endian
/// `i64`s.
fn verdict(bytes: &[u8], at: u64) -> Verdict {
    let n = |i: usize| number(bytes, i);
    // 2: admitted after a delay, which the wait field then holds.
    let delayed = n(0) == 2;
    let wait_ms = if delayed {
        Some(0)
    } else {
        u64::try_from(n(2)).ok()
    };
    Verdict::decided(
        n(0) >= 1,
        n(1).max(0) as u64,
        wait_ms,
        n(3).max(0) as u64,
        at,
    )
    .with_granted(n(4).max(0) as u64)
    .with_delay(if delayed { n(2).max(0) as u64 } else { 0 })
}

#[cfg(test)]
mod tests;
