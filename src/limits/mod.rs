//! Rate limits: the algorithms, the charges a request makes against its
//! limits, the store seam, and the all-or-nothing decision over them.
//!
//! Shared logic (key material, combining verdicts into one decision) lives
//! here; stores only hold state and apply [`algorithm`] to it.

pub mod algorithm;
pub mod breaker;
pub mod holds;
pub mod keys;
pub mod lease;
pub mod limiter;
pub mod memory;
pub mod meter;
pub mod plan;
pub mod redis;

use std::net::IpAddr;
use std::sync::Arc;

use async_trait::async_trait;

use algorithm::{HoldId, Params};

pub use crate::ids::{LimitId, PlanId};

/// The identity dimensions a limit's key is built from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct KeyDims {
    /// Keyed by the client network.
    pub ip: bool,
    /// Keyed by the credential id.
    pub credential: bool,
    /// Keyed by the credential's tenant.
    pub tenant: bool,
    /// Keyed by the route class.
    pub route: bool,
}

/// What a shared limit does while the store is failing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    /// Admit.
    Open,
    /// Refuse with 503.
    #[default]
    Closed,
    /// Enforce this instance's share of the budget.
    Local,
}

/// Whether a limit may deny.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Denials refuse the request.
    #[default]
    Enforce,
    /// Decided and counted, never denying.
    Shadow,
}

/// Where a limit's decisions are made: one of three, so that a limit can
/// never be both decided in this process and leased from the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// In this process alone (`store: local`, or the memory store), or by
    /// the local fallback while the store fails.
    Local,
    /// In the shared store, each decision a store call (`sync: exact`).
    Exact,
    /// Against units this instance took from the shared budget ahead of
    /// time, instead of one store call per request (`sync: lease`).
    Lease(LeaseTerms),
}

impl SyncMode {
    /// Whether it is decided in this process.
    pub fn is_local(self) -> bool {
        self == SyncMode::Local
    }

    /// The lease's terms, for `sync: lease`.
    pub fn lease(self) -> Option<LeaseTerms> {
        match self {
            SyncMode::Lease(terms) => Some(terms),
            _ => None,
        }
    }
}

/// What a limit does with a request whose cost does not fit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnLimit {
    /// Refuses it at once (429).
    #[default]
    Reject,
    /// Admits it after a wait, when the cost fits within `max_ms`
    /// (`on_limit: delay`), charged now for the instant it fits.
    Delay {
        /// The longest wait a request is held for.
        max_ms: u64,
    },
}

impl OnLimit {
    /// A wait of at most `max_ms`, or (for 0) none.
    pub fn delay_up_to(max_ms: u64) -> Self {
        match max_ms {
            0 => OnLimit::Reject,
            max_ms => OnLimit::Delay { max_ms },
        }
    }

    /// The longest wait a cost may be admitted after (0: none).
    pub fn max_delay_ms(self) -> u64 {
        match self {
            OnLimit::Reject => 0,
            OnLimit::Delay { max_ms } => max_ms,
        }
    }
}

/// The order in which a request's limits are decided and charged: a group
/// is charged only if every enforced limit of it and of the groups before
/// it admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Group {
    /// Limits decided before authentication (`scope: pre_auth`).
    PreAuth,
    /// The route's other limits, decided once the key is known.
    Request,
}

impl Group {
    /// The group's number in the Redis script's wire format.
    pub fn wire(self) -> u8 {
        self as u8
    }
}

/// Where a decision stops charging: the groups before it may be charged;
/// it and every later group are only checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Gate {
    /// Charging stops at this group.
    At(Group),
    /// Every group may be charged.
    Open,
}

impl Gate {
    /// Nothing may be charged.
    pub const SHUT: Gate = Gate::At(Group::PreAuth);

    /// Whether charges of `group` may be spent.
    pub fn admits(self, group: Group) -> bool {
        Gate::At(group) < self
    }

    /// The gate in the Redis script's wire format: its group's number, or
    /// 255 when open.
    pub fn wire(self) -> u8 {
        match self {
            Gate::At(group) => group.wire(),
            Gate::Open => u8::MAX,
        }
    }
}

