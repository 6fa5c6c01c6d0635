//! `client_ip` and `ip_rules`: networks, and how the client address is read.

use super::*;

pub(super) fn nets(c: &mut Checker, path: &str, raw: &[String]) -> Vec<IpNet> {
    raw.iter()
        .enumerate()
        .filter_map(|(i, text)| {
            let parsed = text
                .parse::<IpNet>()
                .ok()
                .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from));
            if parsed.is_none() {
                c.fail(
                    format!("{path}[{i}]"),
                    format!("{text:?} is not an IP network"),
                );
            }
            parsed.map(|n| canonical_net(n.trunc()))
        })
        .collect()
}

/// An IPv4-mapped IPv6 network (`::ffff:10.0.0.0/104`) is its IPv4
/// network: addresses are compared in their canonical form, so the mapped
/// one could never match.
pub(super) fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(net, IpNet::V4),
            None => net,
        },
        _ => net,
    }
}

pub(super) fn client_ip(c: &mut Checker, raw: RawClientIp) -> ClientIpConfig {
    ClientIpConfig {
        trusted_proxies: nets(c, "client_ip.trusted_proxies", &raw.trusted_proxies),
        header: match raw.header {
            HeaderName::XForwardedFor => ForwardHeader::XForwardedFor,
            HeaderName::Forwarded => ForwardHeader::Forwarded,
            HeaderName::XRealIp => ForwardHeader::XRealIp,
        },
        ipv6_prefix: c.bounded(
            "client_ip.ipv6_prefix",
            raw.ipv6_prefix,
            bounds::IPV6_PREFIX,
        ),
    }
}
