//! Pools without an upstream: round robin over healthy servers, permits
//! bounded, queued and released by drop, and resizing on reload.

use super::*;
use std::time::Duration;

fn upstream(servers: &[&str], max_in_flight: u32, max_waiting: u32, wait_ms: u64) -> Upstream {
    Upstream {
        name: "api".into(),
        servers: servers.iter().map(|s| s.parse().unwrap()).collect(),
        max_in_flight,
        queue_max_waiting: max_waiting,
        queue_timeout: Duration::from_millis(wait_ms),
        connect_timeout: Duration::from_secs(1),
        read_timeout: Duration::from_secs(1),
        retries: 2,
        server_names: servers.iter().map(|s| s.to_string()).collect(),
        host_header: crate::config::HostHeader::Preserve,
        tls: None,
        protocol: crate::config::UpstreamProtocol::Http1,
        health: None,
        reserved_critical: 0,
    }
}

fn pool(def: &Upstream) -> (Arc<Pool>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let pools = Pools::new(metrics.clone());
    (
        pools.reconcile(std::slice::from_ref(def)).remove(0),
        metrics,
    )
}

#[test]
fn healthy_servers_take_turns() {
    let (p, _) = pool(&upstream(
        &["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"],
        1,
        0,
        0,
    ));
    let picks: Vec<u16> = (0..3).map(|_| p.pick().unwrap().port()).collect();
    assert_eq!(picks, [1, 2, 3]);
    let servers = p.servers();
    // Two failed checks take server 2 out; one good check brings it back.
    assert_eq!(servers[1].record_check(false, 1, 2), None);
    assert_eq!(servers[1].record_check(false, 1, 2), Some(false));
    let picks: Vec<u16> = (0..4).map(|_| p.pick().unwrap().port()).collect();
    assert!(!picks.contains(&2), "{picks:?}");
    assert_eq!(servers[1].record_check(true, 1, 2), Some(true));
    for s in servers.iter() {
        s.record_check(false, 1, 1);
    }
    assert_eq!(p.pick(), Err(PoolRefusal::NoHealthyServer));
}

