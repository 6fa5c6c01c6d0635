//! The controls beyond rate, through the real binary: load shedding by
//! priority, calendar quotas.

mod support;

use std::sync::Barrier;
use std::thread;
use std::time::Duration;

use support::redis_server::{RedisCluster, RedisServer};
use support::{digest, get, Gateway, Upstream};
use tollgate::limits::algorithm::Period;

/// Runs `clients` threads each sending `each` requests to `path` one after
/// the other; returns the statuses.
fn load(
    gw: &Gateway,
    path: &'static str,
    clients: usize,
    each: usize,
) -> thread::JoinHandle<Vec<u16>> {
    let addr = gw.addr;
    thread::spawn(move || {
        let threads: Vec<_> = (0..clients)
            .map(|_| {
                thread::spawn(move || {
                    (0..each)
                        .map(|_| get(addr, path, &[]).status)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    })
}

#[test]
fn a_saturated_pool_sheds_sheddable_traffic_and_keeps_critical_going() {
    // Every request holds its permit 100 ms; four permits, two of them
    // reserved for critical routes, and a queue of two.
    let upstream = Upstream::slow(Duration::from_millis(100));
    let gw = Gateway::start(
        r#"
version: 1
server: { listen: ["{listen}"], admin_listen: "{admin}", threads: 2 }
upstreams:
  api: { servers: ["{upstream}"], max_in_flight: 4, reserve: { critical: 0.5 }, queue: { max_waiting: 2, timeout_ms: 5000 } }
routes:
  - { name: checkout, path: "/slow/checkout", auth: none, upstream: api, priority: critical }
  - { name: search, path: "/slow/search", auth: none, upstream: api, priority: sheddable }
"#,
        Some(&upstream),
    );
    // Eight sheddable clients want twice what the pool has; two critical
    // clients always find a reserved permit.
    let search = load(&gw, "/slow/search", 8, 10);
    let checkout = load(&gw, "/slow/checkout", 2, 10);
    let (search, checkout) = (search.join().unwrap(), checkout.join().unwrap());
    assert_eq!(
        checkout,
        vec![200; 20],
        "critical traffic keeps its throughput"
    );
    let shed = search.iter().filter(|&&s| s == 503).count();
    assert!(shed > 0, "sheddable traffic is refused first: {search:?}");
    assert!(search.iter().all(|&s| s == 200 || s == 503), "{search:?}");
    assert_eq!(
        gw.metric("tollgate_pool_rejections_total{pool=\"api\",priority=\"sheddable\"}"),
        shed as f64
    );
    assert_eq!(
        gw.metric("tollgate_pool_rejections_total{pool=\"api\",priority=\"critical\"}"),
        0.0
    );
    assert!(upstream.max_in_flight() <= 4);
}

/// A monthly quota of 3 for tenant acme (plan free) and of 5 for tenant
/// bigco (plan pro), in `store`.
fn quota_policy(store: &str) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1, admin_token_env: CONTROLS_ADMIN_TOKEN }}
store: {store}
auth:
  keys:
    - {{ id: c1, tenant: acme, plan: free, sha256: "{}" }}
    - {{ id: c2, tenant: bigco, plan: pro, sha256: "{}" }}
plans:
  free: {{}}
  pro: {{ monthly: {{ limit: 5 }} }}
limits:
  monthly: {{ algorithm: quota, key: [tenant], limit: 3, period: month }}
routes:
  - {{ name: api, path: "/**", respond: {{ status: 200, body: "ok" }}, limits: [monthly] }}
responses: {{ ratelimit_headers: draft }}
"#,
        digest("key-c1"),
        digest("key-c2")
    )
}

fn usage(gw: &Gateway, query: &str) -> support::Reply {
    get(
        gw.admin,
        &format!("/admin/usage?{query}"),
        &[("authorization", "Bearer usage-token")],
    )
}

