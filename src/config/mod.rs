//! Configuration: the YAML schema, its strict validation into a typed
//! [`Policy`], and the errors that point operators at the offending line.

pub mod bounds;
mod policy;
pub mod schema;
mod suggest;
mod validate;

use std::fmt;
use std::path::{Path, PathBuf};

pub use policy::*;
pub use validate::{override_params, resolve_override};

/// Why a configuration file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be opened or read.
    #[error("{file}: cannot read: {source}")]
    Read {
        /// The file, as given.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file did not parse into the schema: bad YAML, a wrong type, an unknown
    /// key, or a file too large or nested too deep.
    #[error("{file}{location}: {message}")]
    Syntax {
        /// The file, as given.
        file: String,
        /// Where the parser stopped, when known.
        location: Location,
        /// The parser's message, with the path of the offending key.
        message: String,
    },
    /// The file parsed but broke semantic rules; every problem is listed.
    #[error("{}", render_problems(file, problems))]
    Invalid {
        /// The file, as given.
        file: String,
        /// Every problem found, in the order they were found.
        problems: Vec<Problem>,
    },
}

/// A line and column in a file, shown as `:line:column` when known.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Location(pub Option<(usize, usize)>);

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some((line, column)) => write!(f, ":{line}:{column}"),
            None => Ok(()),
        }
    }
}

/// One semantic problem: where in the document, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where in the document, e.g. `routes[0].limits[1]`.
    pub path: String,
    /// What is wrong, with the offending value.
    pub message: String,
}

fn render_problems(file: &str, problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("{file}: {}: {}", p.path, p.message))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Reads, parses and validates a policy file.
pub fn load(path: &Path) -> Result<Policy, ConfigError> {
    from_text(path, &read(path, MAX_FILE_BYTES)?)
}

/// Parses and validates a policy's `text` as if read from `path` (files it
/// names are resolved beside `path`): a policy built from plain values.
pub fn from_text(path: &Path, text: &str) -> Result<Policy, ConfigError> {
    let raw: schema::RawConfig = parse(path, text)?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    validate::policy(raw, path, &base)
}

/// The first line of the demo policy the container image carries; the
/// gateway warns at start while it serves a file that opens with it.
pub const DEMO_MARKER: &str = "# tollgate: demo policy";

/// Whether the policy at `path` is the image's demo policy (its first line
/// is [`DEMO_MARKER`]).
pub fn is_demo(path: &Path) -> bool {
    std::fs::read_to_string(path)
        .map(|text| text.lines().next().map(str::trim_end) == Some(DEMO_MARKER))
        .unwrap_or(false)
}

/// The files a policy at `path` is read from: the policy itself, its keys
/// file, its TLS certificate and key, its JWKS files, resolved as loading
/// resolves them. Only the policy when it does not parse.
pub fn files_of(path: &Path) -> Vec<PathBuf> {
    let mut files = vec![path.to_path_buf()];
    let Ok(raw) =
        read(path, MAX_FILE_BYTES).and_then(|text| parse::<schema::RawConfig>(path, &text))
    else {
        return files;
    };
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let named = raw.auth.keys_file.into_iter();
    let tls = raw
        .server
        .tls
        .into_iter()
        .flat_map(|t| [t.cert_file, t.key_file]);
    let jwks = raw.auth.jwt.into_iter().filter_map(|j| j.jwks_file);
    for file in named.chain(tls).chain(jwks) {
        let file = base.join(file);
        if !files.contains(&file) {
            files.push(file);
        }
    }
    files
}

/// Policy files larger than this are refused unread.
const MAX_FILE_BYTES: u64 = 64 << 20;
/// Deeper nesting is refused before parsing: no policy needs it, and a
/// parser's work on it grows faster than its size.
const MAX_DEPTH: usize = 64;

