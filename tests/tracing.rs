//! W3C Trace Context through the binary: a trusted proxy's `traceparent`
//! continued, any other client's replaced, the upstream receiving this
//! gateway's span as its parent, and the trace id in the access log.

mod support;

use std::time::Duration;

use support::{digest, eventually, Gateway, Upstream};

const SENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const SENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

fn policy(trusted: &str, log: &std::path::Path) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", access_log: {{ path: "{}" }} }}
client_ip: {{ trusted_proxies: ["{trusted}"] }}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: api, path: "/**", upstream: api }}
"#,
        log.display(),
        digest("key-c1")
    )
}

/// The trace ids of the access log's lines, in order.
fn logged_traces(log: &std::path::Path, lines: usize) -> Vec<String> {
    let mut traces = Vec::new();
    assert!(eventually(Duration::from_secs(5), || {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        traces = text
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["trace_id"].as_str().unwrap_or_default().to_owned()
            })
            .collect();
        traces.len() >= lines
    }));
    traces
}

/// A caller's key with a trace of its own and the trace's state.
const TRACED: [(&str, &str); 3] = [
    ("authorization", "Bearer key-c1"),
    ("traceparent", SENT),
    ("tracestate", "vendor=abc"),
];

/// A gateway trusting `trusted` as proxies, logging every request to
/// `log` in a directory of its own, in front of an upstream.
struct Traced {
    gw: Gateway,
    log: std::path::PathBuf,
    _upstream: Upstream,
    _dir: tempfile::TempDir,
}

fn traced(trusted: &str) -> Traced {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let upstream = Upstream::start();
    let gw = Gateway::start(&policy(trusted, &log), Some(&upstream));
    Traced {
        gw,
        log,
        _upstream: upstream,
        _dir: dir,
    }
}

/// The (trace id, parent span id, flags) of a `traceparent` value.
fn fields(value: &str) -> (String, String, String) {
    let parts: Vec<&str> = value.split('-').collect();
    assert_eq!(parts.len(), 4, "{value}");
    assert_eq!(parts[0], "00");
    (parts[1].into(), parts[2].into(), parts[3].into())
}

#[test]
fn a_trusted_proxys_trace_is_continued_and_the_upstream_is_its_child() {
    let Traced { gw, log, .. } = &traced("127.0.0.1/32");
    let reply = gw.get("/x", &TRACED);
    assert_eq!(reply.status, 200);
    let forwarded = reply.upstream_saw("traceparent");
    assert_eq!(forwarded.len(), 1, "{forwarded:?}");
    let (trace, parent, flags) = fields(&forwarded[0]);
    assert_eq!(trace, SENT_TRACE, "the same trace");
    assert_ne!(
        parent, "00f067aa0ba902b7",
        "the gateway's own span is the parent"
    );
    assert_eq!(flags, "01", "sampled as the proxy said");
    assert_eq!(reply.upstream_saw("tracestate"), ["vendor=abc"]);
    assert_eq!(logged_traces(log, 1), [SENT_TRACE]);
}

#[test]
fn another_clients_trace_is_replaced_and_each_request_starts_its_own() {
    let Traced { gw, log, .. } = &traced("10.0.0.0/8");
    let first = gw.get("/x", &TRACED);
    let second = gw.get("/y", &[("authorization", "Bearer key-c1")]);
    let refused = gw.get("/z", &[("traceparent", SENT)]);
    assert_eq!(
        (first.status, second.status, refused.status),
        (200, 200, 401)
    );
    let (one, _, flags) = fields(&first.upstream_saw("traceparent")[0]);
    let (two, _, _) = fields(&second.upstream_saw("traceparent")[0]);
    assert_ne!(one, SENT_TRACE, "a client cannot choose the trace");
    assert_eq!(flags, "00", "nothing samples without server.tracing");
    assert_ne!(one, two);
    assert!(first.upstream_saw("tracestate").is_empty());
    let logged = logged_traces(log, 3);
    assert_eq!(logged[..2], [one, two]);
    assert_eq!(logged[2].len(), 32, "a refused request has its trace too");
}

/// An OTLP/HTTP collector: every span posted to it, decoded.
struct Collector {
    addr: std::net::SocketAddr,
    spans: std::sync::Arc<std::sync::Mutex<Vec<opentelemetry_proto::tonic::trace::v1::Span>>>,
}

impl Collector {
    fn start() -> Self {
        use prost::Message;
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let store = spans.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(conn.try_clone().unwrap());
                    let mut conn = conn;
                    loop {
                        let mut length = 0usize;
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        assert!(line.starts_with("POST /v1/traces "), "{line}");
                        loop {
                            let mut h = String::new();
                            reader.read_line(&mut h).unwrap();
                            let h = h.trim_end().to_ascii_lowercase();
                            if h.is_empty() {
                                break;
                            }
                            if let Some(v) = h.strip_prefix("content-length:") {
                                length = v.trim().parse().unwrap();
                            }
                        }
                        let mut body = vec![0; length];
                        reader.read_exact(&mut body).unwrap();
                        let request = opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest::decode(&body[..]).unwrap();
                        for rs in request.resource_spans {
                            for ss in rs.scope_spans {
                                store.lock().unwrap().extend(ss.spans);
                            }
                        }
                        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                            .unwrap();
                    }
                });
            }
        });
        Self { addr, spans }
    }

    fn spans(&self) -> Vec<opentelemetry_proto::tonic::trace::v1::Span> {
        self.spans.lock().unwrap().clone()
    }
}

