//! `auth`: the key header and the credentials, inline and from a keys file.

use super::*;

pub(super) fn auth(
    c: &mut Checker,
    raw: RawAuth,
    base: &Path,
    plan_ids: &HashMap<String, PlanId>,
    limits: &[Limit],
) -> Result<AuthSettings, ConfigError> {
    let header_text = raw.header.unwrap_or_else(|| "authorization".into());
    let header = c
        .header_name("auth.header", &header_text)
        .unwrap_or(http::header::AUTHORIZATION);
    let mut keys = KeysLoader::new(plan_ids);
    for (i, k) in raw.keys.iter().enumerate() {
        keys.add(c, &format!("auth.keys[{i}]"), Entry::from(k));
    }
    if let Some(file) = raw.keys_file {
        let path: PathBuf = base.join(file);
        match load_keys_file(&path) {
            Ok(KeysFile::Yaml(extra)) => {
                for (i, k) in extra.keys.iter().enumerate() {
                    let at = format!("{}: keys[{i}]", path.display());
                    keys.add(c, &at, Entry::from(k));
                }
            }
            Ok(KeysFile::Lines(reader)) => keys.add_lines(c, &path, reader),
            // A missing file is a problem of this one; a broken one names itself.
            Err(ConfigError::Read { file, source }) => {
                c.fail("auth.keys_file", format!("cannot read {file}: {source}"))
            }
            Err(e) => return Err(e),
        }
    }
    let keys = keys.finish(c);
    // What the limits key on from the identity sources, kept with the
    // callers the sources name.
    let mut claims: Vec<Box<str>> = Vec::new();
    let mut headers: Vec<http::HeaderName> = Vec::new();
    for dim in limits.iter().flat_map(|l| l.values.dims.iter()) {
        match dim {
            ValueDim::Claim(name) if !claims.contains(name) => claims.push(name.clone()),
            ValueDim::Auth(name) if !headers.contains(name) => headers.push(name.clone()),
            _ => {}
        }
    }
    let mut jwt = jwt_issuers(c, raw.jwt, base);
    jwt.keep_claims(claims);
    let forward = raw
        .forward_auth
        .and_then(|f| forward_auth(c, f, &header, plan_ids))
        .map(|mut s| {
            s.keyed_headers = headers;
            s
        })
        .map(|s| std::sync::Arc::new(crate::identity::forward_auth::ForwardAuth::new(s)));
    let store_keys = raw
        .store_keys
        .map(|s| crate::identity::store_keys::Settings {
            cache_entries: c.bounded(
                "auth.store_keys.cache_entries",
                s.cache_entries,
                bounds::STORE_KEYS_CACHE_ENTRIES,
            ) as usize,
            negative_ttl: Duration::from_secs(c.bounded(
                "auth.store_keys.negative_ttl_s",
                s.negative_ttl_s,
                bounds::STORE_KEYS_NEGATIVE_TTL_S,
            )),
        });
    Ok(AuthSettings {
        header,
        keys,
        forward_key: raw.forward_key,
        jwt,
        store_keys,
        forward,
    })
}

