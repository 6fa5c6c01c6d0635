//! Forward auth end to end: a key no other source knows is shown to an
//! existing service (`auth.forward_auth`), a small one written here that
//! counts its calls and records their headers. Its 2xx answer names the
//! caller, 401/403 refuses it, anything else is a 503 that is never
//! remembered; answers are cached, concurrent first requests share one
//! call, and pre-auth limits and `max_in_flight` bound how often it is
//! asked.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::Value;
use support::{digest, eventually, Gateway, Reply, Upstream};

/// A key listed in `auth.keys` (credential `local-1` of tenant `local`).
const LOCAL_KEY: &str = "local-secret";

/// What the auth service has seen, shared with its connection threads.
#[derive(Default)]
struct AuthState {
    calls: AtomicUsize,
    /// The headers of each call, names lowercased, in arrival order.
    seen: Mutex<Vec<Vec<(String, String)>>>,
    /// While true, every call waits for [`AuthServer::release`].
    held: Mutex<bool>,
    released: Condvar,
}

/// The service the gateway asks, answering by the `authorization` it is
/// shown:
/// - `Bearer good-<id>`: 200, tenant `acme`, credential `<id>`;
/// - `Bearer plan-<plan>`: 200, tenant `acme`, credential `plan-<plan>`,
///   `x-plan: <plan>`;
/// - `Bearer long-tenant-<n>` / `long-id-<n>`: 200 with an `n`-byte tenant
///   or credential id;
/// - `Bearer forbidden`: 403; `Bearer boom`: 500; anything else: 401.
struct AuthServer {
    addr: SocketAddr,
    state: Arc<AuthState>,
}

impl AuthServer {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind auth service");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(AuthState::default());
        let shared = state.clone();
        thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let state = shared.clone();
                thread::spawn(move || serve_auth(conn, &state));
            }
        });
        Self { addr, state }
    }

    fn url(&self) -> String {
        format!("http://{}/whoami", self.addr)
    }

    fn calls(&self) -> usize {
        self.state.calls.load(Ordering::SeqCst)
    }

    /// The values of `header` in each call, in order (`None`: not sent).
    fn seen(&self, header: &str) -> Vec<Option<String>> {
        self.state
            .seen
            .lock()
            .unwrap()
            .iter()
            .map(|call| {
                call.iter()
                    .find(|(k, _)| k == header)
                    .map(|(_, v)| v.clone())
            })
            .collect()
    }

    fn hold(&self) {
        *self.state.held.lock().unwrap() = true;
    }

    fn release(&self) {
        *self.state.held.lock().unwrap() = false;
        self.state.released.notify_all();
    }
}

/// Requests on one connection, one after another (the gateway may keep it).
fn serve_auth(conn: TcpStream, state: &AuthState) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    let mut conn = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        let length = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse::<usize>().ok())
            .unwrap_or(0);
        if reader.read_exact(&mut vec![0u8; length]).is_err() {
            return;
        }
        state.calls.fetch_add(1, Ordering::SeqCst);
        let authorization = headers
            .iter()
            .find(|(k, _)| k == "authorization")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        state.seen.lock().unwrap().push(headers);
        let held = state.held.lock().unwrap();
        drop(state.released.wait_while(held, |held| *held).unwrap());
        let (status, identity) = answer(&authorization);
        let mut reply = format!("HTTP/1.1 {status} {}\r\n", reason(status));
        for (k, v) in identity {
            reply.push_str(&format!("{k}: {v}\r\n"));
        }
        reply.push_str("content-length: 0\r\n\r\n");
        if conn.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// The service's decision on one `authorization` value.