fn assert_quota(gw: &Gateway) {
    let acme = [("authorization", "Bearer key-c1")];
    for left in [2, 1, 0] {
        let r = gw.get("/x", &acme);
        assert_eq!(r.status, 200);
        let field = r.header("ratelimit").unwrap().to_string();
        assert!(
            field.starts_with(&format!("\"monthly\";r={left};t=")),
            "{field}"
        );
    }
    let refused = gw.get("/x", &acme);
    assert_eq!(refused.status, 429);
    // Retry when the month turns: within 31 days.
    let retry: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=31 * 86_400).contains(&retry), "{retry}");

    let now_ms = tollgate::clock::wall()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let r = usage(gw, "limit=monthly&tenant=acme");
    assert_eq!(r.status, 200, "{}", r.body);
    let u = r.json();
    assert_eq!(u["period"], Period::Month.name(now_ms));
    assert_eq!(
        (
            u["quota"].as_u64(),
            u["used"].as_u64(),
            u["remaining"].as_u64()
        ),
        (Some(3), Some(3), Some(0))
    );
    assert!(
        u["period_end"].as_str().unwrap().ends_with("-01T00:00:00Z"),
        "{u}"
    );
    // The pro plan's quota, untouched.
    let u = usage(gw, "limit=monthly&tenant=bigco").json();
    assert_eq!(
        (u["quota"].as_u64(), u["used"].as_u64()),
        (Some(5), Some(0))
    );
    // Reading usage charges nothing.
    let u = usage(gw, "limit=monthly&tenant=bigco").json();
    assert_eq!(u["remaining"].as_u64(), Some(5));
    assert_eq!(usage(gw, "limit=nope&tenant=acme").status, 404);
    assert_eq!(usage(gw, "limit=monthly").status, 400);
    let anonymous = get(gw.admin, "/admin/usage?limit=monthly&tenant=acme", &[]);
    assert_eq!(anonymous.status, 401);
}

const ADMIN: (&str, &str) = ("CONTROLS_ADMIN_TOKEN", "usage-token");
const SECRET: (&str, &str) = ("TOLLGATE_KEY_SECRET", "controls-secret-5d1e");

/// Store calls may take this long: a loaded machine must not turn a slow
/// call into a store failure (a 503, or an open admission). These tests are
/// about what decisions say, not how fast.
const STORE_TIMEOUT_MS: u64 = 2000;

#[test]
fn a_monthly_quota_counts_and_reports_usage_in_memory() {
    let gw = Gateway::start_with_env(&quota_policy("{ backend: memory }"), None, &[ADMIN]);
    assert_quota(&gw);
}

#[test]
fn a_monthly_quota_counts_and_reports_usage_in_redis() {
    let redis = RedisServer::start();
    let store = redis.store(STORE_TIMEOUT_MS);
    let gw = Gateway::start_with_env(&quota_policy(&store), None, &[ADMIN, SECRET]);
    assert_quota(&gw);
    // The key lives until the month ends (and a margin), no longer.
    // (bigco's key, never charged, lives a second after each read.)
    let keys = redis.keys();
    assert!((1..=2).contains(&keys.len()), "{keys:?}");
    for k in keys {
        let ttl: i64 = redis.cmd(&["PTTL", &k]).unwrap();
        assert!(ttl > 0 && ttl <= 31 * 86_400_000 + 1_000, "{k}: {ttl}");
    }
}

#[test]
fn a_monthly_quota_counts_and_reports_usage_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let store = cluster.store(STORE_TIMEOUT_MS);
    let gw = Gateway::start_with_env(&quota_policy(&store), None, &[ADMIN, SECRET]);
    assert_quota(&gw);
}

/// A route behind a GCRA of 10 a second (burst 1) that delays up to a
/// second, in `store`.
fn delay_policy(store: &str) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 2 }}
store: {store}
limits:
  smooth: {{ key: [], algorithm: gcra, capacity: 1, refill_per_second: 10, on_limit: delay, max_delay_ms: 1000, on_store_error: open }}
routes:
  - {{ name: api, path: "/**", auth: none, respond: {{ status: 200, body: "ok" }}, limits: [smooth] }}
"#
    )
}

