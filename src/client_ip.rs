//! Client address resolution behind trusted reverse proxies.
//!
//! The TCP peer is the only address we can verify, so it is the starting
//! point. Forwarding headers are consulted only when that peer is a trusted
//! proxy, and the chain they carry is walked right to left (nearest hop
//! first), skipping hops that are themselves trusted proxies: the first
//! untrusted hop is the client. Everything left of it was written by the
//! client and is ignored. A malformed or empty entry ends the walk at the last
//! address known to be good, so garbage can never choose the rate-limit key.
//! IPv6 clients are keyed by a network rather than one address, because a
//! single host usually controls a whole /64.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use http::HeaderMap;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// Which header carries the forwarding chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardHeader {
    /// `X-Forwarded-For`: comma-separated addresses, client leftmost.
    #[default]
    XForwardedFor,
    /// `Forwarded` (RFC 7239): the `for=` parameter of each element.
    Forwarded,
    /// `X-Real-IP`: a single address set by the nearest proxy.
    XRealIp,
}

impl ForwardHeader {
    /// The lowercase header name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::XForwardedFor => "x-forwarded-for",
            Self::Forwarded => "forwarded",
            Self::XRealIp => "x-real-ip",
        }
    }
}

/// Trusted-proxy settings (already validated).
#[derive(Debug, Clone)]
pub struct ClientIpConfig {
    /// Networks whose addresses may set the forwarding header.
    pub trusted_proxies: Vec<IpNet>,
    /// The header read when the peer is trusted.
    pub header: ForwardHeader,
    /// Prefix length IPv6 clients are keyed by (see [`key_network`]).
    pub ipv6_prefix: u8,
}

impl Default for ClientIpConfig {
    /// No trusted proxies, `X-Forwarded-For`, IPv6 keyed by /64.
    fn default() -> Self {
        Self {
            trusted_proxies: Vec::new(),
            header: ForwardHeader::XForwardedFor,
            ipv6_prefix: 64,
        }
    }
}

impl ClientIpConfig {
    /// Whether `ip` (IPv4-mapped IPv6 counts as IPv4) is a trusted proxy.
    #[must_use]
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }
}

/// Resolves the client address of one request.
///
/// `peer` is the TCP peer address. The result is always canonical: an
/// IPv4-mapped IPv6 address is returned as IPv4.
#[must_use]
pub fn resolve(peer: IpAddr, headers: &HeaderMap, config: &ClientIpConfig) -> IpAddr {
    let peer = peer.to_canonical();
    if !config.is_trusted(peer) {
        return peer;
    }
    match config.header {
        ForwardHeader::XForwardedFor => walk(peer, x_forwarded_for_hops(headers), config),
        ForwardHeader::Forwarded => walk(peer, forwarded_hops(headers), config),
        ForwardHeader::XRealIp => x_real_ip(headers).unwrap_or(peer),
    }
}

/// The network a client is keyed by for limits: an IPv4 address as a /32, an
/// IPv6 address truncated to `ipv6_prefix` (clamped to 0..=128).
#[must_use]
pub fn key_network(ip: IpAddr, ipv6_prefix: u8) -> IpNet {
    match ip.to_canonical() {
        IpAddr::V4(v4) => Ipv4Net::from(v4).into(),
        // The prefix is clamped, so `new` cannot fail; the /128 fallback only
        // exists to avoid a panic path.
        IpAddr::V6(v6) => Ipv6Net::new(v6, ipv6_prefix.min(128))
            .map_or_else(|_| Ipv6Net::from(v6), |net| net.trunc())
            .into(),
    }
}

/// Walks hops ordered nearest first; `None` marks a malformed hop.
fn walk(
    peer: IpAddr,
    hops: impl Iterator<Item = Option<IpAddr>>,
    config: &ClientIpConfig,
) -> IpAddr {
    let mut last_good = peer;
    for hop in hops {
        let Some(ip) = hop else { return last_good };
        let ip = ip.to_canonical();
        if !config.is_trusted(ip) {
            return ip;
        }
        last_good = ip;
    }
    last_good
}

