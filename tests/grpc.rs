//! A gRPC-shaped call through the real binary: an HTTP/2 client with prior
//! knowledge, a unary call (a length-prefixed message in a POST with
//! `content-type: application/grpc`), an HTTP/2 upstream that answers with
//! `grpc-status` in trailers. The trailers must come through; the key and
//! limits apply to the call as to any request. Then the same with a real
//! gRPC library on both sides: grpcio's client and server
//! (`tests/support/grpc_peer.py`).

mod support;

use std::net::SocketAddr;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use support::{digest, Gateway};

/// A gRPC message frame: not compressed, length, message.
fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(0);
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// An HTTP/2 (h2c) server answering every call with its message reversed
/// and `grpc-status: 0` in trailers, with `x-usage-tokens: 7`.
async fn start_upstream() -> SocketAddr {
    start_upstream_with(|_| async {}).await
}

/// The same server, which awaits `before_trailers(n)` for its `n`th call
/// between the message and the trailers (a stream that reports its usage
/// only at its end).
async fn start_upstream_with<F, Fut>(before_trailers: F) -> SocketAddr
where
    F: Fn(usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let (before_trailers, calls) = (before_trailers.clone(), calls.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((request, mut respond))) = conn.accept().await {
                    let before_trailers = before_trailers.clone();
                    let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::spawn(async move {
                        let mut body = request.into_body();
                        let mut received = BytesMut::new();
                        while let Some(Ok(chunk)) = body.data().await {
                            let _ = body.flow_control().release_capacity(chunk.len());
                            received.extend_from_slice(&chunk);
                        }
                        let mut message = received.freeze();
                        message.advance(5);
                        let reply: Vec<u8> = message.iter().rev().copied().collect();
                        let response = http::Response::builder()
                            .status(200)
                            .header("content-type", "application/grpc")
                            .body(())
                            .unwrap();
                        let mut send = respond.send_response(response, false).unwrap();
                        send.send_data(frame(&reply), false).unwrap();
                        before_trailers(n).await;
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", "0".parse().unwrap());
                        trailers.insert("grpc-message", "done".parse().unwrap());
                        // The usage of the call, known only at its end.
                        trailers.insert("x-usage-tokens", "7".parse().unwrap());
                        // The client may have gone meanwhile.
                        let _ = send.send_trailers(trailers);
                    });
                }
            });
        }
    });
    addr
}

/// One unary call through `gateway`: the status, the reply message and the
/// trailers.
async fn call(gateway: SocketAddr, key: &str) -> (u16, Vec<u8>, Option<http::HeaderMap>) {
    let tcp = tokio::net::TcpStream::connect(gateway).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let request = http::Request::post(format!("http://{gateway}/echo.Echo/Reverse"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {key}"))
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(request, false).unwrap();
    // A refusal (401, 429) may end the stream before its body is sent.
    let _ = send.send_data(frame(b"hello"), true);
    let response = response.await.unwrap();
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut received = BytesMut::new();
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
        received.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await.ok().flatten();
    let message = if received.len() >= 5 {
        received[5..].to_vec()
    } else {
        received.to_vec()
    };
    (status, message, trailers)
}

/// A policy serving h2c whose one route calls `upstream` over HTTP/2,
/// for key `key-g1` with a limit of two calls.
fn policy(upstream: SocketAddr) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1, http2: true }}
auth:
  keys: [{{ id: g1, tenant: acme, sha256: "{}" }}]
limits:
  calls: {{ key: [credential], capacity: 2, refill_per_second: 0.001 }}
upstreams:
  grpc: {{ servers: ["{upstream}"], protocol: h2 }}
routes:
  - {{ name: echo, methods: [POST], path: "/echo.Echo/**", upstream: grpc, limits: [calls] }}
