//! Token costs read from an LLM API's answers through the real binary, in
//! front of a fake OpenAI- and Anthropic-compatible upstream: a JSON answer
//! and a streamed one settle at the usage they report, the stream reaches
//! the client byte for byte, an answer without usage settles at `max`, and
//! the request's own estimate (`cost_from_request`) is what admission
//! reserves while the answer is in flight.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use support::{digest, eventually, Gateway};

/// An OpenAI chat/completions stream whose last chunk carries the usage.
pub const OPENAI_STREAM: &str = concat!(
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"usage: {\\\"total_tokens\\\": 99999}\"}}],\"usage\":null}\n\n",
    ": a comment line\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":30,\"completion_tokens\":47,\"total_tokens\":77}}\n\n",
    "data: [DONE]\n\n",
);

/// The same stream without the usage chunk (the client did not ask).
const OPENAI_STREAM_NO_USAGE: &str = concat!(
    "data: {\"id\":\"c2\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
    "data: [DONE]\n\n",
);

const OPENAI_JSON: &str = r#"{"id":"c3","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"{\"usage\":{\"total_tokens\":5000}}"}}],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;

const ANTHROPIC_STREAM: &str = concat!(
    "event: message_start\r\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m1\",\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\r\n\r\n",
    "event: content_block_delta\r\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\r\n\r\n",
    "event: message_delta\r\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":5}}\r\n\r\n",
    "event: message_delta\r\ndata: {\"type\":\"message_delta\",\"delta\":{},\"usage\":{\"output_tokens\":20}}\r\n\r\n",
    "event: message_stop\r\ndata: {\"type\":\"message_stop\"}\r\n\r\n",
);

/// A fake LLM upstream: answers by path, streaming event streams in small
/// chunks (so events are split across reads); a request whose body asks
/// for a stream (`"stream": true`) gets one, with its usage only when the
/// body asks for it (`stream_options.include_usage`), as OpenAI answers;
/// `/hold/…` waits for a release before it answers; it records the request
/// heads it saw.
struct Llm {
    addr: std::net::SocketAddr,
    release: Mutex<mpsc::Sender<()>>,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Llm {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::channel::<()>();
        let rx = Arc::new(Mutex::new(rx));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (rx, log) = (rx.clone(), log.clone());
                thread::spawn(move || serve(conn, &rx, &log));
            }
        });
        Self {
            addr,
            release: Mutex::new(tx),
            seen,
        }
    }

    fn release(&self) {
        self.release.lock().unwrap().send(()).unwrap();
    }
}

fn serve(conn: TcpStream, release: &Mutex<mpsc::Receiver<()>>, seen: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    loop {
        let mut head = String::new();
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            head.push_str(&line);
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        seen.lock().unwrap().push(head.clone());
        let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
        let asked: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let streamed = asked["stream"] == true;
        if path.starts_with("/hold/") {
            let _ = release
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(30));
        }
        let (content_type, answer) = if streamed && asked["stream_options"]["include_usage"] == true
        {
            ("text/event-stream", OPENAI_STREAM)
        } else if streamed {
            ("text/event-stream", OPENAI_STREAM_NO_USAGE)
        } else if path.ends_with("/openai-stream") {
            ("text/event-stream", OPENAI_STREAM)
        } else if path.ends_with("/openai-stream-no-usage") {
            ("text/event-stream", OPENAI_STREAM_NO_USAGE)
        } else if path.ends_with("/anthropic-stream") {
            ("text/event-stream", ANTHROPIC_STREAM)
        } else {
            ("application/json", OPENAI_JSON)
        };
        if content_type == "application/json" {
            let (status, answer) = match path.ends_with("/error") {
                true => (
                    "429 Too Many Requests",
                    r#"{"error":{"type":"rate_limit"}}"#,
                ),
                false => ("200 OK", answer),
            };
            let reply = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            );
            conn.write_all(reply.as_bytes()).unwrap();
            continue;
        }
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n"
        );
        conn.write_all(head.as_bytes()).unwrap();
        for piece in answer.as_bytes().chunks(37) {
            let chunk = [format!("{:x}\r\n", piece.len()).as_bytes(), piece, b"\r\n"].concat();
            if conn.write_all(&chunk).is_err() {
                return;
            }
            conn.flush().unwrap();
            thread::sleep(Duration::from_millis(1));
        }
        conn.write_all(b"0\r\n\r\n").unwrap();
    }
}