/// `X-Forwarded-For` entries, nearest first, across all header lines.
fn x_forwarded_for_hops(headers: &HeaderMap) -> impl Iterator<Item = Option<IpAddr>> + '_ {
    // A non-ASCII line is read as "", which is an empty and thus malformed
    // entry, so it stops the walk exactly where it sits in the chain.
    headers
        .get_all(ForwardHeader::XForwardedFor.name())
        .iter()
        .rev()
        .flat_map(|line| line.to_str().unwrap_or("").rsplit(','))
        .map(|entry| parse_node(entry.trim(), true))
}

/// `Forwarded` elements' `for=` nodes, nearest first, across all header lines.
fn forwarded_hops(headers: &HeaderMap) -> impl Iterator<Item = Option<IpAddr>> + '_ {
    headers
        .get_all(ForwardHeader::Forwarded.name())
        .iter()
        .rev()
        .flat_map(|line| {
            // With an unclosed quote the rightmost element is the broken one,
            // so a single malformed element is exactly what the walk would
            // have hit first anyway.
            split_outside_quotes(line.to_str().unwrap_or(""), b',')
                .unwrap_or_else(|| vec![""])
                .into_iter()
                .rev()
        })
        .map(forwarded_for)
}

/// The node of one `Forwarded` element's single `for=` parameter.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    let mut node = None;
    for pair in split_outside_quotes(element, b';')? {
        let pair = pair.trim();
        // RFC 7239 allows empty pairs (`for=a;;by=b`).
        if pair.is_empty() {
            continue;
        }
        let (name, value) = pair.split_once('=')?;
        // A repeated `for=` is ambiguous, so the element is rejected.
        if name.trim().eq_ignore_ascii_case("for") && node.replace(value.trim()).is_some() {
            return None;
        }
    }
    parse_node(unquote(node?)?, false)
}

/// The single `X-Real-IP` address, if there is exactly one well-formed line.
fn x_real_ip(headers: &HeaderMap) -> Option<IpAddr> {
    let mut lines = headers.get_all(ForwardHeader::XRealIp.name()).iter();
    let (Some(line), None) = (lines.next(), lines.next()) else {
        return None;
    };
    parse_node(line.to_str().ok()?.trim(), true).map(|ip| ip.to_canonical())
}

