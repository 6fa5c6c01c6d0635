//! "Did you mean": the nearest of the names a misspelling could have meant,
//! offered only when it is close, for unknown keys and values (from the
//! parser's message) and for names referred to but not defined.

/// The candidate nearest to `word` by edit distance (a swap of two
/// neighbouring letters counts once), when it is close: at most one edit in
/// a short word, a third of the word's length in a longer one. Ties go to
/// the name first in order, so the answer never depends on a map's order.
pub fn nearest<'a, I>(word: &str, candidates: I) -> Option<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    let most = (word.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (strsim::damerau_levenshtein(word, c), c))
        .filter(|&(d, _)| d <= most)
        .min()
        .map(|(_, c)| c)
}

/// `message` with `; did you mean "name"?` when a name is close to `word`.
pub fn with_nearest<'a, I>(message: String, word: &str, candidates: I) -> String
where
    I: IntoIterator<Item = &'a str>,
{
    match nearest(word, candidates) {
        Some(name) => format!("{message}; did you mean {name:?}?"),
        None => message,
    }
}

/// The parser's message for an unknown key or value, rewritten with the
/// nearest expected one when it is close:
/// `limits.x: unknown field `refil_per_second`, expected one of …` becomes
/// `unknown key refil_per_second at limits.x; did you mean refill_per_second?`.
/// Other messages, and misspellings near nothing, are left as they are.
pub fn parser_message(message: &str) -> Option<String> {
    let (path, rest) = match message.find(": unknown ") {
        Some(i) => (&message[..i], &message[i + 2..]),
        None => ("", message),
    };
    let (what, rest) = if let Some(rest) = rest.strip_prefix("unknown field `") {
        ("key", rest)
    } else if let Some(rest) = rest.strip_prefix("unknown variant `") {
        ("value", rest)
    } else {
        return None;
    };
    let (word, expected) = rest.split_once('`')?;
    // The expected names are the backticked words after the unknown one.
    let candidates = expected.split('`').skip(1).step_by(2);
    let name = nearest(word, candidates)?;
    let at = if path.is_empty() {
        "the top level"
    } else {
        path
    };
    Some(format!(
        "unknown {what} {word} at {at}; did you mean {name}?"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misspellings_get_the_name_they_meant() {
        let keys = [
            "key",
            "algorithm",
            "capacity",
            "refill_per_second",
            "limit",
            "window_seconds",
        ];
        let table = [
            ("refil_per_second", Some("refill_per_second")),
            ("refill_per_seconds", Some("refill_per_second")),
            ("capcity", Some("capacity")),
            ("capaicty", Some("capacity")),
            ("algoritm", Some("algorithm")),
            ("windows_seconds", Some("window_seconds")),
            ("lmit", Some("limit")),
            ("keys", Some("key")),
            // Nothing close: no suggestion rather than a wild one.
            ("burst", None),
            ("rate", None),
            ("x", None),
        ];
        for (word, expected) in table {
            assert_eq!(nearest(word, keys), expected, "{word}");
        }
    }

    #[test]
    fn the_parsers_message_is_rewritten_only_when_a_name_is_close() {
        let table = [
            (
                "limits.per-tenant: unknown field `refil_per_second`, expected one of `key`, `capacity`, `refill_per_second`",
                Some("unknown key refil_per_second at limits.per-tenant; did you mean refill_per_second?"),
            ),
            (
                "unknown field `limtis`, expected one of `version`, `limits`, `routes`",
                Some("unknown key limtis at the top level; did you mean limits?"),
            ),
            (
                "limits.a.algorithm: unknown variant `tokenbucket`, expected one of `token_bucket`, `gcra`",
                Some("unknown value tokenbucket at limits.a.algorithm; did you mean token_bucket?"),
            ),
            (
                "limits.a.algorithm: unknown variant `leaky_bucket`, expected one of `token_bucket`, `gcra`",
                None,
            ),
            (
                "server: unknown field `treads`, expected `threads`",
                Some("unknown key treads at server; did you mean threads?"),
            ),
            ("routes: invalid type: map, expected a sequence", None),
        ];
        for (message, expected) in table {
            assert_eq!(parser_message(message).as_deref(), expected, "{message}");
        }
    }
}