fn answer(authorization: &str) -> (u16, Vec<(&'static str, String)>) {
    let key = authorization.strip_prefix("Bearer ").unwrap_or_default();
    let caller =
        |tenant: String, id: String| vec![("x-tenant-id", tenant), ("x-credential-id", id)];
    let length = |n: &str| n.parse::<usize>().unwrap();
    if let Some(id) = key.strip_prefix("good-") {
        (200, caller("acme".into(), id.into()))
    } else if let Some(plan) = key.strip_prefix("plan-") {
        let mut headers = caller("acme".into(), format!("plan-{plan}"));
        headers.push(("x-plan", plan.into()));
        (200, headers)
    } else if let Some(n) = key.strip_prefix("long-tenant-") {
        (200, caller("t".repeat(length(n)), "long".into()))
    } else if let Some(n) = key.strip_prefix("long-id-") {
        (200, caller("acme".into(), "i".repeat(length(n))))
    } else if key == "forbidden" {
        (403, vec![])
    } else if key == "boom" {
        (500, vec![])
    } else {
        (401, vec![])
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        401 => "Unauthorized",
        403 => "Forbidden",
        _ => "Internal Server Error",
    }
}

/// A policy asking `url`, with `forward` appended to the `forward_auth`
/// block (`, headers: [...]` …); `timeout_ms` is a generous 2000 unless
/// `forward` names one. Routes: `/guarded/**` behind a pre-auth IP limit of
/// 5, `/tight/**` behind a per-credential limit of 1 (3 on plan `pro`),
/// everything else `r`; all forward to the echo upstream.
fn policy(url: &str, forward: &str, log: &Path) -> String {
    let forward = if forward.contains("timeout_ms") {
        forward.to_string()
    } else {
        format!("{forward}, timeout_ms: 2000")
    };
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", access_log: {{ path: "{log}" }} }}
plans: {{ pro: {{ tight: {{ capacity: 3, refill_per_second: 0.001 }} }} }}
auth:
  keys:
    - {{ id: local-1, tenant: local, sha256: "{local}" }}
  forward_auth: {{ url: "{url}", tenant_header: x-tenant-id, credential_header: x-credential-id, plan_header: x-plan{forward} }}
limits:
  guard: {{ scope: pre_auth, key: [ip], capacity: 5, refill_per_second: 0.001 }}
  tight: {{ key: [credential], capacity: 1, refill_per_second: 0.001 }}
upstreams:
  api: {{ servers: ["{{upstream}}"] }}
routes:
  - {{ name: guarded, path: "/guarded/**", upstream: api, limits: [guard] }}
  - {{ name: tight, path: "/tight/**", upstream: api, limits: [tight] }}
  - {{ name: r, path: "/**", upstream: api }}
"#,
        log = log.display(),
        local = digest(LOCAL_KEY),
    )
}

/// A gateway in front of an echo upstream, asking an [`AuthServer`].
struct Setup {
    auth: AuthServer,
    gw: Gateway,
    upstream: Upstream,
    dir: tempfile::TempDir,
}

fn start(forward: &str) -> Setup {
    let auth = AuthServer::start();
    let (gw, upstream, dir) = start_asking(&auth.url(), forward);
    Setup {
        auth,
        gw,
        upstream,
        dir,
    }
}

fn start_asking(url: &str, forward: &str) -> (Gateway, Upstream, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start();
    let text = policy(url, forward, &dir.path().join("access.jsonl"));
    (Gateway::start(&text, Some(&upstream)), upstream, dir)
}

fn some(value: &str) -> Option<String> {
    Some(value.to_string())
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

/// One request to `/v1/x` with `key`.
fn call(gw: &Gateway, key: &str) -> Reply {
    gw.get("/v1/x", &[("authorization", &bearer(key))])
}

fn assert_auth_unavailable(r: &Reply) {
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.json()["type"], "urn:tollgate:problem:auth-unavailable");
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
}