fn policy(llm: &Llm) -> String {
    let keys: String = (1..=6)
        .map(|i| {
            format!(
                "    - {{ id: c{i}, tenant: t{i}, sha256: \"{}\" }}\n",
                digest(&format!("key-{i}"))
            )
        })
        .collect();
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {{ backend: memory }}
auth:
  keys:
{keys}limits:
  tokens: {{ key: [tenant], capacity: 1000, refill_per_second: 0.001 }}
upstreams:
  llm: {{ servers: ["{llm}"] }}
routes:
  - name: openai
    path: "/**"
    upstream: llm
    limits: [tokens]
    cost: 10
    cost_from_request: {{ header: x-max-tokens, max: 500, default: 100 }}
    cost_from_response: {{ format: openai, max: 500 }}
"#,
        llm = llm.addr
    )
}

fn anthropic_policy(llm: &Llm) -> String {
    policy(llm).replace("format: openai", "format: anthropic")
}

fn key(i: u32) -> (String, String) {
    ("authorization".into(), format!("Bearer key-{i}"))
}

/// What `tokens` has left for tenant `t{i}`, as `/admin/explain` reads it.
fn remaining(gw: &Gateway, i: u32) -> i64 {
    let path = format!("/admin/explain?path=/v1/x&credential=c{i}");
    let r = support::get(gw.admin, &path, &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    let limits = r.json()["limits"].clone();
    limits[0]["remaining"].as_i64().unwrap()
}

fn settles_at(gw: &Gateway, i: u32, remaining_after: i64) -> bool {
    eventually(Duration::from_secs(5), || {
        remaining(gw, i) == remaining_after
    })
}

fn call(gw: &Gateway, path: &str, i: u32, extra: &[(&str, &str)]) -> support::Reply {
    let (k, v) = key(i);
    let mut headers: Vec<(&str, &str)> = vec![(&k, &v)];
    headers.extend_from_slice(extra);
    gw.get(path, &headers)
}

#[test]
fn openai_answers_settle_at_their_usage() {
    let llm = Llm::start();
    let gw = Gateway::start(&policy(&llm), None);

    // A JSON answer: 42 tokens, whatever its text says.
    let r = call(&gw, "/v1/chat/completions", 1, &[("x-max-tokens", "300")]);
    assert_eq!(r.status, 200);
    assert_eq!(r.body, OPENAI_JSON);
    assert!(settles_at(&gw, 1, 1000 - 42));

    // A stream: byte for byte, and 77 tokens from its last chunk.
    let r = call(&gw, "/v1/openai-stream", 2, &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.body, OPENAI_STREAM);
    assert!(settles_at(&gw, 2, 1000 - 77));

    // A stream that reports no usage is charged the most.
    let r = call(&gw, "/v1/openai-stream-no-usage", 3, &[]);
    assert_eq!(r.status, 200);
    assert!(settles_at(&gw, 3, 1000 - 500));

    // An error answer of the API reports no usage and spent none: the
    // request's estimate stands.
    let r = call(&gw, "/v1/error", 5, &[("x-max-tokens", "200")]);
    assert_eq!(r.status, 429);
    // (Followed by a stream of 77 tokens: 723 left is reached only if the
    // error kept its 200; settled at the most, it would be 423.)
    assert_eq!(call(&gw, "/v1/openai-stream", 5, &[]).status, 200);
    assert!(settles_at(&gw, 5, 1000 - 200 - 77));

    // Metered answers are asked for without compression.
    let seen = llm.seen.lock().unwrap().join("");
    assert!(seen.contains("accept-encoding: identity"), "{seen}");
}

#[test]
fn the_request_estimate_is_reserved_while_the_answer_is_in_flight() {
    let llm = Llm::start();
    let gw = Gateway::start(&policy(&llm), None);
    let addr = gw.addr;
    let waiting = thread::spawn(move || {
        support::get(
            addr,
            "/hold/openai-stream",
            &[("authorization", "Bearer key-4"), ("x-max-tokens", "300")],
        )
    });
    // Reserved: the request's own estimate, not the route's cost.
    assert!(settles_at(&gw, 4, 1000 - 300));
    llm.release();
    let r = waiting.join().unwrap();
    assert_eq!(r.body, OPENAI_STREAM);
    // Replaced by the usage once the stream ended.
    assert!(settles_at(&gw, 4, 1000 - 77));

    // An estimate beyond max is clamped to it; none named is the default.
    let held = thread::spawn(move || {
        support::get(
            addr,
            "/hold/chat",
            &[
                ("authorization", "Bearer key-5"),
                ("x-max-tokens", "999999"),
            ],
        )
    });
    assert!(settles_at(&gw, 5, 1000 - 500));
    llm.release();
    assert_eq!(held.join().unwrap().status, 200);
    assert!(settles_at(&gw, 5, 1000 - 42));
}

#[test]
fn the_body_names_the_estimate_and_a_stream_is_asked_for_its_usage() {
    let llm = Llm::start();
    let policy = policy(&llm)
        .replace("header: x-max-tokens,", "json: max_tokens,")
        .replace("format: openai,", "format: openai, include_usage: true,");
    let gw = Gateway::start(&policy, None);
    let addr = gw.addr;
    let post = move |i: u32, path: &'static str, body: &'static str| {
        thread::spawn(move || {
            let (k, v) = key(i);
            support::request_with_body(addr, "POST", path, &[(&k, &v)], body.as_bytes())
        })
    };
    // Reserved: the body's max_tokens. The stream did not ask for its
    // usage; the gateway asked for it, so it settles at what it reports.
    let held = post(
        4,
        "/hold/v1/chat/completions",
        r#"{"model":"m","max_tokens":300,"stream":true}"#,
    );
    assert!(settles_at(&gw, 4, 1000 - 300));
    llm.release();
    let r = held.join().unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, OPENAI_STREAM);
    assert!(settles_at(&gw, 4, 1000 - 77));

    // Beyond max: clamped; none named: the default.
    let held = post(5, "/hold/v1/chat/completions", r#"{"max_tokens":999999}"#);
    assert!(settles_at(&gw, 5, 1000 - 500));
    llm.release();
    assert_eq!(held.join().unwrap().status, 200);
    assert!(settles_at(&gw, 5, 1000 - 42));
    let held = post(6, "/hold/v1/chat/completions", r#"{"model":"m"}"#);
    assert!(settles_at(&gw, 6, 1000 - 100));
    llm.release();
    assert_eq!(held.join().unwrap().status, 200);
    assert!(settles_at(&gw, 6, 1000 - 42));

    // A stream that says twice whether it is one is refused, not guessed.
    let r = post(
        3,
        "/v1/chat/completions",
        r#"{"stream":true,"stream":false}"#,
    )
    .join()
    .unwrap();
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(remaining(&gw, 3), 1000, "refused before any charge");

    // A body too large to read before the limits: 413, or with
    // `oversize: absent` sent on unread, its estimate the most.
    let large = format!(r#"{{"max_tokens":1,"pad":"{}"}}"#, "x".repeat(70_000));
    let (k, v) = key(2);
    let big = |gw: &Gateway, path: &str| {
        support::request_with_body(gw.addr, "POST", path, &[(&k, &v)], large.as_bytes())
    };
    assert_eq!(big(&gw, "/v1/chat/completions").status, 413);
    let gw = Gateway::start(
        &policy.replace("    cost: 10\n", "    cost: 10\n    oversize: absent\n"),
        None,
    );
    let addr = gw.addr;
    let held = thread::spawn(move || {
        let (k, v) = key(2);
        let large = format!(r#"{{"max_tokens":1,"pad":"{}"}}"#, "x".repeat(70_000));
        support::request_with_body(
            addr,
            "POST",
            "/hold/v1/chat/completions",
            &[(&k, &v)],
            large.as_bytes(),
        )
    });
    assert!(settles_at(&gw, 2, 1000 - 500));
    llm.release();
    assert_eq!(held.join().unwrap().status, 200);
    assert!(settles_at(&gw, 2, 1000 - 42));
}

#[test]
fn anthropic_streams_settle_at_input_plus_the_last_output() {
    let llm = Llm::start();
    let gw = Gateway::start(&anthropic_policy(&llm), None);
    let r = call(&gw, "/v1/anthropic-stream", 6, &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.body, ANTHROPIC_STREAM);
    assert!(settles_at(&gw, 6, 1000 - 30));
}

#[test]
fn concurrent_streams_of_one_tenant_settle_exactly() {
    let llm = Llm::start();
    let gw = Gateway::start(&policy(&llm), None);
    let addr = gw.addr;
    // Ten streams at once, each reserving its estimate of 80 and settling
    // at 77: the budget ends exactly 770 lower, whatever the interleaving.
    let streams: Vec<_> = (0..10)
        .map(|_| {
            thread::spawn(move || {
                support::get(
                    addr,
                    "/v1/openai-stream",
                    &[("authorization", "Bearer key-1"), ("x-max-tokens", "80")],
                )
            })
        })
        .collect();
    for s in streams {
        let r = s.join().unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.body, OPENAI_STREAM);
    }
    assert!(settles_at(&gw, 1, 1000 - 770));
}

#[test]
fn the_openai_python_client_streams_and_not_through_the_gateway() {
    // The `openai` package, which `make test` installs in target/pylib, as
    // the client: a JSON answer, then a stream it does not ask to carry its
    // usage; the gateway asks for it (`include_usage`).
    let root = env!("CARGO_MANIFEST_DIR");
    let pylib = format!("{root}/target/pylib");
    let import = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .env("PYTHONPATH", &pylib)
        .status()
        .expect("python3 must be installed");
    assert!(
        import.success(),
        "the openai package is missing from {pylib}: run `make test`, which installs it"
    );
    let llm = Llm::start();
    // The estimate is the body's max_tokens, as the client sends it.
    let policy = policy(&llm)
        .replace("header: x-max-tokens,", "json: max_tokens,")
        .replace("format: openai,", "format: openai, include_usage: true,");
    let gw = Gateway::start(&policy, None);
    let out = std::process::Command::new("python3")
        .arg(format!("{root}/tests/openai_client.py"))
        .args(["--base-url", &format!("http://{}/v1", gw.addr)])
        .args(["--api-key", "key-1", "--model", "gpt-4o-mini"])
        .env("PYTHONPATH", &pylib)
        .output()
        .expect("python3 must be installed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}{}",
        String::from_utf8_lossy(&out.stderr),
        gw.log()
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 2, "{stdout}");

    // The JSON answer's text (which looks like a usage) and its usage.
    assert_eq!(lines[0]["mode"], "json");
    assert_eq!(lines[0]["content"], r#"{"usage":{"total_tokens":5000}}"#);
    assert_eq!(lines[0]["total_tokens"], 42);

    // The stream's text and the usage of its last chunk, which the upstream
    // sends only to a request with stream_options.include_usage: three
    // chunks of text and that one.
    assert_eq!(lines[1]["mode"], "stream");
    assert_eq!(lines[1]["content"], r#"usage: {"total_tokens": 99999}"#);
    assert_eq!(lines[1]["total_tokens"], 77, "{}", gw.log());
    assert_eq!(lines[1]["chunks"], 4);

    // Both settle at the usage they report (a stream without it would
    // settle at the most, 500).
    assert!(settles_at(&gw, 1, 1000 - 42 - 77));
}