fn attribute(span: &opentelemetry_proto::tonic::trace::v1::Span, key: &str) -> Option<String> {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .map(|v| match v {
            Value::StringValue(s) => s.clone(),
            Value::IntValue(n) => n.to_string(),
            other => format!("{other:?}"),
        })
}

#[test]
fn sampled_requests_are_exported_as_a_span_with_its_decision_and_upstream() {
    let collector = Collector::start();
    let upstream = Upstream::start();
    let text = format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  tracing: {{ otlp_endpoint: "http://{}/v1/traces", sample: 0 }}
client_ip: {{ trusted_proxies: ["127.0.0.1/32"] }}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 1, refill_per_second: 0.001 }}
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: api, path: "/**", upstream: api, limits: [per-tenant] }}
"#,
        collector.addr,
        digest("key-c1")
    );
    let gw = Gateway::start(&text, Some(&upstream));
    let sampled = [("authorization", "Bearer key-c1"), ("traceparent", SENT)];
    let admitted = gw.get("/x", &sampled);
    let refused = gw.get("/x", &sampled);
    // Not sampled: started here with `sample: 0`, or a proxy's unsampled trace.
    let unsampled = "00-11111111111111111111111111111111-2222222222222222-00";
    gw.get("/x", &[("authorization", "Bearer key-c1")]);
    gw.get(
        "/x",
        &[
            ("authorization", "Bearer key-c1"),
            ("traceparent", unsampled),
        ],
    );
    // A last sampled request: its spans come after anything the two
    // before it could have sent.
    let last = gw.get("/x", &sampled);
    assert_eq!(
        (admitted.status, refused.status, last.status),
        (200, 429, 429)
    );
    let (_, gateway_span, _) = fields(&admitted.upstream_saw("traceparent")[0]);
    let caller = hex::decode("00f067aa0ba902b7").unwrap();
    let requests = |spans: &[opentelemetry_proto::tonic::trace::v1::Span]| {
        spans.iter().filter(|s| s.parent_span_id == caller).count()
    };
    assert!(eventually(Duration::from_secs(10), || requests(
        &collector.spans()
    ) == 3));
    let spans = collector.spans();
    assert!(
        spans.iter().all(|s| hex::encode(&s.trace_id) == SENT_TRACE),
        "only sampled traces"
    );
    let servers: Vec<_> = spans
        .iter()
        .filter(|s| s.parent_span_id == caller)
        .collect();
    let server = servers
        .iter()
        .find(|s| hex::encode(&s.span_id) == gateway_span)
        .expect("the span the upstream saw as its parent");
    assert_eq!(attribute(server, "http.route").as_deref(), Some("api"));
    assert_eq!(
        attribute(server, "http.response.status_code").as_deref(),
        Some("200")
    );
    assert_eq!(
        attribute(server, "tollgate.outcome").as_deref(),
        Some("allowed")
    );
    let children: Vec<_> = spans
        .iter()
        .filter(|s| s.parent_span_id == server.span_id)
        .collect();
    let names: Vec<&str> = children.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names.contains(&"decide limits") && names.contains(&"upstream"),
        "{names:?}"
    );
    for c in &children {
        assert!(c.start_time_unix_nano >= server.start_time_unix_nano);
        assert!(c.end_time_unix_nano <= server.end_time_unix_nano);
    }
    let denied = servers
        .iter()
        .find(|s| s.span_id != server.span_id)
        .unwrap();
    assert_eq!(
        attribute(denied, "tollgate.violated").as_deref(),
        Some("per-tenant")
    );
    assert_eq!(
        attribute(denied, "http.response.status_code").as_deref(),
        Some("429")
    );
    // Never the tenant or the credential.
    for s in &spans {
        for kv in &s.attributes {
            let v = format!("{:?}", kv.value);
            assert!(
                !v.contains("acme") && !v.contains("c1\""),
                "{} = {v}",
                kv.key
            );
        }
    }
}

#[test]
fn a_decision_links_to_the_batched_store_call_that_made_it() {
    let collector = Collector::start();
    let redis = support::redis_server::RedisServer::start();
    let text = format!(
        r#"
version: 1
server:
  listen: ["{{listen}}"]
  admin_listen: "{{admin}}"
  tracing: {{ otlp_endpoint: "http://{}/v1/traces" }}
store: {}
auth:
  keys: [ {{ id: c1, tenant: acme, sha256: "{}" }} ]
limits:
  per-tenant: {{ key: [tenant], capacity: 100, refill_per_second: 100 }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200, body: ok }}, limits: [per-tenant] }}
"#,
        collector.addr,
        redis.store(2_000),
        digest("key-c1")
    );
    let gw = Gateway::start_with_env(&text, None, &[("TOLLGATE_KEY_SECRET", "trace-secret")]);
    assert_eq!(
        gw.get("/x", &[("authorization", "Bearer key-c1")]).status,
        200
    );
    let find = |name: &str| collector.spans().into_iter().find(|s| s.name == name);
    assert!(eventually(Duration::from_secs(10), || find(
        "decide limits"
    )
    .is_some()
        && find("store call").is_some()));
    let (decide, call) = (find("decide limits").unwrap(), find("store call").unwrap());
    assert_eq!(decide.links.len(), 1, "{decide:?}");
    assert_eq!(decide.links[0].span_id, call.span_id);
    assert_eq!(decide.links[0].trace_id, call.trace_id);
    assert_ne!(
        call.trace_id, decide.trace_id,
        "a call serves many traces: a trace of its own"
    );
    assert_eq!(attribute(&call, "db.system").as_deref(), Some("redis"));
    assert_eq!(attribute(&call, "tollgate.requests").as_deref(), Some("1"));
}
