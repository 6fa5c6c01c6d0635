//! The headers of the upstream request: what the gateway vouches for is
//! set by the gateway alone.
//!
//! A header the gateway owns is dropped in every spelling a server could
//! read as the same name: HTTP names are case-insensitive, and CGI, WSGI
//! and most frameworks fold `_` and `-` together (`X_Tenant_Id` becomes
//! `HTTP_X_TENANT_ID`, as `x-tenant-id` does).

use std::net::IpAddr;

use http::{HeaderName, HeaderValue};
use pingora::http::RequestHeader;

/// Set by the gateway; client copies are always dropped.
const OWNED: [&str; 4] = [
    "x-tenant-id",
    "x-credential-id",
    "x-route-class",
    "x-real-ip",
];
/// Ask frameworks to route on another path or method than the request
/// line's (IIS URL Rewrite, Symfony, Rails, Express's method-override):
/// the gateway classified the request line, so these are always dropped,
/// whoever sent them (a trusted CDN forwards the client's copy unchanged).
const OVERRIDES: [&str; 5] = [
    "x-original-url",
    "x-rewrite-url",
    "x-http-method-override",
    "x-method-override",
    "x-http-method",
];
/// Kept only when the peer is a trusted proxy.
const FROM_PROXIES: [&str; 4] = [
    "forwarded",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-forwarded-port",
];
const X_FORWARDED_FOR: &str = "x-forwarded-for";
const X_REAL_IP: &str = "x-real-ip";
const X_FORWARDED_PROTO: &str = "x-forwarded-proto";

/// Whether `name` (lower-case, as `HeaderName`s are) reads as `target`
/// once `_` and `-` are folded together.
pub fn folds_to(name: &str, target: &str) -> bool {
    name.len() == target.len()
        && name
            .bytes()
            .zip(target.bytes())
            .all(|(a, b)| a == b || (a == b'_' && b == b'-'))
}

/// What the upstream request is rewritten with.
#[derive(Debug)]
pub struct Forwarding<'a> {
    /// The TCP peer, appended to `x-forwarded-for`.
    pub peer: IpAddr,
    /// The resolved client, sent as `x-real-ip`.
    pub client: IpAddr,
    /// Whether the peer is a trusted proxy, whose forwarding headers stand.
    pub peer_trusted: bool,
    /// The scheme the gateway received (`http` or `https`).
    pub scheme: &'static str,
    /// The API key's header, removed unless the policy forwards keys.
    pub strip_key: Option<&'a HeaderName>,
}

/// Rewrites the forwarding headers of an upstream request.
pub fn rewrite(req: &mut RequestHeader, f: &Forwarding<'_>) -> pingora::Result<()> {
    let mut drop: Vec<HeaderName> = Vec::new();
    let mut forwarded_for = String::with_capacity(64);
    for (name, value) in req.headers.iter() {
        let n = name.as_str();
        let owned = OWNED.iter().chain(&OVERRIDES).any(|o| folds_to(n, o))
            || (!f.peer_trusted && FROM_PROXIES.iter().any(|p| folds_to(n, p)))
            || f.strip_key.is_some_and(|k| folds_to(n, k.as_str()));
        if n == X_FORWARDED_FOR {
            // Every line, read as one list, as the client IP was.
            let text = value.to_str().unwrap_or("").trim();
            if !text.is_empty() {
                forwarded_for.push_str(text);
                forwarded_for.push_str(", ");
            }
        } else if (owned || folds_to(n, X_FORWARDED_FOR)) && !drop.contains(name) {
            drop.push(name.clone());
        }
    }
    for name in &drop {
        req.remove_header(name);
    }
    push_ip(&mut forwarded_for, f.peer);
    req.insert_header(X_FORWARDED_FOR, forwarded_for)?;
    let mut client = String::with_capacity(15);
    push_ip(&mut client, f.client);
    req.insert_header(X_REAL_IP, client)?;
    if !f.peer_trusted || !req.headers.contains_key(X_FORWARDED_PROTO) {
        req.insert_header(X_FORWARDED_PROTO, HeaderValue::from_static(f.scheme))?;
    }
    Ok(())
}