/// One request's charge against one limit.
#[derive(Debug, Clone)]
pub struct Charge {
    /// The limit charged.
    pub limit: LimitId,
    /// Its name, for metrics, headers and the 429 body.
    pub name: Arc<str>,
    /// The parameters it runs with for this caller (after the plan's override).
    pub params: Params,
    /// The limit's key material for this caller: the identity dimensions
    /// joined. Shared stores never see it in the clear.
    pub key: String,
    /// The tenant, when the key is tenant-scoped (tenant or credential):
    /// shared stores derive a hash tag from it so the keys share a slot.
    pub tenant: Option<Arc<str>>,
    /// What the request spends, in whole units.
    pub cost: u64,
    /// Enforced, or (shadow) decided and counted, never denying.
    pub mode: Mode,
    /// Decision order: a group is charged only if every enforced limit of
    /// it and of the groups before it admits.
    pub group: Group,
    /// Where it is decided: in this process, in the shared store, or
    /// against a lease of the shared budget.
    pub sync: SyncMode,
    /// What a shared limit does while the store is failing.
    pub on_store_error: OnStoreError,
    /// What the charge does to its limit.
    pub op: Op,
    /// The request's hold on a concurrency limit: taken when the charge
    /// is spent, renewed when it is forced, released when it is given
    /// back. `None` for every other limit.
    pub hold: Option<HoldId>,
}

impl Charge {
    /// Whether a denial of it refuses the request (not a shadow limit).
    pub fn enforced(&self) -> bool {
        self.mode == Mode::Enforce
    }

    /// Whether it is decided in this process.
    pub fn is_local(&self) -> bool {
        self.sync.is_local()
    }

    /// The terms it is leased on, for `sync: lease`.
    pub fn lease(&self) -> Option<LeaseTerms> {
        self.sync.lease()
    }
}

/// What a charge does to its limit: each meaning with only what it needs,
/// so that no charge can both delay and take, or be forced and delayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Decided with the request's other charges, all-or-nothing; a cost
    /// that does not fit is refused, or admitted after a wait
    /// ([`OnLimit`]).
    Decide {
        /// What a cost that does not fit gets.
        on_limit: OnLimit,
    },
    /// Decided as [`Op::Decide`] without delay, then up to `units` more
    /// taken, as many as fit: a lease's take or renewal.
    Take {
        /// Units wanted beyond the cost.
        units: u64,
    },
    /// Charged whatever the state, never gating the others: a cost learnt
    /// after the response. The limit goes into debt of at most
    /// `max_debt` units (its balance at most that far below empty, its
    /// count that far above its limit); what would go deeper is not
    /// charged, and the verdict says how much (`uncharged`).
    Force {
        /// The deepest debt the charge may leave, in whole units.
        max_debt: u64,
    },
}

impl Op {
    /// A plain decision, refused at once when the cost does not fit.
    pub const DECIDE: Op = Op::Decide {
        on_limit: OnLimit::Reject,
    };

    /// Units to take beyond the cost (0 but for [`Op::Take`]).
    pub fn units(self) -> u64 {
        match self {
            Op::Take { units } => units,
            _ => 0,
        }
    }

    /// The longest delay a cost may be admitted after (0 but for a
    /// delaying [`Op::Decide`]).
    pub fn max_delay_ms(self) -> u64 {
        match self {
            Op::Decide { on_limit } => on_limit.max_delay_ms(),
            _ => 0,
        }
    }

    /// Whether the charge is forced.
    pub fn is_force(self) -> bool {
        matches!(self, Op::Force { .. })
    }

    /// The deepest debt a forced charge may leave (0 but for
    /// [`Op::Force`]).
    pub fn max_debt(self) -> u64 {
        match self {
            Op::Force { max_debt } => max_debt,
            _ => 0,
        }
    }

    /// The same charge without what it takes beyond its cost: what giving
    /// it back returns.
    pub fn without_take(self) -> Op {
        match self {
            Op::Take { .. } => Op::DECIDE,
            other => other,
        }
    }
}

/// The terms of `sync: lease` for one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseTerms {
    /// Units an instance asks for per key, at first and after a refusal.
    pub units: u64,
    /// Units unspent this long after they were taken go back.
    pub ttl_ms: u64,
    /// The most an instance holds per key: a lease grows towards it under
    /// steady demand (`units` for a fixed size).
    pub max_units: u64,
}

