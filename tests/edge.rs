//! The edge through the real binary, tried as an attacker would: raw
//! sockets, percent signs, look-alike headers, stalled clients.

mod support;

use std::io::{Read, Write};
use std::time::Duration;

use support::{connect, digest, eventually, raw, status_of, Gateway, Upstream};

const POLICY: &str = r#"
version: 1
server:
  listen: ["{listen}"]
  admin_listen: "{admin}"
  threads: 1
  limits: { max_connections: 40, max_header_bytes: 2048, max_body_bytes: 64 }
  timeouts: { header_read_ms: 400, keepalive_idle_ms: 600, body_read_ms: 400, send_ms: 400 }
store: { backend: memory }
client_ip: { trusted_proxies: ["127.0.0.2/32"] }
auth:
  keys:
    - { id: a1, tenant: acme, sha256: "DIGEST" }
limits:
  reports-limit: { key: [credential], capacity: 1, refill_per_second: 0.001 }
upstreams:
  api: { servers: ["{upstream}"], max_in_flight: 2 }
routes:
  - { name: reports, methods: [POST], path: "/v1/reports/{id}", upstream: api, limits: [reports-limit] }
  - { name: public, path: "/public/**", auth: none, upstream: api }
  - { name: ws, path: /ws, auth: none, upstream: api, upgrade: true }
  - { name: small, path: /small, auth: none, upstream: api, max_body_bytes: 4 }
  - { name: root, methods: [GET], path: /, auth: none, upstream: api }
  - { name: api, path: "/v1/**", upstream: api }
"#;

const KEY: &str = "Bearer key-a1";

fn start() -> (Gateway, Upstream) {
    let upstream = Upstream::start();
    let policy = POLICY.replace("DIGEST", &digest("key-a1"));
    (Gateway::start(&policy, Some(&upstream)), upstream)
}

/// One request written as given, on its own connection.
fn send(gw: &Gateway, head: &str) -> String {
    raw(
        gw.addr,
        format!("{head}\r\nconnection: close\r\n\r\n").as_bytes(),
    )
}

/// The upstream's JSON echo inside a raw reply.
fn echo(reply: &str) -> serde_json::Value {
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {reply}"))
}

