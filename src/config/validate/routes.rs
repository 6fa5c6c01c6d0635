//! `routes`: templates, hosts, targets, costs and the limits each route applies.

use super::*;
use crate::key_values::FieldPath;
use crate::limits::meter::{FormatName, Reader, Weights};
use std::sync::Arc;

/// `routes[].cost_from_response`: a header name, a bound no smaller than
/// the estimate, and limits whose charges can be given back in part.
pub(super) fn cost_from_response<'a>(
    c: &mut Checker,
    path: &str,
    raw: RawCostFromResponse,
    estimate: u64,
    limits: impl Iterator<Item = &'a Limit>,
) -> Option<CostFromResponse> {
    let path = format!("{path}.cost_from_response");
    let source = cost_source(c, &path, &raw);
    if raw.include_usage && raw.format != Some(FormatName::Openai) {
        c.fail(
            format!("{path}.include_usage"),
            "asks an OpenAI upstream for a stream's usage: only with format: openai",
        );
    }
    if raw.weights.is_some() && raw.format.is_none() {
        c.fail(
            format!("{path}.weights"),
            "weighs the input and output tokens a format reports: only with format",
        );
    }
    let max = c.whole(&format!("{path}.max"), raw.max, MAX_AMOUNT);
    if let Some(max) = max.filter(|&m| m < estimate) {
        c.fail(
            format!("{path}.max"),
            format!("must be at least the route's cost {estimate} (the estimate), got {max}"),
        );
    }
    for l in limits {
        if matches!(l.params, Params::SlidingLog(_)) {
            c.fail(
                &path,
                format!(
                    "limit {:?} is a sliding_log, whose entries cannot be given back in part",
                    l.name
                ),
            );
        }
    }
    let explicit = raw
        .max_debt
        .map(|d| c.whole(&format!("{path}.max_debt"), d, MAX_AMOUNT));
    let max = max?;
    Some(CostFromResponse {
        source: source?,
        include_usage: raw.include_usage,
        max,
        expose: raw.expose,
        on_abandon: raw.on_abandon.unwrap_or_default(),
        reserve: raw.reserve.unwrap_or_default(),
        max_debt: DebtBound {
            explicit: explicit.map(|d| d.unwrap_or_default()),
            default: max.saturating_sub(estimate).saturating_mul(10),
        },
    })
}

/// Where a route's response reports its cost: exactly one of a header, JSON
/// paths and an API format.
fn cost_source(c: &mut Checker, path: &str, raw: &RawCostFromResponse) -> Option<CostSource> {
    let given = [
        raw.header.is_some(),
        raw.json.is_some(),
        raw.format.is_some(),
    ];
    if given.iter().filter(|g| **g).count() != 1 {
        c.fail(path, "takes exactly one of header, json and format");
        return None;
    }
    if let Some(name) = &raw.header {
        return c
            .header_name(format!("{path}.header"), name)
            .map(CostSource::Header);
    }
    if let Some(json) = &raw.json {
        let paths = match json {
            OneOrMany::One(p) => vec![p.clone()],
            OneOrMany::Many(ps) => ps.clone(),
        };
        if paths.is_empty() {
            c.fail(format!("{path}.json"), "names no path");
        }
        let mut split = Vec::new();
        for (i, p) in paths.iter().enumerate() {
            let parts: Vec<String> = p.split('.').map(str::to_owned).collect();
            if parts.iter().any(String::is_empty) {
                c.fail(
                    format!("{path}.json[{i}]"),
                    format!("{p:?} is not a dotted path (e.g. usage.total_tokens)"),
                );
            }
            split.push(parts);
        }
        return Some(CostSource::Body(Reader::Json(split)));
    }
    let weights = raw.weights.map_or(Weights::default(), |w| Weights {
        input: w.input,
        output: w.output,
    });
    Some(CostSource::Body(match raw.format? {
        FormatName::Openai => Reader::OpenAi(weights),
        FormatName::Anthropic => Reader::Anthropic(weights),
    }))
}

