//! HTTP/2 through the real binary, with curl as the client: h2c with prior
//! knowledge on the plain listener and h2 by ALPN on the TLS one. Each
//! stream gets exactly the answers an HTTP/1.1 request gets.

mod support;

use std::path::Path;
use std::process::Command;

use support::{digest, free_port, make_certs, Gateway, Upstream};

fn policy(tls_port: u16, cert: &Path, key: &Path) -> String {
    format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  threads: 1
  http2: true
  tls: {{ listen: ["127.0.0.1:{tls_port}"], cert_file: "{}", key_file: "{}" }}
store: {{ backend: memory }}
auth:
  keys: [{{ id: c1, tenant: acme, sha256: "{}" }}]
limits:
  one: {{ key: [credential], capacity: 2, refill_per_second: 0.001 }}
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: api, path: "/**", upstream: api, limits: [one] }}
responses: {{ ratelimit_headers: draft }}
"#,
        cert.display(),
        key.display(),
        digest("key-c1")
    )
}

/// `curl` with `args`; its output (headers, then the body).
fn curl(args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(["-s", "-D", "-", "--max-time", "10"])
        .args(args)
        .output()
        .expect("curl must be installed (make test installs it)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn status_line(reply: &str) -> &str {
    reply.lines().next().unwrap_or("")
}

fn header<'a>(reply: &'a str, name: &str) -> Option<&'a str> {
    reply.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[test]
fn streams_get_the_same_answers_as_http1_requests() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_certs(dir.path(), "h2");
    let upstream = Upstream::start();
    let tls_port = free_port();
    let gw = Gateway::start(&policy(tls_port, &cert, &key), Some(&upstream));
    let plain = format!("http://{}/v1/x", gw.addr);
    let auth = "authorization: Bearer key-c1";

    let missing = curl(&["--http2-prior-knowledge", &plain]);
    assert!(status_line(&missing).starts_with("HTTP/2 401"), "{missing}");
    assert_eq!(header(&missing, "www-authenticate"), Some("Bearer"));
    assert_eq!(
        header(&missing, "content-type"),
        Some("application/problem+json")
    );

    let first = curl(&["--http2-prior-knowledge", "-H", auth, &plain]);
    assert!(status_line(&first).starts_with("HTTP/2 200"), "{first}");
    assert!(first.contains("\"x-tenant-id\":[\"acme\"]"), "{first}");
    assert!(header(&first, "ratelimit").is_some(), "{first}");

    // Over TLS, h2 by ALPN; the same budget.
    let resolve = format!("localhost:{tls_port}:127.0.0.1");
    let url = format!("https://localhost:{tls_port}/v1/x");
    let ca = ca.to_string_lossy().into_owned();
    let second = curl(&[
        "--http2",
        "--cacert",
        &ca,
        "--resolve",
        &resolve,
        "-H",
        auth,
        &url,
    ]);
    assert!(status_line(&second).starts_with("HTTP/2 200"), "{second}");

    let limited = curl(&["--http2-prior-knowledge", "-H", auth, &plain]);
    assert!(status_line(&limited).starts_with("HTTP/2 429"), "{limited}");
    assert!(header(&limited, "retry-after").is_some(), "{limited}");
    assert!(
        limited.contains("\"violated-policies\":[\"one\"]"),
        "{limited}"
    );

    // A request shorter than the HTTP/2 preface is still read as HTTP/1.
    let short = support::raw(gw.addr, b"GET / HTTP/1.0\r\n\r\n");
    assert!(
        short.starts_with("HTTP/1.0 401") || short.starts_with("HTTP/1.1 401"),
        "{short}"
    );

    // HTTP/1.1 on the same listeners, the same answer.
    let h1 = curl(&["--http1.1", "-H", auth, &plain]);
    assert!(status_line(&h1).starts_with("HTTP/1.1 429"), "{h1}");
    let h1_tls = curl(&[
        "--http1.1",
        "--cacert",
        &ca,
        "--resolve",
        &resolve,
        "-H",
        auth,
        &url,
    ]);
    assert!(status_line(&h1_tls).starts_with("HTTP/1.1 429"), "{h1_tls}");
}

