//! `limits` and `plans`: algorithms, their numbers, failure modes, delay and leases.

use super::*;
use crate::identity::overrides::{Override, Resolved};

/// Turns a limit's (or an override's) numbers into algorithm parameters.
pub(super) fn params(
    c: &mut Checker,
    path: &str,
    algorithm: AlgorithmName,
    n: &RawOverride,
) -> Option<Params> {
    if algorithm == AlgorithmName::Concurrency {
        return concurrency(c, path, n);
    }
    for (field, set) in [
        ("max_in_flight", n.max_in_flight.is_some()),
        ("hold_ttl_ms", n.hold_ttl_ms.is_some()),
    ] {
        if set {
            c.fail(
                path,
                format!("`{field}` does not apply to {algorithm}; it is for concurrency"),
            );
        }
    }
    if algorithm == AlgorithmName::Quota {
        return quota(c, path, n);
    }
    if n.period.is_some() {
        c.fail(
            path,
            format!("`period` does not apply to {algorithm}; it is for quota"),
        );
    }
    let bucket = matches!(algorithm, AlgorithmName::TokenBucket | AlgorithmName::Gcra);
    let (wanted, unwanted) = if bucket {
        (
            ["capacity", "refill_per_second"],
            [("limit", n.limit), ("window_seconds", n.window_seconds)],
        )
    } else {
        (
            ["limit", "window_seconds"],
            [
                ("capacity", n.capacity),
                ("refill_per_second", n.refill_per_second),
            ],
        )
    };
    for (field, value) in unwanted {
        if value.is_some() {
            c.fail(
                path,
                format!(
                    "`{field}` does not apply to {algorithm}; it takes `{}` and `{}`",
                    wanted[0], wanted[1]
                ),
            );
        }
    }
    if bucket {
        let capacity = c.required(path, "capacity", n.capacity);
        let rate = c.required(path, "refill_per_second", n.refill_per_second);
        let capacity = c.amount(&format!("{path}.capacity"), capacity?, MAX_AMOUNT)?;
        let rate = c.amount(&format!("{path}.refill_per_second"), rate?, MAX_AMOUNT)?;
        let per_ms = (rate * 1000.0).round() as u64;
        if per_ms == 0 {
            c.fail(
                format!("{path}.refill_per_second"),
                format!("must be at least 0.001, got {rate}"),
            );
            return None;
        }
        if capacity < 1.0 {
            c.fail(
                format!("{path}.capacity"),
                format!("must be at least 1, got {capacity}"),
            );
            return None;
        }
        let b = Bucket {
            capacity: (capacity * MICRO as f64).round() as u64,
            per_ms,
        };
        Some(if algorithm == AlgorithmName::Gcra {
            Params::Gcra(b)
        } else {
            Params::TokenBucket(b)
        })
    } else {
        let limit = c.required(path, "limit", n.limit);
        let seconds = c.required(path, "window_seconds", n.window_seconds);
        let max = if algorithm == AlgorithmName::SlidingLog {
            MAX_LOG_LIMIT
        } else {
            MAX_AMOUNT
        };
        let limit = c.whole(&format!("{path}.limit"), limit?, max)?;
        let seconds = c.amount(
            &format!("{path}.window_seconds"),
            seconds?,
            MAX_WINDOW_SECONDS,
        )?;
        let window_ms = (seconds * 1000.0).round().max(1.0) as u64;
        if algorithm == AlgorithmName::SlidingWindow && limit * window_ms >= MAX_EXACT {
            c.fail(
                path,
                format!(
                    "limit × window in ms must stay below 2^53, got {}",
                    limit * window_ms
                ),
            );
            return None;
        }
        let w = Window { limit, window_ms };
        Some(match algorithm {
            AlgorithmName::FixedWindow => Params::FixedWindow(w),
            AlgorithmName::SlidingWindow => Params::SlidingWindow(w),
            _ => Params::SlidingLog(w),
        })
    }
}