/// How a verdict was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// By the store that holds the limit.
    Store,
    /// The store failed and the limit admits (`on_store_error: open`).
    FailOpen,
    /// The store failed and the limit refuses (`on_store_error: closed`).
    FailClosed,
    /// The store failed; decided by this instance's share of the budget.
    Fallback,
    /// Not decided: the gateway was too busy to have the store decide in
    /// time while the store itself answered. The request is shed (503),
    /// nothing is charged, and no failure mode applies.
    Shed(Overload),
}

/// Why a decision was shed: the gateway's own overload, never the store's
/// failure (a store that answers is not failing, however late a decision
/// was).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Overload {
    /// `store.max_pending` decisions were already waiting for the store.
    Pending,
    /// The decision's deadline (`store.timeout_ms` from when it was
    /// queued) passed before it could be sent, behind calls that were out.
    Wait,
}

impl Overload {
    /// The `reason` label of `tollgate_overload_shed_total`.
    pub fn reason(self) -> &'static str {
        match self {
            Overload::Pending => "store_pending",
            Overload::Wait => "store_wait",
        }
    }
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
    /// How the verdict was reached.
    pub source: Source,
    /// Units taken beyond the cost (see [`Op::Take`]).
    pub granted: u64,
    /// The store's time of the decision (ms), which giving back needs.
    pub at: u64,
    /// Admitted after this many ms (`on_limit: delay`); 0 for now.
    pub delay_ms: u64,
    /// Units of a forced charge that were not charged because the limit
    /// was at its deepest debt (see [`Op::Force`]).
    pub uncharged: u64,
    /// Holds of a concurrency limit found expired and dropped by this
    /// decision: their requests' instances stopped renewing them.
    pub reclaimed: u64,
}

impl Verdict {
    /// What the store that holds the limit said, at its time `at`: the
    /// limit admits the cost or not, `remaining` whole units are left,
    /// the cost fits in `wait_ms` (`None`: never), the key is back to its
    /// initial state in `reset_ms`. Nothing taken, no delay.
    pub fn decided(
        allowed: bool,
        remaining: u64,
        wait_ms: Option<u64>,
        reset_ms: u64,
        at: u64,
    ) -> Self {
        Self {
            allowed,
            remaining,
            wait_ms,
            reset_ms,
            source: Source::Store,
            granted: 0,
            at,
            delay_ms: 0,
            uncharged: 0,
            reclaimed: 0,
        }
    }

    /// Not decided by the store: a failure mode's answer, or a shed
    /// decision (`source` says which).
    pub fn undecided(allowed: bool, source: Source) -> Self {
        Self {
            source,
            ..Self::decided(allowed, 0, None, 0, 0)
        }
    }

    /// With `units` taken beyond the cost.
    #[must_use]
    pub fn with_granted(self, units: u64) -> Self {
        Self {
            granted: units,
            ..self
        }
    }

    /// Admitted after `ms`.
    #[must_use]
    pub fn with_delay(self, ms: u64) -> Self {
        Self {
            delay_ms: ms,
            ..self
        }
    }

    /// With `units` of a forced charge left uncharged.
    #[must_use]
    pub fn with_uncharged(self, units: u64) -> Self {
        Self {
            uncharged: units,
            ..self
        }
    }

    /// With `holds` expired holds reclaimed.
    #[must_use]
    pub fn with_reclaimed(self, holds: u64) -> Self {
        Self {
            reclaimed: holds,
            ..self
        }
    }
}

/// The decision for one group of a request's charges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Every enforced limit of the group admits.
    Allow,
    /// At least one enforced limit denied; nothing was charged.
    Deny {
        /// Names of the enforced limits that denied.
        violated: Vec<Arc<str>>,
        /// Whole seconds (at least 1) until a retry could succeed, or `None`
        /// when the cost can never fit one of the limits.
        retry_after: Option<u64>,
    },
    /// The store is failing and an enforced limit says `closed`.
    Unavailable,
    /// The gateway could not have the decision made in time: shed.
    Shed(Overload),
}

