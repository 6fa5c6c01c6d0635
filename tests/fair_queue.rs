//! A pool's queue shared fairly between tenants (`queue.fair: tenant`,
//! `queue.per_tenant_max`), through the binary: one tenant's burst neither
//! starves another's request nor fills the queue, and callers without a
//! credential take their turns by client network.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use support::{digest, eventually, Gateway, Upstream};

type Headers = &'static [(&'static str, &'static str)];

/// Thirty requests of caller `a` at once, then, once one of them has been
/// refused, one request of caller `b`: every answer, by caller, in the
/// order they finished.
fn burst_then_one(addr: SocketAddr, a: Headers, b: Headers) -> Vec<(&'static str, u16)> {
    let finished = Arc::new(Mutex::new(Vec::new()));
    let send = |who: &'static str, headers: Headers| {
        let finished = finished.clone();
        thread::spawn(move || {
            let status = support::get(addr, "/slow", headers).status;
            finished.lock().unwrap().push((who, status));
        })
    };
    let burst: Vec<_> = (0..30).map(|_| send("a", a)).collect();
    assert!(eventually(Duration::from_secs(20), || {
        finished.lock().unwrap().iter().any(|(_, s)| *s == 503)
    }));
    send("b", b).join().unwrap();
    for t in burst {
        t.join().unwrap();
    }
    let finished = finished.lock().unwrap().clone();
    finished
}

/// The callers answered 200, in the order they finished.
fn served(finished: &[(&'static str, u16)]) -> Vec<&'static str> {
    finished
        .iter()
        .filter(|(_, s)| *s == 200)
        .map(|(w, _)| *w)
        .collect()
}

#[test]
fn a_tenants_burst_neither_starves_nor_shuts_out_another() {
    // Each request holds the pool's one permit for 400 ms.
    let upstream = Upstream::slow(Duration::from_millis(400));
    let policy = format!(
        r#"
version: 1
server: {{ listen: ["{{listen}}"], admin_listen: "{{admin}}" }}
auth:
  keys:
    - {{ id: a-1, tenant: tenant-a, sha256: "{}" }}
    - {{ id: b-1, tenant: tenant-b, sha256: "{}" }}
upstreams:
  api:
    servers: ["{{upstream}}"]
    max_in_flight: 1
    queue: {{ max_waiting: 100, timeout_ms: 30000, fair: tenant, per_tenant_max: 20 }}
routes:
  - {{ name: api, path: "/**", upstream: api }}
"#,
        digest("key-a"),
        digest("key-b")
    );
    let gw = Gateway::start(&policy, Some(&upstream));
    // Tenant a: one in flight, up to twenty waiting, and the rest refused
    // at once (per_tenant_max) rather than filling the queue. Tenant b's
    // one request still queues, behind a's, and is served within one turn.
    let finished = burst_then_one(
        gw.addr,
        &[("authorization", "Bearer key-a")],
        &[("authorization", "Bearer key-b")],
    );
    let served = served(&finished);
    let refused = finished.iter().filter(|(_, s)| *s == 503).count();
    assert_eq!(served.len() + refused, 31, "{finished:?}");
    assert!(
        served.len() >= 21,
        "a's twenty waiters and b were served: {finished:?}"
    );
    let b_at = served.iter().position(|w| *w == "b").unwrap();
    assert!(b_at <= 3, "b finished {b_at}th of {served:?}");
}

#[test]
fn anonymous_callers_take_turns_by_client_network() {
    // An `auth: none` route behind a trusted proxy: each request holds the
    // pool's one permit for 400 ms, and its client is the forwarded one.
    let upstream = Upstream::slow(Duration::from_millis(400));
    let policy = r#"
version: 1
server: { listen: ["{listen}"], admin_listen: "{admin}" }
client_ip: { trusted_proxies: ["127.0.0.1/32"], header: x-forwarded-for }
upstreams:
  api:
    servers: ["{upstream}"]
    max_in_flight: 1
    queue: { max_waiting: 100, timeout_ms: 30000, fair: tenant, per_tenant_max: 20 }
routes:
  - { name: open, path: "/**", upstream: api, auth: none }
"#;
    let gw = Gateway::start(policy, Some(&upstream));
    // One client's burst: one in flight, twenty waiting, the rest refused
    // at once, as a tenant's would be. Another client's one request is its
    // own party: it queues, and is served within one turn rather than
    // behind the whole burst (or refused with it).
    let finished = burst_then_one(
        gw.addr,
        &[("x-forwarded-for", "198.51.100.7")],
        &[("x-forwarded-for", "192.0.2.44")],
    );
    let refused = finished
        .iter()
        .filter(|(w, s)| *w == "a" && *s == 503)
        .count();
    assert!(
        refused >= 9,
        "a beyond per_tenant_max refused: {finished:?}"
    );
    let served = served(&finished);
    let b_at = served.iter().position(|w| *w == "b").unwrap();
    assert!(b_at <= 3, "b finished {b_at}th of {served:?}");
}