#[test]
fn a_client_that_stops_inside_the_preface_is_cut_at_the_header_timeout() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let (_ca, cert, key) = make_certs(dir.path(), "h2");
    let text = policy(free_port(), &cert, &key).replace(
        "http2: true\n",
        "http2: true\n  timeouts: { header_read_ms: 400 }\n",
    );
    let gw = Gateway::start(&text, None);
    // The preface's first bytes pick HTTP/2; the rest never comes. Without
    // a deadline, the HTTP/2 handshake would wait for it for ever.
    let mut stalled = std::net::TcpStream::connect(gw.addr).unwrap();
    stalled.write_all(b"PRI * HTTP/2.0\r\n").unwrap();
    stalled
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut out = Vec::new();
    assert!(
        stalled.read_to_end(&mut out).is_ok(),
        "closed by the gateway"
    );
    let series = format!(
        "tollgate_connections_rejected_total{{listener=\"{}\",reason=\"header_timeout\"}}",
        gw.addr
    );
    assert!(gw.metric(&series) >= 1.0);
    // The whole preface still makes an HTTP/2 connection.
    let ok = curl(&[
        "--http2-prior-knowledge",
        &format!("http://{}/v1/x", gw.addr),
    ]);
    assert!(status_line(&ok).starts_with("HTTP/2 401"), "{ok}");
}

#[test]
fn a_client_silent_after_choosing_h2_by_alpn_is_cut_at_the_header_timeout() {
    use rustls::pki_types::ServerName;
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = make_certs(dir.path(), "h2");
    let tls_port = free_port();
    let text = policy(tls_port, &cert, &key).replace(
        "http2: true\n",
        "http2: true\n  timeouts: { header_read_ms: 1500 }\n",
    );
    let gw = Gateway::start(&text, None);
    let config = support::tls_client_config(&ca, &[b"h2"]);
    let name = ServerName::try_from("localhost").unwrap();
    let mut conn = rustls::ClientConnection::new(config, name).unwrap();
    // The TLS listener may start a moment after the ones the gateway was
    // found ready on.
    let mut connected = None;
    assert!(support::eventually(
        std::time::Duration::from_secs(10),
        || {
            connected = std::net::TcpStream::connect(("127.0.0.1", tls_port)).ok();
            connected.is_some()
        }
    ));
    let mut tcp = connected.unwrap();
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    // The handshake completes (well within the 1.5 s, even on a loaded
    // machine) and h2 is chosen; then nothing is sent.
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp).unwrap();
    }
    assert_eq!(conn.alpn_protocol(), Some(&b"h2"[..]));
    let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
    let mut out = Vec::new();
    // Closed by the gateway (a clean close, or a reset), not by our timeout.
    let closed = match tls.read_to_end(&mut out) {
        Ok(_) => true,
        Err(e) => {
            e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::TimedOut
        }
    };
    assert!(closed, "the gateway closed the silent connection");
    let series = format!(
        "tollgate_connections_rejected_total{{listener=\"127.0.0.1:{tls_port}\",reason=\"header_timeout\"}}"
    );
    assert!(gw.metric(&series) >= 1.0, "{}", gw.metrics());
    // A client that sends its preface is served as before.
    let ok = curl(&[
        "--http2",
        "--cacert",
        ca.to_str().unwrap(),
        &format!("https://localhost:{tls_port}/v1/x"),
    ]);
    assert!(status_line(&ok).starts_with("HTTP/2 401"), "{ok}");
}