/// Why a store could not decide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No answer within `store.timeout_ms`.
    #[error("store call timed out")]
    Timeout,
    /// The breaker is open: no call was made.
    #[error("store circuit is open")]
    CircuitOpen,
    /// The store could not be reached, or the connection broke.
    #[error("store connection failed: {0}")]
    Connection(String),
    /// The store answered with an error of its own: a failing script, or a
    /// refusal such as `READONLY` or `BUSY`.
    #[error("store script failed: {0}")]
    Script(String),
    /// The store answered something that is not a decision of this call.
    #[error("store reply unreadable: {0}")]
    Reply(String),
    /// The gateway did not send the call (it cannot be encoded, or the
    /// store's driver stopped).
    #[error("store call refused: {0}")]
    Refused(String),
    /// The gateway was too busy to have the store decide in time: not a
    /// failure of the store, which is judged on its calls.
    #[error("decision shed: the gateway is overloaded ({})", .0.reason())]
    Overloaded(Overload),
}

impl StoreError {
    /// The `reason` label of `tollgate_store_errors_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            StoreError::Timeout => "timeout",
            StoreError::CircuitOpen => "circuit_open",
            StoreError::Connection(_) => "connection",
            StoreError::Script(_) => "script",
            StoreError::Reply(_) => "reply",
            StoreError::Refused(_) => "refused",
            StoreError::Overloaded(o) => o.reason(),
        }
    }

    /// Whether the error says the store is failing (and so counts towards
    /// the breaker and hands decisions to `on_store_error`). An overloaded
    /// gateway is not a failing store.
    pub fn is_failure(&self) -> bool {
        !matches!(self, StoreError::Overloaded(_))
    }
}

/// Told once when a release queued at once fails in the store.
pub type ReleaseFailed = Box<dyn FnOnce(StoreError) + Send>;

/// The seam between the decision logic and where limit state lives.
///
/// Every call is bounded by the store itself: a decision waits at most
/// `timeout_ms` to be sent ([`StoreError::Overloaded`] beyond: the gateway
/// was busy), then its call's bound ([`StoreError::Timeout`] when the
/// store answered nothing in it).
///
/// `decide` refreshes every charge's key and checks every one without
/// spending; then it charges the admitted charges of every group below the
/// gate: the first group holding an enforced denial, or `blocked_from` when
/// that comes first (an earlier part of the decision already denied it).
#[async_trait]
pub trait LimitStore: Send + Sync {
    /// Decides and spends `charges` as described above; one verdict per charge,
    /// in the same order.
    async fn decide(
        &self,
        charges: &[&Charge],
        blocked_from: Gate,
    ) -> Result<Vec<Verdict>, StoreError>;

    /// Gives back `cost` of each charge, spent at store time `spent_at`:
    /// a lease's unspent units. Nothing grows beyond its initial state, and
    /// a window that has rolled since is left alone.
    async fn give_back(&self, charges: &[&Charge], spent_at: u64) -> Result<(), StoreError>;

    /// Queues the give-back of these holds (as [`LimitStore::give_back`])
    /// at once, before this returns, without waiting for it: a decision
    /// queued after it is decided after it. `false` when this store
    /// cannot, or is too busy to (the caller gives them back itself).
    /// `failed` is told if the call then fails (the holds may still be
    /// held: the caller tries again).
    fn release_now(&self, charges: &[&Charge], failed: ReleaseFailed) -> bool {
        let _ = (charges, failed);
        false
    }

    /// What each charge's limit holds now, charging nothing and writing
    /// nothing: whether its cost would fit, the whole units left before it
    /// (`remaining`), the wait until it would fit, and the reset. For
    /// operators (`/admin/explain`), never on the request path.
    async fn peek(&self, charges: &[&Charge]) -> Result<Vec<Verdict>, StoreError> {
        let _ = charges;
        Err(StoreError::Refused(
            "this store cannot be read without charging".into(),
        ))
    }

    /// Starts each charge's key afresh: full, its window or period empty
    /// (an operator's reset).
    async fn reset(&self, charges: &[&Charge]) -> Result<(), StoreError> {
        let _ = charges;
        Err(StoreError::Refused("this store cannot reset a key".into()))
    }

    /// Gives each charge's `cost` back to its key now, capped at its
    /// initial state (an operator's credit); what each holds after, as
    /// [`LimitStore::peek`] reads it for a cost of 0.
    async fn credit(&self, charges: &[&Charge]) -> Result<Vec<Verdict>, StoreError> {
        let _ = charges;
        Err(StoreError::Refused("this store cannot credit a key".into()))
    }

    /// Whether the store answers at all (readiness probes).
    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Decisions waiting for the store (queued or in a call).
    fn pending(&self) -> usize {
        0
    }
}