/// A dotted path to a member of a JSON body (`usage.total_tokens`).
fn field_path(c: &mut Checker, at: &str, text: &str) -> Option<FieldPath> {
    match ValueDim::parse(&format!("body.{text}")) {
        Some(Ok(ValueDim::Body(path))) => Some(path),
        Some(Err(e)) => {
            c.fail(at, format!("{text:?} is not a dotted path: {e}"));
            None
        }
        _ => {
            c.fail(
                at,
                format!("{text:?} is not a dotted path (e.g. max_tokens)"),
            );
            None
        }
    }
}

/// What a route reads from its request body, if anything: the `body.*`
/// keys of its request limits, a `cost_from_request.json`, and whether it
/// asks for a stream's usage. `oversize` only where a body is read.
fn body_read(
    c: &mut Checker,
    path: &str,
    request: &[LimitId],
    ctx: &RouteContext<'_>,
    from_request: Option<&CostFromRequest>,
    from_response: Option<&CostFromResponse>,
    oversize: Option<Oversize>,
) -> Option<BodyRead> {
    let mut fields: Vec<FieldPath> = Vec::new();
    let keyed = request
        .iter()
        .flat_map(|&id| ctx.limits[id].values.dims.iter())
        .filter_map(|d| match d {
            ValueDim::Body(p) => Some(p.clone()),
            _ => None,
        });
    let estimated = from_request.and_then(|f| match &f.source {
        RequestCost::Json(p) => Some(p.clone()),
        RequestCost::Header(_) => None,
    });
    for p in keyed.chain(estimated) {
        if !fields.contains(&p) {
            fields.push(p);
        }
    }
    let include_usage = from_response.is_some_and(|f| f.include_usage);
    if fields.is_empty() && !include_usage {
        if oversize.is_some() {
            c.fail(
                format!("{path}.oversize"),
                "the route reads no request body (no body.* key, cost_from_request.json or \
                 include_usage)",
            );
        }
        return None;
    }
    Some(BodyRead {
        fields,
        oversize: oversize.unwrap_or_default(),
        include_usage,
    })
}

/// `routes[].cost_from_request`: a header, and bounds; only beside
/// `cost_from_response`, whose default `max_debt` becomes ten times its
/// `max` (an estimate varies from request to request).
fn cost_from_request(
    c: &mut Checker,
    path: &str,
    raw: RawCostFromRequest,
    cost: u64,
    response: Option<&mut CostFromResponse>,
) -> Option<CostFromRequest> {
    let path = format!("{path}.cost_from_request");
    let Some(response) = response else {
        c.fail(
            &path,
            "a cost the client names is only an estimate the response corrects: add cost_from_response",
        );
        return None;
    };
    let max = c.whole(&format!("{path}.max"), raw.max, MAX_AMOUNT)?;
    if max == 0 {
        c.fail(format!("{path}.max"), "must be at least 1");
    }
    let default = match raw.default {
        Some(d) => c.whole(&format!("{path}.default"), d, MAX_AMOUNT)?,
        None => cost,
    };
    if default == 0 || default > max {
        c.fail(
            format!("{path}.default"),
            format!("must be between 1 and max ({max}), got {default}"),
        );
    }
    let source = match (raw.header, raw.json) {
        (Some(name), None) => RequestCost::Header(c.header_name(format!("{path}.header"), &name)?),
        (None, Some(json)) => RequestCost::Json(field_path(c, &format!("{path}.json"), &json)?),
        _ => {
            c.fail(&path, "takes exactly one of header and json");
            return None;
        }
    };
    if response.max_debt.explicit.is_none() {
        response.max_debt.default = response.max.saturating_mul(10);
    }
    Some(CostFromRequest {
        source,
        max,
        default,
    })
}

pub(super) struct RouteContext<'a> {
    pub(super) limits: &'a [Limit],
    pub(super) limit_ids: &'a LimitNames,
    pub(super) plans: &'a [Plan],
    pub(super) pool_ids: &'a HashMap<String, PoolId>,
    /// Whether callers may come with a JWT (`claim.*` keys).
    pub(super) jwt: bool,
    /// Whether callers may be named by forward auth (`auth.*` keys).
    pub(super) forward: bool,
}

