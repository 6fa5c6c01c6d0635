//! TLS termination through the real binary: a client that trusts the CA
//! gets through, one that does not fails, and a reload swaps the
//! certificate (or keeps the old one when the new one is broken).

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls::pki_types::ServerName;
use support::{eventually, free_port, make_certs, tls_client_config, Gateway, Upstream};

/// One HTTPS request; the reply and the certificate the server showed.
fn https_get(port: u16, ca: &Path, path: &str) -> Result<(String, Vec<u8>), String> {
    let config = tls_client_config(ca, &[]);
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())?;
    let tcp = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let req = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n");
    tls.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out);
    if out.is_empty() {
        return Err("no reply".into());
    }
    let served = tls.conn.peer_certificates().unwrap()[0].to_vec();
    Ok((String::from_utf8_lossy(&out).into_owned(), served))
}

fn policy(port: u16, cert: &Path, key: &Path) -> String {
    format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  threads: 1
  tls: {{ listen: ["127.0.0.1:{port}"], cert_file: "{}", key_file: "{}" }}
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: api, path: "/**", auth: none, upstream: api }}
"#,
        cert.display(),
        key.display()
    )
}

/// Two certificate pairs, each with its CA, and a TLS gateway on `port`
/// serving the first from `live.pem`/`live.key`, whose contents a test
/// then changes.
struct Rotation {
    dir: tempfile::TempDir,
    ca: std::path::PathBuf,
    other: (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf),
    live: (std::path::PathBuf, std::path::PathBuf),
    port: u16,
    gw: Gateway,
    _upstream: Upstream,
}

fn rotation() -> Rotation {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_certs(dir.path(), "first");
    let other = make_certs(dir.path(), "second");
    let live = (dir.path().join("live.pem"), dir.path().join("live.key"));
    std::fs::copy(&cert, &live.0).unwrap();
    std::fs::copy(&key, &live.1).unwrap();
    let upstream = Upstream::start();
    let port = free_port();
    let gw = Gateway::start(&policy(port, &live.0, &live.1), Some(&upstream));
    Rotation {
        dir,
        ca,
        other,
        live,
        port,
        gw,
        _upstream: upstream,
    }
}

#[test]
fn clients_get_through_over_tls_and_a_reload_swaps_the_certificate() {
    let r = rotation();
    let (ca, port, gw) = (r.ca.clone(), r.port, &r.gw);
    let (other_ca, other_cert, other_key) = r.other.clone();
    let (live_cert, live_key) = r.live.clone();

    let (reply, first_served) = https_get(port, &ca, "/x").unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let echo = reply.split_once("\r\n\r\n").unwrap().1;
    let seen: serde_json::Value = serde_json::from_str(echo).unwrap();
    assert_eq!(seen["headers"]["x-forwarded-proto"][0], "https");
    assert!(
        https_get(port, &other_ca, "/x").is_err(),
        "a client that trusts another CA fails"
    );

    // A broken certificate is a rejected reload: the old one keeps serving.
    std::fs::write(&live_cert, "not a certificate").unwrap();
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(5), || {
        gw.metric("tollgate_config_reloads_total{result=\"error\"}") >= 1.0
    }));
    assert_eq!(https_get(port, &ca, "/x").unwrap().1, first_served);

    // A good one is swapped in: new handshakes see it.
    std::fs::copy(&other_cert, &live_cert).unwrap();
    std::fs::copy(&other_key, &live_key).unwrap();
    gw.signal("-HUP");
    assert!(eventually(Duration::from_secs(5), || {
        https_get(port, &other_ca, "/x").is_ok_and(|(_, served)| served != first_served)
    }));
    assert!(
        https_get(port, &ca, "/x").is_err(),
        "the old certificate is gone"
    );
}

/// A gateway answering on TLS only, as an HTTPS upstream.
fn https_upstream(dir: &Path, name: &str) -> (Gateway, u16, std::path::PathBuf) {
    let (ca, cert, key) = make_certs(dir, name);
    let port = free_port();
    let policy = format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  threads: 1
  http2: true
  tls: {{ listen: ["127.0.0.1:{port}"], cert_file: "{}", key_file: "{}" }}
routes:
  - {{ name: hello, path: "/**", auth: none, respond: {{ status: 200, body: "over https\n" }} }}
"#,
        cert.display(),
        key.display()
    );
    (Gateway::start(&policy, None), port, ca)
}

fn through(port: u16, tls: &str, extra: &str) -> Gateway {
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
upstreams:
  secure: {{ servers: ["127.0.0.1:{port}"], tls: {tls} {extra} }}
routes:
  - {{ name: api, path: "/**", auth: none, upstream: secure }}
"#
    );
    Gateway::start(&policy, None)
}