/// Where operators' records live beside the limits (revocations,
/// overrides, the store's credentials): every instance's to read, changed
/// through a version and a change feed. Apart from [`LimitStore`], so
/// that the limits' seam holds only what deciding needs.
#[async_trait]
pub trait RecordStore: Send + Sync {
    /// Admin records kept beside the limits (revocations, …), every
    /// instance's to read: the number every change of a record moves.
    async fn records_version(&self) -> Result<u64, StoreError> {
        Err(StoreError::Refused(
            "this store keeps no admin records".into(),
        ))
    }

    /// Every record of `kind`, as the JSON texts they were put as.
    async fn records(&self, kind: &str) -> Result<Vec<String>, StoreError> {
        let _ = kind;
        Err(StoreError::Refused(
            "this store keeps no admin records".into(),
        ))
    }

    /// Puts (or with `None` removes) the record of `kind` about `id`, and
    /// moves the version. Returns whether a record was there before.
    async fn put_record(
        &self,
        kind: &str,
        id: &str,
        value: Option<&str>,
    ) -> Result<bool, StoreError> {
        self.put_record_at(kind, &self.record_field(kind, id), value)
            .await
    }

    /// The field the record of `kind` about `id` is kept under: a keyed
    /// hash in a shared store, so that a dump of it names nothing.
    fn record_field(&self, kind: &str, id: &str) -> String {
        let _ = kind;
        id.to_owned()
    }

    /// The record of `kind` kept under `field`, if any.
    async fn record_at(&self, kind: &str, field: &str) -> Result<Option<String>, StoreError> {
        let _ = (kind, field);
        Err(StoreError::Refused(
            "this store keeps no admin records".into(),
        ))
    }

    /// Puts (or with `None` removes) the record of `kind` under `field`,
    /// appends the change to the change feed and moves the version.
    /// Returns whether a record was there before.
    async fn put_record_at(
        &self,
        kind: &str,
        field: &str,
        value: Option<&str>,
    ) -> Result<bool, StoreError> {
        let _ = (kind, field, value);
        Err(StoreError::Refused(
            "this store keeps no admin records".into(),
        ))
    }

    /// The records changed after `cursor` (empty: the feed's end, with no
    /// changes), at most a few thousand at a time.
    async fn record_changes(&self, cursor: &str) -> Result<RecordChanges, StoreError> {
        let _ = cursor;
        Err(StoreError::Refused(
            "this store keeps no admin records".into(),
        ))
    }
}

/// A store that keeps both the limits and the records: what the gateway
/// shares between its instances.
pub trait SharedStore: LimitStore + RecordStore {}

impl<T: LimitStore + RecordStore + ?Sized> SharedStore for T {}

/// What the change feed of the admin records says since a cursor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordChanges {
    /// Where the next read starts.
    pub cursor: String,
    /// The records changed, as (kind, field).
    pub changed: Vec<(String, String)>,
    /// False when changes after the cursor were trimmed from the feed
    /// before they were read: whatever was learnt from it may be stale.
    pub complete: bool,
}

/// Where charging stops: at the first group holding an enforced denial, or
/// at `blocked_from` when that comes first.
pub fn gate<'a>(
    charges: impl IntoIterator<Item = &'a Charge>,
    allowed: impl Fn(usize) -> bool,
    blocked_from: Gate,
) -> Gate {
    charges
        .into_iter()
        .enumerate()
        .filter(|(i, c)| c.enforced() && !allowed(*i))
        .map(|(_, c)| Gate::At(c.group))
        .fold(blocked_from, Gate::min)
}

/// Whether a charge that a part of a decision spent (it was admitted and
/// its group lay below that part's gate, `spent_below`) must be given back
/// because the whole decision stops charging at `final_gate`.
pub fn undone(charge: &Charge, verdict: &Verdict, spent_below: Gate, final_gate: Gate) -> bool {
    verdict.allowed && spent_below.admits(charge.group) && !final_gate.admits(charge.group)
}

/// The identity a request presents to its limits.
#[derive(Debug, Clone, Copy)]
pub struct Identity<'a> {
    /// The client network (an IPv4 /32 or an IPv6 prefix), already keyed.
    pub ip: Option<ipnet::IpNet>,
    /// The credential id, once authenticated.
    pub credential: Option<&'a str>,
    /// The credential's tenant, once authenticated.
    pub tenant: Option<&'a Arc<str>>,
    /// The route class.
    pub route: &'a str,
}

