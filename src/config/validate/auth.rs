//! `auth`: the key header and the credentials, inline and from a keys file.

use super::*;

pub(super) fn auth(
    c: &mut Checker,
    raw: RawAuth,
    base: &Path,
    plan_ids: &HashMap<String, PlanId>,
) -> Result<AuthSettings, ConfigError> {
    let header_text = raw.header.unwrap_or_else(|| "authorization".into());
    let header = match http::HeaderName::from_bytes(header_text.to_ascii_lowercase().as_bytes()) {
        Ok(h) => h,
        Err(_) => {
            c.fail(
                "auth.header",
                format!("{header_text:?} is not a header name"),
            );
            http::header::AUTHORIZATION
        }
    };
    let mut keys = KeyTable::default();
    let mut ids = HashSet::new();
    add_keys(c, "auth.keys", raw.keys, plan_ids, &mut keys, &mut ids);
    if let Some(file) = raw.keys_file {
        let path: PathBuf = base.join(file);
        match load_keys_file(&path) {
            Ok(extra) => {
                let prefix = format!("{}: keys", path.display());
                add_keys(c, &prefix, extra.keys, plan_ids, &mut keys, &mut ids);
            }
            // A missing file is a problem of this one; a broken one names itself.
            Err(ConfigError::Read { file, source }) => {
                c.fail("auth.keys_file", format!("cannot read {file}: {source}"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(AuthSettings {
        header,
        keys,
        forward_key: raw.forward_key,
    })
}

pub(super) fn add_keys(
    c: &mut Checker,
    prefix: &str,
    raw: Vec<RawKey>,
    plan_ids: &HashMap<String, PlanId>,
    table: &mut KeyTable,
    ids: &mut HashSet<String>,
) {
    for (i, k) in raw.into_iter().enumerate() {
        let path = format!("{prefix}[{i}]");
        c.name(&format!("{path}.id"), &k.id);
        if k.tenant.is_empty() || k.tenant.len() > 256 {
            c.fail(format!("{path}.tenant"), "must be 1-256 characters");
        }
        if !ids.insert(k.id.clone()) {
            c.fail(
                format!("{path}.id"),
                format!("duplicate credential id {:?}", k.id),
            );
        }
        let plan = k.plan.as_ref().and_then(|p| {
            let id = plan_ids.get(p).copied();
            if id.is_none() {
                let message = format!("unknown plan {p:?}");
                let names = plan_ids.keys().map(String::as_str);
                c.fail(format!("{path}.plan"), with_nearest(message, p, names));
            }
            id
        });
        let Some(digest) = parse_digest(&k.sha256).filter(|_| k.sha256.len() == 64) else {
            c.fail(
                format!("{path}.sha256"),
                "must be 64 hex digits (the SHA-256 of the raw key; see `tollgate hash-key`)",
            );
            continue;
        };
        let Some(credential) = Credential::new(&k.id, &k.tenant, plan) else {
            c.fail(
                format!("{path}.tenant"),
                "must be printable text: it is sent to the upstream in x-tenant-id",
            );
            continue;
        };
        if !table.insert(digest, credential) {
            c.fail(
                format!("{path}.sha256"),
                "the same key digest is listed twice",
            );
        }
    }
}