pub(super) fn limits(
    c: &mut Checker,
    raw: UniqueMap<RawLimit>,
    memory: bool,
    notes: &mut Vec<String>,
) -> (Vec<Limit>, LimitNames) {
    let mut out = Vec::new();
    let mut ids = HashMap::new();
    for (name, l) in raw.0 {
        let path = format!("limits.{name}");
        c.name(&path, &name);
        let (key, dims) = key_dims(c, &path, &l.key);
        if l.scope == Scope::PreAuth && (key.credential || key.tenant) {
            c.fail(
                format!("{path}.key"),
                "a pre_auth limit runs before authentication: its key may only use ip and route",
            );
        }
        if l.scope == Scope::PreAuth {
            if let Some(d) = dims.iter().find(|d| !d.before_identity()) {
                c.fail(
                    format!("{path}.key"),
                    format!(
                        "a pre_auth limit runs before the caller is identified and its body read: \
                         {d} needs them; a pre_auth key may add header.* and path.*"
                    ),
                );
            }
        }
        let numbers = RawOverride {
            capacity: l.capacity,
            refill_per_second: l.refill_per_second,
            limit: l.limit,
            window_seconds: l.window_seconds,
            period: l.period,
            max_in_flight: l.max_in_flight,
            hold_ttl_ms: l.hold_ttl_ms,
        };
        let Some(params) = params(c, &path, l.algorithm, &numbers) else {
            // Known but invalid: references to it are not a second error.
            ids.insert(name, (None, l.algorithm));
            continue;
        };
        let lease = lease(c, &path, &l, &params);
        let on_limit = match delay(c, &path, &l, &params) {
            0 => crate::limits::OnLimit::Reject,
            max_ms => crate::limits::OnLimit::Delay { max_ms },
        };
        let local = memory || l.store.unwrap_or(Placement::Shared) == Placement::Local;
        if local && lease.is_some() {
            notes.push(format!(
                "limit {name:?}: sync: lease has no effect on a limit decided in this process \
                 (store backend memory)"
            ));
        }
        let sync = match (local, lease) {
            (true, _) => crate::limits::SyncMode::Local,
            (false, Some(terms)) => crate::limits::SyncMode::Lease(terms),
            (false, None) => crate::limits::SyncMode::Exact,
        };
        let values = value_key(c, &path, &l, dims, l.algorithm, &params);
        ids.insert(name.clone(), (Some(LimitId::new(out.len())), l.algorithm));
        out.push(Limit {
            name: name.into(),
            scope: l.scope,
            key,
            params,
            sync,
            on_store_error: l.on_store_error,
            mode: l.mode,
            on_limit,
            values,
        });
    }
    (out, ids)
}

/// The dimensions a key lists: the four the gateway knows, and those read
/// from the request, in order.
fn key_dims(c: &mut Checker, path: &str, raw: &[String]) -> (KeyDims, Vec<ValueDim>) {
    const WORDS: [&str; 10] = [
        "ip",
        "credential",
        "tenant",
        "route",
        "header.",
        "path.",
        "query.",
        "claim.",
        "auth.",
        "body.",
    ];
    let mut key = KeyDims::default();
    let mut dims: Vec<ValueDim> = Vec::new();
    for (i, word) in raw.iter().enumerate() {
        let at = format!("{path}.key[{i}]");
        let slot = match word.as_str() {
            "ip" => &mut key.ip,
            "credential" => &mut key.credential,
            "tenant" => &mut key.tenant,
            "route" => &mut key.route,
            _ => {
                match ValueDim::parse(word) {
                    Some(Ok(d)) if dims.contains(&d) => {
                        c.fail(at, format!("duplicate key dimension {word:?}"));
                    }
                    Some(Ok(d)) => dims.push(d),
                    Some(Err(e)) => c.fail(at, format!("{word:?}: {e}")),
                    None => {
                        let kind = word.split('.').next().unwrap_or(word);
                        let named = word.contains('.');
                        let candidates = WORDS
                            .iter()
                            .filter(|w| w.ends_with('.') == named)
                            .map(|w| w.trim_end_matches('.'));
                        c.fail(
                            at,
                            with_nearest(
                                format!(
                                    "unknown key dimension {word:?}: ip, credential, tenant, route, \
                                     or header.NAME, path.PARAM, query.NAME, claim.NAME, auth.NAME, \
                                     body.FIELD"
                                ),
                                kind,
                                candidates,
                            ),
                        );
                    }
                }
                continue;
            }
        };
        if std::mem::replace(slot, true) {
            c.fail(at, format!("duplicate key dimension {word:?}"));
        }
    }
    (key, dims)
}