/// Splits `s` on `sep` outside double-quoted strings (with `\` escapes).
/// Returns `None` if a quoted string is left open.
fn split_outside_quotes(s: &str, sep: u8) -> Option<Vec<&str>> {
    let (mut parts, mut start) = (Vec::new(), 0);
    let (mut quoted, mut escaped) = (false, false);
    for (i, byte) in s.bytes().enumerate() {
        match byte {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            _ if byte == sep && !quoted => {
                // `sep` is ASCII, so `i` and `i + 1` are char boundaries.
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    (!quoted).then_some(parts)
}

/// Strips the quotes of a `Forwarded` value. Addresses never need escapes,
/// so any stray quote or backslash makes the value malformed.
fn unquote(value: &str) -> Option<&str> {
    let inner = match value.strip_prefix('"') {
        Some(rest) => rest.strip_suffix('"')?,
        None => value,
    };
    (!inner.contains(['"', '\\'])).then_some(inner)
}

/// Parses `IPv4`, `IPv4:port`, `[IPv6]`, `[IPv6]:port`, and, when
/// `bare_ipv6` is set, an unbracketed IPv6 address.
fn parse_node(node: &str, bare_ipv6: bool) -> Option<IpAddr> {
    if let Some(rest) = node.strip_prefix('[') {
        let (host, tail) = rest.split_once(']')?;
        if !tail.is_empty() && !tail.strip_prefix(':').is_some_and(is_port) {
            return None;
        }
        return host.parse::<Ipv6Addr>().ok().map(IpAddr::V6);
    }
    let v4 = match node.split_once(':') {
        Some((host, port)) if is_port(port) => host.parse::<Ipv4Addr>(),
        _ => node.parse::<Ipv4Addr>(),
    };
    match v4 {
        Ok(v4) => Some(IpAddr::V4(v4)),
        Err(_) if bare_ipv6 => node.parse::<Ipv6Addr>().ok().map(IpAddr::V6),
        Err(_) => None,
    }
}

/// A decimal TCP port (digits only: `u16::from_str` would also accept `+`).
fn is_port(port: &str) -> bool {
    !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) && port.parse::<u16>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use ForwardHeader::{Forwarded, XForwardedFor as Xff, XRealIp};

    /// The trusted TCP peer used by most tests (inside 10.0.0.0/8).
    const PEER: &str = "10.0.0.1";
    const CLIENT: &str = "203.0.113.7";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn config(header: ForwardHeader) -> ClientIpConfig {
        let trusted_proxies = vec!["10.0.0.0/8".parse().unwrap()];
        ClientIpConfig {
            trusted_proxies,
            header,
            ..ClientIpConfig::default()
        }
    }

    fn resolve_raw(peer: &str, header: ForwardHeader, lines: &[&[u8]]) -> String {
        let mut map = HeaderMap::new();
        for line in lines {
            map.append(header.name(), HeaderValue::from_bytes(line).unwrap());
        }
        resolve(ip(peer), &map, &config(header)).to_string()
    }

    /// Resolves `lines` (one header line each) as received from `PEER`.
    fn via(header: ForwardHeader, lines: &[&str]) -> String {
        let lines: Vec<&[u8]> = lines.iter().map(|line| line.as_bytes()).collect();
        resolve_raw(PEER, header, &lines)
    }

    /// Checks single-line `(header value, expected client)` cases.
    fn check(header: ForwardHeader, cases: &[(&str, &str)]) {
        for (line, expected) in cases {
            assert_eq!(via(header, &[line]), *expected, "{header:?}: {line:?}");
        }
    }

    #[test]
    fn names_and_defaults() {
        let names = [Xff, Forwarded, XRealIp].map(ForwardHeader::name);
        assert_eq!(names, ["x-forwarded-for", "forwarded", "x-real-ip"]);
        let default = ClientIpConfig::default();
        assert!(default.trusted_proxies.is_empty());
        assert_eq!((default.header, default.ipv6_prefix), (Xff, 64));
        assert!(!default.is_trusted(ip(PEER)));
    }

    #[test]
    fn untrusted_peer_ignores_spoofed_headers() {
        let spoofed = [
            (Xff, "1.2.3.4"),
            (Forwarded, "for=1.2.3.4"),
            (XRealIp, "1.2.3.4"),
        ];
        for (header, line) in spoofed {
            assert_eq!(
                resolve_raw("198.51.100.9", header, &[line.as_bytes()]),
                "198.51.100.9"
            );
        }
    }

    #[test]
    fn xff_walks_right_to_left_skipping_trusted_hops() {
        let cases = [
            ("203.0.113.7", CLIENT),
            ("203.0.113.7, 10.0.0.2,10.0.0.3", CLIENT),
            // Whatever the client wrote to the left of itself is ignored.
            ("1.1.1.1, 203.0.113.7, 10.0.0.2", CLIENT),
            // All hops trusted: the leftmost one is the client.
            ("10.0.0.5, 10.0.0.2", "10.0.0.5"),
            ("203.0.113.7:4711", CLIENT),
            ("[2001:db8::1]:80", "2001:db8::1"),
            ("2001:db8::1", "2001:db8::1"),
        ];
        check(Xff, &cases);
    }

    #[test]
    fn xff_malformed_entry_falls_back_to_last_good() {
        for entry in "unknown|1.2.3|::zz|| |junk|1.2.3.4:99999|1.2.3.4:|[::1".split('|') {
            let tail = format!("203.0.113.7, {entry}");
            let middle = format!("203.0.113.7, {entry}, 10.0.0.2, 10.0.0.3");
            check(Xff, &[(&tail, PEER), (&middle, "10.0.0.2")]);
        }
        check(Xff, &[("", PEER), ("203.0.113.7,", PEER)]);
        assert_eq!(via(Xff, &[]), PEER);
        let non_ascii: [&[u8]; 2] = [b"203.0.113.7", b"\xff1.2.3.4"];
        assert_eq!(resolve_raw(PEER, Xff, &non_ascii), PEER);
    }

    #[test]
    fn xff_lines_are_concatenated_in_order() {
        assert_eq!(via(Xff, &["203.0.113.7, 10.0.0.3", "10.0.0.2"]), CLIENT);
        assert_eq!(via(Xff, &["198.51.100.1", "203.0.113.7"]), CLIENT);
        assert_eq!(via(Xff, &["203.0.113.7", "junk", "10.0.0.2"]), "10.0.0.2");
    }

    #[test]
    fn forwarded_node_forms() {
        let cases = [
            (r#"for="[2001:db8:cafe::17]:4711""#, "2001:db8:cafe::17"),
            (r#"for="[2001:db8::1]";proto=https"#, "2001:db8::1"),
            ("for=203.0.113.7:8080", CLIENT),
            (r#"proto=http; For="203.0.113.7"; by=10.0.0.1"#, CLIENT),
            ("FOR=203.0.113.7, for=10.0.0.2", CLIENT),
            (r#"for=198.51.100.1, for=203.0.113.7;host="a,b;c""#, CLIENT),
        ];
        check(Forwarded, &cases);
    }

    #[test]
    fn forwarded_malformed_falls_back_to_last_good() {
        let bad = r#"for=unknown|for=_hidden|proto=https|for=2001:db8::1|for="2001:db8::1"|for|"#;
        let bad = bad
            .split('|')
            .chain([r#"for="1.2.3.4"x"#, "for=1.2.3.4;for=5.6.7.8"]);
        for element in bad {
            let tail = format!("for=203.0.113.7, {element}");
            let middle = format!("for=203.0.113.7, {element}, for=10.0.0.2");
            check(Forwarded, &[(&tail, PEER), (&middle, "10.0.0.2")]);
        }
        // An unclosed quote swallows the rest of the line, so no hop right of
        // it is usable either.
        let unclosed = [
            r#"for=203.0.113.7, for="[::1]:80"#,
            r#"for="1.2.3.4, for=10.0.0.2"#,
        ];
        check(Forwarded, &unclosed.map(|line| (line, PEER)));
    }

    #[test]
    fn x_real_ip_takes_exactly_one_address() {
        let cases = [
            (" 203.0.113.7 ", CLIENT),
            ("[2001:db8::1]:443", "2001:db8::1"),
            ("203.0.113.7, 1.2.3.4", PEER),
            ("unknown", PEER),
        ];
        check(XRealIp, &cases);
        assert_eq!(via(XRealIp, &["203.0.113.7", "1.2.3.4"]), PEER);
        assert_eq!(via(XRealIp, &[]), PEER);
    }

    #[test]
    fn ipv4_mapped_addresses_are_canonicalised() {
        let mapped_peer = "::ffff:10.0.0.1";
        assert!(config(Xff).is_trusted(ip(mapped_peer)));
        let cases: [(_, &[u8], _); 4] = [
            (Xff, b"::ffff:203.0.113.7", CLIENT),
            // A mapped trusted hop is skipped like its IPv4 form.
            (Xff, b"203.0.113.7, [::ffff:10.0.0.2]:80", CLIENT),
            (Xff, b"junk, [::ffff:10.0.0.2]", "10.0.0.2"),
            (Forwarded, br#"for="[::ffff:203.0.113.7]""#, CLIENT),
        ];
        for (header, line, expected) in cases {
            assert_eq!(resolve_raw(mapped_peer, header, &[line]), expected);
        }
        assert_eq!(
            resolve_raw("::ffff:198.51.100.9", Xff, &[b"1.2.3.4"]),
            "198.51.100.9"
        );
    }

    #[test]
    fn key_network_groups_ipv6_by_prefix() {
        let net = |s: &str, prefix| key_network(ip(s), prefix).to_string();
        assert_eq!(net("203.0.113.7", 64), "203.0.113.7/32");
        assert_eq!(net("::ffff:203.0.113.7", 64), "203.0.113.7/32");
        assert_eq!(net("2001:db8:1:2::1", 64), "2001:db8:1:2::/64");
        assert_eq!(net("2001:db8:1:2::1", 64), net("2001:db8:1:2:ffff::9", 64));
        assert_ne!(net("2001:db8:1:2::1", 64), net("2001:db8:1:3::1", 64));
        assert_eq!(net("2001:db8:1:2::1", 48), "2001:db8:1::/48");
        assert_eq!(net("2001:db8:1:2::1", 48), net("2001:db8:1:ff::1", 48));
        assert_eq!(net("2001:db8::1", 200), "2001:db8::1/128");
        assert_eq!(net("2001:db8::1", 0), "::/0");
    }
}