pub(super) fn routes(
    c: &mut Checker,
    raw: Vec<RawRoute>,
    ctx: &RouteContext<'_>,
    max_body_bytes: u64,
    matching: Matching,
) -> Router<Route> {
    let mut router = Router::matching(matching);
    let mut names = HashSet::new();
    if raw.is_empty() {
        c.fail("routes", "needs at least one route");
    }
    for (i, r) in raw.into_iter().enumerate() {
        let path = format!("routes[{i}]");
        c.name(&format!("{path}.name"), &r.name);
        if !names.insert(r.name.clone()) {
            c.fail(
                format!("{path}.name"),
                format!("duplicate route name {:?}", r.name),
            );
        }
        let template = PathTemplate::parse(&r.path)
            .map_err(|e| c.fail(format!("{path}.path"), e.to_string()))
            .ok();
        let methods = methods(c, &path, &r.methods);
        let hosts = hosts(c, &path, &r.hosts);
        let target = target(c, &path, r.upstream, r.respond, ctx.pool_ids);
        let cost = match r.cost {
            Some(v) => c.whole(&format!("{path}.cost"), v, MAX_AMOUNT).unwrap_or(1),
            None => 1,
        };
        let auth_required = r.auth == AuthMode::Required;
        // With `reserve: max` admission charges `max`, which every limit
        // must be able to admit (`max` itself is checked below).
        let admitted_cost = r
            .cost_from_response
            .as_ref()
            .filter(|f| f.reserve == Some(Reserve::Max) && f.max.fract() == 0.0 && f.max >= 0.0)
            .map_or(cost, |f| f.max as u64);
        let (pre_auth, request) =
            route_limits(c, &path, &r.limits, admitted_cost, auth_required, ctx);
        if let Some(t) = &template {
            read_values(c, &path, t, auth_required, &pre_auth, &request, ctx);
        }
        let mut cost_from_response = r.cost_from_response.and_then(|raw| {
            let limits = pre_auth.iter().chain(&request).map(|&id| &ctx.limits[id]);
            cost_from_response(c, &path, raw, cost, limits)
        });
        let cost_from_request = r
            .cost_from_request
            .and_then(|raw| cost_from_request(c, &path, raw, cost, cost_from_response.as_mut()));
        let body = body_read(
            c,
            &path,
            &request,
            ctx,
            cost_from_request.as_ref(),
            cost_from_response.as_ref(),
            r.oversize,
        );
        let max_body_bytes = c.bounded(
            &format!("{path}.max_body_bytes"),
            r.max_body_bytes.or(Some(max_body_bytes)),
            bounds::ROUTE_MAX_BODY_BYTES,
        );
        if let (Some(template), Some(target)) = (template, target) {
            // A name that is no header value already failed the name check,
            // so the policy is rejected before this placeholder could be used.
            let class_header = http::HeaderValue::from_str(&r.name)
                .unwrap_or(http::HeaderValue::from_static("invalid"));
            let route = Route {
                id: RouteId::new(router.len()),
                class_header,
                name: r.name.into(),
                auth_required,
                target,
                cost,
                pre_auth,
                request,
                max_body_bytes,
                upgrade: upgrade(c, &format!("{path}.upgrade"), r.upgrade),
                timeout: r.timeout_ms.map(|ms| {
                    Duration::from_millis(c.bounded(
                        &format!("{path}.timeout_ms"),
                        Some(ms),
                        bounds::ROUTE_TIMEOUT_MS,
                    ))
                }),
                priority: r.priority,
                cost_from_response,
                cost_from_request,
                body,
            };
            router.push(methods, hosts, template, route);
        }
    }
    router
}

pub(super) fn hosts(c: &mut Checker, path: &str, raw: &[String]) -> Vec<HostPattern> {
    raw.iter()
        .enumerate()
        .filter_map(|(i, h)| {
            HostPattern::parse(h)
                .map_err(|e| c.fail(format!("{path}.hosts[{i}]"), e.to_string()))
                .ok()
        })
        .collect()
}