fn saw(reply: &str, header: &str) -> Vec<String> {
    echo(reply)["headers"][header]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

#[test]
fn a_percent_sign_does_not_walk_around_a_route() {
    let (gw, upstream) = start();
    let first = send(
        &gw,
        &format!(
            "POST /v1/%72eports/1 HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\ncontent-length: 0"
        ),
    );
    assert_eq!(status_of(&first), 200, "{first}");
    assert_eq!(echo(&first)["path"], "/v1/reports/1");
    assert_eq!(saw(&first, "x-route-class"), ["reports"]);
    // Its own limit holds whatever the spelling.
    let second = send(
        &gw,
        &format!(
            "POST /v1/r%65ports/2 HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\ncontent-length: 0"
        ),
    );
    assert_eq!(status_of(&second), 429, "{second}");
    assert_eq!(upstream.hits(), 1);

    let merged = send(&gw, "GET /public//a///b?x=%2F..//&y HTTP/1.1\r\nhost: t");
    assert_eq!(echo(&merged)["path"], "/public/a/b?x=%2F..//&y");

    let slash = send(&gw, "GET /public/%2e%2e%2fv1/reports/1 HTTP/1.1\r\nhost: t");
    assert_eq!(status_of(&slash), 400, "{slash}");
    assert!(slash.contains("application/problem+json"));
    for dots in [
        "/public/%2e%2e/v1/reports/1",
        "/public/./x",
        "/public/.%2E/x",
    ] {
        let r = send(&gw, &format!("GET {dots} HTTP/1.1\r\nhost: t"));
        assert_eq!(status_of(&r), 404, "{dots}: {r}");
    }
    for bad in [
        "/public/a%5cb",
        "/public/a\\b",
        "/public/a%00b",
        "/public/%zz",
    ] {
        let r = send(&gw, &format!("GET {bad} HTTP/1.1\r\nhost: t"));
        assert_eq!(status_of(&r), 400, "{bad}: {r}");
    }
    assert_eq!(upstream.hits(), 2);
}

#[test]
fn targets_that_are_not_origin_form_get_400() {
    let (gw, upstream) = start();
    for target in [
        "v1/secret",
        "x:1/v1/secret",
        "?",
        "*",
        "http://elsewhere/v1/x",
    ] {
        let r = send(&gw, &format!("GET {target} HTTP/1.1\r\nhost: t"));
        assert_eq!(status_of(&r), 400, "{target}: {r}");
    }
    assert_eq!(upstream.hits(), 0, "nothing reached the upstream");
    let absolute = send(
        &gw,
        &format!("GET http://t/v1/x?q=1 HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}"),
    );
    assert_eq!(status_of(&absolute), 200, "{absolute}");
    assert_eq!(echo(&absolute)["path"], "/v1/x?q=1");
}

#[test]
fn headers_the_gateway_owns_cannot_be_sent_in() {
    let (gw, _upstream) = start();
    let r = send(
        &gw,
        &format!(
            "GET /v1/x HTTP/1.1\r\nhost: t\r\nauthorization: {KEY}\r\nX_Tenant_Id: globex\r\n\
             x-tenant_id: globex\r\nX-Real-IP: 6.6.6.6\r\nforwarded: for=6.6.6.6\r\n\
             x-forwarded-proto: https\r\nx-forwarded-host: evil.test\r\nx_forwarded_for: 6.6.6.6"
        ),
    );
    assert_eq!(status_of(&r), 200, "{r}");
    let headers = echo(&r)["headers"].as_object().unwrap().clone();
    for gone in [
        "x_tenant_id",
        "x-tenant_id",
        "forwarded",
        "x-forwarded-host",
        "authorization",
        "x_forwarded_for",
    ] {
        assert!(
            !headers.contains_key(gone),
            "{gone} reached the upstream: {headers:?}"
        );
    }
    assert_eq!(saw(&r, "x-tenant-id"), ["acme"]);
    assert_eq!(saw(&r, "x-real-ip"), ["127.0.0.1"]);
    assert_eq!(saw(&r, "x-forwarded-proto"), ["http"]);
    assert_eq!(saw(&r, "x-forwarded-for"), ["127.0.0.1"]);
}

#[test]
fn every_forwarded_for_line_of_a_trusted_proxy_reaches_the_upstream() {
    let (gw, _upstream) = start();
    let mut stream = connect(gw.addr, Some("127.0.0.2".parse().unwrap()));
    let req = "GET /public/x HTTP/1.1\r\nhost: t\r\nx-forwarded-for: 198.51.100.7, 203.0.113.1\r\n\
               x-forwarded-for: 127.0.0.2\r\nx-forwarded-proto: https\r\nconnection: close\r\n\r\n";
    stream.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).unwrap();
    assert_eq!(
        saw(&out, "x-forwarded-for"),
        ["198.51.100.7, 203.0.113.1, 127.0.0.2, 127.0.0.2"]
    );
    assert_eq!(saw(&out, "x-real-ip"), ["203.0.113.1"]);
    assert_eq!(saw(&out, "x-forwarded-proto"), ["https"]);
}

#[test]
fn upgrades_pass_only_where_the_route_allows_them() {
    let (gw, _upstream) = start();
    let up = "Upgrade: websocket\r\nConnection: Upgrade";
    let refused = send(&gw, &format!("GET / HTTP/1.1\r\nhost: t\r\n{up}"));
    assert_eq!(status_of(&refused), 200, "{refused}");
    assert!(saw(&refused, "upgrade").is_empty(), "{refused}");
    let allowed = send(&gw, &format!("GET /ws HTTP/1.1\r\nhost: t\r\n{up}"));
    assert_eq!(saw(&allowed, "upgrade"), ["websocket"], "{allowed}");
    // `upgrade: true` is WebSocket only: h2c would open an HTTP/2 tunnel
    // to every path of an upstream that speaks it.
    for h2c in ["h2c", "websocket, h2c"] {
        let tunnel = send(
            &gw,
            &format!(
                "GET /ws HTTP/1.1\r\nhost: t\r\nUpgrade: {h2c}\r\nConnection: Upgrade, HTTP2-Settings\r\n\
                 HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA"
            ),
        );
        assert_eq!(status_of(&tunnel), 200, "{tunnel}");
        assert!(saw(&tunnel, "upgrade").is_empty(), "{h2c}: {tunnel}");
        assert!(
            !saw(&tunnel, "connection")
                .iter()
                .any(|c| c.to_ascii_lowercase().contains("upgrade")),
            "{h2c}: {tunnel}"
        );
    }
}