/// The sum of the series of `family` carrying every one of `labels`.
fn total(gw: &Gateway, family: &str, labels: &[&str]) -> f64 {
    gw.metrics()
        .lines()
        .filter(|l| {
            l.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn lookups(gw: &Gateway, result: &str) -> f64 {
    total(
        gw,
        "tollgate_auth_lookups_total",
        &["source=\"forward\"", &format!("result=\"{result}\"")],
    )
}

/// The access log's lines so far, once `n` are written.
fn log_lines(dir: &Path, n: usize) -> Vec<Value> {
    let path = dir.join("access.jsonl");
    let read = || -> Vec<Value> {
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    assert!(eventually(Duration::from_secs(5), || read().len() >= n));
    read()
}

#[test]
fn a_known_caller_is_asked_about_once_and_named_to_the_upstream() {
    let s = start("");
    for _ in 0..3 {
        let r = s.gw.get(
            "/v1/x",
            &[
                ("authorization", "Bearer good-u1"),
                ("x-tenant-id", "victim"),
                ("x-credential-id", "victim-ci"),
            ],
        );
        assert_eq!(r.status, 200, "{}", s.gw.log());
        assert_eq!(r.upstream_saw("x-tenant-id"), ["acme"]);
        assert_eq!(r.upstream_saw("x-credential-id"), ["fwd:u1"]);
    }
    assert_eq!(s.auth.calls(), 1);
    assert_eq!(s.upstream.hits(), 3);
}

#[test]
fn an_unknown_or_forbidden_caller_gets_401_and_is_remembered() {
    let s = start("");
    for key in ["bad-x", "forbidden"] {
        for _ in 0..3 {
            let r = call(&s.gw, key);
            assert_eq!(r.status, 401, "{key}: {r:?}");
            assert_eq!(r.json()["type"], "urn:tollgate:problem:unauthorized");
            assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        }
    }
    assert_eq!(s.auth.calls(), 2, "one call for each key");
    assert_eq!(s.upstream.hits(), 0);
}

#[test]
fn cached_answers_are_asked_again_once_their_ttl_ends() {
    let s = start(", cache_ttl_s: 1, negative_ttl_s: 1");
    assert_eq!(call(&s.gw, "good-a").status, 200);
    assert_eq!(call(&s.gw, "bad-b").status, 401);
    assert_eq!(s.auth.calls(), 2);
    assert!(eventually(Duration::from_secs(10), || {
        assert_eq!(call(&s.gw, "good-a").status, 200);
        s.auth.calls() == 3
    }));
    assert!(eventually(Duration::from_secs(10), || {
        assert_eq!(call(&s.gw, "bad-b").status, 401);
        s.auth.calls() == 4
    }));
}

#[test]
fn forty_concurrent_first_requests_share_one_call() {
    // The service answers only once all forty are in: the lookup's timeout
    // is far beyond the time they take to arrive on a slow machine.
    let s = start(", timeout_ms: 10000");
    s.auth.hold();
    let together = Barrier::new(40);
    // Every request read and found in no `auth.keys` entry: each is on its
    // way to the forward lookup, which is held unanswered.
    let unknown_to_the_file = || {
        s.gw.metric("tollgate_auth_lookups_total{result=\"miss\",source=\"file\"}")
    };
    let (statuses, all_in): (Vec<u16>, bool) = thread::scope(|scope| {
        let threads: Vec<_> = (0..40)
            .map(|_| {
                scope.spawn(|| {
                    together.wait();
                    call(&s.gw, "good-shared").status
                })
            })
            .collect();
        let all_in = eventually(Duration::from_secs(8), || unknown_to_the_file() >= 40.0);
        s.auth.release();
        let statuses: Vec<u16> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        (statuses, all_in)
    });
    assert!(
        all_in,
        "not all forty requests reached the gateway: {}",
        s.gw.metrics()
    );
    assert_eq!(statuses, [200; 40]);
    assert_eq!(s.auth.calls(), 1);
}

#[test]
fn a_service_that_refuses_connections_gets_503_auth_unavailable_every_time() {
    let closed = format!("http://127.0.0.1:{}/whoami", support::free_port());
    let (gw, upstream, _dir) = start_asking(&closed, "");
    for _ in 0..2 {
        assert_auth_unavailable(&call(&gw, "good-a"));
    }
    assert_eq!(upstream.hits(), 0);
    // Not remembered: both requests tried, and failed.
    assert_eq!(lookups(&gw, "error"), 2.0);
    assert_eq!(lookups(&gw, "cached"), 0.0);
    assert_eq!(
        gw.metric("tollgate_requests_total{outcome=\"auth_unavailable\",route=\"r\"}"),
        2.0
    );
    assert_eq!(
        gw.metric("tollgate_auth_failures_total{reason=\"unavailable\"}"),
        2.0
    );
}

#[test]
fn a_failing_service_is_asked_again_on_the_next_request() {
    let s = start("");
    for _ in 0..2 {
        assert_auth_unavailable(&call(&s.gw, "boom"));
    }
    assert_eq!(s.auth.calls(), 2);
    assert_eq!(s.upstream.hits(), 0);
}

#[test]
fn a_service_slower_than_timeout_ms_gets_503_and_is_not_remembered() {
    let s = start(", timeout_ms: 100");
    // The service says nothing until the gateway has given up on it.
    s.auth.hold();
    assert_auth_unavailable(&call(&s.gw, "good-slow"));
    s.auth.release();
    let r = call(&s.gw, "good-slow");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.upstream_saw("x-credential-id"), ["fwd:slow"]);
    assert_eq!(s.auth.calls(), 2);
}

#[test]
fn only_the_listed_headers_are_sent_to_the_service() {
    let s = start("");
    let r = s.gw.get(
        "/v1/x",
        &[
            ("authorization", "Bearer good-u2"),
            ("cookie", "session=s3cret"),
            ("x-other", "private"),
        ],
    );
    assert_eq!(r.status, 200);
    assert_eq!(s.auth.seen("authorization"), [some("Bearer good-u2")]);
    assert_eq!(s.auth.seen("cookie"), [None::<String>]);
    assert_eq!(s.auth.seen("x-other"), [None::<String>]);
}

#[test]
fn callers_differing_in_another_listed_header_are_looked_up_separately() {
    let s = start(", headers: [authorization, cookie]");
    let with_cookie = |cookie: &str| {
        s.gw.get(
            "/v1/x",
            &[("authorization", "Bearer good-c"), ("cookie", cookie)],
        )
        .status
    };
    assert_eq!(with_cookie("session=1"), 200);
    assert_eq!(with_cookie("session=2"), 200);
    assert_eq!(with_cookie("session=1"), 200);
    assert_eq!(with_cookie("session=2"), 200);
    assert_eq!(s.auth.calls(), 2);
    assert_eq!(
        s.auth.seen("cookie"),
        [some("session=1"), some("session=2")]
    );
    assert_eq!(
        s.auth.seen("authorization"),
        [some("Bearer good-c"), some("Bearer good-c")]
    );
}

#[test]
fn pre_auth_limits_bound_the_calls_a_flood_of_new_keys_makes() {
    let s = start("");
    let statuses: Vec<u16> = (0..20)
        .map(|i| {
            s.gw.get(
                "/guarded/x",
                &[("authorization", &bearer(&format!("bad-flood-{i}")))],
            )
            .status
        })
        .collect();
    let mut expected = vec![401u16; 5];
    expected.extend([429; 15]);
    assert_eq!(statuses, expected);
    assert!(s.auth.calls() <= 5, "{} calls", s.auth.calls());
}

#[test]
fn lookups_beyond_max_in_flight_get_503() {
    let s = start(", max_in_flight: 1");
    s.auth.hold();
    thread::scope(|scope| {
        let first = scope.spawn(|| call(&s.gw, "good-first"));
        assert!(eventually(Duration::from_secs(10), || s.auth.calls() == 1));
        // The first lookup is still waiting for its answer: no room.
        assert_auth_unavailable(&call(&s.gw, "good-second"));
        assert_eq!(s.auth.calls(), 1);
        s.auth.release();
        assert_eq!(first.join().unwrap().status, 200);
    });
    let r = call(&s.gw, "good-second");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.upstream_saw("x-credential-id"), ["fwd:second"]);
    assert_eq!(s.auth.calls(), 2);
}

#[test]
fn identity_values_longer_than_256_bytes_get_503() {
    let s = start("");
    let r = call(&s.gw, "long-tenant-256");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.upstream_saw("x-tenant-id"), ["t".repeat(256)]);
    assert_eq!(call(&s.gw, "long-tenant-257").status, 503);
    assert_eq!(call(&s.gw, "long-id-300").status, 503);
    assert_eq!(s.upstream.hits(), 1);
}

#[test]
fn a_plan_header_naming_a_plan_sets_the_limits_and_any_other_is_ignored() {
    let s = start("");
    let statuses = |key: &str| -> Vec<u16> {
        (0..4)
            .map(|_| {
                s.gw.get("/tight/x", &[("authorization", &bearer(key))])
                    .status
            })
            .collect()
    };
    assert_eq!(statuses("plan-pro"), [200, 200, 200, 429]);
    // `gold` is no plan of the policy: admitted, under the limit's own numbers.
    assert_eq!(statuses("plan-gold"), [200, 429, 429, 429]);
}

#[test]
fn a_key_of_auth_keys_never_asks_the_service() {
    let s = start("");
    for _ in 0..3 {
        let r = call(&s.gw, LOCAL_KEY);
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.upstream_saw("x-tenant-id"), ["local"]);
        assert_eq!(r.upstream_saw("x-credential-id"), ["local-1"]);
    }
    assert_eq!(s.auth.calls(), 0);
}