/// The part of a limit's key read from the request, with `absent`,
/// `values` and `other`.
fn value_key(
    c: &mut Checker,
    path: &str,
    l: &RawLimit,
    dims: Vec<ValueDim>,
    algorithm: AlgorithmName,
    own: &Params,
) -> ValueKey {
    if dims.is_empty() {
        for (field, set) in [
            ("absent", l.absent.is_some()),
            ("values", l.values.is_some()),
            ("other", l.other.is_some()),
        ] {
            if set {
                c.fail(
                    format!("{path}.{field}"),
                    "only read with a key read from the request (header.*, path.*, query.*, \
                     claim.*, auth.*, body.*)",
                );
            }
        }
        return ValueKey::default();
    }
    let values = l.values.as_ref().map(|raw| {
        if dims.len() != 1 {
            c.fail(
                format!("{path}.values"),
                "values name parameters per value of one dimension: the key reads more than one",
            );
        }
        let mut out = HashMap::new();
        for (value, numbers) in &raw.0 {
            let at = format!("{path}.values.{value}");
            if crate::key_values::check(value).is_err() || value.is_empty() {
                c.fail(&at, "a value is 1 to 256 bytes without control characters");
            }
            let numbers = limit_owned(c, &at, own, numbers.clone(), "a value");
            if let Some(p) = params(c, &at, algorithm, &numbers) {
                out.insert(Box::from(value.as_str()), p);
            }
        }
        Arc::new(out)
    });
    if l.other.is_some() && values.is_none() {
        c.fail(format!("{path}.other"), "only read with values");
    }
    ValueKey {
        dims: dims.into(),
        absent: l.absent.unwrap_or_default(),
        values,
        other: l.other.unwrap_or_default(),
    }
}

/// `on_limit: delay` and its bound, for the algorithms that can schedule an
/// admission ahead: a bucket going into debt, a GCRA's arrival time.
pub(super) fn delay(c: &mut Checker, path: &str, l: &RawLimit, params: &Params) -> u64 {
    match (l.on_limit, l.max_delay_ms) {
        (OnLimit::Reject, None) => 0,
        (OnLimit::Reject, Some(_)) => {
            c.fail(
                format!("{path}.max_delay_ms"),
                "only read with on_limit: delay",
            );
            0
        }
        (OnLimit::Delay, None) => {
            c.fail(
                format!("{path}.max_delay_ms"),
                "on_limit: delay needs max_delay_ms, the longest a request is held",
            );
            0
        }
        (OnLimit::Delay, Some(ms)) => {
            if params.is_concurrency() {
                c.fail(
                    format!("{path}.on_limit"),
                    "a concurrency limit admits when a request ends, which no wait can foretell: \
                     use on_limit: reject (429 with Retry-After: 1), or a pool's queue",
                );
            } else if !matches!(params, Params::TokenBucket(_) | Params::Gcra(_)) {
                c.fail(
                    format!("{path}.on_limit"),
                    "delay schedules an admission ahead, which token_bucket and gcra can; \
                     a window's count belongs to the window it is made in",
                );
            }
            if l.sync == LimitSync::Lease {
                c.fail(
                    format!("{path}.on_limit"),
                    "a leased limit admits from what an instance holds: use sync: exact to delay",
                );
            }
            c.bounded(
                &format!("{path}.max_delay_ms"),
                Some(ms),
                bounds::MAX_DELAY_MS,
            )
        }
    }
}

/// A concurrency limit: `max_in_flight` and `hold_ttl_ms`, nothing else.
pub(super) fn concurrency(c: &mut Checker, path: &str, n: &RawOverride) -> Option<Params> {
    for (field, set) in [
        ("capacity", n.capacity.is_some()),
        ("refill_per_second", n.refill_per_second.is_some()),
        ("limit", n.limit.is_some()),
        ("window_seconds", n.window_seconds.is_some()),
        ("period", n.period.is_some()),
    ] {
        if set {
            c.fail(
                path,
                format!(
                    "`{field}` does not apply to concurrency; it takes `max_in_flight` and `hold_ttl_ms`"
                ),
            );
        }
    }
    let max = c.required(path, "max_in_flight", n.max_in_flight)?;
    let max_in_flight = c.bounded(
        &format!("{path}.max_in_flight"),
        Some(max),
        bounds::LIMIT_MAX_IN_FLIGHT,
    );
    let hold_ttl_ms = c.bounded(
        &format!("{path}.hold_ttl_ms"),
        n.hold_ttl_ms,
        bounds::HOLD_TTL_MS,
    );
    Some(Params::Concurrency(Concurrency {
        max_in_flight,
        hold_ttl_ms,
    }))
}

