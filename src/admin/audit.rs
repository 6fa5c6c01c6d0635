//! The audit log: one JSON line for every admin write, and for every
//! refused one, in `server.audit_log.path` or the process log. Never
//! sampled or rate-limited: admin writes are few, and each must be found.

use std::io::Write;
use std::path::Path;

use serde::Serialize;

/// The log target of audit lines when no file is configured.
pub const TARGET: &str = "tollgate::audit";

/// One admin action, as recorded.
#[derive(Debug, Serialize)]
pub struct Entry<'a> {
    /// RFC 3339, UTC, milliseconds.
    pub time: String,
    /// The token's name (`env` for `admin_token_env`), `anonymous` or
    /// `unknown`.
    pub actor: &'a str,
    /// What was asked: `reload`, …
    pub action: &'a str,
    /// What it acts on: `policy`, a key's limit and dimensions, or the
    /// path of a refused write.
    pub target: serde_json::Value,
    /// The state before, when it has one.
    pub before: serde_json::Value,
    /// The state after, or why nothing changed.
    pub after: serde_json::Value,
    /// The reason the caller gave.
    pub reason: Option<&'a str>,
    /// `ok`, `rejected` (the request was invalid) or `refused` (not
    /// allowed).
    pub result: &'a str,
}

/// Appends `entry` to `file` (created mode 0600), or writes it to the
/// process log when there is none or the file cannot be written.
pub fn record(file: Option<&Path>, entry: &Entry<'_>) {
    let line = serde_json::to_string(entry).unwrap_or_default();
    if let Some(path) = file {
        match append(path, &line) {
            Ok(()) => return,
            Err(e) => {
                tracing::error!(target: TARGET, path = %path.display(), error = %e, "cannot write the audit log; the line follows");
            }
        }
    }
    tracing::info!(target: TARGET, "{line}");
}

fn append(path: &Path, line: &str) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.create(true).append(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(format!("{line}\n").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_entry_is_one_json_line_appended() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        for result in ["ok", "refused"] {
            record(
                Some(&path),
                &Entry {
                    time: "2026-12-01T00:00:00.000Z".into(),
                    actor: "oncall",
                    action: "reload",
                    target: serde_json::json!("policy"),
                    before: serde_json::json!("v1"),
                    after: serde_json::json!("v2"),
                    reason: None,
                    result,
                },
            );
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["actor"], "oncall");
        assert_eq!(lines[1]["result"], "refused");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