#[test]
fn lookups_are_counted_by_result_and_calls_are_timed() {
    let s = start("");
    let statuses: Vec<u16> = ["good-m", "good-m", "bad-m", "bad-m", "boom", LOCAL_KEY]
        .iter()
        .map(|key| call(&s.gw, key).status)
        .collect();
    assert_eq!(statuses, [200, 200, 401, 401, 503, 200]);
    assert_eq!(s.auth.calls(), 3);
    assert_eq!(lookups(&s.gw, "hit"), 1.0);
    assert_eq!(lookups(&s.gw, "miss"), 1.0);
    assert_eq!(lookups(&s.gw, "cached"), 2.0);
    assert_eq!(lookups(&s.gw, "error"), 1.0);
    assert_eq!(
        total(&s.gw, "tollgate_forward_auth_seconds_count", &[]),
        3.0
    );
    assert_eq!(
        s.gw.metric("tollgate_requests_total{outcome=\"auth_unavailable\",route=\"r\"}"),
        1.0
    );
    assert_eq!(
        s.gw.metric("tollgate_auth_failures_total{reason=\"unavailable\"}"),
        1.0
    );
}

#[test]
fn the_access_log_names_the_forward_source() {
    let s = start("");
    assert_eq!(call(&s.gw, "good-logged").status, 200);
    assert_eq!(call(&s.gw, LOCAL_KEY).status, 200);
    let lines = log_lines(s.dir.path(), 2);
    let who: Vec<_> = lines
        .iter()
        .map(|l| {
            (
                l["credential"].as_str().unwrap_or_default(),
                l["tenant"].as_str().unwrap_or_default(),
                l["auth_source"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        who,
        [
            ("fwd:logged", "acme", "forward"),
            ("local-1", "local", "file")
        ]
    );
}

/// The book's worked example (docs/src/forward-auth.md): `examples/forward-auth/whoami.py` as the
/// existing service, `examples/forward-auth/tollgate.yaml` in front.
#[test]
fn the_worked_example_identifies_callers_by_the_existing_service() {
    let port = support::free_port();
    let mut service = std::process::Command::new("python3")
        .arg("examples/forward-auth/whoami.py")
        .arg(port.to_string())
        .spawn()
        .expect("start whoami.py");
    let up = eventually(Duration::from_secs(10), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let policy = std::fs::read_to_string("examples/forward-auth/tollgate.yaml")
        .unwrap()
        .replace("127.0.0.1:8080", "{listen}")
        .replace("127.0.0.1:9090", "{admin}")
        .replace("127.0.0.1:8000", &format!("127.0.0.1:{port}"));
    let gw = Gateway::start(&policy, None);
    let statuses = |key: &str, n: usize| -> Vec<u16> {
        let auth = format!("Bearer {key}");
        (0..n)
            .map(|_| gw.get("/v1/hello", &[("authorization", &auth)]).status)
            .collect()
    };
    let pro = statuses("sk_live_acme_1", 6);
    let free = statuses("sk_live_globex_7", 6);
    let unknown = statuses("sk_live_nobody", 2);
    let _ = service.kill();
    let _ = service.wait();
    assert!(up, "whoami.py did not start");
    // The pro plan's per-credential capacity is 20, the default's 5.
    assert_eq!(pro, [200; 6]);
    assert_eq!(free, [200, 200, 200, 200, 200, 429]);
    assert_eq!(unknown, [401, 401]);
    assert_eq!(
        gw.metric("tollgate_auth_lookups_total{result=\"hit\",source=\"forward\"}"),
        2.0
    );
}

#[test]
fn a_stalled_store_leaves_callers_to_forward_auth_on_an_open_route() {
    let redis = support::redis_server::RedisServer::start();
    let auth = AuthServer::start();
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start();
    let text = policy(&auth.url(), "", &dir.path().join("access.jsonl"))
        .replace(
            "auth:\n",
            &format!("store: {}\nauth:\n  store_keys: {{ cache_entries: 100 }}\n", redis.store(50)),
        )
        .replace(
            "limits:\n",
            "limits:\n  open: { key: [credential], capacity: 100, refill_per_second: 1, on_store_error: open }\n",
        )
        .replace(
            "  - { name: r, path: \"/**\", upstream: api }",
            "  - { name: r, path: \"/**\", upstream: api, limits: [open] }",
        );
    let secret = [("TOLLGATE_KEY_SECRET", "forward-auth-secret-7f3a")];
    let gw = Gateway::start_with_env(&text, Some(&upstream), &secret);
    assert_eq!(call(&gw, "good-before").status, 200);
    // The store answers nothing now: the store's credentials cannot be
    // read, and the route's only limit admits while the store is down.
    redis.pause();
    for i in 0..3 {
        let r = call(&gw, &format!("good-new-{i}"));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.upstream_saw("x-credential-id"), [format!("fwd:new-{i}")]);
    }
    assert_eq!(call(&gw, "good-before").status, 200);
    // A key the service refuses may still be the store's: no source that
    // could answer named it.
    assert_auth_unavailable(&call(&gw, "nobody"));
    redis.resume();
}