/// A plan's or a tenant override's numbers for a limit of `params`, with
/// what belongs to the limit alone (a quota's period, a concurrency
/// limit's hold lifetime) taken from it and refused when given.
fn limit_owned(
    c: &mut Checker,
    path: &str,
    params: &Params,
    mut numbers: RawOverride,
    who: &str,
) -> RawOverride {
    match *params {
        Params::Quota(q) => {
            if numbers.period.is_some() {
                c.fail(
                    format!("{path}.period"),
                    format!("{who} changes a quota's limit; its period is the limit's"),
                );
            }
            numbers.period = Some(q.period);
        }
        Params::Concurrency(l) => {
            if numbers.hold_ttl_ms.is_some() {
                c.fail(
                    format!("{path}.hold_ttl_ms"),
                    format!("{who} changes a concurrency limit's max_in_flight; its hold_ttl_ms is the limit's"),
                );
            }
            numbers.hold_ttl_ms = Some(l.hold_ttl_ms);
        }
        _ => {}
    }
    numbers
}

/// A calendar quota: `limit` and `period`, nothing else.
pub(super) fn quota(c: &mut Checker, path: &str, n: &RawOverride) -> Option<Params> {
    for (field, value) in [
        ("capacity", n.capacity),
        ("refill_per_second", n.refill_per_second),
        ("window_seconds", n.window_seconds),
    ] {
        if value.is_some() {
            c.fail(
                path,
                format!("`{field}` does not apply to quota; it takes `limit` and `period`"),
            );
        }
    }
    let limit = c.required(path, "limit", n.limit);
    let period = c.required(path, "period", n.period);
    let limit = c.whole(&format!("{path}.limit"), limit?, MAX_AMOUNT)?;
    Some(Params::Quota(Quota {
        limit,
        period: period?,
    }))
}

/// The terms of `sync: lease`, checked against the limit they belong to.
pub(super) fn lease(
    c: &mut Checker,
    path: &str,
    l: &RawLimit,
    params: &Params,
) -> Option<LeaseTerms> {
    let raw = match (l.sync, &l.lease) {
        (LimitSync::Exact, None) => return None,
        (LimitSync::Exact, Some(_)) => {
            c.fail(format!("{path}.lease"), "only read with sync: lease");
            return None;
        }
        (LimitSync::Lease, None) => {
            c.fail(
                format!("{path}.lease"),
                "sync: lease needs lease: { units, ttl_ms }",
            );
            return None;
        }
        (LimitSync::Lease, Some(raw)) => raw,
    };
    if l.store == Some(Placement::Local) {
        c.fail(
            format!("{path}.sync"),
            "a lease is taken from the shared store; a limit with store: local has none",
        );
    }
    if matches!(params, Params::Quota(_)) {
        c.fail(
            format!("{path}.sync"),
            "a quota counts a calendar period; a lease's units would outlive it: use sync: exact",
        );
    }
    if params.is_concurrency() {
        c.fail(
            format!("{path}.sync"),
            "a concurrency limit's hold is one request in flight, taken and released with it: \
             it cannot be leased ahead, use sync: exact",
        );
        return None;
    }
    if matches!(params, Params::SlidingLog(_)) {
        c.fail(
            format!("{path}.sync"),
            "a sliding_log records the time of each admission, and a lease spends units \
             later than the store charged them: use sliding_window, or sync: exact",
        );
    }
    let capacity = params.quota();
    let units = whole(c, &format!("{path}.lease.units"), raw.units, 1, capacity);
    let ttl = bounds::LEASE_TTL_MS;
    let ttl_ms = whole(
        c,
        &format!("{path}.lease.ttl_ms"),
        raw.ttl_ms,
        ttl.min,
        ttl.max,
    );
    let units = units?;
    let max_units = match raw.max_units {
        Some(m) => whole(c, &format!("{path}.lease.max_units"), m, units, capacity)?,
        None => units,
    };
    Some(LeaseTerms {
        units,
        ttl_ms: ttl_ms?,
        max_units,
    })
}

/// A whole number in `min..=max`, or a problem at `path`.
pub(super) fn whole(c: &mut Checker, path: &str, value: f64, min: u64, max: u64) -> Option<u64> {
    if value.fract() != 0.0 || value < min as f64 || value > max as f64 {
        c.fail(
            path,
            format!("must be a whole number from {min} to {max}, got {value}"),
        );
        return None;
    }
    Some(value as u64)
}

