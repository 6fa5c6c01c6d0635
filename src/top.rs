//! Heavy hitters: which callers spend the most, admitted and denied, in a
//! fixed-size space-saving sketch (Metwally et al.): memory stays bounded
//! however many callers there are, and every caller whose share exceeds
//! 1/capacity of the traffic is guaranteed to be listed.
//!
//! Identities are shown as keyed hashes unless the reader holds the admin
//! token; the same hashes identify callers in logs.

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Number of callers the sketch tracks.
pub const CAPACITY: usize = 128;

/// Turns identities into short stable hashes for logs and reports, keyed
/// per process so they cannot be reversed by guessing.
pub struct Redactor {
    mac: Hmac<Sha256>,
}

impl Redactor {
    /// A redactor keyed from the kernel's randomness. Without it there is
    /// no key that hides identities, so this fails rather than fall back to
    /// a guessable one.
    pub fn new() -> std::io::Result<Self> {
        let mut key = [0u8; 32];
        std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut key))?;
        Ok(Self {
            mac: Hmac::new_from_slice(&key).expect("HMAC accepts any key length"),
        })
    }

    /// A caller as `kind:tag`, its identity replaced by its tag.
    pub fn caller(&self, caller: &Caller) -> String {
        match caller {
            Caller::Credential(id) => format!("credential:{}", self.tag(id)),
            Caller::Ip(net) => format!("ip:{}", self.tag(&net.to_string())),
        }
    }

    /// A 12-hex-digit tag of an identity.
    pub fn tag(&self, identity: &str) -> String {
        let mut mac = self.mac.clone();
        mac.update(identity.as_bytes());
        hex::encode(&mac.finalize().into_bytes()[..6])
    }
}

/// Whom a request counts against: its credential, or before
/// authentication its client network.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Caller {
    /// An authenticated caller, by credential id.
    Credential(Arc<str>),
    /// A caller before authentication, by client network.
    Ip(ipnet::IpNet),
}

impl Caller {
    /// A digest of who it is, to count what it holds by (not kept, not
    /// shown).
    pub fn digest(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.hash(&mut h);
        h.finish()
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Credential(id) => write!(f, "credential:{id}"),
            Caller::Ip(net) => write!(f, "ip:{net}"),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Counts {
    admitted: u64,
    denied: u64,
    /// Over-count inherited from the entry this one replaced.
    error: u64,
}

impl Counts {
    fn total(&self) -> u64 {
        self.admitted + self.denied
    }
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Hitter {
    /// `credential:ID` or `ip:NETWORK`, or its keyed hash unless revealed.
    pub caller: String,
    /// Cost of its admitted requests.
    pub admitted_cost: u64,
    /// Cost of its denied requests.
    pub denied_cost: u64,
    /// Upper bound of how much of the counts may belong to other callers.
    pub max_overcount: u64,
}

/// The sketch.
#[derive(Default)]
pub struct Top {
    entries: Mutex<HashMap<Caller, Counts, ahash::RandomState>>,
}

impl Top {
    /// An empty sketch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts `cost` for a caller.
    pub fn record(&self, caller: &Caller, cost: u64, admitted: bool) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if !entries.contains_key(caller) && entries.len() >= CAPACITY {
            // Replace the smallest: the newcomer inherits its count as error.
            let smallest = entries
                .iter()
                .min_by_key(|(_, c)| c.total())
                .map(|(k, c)| (k.clone(), c.total()));
            if let Some((key, total)) = smallest {
                entries.remove(&key);
                entries.insert(
                    caller.clone(),
                    Counts {
                        admitted: 0,
                        denied: 0,
                        error: total,
                    },
                );
            }
        }
        let c = match entries.get_mut(caller) {
            Some(c) => c,
            None => entries.entry(caller.clone()).or_default(),
        };
        if admitted {
            c.admitted += cost;
        } else {
            c.denied += cost;
        }
    }

    /// The heaviest callers first, at most `n`; identities hashed unless
    /// `reveal`.
    pub fn report(&self, n: usize, reveal: bool, redactor: &Redactor) -> Vec<Hitter> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<(&Caller, &Counts)> = entries.iter().collect();
        rows.sort_by(|a, b| {
            (b.1.total() + b.1.error)
                .cmp(&(a.1.total() + a.1.error))
                .then(a.0.cmp(b.0))
        });
        rows.into_iter()
            .take(n)
            .map(|(caller, c)| Hitter {
                caller: if reveal {
                    caller.to_string()
                } else {
                    redactor.caller(caller)
                },
                admitted_cost: c.admitted,
                denied_cost: c.denied,
                max_overcount: c.error,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_callers_survive_a_flood_of_small_ones() {
        let top = Top::new();
        for round in 0..50 {
            top.record(&Caller::Credential("big".into()), 10, round % 5 != 0);
            for i in 0..20 {
                let net = format!("10.0.{round}.{i}/32").parse().unwrap();
                top.record(&Caller::Ip(net), 1, true);
            }
        }
        let r = Redactor::new().unwrap();
        let report = top.report(3, true, &r);
        assert_eq!(report[0].caller, "credential:big");
        assert_eq!((report[0].admitted_cost, report[0].denied_cost), (400, 100));
        assert!(top.entries.lock().unwrap().len() <= CAPACITY);
    }

    #[test]
    fn identities_are_hashed_unless_revealed() {
        let top = Top::new();
        top.record(&Caller::Credential("acme-ci".into()), 3, true);
        let r = Redactor::new().unwrap();
        let hidden = &top.report(1, false, &r)[0].caller;
        assert!(
            hidden.starts_with("credential:") && !hidden.contains("acme"),
            "{hidden}"
        );
        assert_eq!(hidden, &format!("credential:{}", r.tag("acme-ci")));
        assert_eq!(top.report(1, true, &r)[0].caller, "credential:acme-ci");
    }
}
