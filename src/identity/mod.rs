//! Who a request comes from: every source that can name a caller, and the
//! records an operator puts at runtime about callers.
//!
//! - [`auth`]: the API key as presented, its keyed digest, and the table
//!   of the policy's keys (and its keys file): the `file` source.
//! - [`jwt`]: bearer tokens verified against issuers' key sets.
//! - [`store_keys`]: credentials kept in the shared store, cached.
//! - [`forward_auth`]: an HTTP service asked about keys no other source
//!   knows, its answers cached.
//! - [`revocations`] and [`overrides`]: a credential refused, a tenant's
//!   other plan or numbers, until an expiry; both kept as [`records`].
//! - [`single_flight`]: one lookup at a time per key, shared by the
//!   lookups above.
//!
//! Nothing here decides a limit. The request path asks these sources in
//! order (see `admission::identify`) and hands the caller they name to
//! the limits; the configuration builds the sources' settings, so nothing
//! here reads the configuration.

pub mod auth;
pub mod forward_auth;
pub mod jwt;
pub mod overrides;
pub mod records;
pub mod revocations;
pub mod single_flight;
pub mod store_keys;

/// The source that named a request's caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuthSource {
    /// The policy's keys, or its keys file.
    File,
    /// A verified JWT.
    Jwt,
    /// The shared store's credentials.
    Store,
    /// The forward-auth service (asked now, or its answer cached).
    Forward,
}

impl AuthSource {
    /// Every source, in the order the request path asks them.
    pub const ALL: [Self; 4] = [Self::File, Self::Jwt, Self::Store, Self::Forward];

    /// Its name in access-log lines, usage records and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Jwt => "jwt",
            Self::Store => "store",
            Self::Forward => "forward",
        }
    }

    /// The source an access-log line or usage record names.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// Whether the policy lists the callers this source names: a caller
    /// named by any other source is known by what the source said alone.
    pub const fn listed(self) -> bool {
        matches!(self, Self::File)
    }
}

impl std::fmt::Display for AuthSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
