//! A pool's queue shared fairly between tenants (`queue.fair: tenant`,
//! `queue.per_tenant_max`), through the binary: one tenant's burst neither
//! starves another's request nor fills the queue.

mod support;

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use support::{digest, eventually, Gateway, Upstream};

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
    let finished = Arc::new(Mutex::new(Vec::new()));
    let send = |who: &'static str| {
        let (addr, finished) = (gw.addr, finished.clone());
        thread::spawn(move || {
            let auth = format!("Bearer key-{who}");
            let status = support::get(addr, "/slow", &[("authorization", &auth)]).status;
            finished.lock().unwrap().push((who, status));
        })
    };
    // Tenant a: one in flight, up to twenty waiting, and the rest refused
    // at once (per_tenant_max) rather than filling the queue.
    let burst: Vec<_> = (0..30).map(|_| send("a")).collect();
    assert!(eventually(Duration::from_secs(20), || {
        finished.lock().unwrap().iter().any(|(_, s)| *s == 503)
    }));
    // Tenant b's one request still queues, behind a's, and is served
    // within one turn.
    let b = send("b");
    b.join().unwrap();
    for t in burst {
        t.join().unwrap();
    }
    let finished = finished.lock().unwrap();
    let served: Vec<_> = finished
        .iter()
        .filter(|(_, s)| *s == 200)
        .map(|(w, _)| *w)
        .collect();
    let refused = finished.iter().filter(|(_, s)| *s == 503).count();
    assert_eq!(served.len() + refused, 31, "{finished:?}");
    assert!(
        served.len() >= 21,
        "a's twenty waiters and b were served: {finished:?}"
    );
    let b_at = served.iter().position(|w| *w == "b").unwrap();
    assert!(b_at <= 3, "b finished {b_at}th of {served:?}");
}