#[test]
fn path_and_method_overrides_never_reach_the_upstream() {
    let (gw, _upstream) = start();
    let overrides = "x-original-url: /admin\r\nX_Rewrite_Url: /admin\r\n\
                     x-http-method-override: DELETE\r\nx-method-override: DELETE\r\n\
                     x-http-method: DELETE\r\nx-forwarded-host: evil.test\r\nx-forwarded-port: 8443";
    for (from, trusted) in [("127.0.0.1", false), ("127.0.0.2", true)] {
        let mut stream = connect(gw.addr, Some(from.parse().unwrap()));
        let req = format!(
            "GET /public/x HTTP/1.1\r\nhost: t\r\n{overrides}\r\nconnection: close\r\n\r\n"
        );
        stream.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).unwrap();
        assert_eq!(status_of(&out), 200, "{out}");
        let headers = echo(&out)["headers"].as_object().unwrap().clone();
        for gone in [
            "x-original-url",
            "x_rewrite_url",
            "x-http-method-override",
            "x-method-override",
            "x-http-method",
        ] {
            assert!(
                !headers.contains_key(gone),
                "{gone} from {from}: {headers:?}"
            );
        }
        let expected: &[&str] = if trusted { &["evil.test"] } else { &[] };
        assert_eq!(saw(&out, "x-forwarded-host"), expected, "from {from}");
        let expected: &[&str] = if trusted { &["8443"] } else { &[] };
        assert_eq!(saw(&out, "x-forwarded-port"), expected, "from {from}");
    }
}

const PATHS: &str = r#"
version: 1
server:
  listen: ["{listen}"]
  admin_listen: "{admin}"
  threads: 1
  path: PATH_RULES
store: { backend: memory }
auth:
  keys:
    - { id: a1, tenant: acme, sha256: "DIGEST" }
upstreams:
  api: { servers: ["{upstream}"] }
routes:
  - { name: reports, path: "/v1/reports/{id}", upstream: api }
  - { name: open, path: "/**", auth: none, upstream: api }
"#;

#[test]
fn paths_are_routed_as_the_upstream_will_read_them() {
    // (rules, path, with the key?) -> (status, route class, forwarded path)
    type Case<'a> = (&'a str, bool, u16, &'a str, &'a str);
    let table: [(&str, &[Case]); 4] = [
        (
            "{}",
            &[
                ("/v1/reports;x/3", true, 400, "", ""),
                ("/v1/reports%3Bx/3", true, 400, "", ""),
                // A server that strips a trailing `.` or space reads
                // another route: /v1/reports/3, /v1/admin.
                ("/v1/reports/3.", true, 400, "", ""),
                ("/v1/admin.", false, 400, "", ""),
                ("/v1/admin%2E", false, 400, "", ""),
                ("/v1/x%20/y", false, 400, "", ""),
                ("/v1/a./b", false, 400, "", ""),
                ("/v1/a.b/c", false, 200, "open", "/v1/a.b/c"),
                ("/v1/reports/3/", false, 200, "open", "/v1/reports/3/"),
                ("/V1/REPORTS/3", false, 200, "open", "/V1/REPORTS/3"),
                ("/v1/reports/3", true, 200, "reports", "/v1/reports/3"),
            ],
        ),
        (
            "{ params: strip, trailing_slash: ignore, case: insensitive }",
            &[
                ("/v1/reports;x/3", false, 401, "", ""),
                ("/v1/reports;x/3", true, 200, "reports", "/v1/reports/3"),
                (
                    "/v1/reports%3Bjsessionid=1/3",
                    true,
                    200,
                    "reports",
                    "/v1/reports/3",
                ),
                ("/v1/reports/3/", false, 401, "", ""),
                ("/v1/reports/3/", true, 200, "reports", "/v1/reports/3/"),
                ("/V1/REPORTS/3", false, 401, "", ""),
                ("/V1/REPORTS/3", true, 200, "reports", "/V1/REPORTS/3"),
            ],
        ),
        (
            "{ params: keep }",
            &[("/v1/reports;x/3", false, 200, "open", "/v1/reports;x/3")],
        ),
        (
            "{ trailing_dots: allow }",
            &[
                ("/v1/admin.", false, 200, "open", "/v1/admin."),
                ("/v1/x%20/y", false, 200, "open", "/v1/x%20/y"),
                ("/v1/a%2E/b", false, 200, "open", "/v1/a./b"),
                ("/v1/reports/3.", true, 200, "reports", "/v1/reports/3."),
            ],
        ),
    ];
    let upstream = Upstream::start();
    for (rules, cases) in table {
        let policy = PATHS
            .replace("DIGEST", &digest("key-a1"))
            .replace("PATH_RULES", rules);
        let gw = Gateway::start(&policy, Some(&upstream));
        for &(path, keyed, status, class, forwarded) in cases {
            let key = if keyed {
                format!("\r\nauthorization: {KEY}")
            } else {
                String::new()
            };
            let r = send(&gw, &format!("GET {path} HTTP/1.1\r\nhost: t{key}"));
            assert_eq!(status_of(&r), status, "{rules} {path}: {r}");
            if status == 200 {
                assert_eq!(saw(&r, "x-route-class"), [class], "{rules} {path}");
                assert_eq!(echo(&r)["path"], forwarded, "{rules} {path}");
            }
        }
    }
}

