//! The saturation queue: FIFO within a lane and fair between lanes, woken by releases, bounded in length and time, and left cleanly
//! by a waiter whose client goes away; a line per pool (`pools`).

mod pools;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prefixlb::routing::*;

fn one_slot_cluster() -> Arc<Cluster> {
    let spec = PeerSpec::new("10.0.0.1:8000".parse().unwrap()).max_in_flight(1);
    Arc::new(Cluster::new(&[spec], RingConfig::default()))
}

const LIMIT: QueueLimit = QueueLimit {
    max_waiting: 8,
    timeout: Duration::from_secs(30),
};

fn select(c: &Cluster) -> Decision {
    c.select(&Balance::default(), Some(7), &[])
}

/// A request of `lane` taking a slot of `cluster` (one pool: one line) under `limit`, in line
/// when it must; the slot and the time waited.
async fn admit(
    cluster: &Cluster,
    limit: QueueLimit,
    lane: u64,
) -> Result<(Routed, Duration), Rejection> {
    cluster
        .load()
        .waiters()
        .line(None)
        .admit(limit, lane, || select(cluster))
        .await
}

/// A request of `lane` waiting in `cluster`'s line (until aborted), that drops what it takes.
fn spawn_waiter(
    cluster: &Arc<Cluster>,
    lane: u64,
) -> tokio::task::JoinHandle<Result<(), Rejection>> {
    let cluster = Arc::clone(cluster);
    tokio::spawn(async move { admit(&cluster, LIMIT, lane).await.map(drop) })
}

