//! Slow and half-finished clients through the real binary: trickled bodies
//! over HTTP/1.1 and HTTP/2 lose their pool permits while other clients are
//! served, the HTTP/2 stream bound is announced, pipelined requests and
//! late bodies are answered, client errors write a bounded log, and the
//! admin listener keeps its own connection bound.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::Duration;

use support::{connect, digest, eventually, get, raw, status_of, Gateway, Upstream};

const KEY: &str = "Bearer key-s1";

/// A four-permit pool that answers at once when its queue is full; bodies
/// must average 1 KiB/s after 500 ms, and may pause 3 s between bytes.
fn policy(extra_server: &str) -> String {
    format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  threads: 2
  http2: true
  timeouts: {{ body_read_ms: 3000, body_grace_ms: 500, body_min_rate: 1024 }}
{extra_server}
store: {{ backend: memory }}
auth:
  keys: [ {{ id: s1, tenant: slow, sha256: "{}" }} ]
upstreams:
  api: {{ servers: ["{{upstream}}"], max_in_flight: 4, queue: {{ max_waiting: 0, timeout_ms: 50 }} }}
routes:
  - {{ name: api, path: "/**", upstream: api }}
"#,
        digest("key-s1")
    )
}

fn start(extra_server: &str) -> (Gateway, Upstream) {
    start_with(policy(extra_server))
}

fn start_with(text: String) -> (Gateway, Upstream) {
    let upstream = Upstream::start();
    let gw = Gateway::start(&text, Some(&upstream));
    (gw, upstream)
}

/// As [`start`], with a grace so long that a trickled body is still being
/// sent while the test looks.
fn start_patient(extra_server: &str) -> (Gateway, Upstream) {
    start_with(policy(extra_server).replace("body_grace_ms: 500", "body_grace_ms: 60000"))
}

/// A client that sends a POST head announcing `length` bytes, then one
/// byte every 200 ms (never a gap the body read timeout would catch) until
/// the gateway stops it; what it read back.
fn trickle(to: std::net::SocketAddr, length: usize) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut s = connect(to, None);
        let head = format!(
            "POST /upload HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\ncontent-length: {length}\r\n\r\n"
        );
        if s.write_all(head.as_bytes()).is_err() {
            return String::new();
        }
        // The pace is the behaviour under test, not an ordering: a read
        // that waits up to 200 ms for an answer between bytes makes this a
        // writer slower than `body_min_rate`, yet never idle for
        // `body_read_ms`.
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut got = Vec::new();
        for _ in 0..length.min(150) {
            if s.write_all(b"x").is_err() {
                break;
            }
            let mut buf = [0u8; 4096];
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    })
}

fn pool_in_flight(gw: &Gateway) -> f64 {
    gw.metric("tollgate_pool_in_flight{pool=\"api\"}")
}

fn rejected(gw: &Gateway, reason: &str) -> f64 {
    gw.metric(&format!(
        "tollgate_connections_rejected_total{{listener=\"{}\",reason=\"{reason}\"}}",
        gw.addr
    ))
}

#[test]
fn trickled_large_bodies_lose_their_permits_and_others_are_served() {
    let (gw, _upstream) = start("");
    // Eight clients trickle bodies too large to read whole: four take the
    // permits and would keep them for the whole body (the others find the
    // pool full).
    let tricklers: Vec<_> = (0..8).map(|_| trickle(gw.addr, 100_000)).collect();
    assert!(eventually(Duration::from_secs(10), || pool_in_flight(&gw) >= 1.0));
    // Others are served once the tricklers fall behind the rate.
    assert!(
        eventually(Duration::from_secs(20), || gw
            .get("/x", &[("authorization", KEY)])
            .status
            == 200),
        "a trickled body held its permit: {}",
        gw.metrics()
    );
    let replies: Vec<String> = tricklers.into_iter().map(|t| t.join().unwrap()).collect();
    // Those that held a permit were cut (408); the others found the pool
    // full (503).
    assert!(
        replies
            .iter()
            .all(|r| r.starts_with("HTTP/1.1 408 ") || r.starts_with("HTTP/1.1 503 ")),
        "{replies:?}"
    );
    let cut = replies
        .iter()
        .filter(|r| r.starts_with("HTTP/1.1 408 "))
        .count();
    assert!(cut >= 1, "{replies:?}");
    assert!(
        rejected(&gw, "body_too_slow") >= cut as f64,
        "{}",
        gw.metrics()
    );
    assert!(eventually(Duration::from_secs(5), || pool_in_flight(&gw) == 0.0));
}

