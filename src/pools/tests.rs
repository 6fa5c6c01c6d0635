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
        response_buffer_bytes: 65_536,
        retries: 2,
        server_names: servers.iter().map(|s| s.to_string()).collect(),
        host_header: crate::config::HostHeader::Preserve,
        tls: None,
        protocol: crate::config::UpstreamProtocol::Http1,
        health: None,
        reserved_critical: 0,
        queue_order: QueueOrder::Arrival,
        queue_per_tenant_max: None,
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
    let a = p.admit(Priority::Normal, None).await.unwrap();
    let _b = p.admit(Priority::Normal, None).await.unwrap();
    assert_eq!(metrics.pool_in_flight.with_label_values(&["api"]).get(), 2);
    // The third waits in the queue and gets a permit when one is dropped.
    let waiter = {
        let p = p.clone();
        tokio::spawn(async move { p.admit(Priority::Normal, None).await.map(drop) })
    };
    tokio::task::yield_now().await;
    // The queue holds one: a fourth is refused at once.
    tokio::time::advance(Duration::from_millis(5)).await;
    assert_eq!(metrics.pool_waiting.with_label_values(&["api"]).get(), 1);
    assert_eq!(
        p.admit(Priority::Normal, None).await.err(),
        Some(PoolRefusal::Saturated)
    );
    drop(a);
    assert_eq!(waiter.await.unwrap().err(), None);
    // With nothing released, a waiter times out (paused time jumps to the
    // timeout once nothing else can run).
    let _c = p.admit(Priority::Normal, None).await.unwrap();
    assert_eq!(
        p.admit(Priority::Normal, None).await.err(),
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
    let held = first.admit(Priority::Normal, None).await.unwrap();
    let bigger = pools
        .reconcile(&[upstream(&["127.0.0.1:1"], 3, 0, 0)])
        .remove(0);
    assert!(Arc::ptr_eq(&first, &bigger), "the same pool, resized");
    let more = [
        bigger.admit(Priority::Normal, None).await.unwrap(),
        bigger.admit(Priority::Normal, None).await.unwrap(),
    ];
    assert!(
        bigger.admit(Priority::Normal, None).await.is_err(),
        "3 in flight, including the one from before"
    );
    // Shrinking to 1 while 3 are in flight: nothing new until two finish.
    let smaller = pools
        .reconcile(&[upstream(&["127.0.0.1:1"], 1, 0, 0)])
        .remove(0);
    drop(held);
    tokio::task::yield_now().await;
    assert!(smaller.admit(Priority::Normal, None).await.is_err());
    drop(more);
    // Lets the task that takes back the owed permits run.
    tokio::time::advance(Duration::from_millis(10)).await;
    let only = smaller.admit(Priority::Normal, None).await.unwrap();
    assert!(smaller.admit(Priority::Normal, None).await.is_err());
    drop(only);
}

/// Starts waiting for a permit of `priority` in the background.
fn waiter(
    p: &Arc<Pool>,
    priority: Priority,
) -> tokio::task::JoinHandle<Result<PoolPermit, PoolRefusal>> {
    let p = p.clone();
    tokio::spawn(async move { p.admit(priority, None).await })
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_by_priority_and_the_lowest_is_displaced() {
    let (p, metrics) = pool(&upstream(&["127.0.0.1:1"], 1, 2, 60_000));
    let running = p.admit(Priority::Normal, None).await.unwrap();
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
        p.admit(Priority::Normal, None).await.err(),
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
        queue_order: QueueOrder::Arrival,
        queue_per_tenant_max: None,
        ..upstream(&["127.0.0.1:1"], 3, 0, 0)
    };
    let (p, _) = pool(&def);
    let normal = [
        p.admit(Priority::Normal, None).await.unwrap(),
        p.admit(Priority::Sheddable, None).await.unwrap(),
    ];
    // Two of three taken: the third is the reserve.
    assert_eq!(
        p.admit(Priority::Normal, None).await.err(),
        Some(PoolRefusal::Saturated)
    );
    let critical = p.admit(Priority::Critical, None).await.unwrap();
    assert_eq!(
        p.admit(Priority::Critical, None).await.err(),
        Some(PoolRefusal::Saturated)
    );
    drop(normal);
    drop(critical);
}