#[test]
fn oversized_and_ambiguous_requests_are_answered() {
    let (gw, upstream) = start();
    let big = send(
        &gw,
        &format!(
            "GET /public/x HTTP/1.1\r\nhost: t\r\nx-pad: {}",
            "a".repeat(4000)
        ),
    );
    assert_eq!(status_of(&big), 431, "{big}");
    let smuggle = send(
        &gw,
        "POST /public/x HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\ntransfer-encoding: chunked",
    );
    assert_eq!(status_of(&smuggle), 400, "{smuggle}");
    assert!(smuggle.contains("\"status\":400"), "{smuggle}");
    // Heads Pingora's own parse would refuse with a bare 400 are answered
    // here, as every other client error is.
    for head in [
        "GET /public/x HTTP/1.1\r\nhost: t\r\nhost: u",
        "GET /public/x HTTP/1.1\r\nhost: user@t",
        "GET http://user@t/public/x HTTP/1.1\r\nhost: t",
        "GET http://u/public/x HTTP/1.1\r\nhost: t",
        "POST /public/x HTTP/1.0\r\nhost: t\r\ntransfer-encoding: chunked",
    ] {
        let answer = send(&gw, head);
        assert_eq!(status_of(&answer), 400, "{head}: {answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert!(answer.contains("cache-control: no-store"), "{answer}");
    }
    let absolute = send(&gw, "GET http://t/public/x HTTP/1.1\r\nhost: t");
    assert_eq!(status_of(&absolute), 200, "{absolute}");
    let garbage = raw(gw.addr, b"GET /public/x HTTP/1.1\r\nbad header\r\n\r\n");
    assert_eq!(status_of(&garbage), 400, "{garbage}");
    assert!(garbage.contains("application/problem+json"));

    let bad_chunk = raw(
        gw.addr,
        b"POST /public/x HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\nzz\r\n",
    );
    assert_eq!(
        status_of(&bad_chunk),
        400,
        "a framing error gets an answer: {bad_chunk}"
    );
    let declared = send(
        &gw,
        "POST /public/x HTTP/1.1\r\nhost: t\r\ncontent-length: 65",
    );
    assert_eq!(status_of(&declared), 413, "{declared}");
    let route = raw(
        gw.addr,
        b"POST /small HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
    );
    assert_eq!(status_of(&route), 413, "{route}");
    let chunked = raw(gw.addr, b"POST /small HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n");
    assert_eq!(status_of(&chunked), 413, "{chunked}");
    let fits = raw(
        gw.addr,
        b"POST /small HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\nconnection: close\r\n\r\nfour",
    );
    assert_eq!(status_of(&fits), 200, "{fits}");
    // The absolute-form request, the two fitting bodies, and the bad
    // chunk's head: a body's framing is found wrong while it streams, after
    // the head went on.
    assert!(
        upstream.hits() <= 4,
        "only the fitting bodies may reach the upstream"
    );
}

#[test]
fn a_head_without_host_or_with_a_look_alike_framing_header_is_refused() {
    let (gw, upstream) = start();
    let refused = |head: &str| {
        let answer = send(&gw, head);
        assert_eq!(status_of(&answer), 400, "{head}: {answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert!(answer.contains("cache-control: no-store"), "{answer}");
        answer
    };
    let hostless = refused("GET /public/x HTTP/1.1");
    assert!(hostless.contains("Host header"), "{hostless}");
    for head in [
        "POST /public/x HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\nTransfer_Encoding: chunked",
        "POST /public/x HTTP/1.1\r\nhost: t\r\ntransfer_encoding: chunked",
        "POST /public/x HTTP/1.1\r\nhost: t\r\nContent_Length: 5",
    ] {
        refused(head);
    }
    assert_eq!(upstream.hits(), 0, "none of them reached the upstream");

    // HTTP/1.0 needs no Host; a name in another case is the same name.
    let old = send(&gw, "GET /public/x HTTP/1.0");
    assert_eq!(status_of(&old), 200, "{old}");
    let cased = raw(
        gw.addr,
        b"POST /public/x HTTP/1.1\r\nHOST: t\r\nCONTENT-LENGTH: 2\r\nconnection: close\r\n\r\nhi",
    );
    assert_eq!(status_of(&cased), 200, "{cased}");
    assert_eq!(upstream.hits(), 2);
}

/// Reads from a connection until the gateway closes it; what it sent.
fn until_closed(stream: &mut std::net::TcpStream) -> String {
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn idle_and_slow_clients_are_cut_at_their_timeouts() {
    let (gw, _upstream) = start();
    // Idle after a request: closed quietly.
    let mut idle = connect(gw.addr, None);
    idle.write_all(b"GET /public/x HTTP/1.1\r\nhost: t\r\n\r\n")
        .unwrap();
    // The gateway closes it (the client would wait 10 s): the idle timeout
    // is counted below.
    let all = until_closed(&mut idle);
    assert_eq!(status_of(&all), 200);

    // A head that trickles: 408.
    let mut slow = connect(gw.addr, None);
    slow.write_all(b"GET /public/x HTTP/1.1\r\n").unwrap();
    assert_eq!(status_of(&until_closed(&mut slow)), 408);

    // A body that stops: 408, and the pool slot is free again.
    let mut upload = connect(gw.addr, None);
    upload
        .write_all(b"POST /public/x HTTP/1.1\r\nhost: t\r\ncontent-length: 50\r\n\r\nsome")
        .unwrap();
    let reply = until_closed(&mut upload);
    assert!(matches!(status_of(&reply), 408 | 0), "{reply}");
    let free = || gw.metric("tollgate_pool_in_flight{pool=\"api\"}") == 0.0;
    assert!(eventually(Duration::from_secs(5), free));

    for reason in ["idle_timeout", "header_timeout", "body_timeout"] {
        let series = format!(
            "tollgate_connections_rejected_total{{listener=\"{}\",reason=\"{reason}\"}}",
            gw.addr
        );
        assert!(gw.metric(&series) >= 1.0, "{series}\n{}", gw.metrics());
    }
}

#[test]
fn a_client_that_stops_reading_gives_its_pool_slot_back() {
    let (gw, _upstream) = start();
    let mut readers: Vec<_> = (0..2)
        .map(|_| {
            let mut s = connect(gw.addr, None);
            s.write_all(b"GET /public/big HTTP/1.1\r\nhost: t\r\n\r\n")
                .unwrap();
            s
        })
        .collect();
    // Both slots of the pool are taken by clients that read nothing; the
    // send timeout frees them.
    let freed = || {
        gw.metric(&format!(
            "tollgate_connections_rejected_total{{listener=\"{}\",reason=\"send_timeout\"}}",
            gw.addr
        )) >= 2.0
    };
    assert!(
        eventually(Duration::from_secs(10), freed),
        "{}",
        gw.metrics()
    );
    assert!(eventually(Duration::from_secs(5), || gw
        .metric("tollgate_pool_in_flight{pool=\"api\"}")
        == 0.0));
    let after = send(&gw, "GET /public/x HTTP/1.1\r\nhost: t");
    assert_eq!(status_of(&after), 200, "{after}");
    readers.clear();
}

#[test]
fn connections_beyond_the_bound_are_refused_and_counted() {
    let (gw, _upstream) = start();
    let held: Vec<_> = (0..40).map(|_| connect(gw.addr, None)).collect();
    let open = || gw.metric(&format!("tollgate_connections{{listener=\"{}\"}}", gw.addr)) >= 40.0;
    assert!(eventually(Duration::from_secs(5), open), "{}", gw.metrics());
    let mut extra = connect(gw.addr, None);
    let _ = extra.write_all(b"GET /public/x HTTP/1.1\r\nhost: t\r\n\r\n");
    assert_eq!(until_closed(&mut extra), "", "refused without an answer");
    let series = format!(
        "tollgate_connections_rejected_total{{listener=\"{}\",reason=\"max_connections\"}}",
        gw.addr
    );
    assert!(gw.metric(&series) >= 1.0);
    drop(held);
    assert!(eventually(Duration::from_secs(5), || {
        status_of(&send(&gw, "GET /public/x HTTP/1.1\r\nhost: t")) == 200
    }));
}

#[test]
fn a_flood_of_bad_requests_writes_few_log_lines() {
    let (gw, _upstream) = start();
    for _ in 0..100 {
        let r = raw(
            gw.addr,
            b"POST /public/x HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        );
        assert_eq!(status_of(&r), 400, "{r}");
    }
    for _ in 0..200 {
        let mut s = connect(gw.addr, None);
        s.write_all(b"GET /public/x HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
            .unwrap();
        drop(s);
    }
    let lines = gw.log().lines().filter(|l| l.contains("ERROR")).count();
    assert!(lines <= 20, "{lines} error lines:\n{}", gw.log());
}