/// Requests faster than the rate: none is lost within the delay bound,
/// and the gateway holds them (decided `delayed`) instead of refusing them.
/// Then a burst beyond the bound: what the schedule cannot fit within a
/// second is refused at once. (When each delayed request goes out is the
/// decision's arithmetic, tested in the algorithm's and the limiter's unit
/// tests on a clock moved by hand; here only outcomes are asserted.)
fn assert_smoothed(gw: &Gateway) {
    let addr = gw.addr;
    // Twelve requests from three clients that start together, each sending
    // its next request as soon as its last is answered: three in line at
    // once where the rate lets one through every 100 ms. Each client waits
    // for the gateway's answer, not a guessed pace, so the line is never
    // longer than three, and no request waits more than about 300 ms of the
    // 1000 ms bound however slow the machine.
    let start = Barrier::new(3);
    let replies: Vec<u16> = thread::scope(|scope| {
        let clients: Vec<_> = (0..3)
            .map(|_| {
                scope.spawn(|| {
                    start.wait();
                    (0..4)
                        .map(|_| get(addr, "/x", &[]).status)
                        .collect::<Vec<u16>>()
                })
            })
            .collect();
        clients
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect()
    });
    assert!(replies.iter().all(|s| *s == 200), "none lost: {replies:?}");
    let decided = |outcome: &str| {
        gw.metric(&format!(
            "tollgate_limit_decisions_total{{limit=\"smooth\",outcome=\"{outcome}\"}}"
        ))
    };
    assert!(decided("delayed") >= 1.0);
    assert_eq!(decided("delayed") + decided("allowed"), 12.0);

    // Thirty at once (released together once all are ready): about eleven
    // fit the next second, the rest get 429.
    let at_once = Barrier::new(30);
    let statuses: Vec<u16> = thread::scope(|scope| {
        let burst: Vec<_> = (0..30)
            .map(|_| {
                scope.spawn(|| {
                    at_once.wait();
                    get(addr, "/x", &[]).status
                })
            })
            .collect();
        burst.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert!(
        statuses.iter().all(|&s| s == 200 || s == 429),
        "{statuses:?}"
    );
    assert!(statuses.contains(&429), "{statuses:?}");
}

#[test]
fn delayed_requests_come_out_at_the_rate_in_memory() {
    let gw = Gateway::start(&delay_policy("{ backend: memory }"), None);
    assert_smoothed(&gw);
}

#[test]
fn delayed_requests_come_out_at_the_rate_in_redis() {
    let redis = RedisServer::start();
    let store = redis.store(STORE_TIMEOUT_MS);
    let gw = Gateway::start_with_env(&delay_policy(&store), None, &[SECRET]);
    assert_smoothed(&gw);
}

/// A chat route charged 100 at admission and then what the upstream
/// reports in `x-usage-tokens` (at most 10 000), against a per-tenant
/// budget of 1000 that does not refill while the test runs.
fn usage_policy(store: &str) -> String {
    format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}", threads: 1 }}
store: {store}
auth:
  keys:
    - {{ id: c1, tenant: acme, sha256: "{}" }}
    - {{ id: c2, tenant: bigco, sha256: "{}" }}
limits:
  tokens: {{ key: [tenant], capacity: 1000, refill_per_second: 0.001, on_store_error: open }}
upstreams:
  llm: {{ servers: ["{{upstream}}"] }}
routes:
  - name: chat
    path: "/v1/chat"
    upstream: llm
    cost: 100
    cost_from_response: {{ header: x-usage-tokens, max: 10000 }}
    limits: [tokens]
  - name: chat-big
    path: "/v1/chat/big"
    upstream: llm
    cost: 100
    cost_from_response: {{ header: x-usage-tokens, max: 10000 }}
    limits: [tokens]
  - name: chat-slow
    path: "/slow/chat"
    upstream: llm
    cost: 100
    cost_from_response: {{ header: x-usage-tokens, max: 10000 }}
    limits: [tokens]
  - name: chat-visible
    path: "/v1/chat-visible"
    upstream: llm
    cost: 100
    cost_from_response: {{ header: x-usage-tokens, max: 10000, expose: true }}
    limits: [tokens]
responses: {{ ratelimit_headers: draft }}
"#,
        digest("key-c1"),
        digest("key-c2")
    )
}