"#,
        digest("key-g1")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unary_grpc_call_passes_with_its_trailers() {
    let upstream = start_upstream().await;
    let policy = policy(upstream);
    let gw = tokio::task::spawn_blocking(move || Gateway::start(&policy, None))
        .await
        .unwrap();
    let (status, message, trailers) = call(gw.addr, "key-g1").await;
    assert_eq!(status, 200, "{}", gw.log());
    assert_eq!(message, b"olleh");
    let trailers = trailers.expect("trailers came through");
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    assert_eq!(trailers.get("grpc-message").unwrap(), "done");

    // The key and the limit apply to calls as to any request.
    assert_eq!(call(gw.addr, "wrong").await.0, 401);
    assert_eq!(call(gw.addr, "key-g1").await.0, 200);
    assert_eq!(call(gw.addr, "key-g1").await.0, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usage_reported_in_trailers_is_settled_after_the_call() {
    let upstream = start_upstream().await;
    // Calls are charged 10 at admission, then the 7 the trailers report.
    let policy = policy(upstream).replace(
        "calls: { key: [credential], capacity: 2, refill_per_second: 0.001 }",
        "calls: { key: [credential], capacity: 25, refill_per_second: 0.001 }",
    ).replace(
        "upstream: grpc, limits: [calls] }",
        "upstream: grpc, limits: [calls], cost: 10, cost_from_response: { header: x-usage-tokens, max: 100 } }",
    );
    let gw = tokio::task::spawn_blocking(move || Gateway::start(&policy, None))
        .await
        .unwrap();
    // 25: three calls fit only if each gives 3 back before the next.
    for n in 1..=3 {
        let (status, _, trailers) = call(gw.addr, "key-g1").await;
        assert_eq!(status, 200, "call {n}");
        let trailers = trailers.expect("trailers came through");
        assert_eq!(trailers.get("grpc-status").unwrap(), "0");
        assert!(
            trailers.get("x-usage-tokens").is_none(),
            "the usage is not exposed"
        );
        let series = "tollgate_cost_reconciled_total{direction=\"refunded\",route=\"echo\"}";
        let gw = &gw;
        let settled = tokio::task::block_in_place(|| {
            support::eventually(std::time::Duration::from_secs(5), || {
                gw.metric(series) == n as f64
            })
        });
        assert!(settled, "call {n} settled");
    }
    assert_eq!(call(gw.addr, "key-g1").await.0, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_resets_before_the_usage_arrives_pays_the_max() {
    // The first call's trailers wait until the client has reset its
    // stream; the others come at once.
    let reset = std::sync::Arc::new(tokio::sync::Notify::new());
    let gone = reset.clone();
    let upstream = start_upstream_with(move |n| {
        let gone = gone.clone();
        async move {
            if n == 0 {
                gone.notified().await;
            }
        }
    })
    .await;
    // Cost 10 at admission, up to 100 reported: 105 fits one abandoned
    // call (settled at 100) and nothing more, or ten honest ones.
    let policy = policy(upstream).replace(
        "calls: { key: [credential], capacity: 2, refill_per_second: 0.001 }",
        "calls: { key: [credential], capacity: 105, refill_per_second: 0.001 }",
    ).replace(
        "upstream: grpc, limits: [calls] }",
        "upstream: grpc, limits: [calls], cost: 10, cost_from_response: { header: x-usage-tokens, max: 100 } }",
    );
    let gw = tokio::task::spawn_blocking(move || Gateway::start(&policy, None))
        .await
        .unwrap();

    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let request = http::Request::post(format!("http://{}/echo.Echo/Reverse", gw.addr))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", "Bearer key-g1")
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(request, false).unwrap();
    send.send_data(frame(b"hello"), true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let first = body.data().await.expect("the message").unwrap();
    assert!(!first.is_empty());
    // Gone before the usage: the stream is reset, the connection stays.
    send.send_reset(h2::Reason::CANCEL);
    drop(body);

    let series = "tollgate_cost_reconciled_total{direction=\"charged\",route=\"echo\"}";
    let gw = &gw;
    let settled = tokio::task::block_in_place(|| {
        support::eventually(std::time::Duration::from_secs(10), || {
            gw.metric(series) == 1.0
        })
    });
    assert!(settled, "the abandoned call was settled at its max");
    reset.notify_one();
    // 100 of 105 spent: the next call (10) does not fit.
    assert_eq!(call(gw.addr, "key-g1").await.0, 429);
    let missing = "tollgate_cost_reconciled_total{direction=\"missing\",route=\"echo\"}";
    assert_eq!(
        gw.metric(missing),
        0.0,
        "an abandoned call is not a missing report"
    );
}

/// Debian's interpreter, which `make test` gives `python3-grpcio`.
const PYTHON: &str = "/usr/bin/python3";
const PEER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/grpc_peer.py");

/// A grpcio server; stopped when its stdin closes (on drop).
struct GrpcServer {
    child: std::process::Child,
    port: u16,
}

impl GrpcServer {
    fn start() -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(PYTHON)
            .args([PEER, "serve"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 with grpcio (make test installs python3-grpcio)");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line.trim().parse().expect("the server's port");
        GrpcServer { child, port }
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn grpcio_call(gateway: SocketAddr, key: &str) -> String {
    let out = std::process::Command::new(PYTHON)
        .args([PEER, "call", &gateway.to_string(), key, "hello"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[test]
fn a_grpcio_client_calls_a_grpcio_server_through_the_gateway() {
    let server = GrpcServer::start();
    let policy = policy(SocketAddr::from(([127, 0, 0, 1], server.port)));
    let gw = Gateway::start(&policy, None);
    assert_eq!(
        grpcio_call(gw.addr, "key-g1"),
        "OK olleh kept",
        "{}",
        gw.log()
    );
    // HTTP 401 and 429 reach the client as gRPC's mapping of them.
    assert!(grpcio_call(gw.addr, "wrong").starts_with("UNAUTHENTICATED"));
    assert_eq!(grpcio_call(gw.addr, "key-g1"), "OK olleh kept");
    assert!(grpcio_call(gw.addr, "key-g1").starts_with("UNAVAILABLE"));
}