/// A gateway on the policy as `edit` changes it, in front of the echo
/// upstream, and an h2c client connection to it, ready for a stream. The
/// certificates' directory and the upstream are returned to outlive it.
async fn h2_gateway(
    edit: impl FnOnce(String) -> String,
) -> (
    tempfile::TempDir,
    Upstream,
    Gateway,
    h2::client::SendRequest<bytes::Bytes>,
) {
    let dir = tempfile::tempdir().unwrap();
    let (_ca, cert, key) = make_certs(dir.path(), "h2");
    let upstream = Upstream::start();
    let text = edit(policy(free_port(), &cert, &key));
    let gw = tokio::task::block_in_place(|| Gateway::start(&text, Some(&upstream)));
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    (dir, upstream, gw, client.ready().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_client_stops_reading_is_reset_at_the_send_timeout() {
    let (_dir, _upstream, gw, mut client) = h2_gateway(|policy| {
        policy.replace(
            "http2: true\n",
            "http2: true\n  timeouts: { send_ms: 500 }\n",
        )
    })
    .await;
    let request = http::Request::get(format!("http://{}/v1/big", gw.addr))
        .header("authorization", "Bearer key-c1")
        .body(())
        .unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    // Take what the flow-control window allows and never give it back:
    // the gateway cannot write the rest of the 64 MiB.
    let mut body = response.into_body();
    let mut received = 0;
    let ended = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        loop {
            match body.data().await {
                Some(Ok(chunk)) => received += chunk.len(),
                Some(Err(e)) => return Err(e),
                None => return Ok(()),
            }
        }
    })
    .await
    .expect("the gateway gives up on the stream instead of waiting for ever");
    assert!(ended.is_err(), "reset, not completed: {ended:?}");
    assert!(received < 64 << 20, "{received} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_body_stalls_ends_at_the_route_timeout_and_frees_its_permit() {
    // The upstream waits for the whole body; the route waits 500 ms for
    // the upstream's answer.
    let (_dir, _upstream, gw, mut client) = h2_gateway(|policy| {
        policy.replace(
            "upstream: api, limits: [one] }",
            "upstream: api, limits: [one], timeout_ms: 500 }",
        )
    })
    .await;
    let request = http::Request::post(format!("http://{}/v1/upload", gw.addr))
        .header("authorization", "Bearer key-c1")
        .header("content-length", "1000")
        .body(())
        .unwrap();
    // One byte of the thousand announced, then nothing.
    let (response, mut send) = client.send_request(request, false).unwrap();
    send.send_data(bytes::Bytes::from_static(b"x"), false)
        .unwrap();
    let answered = tokio::time::timeout(std::time::Duration::from_secs(20), response)
        .await
        .expect("the stream ends instead of waiting for ever");
    if let Ok(response) = answered {
        assert_eq!(response.status(), 504);
    }
    let pool = "tollgate_pool_in_flight{pool=\"api\"}";
    let gw = &gw;
    let freed = tokio::task::block_in_place(|| {
        support::eventually(std::time::Duration::from_secs(5), || gw.metric(pool) == 0.0)
    });
    assert!(freed, "the stalled stream gave its pool permit back");
    drop(send);
}

/// An HTTP/2 request whose `:authority` and `Host` disagree, or whose
/// authority names a user, is malformed (RFC 9113 §8.3.1): refused with the
/// edge's problem+json 400 (though Pingora answers it before the gateway
/// sees the stream), never forwarded, and the connection's other streams
/// go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_authorities_are_refused_and_never_forwarded() {
    let (_dir, upstream, gw, client) = h2_gateway(|policy| policy).await;
    let conflicting = http::Request::get(format!("http://{}/v1/x", gw.addr))
        .header("host", "elsewhere.test")
        .header("authorization", "Bearer key-c1")
        .body(())
        .unwrap();
    let with_user = http::Request::get(format!("http://user@{}/v1/x", gw.addr))
        .header("authorization", "Bearer key-c1")
        .body(())
        .unwrap();
    for malformed in [conflicting, with_user] {
        let mut ready = client.clone().ready().await.unwrap();
        let (response, _) = ready.send_request(malformed, true).unwrap();
        let response = response.await.unwrap();
        assert_eq!(response.status(), 400);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        let mut body = response.into_body();
        let mut read = Vec::new();
        while let Some(chunk) = body.data().await {
            read.extend_from_slice(&chunk.unwrap());
        }
        let problem: serde_json::Value = serde_json::from_slice(&read).unwrap();
        assert_eq!(problem["type"], "urn:tollgate:problem:bad-request");
        assert_eq!(problem["status"], 400);
    }
    assert_eq!(upstream.hits(), 0, "a malformed request is never forwarded");
    let mut client = client.ready().await.unwrap();
    let fine = http::Request::get(format!("http://{}/v1/x", gw.addr))
        .header("authorization", "Bearer key-c1")
        .body(())
        .unwrap();
    let (response, _) = client.send_request(fine, true).unwrap();
    assert_eq!(response.await.unwrap().status(), 200);
    assert_eq!(upstream.hits(), 1);
}