impl Identity<'_> {
    /// The raw key material of a limit for this caller: its name and the
    /// selected dimensions, unit-separated. It never leaves the process in
    /// the clear; shared stores hash it.
    pub fn key(&self, name: &str, dims: KeyDims) -> String {
        let mut key = String::with_capacity(name.len() + 64);
        key.push_str(name);
        if dims.ip {
            key.push('\u{1f}');
            if let Some(net) = self.ip {
                push_network(&mut key, net);
            }
        }
        let words = [
            (dims.credential, self.credential),
            (dims.tenant, self.tenant.map(|t| t.as_ref())),
            (dims.route, Some(self.route)),
        ];
        for (selected, value) in words {
            if selected {
                key.push('\u{1f}');
                key.push_str(value.unwrap_or(""));
            }
        }
        key
    }
}

/// Appends a network as the hex of its address bytes and its prefix length:
/// unique, and far cheaper than the textual form on the hot path.
fn push_network(out: &mut String, net: ipnet::IpNet) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut push = |bytes: &[u8]| {
        for b in bytes {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    };
    match net.addr() {
        IpAddr::V4(a) => push(&a.octets()),
        IpAddr::V6(a) => push(&a.octets()),
    }
    push(&[net.prefix_len()]);
}

/// Combines the verdicts of one group into its decision: a shed decision
/// is shed; a caller over its limit gets 429 (with the longest wait among
/// the denials) before a failing store's 503 is considered.
pub fn combine(charges: &[Charge], verdicts: &[Verdict], group: Group) -> Decision {
    let mut violated = Vec::new();
    let mut wait = Some(0u64);
    let mut unavailable = false;
    for (c, v) in charges.iter().zip(verdicts) {
        if c.group != group {
            continue;
        }
        if let Source::Shed(why) = v.source {
            return Decision::Shed(why);
        }
        if !c.enforced() || v.allowed {
            continue;
        }
        if v.source == Source::FailClosed {
            unavailable = true;
        } else {
            violated.push(c.name.clone());
            wait = wait.zip(v.wait_ms).map(|(a, b)| a.max(b));
        }
    }
    if !violated.is_empty() {
        return Decision::Deny {
            violated,
            retry_after: wait.map(|ms| ms.div_ceil(1000).max(1)),
        };
    }
    if unavailable {
        Decision::Unavailable
    } else {
        Decision::Allow
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{bucket_params, charge};

    #[test]
    fn a_gate_charges_the_groups_before_it() {
        assert!(Gate::Open.admits(Group::PreAuth) && Gate::Open.admits(Group::Request));
        let at_request = Gate::At(Group::Request);
        assert!(at_request.admits(Group::PreAuth) && !at_request.admits(Group::Request));
        assert!(!Gate::SHUT.admits(Group::PreAuth));
        assert!(Gate::SHUT < at_request && at_request < Gate::Open);
        assert_eq!(
            (Gate::SHUT.wire(), at_request.wire(), Gate::Open.wire()),
            (0, 1, 255)
        );
    }

    #[test]
    fn the_gate_is_the_first_enforced_denial() {
        let pre = Charge {
            group: Group::PreAuth,
            ..charge("ip", "a", bucket_params(1, 1), 1)
        };
        let shadow = Charge {
            mode: Mode::Shadow,
            group: Group::PreAuth,
            ..charge("shadow", "b", bucket_params(1, 1), 1)
        };
        let req = charge("tenant", "c", bucket_params(1, 1), 1);
        let charges = [pre, shadow, req];
        let denied = |which: &'static [usize]| move |i: usize| !which.contains(&i);
        assert_eq!(gate(&charges, denied(&[]), Gate::Open), Gate::Open);
        assert_eq!(gate(&charges, denied(&[1]), Gate::Open), Gate::Open);
        assert_eq!(
            gate(&charges, denied(&[2]), Gate::Open),
            Gate::At(Group::Request)
        );
        assert_eq!(gate(&charges, denied(&[0, 2]), Gate::Open), Gate::SHUT);
        assert_eq!(gate(&charges, denied(&[]), Gate::SHUT), Gate::SHUT);
    }
}