/// `auth.forward_auth`: the service's URL resolved now (again at each
/// reload), the header names, the bounds.
fn forward_auth(
    c: &mut Checker,
    raw: RawForwardAuth,
    auth_header: &http::HeaderName,
    plan_ids: &HashMap<String, PlanId>,
) -> Option<crate::identity::forward_auth::Settings> {
    let path = "auth.forward_auth";
    let headers: Vec<_> = match &raw.headers {
        None => vec![auth_header.clone()],
        Some(list) => list
            .iter()
            .enumerate()
            .filter_map(|(i, h)| c.header_name(format!("{path}.headers[{i}]"), h))
            .collect(),
    };
    if raw.headers.as_ref().is_some_and(Vec::is_empty) {
        c.fail(
            format!("{path}.headers"),
            "needs at least one header: the service would be asked with nothing to tell callers apart",
        );
    }
    let tenant_header = c.header_name(format!("{path}.tenant_header"), &raw.tenant_header);
    let credential_header =
        c.header_name(format!("{path}.credential_header"), &raw.credential_header);
    let plan_header = match &raw.plan_header {
        Some(h) => Some(c.header_name(format!("{path}.plan_header"), h)?),
        None => None,
    };
    let timeout_ms = c.bounded(
        &format!("{path}.timeout_ms"),
        raw.timeout_ms,
        bounds::FORWARD_AUTH_TIMEOUT_MS,
    );
    let cache_ttl_s = c.bounded(
        &format!("{path}.cache_ttl_s"),
        raw.cache_ttl_s,
        bounds::FORWARD_AUTH_CACHE_TTL_S,
    );
    let negative_ttl_s = c.bounded(
        &format!("{path}.negative_ttl_s"),
        raw.negative_ttl_s,
        bounds::FORWARD_AUTH_NEGATIVE_TTL_S,
    );
    let max_entries = c.bounded(
        &format!("{path}.max_entries"),
        raw.max_entries,
        bounds::FORWARD_AUTH_MAX_ENTRIES,
    );
    let max_in_flight = c.bounded(
        &format!("{path}.max_in_flight"),
        raw.max_in_flight,
        bounds::FORWARD_AUTH_MAX_IN_FLIGHT,
    );
    let url_at = format!("{path}.url");
    let Ok(url) = url::Url::parse(&raw.url) else {
        c.fail(url_at, format!("{:?} is not a URL", raw.url));
        return None;
    };
    let tls = match url.scheme() {
        "https" => true,
        "http" => false,
        _ => {
            c.fail(url_at, "must be http:// or https://");
            return None;
        }
    };
    let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
        c.fail(url_at, "needs a host");
        return None;
    };
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let addr = match std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port)) {
        Ok(mut addrs) => addrs.next(),
        Err(_) => None,
    };
    let Some(addr) = addr else {
        c.fail(url_at, format!("cannot resolve {host}"));
        return None;
    };
    let authority = match url.port() {
        Some(p) => format!("{}:{p}", url.host_str().unwrap_or(&host)),
        None => url.host_str().unwrap_or(&host).to_owned(),
    };
    let mut target = url.path().to_owned();
    if let Some(q) = url.query() {
        target.push('?');
        target.push_str(q);
    }
    Some(crate::identity::forward_auth::Settings {
        addr,
        tls,
        host,
        authority,
        path: target,
        headers,
        tenant_header: tenant_header?,
        credential_header: credential_header?,
        plan_header,
        timeout: Duration::from_millis(timeout_ms),
        cache_ttl: Duration::from_secs(cache_ttl_s),
        negative_ttl: Duration::from_secs(negative_ttl_s),
        max_entries: max_entries as usize,
        max_in_flight: max_in_flight as usize,
        plans: plan_ids.clone(),
        keyed_headers: Vec::new(),
    })
}

