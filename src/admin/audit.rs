//! The audit log: one JSON line for every admin write, allowed, refused or
//! failed, in `server.audit_log.path` or the process log.
//!
//! A write by a valid token is never left out: such writes are few (10 a
//! second per token at most), and each must be found. The refusals of
//! callers no token identified are another matter, since anyone who reaches
//! the admin port can cause them: their lines are held to
//! [`REFUSALS_PER_SECOND`] in all ([`Throttle`]), and the count of those
//! left out is one line of its own, written at the end of the second that
//! left them out (or before the next line, if that comes first). Every line
//! is at most [`MAX_LINE_BYTES`]: long values (a 30 KB path) are cut.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

/// The log target of audit lines when no file is configured.
pub const TARGET: &str = "tollgate::audit";

/// Audit lines a second, in all, for refusals of callers without a valid
/// token.
pub const REFUSALS_PER_SECOND: u32 = 10;

/// The longest audit line, in bytes (its newline aside).
pub const MAX_LINE_BYTES: usize = 1024;

/// What ends a value that was cut to fit the line.
const CUT: &str = "…[cut]";

/// One admin action, as recorded.
#[derive(Debug, Serialize)]
pub struct Entry<'a> {
    /// RFC 3339, UTC, milliseconds.
    pub time: String,
    /// The token's name (`env` for `admin_token_env`), `anonymous` or
    /// `unknown`.
    pub actor: &'a str,
    /// What was asked: `reload`, …, `read` for a refused read, or
    /// `suppressed` for the count of refusals left out.
    pub action: &'a str,
    /// What it acts on: `policy`, a key's limit and dimensions, or the
    /// method and path of a request that did nothing.
    pub target: serde_json::Value,
    /// The state before, when it has one.
    pub before: serde_json::Value,
    /// The state after, or why nothing changed.
    pub after: serde_json::Value,
    /// The reason the caller gave.
    pub reason: Option<&'a str>,
    /// `ok`, `rejected` (the request was invalid), `refused` (not
    /// allowed) or `error` (it failed).
    pub result: &'a str,
    /// Refusals left out of the log before this line (`suppressed` lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub suppressed: Option<u64>,
}

impl Entry<'_> {
    /// The line that says `count` refusals were left out.
    pub fn suppressed(time: String, count: u64) -> Entry<'static> {
        Entry {
            time,
            actor: "unknown",
            action: "suppressed",
            target: serde_json::Value::Null,
            before: serde_json::Value::Null,
            after: serde_json::Value::Null,
            reason: None,
            result: "refused",
            suppressed: Some(count),
        }
    }
}

/// Appends `entry` to `file` (created mode 0600), or writes it to the
/// process log when there is none or the file cannot be written.
pub fn record(file: Option<&Path>, entry: &Entry<'_>) {
    let line = line(entry);
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

/// `entry` as one JSON line of at most [`MAX_LINE_BYTES`]: every string
/// (object keys included) is cut shorter and shorter until it fits; what
/// still does not (a value of many short parts) is replaced by the start
/// of its JSON text.
pub fn line(entry: &Entry<'_>) -> String {
    let full = serde_json::to_string(entry).unwrap_or_default();
    if full.len() <= MAX_LINE_BYTES {
        return full;
    }
    let Ok(mut value) = serde_json::to_value(entry) else {
        return String::new();
    };
    let mut longest = 256;
    while longest >= 16 {
        cut_strings(&mut value, longest);
        let text = value.to_string();
        if text.len() <= MAX_LINE_BYTES {
            return text;
        }
        longest /= 2;
    }
    // Many short parts: each large field becomes a cut string of its JSON.
    for field in ["after", "before", "target", "reason"] {
        if let Some(v) = value.get_mut(field) {
            let text = v.to_string();
            *v = serde_json::Value::String(cut(&text, 64));
        }
        let text = value.to_string();
        if text.len() <= MAX_LINE_BYTES {
            return text;
        }
    }
    value.to_string()
}

/// Cuts every string of `value`, keys included, to at most `longest`
/// bytes (the marker added).
fn cut_strings(value: &mut serde_json::Value, longest: usize) {
    match value {
        serde_json::Value::String(s) if s.len() > longest => *s = cut(s, longest),
        serde_json::Value::Array(items) => {
            for item in items {
                cut_strings(item, longest);
            }
        }
        serde_json::Value::Object(map) => {
            let fields = std::mem::take(map);
            for (key, mut v) in fields {
                cut_strings(&mut v, longest);
                let key = if key.len() > longest {
                    cut(&key, longest)
                } else {
                    key
                };
                map.insert(key, v);
            }
        }
        _ => {}
    }
}

/// The start of `s`, cut at a character boundary, and the marker: at most
/// `longest` bytes in all (the marker alone when nothing else fits).
fn cut(s: &str, longest: usize) -> String {
    if s.len() <= longest {
        return s.to_string();
    }
    let mut end = longest.saturating_sub(CUT.len()).min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{CUT}", &s[..end])
}

/// The lines of refusals written a second, in all: a fixed one-second
/// window, and the count of those left out since the last line written.
#[derive(Debug, Default)]
pub struct Throttle {
    state: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    second: u64,
    written: u32,
    suppressed: u64,
    /// A `suppressed` line is due: its writer waits for the window's end.
    due: bool,
}

/// What [`Throttle::admit`] says of a refusal's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Write it, after a `suppressed` line when `left_out` is not 0.
    Write {
        /// The refusals left out before it, not said yet.
        left_out: u64,
    },
    /// Leave it out; it is counted.
    LeftOut {
        /// When this is the first left out since the count was last said:
        /// the end of its second (of the process clock), when the count is
        /// to be written ([`Throttle::take_left_out`]) if no line did so
        /// before.
        say_at: Option<Duration>,
    },
}