pub(super) fn methods(c: &mut Checker, path: &str, raw: &[String]) -> Vec<String> {
    raw.iter()
        .enumerate()
        .map(|(i, m)| {
            let upper = m.to_ascii_uppercase();
            if http::Method::from_bytes(upper.as_bytes()).is_err() || upper.is_empty() {
                c.fail(
                    format!("{path}.methods[{i}]"),
                    format!("{m:?} is not an HTTP method"),
                );
            }
            upper
        })
        .collect()
}

pub(super) fn target(
    c: &mut Checker,
    path: &str,
    upstream: Option<String>,
    respond: Option<RawRespond>,
    pool_ids: &HashMap<String, PoolId>,
) -> Option<Target> {
    match (upstream, respond) {
        (Some(_), Some(_)) => {
            c.fail(path, "a route has either `upstream` or `respond`, not both");
            None
        }
        (None, None) => {
            c.fail(path, "a route needs `upstream` or `respond`");
            None
        }
        (Some(name), None) => {
            let id = pool_ids.get(&name).copied();
            if id.is_none() {
                let names = pool_ids.keys().map(String::as_str);
                c.fail(
                    format!("{path}.upstream"),
                    with_nearest(format!("unknown upstream {name:?}"), &name, names),
                );
            }
            id.map(Target::Upstream)
        }
        (None, Some(r)) => {
            // 1xx and 101 would switch or hold the connection; 204 and 304
            // have no body by definition.
            c.bounded(
                &format!("{path}.respond.status"),
                Some(r.status),
                bounds::RESPOND_STATUS,
            );
            if matches!(r.status, 204 | 304) && !r.body.is_empty() {
                c.fail(
                    format!("{path}.respond.body"),
                    format!("status {} has no body", r.status),
                );
            }
            let content_type = r
                .content_type
                .unwrap_or_else(|| "text/plain; charset=utf-8".into());
            if content_type.bytes().any(|b| b.is_ascii_control()) || content_type.is_empty() {
                c.fail(
                    format!("{path}.respond.content_type"),
                    "must be a header value without control characters",
                );
            }
            Some(Target::Respond {
                status: r.status,
                body: r.body.into(),
                content_type,
            })
        }
    }
}

pub(super) fn route_limits(
    c: &mut Checker,
    path: &str,
    names: &[String],
    cost: u64,
    auth_required: bool,
    ctx: &RouteContext<'_>,
) -> (Vec<LimitId>, Vec<LimitId>) {
    let (mut pre, mut req) = (Vec::new(), Vec::new());
    for (i, name) in names.iter().enumerate() {
        let at = format!("{path}.limits[{i}]");
        let Some(&(id, _)) = ctx.limit_ids.get(name) else {
            let names = ctx.limit_ids.keys().map(String::as_str);
            c.fail(
                at,
                with_nearest(format!("unknown limit {name:?}"), name, names),
            );
            continue;
        };
        let Some(id) = id else { continue };
        if pre.contains(&id) || req.contains(&id) {
            c.fail(at, format!("limit {name:?} is listed twice"));
            continue;
        }
        let limit = &ctx.limits[id];
        if !auth_required && (limit.key.credential || limit.key.tenant) {
            c.fail(&at, format!("limit {name:?} is keyed by credential or tenant but the route has `auth: none`"));
        }
        // Every budget a request of the route may be decided against: the
        // limit's own, its `values` entries', and its plans'.
        let value_params = limit.budgets().into_iter().map(|(value, params)| {
            let whose = value.map_or(String::new(), |v| format!(" (values {v:?})"));
            (whose, params)
        });
        let plan_params = ctx.plans.iter().filter_map(|p| {
            p.params_for(id)
                .map(|x| (format!(" (plan {:?})", p.name), x))
        });
        for (whose, params) in value_params.chain(plan_params) {
            // A concurrency limit holds one unit per request, whatever its cost.
            if cost > params.quota() && !params.is_concurrency() {
                c.fail(&at, format!("route cost {cost} exceeds the capacity {} of limit {name:?}{whose}: it could never be admitted", params.quota()));
            }
        }
        if limit.scope == Scope::PreAuth {
            pre.push(id)
        } else {
            req.push(id)
        }
    }
    (pre, req)
}