#[test]
fn a_small_body_is_read_whole_before_its_request_takes_a_permit() {
    let (gw, _upstream) = start_patient("  limits: { buffer_body_bytes: 4096 }\n");
    // Six clients trickle small bodies, more than the pool's four permits.
    let _tricklers: Vec<_> = (0..6).map(|_| trickle(gw.addr, 1_000)).collect();
    let listener = format!("tollgate_connections{{listener=\"{}\"}}", gw.addr);
    assert!(eventually(Duration::from_secs(10), || gw.metric(&listener) >= 6.0));
    // While they are still sending, they hold no permit: everyone else is
    // served by a pool that refuses at once when it is full.
    for _ in 0..10 {
        assert_eq!(gw.get("/x", &[("authorization", KEY)]).status, 200);
    }
    assert_eq!(pool_in_flight(&gw), 0.0);
}

/// A connection whose POST announced a `length`-byte body with `Expect:
/// 100-continue`, once the gateway has asked for the body.
fn asked_to_continue(to: std::net::SocketAddr, length: usize) -> TcpStream {
    let mut s = connect(to, None);
    s.write_all(
        format!(
            "POST /upload HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\n\
             content-length: {length}\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .unwrap();
    let mut interim = [0u8; 25];
    s.read_exact(&mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    s
}

#[test]
fn a_small_body_with_expect_continue_is_answered_100_then_forwarded() {
    let (gw, upstream) = start("");
    let mut s = asked_to_continue(gw.addr, 5);
    s.write_all(b"hello").unwrap();
    let mut rest = String::new();
    s.read_to_string(&mut rest).unwrap();
    assert_eq!(status_of(&rest), 200, "{rest}");
    assert!(!rest.contains("\"expect\""), "not passed on: {rest}");
    assert_eq!(upstream.hits(), 1);
}

#[test]
fn a_body_that_stalls_after_100_continue_is_answered_408() {
    let (gw, upstream) = start("");
    let mut s = asked_to_continue(gw.addr, 5);
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    // Two bytes of the five, then nothing: the interim answer was no
    // answer, so the stall is still answered, not just closed.
    s.write_all(b"he").unwrap();
    let mut rest = String::new();
    s.read_to_string(&mut rest).unwrap();
    assert_eq!(status_of(&rest), 408, "{rest}");
    assert!(rest.contains("application/problem+json"), "{rest}");
    assert_eq!(upstream.hits(), 0);
}

#[test]
fn bodies_beyond_the_buffered_total_are_shed() {
    let (gw, _upstream) = start_patient("  limits: { buffered_bytes_total: 1500 }\n");
    // A client that announces a 1 000-byte body: once the gateway asks for
    // it (100 Continue), its share of the 1 500 is held.
    let mut holder = asked_to_continue(gw.addr, 1000);
    let post = || raw(gw.addr, posting(600).as_bytes());
    let second = post();
    assert_eq!(status_of(&second), 503, "{second}");
    assert!(
        second.contains("urn:tollgate:problem:overloaded"),
        "{second}"
    );
    assert_eq!(
        gw.metric("tollgate_overload_shed_total{reason=\"body_buffer\"}"),
        1.0
    );
    // The holder's body arrives: it is served, and the budget is free again.
    holder.write_all(&[b'x'; 1000]).unwrap();
    let mut reply = [0u8; 12];
    holder.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b"HTTP/1.1 200");
    let third = post();
    assert_eq!(status_of(&third), 200, "{third}");
}

/// A whole POST of a `len`-byte body, on a connection that closes after.
fn posting(len: usize) -> String {
    format!(
        "POST /upload HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\n\
         content-length: {len}\r\nconnection: close\r\n\r\n{}",
        "y".repeat(len)
    )
}

/// The value of `SETTINGS_MAX_CONCURRENT_STREAMS` in the server's first
/// SETTINGS frame, read off the wire.
fn announced_streams(to: std::net::SocketAddr) -> Option<u32> {
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).unwrap(); // empty SETTINGS
    loop {
        let mut head = [0u8; 9];
        s.read_exact(&mut head).ok()?;
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).ok()?;
        // A SETTINGS frame that is not an acknowledgement.
        if head[3] == 4 && head[4] & 1 == 0 {
            return payload.chunks_exact(6).find_map(|p| {
                (u16::from_be_bytes([p[0], p[1]]) == 3)
                    .then(|| u32::from_be_bytes([p[2], p[3], p[4], p[5]]))
            });
        }
    }
}

