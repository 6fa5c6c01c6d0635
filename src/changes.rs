//! What a new policy changes against the one before: limits and routes
//! added, removed and changed, parameter by parameter, and for each changed
//! budget whether it goes down. Printed by `tollgate check --config NEW
//! --against OLD` and logged with every reload.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::config::{Limit, LimitId, Mode, Policy, Route, Scope, Target};
use crate::explain::{algorithm, key_dims, number, params_json};
use crate::limits::algorithm::Params;

/// Which way a changed budget moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Down,
    Up,
    Mixed,
    /// Another algorithm: budgets are not comparable number by number.
    Reshaped,
    /// No number of the budget moved (another setting did).
    Same,
}

/// A limit's settings by name, as the policy writes them.
fn limit_settings(policy: &Policy, l: &Limit, params: &Params) -> BTreeMap<&'static str, String> {
    let mut out = BTreeMap::new();
    out.insert("algorithm", algorithm(params).to_string());
    if let Value::Object(numbers) = params_json(params) {
        for (k, v) in numbers {
            let name: &'static str = match k.as_str() {
                "capacity" => "capacity",
                "refill_per_second" => "refill_per_second",
                "limit" => "limit",
                "window_seconds" => "window_seconds",
                "period" => "period",
                _ => continue,
            };
            let text = match (v.as_str(), v.as_f64()) {
                (Some(text), _) => text.to_owned(),
                (None, Some(n)) => number(n),
                (None, None) => v.to_string(),
            };
            out.insert(name, text);
        }
    }
    let dims = key_dims(l);
    out.insert("key", format!("[{}]", dims.join(", ")));
    let scope = if l.scope == Scope::PreAuth {
        "pre_auth"
    } else {
        "request"
    };
    out.insert("scope", scope.into());
    let mode = if l.mode == Mode::Enforce {
        "enforce"
    } else {
        "shadow"
    };
    out.insert("mode", mode.into());
    let local = l.sync.is_local() && policy.store.backend != crate::config::schema::Backend::Memory;
    out.insert("store", if local { "local" } else { "shared" }.into());
    out.insert(
        "on_store_error",
        format!("{:?}", l.on_store_error).to_lowercase(),
    );
    match l.sync.lease() {
        Some(t) => {
            out.insert("sync", "lease".into());
            out.insert(
                "lease",
                format!(
                    "units {}, max_units {}, ttl_ms {}",
                    t.units, t.max_units, t.ttl_ms
                ),
            );
        }
        None => {
            out.insert("sync", "exact".into());
        }
    }
    if let crate::limits::OnLimit::Delay { max_ms } = l.on_limit {
        out.insert("max_delay_ms", max_ms.to_string());
    }
    out
}

/// Whether the budget numbers went down: less capacity, refill or limit,
/// or the same limit over a longer window.
fn direction(old: &Params, new: &Params) -> Direction {
    if algorithm(old) != algorithm(new) {
        return Direction::Reshaped;
    }
    let (a, b) = (params_json(old), params_json(new));
    let mut down = false;
    let mut up = false;
    for (key, more_is_more) in [
        ("capacity", true),
        ("refill_per_second", true),
        ("limit", true),
        ("window_seconds", false),
    ] {
        let (Some(x), Some(y)) = (a[key].as_f64(), b[key].as_f64()) else {
            continue;
        };
        if (y < x) == more_is_more && x != y {
            down = true;
        } else if x != y {
            up = true;
        }
    }
    if a["period"] != b["period"] {
        return Direction::Reshaped;
    }
    match (down, up) {
        (true, true) => Direction::Mixed,
        (true, false) => Direction::Down,
        (false, true) => Direction::Up,
        (false, false) => Direction::Same,
    }
}

/// `name a → b, …` for the settings that differ.
fn differences(old: &BTreeMap<&str, String>, new: &BTreeMap<&str, String>) -> Vec<String> {
    let keys: std::collections::BTreeSet<&&str> = old.keys().chain(new.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let (a, b) = (old.get(*k), new.get(*k));
            (a != b).then(|| {
                let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "none".into());
                format!("{k} {} → {}", show(a), show(b))
            })
        })
        .collect()
}