/// The keys a route's limits read from its requests: each must be there
/// to read, and each a client chooses must be bounded, so that the keys a
/// client can make are bounded by what it is admitted.
fn read_values(
    c: &mut Checker,
    path: &str,
    template: &PathTemplate,
    auth_required: bool,
    pre_auth: &[LimitId],
    request: &[LimitId],
    ctx: &RouteContext<'_>,
) {
    let groups = [(0, pre_auth), (1, request)];
    let limits = || {
        groups
            .iter()
            .flat_map(|&(g, ids)| ids.iter().map(move |&id| (g, &ctx.limits[id])))
    };
    for (group, limit) in limits() {
        let at = format!("{path}.limits");
        let name = &limit.name;
        for dim in limit.values.dims.iter() {
            match dim {
                ValueDim::Path(p) if !template.has_param(p) => c.fail(
                    &at,
                    format!(
                        "limit {name:?} is keyed by {dim}, but the route's path {:?} has no {{{p}}}",
                        template.as_str()
                    ),
                ),
                ValueDim::Claim(_) if !(auth_required && ctx.jwt) => c.fail(
                    &at,
                    format!("limit {name:?} is keyed by {dim}, but no caller of the route can have a JWT (auth.jwt and auth: required)"),
                ),
                ValueDim::Auth(_) if !(auth_required && ctx.forward) => c.fail(
                    &at,
                    format!("limit {name:?} is keyed by {dim}, but no caller of the route is named by forward auth (auth.forward_auth and auth: required)"),
                ),
                _ => {}
            }
        }
        if !limit.values.unbounded() {
            continue;
        }
        // An enforced limit per caller, decided with it or before it, and
        // not failing open, bounds how many requests (and so keys) a
        // caller gets admitted. A concurrency limit does not: it bounds
        // the requests at once, not how many there are in all.
        let bounded = limits().any(|(g, other)| {
            g <= group
                && other.mode == Mode::Enforce
                && !other.params.is_concurrency()
                && (other.key.credential || other.key.tenant || other.key.ip)
                && other.values.is_empty()
                && (other.sync.is_local() || other.on_store_error != OnStoreError::Open)
        });
        if !bounded {
            c.fail(
                &at,
                format!(
                    "limit {name:?} is keyed by a value the client chooses ({}), so each new value \
                     would be a new budget: list its values with other: reject, or also apply an \
                     enforced limit keyed by credential, tenant or ip that counts requests (not a \
                     concurrency limit), in the same or an earlier scope, that does not fail open",
                    limit
                        .values
                        .dims
                        .iter()
                        .filter(|d| d.client_chosen())
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        }
    }
}

/// `routes[].upgrade`: `true` is WebSocket; a list names HTTP tokens.
fn upgrade(c: &mut Checker, path: &str, raw: RawUpgrade) -> Arc<[Box<str>]> {
    match raw {
        RawUpgrade::Flag(false) => Arc::from([]),
        RawUpgrade::Flag(true) => Arc::from([Box::from("websocket")]),
        RawUpgrade::Protocols(tokens) => {
            if tokens.is_empty() {
                c.fail(path, "lists no protocol (write false for none)");
            }
            for (i, t) in tokens.iter().enumerate() {
                let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~/".contains(&b);
                if t.is_empty() || !t.bytes().all(tchar) {
                    c.fail(
                        format!("{path}[{i}]"),
                        format!("{t:?} is not a protocol token (e.g. websocket, h2c)"),
                    );
                }
            }
            tokens
                .into_iter()
                .map(|t| t.to_ascii_lowercase().into())
                .collect()
        }
    }
}
