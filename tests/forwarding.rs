//! Forwarding through the real binary: retries on connect failures, a
//! dropped SYN that is only latency, upstreams that close idle
//! connections, route deadlines and host routing.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Mutex};
use std::thread;
use std::time::Duration;

use support::{eventually, free_port, Gateway, Upstream};

fn policy(servers: &str, extra_upstream: &str, routes: &str) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {{ backend: memory }}
upstreams:
  api: {{ servers: [{servers}], max_in_flight: 64 {extra_upstream} }}
routes:
{routes}
"#
    )
}

const OPEN: &str = "  - { name: open, path: \"/**\", auth: none, upstream: api }";

/// An upstream written by hand: on each connection (a thread each), the
/// request head is read, then `answer` gets the connection and the reader
/// holding whatever came after the head.
fn raw_upstream<F>(answer: F) -> SocketAddr
where
    F: Fn(TcpStream, BufReader<TcpStream>) + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let answer = std::sync::Arc::new(answer);
    thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let answer = answer.clone();
            thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                    line.clear();
                }
                answer(conn, reader);
            });
        }
    });
    addr
}

/// An address nothing listens on: connecting is refused at once.
fn refused() -> String {
    format!("\"127.0.0.1:{}\"", free_port())
}

#[test]
fn a_refused_connect_is_retried_on_another_server() {
    let upstream = Upstream::start();
    let servers = format!("{}, \"{}\"", refused(), upstream.addr);
    let gw = Gateway::start(&policy(&servers, "", OPEN), None);
    let statuses: Vec<u16> = (0..8).map(|_| gw.get("/x", &[]).status).collect();
    assert!(
        statuses.iter().all(|&s| s == 200),
        "{statuses:?}\n{}",
        gw.log()
    );
    let retried = gw.metric("tollgate_upstream_retries_total{pool=\"api\",reason=\"connect\"}");
    assert!(retried >= 1.0, "{}", gw.metrics());

    // Without retries, the dead server's turns are 502s.
    let gw = Gateway::start(&policy(&servers, ", retries: 0", OPEN), None);
    let statuses: Vec<u16> = (0..8).map(|_| gw.get("/x", &[]).status).collect();
    assert!(statuses.contains(&502), "{statuses:?}");
}

/// Answers one request on `conn` with 200 and `connection: close`.
fn answer_and_close(conn: TcpStream) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
        line.clear();
    }
    let mut conn = conn;
    let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok");
}