pub(super) fn plans(
    c: &mut Checker,
    raw: UniqueMap<UniqueMap<RawOverride>>,
    limits: &[Limit],
    limit_ids: &LimitNames,
) -> (Vec<Plan>, HashMap<String, PlanId>) {
    let mut out = Vec::new();
    let mut ids = HashMap::new();
    for (name, overrides) in raw.0 {
        c.name(&format!("plans.{name}"), &name);
        let mut plan = Plan {
            name: name.clone(),
            overrides: Vec::new(),
        };
        for (limit, numbers) in overrides.0 {
            let path = format!("plans.{name}.{limit}");
            let Some(&(id, algorithm)) = limit_ids.get(&limit) else {
                let names = limit_ids.keys().map(String::as_str);
                c.fail(
                    path,
                    with_nearest(format!("unknown limit {limit:?}"), &limit, names),
                );
                continue;
            };
            let Some(id) = id else { continue };
            if limits[id].scope == Scope::PreAuth {
                c.fail(
                    &path,
                    "a pre_auth limit runs before the plan is known and cannot be overridden",
                );
            }
            let numbers = limit_owned(c, &path, &limits[id].params, numbers, "a plan");
            if let Some(p) = params(c, &path, algorithm, &numbers) {
                plan.overrides.push((id, p));
            }
        }
        ids.insert(name, PlanId::new(out.len()));
        out.push(plan);
    }
    (out, ids)
}

/// A tenant override's numbers for limit `name` (`/admin/overrides`),
/// checked as a plan's would be, and against the costs of the routes that
/// apply the limit: its id and parameters, or every problem, by path.
pub fn override_params(
    policy: &Policy,
    name: &str,
    raw: &RawOverride,
) -> Result<(LimitId, Params), Vec<Problem>> {
    let mut c = Checker {
        problems: Vec::new(),
    };
    let path = format!("limits.{name}");
    let Some((id, limit)) = policy.limit_named(name) else {
        let names = policy.limits.iter().map(|l| &*l.name);
        c.fail(
            &path,
            with_nearest(format!("unknown limit {name:?}"), name, names),
        );
        return Err(c.problems);
    };
    if limit.scope == Scope::PreAuth {
        c.fail(
            &path,
            "a pre_auth limit runs before the tenant is known and cannot be overridden",
        );
    }
    let algorithm = match limit.params {
        Params::TokenBucket(_) => AlgorithmName::TokenBucket,
        Params::Gcra(_) => AlgorithmName::Gcra,
        Params::FixedWindow(_) => AlgorithmName::FixedWindow,
        Params::SlidingWindow(_) => AlgorithmName::SlidingWindow,
        Params::SlidingLog(_) => AlgorithmName::SlidingLog,
        Params::Quota(_) => AlgorithmName::Quota,
        Params::Concurrency(_) => AlgorithmName::Concurrency,
    };
    let numbers = limit_owned(&mut c, &path, &limit.params, raw.clone(), "an override");
    let params = params(&mut c, &path, algorithm, &numbers);
    // A concurrency limit holds one unit per request, whatever its cost.
    if let Some(p) = params.filter(|p| !p.is_concurrency()) {
        for route in policy.routes.iter().filter(|r| r.request.contains(&id)) {
            if route.admission_cost() > p.quota() {
                c.fail(
                    &path,
                    format!(
                        "route {:?} costs {}, more than the override's capacity {}: it could never be admitted",
                        route.name,
                        route.admission_cost(),
                        p.quota()
                    ),
                );
            }
        }
    }
    match params {
        Some(p) if c.problems.is_empty() => Ok((id, p)),
        _ => Err(c.problems),
    }
}

/// Checks a tenant's override `o` against `policy` as the YAML would be: the plan exists, each
/// limit's numbers are valid for its algorithm and fit the routes' costs.
/// Every problem as `path: message`.
pub fn resolve_override(policy: &Policy, o: &Override) -> Result<Resolved, Vec<String>> {
    let mut problems = Vec::new();
    let plan = match &o.plan {
        Some(name) => match policy.plan_id(name) {
            Some(id) => Some(id),
            None => {
                problems.push(format!("plan: unknown plan {name:?}"));
                None
            }
        },
        None => None,
    };
    let mut limits = HashMap::new();
    for (name, numbers) in &o.limits {
        let raw = match serde_json::from_value(numbers.clone()) {
            Ok(raw) => raw,
            Err(e) => {
                problems.push(format!("limits.{name}: {e}"));
                continue;
            }
        };
        match override_params(policy, name, &raw) {
            Ok((id, params)) => {
                limits.insert(id, params);
            }
            Err(found) => problems.extend(
                found
                    .into_iter()
                    .map(|p| format!("{}: {}", p.path, p.message)),
            ),
        }
    }
    if problems.is_empty() {
        Ok(Resolved {
            plan,
            limits,
            expires_at_ms: o.expires_at_ms,
        })
    } else {
        Err(problems)
    }
}
