//! The scripts of `lua/`, one per concern, as a server runs them.
//!
//! `lua/limits.lua` holds what every script shares (the wire format, the
//! algorithms, reading and writing state); each concern adds its own file:
//! `decide.lua` the request path's decisions, `settle.lua` giving back what
//! decisions spent (a hold at the end of its request, a lease's unused
//! units, a cost settled lower, a cluster slot's undone part) and
//! `inspect.lua` the operators' peeks, resets and credits; `serve.lua`
//! ends each text. A decision's script holds no code of the other
//! concerns: run as a script (`EVALSHA`, which runs the whole text on
//! every call), it defines only what a decision uses. As a function
//! library (`FUNCTION LOAD`) the files are one library, each concern a
//! function of its own.

use super::codec::{self, Request};

/// What every script shares.
const LIMITS: &str = include_str!("../../../lua/limits.lua");
/// Decisions.
const DECIDE: &str = include_str!("../../../lua/decide.lua");
/// Give-backs.
const SETTLE: &str = include_str!("../../../lua/settle.lua");
/// Peeks, resets and credits.
const INSPECT: &str = include_str!("../../../lua/inspect.lua");
/// The end of every script and of the library.
const SERVE: &str = include_str!("../../../lua/serve.lua");

/// What a script call is for. A call carries requests of one concern; the
/// calls of one batch are sent in this order (see [`Concern::of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Concern {
    /// Give-backs, sent first: a hold released before a decision that
    /// queued beside it is decided after the release, as the holds
    /// promise (the client's next request).
    Settle,
    /// Decisions.
    Decide,
    /// Operators' peeks, resets and credits, sent last: a peek sees the
    /// decisions it waited beside, a reset clears them (they were all
    /// pending together, so either order is one a caller could see).
    Inspect,
}

impl Concern {
    /// Every concern, in the order a batch's calls are sent.
    pub const ALL: [Concern; 3] = [Concern::Settle, Concern::Decide, Concern::Inspect];

    /// Its name: its file's, and its function's after the library's prefix.
    pub fn name(self) -> &'static str {
        match self {
            Concern::Settle => "settle",
            Concern::Decide => "decide",
            Concern::Inspect => "inspect",
        }
    }

    /// What `request` asks for: a decision (refund time 0), an operator's
    /// peek, reset or credit, or a give-back.
    pub fn of(request: &Request) -> Self {
        match request.refund_at {
            0 => Concern::Decide,
            at if at >= codec::CREDIT => Concern::Inspect,
            _ => Concern::Settle,
        }
    }

    /// The files after `limits.lua` that its script holds (a credit gives
    /// back as a settlement does, where an algorithm has no credit of its
    /// own).
    fn files(self) -> &'static [&'static str] {
        match self {
            Concern::Settle => &[SETTLE],
            Concern::Decide => &[DECIDE],
            Concern::Inspect => &[SETTLE, INSPECT],
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One concern's script: its text and the hash it is called by.
#[derive(Debug, Clone)]
pub struct Script {
    /// The text `EVAL` sends.
    pub text: String,
    /// Its SHA-1, for `EVALSHA`.
    pub sha: String,
}

/// Every concern's script, and the function library that holds them all.
#[derive(Debug, Clone)]
pub struct Scripts {
    scripts: [Script; 3],
    library: String,
    functions: [String; 3],
}

impl Scripts {
    /// The scripts of this build. The library's name carries a hash of its
    /// text, so that gateways of different versions can share a server.
    pub fn new() -> Self {
        let body: String = [LIMITS, DECIDE, SETTLE, INSPECT, SERVE].concat();
        let tag = redis::Script::new(&body).get_hash()[..12].to_owned();
        let prefix = format!("tollgate_{tag}_");
        let library =
            format!("#!lua name=tollgate_{tag}\nlocal PREFIX, CONCERN = '{prefix}', nil\n{body}");
        let scripts = Concern::ALL.map(|concern| {
            let mut text = format!("local PREFIX, CONCERN = nil, '{}'\n", concern.name());
            text.push_str(LIMITS);
            concern.files().iter().for_each(|f| text.push_str(f));
            text.push_str(SERVE);
            let sha = redis::Script::new(&text).get_hash().to_owned();
            Script { text, sha }
        });
        let functions = Concern::ALL.map(|concern| format!("{prefix}{}", concern.name()));
        Self {
            scripts,
            library,
            functions,
        }
    }

    /// The script of `concern`.
    pub fn script(&self, concern: Concern) -> &Script {
        &self.scripts[concern.index()]
    }

    /// The function of `concern` in the library.
    pub fn function(&self, concern: Concern) -> &str {
        &self.functions[concern.index()]
    }

    /// The library's source, for `FUNCTION LOAD`.
    pub fn library(&self) -> &str {
        &self.library
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_script_holds_no_other_concern() {
        let scripts = Scripts::new();
        let decide = &scripts.script(Concern::Decide).text;
        assert!(decide.contains("HANDLERS.decide"));
        for other in [
            "HANDLERS.settle",
            "HANDLERS.inspect",
            "function token_bucket.refund",
        ] {
            assert!(!decide.contains(other), "{other}");
        }
        let inspect = &scripts.script(Concern::Inspect).text;
        assert!(inspect.contains("HANDLERS.inspect") && inspect.contains("function gcra.refund"));
        let library = scripts.library();
        for concern in Concern::ALL {
            assert!(library.contains(&format!("HANDLERS.{}", concern.name())));
            assert!(scripts.function(concern).ends_with(concern.name()));
        }
        let shas: std::collections::HashSet<_> = Concern::ALL
            .iter()
            .map(|&c| &scripts.script(c).sha)
            .collect();
        assert_eq!(shas.len(), 3);
    }

    #[test]
    fn every_request_has_one_concern() {
        let request = |refund_at| Request {
            keys: Vec::new(),
            limits: Vec::new(),
            blocked_from: 255,
            refund_at,
        };
        assert_eq!(Concern::of(&request(0)), Concern::Decide);
        assert_eq!(Concern::of(&request(1)), Concern::Settle);
        assert_eq!(Concern::of(&request(1_764_000_000_000)), Concern::Settle);
        for at in [codec::PEEK, codec::RESET, codec::CREDIT] {
            assert_eq!(Concern::of(&request(at)), Concern::Inspect);
        }
    }
}