async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_arrival_order_on_release() {
    let cluster = one_slot_cluster();
    let (first, _) = admit(&cluster, LIMIT, 0).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (cluster, order) = (Arc::clone(&cluster), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            let (routed, waited) = admit(&cluster, LIMIT, 0).await.unwrap();
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(10)).await;
            drop(routed);
            waited
        }));
        settle().await;
    }
    assert_eq!(cluster.load().waiters().len(), 4);
    assert!(
        order.lock().unwrap().is_empty(),
        "nobody passes a held slot"
    );
    drop(first);
    let mut waits = Vec::new();
    for t in tasks {
        waits.push(t.await.unwrap().as_millis());
    }
    // Each holds its slot 10 ms (virtual time) before the next in line gets it.
    assert_eq!(waits, vec![0, 10, 20, 30]);
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
    assert!(cluster.load().waiters().is_empty());
    assert_eq!(cluster.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_lanes_burst_does_not_queue_ahead_of_another_lane() {
    let cluster = one_slot_cluster();
    let (first, _) = admit(&cluster, LIMIT, 0).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // Lane 1 queues four, then lanes 2 and 3 one each.
    for (lane, name) in [
        (1, "a1"),
        (1, "a2"),
        (1, "a3"),
        (1, "a4"),
        (2, "b1"),
        (3, "c1"),
    ] {
        let (cluster, order) = (Arc::clone(&cluster), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            let (routed, _) = admit(&cluster, LIMIT, lane).await.unwrap();
            order.lock().unwrap().push(name);
            tokio::time::sleep(Duration::from_millis(10)).await;
            drop(routed);
        }));
        settle().await;
    }
    assert_eq!(cluster.load().waiters().len(), 6);
    drop(first);
    for t in tasks {
        t.await.unwrap();
    }
    // One of each lane per round; within lane 1, arrival order.
    assert_eq!(
        *order.lock().unwrap(),
        vec!["a1", "b1", "c1", "a2", "a3", "a4"]
    );
    assert_eq!(cluster.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_lane_leaves_a_quarter_of_the_line_to_the_others() {
    let cluster = one_slot_cluster();
    let (_held, _) = admit(&cluster, LIMIT, 0).await.unwrap();
    let mut waiting = Vec::new();
    for _ in 0..6 {
        waiting.push(spawn_waiter(&cluster, 1));
        settle().await;
    }
    assert_eq!(cluster.load().waiters().len(), 6);
    // Lane 1 has its three quarters of 8; lane 2 still gets in.
    let refused = admit(&cluster, LIMIT, 1).await;
    assert_eq!(refused.map(drop), Err(Rejection::QueueFull));
    let other = spawn_waiter(&cluster, 2);
    settle().await;
    assert_eq!(cluster.load().waiters().len(), 7);
    for w in waiting {
        w.abort();
    }
    other.abort();
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_or_zero_length_rejects_at_once() {
    let cluster = one_slot_cluster();
    let _held = select(&cluster).routed().unwrap();
    let none = QueueLimit {
        max_waiting: 0,
        ..LIMIT
    };
    let r = admit(&cluster, none, 0).await;
    assert_eq!(r.err(), Some(Rejection::QueueFull));

    let one = QueueLimit {
        max_waiting: 1,
        ..LIMIT
    };
    let c2 = Arc::clone(&cluster);
    let waiter = tokio::spawn(async move { admit(&c2, one, 0).await.map(|_| ()) });
    settle().await;
    let r = admit(&cluster, one, 0).await;
    assert_eq!(r.err(), Some(Rejection::QueueFull));
    waiter.abort();
}

#[tokio::test(start_paused = true)]
async fn a_waiter_times_out_and_leaves_the_line() {
    let cluster = one_slot_cluster();
    let _held = select(&cluster).routed().unwrap();
    let short = QueueLimit {
        max_waiting: 4,
        timeout: Duration::from_millis(250),
    };
    let start = tokio::time::Instant::now();
    let r = admit(&cluster, short, 0).await;
    assert_eq!(r.err(), Some(Rejection::Timeout));
    assert_eq!(start.elapsed(), Duration::from_millis(250));
    assert!(cluster.load().waiters().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_front_waiter_passes_its_turn_on() {
    let cluster = one_slot_cluster();
    let held = select(&cluster).routed().unwrap();
    let c1 = Arc::clone(&cluster);
    let front = tokio::spawn(async move { admit(&c1, LIMIT, 0).await.map(|_| ()) });
    settle().await;
    let c2 = Arc::clone(&cluster);
    let second = tokio::spawn(async move {
        let (r, _) = admit(&c2, LIMIT, 0).await.unwrap();
        r.slot.peer().id().to_owned()
    });
    settle().await;
    front.abort();
    settle().await;
    assert_eq!(cluster.load().waiters().len(), 1);
    drop(held);
    assert_eq!(second.await.unwrap(), "10.0.0.1:8000");
}

#[tokio::test(start_paused = true)]
async fn no_peer_is_not_worth_waiting_for() {
    let cluster = one_slot_cluster();
    cluster.set_healthy("10.0.0.1:8000", false);
    let r = admit(&cluster, LIMIT, 0).await;
    assert_eq!(r.err(), Some(Rejection::NoPeer));
}

#[tokio::test(start_paused = true)]
async fn a_peer_coming_back_wakes_the_line() {
    let cluster = one_slot_cluster();
    let _held = select(&cluster).routed().unwrap();
    // Second peer, down for now.
    let specs = vec![
        PeerSpec::new("10.0.0.1:8000".parse().unwrap()).max_in_flight(1),
        PeerSpec::new("10.0.0.2:8000".parse().unwrap()).max_in_flight(1),
    ];
    let bigger = Arc::new(cluster.rebuild(&specs, RingConfig::default()));
    bigger.set_healthy("10.0.0.2:8000", false);
    let c = Arc::clone(&bigger);
    let waiter = tokio::spawn(async move {
        let (r, _) = admit(&c, LIMIT, 0).await.unwrap();
        r.slot.peer().id().to_owned()
    });
    settle().await;
    bigger.set_healthy("10.0.0.2:8000", true);
    assert_eq!(waiter.await.unwrap(), "10.0.0.2:8000");
}
