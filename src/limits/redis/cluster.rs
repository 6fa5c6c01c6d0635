//! The shared store on Redis Cluster.
//!
//! A script call may only touch keys of one hash slot. A request's keys
//! share a slot when they are tenant-scoped (they carry the tenant's hash
//! tag), but a global or per-address limit lives elsewhere; so a request
//! is decided in two steps that keep it all-or-nothing:
//!
//! 1. every slot decides its part in one call of `lua/decide.lua` (a
//!    function, loaded on every primary), all slots at once, each charging
//!    what it admits;
//! 2. when one slot denied (or failed), the parts the others charged in the
//!    groups that are denied after all ([`settle`], the limiter's rule too)
//!    are given back by `lua/settle.lua`.
//!
//! Between the two steps the charged units are briefly unavailable to other
//! callers, so a budget can be under-used for a round trip, never over-used.
//! A refund that fails leaves the units charged until the key refills.
//!
//! Calls are batched per slot as on a standalone server: requests whose
//! part waits while a call for the same slot is in flight share the next.

use std::sync::{Arc, Mutex};

use crate::limits::{RecordChanges, RecordStore};

use async_trait::async_trait;
use futures_util::future::join_all;

use super::batch::{Batches, Bounds};
use super::codec::{self, Decided, Request};
use super::conn::Connection;
use crate::limits::keys::{KeyCache, KeyHasher, CACHED_KEYS};
use crate::limits::plan::{in_order, part_gate, settle, Part};
use crate::limits::{Charge, Gate, LimitStore, StoreError, Verdict};

/// One slot's charges, with their keys.
type SlotPart<'c> = (u16, Vec<&'c Charge>, Vec<Arc<str>>);

/// Hash slots of a Redis Cluster.
const SLOTS: u16 = 16_384;

/// Limit state in a Redis Cluster.
pub struct ClusterStore {
    batches: Batches<Connection>,
    keys: KeyCache,
}

impl ClusterStore {
    /// Prepares a client for the cluster reached through `seeds`; the
    /// connection is made on first use, so a gateway can start while the
    /// cluster is down.
    pub fn new(seeds: &[String], keys: KeyHasher, bounds: Bounds) -> Result<Self, StoreError> {
        Ok(Self {
            batches: Batches::new(Connection::cluster(seeds, bounds.timeout)?, bounds)?,
            keys: KeyCache::new(keys, CACHED_KEYS),
        })
    }

    /// `charges` grouped by their keys' slot, with their keys.
    fn by_slot<'c>(&self, charges: &[&'c Charge]) -> Vec<SlotPart<'c>> {
        let mut slots: Vec<SlotPart<'c>> = Vec::new();
        for c in charges {
            let key = self.keys.key(c);
            let s = slot(&key);
            match slots.iter_mut().find(|(other, ..)| *other == s) {
                Some((_, members, keys)) => {
                    members.push(c);
                    keys.push(key);
                }
                None => slots.push((s, vec![c], vec![key])),
            }
        }
        slots
    }

    /// One slot's part of a request, in that slot's next script call.
    async fn call(&self, slot: u16, request: Request) -> Result<Decided, StoreError> {
        codec::fits(&request)?;
        self.batches.submit(slot, request).await
    }
}

/// The cluster hash slot of a key: CRC16 of its hash tag (the first
/// non-empty `{…}`), or of the whole key.
pub fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &bytes[open + 1..];
        rest.iter()
            .position(|&b| b == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(bytes)) % SLOTS
}

/// The indices of `keys` grouped by hash slot, in order of first use.
fn by_slot(keys: &[Arc<str>]) -> Vec<(u16, Vec<usize>)> {
    let mut slots: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let s = slot(key);
        match slots.iter_mut().find(|(other, _)| *other == s) {
            Some((_, members)) => members.push(i),
            None => slots.push((s, vec![i])),
        }
    }
    slots
}