impl Throttle {
    /// Whether a refusal's line may be written at `now` (of the process
    /// clock).
    pub fn admit(&self, now: Duration) -> Admit {
        let second = now.as_secs();
        let mut window = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if window.second != second {
            window.second = second;
            window.written = 0;
        }
        if window.written >= REFUSALS_PER_SECOND {
            window.suppressed += 1;
            let first = !std::mem::replace(&mut window.due, true);
            return Admit::LeftOut {
                say_at: first.then(|| Duration::from_secs(second + 1)),
            };
        }
        window.written += 1;
        window.due = false;
        Admit::Write {
            left_out: std::mem::take(&mut window.suppressed),
        }
    }

    /// The refusals left out and not said yet, now said (0 when a line
    /// said them already).
    pub fn take_left_out(&self) -> u64 {
        let mut window = self.state.lock().unwrap_or_else(|e| e.into_inner());
        window.due = false;
        std::mem::take(&mut window.suppressed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry<'a>(actor: &'a str, target: serde_json::Value, result: &'a str) -> Entry<'a> {
        Entry {
            time: "2026-12-01T00:00:00.000Z".into(),
            actor,
            action: "reload",
            target,
            before: serde_json::json!("v1"),
            after: serde_json::json!("v2"),
            reason: None,
            result,
            suppressed: None,
        }
    }

    #[test]
    fn each_entry_is_one_json_line_appended() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        for result in ["ok", "refused"] {
            record(
                Some(&path),
                &entry("oncall", serde_json::json!("policy"), result),
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
        assert!(
            lines[0].get("suppressed").is_none(),
            "said only when some were"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn long_values_are_cut_to_fit_the_line_at_a_character_boundary() {
        let path = format!("/admin/{}", "é".repeat(15_000));
        let text = line(&entry("unknown", serde_json::json!(path), "refused"));
        assert!(text.len() <= MAX_LINE_BYTES, "{}", text.len());
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        let target = parsed["target"].as_str().unwrap();
        assert!(target.starts_with("/admin/éé") && target.ends_with(CUT));
        assert_eq!(parsed["actor"], "unknown");
        assert_eq!(parsed["after"], "v2", "short values are kept whole");

        // Control bytes grow when escaped; keys can be long too.
        let nasty = serde_json::json!({ "\u{1}".repeat(3_000): "\0".repeat(3_000) });
        let text = line(&entry("oncall", nasty, "rejected"));
        assert!(text.len() <= MAX_LINE_BYTES, "{}", text.len());
        assert!(serde_json::from_str::<serde_json::Value>(&text).is_ok());

        // Many short values: the field is replaced by the start of its text.
        let many: serde_json::Map<String, serde_json::Value> = (0..500)
            .map(|i| (format!("k{i}"), serde_json::json!(i)))
            .collect();
        let text = line(&entry("oncall", serde_json::Value::Object(many), "ok"));
        assert!(text.len() <= MAX_LINE_BYTES, "{}", text.len());
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(parsed["target"].as_str().unwrap().ends_with(CUT));
    }

    #[test]
    fn cutting_never_splits_a_character() {
        for longest in 0..20 {
            let s = cut(&"日本語".repeat(10), longest);
            assert!(s.ends_with(CUT), "{longest}: {s}");
        }
        assert_eq!(cut("short", 64), "short");
    }

    #[test]
    fn refusals_are_written_ten_a_second_then_counted() {
        let throttle = Throttle::default();
        let at = |ms: u64| Duration::from_millis(ms);
        let write = |left_out| Admit::Write { left_out };
        for i in 0..REFUSALS_PER_SECOND {
            assert_eq!(throttle.admit(at(5_000 + u64::from(i))), write(0));
        }
        // The first left out says when its count is due: the second's end.
        assert_eq!(
            throttle.admit(at(5_500)),
            Admit::LeftOut {
                say_at: Some(at(6_000))
            }
        );
        for _ in 1..25 {
            assert_eq!(throttle.admit(at(5_500)), Admit::LeftOut { say_at: None });
        }
        // A line written first says how many were left out, once.
        assert_eq!(throttle.admit(at(6_000)), write(25));
        assert_eq!(throttle.take_left_out(), 0);
        assert_eq!(throttle.admit(at(6_001)), write(0));
        // Without one, the count is taken when it is due, once.
        for _ in 0..8 {
            throttle.admit(at(6_002));
        }
        assert_eq!(
            throttle.admit(at(6_003)),
            Admit::LeftOut {
                say_at: Some(at(7_000))
            }
        );
        assert_eq!(throttle.admit(at(6_004)), Admit::LeftOut { say_at: None });
        assert_eq!(throttle.take_left_out(), 2);
        assert_eq!(throttle.take_left_out(), 0);
        assert_eq!(throttle.admit(at(60_000)), write(0));
    }
}