#[test]
fn upstreams_are_reached_over_verified_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (_upstream, port, ca) = https_upstream(dir.path(), "up");
    let (_, _, _) = make_certs(dir.path(), "stranger");
    let stranger = dir.path().join("stranger-ca.pem");
    let ca = ca.display().to_string();

    for protocol in ["http1", "h2", "auto"] {
        let gw = through(
            port,
            &format!("{{ ca_file: \"{ca}\" }}"),
            &format!(", protocol: {protocol}"),
        );
        let r = gw.get("/x", &[]);
        assert_eq!(
            (r.status, r.body.as_str()),
            (200, "over https\n"),
            "{protocol}: {}",
            gw.log()
        );
    }
    // Verification is on by default: another CA, or another name, fails.
    let wrong_ca = through(
        port,
        &format!("{{ ca_file: \"{}\" }}", stranger.display()),
        "",
    );
    assert_eq!(wrong_ca.get("/x", &[]).status, 502);
    let wrong_name = through(
        port,
        &format!("{{ ca_file: \"{ca}\", sni: elsewhere.test }}"),
        "",
    );
    assert_eq!(wrong_name.get("/x", &[]).status, 502);
    // Unless it is turned off.
    let unverified = through(port, "{ verify: false }", "");
    assert_eq!(unverified.get("/x", &[]).status, 200);
}

/// A gateway with a plain and a TLS listener (on `port`) and room for two
/// connections, whose heads (and TLS handshakes) may take
/// `header_read_ms`; the CA that signed its certificate.
fn two_connections(dir: &Path, header_read_ms: u64) -> (Gateway, Upstream, u16, PathBuf) {
    let (ca, cert, key) = make_certs(dir, "first");
    let upstream = Upstream::start();
    let port = free_port();
    let text = policy(port, &cert, &key).replace(
        "threads: 1\n",
        &format!(
            "threads: 1\n  limits: {{ max_connections: 2 }}\n  timeouts: {{ header_read_ms: {header_read_ms} }}\n"
        ),
    );
    let gw = Gateway::start(&text, Some(&upstream));
    (gw, upstream, port, ca)
}

#[test]
fn clients_silent_before_the_handshake_hold_a_slot_until_the_header_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (gw, _upstream, port, ca) = two_connections(dir.path(), 400);
    let listener = format!("listener=\"127.0.0.1:{port}\"");

    // Two connections that never send a ClientHello take both slots...
    let silent: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    assert!(eventually(Duration::from_secs(5), || {
        gw.metric(&format!("tollgate_connections{{{listener}}}")) == 2.0
    }));
    // ...so a third is refused before its handshake.
    assert!(https_get(port, &ca, "/x").is_err());
    let rejected = |reason: &str| {
        gw.metric(&format!(
            "tollgate_connections_rejected_total{{{listener},reason=\"{reason}\"}}"
        ))
    };
    assert!(rejected("max_connections") >= 1.0);

    // The handshake is bounded by header_read_ms: both are closed (long
    // before the client's own 10 s read timeout) and counted.
    for mut s in silent {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut out = Vec::new();
        assert!(s.read_to_end(&mut out).is_ok(), "closed by the gateway");
    }
    assert!(eventually(Duration::from_secs(5), || rejected(
        "header_timeout"
    ) >= 2.0));
    assert!(https_get(port, &ca, "/x").is_ok_and(|(reply, _)| reply.starts_with("HTTP/1.1 200")));
}

#[test]
fn max_connections_bounds_the_plain_and_tls_listeners_together() {
    let dir = tempfile::tempdir().unwrap();
    let (gw, _upstream, port, ca) = two_connections(dir.path(), 60_000);
    // (Once the connections that found the gateway ready have gone: one
    // still open would take a slot from the two below.)
    let open = || gw.metric(&format!("tollgate_connections{{listener=\"{}\"}}", gw.addr));
    assert!(eventually(Duration::from_secs(30), || open() == 0.0));
    // Two plain connections that send nothing take the instance's two
    // slots...
    let _held: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(gw.addr).unwrap())
        .collect();
    assert!(eventually(Duration::from_secs(30), || open() == 2.0));
    // ...so the TLS listener refuses a third, and counts it.
    assert!(https_get(port, &ca, "/x").is_err());
    assert!(
        gw.metric(&format!(
            "tollgate_connections_rejected_total{{listener=\"127.0.0.1:{port}\",reason=\"max_connections\"}}"
        )) >= 1.0
    );
}

#[test]
fn a_rotated_certificate_is_served_without_a_signal() {
    let r = rotation();
    let (_, first_served) = https_get(r.port, &r.ca, "/x").unwrap();
    // Rotated as a certificate manager does: each file replaced whole.
    for (from, to) in [(&r.other.2, &r.live.1), (&r.other.1, &r.live.0)] {
        let staged = r.dir.path().join("staged");
        std::fs::copy(from, &staged).unwrap();
        std::fs::rename(&staged, to).unwrap();
    }
    // Watched: new handshakes see it, with no SIGHUP and no admin call.
    assert!(eventually(Duration::from_secs(10), || {
        https_get(r.port, &r.other.0, "/x").is_ok_and(|(_, served)| served != first_served)
    }));
    assert!(
        https_get(r.port, &r.ca, "/x").is_err(),
        "the old certificate is gone"
    );
}