impl ClusterStore {
    /// One call per slot of `charges`, all at once, each limit on its own
    /// (no all-or-nothing across them: peeks, resets and credits); the
    /// verdicts in the charges' order.
    async fn per_slot(&self, charges: &[&Charge], mode: u64) -> Result<Vec<Verdict>, StoreError> {
        let keys: Vec<Arc<str>> = charges.iter().map(|c| self.keys.key(c)).collect();
        let slots = by_slot(&keys);
        let calls = slots.iter().map(|(s, members)| {
            let picked: Vec<&Charge> = members.iter().map(|&i| charges[i]).collect();
            let keys = members.iter().map(|&i| keys[i].clone()).collect();
            self.call(*s, Request::new(keys, &picked, Gate::Open, mode))
        });
        let mut verdicts = vec![None; charges.len()];
        for ((_, members), result) in slots.iter().zip(join_all(calls).await) {
            let (part, _) = result?;
            for (&i, v) in members.iter().zip(part) {
                verdicts[i] = Some(v);
            }
        }
        Ok(verdicts.into_iter().flatten().collect())
    }
}

#[async_trait]
impl LimitStore for ClusterStore {
    async fn decide(
        &self,
        charges: &[&Charge],
        blocked_from: Gate,
    ) -> Result<Vec<Verdict>, StoreError> {
        // The request's charges, by slot.
        let keys: Vec<Arc<str>> = charges.iter().map(|c| self.keys.key(c)).collect();
        let slots = by_slot(&keys);
        let part = |members: &[usize], refund_at: u64| {
            let picked: Vec<&Charge> = members.iter().map(|&i| charges[i]).collect();
            let keys = members.iter().map(|&i| keys[i].clone()).collect();
            Request::new(keys, &picked, blocked_from, refund_at)
        };

        // 1. Every slot decides its part, all at once.
        let decided = join_all(slots.iter().map(|(s, m)| self.call(*s, part(m, 0)))).await;
        let failure = decided.iter().find_map(|r| r.as_ref().err().cloned());
        let mut parts = Vec::with_capacity(slots.len());
        let mut answered = Vec::with_capacity(slots.len());
        for ((slot, members), result) in slots.iter().zip(&decided) {
            if let Ok((verdicts, at)) = result {
                parts.push(Part {
                    spent_below: part_gate(charges, members, verdicts, blocked_from),
                    members: members.clone(),
                    verdicts: verdicts.clone(),
                });
                answered.push((*slot, *at));
            }
        }
        // Nothing stays charged when a slot failed: the caller then applies
        // each limit's failure mode.
        let settled = settle(
            charges,
            &parts,
            if failure.is_some() {
                Gate::SHUT
            } else {
                blocked_from
            },
        );
        let mut verdicts = in_order(&parts, charges.len());

        // 2. Give back what a slot charged in groups denied after all,
        // each undone charge its cost and what it took beyond it.
        let mut refunds = Vec::new();
        for ((slot, at), undo) in answered.iter().zip(&settled.undo) {
            if undo.is_empty() {
                continue;
            }
            let mut back = Vec::with_capacity(undo.len());
            for &i in undo {
                let granted = verdicts[i].map_or(0, |v| v.granted);
                if let Some(v) = verdicts[i].as_mut() {
                    // Admissible but not charged: what is left is untouched.
                    v.remaining += charges[i].cost + granted;
                    v.granted = 0;
                }
                back.push(Charge {
                    cost: charges[i].cost + granted,
                    op: charges[i].op.without_take(),
                    ..charges[i].clone()
                });
            }
            let back: Vec<&Charge> = back.iter().collect();
            let keys = undo.iter().map(|&i| keys[i].clone()).collect();
            refunds.push(self.call(*slot, Request::new(keys, &back, blocked_from, *at)));
        }
        for refund in join_all(refunds).await {
            if let Err(e) = refund {
                tracing::warn!(target: crate::logs::STORE, error = %e, "giving back a cluster slot's charges failed; they stay charged until the keys refill");
            }
        }

        if let Some(e) = failure {
            return Err(e);
        }
        Ok(verdicts.into_iter().flatten().collect())
    }