/// The text of `path`, refused when it is larger than `most` bytes.
fn read(path: &Path, most: u64) -> Result<String, ConfigError> {
    let read_error = |source| ConfigError::Read {
        file: path.display().to_string(),
        source,
    };
    let too_large = || ConfigError::Syntax {
        file: path.display().to_string(),
        location: Location(None),
        message: format!("file is larger than {} MiB", most >> 20),
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    // Refused unread when its size says so; the read is bounded too, for
    // a file that grows meanwhile or has no size.
    if file.metadata().is_ok_and(|m| m.len() > most) {
        return Err(too_large());
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(file, most + 1), &mut text)
        .map_err(read_error)?;
    if text.len() as u64 > most {
        return Err(too_large());
    }
    Ok(text)
}

/// An upper bound of a YAML document's nesting: block levels by
/// indentation (and `- ` items opening on one line), plus flow levels by
/// brackets. Stops counting past `limit`.
fn nesting_depth(text: &str, limit: usize) -> usize {
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    let mut deepest = 0usize;
    for line in text.lines() {
        let content = line.trim_start_matches(' ');
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let mut column = line.len() - content.len();
        let mut rest = content;
        loop {
            while indents.last().is_some_and(|&top| top > column) {
                indents.pop();
            }
            if indents.last() != Some(&column) {
                indents.push(column);
            }
            match rest.strip_prefix("- ").or_else(|| rest.strip_prefix("? ")) {
                Some(after) => {
                    let item = after.trim_start_matches(' ');
                    column += rest.len() - item.len();
                    rest = item;
                }
                None => break,
            }
        }
        let mut quote = None;
        for b in rest.bytes() {
            match (quote, b) {
                (None, b'\'' | b'"') => quote = Some(b),
                (Some(q), _) if q == b => quote = None,
                (None, b'#') => break,
                (None, b'[' | b'{') => flow += 1,
                (None, b']' | b'}') => flow = flow.saturating_sub(1),
                _ => {}
            }
            deepest = deepest.max(indents.len() + flow);
        }
        deepest = deepest.max(indents.len() + flow);
        if deepest > limit {
            break;
        }
    }
    deepest
}

/// Parses YAML into a raw schema type, turning serde's message into
/// `file:line:column: path: message`.
fn parse<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T, ConfigError> {
    if nesting_depth(text, MAX_DEPTH) > MAX_DEPTH {
        return Err(ConfigError::Syntax {
            file: path.display().to_string(),
            location: Location(None),
            message: format!("nested deeper than {MAX_DEPTH} levels"),
        });
    }
    serde_yaml::from_str(text).map_err(|e| {
        let location = Location(e.location().map(|l| (l.line(), l.column())));
        let mut message = e.to_string();
        if let Some((line, column)) = location.0 {
            let suffix = format!(" at line {line} column {column}");
            if let Some(stripped) = message.strip_suffix(&suffix) {
                message = stripped.to_string();
            }
        }
        if let Some(suggested) = suggest::parser_message(&message) {
            message = suggested;
        }
        ConfigError::Syntax {
            file: path.display().to_string(),
            location,
            message,
        }
    })
}

/// A keys file larger than this is refused unread. It only holds
/// credentials, read line by line in the line format, so it may be far
/// larger than a policy.
const MAX_KEYS_FILE_BYTES: u64 = 512 << 20;

/// A keys file: YAML (`.yaml`, `.yml`), or the line format (any other
/// name), read as it is checked. Either may be up to
/// [`MAX_KEYS_FILE_BYTES`]; the line format is the one that loads a large
/// file fast and small in memory.
enum KeysFile {
    Yaml(schema::RawKeysFile),
    Lines(std::io::BufReader<std::fs::File>),
}

/// Opens the separate keys file named by `auth.keys_file`.
fn load_keys_file(path: &Path) -> Result<KeysFile, ConfigError> {
    let yaml = path.extension().is_some_and(|x| x == "yaml" || x == "yml");
    if yaml {
        let text = read(path, MAX_KEYS_FILE_BYTES)?;
        return parse(path, &text).map(KeysFile::Yaml);
    }
    let read_error = |source| ConfigError::Read {
        file: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let size = file.metadata().map_err(read_error)?.len();
    if size > MAX_KEYS_FILE_BYTES {
        return Err(ConfigError::Syntax {
            file: path.display().to_string(),
            location: Location(None),
            message: format!("file is larger than {} MiB", MAX_KEYS_FILE_BYTES >> 20),
        });
    }
    Ok(KeysFile::Lines(std::io::BufReader::with_capacity(
        1 << 20,
        file,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nesting_is_bounded_in_every_style() {
        let flow = format!("a: {}{}", "[".repeat(100), "]".repeat(100));
        assert!(nesting_depth(&flow, MAX_DEPTH) > MAX_DEPTH);
        let block: String = (0..100)
            .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
            .collect();
        assert!(nesting_depth(&block, MAX_DEPTH) > MAX_DEPTH);
        let items = format!("{}x\n", "- ".repeat(100));
        assert!(nesting_depth(&items, MAX_DEPTH) > MAX_DEPTH);
        let quoted = format!("a: \"{}\"\n# {}\n", "[".repeat(100), "{".repeat(100));
        assert!(nesting_depth(&quoted, MAX_DEPTH) <= 2);
    }

    #[test]
    fn the_shipped_policies_are_shallow() {
        for file in ["config/quickstart.yaml", "config/production.yaml"] {
            let text =
                std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(file)).unwrap();
            assert!(nesting_depth(&text, MAX_DEPTH) < 10, "{file}");
        }
    }

    #[test]
    fn ipv4_mapped_networks_mean_their_ipv4_network() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("p.yaml");
        let text = "version: 1\nclient_ip: { trusted_proxies: [\"::ffff:10.0.0.0/104\"] }\n\
                    ip_rules: { deny: [\"::ffff:127.0.0.1\", \"2001:db8::/32\"] }\n\
                    routes: [{ name: r, path: /, auth: none, respond: { status: 200 } }]\n";
        std::fs::write(&file, text).unwrap();
        let policy = load(&file).unwrap();
        assert_eq!(
            policy.client_ip.trusted_proxies,
            ["10.0.0.0/8".parse::<ipnet::IpNet>().unwrap()]
        );
        assert!(policy.client_ip.is_trusted("10.1.2.3".parse().unwrap()));
        assert!(!policy.ip_rules.admits("127.0.0.1".parse().unwrap()));
        assert!(policy.ip_rules.admits("127.0.0.2".parse().unwrap()));
        assert!(!policy.ip_rules.admits("2001:db8::1".parse().unwrap()));
    }

    #[test]
    fn a_deep_document_is_refused_quickly() {
        let deep = format!(
            "version: 1\nroutes: {}{}",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        let err = parse::<schema::RawConfig>(Path::new("deep.yaml"), &deep).unwrap_err();
        assert_eq!(err.to_string(), "deep.yaml: nested deeper than 64 levels");
    }
}