#[tokio::test(start_paused = true)]
async fn a_freed_reserved_permit_waits_for_a_critical_route() {
    let def = Upstream {
        reserved_critical: 1,
        queue_order: QueueOrder::Arrival,
        queue_per_tenant_max: None,
        ..upstream(&["127.0.0.1:1"], 2, 4, 60_000)
    };
    let (p, _) = pool(&def);
    let normal = p.admit(Priority::Normal, None).await.unwrap();
    let critical = p.admit(Priority::Critical, None).await.unwrap();
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

/// A pool of one permit whose queue holds 100 for 10 s, fair between
/// tenants or not, with at most `per_tenant` waiters a tenant.
fn queue(fair: bool, per_tenant: Option<u32>) -> (Arc<Pool>, Arc<Metrics>) {
    let mut def = upstream(&["127.0.0.1:1"], 1, 100, 10_000);
    def.queue_order = if fair {
        QueueOrder::FairByTenant
    } else {
        QueueOrder::Arrival
    };
    def.queue_per_tenant_max = per_tenant;
    pool(&def)
}

/// Queues one waiter of `tenant` that, once admitted, notes its tenant in
/// `served` and gives its permit back; returns once it is in the queue.
async fn queued(
    p: &Arc<Pool>,
    metrics: &Metrics,
    tenant: &'static str,
    served: &Arc<Mutex<Vec<&'static str>>>,
) -> tokio::task::JoinHandle<Result<(), PoolRefusal>> {
    let party = Party::Tenant(Arc::from(tenant));
    queued_as(p, metrics, tenant, Some(party), served).await
}

/// Queues one waiter of `party` that, once admitted, notes `label` in
/// `served` and gives its permit back; returns once it is in the queue.
async fn queued_as(
    p: &Arc<Pool>,
    metrics: &Metrics,
    label: &'static str,
    party: Option<Party>,
    served: &Arc<Mutex<Vec<&'static str>>>,
) -> tokio::task::JoinHandle<Result<(), PoolRefusal>> {
    let waiting = metrics.pool_waiting.with_label_values(&["api"]);
    let before = waiting.get();
    let (p, served) = (p.clone(), served.clone());
    let task = tokio::spawn(async move {
        let permit = p.admit(Priority::Normal, party).await?;
        served.lock().unwrap().push(label);
        drop(permit);
        Ok(())
    });
    while waiting.get() == before && !task.is_finished() {
        tokio::task::yield_now().await;
    }
    task
}

/// Fifty waiters of tenant `a`, then one of `b`, behind a held permit: the
/// order they are served in.
async fn fifty_and_one(fair: bool) -> Vec<&'static str> {
    let (p, metrics) = queue(fair, None);
    let held = p.admit(Priority::Normal, None).await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..50 {
        tasks.push(queued(&p, &metrics, "a", &served).await);
    }
    tasks.push(queued(&p, &metrics, "b", &served).await);
    drop(held);
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let order = served.lock().unwrap().clone();
    order
}

#[tokio::test(start_paused = true)]
async fn a_fair_queue_serves_a_newcomer_within_one_turn() {
    let order = fifty_and_one(true).await;
    assert_eq!(order.len(), 51);
    assert_eq!(order.iter().position(|&t| t == "b"), Some(1), "{order:?}");
    // In arrival order, the newcomer waits for all fifty.
    let order = fifty_and_one(false).await;
    assert_eq!(order.iter().position(|&t| t == "b"), Some(50), "{order:?}");
}

#[tokio::test(start_paused = true)]
async fn tenants_with_several_waiters_take_turns() {
    let (p, metrics) = queue(true, None);
    let held = p.admit(Priority::Normal, None).await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for tenant in ["a", "a", "a", "b", "b", "c"] {
        tasks.push(queued(&p, &metrics, tenant, &served).await);
    }
    drop(held);
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(*served.lock().unwrap(), ["a", "b", "c", "a", "b", "a"]);
}

#[tokio::test(start_paused = true)]
async fn a_tenant_beyond_per_tenant_max_is_refused_while_others_queue() {
    let (p, metrics) = queue(true, Some(3));
    let held = p.admit(Priority::Normal, None).await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        tasks.push(queued(&p, &metrics, "a", &served).await);
    }
    let excess = p
        .admit(Priority::Normal, Some(Party::Tenant(Arc::from("a"))))
        .await;
    assert_eq!(
        excess.err(),
        Some(PoolRefusal::Saturated),
        "refused at once"
    );
    tasks.push(queued(&p, &metrics, "b", &served).await);
    assert_eq!(metrics.pool_waiting.with_label_values(&["api"]).get(), 4);
    drop(held);
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(*served.lock().unwrap(), ["a", "b", "a", "a"]);
    // Once a's waiters are served, a may queue again.
    let held = p.admit(Priority::Normal, None).await.unwrap();
    let again = queued(&p, &metrics, "a", &served).await;
    drop(held);
    again.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn callers_without_a_credential_take_turns_by_network() {
    let (p, metrics) = queue(true, Some(3));
    let network = |ip: &str| {
        let ip = ip.parse().unwrap();
        Some(Party::Network(crate::client_ip::key_network(ip, 64)))
    };
    let held = p.admit(Priority::Normal, None).await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // Two addresses of one /64 are one party: three waiters between them,
    // and a fourth is refused at once.
    for ip in ["2001:db8::1", "2001:db8::2", "2001:db8::1"] {
        tasks.push(queued_as(&p, &metrics, "a", network(ip), &served).await);
    }
    let excess = p.admit(Priority::Normal, network("2001:db8::3")).await;
    assert_eq!(excess.err(), Some(PoolRefusal::Saturated));
    // Another /64 and an IPv4 client each take their own turn.
    tasks.push(queued_as(&p, &metrics, "b", network("2001:db8:1::1"), &served).await);
    tasks.push(queued_as(&p, &metrics, "c", network("203.0.113.7"), &served).await);
    drop(held);
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(*served.lock().unwrap(), ["a", "b", "c", "a", "a"]);
}