    async fn give_back(&self, charges: &[&Charge], spent_at: u64) -> Result<(), StoreError> {
        let calls = self.by_slot(charges).into_iter().map(|(s, members, keys)| {
            self.call(s, Request::new(keys, &members, Gate::Open, spent_at.max(1)))
        });
        join_all(calls)
            .await
            .into_iter()
            .try_for_each(|r| r.map(drop))
    }

    fn release_now(&self, charges: &[&Charge], failed: crate::limits::ReleaseFailed) -> bool {
        // Every slot's part queued before this returns; when one cannot
        // be, the caller gives them all back later, and when one fails
        // they are all tried again (a release twice is one release).
        let failed = Arc::new(Mutex::new(Some(failed)));
        self.by_slot(charges).into_iter().all(|(s, members, keys)| {
            let request = Request::new(keys, &members, Gate::Open, 1);
            let failed = failed.clone();
            codec::fits(&request).is_ok()
                && self.batches.queue_now(s, request, move |e| {
                    super::released_badly(&e);
                    let once = failed.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(failed) = once {
                        failed(e);
                    }
                })
        })
    }

    /// Each slot's charges read in one call, all slots at once; nothing is
    /// reserved, so nothing needs confirming or giving back.
    async fn peek(&self, charges: &[&Charge]) -> Result<Vec<Verdict>, StoreError> {
        self.per_slot(charges, codec::PEEK).await
    }

    async fn reset(&self, charges: &[&Charge]) -> Result<(), StoreError> {
        self.per_slot(charges, codec::RESET).await.map(drop)
    }

    async fn credit(&self, charges: &[&Charge]) -> Result<Vec<Verdict>, StoreError> {
        self.per_slot(charges, codec::CREDIT).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.batches.ping().await
    }

    fn pending(&self) -> usize {
        self.batches.pending()
    }
}

#[async_trait]
impl RecordStore for ClusterStore {
    async fn records_version(&self) -> Result<u64, StoreError> {
        super::records::version(&self.batches, self.keys.hasher()).await
    }

    async fn records(&self, kind: &str) -> Result<Vec<String>, StoreError> {
        super::records::all(&self.batches, self.keys.hasher(), kind).await
    }

    fn record_field(&self, kind: &str, id: &str) -> String {
        self.keys.hasher().record(kind, id).1
    }

    async fn record_at(&self, kind: &str, field: &str) -> Result<Option<String>, StoreError> {
        super::records::get(&self.batches, self.keys.hasher(), kind, field).await
    }

    async fn put_record_at(
        &self,
        kind: &str,
        field: &str,
        value: Option<&str>,
    ) -> Result<bool, StoreError> {
        super::records::put(&self.batches, self.keys.hasher(), kind, field, value).await
    }

    async fn record_changes(&self, cursor: &str) -> Result<RecordChanges, StoreError> {
        super::records::changes(&self.batches, self.keys.hasher(), cursor).await
    }
}

#[cfg(test)]
mod tests {
    use super::slot;

    #[test]
    fn slots_follow_the_cluster_specification() {
        // CRC16/XMODEM's check value, then values from the Redis Cluster
        // specification and `CLUSTER KEYSLOT`.
        assert_eq!(slot("123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12_182);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        // An empty first tag: the whole key is hashed.
        let whole = crc16::State::<crc16::XMODEM>::calculate(b"foo{}{bar}") % 16_384;
        assert_eq!(slot("foo{}{bar}"), whole);
        assert_ne!(slot("foo{}{bar}"), slot("bar"));
        assert_eq!(slot("foo{{bar}}zap"), slot("{bar"));
        assert_eq!(slot("foo{bar}{zap}"), slot("bar"));
    }
}