#[test]
fn http2_connections_are_told_the_stream_bound() {
    let (gw, _upstream) = start("  http2_max_streams: 7\n");
    assert_eq!(announced_streams(gw.addr), Some(7));
    let (gw, _upstream) = start("");
    assert_eq!(announced_streams(gw.addr), Some(100), "the default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_http2_bodies_are_reset_and_free_their_permits() {
    let (gw, _upstream) = tokio::task::block_in_place(|| start(""));
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    // Twenty streams on one connection, each announcing 100 000 bytes and
    // sending one every 200 ms: four take the permits, the others find the
    // pool full.
    let mut streams = Vec::new();
    for _ in 0..20 {
        let request = http::Request::post(format!("http://{}/upload", gw.addr))
            .header("authorization", KEY)
            .header("content-length", "100000")
            .body(())
            .unwrap();
        client = client.ready().await.unwrap();
        streams.push(client.send_request(request, false).unwrap());
    }
    let feeding = tokio::spawn(async move {
        // Until no stream takes more (each was reset or answered).
        for _ in 0..150 {
            let mut open = 0;
            for (_, send) in streams.iter_mut() {
                if send
                    .send_data(bytes::Bytes::from_static(b"x"), false)
                    .is_ok()
                {
                    open += 1;
                }
            }
            if open == 0 {
                break;
            }
            // The pace is the behaviour under test, not an ordering: one
            // byte every 200 ms is a body slower than `body_min_rate`, never
            // stalled for `body_read_ms`, which the gateway must cut.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut outcomes = Vec::new();
        for (response, _) in streams {
            outcomes.push(
                response
                    .await
                    .map(|r| r.status().as_u16())
                    .map_err(|e| e.to_string()),
            );
        }
        outcomes
    });
    let gw = &gw;
    let served = tokio::task::block_in_place(|| {
        eventually(Duration::from_secs(20), || {
            get(gw.addr, "/x", &[("authorization", KEY)]).status == 200
        })
    });
    assert!(
        served,
        "trickled streams held the permits: {}",
        gw.metrics()
    );
    let outcomes = feeding.await.unwrap();
    let reset = outcomes.iter().filter(|o| o.is_err()).count();
    assert!(
        reset >= 1 && outcomes.iter().all(|o| o.is_err() || *o == Ok(503)),
        "streams holding permits were reset, the others refused: {outcomes:?}"
    );
    let counted = tokio::task::block_in_place(|| rejected(gw, "body_too_slow"));
    assert!(counted >= reset as f64, "{counted} counted, {reset} reset");
    let freed = tokio::task::block_in_place(|| {
        eventually(Duration::from_secs(5), || pool_in_flight(gw) == 0.0)
    });
    assert!(freed);
}

/// Every response in a raw reply, by status, in order.
fn statuses(reply: &str) -> Vec<u16> {
    reply
        .match_indices("HTTP/1.1 ")
        .filter_map(|(i, _)| reply[i + 9..].get(..3)?.parse().ok())
        .filter(|s| *s >= 200)
        .collect()
}

#[test]
fn pipelined_requests_are_answered_in_order_each_checked_as_a_first() {
    let (gw, upstream) = start("  limits: { max_header_bytes: 2048 }\n");
    let two = format!(
        "GET /a HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\n\r\n\
         POST /b HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\ncontent-length: 2\r\n\r\nhi\
         GET /c HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\nconnection: close\r\n\r\n"
    );
    let reply = raw(gw.addr, two.as_bytes());
    assert_eq!(statuses(&reply), [200, 200, 200], "{reply}");
    let paths: Vec<_> = reply
        .match_indices("\"path\":\"/")
        .map(|(i, _)| &reply[i + 8..i + 10])
        .collect();
    assert_eq!(paths, ["/a", "/b", "/c"], "{reply}");
    assert_eq!(upstream.hits(), 3);

    // A second request with a bad head still gets its answer.
    let bad = format!(
        "GET /a HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\n\r\n\
         GET /b HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n"
    );
    assert_eq!(statuses(&raw(gw.addr, bad.as_bytes())), [200, 400]);
    let big = format!(
        "GET /a HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\n\r\n\
         GET /b HTTP/1.1\r\nx-big: {}\r\n\r\n",
        "z".repeat(3000)
    );
    assert_eq!(statuses(&raw(gw.addr, big.as_bytes())), [200, 431]);
}

#[test]
fn a_body_that_comes_late_with_the_next_request_is_answered() {
    let (gw, upstream) = start("");
    let mut s = connect(gw.addr, None);
    s.write_all(
        format!(
            "POST /upload HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\ncontent-length: 5\r\n\r\n"
        )
        .as_bytes(),
    )
    .unwrap();
    // The body comes late: only once the gateway has read the head on its
    // own and gone on with it (authenticated its key, which comes before
    // the body is read), so the body and the next request reach it in a
    // later read than the head.
    let head_read = || gw.metric("tollgate_auth_lookups_total{result=\"hit\",source=\"file\"}");
    assert!(
        eventually(Duration::from_secs(10), || head_read() >= 1.0),
        "the head was never read: {}",
        gw.metrics()
    );
    s.write_all(
        format!("helloGET /next HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\nconnection: close\r\n\r\n")
            .as_bytes(),
    )
    .unwrap();
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    assert_eq!(statuses(&reply), [200, 200], "{reply}");
    assert_eq!(upstream.hits(), 2);
}

#[test]
fn client_errors_write_a_bounded_log_and_a_suppressed_count() {
    let (gw, _upstream) = start("  log_client_errors_per_s: 0\n");
    // Two hundred clients that leave in the middle of their bodies: the
    // proxy library reports each as an error.
    for _ in 0..200 {
        let mut s = connect(gw.addr, None);
        let _ = s.write_all(
            format!(
                "POST /upload HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\n\
                 content-length: 100000\r\n\r\npartial"
            )
            .as_bytes(),
        );
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    let suppressed = || gw.metric("tollgate_log_suppressed_total{kind=\"proxy\"}");
    assert!(
        eventually(Duration::from_secs(10), || suppressed() >= 200.0),
        "{}\n{}",
        gw.metrics(),
        gw.log()
    );
    assert!(
        eventually(Duration::from_secs(5), || gw
            .log()
            .contains("client-caused log lines suppressed")),
        "the count is summarized: {}",
        gw.log()
    );
    let proxy_lines = gw
        .log()
        .lines()
        .filter(|l| l.contains("Fail to proxy"))
        .count();
    assert_eq!(proxy_lines, 0, "{}", gw.log());
}

#[test]
fn the_admin_listener_keeps_its_own_connection_bound() {
    let (gw, _upstream) = start("  admin_max_connections: 3\n");
    // Four clients ask at once and keep their connections: three are
    // answered (and stay open), one is refused without an answer.
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let mut s = connect(gw.admin, None);
            s.write_all(b"GET /readyz HTTP/1.1\r\nhost: t\r\n\r\n")
                .unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s
        })
        .collect();
    let answers: Vec<(TcpStream, usize)> = clients
        .into_iter()
        .map(|mut s| {
            let mut buf = [0u8; 256];
            let n = s.read(&mut buf).unwrap_or(0);
            (s, n)
        })
        .collect();
    let answered = answers.iter().filter(|(_, n)| *n > 0).count();
    assert_eq!(answered, 3, "three of four connections within the bound");
    drop(answers);
    let readyz = || {
        status_of(&raw(
            gw.admin,
            b"GET /readyz HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n",
        ))
    };
    assert!(eventually(Duration::from_secs(5), || readyz() == 200));
    assert!(
        gw.metric(
            "tollgate_connections_rejected_total{listener=\"admin\",reason=\"max_connections\"}"
        ) >= 1.0
    );
}

/// The slow-client policy with `send_ms` beyond any test: only the
/// upstream's end, or the rate, can free what a reader that never reads
/// holds.
fn start_never_timing_out_sends() -> (Gateway, Upstream) {
    start_with(policy("").replace(
        "body_min_rate: 1024 }",
        "body_min_rate: 1024, send_ms: 600000 }",
    ))
}

/// An h2c connection whose client announces a zero window for every
/// stream: it takes response heads, never a byte of a body.
async fn never_reading_h2(gw: &Gateway) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake(tcp)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.ready().await.unwrap()
}