#[tokio::test(start_paused = true)]
async fn permits_are_bounded_queued_and_released_by_drop() {
    let (p, metrics) = pool(&upstream(&["127.0.0.1:1"], 2, 1, 50));
    let a = p.admit(Priority::Normal).await.unwrap();
    let _b = p.admit(Priority::Normal).await.unwrap();
    assert_eq!(metrics.pool_in_flight.with_label_values(&["api"]).get(), 2);
    // The third waits in the queue and gets a permit when one is dropped.
    let waiter = {
        let p = p.clone();
        tokio::spawn(async move { p.admit(Priority::Normal).await.map(drop) })
    };
    tokio::task::yield_now().await;
    // The queue holds one: a fourth is refused at once.
    tokio::time::advance(Duration::from_millis(5)).await;
    assert_eq!(metrics.pool_waiting.with_label_values(&["api"]).get(), 1);
    assert_eq!(
        p.admit(Priority::Normal).await.err(),
        Some(PoolRefusal::Saturated)
    );
    drop(a);
    assert_eq!(waiter.await.unwrap().err(), None);
    // With nothing released, a waiter times out (paused time jumps to the
    // timeout once nothing else can run).
    let _c = p.admit(Priority::Normal).await.unwrap();
    assert_eq!(
        p.admit(Priority::Normal).await.err(),
        Some(PoolRefusal::Saturated)
    );
    assert_eq!(
        metrics
            .pool_rejections
            .with_label_values(&["api", "normal"])
            .get(),
        2
    );
    drop(_c);
    drop(_b);
    assert_eq!(metrics.pool_in_flight.with_label_values(&["api"]).get(), 0);
    assert_eq!(metrics.pool_waiting.with_label_values(&["api"]).get(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_reload_resizes_the_pool_in_place() {
    let metrics = Arc::new(Metrics::new());
    let pools = Pools::new(metrics);
    let first = pools
        .reconcile(&[upstream(&["127.0.0.1:1"], 1, 0, 0)])
        .remove(0);
    let held = first.admit(Priority::Normal).await.unwrap();
    let bigger = pools
        .reconcile(&[upstream(&["127.0.0.1:1"], 3, 0, 0)])
        .remove(0);
    assert!(Arc::ptr_eq(&first, &bigger), "the same pool, resized");
    let more = [
        bigger.admit(Priority::Normal).await.unwrap(),
        bigger.admit(Priority::Normal).await.unwrap(),
    ];
    assert!(
        bigger.admit(Priority::Normal).await.is_err(),
        "3 in flight, including the one from before"
    );
    // Shrinking to 1 while 3 are in flight: nothing new until two finish.
    let smaller = pools
        .reconcile(&[upstream(&["127.0.0.1:1"], 1, 0, 0)])
        .remove(0);
    drop(held);
    tokio::task::yield_now().await;
    assert!(smaller.admit(Priority::Normal).await.is_err());
    drop(more);
    // Lets the task that takes back the owed permits run.
    tokio::time::advance(Duration::from_millis(10)).await;
    let only = smaller.admit(Priority::Normal).await.unwrap();
    assert!(smaller.admit(Priority::Normal).await.is_err());
    drop(only);
}

/// Starts waiting for a permit of `priority` in the background.
fn waiter(
    p: &Arc<Pool>,
    priority: Priority,
) -> tokio::task::JoinHandle<Result<PoolPermit, PoolRefusal>> {
    let p = p.clone();
    tokio::spawn(async move { p.admit(priority).await })
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_by_priority_and_the_lowest_is_displaced() {
    let (p, metrics) = pool(&upstream(&["127.0.0.1:1"], 1, 2, 60_000));
    let running = p.admit(Priority::Normal).await.unwrap();
    let sheddable = waiter(&p, Priority::Sheddable);
    tokio::task::yield_now().await;
    let normal = waiter(&p, Priority::Normal);
    tokio::task::yield_now().await;
    // The queue of two is full: a critical newcomer displaces the
    // sheddable waiter, which is refused at once.
    let critical = waiter(&p, Priority::Critical);
    tokio::task::yield_now().await;
    assert_eq!(sheddable.await.unwrap().err(), Some(PoolRefusal::Saturated));
    // A normal newcomer finds nobody lower to displace.
    assert_eq!(
        p.admit(Priority::Normal).await.err(),
        Some(PoolRefusal::Saturated)
    );
    // The freed permit goes to the critical waiter, though it came last.
    drop(running);
    let critical = critical.await.unwrap().unwrap();
    assert!(!normal.is_finished());
    drop(critical);
    drop(normal.await.unwrap().unwrap());
    let refused = |p: &str| metrics.pool_rejections.with_label_values(&["api", p]).get();
    assert_eq!(
        (refused("critical"), refused("normal"), refused("sheddable")),
        (0, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn the_reserved_share_goes_only_to_critical_routes() {
    let def = Upstream {
        reserved_critical: 1,
        ..upstream(&["127.0.0.1:1"], 3, 0, 0)
    };
    let (p, _) = pool(&def);
    let normal = [
        p.admit(Priority::Normal).await.unwrap(),
        p.admit(Priority::Sheddable).await.unwrap(),
    ];
    // Two of three taken: the third is the reserve.
    assert_eq!(
        p.admit(Priority::Normal).await.err(),
        Some(PoolRefusal::Saturated)
    );
    let critical = p.admit(Priority::Critical).await.unwrap();
    assert_eq!(
        p.admit(Priority::Critical).await.err(),
        Some(PoolRefusal::Saturated)
    );
    drop(normal);
    drop(critical);
}

#[tokio::test(start_paused = true)]
async fn a_freed_reserved_permit_waits_for_a_critical_route() {
    let def = Upstream {
        reserved_critical: 1,
        ..upstream(&["127.0.0.1:1"], 2, 4, 60_000)
    };
    let (p, _) = pool(&def);
    let normal = p.admit(Priority::Normal).await.unwrap();
    let critical = p.admit(Priority::Critical).await.unwrap();
    let waiting = waiter(&p, Priority::Normal);
    tokio::task::yield_now().await;
    // The critical route's permit comes back: it is the reserved one.
    drop(critical);
    tokio::task::yield_now().await;
    assert!(
        !waiting.is_finished(),
        "a normal waiter never takes the reserve"
    );
    let again = waiter(&p, Priority::Critical);
    let again = again.await.unwrap().unwrap();
    // With the critical route holding one permit, the other is still the
    // reserve's share of two: only once nothing is in flight does the
    // normal waiter get one.
    drop(normal);
    tokio::task::yield_now().await;
    assert!(!waiting.is_finished());
    drop(again);
    drop(waiting.await.unwrap().unwrap());
}