/// SYNs the kernel dropped because a listener's accept queue was full
/// (`TcpExt: ListenOverflows` of /proc/net/netstat), over the machine.
fn listen_overflows() -> u64 {
    let text = std::fs::read_to_string("/proc/net/netstat").unwrap_or_default();
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (Some(names), Some(values)) = (lines.next(), lines.next()) else {
        return 0;
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "ListenOverflows")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_dropped_syn_is_latency_not_a_502() {
    // A listener whose accept queue holds nothing more: one connection,
    // not yet accepted, fills it, and the kernel drops the next SYN; the
    // client retransmits it (after 1 s, then 2 s more, ...).
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_reuse_address(true).unwrap();
    socket
        .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    socket.listen(0).unwrap();
    let listener: TcpListener = socket.into();
    let addr = listener.local_addr().unwrap();
    let filler = TcpStream::connect(addr).unwrap();
    // A connect bound that covers several retransmissions, whatever the
    // machine's pace.
    let gw = Gateway::start(
        &policy(&format!("\"{addr}\""), ", connect_timeout_ms: 20000", OPEN),
        None,
    );
    let dropped_before = listen_overflows();
    // Accept only once the kernel has dropped one of the gateway's SYNs.
    let server = thread::spawn(move || {
        assert!(
            eventually(Duration::from_secs(10), || listen_overflows()
                > dropped_before),
            "no SYN was dropped"
        );
        let mut served = 0;
        for conn in listener.incoming().flatten() {
            served += 1;
            if served > 1 {
                answer_and_close(conn);
                return;
            }
        }
    });
    let r = gw.get("/x", &[]);
    assert_eq!(r.status, 200, "{}\n{}", r.body, gw.log());
    server.join().unwrap();
    drop(filler);
}

#[test]
fn an_upstream_that_closes_idle_connections_causes_no_502() {
    // Every connection answers one request, then the server closes it
    // without saying so: the gateway's next request on it finds it closed.
    // The server closes only when told to, once the gateway is done with
    // the request (and so keeps the connection idle); the test sends the
    // next request only once the server says it has closed.
    let (close, told_to_close) = mpsc::channel::<()>();
    let (closed, has_closed) = mpsc::channel::<()>();
    let (told_to_close, closed) = (Mutex::new(told_to_close), Mutex::new(closed));
    let addr = raw_upstream(move |mut conn, _| {
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        if told_to_close.lock().unwrap().recv().is_err() {
            return;
        }
        let _ = conn.shutdown(std::net::Shutdown::Both);
        let _ = closed.lock().unwrap().send(());
    });
    let gw = Gateway::start(&policy(&format!("\"{addr}\""), "", OPEN), None);
    let finished = || gw.metric("tollgate_requests_total{outcome=\"allowed\",route=\"open\"}");
    for i in 0..12 {
        let r = gw.get("/x", &[]);
        assert_eq!(r.status, 200, "request {i}: {}\n{}", r.body, gw.log());
        // Counted once the gateway has finished the request, after it put
        // the upstream connection back among its idle ones.
        assert!(
            eventually(Duration::from_secs(10), || finished() >= (i + 1) as f64),
            "request {i} never finished: {}",
            gw.metrics()
        );
        close.send(()).unwrap();
        has_closed
            .recv_timeout(Duration::from_secs(10))
            .expect("the upstream closed the connection it answered on");
    }
}

#[test]
fn a_route_deadline_answers_504() {
    let upstream = Upstream::slow(Duration::from_millis(1_500));
    let routes = [
        "  - { name: quick, path: \"/slow/**\", auth: none, upstream: api, timeout_ms: 200 }",
        "  - { name: patient, path: \"/**\", auth: none, upstream: api }",
    ]
    .join("\n");
    let gw = Gateway::start(
        &policy(&format!("\"{}\"", upstream.addr), "", &routes),
        None,
    );
    let r = gw.get("/slow/x", &[]);
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(gw.get("/fast", &[]).status, 200);
}

#[test]
fn routes_are_chosen_by_host() {
    let upstream = Upstream::start();
    let routes = [
        "  - { name: api-host, hosts: [API.example.com], path: \"/**\", auth: none, upstream: api }",
        "  - { name: tenants, hosts: [\"*.tenants.example.com\"], path: \"/**\", auth: none, upstream: api }",
        "  - { name: any, path: \"/**\", auth: none, upstream: api }",
    ]
    .join("\n");
    let gw = Gateway::start(
        &policy(&format!("\"{}\"", upstream.addr), "", &routes),
        None,
    );
    let class = |host: &str| {
        let mut s = TcpStream::connect(gw.addr).unwrap();
        let req = format!("GET /x HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        let reply = support::parse(&out);
        reply.upstream_saw("x-route-class")
    };
    assert_eq!(class("api.example.com:8080"), ["api-host"]);
    assert_eq!(class("acme.tenants.example.com"), ["tenants"]);
    assert_eq!(class("tenants.example.com"), ["any"]);
    assert_eq!(class("elsewhere.test"), ["any"]);
}

#[test]
fn the_upstream_host_header_is_as_configured() {
    let upstream = Upstream::start();
    let host = |extra: &str| {
        let gw = Gateway::start(
            &policy(&format!("\"{}\"", upstream.addr), extra, OPEN),
            None,
        );
        let mut s = TcpStream::connect(gw.addr).unwrap();
        s.write_all(b"GET /x HTTP/1.1\r\nhost: client.example\r\nconnection: close\r\n\r\n")
            .unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        support::parse(&out).upstream_saw("host")
    };
    assert_eq!(host(""), ["client.example"]);
    assert_eq!(host(", host_header: upstream"), [upstream.addr.to_string()]);
    assert_eq!(
        host(", host_header: billing.internal"),
        ["billing.internal"]
    );
}

/// An upstream that accepts a WebSocket upgrade and then echoes bytes.
fn websocket_upstream() -> SocketAddr {
    raw_upstream(|mut conn, mut reader| {
        let _ = conn.write_all(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
        );
        let mut buf = [0u8; 64];
        loop {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if conn.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    })
}

#[test]
fn an_upgraded_connection_holds_its_pool_permit_until_it_closes() {
    let upstream = websocket_upstream();
    let routes = "  - { name: ws, path: /ws, auth: none, upstream: api, upgrade: true }";
    let gw = Gateway::start(&policy(&format!("\"{upstream}\""), "", routes), None);
    let mut client = TcpStream::connect(gw.addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    client
        .write_all(
            b"GET /ws HTTP/1.1\r\nhost: t\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
              sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        )
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        client.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    // The tunnel carries bytes both ways…
    client.write_all(b"hello through").unwrap();
    let mut echo = [0u8; 13];
    client.read_exact(&mut echo).unwrap();
    assert_eq!(&echo, b"hello through");
    // …and holds the pool's permit while it is open.
    let in_flight = || gw.metric("tollgate_pool_in_flight{pool=\"api\"}");
    assert_eq!(in_flight(), 1.0);
    drop(client);
    assert!(support::eventually(Duration::from_secs(5), || in_flight() == 0.0));
}

#[test]
fn an_error_after_the_response_started_is_not_written_into_it() {
    // Headers and the first chunk, then nothing until the gateway gives up
    // at the route's deadline and hangs up: the silence ends with the
    // gateway's error, not after a guessed time.
    let (hung_up, gave_up) = mpsc::channel::<()>();
    let hung_up = Mutex::new(hung_up);
    let addr = raw_upstream(move |mut conn, mut reader| {
        let _ =
            conn.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n");
        let _ = reader.read_to_end(&mut Vec::new());
        let _ = hung_up.lock().unwrap().send(());
    });
    let routes = "  - { name: api, path: \"/**\", auth: none, upstream: api, timeout_ms: 300 }";
    let gw = Gateway::start(&policy(&format!("\"{addr}\""), "", routes), None);
    let mut s = TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n").unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("hello"), "{text}");
    assert!(
        !text.contains("problem"),
        "no error body inside the 200: {text}"
    );
    assert!(
        gave_up.recv_timeout(Duration::from_secs(10)).is_ok(),
        "the route's deadline ended the upstream call"
    );
}

#[test]
fn an_upgraded_connection_is_not_held_to_the_body_bound() {
    let upstream = websocket_upstream();
    let routes =
        "  - { name: ws, path: /ws, auth: none, upstream: api, upgrade: true, max_body_bytes: 16 }";
    let gw = Gateway::start(&policy(&format!("\"{upstream}\""), "", routes), None);
    let mut client = TcpStream::connect(gw.addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    client
        .write_all(
            b"GET /ws HTTP/1.1\r\nhost: t\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\r\n",
        )
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        client.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 101"));
    let message = [b'm'; 64];
    for _ in 0..4 {
        client.write_all(&message).unwrap();
        let mut echo = [0u8; 64];
        client.read_exact(&mut echo).unwrap();
        assert_eq!(echo, message);
    }
}
