//! The controls beyond rate, through the real binary: load shedding by
//! priority.

mod support;

use std::thread;
use std::time::Duration;

use support::{get, Gateway, Upstream};

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