fn chat(gw: &Gateway, key: &str, usage: u64) -> support::Reply {
    let auth = format!("Bearer {key}");
    gw.get(
        "/v1/chat",
        &[
            ("authorization", auth.as_str()),
            ("x-reply-usage", &usage.to_string()),
        ],
    )
}

/// The `RateLimit` field of the `tokens` limit: `remaining` exactly, and
/// the reset at most `reset_secs` (the budget refills a token every 1000 s,
/// so a second or two of test time may take a second off it).
fn assert_rate(reply: &support::Reply, remaining: u64, reset_secs: u64) {
    let field = reply.header("ratelimit").expect("a RateLimit field");
    let prefix = format!("\"tokens\";r={remaining};t=");
    let t: u64 = field
        .strip_prefix(&prefix)
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{field}"));
    assert!((reset_secs - 5..=reset_secs).contains(&t), "{field}");
}

fn assert_costs_settled(gw: &Gateway) {
    let settled = |direction: &str, n: f64| {
        let series =
            format!("tollgate_cost_reconciled_total{{direction=\"{direction}\",route=\"chat\"}}");
        assert!(
            support::eventually(Duration::from_secs(5), || gw.metric(&series) == n),
            "{series} never reached {n}"
        );
    };
    // Far above the estimate: 800 more once the response is in.
    let r = chat(gw, "key-c1", 900);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-usage-tokens"), None, "not exposed");
    assert_rate(&r, 900, 100_000);
    settled("charged", 1.0);
    // 2000 reported against the 100 left: the balance goes into debt, all
    // of it (-1900: the default bound is 10 x (max - cost)), and later
    // requests wait for it.
    assert_eq!(chat(gw, "key-c1", 2000).status, 200);
    settled("charged", 2.0);
    let refused = chat(gw, "key-c1", 100);
    assert_eq!(refused.status, 429);
    // 2000 tokens short (the debt and the cost) at 0.001 a second.
    assert_eq!(refused.header("retry-after"), Some("2000000"));

    // Far below the estimate: 90 of the 100 come back.
    assert_eq!(chat(gw, "key-c2", 10).status, 200);
    settled("refunded", 1.0);
    let r = chat(gw, "key-c2", 100);
    assert_rate(&r, 890, 110_000);
    // Exposed where the route says so.
    let visible = gw.get(
        "/v1/chat-visible",
        &[("authorization", "Bearer key-c2"), ("x-reply-usage", "100")],
    );
    assert_eq!(visible.header("x-usage-tokens"), Some("100"));
}

#[test]
fn costs_reported_by_the_response_are_settled_in_memory() {
    let upstream = Upstream::start();
    let gw = Gateway::start(&usage_policy("{ backend: memory }"), Some(&upstream));
    assert_costs_settled(&gw);
}

#[test]
fn a_cost_too_large_to_hold_is_max_and_of_several_the_largest_is_charged() {
    let upstream = Upstream::start();
    let gw = Gateway::start(&usage_policy("{ backend: memory }"), Some(&upstream));
    let charged = |n: f64| {
        let series = "tollgate_cost_reconciled_total{direction=\"charged\",route=\"chat\"}";
        assert!(
            support::eventually(Duration::from_secs(5), || gw.metric(series) == n),
            "{series} never reached {n}"
        );
    };
    let chat_reporting = |key: &str, usage: &str| {
        let auth = format!("Bearer {key}");
        gw.get(
            "/v1/chat",
            &[("authorization", auth.as_str()), ("x-reply-usage", usage)],
        )
    };
    // More than a u64: settled at max (10 000), 9 900 beyond the estimate,
    // where it used to be the estimate alone.
    let huge = chat_reporting("key-c1", "99999999999999999999999");
    assert_eq!(huge.status, 200);
    charged(1.0);
    let refused = chat(&gw, "key-c1", 100);
    assert_eq!(refused.status, 429, "the balance is 1000 - 10 000");
    // 9 000 in debt and the next cost, at 0.001 a second.
    assert_eq!(refused.header("retry-after"), Some("9100000"));

    // Two values: the larger, 2000, where the list used to be unreadable.
    let two = chat_reporting("key-c2", "5, 2000");
    assert_eq!(two.status, 200);
    charged(2.0);
    let refused = chat(&gw, "key-c2", 100);
    assert_eq!(refused.status, 429, "the balance is 1000 - 2000");
    assert_eq!(refused.header("retry-after"), Some("1100000"));
}