fn verdict(d: Direction) -> &'static str {
    match d {
        Direction::Down => " (budgets go down)",
        Direction::Up => " (budgets go up)",
        Direction::Mixed => " (budgets go down in part)",
        Direction::Reshaped => " (another algorithm: budgets change shape)",
        Direction::Same => "",
    }
}

/// A route's settings by name.
fn route_settings(policy: &Policy, r: &Route) -> BTreeMap<&'static str, String> {
    let names = |ids: &[LimitId]| {
        ids.iter()
            .map(|&id| policy.limits[id].name.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out = BTreeMap::new();
    out.insert("cost", r.cost.to_string());
    out.insert(
        "auth",
        if r.auth_required { "required" } else { "none" }.into(),
    );
    out.insert(
        "limits",
        format!(
            "[{}]",
            [names(&r.pre_auth), names(&r.request)]
                .iter()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    let target = match &r.target {
        Target::Upstream(pool) => format!("upstream {}", policy.upstreams[*pool].name),
        Target::Respond { status, .. } => format!("respond {status}"),
    };
    out.insert("target", target);
    out.insert("priority", format!("{:?}", r.priority).to_lowercase());
    out.insert("max_body_bytes", r.max_body_bytes.to_string());
    if let Some(t) = r.timeout {
        out.insert("timeout_ms", t.as_millis().to_string());
    }
    out
}

/// The changes from `old` to `new`, one line each; empty when the limits
/// and routes are the same.
pub fn lines(old: &Policy, new: &Policy) -> Vec<String> {
    let mut out = Vec::new();
    let find = |p: &'_ Policy, name: &str| p.limit_named(name).map(|(id, _)| id);
    for (id, l) in new.limits() {
        let Some(was) = find(old, &l.name) else {
            let s = limit_settings(new, l, &l.params);
            let numbers: Vec<String> = s
                .iter()
                .filter(|(k, _)| {
                    matches!(
                        **k,
                        "capacity" | "refill_per_second" | "limit" | "window_seconds" | "period"
                    )
                })
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            out.push(format!(
                "+ limit {}: {}, {}",
                l.name,
                algorithm(&l.params),
                numbers.join(", ")
            ));
            continue;
        };
        let w = &old.limits[was];
        let changed = differences(
            &limit_settings(old, w, &w.params),
            &limit_settings(new, l, &l.params),
        );
        if !changed.is_empty() {
            let d = direction(&w.params, &l.params);
            out.push(format!(
                "~ limit {}: {}{}",
                l.name,
                changed.join(", "),
                verdict(d)
            ));
        }
        // Each plan's numbers, where the plan exists on both sides.
        for plan in &new.plans {
            let Some(old_plan) = old.plan_id(&plan.name) else {
                continue;
            };
            let new_plan = new.plan_id(&plan.name);
            let (a, b) = (old.params(was, Some(old_plan)), new.params(id, new_plan));
            let (a_base, b_base) = (old.params(was, None), new.params(id, None));
            // Only where the plan overrides on either side.
            if a == a_base && b == b_base {
                continue;
            }
            let changed = differences(&limit_settings(old, w, &a), &limit_settings(new, l, &b));
            if !changed.is_empty() {
                out.push(format!(
                    "~ limit {} (plan {}): {}{}",
                    l.name,
                    plan.name,
                    changed.join(", "),
                    verdict(direction(&a, &b))
                ));
            }
        }
    }
    for l in &old.limits {
        if find(new, &l.name).is_none() {
            out.push(format!("- limit {}", l.name));
        }
    }
    let route = |p: &'_ Policy, name: &str| {
        p.routes
            .iter()
            .find(|r| *r.name == *name)
            .map(|r| route_settings(p, r))
    };
    for r in new.routes.iter() {
        match route(old, &r.name) {
            None => out.push(format!("+ route {}", r.name)),
            Some(was) => {
                let changed = differences(&was, &route_settings(new, r));
                if !changed.is_empty() {
                    out.push(format!("~ route {}: {}", r.name, changed.join(", ")));
                }
            }
        }
    }
    for r in old.routes.iter() {
        if route(new, &r.name).is_none() {
            out.push(format!("- route {}", r.name));
        }
    }
    out
}