/// Lets an upgrade request through when its route lists every protocol
/// its `Upgrade` header names (case-insensitive; `websocket` for
/// `upgrade: true`), and otherwise makes it an ordinary request: an
/// `Upgrade: h2c` on a WebSocket route would open an HTTP/2 tunnel to
/// every path of an upstream that speaks h2c.
pub fn limit_upgrade(req: &mut RequestHeader, allowed: &[Box<str>]) -> pingora::Result<()> {
    let mut listed = true;
    for value in req.headers.get_all(http::header::UPGRADE) {
        // A value that is not text names no protocol the route lists.
        let Ok(text) = value.to_str() else {
            listed = false;
            break;
        };
        listed &= text
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .all(|t| allowed.iter().any(|a| a.eq_ignore_ascii_case(t)));
    }
    if listed {
        Ok(())
    } else {
        refuse_upgrade(req)
    }
}

/// Removes an upgrade request's `Upgrade` header and the `upgrade` token of
/// its `Connection` header, so that it is an ordinary request.
pub fn refuse_upgrade(req: &mut RequestHeader) -> pingora::Result<()> {
    if !req.headers.contains_key(http::header::UPGRADE) {
        return Ok(());
    }
    req.remove_header(&http::header::UPGRADE);
    let tokens: Vec<String> = req
        .headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("").split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty() && !t.eq_ignore_ascii_case("upgrade"))
        .map(str::to_owned)
        .collect();
    req.remove_header(&http::header::CONNECTION);
    if !tokens.is_empty() {
        req.insert_header(http::header::CONNECTION, tokens.join(", "))?;
    }
    Ok(())
}