/// `auth.jwt`: each issuer with its keys read from its JWKS file.
fn jwt_issuers(c: &mut Checker, raw: Vec<RawJwt>, base: &Path) -> crate::identity::jwt::Issuers {
    let mut names = HashSet::new();
    let mut out = Vec::new();
    for (i, j) in raw.into_iter().enumerate() {
        let path = format!("auth.jwt[{i}]");
        c.name(&format!("{path}.name"), &j.name);
        if !names.insert(j.name.clone()) {
            c.fail(
                format!("{path}.name"),
                format!("duplicate issuer name {:?}", j.name),
            );
        }
        if j.issuer.is_empty() {
            c.fail(
                format!("{path}.issuer"),
                "must name the `iss` of its tokens",
            );
        }
        if j.audiences.is_empty() {
            c.fail(format!("{path}.audiences"), "needs at least one audience");
        }
        if j.algorithms.is_empty() {
            c.fail(format!("{path}.algorithms"), "needs at least one algorithm");
        }
        let algorithms: Vec<_> = j
            .algorithms
            .iter()
            .enumerate()
            .filter_map(|(k, name)| {
                crate::identity::jwt::algorithm(name)
                    .map_err(|e| c.fail(format!("{path}.algorithms[{k}]"), e.to_string()))
                    .ok()
            })
            .collect();
        let refresh_s = c.bounded(
            &format!("{path}.refresh_s"),
            j.refresh_s,
            bounds::JWKS_REFRESH_S,
        );
        let jwks = match (&j.jwks_file, &j.jwks_url) {
            (Some(file), None) => jwks_file(c, &format!("{path}.jwks_file"), &base.join(file)),
            (None, Some(url)) => jwks_url(c, &format!("{path}.jwks_url"), url).map(|url| {
                crate::identity::jwt::Jwks::Url {
                    url,
                    refresh: std::time::Duration::from_secs(refresh_s),
                }
            }),
            _ => {
                c.fail(path.clone(), "needs one of jwks_file and jwks_url");
                None
            }
        };
        let leeway_s = c.bounded(
            &format!("{path}.leeway_s"),
            j.leeway_s,
            bounds::JWT_LEEWAY_S,
        );
        let Some(jwks) = jwks else { continue };
        let settings = crate::identity::jwt::IssuerSettings {
            name: j.name,
            issuer: j.issuer,
            audiences: j.audiences,
            algorithms,
            jwks,
            tenant_claim: j.tenant_claim,
            tenant_prefix: j.tenant_prefix,
            credential_claim: j.credential_claim.unwrap_or_else(|| "sub".into()),
            plan_claim: j.plan_claim,
            leeway_s,
        };
        match crate::identity::jwt::Issuer::new(settings) {
            Ok(issuer) => out.push(issuer),
            Err(e) => c.fail(format!("{path}.jwks_file"), e.to_string()),
        }
    }
    crate::identity::jwt::Issuers::new(out)
}

/// A JWKS file, read now.
fn jwks_file(c: &mut Checker, path: &str, file: &Path) -> Option<crate::identity::jwt::Jwks> {
    match std::fs::read(file) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(crate::identity::jwt::Jwks::Set)
            .map_err(|e| c.fail(path, format!("{}: not a JWKS: {e}", file.display())))
            .ok(),
        Err(e) => {
            c.fail(path, format!("cannot read {}: {e}", file.display()));
            None
        }
    }
}

/// A JWKS URL: `https://`, or `http://` to a loopback address (a sidecar
/// on the same host); keys must not travel in the clear.
fn jwks_url(c: &mut Checker, path: &str, text: &str) -> Option<String> {
    let Ok(url) = url::Url::parse(text) else {
        c.fail(path, format!("{text:?} is not a URL"));
        return None;
    };
    let loopback = match url.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(d)) => d == "localhost",
        None => false,
    };
    match url.scheme() {
        "https" => Some(text.to_owned()),
        "http" if loopback => Some(text.to_owned()),
        _ => {
            c.fail(path, "must be https://, or http:// to a loopback address");
            None
        }
    }
}

/// One credential as written, in `auth.keys`, a YAML keys file or a line.
pub(super) struct Entry<'e> {
    id: &'e str,
    tenant: &'e str,
    plan: Option<&'e str>,
    sha256: &'e str,
}

impl<'e> From<&'e RawKey> for Entry<'e> {
    fn from(k: &'e RawKey) -> Self {
        Self {
            id: &k.id,
            tenant: &k.tenant,
            plan: k.plan.as_deref(),
            sha256: &k.sha256,
        }
    }
}

/// Problems a keys file may report before the rest of it is not read: a
/// file broken on every line says so without a million lines of it.
const MAX_KEY_PROBLEMS: usize = 100;

/// Credentials being loaded: the table (whose ids are one space for every
/// source, checked once all are read) and each tenant made once for all
/// its credentials.
pub(super) struct KeysLoader<'p> {
    plan_ids: &'p HashMap<String, PlanId>,
    table: KeyTableBuilder,
    tenants: HashMap<Box<str>, Tenant, ahash::RandomState>,
}

