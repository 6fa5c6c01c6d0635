//! Raw schema → [`Policy`]. Every check names the path of the offending
//! value; all problems of a file are reported together.
//!
//! One file per section of the schema: [`server`], [`store`],
//! [`client_ip`] (with `ip_rules`), [`limits`] (with `plans`), [`auth`],
//! [`upstreams`] and [`routes`]; here the walk over the whole document and
//! the checker they share.

use std::collections::{HashMap, HashSet};
use std::io::BufRead;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use super::bounds::{self, Bound, MAX_AMOUNT};
use super::policy::*;
use super::schema::*;
use super::suggest::with_nearest;
use super::{load_keys_file, ConfigError, KeysFile, Problem};
use crate::access_log::{AccessLogSettings, Destination};
use crate::client_ip::{ClientIpConfig, ForwardHeader};
use crate::edge::{EdgeSettings, EncodedSlash, PathRules};
use crate::identity::auth::{parse_digest, Credential, KeyTable, KeyTableBuilder, Tenant};
use crate::key_values::{ValueDim, ValueKey};
use crate::limits::algorithm::{Bucket, Concurrency, Params, Quota, Window, MICRO};
use crate::limits::redis::redacted;
use crate::limits::LeaseTerms;
use crate::routes::{HostPattern, Matching, PathTemplate, Router};
use crate::tls::{Certificate, TlsSettings};

mod auth;
mod client_ip;
mod limits;
mod routes;
mod server;
mod store;
mod upstreams;
mod usage;

use auth::*;
use client_ip::*;
use limits::*;
pub use limits::{override_params, resolve_override};
use routes::*;
use server::*;
use store::*;
use upstreams::*;

/// Sliding logs keep one entry per admitted request.
const MAX_LOG_LIMIT: f64 = 10_000.0;

/// Longest window: one day.
const MAX_WINDOW_SECONDS: f64 = 86_400.0;

/// Products the Redis scripts compute must stay exact in a Lua double.
const MAX_EXACT: u64 = 1 << 53;

/// Limit names as declared: the limit's id when it validated, and its
/// algorithm (which decides what a plan override must contain).
type LimitNames = HashMap<String, (Option<LimitId>, AlgorithmName)>;

/// Collects problems while walking the raw document.
struct Checker {
    problems: Vec<Problem>,
}

impl Checker {
    fn fail(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    /// A finite number in `(0, max]`.
    fn amount(&mut self, path: &str, value: f64, max: f64) -> Option<f64> {
        if !value.is_finite() {
            self.fail(path, format!("must be a finite number, got {value}"));
        } else if value <= 0.0 {
            self.fail(path, format!("must be positive, got {value}"));
        } else if value > max {
            self.fail(path, format!("must be at most {max}, got {value}"));
        } else {
            return Some(value);
        }
        None
    }

    /// A whole number in `[1, max]`.
    fn whole(&mut self, path: &str, value: f64, max: f64) -> Option<u64> {
        let v = self.amount(path, value, max)?;
        if v.fract() != 0.0 {
            self.fail(path, format!("must be a whole number, got {v}"));
            return None;
        }
        Some(v as u64)
    }

    fn range<T: PartialOrd + std::fmt::Display + Copy>(
        &mut self,
        path: &str,
        value: T,
        min: T,
        max: T,
    ) -> T {
        if value < min || value > max {
            self.fail(
                path,
                format!("must be between {min} and {max}, got {value}"),
            );
        }
        value
    }

    /// `value`, or the bound's default, checked against the bound.
    fn bounded<T>(&mut self, path: &str, value: Option<T>, bound: Bound) -> T
    where
        T: Copy + Default + TryInto<u64> + TryFrom<u64>,
    {
        let value = value
            .and_then(|v| v.try_into().ok())
            .or(bound.default)
            .unwrap_or(bound.min);
        // Within the type: the value came from it, or is a bound's default.
        T::try_from(self.range(path, value, bound.min, bound.max)).unwrap_or_default()
    }

    fn required<T>(&mut self, path: &str, what: &str, value: Option<T>) -> Option<T> {
        if value.is_none() {
            self.fail(path, format!("missing `{what}`"));
        }
        value
    }

    /// A header name, or the problem at `path`.
    fn header_name(&mut self, path: impl Into<String>, name: &str) -> Option<http::HeaderName> {
        http::HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
            .map_err(|_| self.fail(path, format!("{name:?} is not a header name")))
            .ok()
    }

    fn name(&mut self, path: &str, name: &str) {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !ok {
            self.fail(
                path,
                format!("name {name:?} must be 1-64 characters of A-Z a-z 0-9 - _ ."),
            );
        }
    }
}

pub(super) fn policy(raw: RawConfig, file: &Path, base: &Path) -> Result<Policy, ConfigError> {
    let mut c = Checker {
        problems: Vec::new(),
    };
    if raw.version != 1 {
        c.fail(
            "version",
            format!("unsupported version {} (expected 1)", raw.version),
        );
    }
    let server = server(&mut c, raw.server, base);
    let store = store(&mut c, raw.store);
    let client_ip = client_ip(&mut c, raw.client_ip);
    let ip_rules = IpRules {
        deny: nets(&mut c, "ip_rules.deny", &raw.ip_rules.deny),
        allow: nets(&mut c, "ip_rules.allow", &raw.ip_rules.allow),
    };
    let memory = store.backend == Backend::Memory;
    let mut notes = Vec::new();
    let (limits, limit_ids) = limits(&mut c, raw.limits, memory, &mut notes);
    let (plans, plan_ids) = plans(&mut c, raw.plans, &limits, &limit_ids);
    let auth = auth(&mut c, raw.auth, base, &plan_ids, &limits)?;
    let (upstreams, pool_ids) = upstreams(&mut c, raw.upstreams, base);
    let ctx = RouteContext {
        limits: &limits,
        limit_ids: &limit_ids,
        plans: &plans,
        pool_ids: &pool_ids,
        jwt: !auth.jwt.is_empty(),
        forward: auth.forward.is_some(),
    };
    let routes = routes(
        &mut c,
        raw.routes,
        &ctx,
        server.edge.max_body_bytes,
        server.edge.path.into(),
    );
    let usage = raw
        .usage
        .map(|u| usage::usage(&mut c, u, base, &store, &routes));
    if !c.problems.is_empty() {
        return Err(ConfigError::Invalid {
            file: file.display().to_string(),
            problems: c.problems,
        });
    }
    Ok(Policy {
        file: file.to_path_buf(),
        policy_version: raw.policy_version.unwrap_or_else(|| "unversioned".into()),
        server,
        store,
        notes,
        client_ip,
        ip_rules,
        auth,
        plans,
        limits,
        upstreams,
        routes,
        ratelimit_headers: raw.responses.ratelimit_headers == RateLimitHeaders::Draft,
        usage,
    })
}

fn env_name(c: &mut Checker, path: &str, name: &str) {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        c.fail(
            path,
            format!("{name:?} is not an environment variable name"),
        );
    }
}