/// A GET of `path` with the test key on `client`'s connection: its
/// response head, the body left unread.
async fn head_of(
    client: &mut h2::client::SendRequest<bytes::Bytes>,
    gw: &Gateway,
    path: &str,
) -> http::Response<h2::RecvStream> {
    let request = http::Request::get(format!("http://{}{path}", gw.addr))
        .header("authorization", KEY)
        .body(())
        .unwrap();
    *client = client.clone().ready().await.unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    response.await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_that_never_read_their_answers_do_not_hold_the_pool() {
    let (gw, upstream) = tokio::task::block_in_place(start_never_timing_out_sends);
    let mut client = never_reading_h2(&gw).await;
    // Six streams, one after the other, on a four-permit pool that refuses
    // at once when full: each answer is read whole from the upstream and
    // its permit freed, though its client takes none of it.
    let mut unread = Vec::new();
    for _ in 0..6 {
        let response = head_of(&mut client, &gw, "/x").await;
        assert_eq!(response.status(), 200);
        unread.push(response);
    }
    assert_eq!(upstream.hits(), 6);
    let gw = &gw;
    let freed = tokio::task::block_in_place(|| {
        eventually(Duration::from_secs(10), || pool_in_flight(gw) == 0.0)
    });
    assert!(freed, "{}", gw.metrics());
    let other = tokio::task::block_in_place(|| get(gw.addr, "/y", &[("authorization", KEY)]));
    assert_eq!(other.status, 200);
    assert_eq!(unread.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_with_a_shut_window_is_cut_at_the_grace_and_frees_its_permit() {
    let (gw, _upstream) = tokio::task::block_in_place(start_never_timing_out_sends);
    let mut client = never_reading_h2(&gw).await;
    // 64 MiB, far beyond the response buffer: the answer streams, and
    // keeps its permit while it does.
    let response = head_of(&mut client, &gw, "/big").await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let ended = tokio::time::timeout(Duration::from_secs(8), body.data())
        .await
        .unwrap_or_else(|_| panic!("not cut: {}", gw.log()));
    assert!(matches!(ended, Some(Err(_))), "reset: {ended:?}");
    let gw = &gw;
    let counted = tokio::task::block_in_place(|| {
        eventually(Duration::from_secs(10), || {
            rejected(gw, "send_too_slow") == 1.0
        })
    });
    assert!(counted, "{}", gw.metrics());
    assert_eq!(
        tokio::task::block_in_place(|| rejected(gw, "send_timeout")),
        0.0
    );
    let freed = tokio::task::block_in_place(|| {
        eventually(Duration::from_secs(10), || pool_in_flight(gw) == 0.0)
    });
    assert!(freed);
}

#[test]
fn an_http1_client_that_never_reads_a_large_answer_is_cut_and_frees_its_permit() {
    let (gw, _upstream) = start_never_timing_out_sends();
    let mut conn = connect(gw.addr, None);
    conn.write_all(b"GET /big HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer key-s1\r\n\r\n")
        .unwrap();
    // Reads nothing: the socket buffers fill, then the gateway waits on
    // the client, which takes nothing over the grace.
    let counted = eventually(Duration::from_secs(30), || {
        rejected(&gw, "send_too_slow") == 1.0
    });
    assert!(counted, "{}", gw.metrics());
    assert_eq!(rejected(&gw, "send_timeout"), 0.0);
    assert!(eventually(Duration::from_secs(10), || pool_in_flight(&gw) == 0.0));
    drop(conn);
}

#[test]
fn one_client_address_cannot_take_every_connection_slot() {
    let (gw, _upstream) = start("  limits: { max_connections_per_ip: 3 }");
    let mine: Vec<TcpStream> = (0..3).map(|_| connect(gw.addr, None)).collect();
    assert!(eventually(Duration::from_secs(5), || {
        gw.metric(&format!("tollgate_connections{{listener=\"{}\"}}", gw.addr)) == 3.0
    }));
    // A fourth from the same address is closed at once, unanswered.
    let mut fourth = connect(gw.addr, None);
    let _ =
        fourth.write_all(b"GET /x HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer key-s1\r\n\r\n");
    let mut got = Vec::new();
    let _ = fourth.read_to_end(&mut got);
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    assert_eq!(rejected(&gw, "max_connections_per_ip"), 1.0);
    // Another address is served.
    let other = raw_from(gw.addr, "127.0.0.2");
    assert_eq!(status_of(&other), 200, "{other}");
    drop(mine);
}

/// One request to `/x` from the loopback address `from`.
fn raw_from(to: std::net::SocketAddr, from: &str) -> String {
    let mut conn = connect(to, Some(from.parse().unwrap()));
    conn.write_all(
        b"GET /x HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer key-s1\r\nconnection: close\r\n\r\n",
    )
    .unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    reply
}