#[test]
fn a_response_abandoned_or_unreported_is_settled_at_max_or_the_estimate() {
    use std::io::{Read, Write};
    let upstream = Upstream::start();
    let gw = Gateway::start(&usage_policy("{ backend: memory }"), Some(&upstream));
    let series = |route: &str, direction: &str| {
        format!("tollgate_cost_reconciled_total{{direction=\"{direction}\",route=\"{route}\"}}")
    };
    // Completed without the header: the estimate stands, counted missing.
    let r = gw.get("/v1/chat", &[("authorization", "Bearer key-c2")]);
    assert_eq!(r.status, 200);
    assert!(support::eventually(Duration::from_secs(5), || {
        gw.metric(&series("chat", "missing")) == 1.0
    }));
    assert_rate(
        &gw.get("/v1/chat", &[("authorization", "Bearer key-c2")]),
        800,
        200_000,
    );

    // A client that reads part of a long answer (64 MiB, its cost never
    // reported in time) and hangs up pays the max: 9900 more.
    let mut stream = support::connect(gw.addr, None);
    stream
        .write_all(b"GET /v1/chat/big HTTP/1.1\r\nhost: t\r\nauthorization: Bearer key-c1\r\n\r\n")
        .unwrap();
    let mut part = vec![0; 256 * 1024];
    stream.read_exact(&mut part).unwrap();
    assert!(part.starts_with(b"HTTP/1.1 200"));
    drop(stream);
    assert!(
        support::eventually(Duration::from_secs(10), || {
            gw.metric(&series("chat-big", "charged")) == 1.0
        }),
        "the abandoned answer was settled"
    );
    assert_eq!(gw.metric(&series("chat-big", "missing")), 0.0);
    let refused = chat(&gw, "key-c1", 100);
    assert_eq!(refused.status, 429);
    // 1000 - 100 - 9900 = -9000: 9100 short at 0.001 a second.
    assert_eq!(refused.header("retry-after"), Some("9100000"));
}

#[test]
fn a_client_that_leaves_before_the_answer_pays_the_max() {
    use std::io::Write;
    use std::sync::atomic::Ordering;
    let upstream = Upstream::slow(Duration::from_secs(3));
    let gw = Gateway::start(&usage_policy("{ backend: memory }"), Some(&upstream));
    let mut stream = support::connect(gw.addr, None);
    stream
        .write_all(b"GET /slow/chat HTTP/1.1\r\nhost: t\r\nauthorization: Bearer key-c2\r\n\r\n")
        .unwrap();
    // Gone while the upstream works on it.
    assert!(support::eventually(Duration::from_secs(5), || {
        upstream.state.in_flight.load(Ordering::SeqCst) == 1
    }));
    drop(stream);
    let series = "tollgate_cost_reconciled_total{direction=\"charged\",route=\"chat-slow\"}";
    assert!(
        support::eventually(Duration::from_secs(10), || gw.metric(series) == 1.0),
        "the abandoned request was settled at its max"
    );
}

#[test]
fn costs_reported_by_the_response_are_settled_in_redis() {
    let redis = RedisServer::start();
    let upstream = Upstream::start();
    let store = redis.store(STORE_TIMEOUT_MS);
    let gw = Gateway::start_with_env(&usage_policy(&store), Some(&upstream), &[SECRET]);
    assert_costs_settled(&gw);
}