/// Appends an address in its usual text form; IPv4 without the formatting
/// machinery, which costs more than the rest of the header rewrite.
pub fn push_ip(out: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(a) => {
            for (i, octet) in a.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
        }
        IpAddr::V6(_) => {
            use std::fmt::Write;
            let _ = write!(out, "{ip}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &str)]) -> RequestHeader {
        let mut req = RequestHeader::build("GET", b"/", None).unwrap();
        for (k, v) in headers {
            req.append_header(k.to_string(), *v).unwrap();
        }
        req
    }

    fn values(req: &RequestHeader, name: &str) -> Vec<String> {
        req.headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    }

    fn forwarding(trusted: bool) -> Forwarding<'static> {
        Forwarding {
            peer: "10.0.0.1".parse().unwrap(),
            client: "203.0.113.9".parse().unwrap(),
            peer_trusted: trusted,
            scheme: "http",
            strip_key: None,
        }
    }

    #[test]
    fn folding() {
        assert!(folds_to("x_tenant_id", "x-tenant-id"));
        assert!(folds_to("x-tenant_id", "x-tenant-id"));
        assert!(!folds_to("x-tenant-ids", "x-tenant-id"));
        assert!(!folds_to("x-tenant-ix", "x-tenant-id"));
    }

    #[test]
    fn owned_names_are_dropped_in_every_folding() {
        let mut req = request(&[
            ("X_Tenant_Id", "globex"),
            ("x-tenant-id", "globex"),
            ("X-Credential_ID", "c"),
            ("x_route_class", "r"),
            ("X_Real_IP", "1.2.3.4"),
            ("x_forwarded_for", "6.6.6.6"),
            ("accept", "*/*"),
        ]);
        rewrite(&mut req, &forwarding(true)).unwrap();
        let names: Vec<&str> = req.headers.keys().map(HeaderName::as_str).collect();
        for gone in [
            "x_tenant_id",
            "x-tenant-id",
            "x-credential_id",
            "x_route_class",
            "x_real_ip",
            "x_forwarded_for",
        ] {
            assert!(!names.contains(&gone), "{gone} in {names:?}");
        }
        assert_eq!(values(&req, "accept"), ["*/*"]);
        assert_eq!(values(&req, "x-real-ip"), ["203.0.113.9"]);
    }

    #[test]
    fn every_forwarded_for_line_is_kept_and_the_peer_appended() {
        let mut req = request(&[
            ("x-forwarded-for", "198.51.100.1, 198.51.100.2"),
            ("X-Forwarded-For", "198.51.100.3"),
        ]);
        rewrite(&mut req, &forwarding(true)).unwrap();
        assert_eq!(
            values(&req, "x-forwarded-for"),
            ["198.51.100.1, 198.51.100.2, 198.51.100.3, 10.0.0.1"]
        );
        let mut req = request(&[]);
        rewrite(&mut req, &forwarding(false)).unwrap();
        assert_eq!(values(&req, "x-forwarded-for"), ["10.0.0.1"]);
    }

    #[test]
    fn proxy_headers_stand_only_from_trusted_peers() {
        let sent = [
            ("forwarded", "for=1.2.3.4;proto=https"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "evil.test"),
        ];
        let mut req = request(&sent);
        rewrite(&mut req, &forwarding(false)).unwrap();
        assert!(values(&req, "forwarded").is_empty());
        assert!(values(&req, "x-forwarded-host").is_empty());
        assert_eq!(values(&req, "x-forwarded-proto"), ["http"]);

        let mut req = request(&sent);
        rewrite(&mut req, &forwarding(true)).unwrap();
        assert_eq!(values(&req, "forwarded"), ["for=1.2.3.4;proto=https"]);
        assert_eq!(values(&req, "x-forwarded-host"), ["evil.test"]);
        assert_eq!(values(&req, "x-forwarded-proto"), ["https"]);
    }

    #[test]
    fn the_key_is_stripped_when_asked() {
        let key = HeaderName::from_static("x-api-key");
        let mut req = request(&[("x-api-key", "secret"), ("x_api_key", "secret")]);
        let f = Forwarding {
            strip_key: Some(&key),
            ..forwarding(false)
        };
        rewrite(&mut req, &f).unwrap();
        assert!(values(&req, "x-api-key").is_empty());
        assert!(values(&req, "x_api_key").is_empty());
    }

    #[test]
    fn overrides_of_path_and_method_never_pass() {
        let sent = [
            ("x-original-url", "/admin"),
            ("X_Rewrite_URL", "/admin"),
            ("x-http-method-override", "DELETE"),
            ("x-method-override", "DELETE"),
            ("X-HTTP-Method", "DELETE"),
            ("x-forwarded-port", "8443"),
        ];
        for trusted in [false, true] {
            let mut req = request(&sent);
            rewrite(&mut req, &forwarding(trusted)).unwrap();
            let names: Vec<&str> = req.headers.keys().map(HeaderName::as_str).collect();
            for gone in [
                "x-original-url",
                "x_rewrite_url",
                "x-http-method-override",
                "x-method-override",
                "x-http-method",
            ] {
                assert!(!names.contains(&gone), "{gone} in {names:?}");
            }
            let port = values(&req, "x-forwarded-port");
            assert_eq!(
                port.is_empty(),
                !trusted,
                "x-forwarded-port from trusted={trusted}"
            );
        }
    }

    #[test]
    fn an_upgrade_passes_only_when_every_protocol_is_listed() {
        let websocket: Vec<Box<str>> = vec!["websocket".into()];
        let upgrade = |value: &str, allowed: &[Box<str>]| {
            let mut req = request(&[("upgrade", value), ("connection", "upgrade")]);
            limit_upgrade(&mut req, allowed).unwrap();
            values(&req, "upgrade")
        };
        assert_eq!(upgrade("WebSocket", &websocket), ["WebSocket"]);
        assert!(
            upgrade("h2c", &websocket).is_empty(),
            "h2c on a WebSocket route"
        );
        assert!(upgrade("websocket, h2c", &websocket).is_empty());
        assert!(
            upgrade("websocket", &[]).is_empty(),
            "a route without upgrades"
        );
        let both: Vec<Box<str>> = vec!["websocket".into(), "h2c".into()];
        assert_eq!(upgrade("h2c", &both), ["h2c"]);
        let mut plain = request(&[("connection", "keep-alive")]);
        limit_upgrade(&mut plain, &websocket).unwrap();
        assert_eq!(
            values(&plain, "connection"),
            ["keep-alive"],
            "no upgrade: untouched"
        );
    }

    #[test]
    fn upgrades_are_refused_by_removing_them() {
        let mut req = request(&[
            ("upgrade", "websocket"),
            ("connection", "keep-alive, Upgrade"),
        ]);
        refuse_upgrade(&mut req).unwrap();
        assert!(values(&req, "upgrade").is_empty());
        assert_eq!(values(&req, "connection"), ["keep-alive"]);
        let mut req = request(&[("upgrade", "h2c"), ("connection", "upgrade")]);
        refuse_upgrade(&mut req).unwrap();
        assert!(values(&req, "connection").is_empty());
    }

    #[test]
    fn addresses_print_as_usual() {
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "10.20.255.9",
            "203.0.113.100",
            "::1",
            "2001:db8::7",
        ] {
            let mut out = String::new();
            push_ip(&mut out, ip.parse().unwrap());
            assert_eq!(out, ip);
        }
    }
}