impl<'p> KeysLoader<'p> {
    pub(super) fn new(plan_ids: &'p HashMap<String, PlanId>) -> Self {
        Self {
            plan_ids,
            table: KeyTable::builder(),
            tenants: HashMap::default(),
        }
    }

    /// Checks one credential and adds it; problems at `path`.
    pub(super) fn add(&mut self, c: &mut Checker, path: &str, k: Entry<'_>) {
        c.name(&format!("{path}.id"), k.id);
        if k.tenant.is_empty() || k.tenant.len() > 256 {
            c.fail(format!("{path}.tenant"), "must be 1-256 characters");
        }
        let plan = k.plan.and_then(|p| {
            let id = self.plan_ids.get(p).copied();
            if id.is_none() {
                let message = format!("unknown plan {p:?}");
                let names = self.plan_ids.keys().map(String::as_str);
                c.fail(format!("{path}.plan"), with_nearest(message, p, names));
            }
            id
        });
        let Some(digest) = parse_digest(k.sha256).filter(|_| k.sha256.len() == 64) else {
            c.fail(
                format!("{path}.sha256"),
                "must be 64 hex digits (the SHA-256 of the raw key; see `tollgate hash-key`)",
            );
            return;
        };
        let tenant = match self.tenants.get(k.tenant) {
            Some(t) => Some(t.clone()),
            None => Tenant::new(k.tenant).inspect(|t| {
                self.tenants.insert(k.tenant.into(), t.clone());
            }),
        };
        let Some(credential) = tenant.and_then(|t| Credential::of_tenant(k.id, &t, plan)) else {
            c.fail(
                format!("{path}.tenant"),
                "must be printable text: it is sent to the upstream in x-tenant-id",
            );
            return;
        };
        self.table.insert(digest, credential);
    }

    /// The line format of a keys file: `<sha256> <id> <tenant> [<plan>]` per
    /// line, blank lines and `#` comments skipped; problems at
    /// `file:line`.
    pub(super) fn add_lines(&mut self, c: &mut Checker, file: &Path, mut reader: impl BufRead) {
        let before = c.problems.len();
        let mut line = String::new();
        let mut number = 0usize;
        loop {
            line.clear();
            number += 1;
            let at = || format!("{}:{number}", file.display());
            match reader.read_line(&mut line) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    c.fail(at(), format!("cannot read: {e}"));
                    break;
                }
            }
            if c.problems.len() - before >= MAX_KEY_PROBLEMS {
                c.fail(at(), format!("stopped after {MAX_KEY_PROBLEMS} problems"));
                break;
            }
            let text = line.trim();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            let mut fields = text.split_ascii_whitespace();
            let (Some(sha256), Some(id), Some(tenant), plan, None) = (
                fields.next(),
                fields.next(),
                fields.next(),
                fields.next(),
                fields.next(),
            ) else {
                c.fail(at(), "expected `<sha256> <id> <tenant> [<plan>]`");
                continue;
            };
            self.add(
                c,
                &at(),
                Entry {
                    id,
                    tenant,
                    plan,
                    sha256,
                },
            );
        }
    }

    /// The table; two credentials of one key digest are a problem.
    pub(super) fn finish(self, c: &mut Checker) -> KeyTable {
        let (table, twice) = self.table.build();
        // Sorted references, not a set of a million ids: no more memory
        // than a pointer a key while checking.
        let mut ids: Vec<&str> = table.credentials().map(|c| &*c.id).collect();
        ids.sort_unstable();
        for pair in ids.windows(2).filter(|p| p[0] == p[1]) {
            c.fail("auth", format!("duplicate credential id {:?}", pair[0]));
        }
        drop(ids);
        for (kept, again) in twice {
            c.fail(
                "auth",
                format!(
                    "credentials {:?} and {:?} have the same key digest: a key must name one caller",
                    kept.id, again.id
                ),
            );
        }
        table
    }
}
