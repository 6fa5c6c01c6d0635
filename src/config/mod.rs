//! Configuration: the YAML schema, its strict validation into a typed
//! [`Policy`], and the errors that point operators at the offending line.

mod policy;
pub mod schema;
mod validate;

use std::fmt;
use std::path::Path;

pub use policy::*;

/// Why a configuration file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}{location}: {message}")]
    Syntax {
        file: String,
        location: Location,
        message: String,
    },
    #[error("{}", render_problems(file, problems))]
    Invalid {
        file: String,
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
    pub path: String,
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
    let text = read(path)?;
    let raw: schema::RawConfig = parse(path, &text)?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    validate::policy(raw, path, &base)
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        file: path.display().to_string(),
        source,
    })
}

/// Parses YAML into a raw schema type, turning serde's message into
/// `file:line:column: path: message`.
fn parse<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T, ConfigError> {
    serde_yaml::from_str(text).map_err(|e| {
        let location = Location(e.location().map(|l| (l.line(), l.column())));
        let mut message = e.to_string();
        if let Some((line, column)) = location.0 {
            let suffix = format!(" at line {line} column {column}");
            if let Some(stripped) = message.strip_suffix(&suffix) {
                message = stripped.to_string();
            }
        }
        ConfigError::Syntax {
            file: path.display().to_string(),
            location,
            message,
        }
    })
}

/// Reads the separate keys file named by `auth.keys_file`.
fn load_keys_file(path: &Path) -> Result<schema::RawKeysFile, ConfigError> {
    let text = read(path)?;
    parse(path, &text)
}
