//! A waiting line per pool: a model whose peers are all busy holds up no other model, models
//! on the same peers share a line, and a slot freed on a peer two lines share wakes both.

use std::sync::Arc;
use std::time::Duration;

use prefixlb::routing::*;

use super::{settle, LIMIT};

/// A cluster of one-slot peers listing `models`, the id of a model's pool, and a choice for it.
fn pooled(models: &[&[&str]]) -> Arc<Cluster> {
    let specs: Vec<_> = models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            PeerSpec::new(format!("10.0.0.{}:8000", i + 1).parse().unwrap())
                .max_in_flight(1)
                .models(m.iter().copied())
        })
        .collect();
    Arc::new(Cluster::new(&specs, RingConfig::default()))
}

fn pool(cluster: &Cluster, name: &str) -> Option<ModelId> {
    match cluster.pools().choose(Some(name), None) {
        PoolChoice::Model(id) => Some(id),
        other => panic!("{name}: {other:?}"),
    }
}

fn select_for(cluster: &Cluster, model: Option<ModelId>) -> Decision {
    let demand = Demand {
        hash: Some(7),
        model,
        ..Demand::default()
    };
    cluster.select(&Balance::default(), demand, &[])
}

/// A request for `model` waiting in its line (as the proxy finds it) until it gets a slot,
/// which it holds until `release` is dropped; yields its peer.
fn wait_for(
    cluster: &Arc<Cluster>,
    model: Option<ModelId>,
    release: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<String> {
    let cluster = Arc::clone(cluster);
    tokio::spawn(async move {
        let line = cluster
            .load()
            .waiters()
            .line(cluster.pools().line_of(model));
        let (routed, _) = line
            .admit(LIMIT, 0, || select_for(&cluster, model))
            .await
            .unwrap();
        let _ = release.await;
        routed.slot.peer().id().to_owned()
    })
}

#[tokio::test(start_paused = true)]
async fn a_full_pool_holds_up_no_other_pool() {
    let cluster = pooled(&[&["a"], &["b"]]);
    let (a, b) = (pool(&cluster, "a"), pool(&cluster, "b"));
    let one = QueueLimit {
        max_waiting: 1,
        ..LIMIT
    };
    let admit = |model| {
        let cluster = Arc::clone(&cluster);
        tokio::spawn(async move {
            let line = cluster
                .load()
                .waiters()
                .line(cluster.pools().line_of(model));
            line.admit(one, 0, || select_for(&cluster, model))
                .await
                .map(|(routed, waited)| (routed.slot.peer().id().to_owned(), routed, waited))
        })
    };
    // Pool a's only slot is held and its line is full.
    let held_a = select_for(&cluster, a).routed().unwrap();
    let waiting_a = admit(a);
    settle().await;
    assert_eq!(cluster.load().waiters().len(), 1);

    // A request for b goes straight to b: nobody in its line.
    let (peer, held_b, waited) = admit(b).await.unwrap().unwrap();
    assert_eq!((peer.as_str(), waited), ("10.0.0.2:8000", Duration::ZERO));

    // b full too: the next request for b waits in b's line, behind nobody of a's.
    let waiting_b = admit(b);
    settle().await;
    assert_eq!(cluster.load().waiters().len(), 2);
    // A slot freed in b serves b's waiter, though a's has waited longer.
    tokio::time::sleep(Duration::from_millis(5)).await;
    drop(held_b);
    let (peer, routed_b, waited) = waiting_b.await.unwrap().unwrap();
    assert_eq!(peer, "10.0.0.2:8000");
    assert_eq!(waited, Duration::from_millis(5));
    assert!(!waiting_a.is_finished(), "a's waiter took b's slot");
    assert_eq!(cluster.load().waiters().len(), 1);

    drop(held_a);
    let (peer, routed_a, _) = waiting_a.await.unwrap().unwrap();
    assert_eq!(peer, "10.0.0.1:8000");
    assert!(cluster.load().waiters().is_empty());
    drop((routed_a, routed_b));
    assert_eq!(cluster.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn models_on_the_same_engines_wait_in_one_line_first_come_first_served() {
    // One engine serving a base model and an adapter on it.
    let cluster = pooled(&[&["base", "adapter"]]);
    let (base, adapter) = (pool(&cluster, "base"), pool(&cluster, "adapter"));
    // The adapter's line made first: lines apart, a release would wake its front first.
    let _ = cluster
        .load()
        .waiters()
        .line(cluster.pools().line_of(adapter));
    let held = select_for(&cluster, adapter).routed().unwrap();
    let (let_base_go, base_done) = tokio::sync::oneshot::channel();
    let base_waiter = wait_for(&cluster, base, base_done);
    settle().await;
    let (let_adapter_go, adapter_done) = tokio::sync::oneshot::channel();
    let adapter_waiter = wait_for(&cluster, adapter, adapter_done);
    settle().await;
    assert_eq!(cluster.load().waiters().len(), 2);
    drop(held);
    settle().await;
    assert_eq!(
        cluster.load().waiters().len(),
        1,
        "the first in line took the slot"
    );
    assert!(!adapter_waiter.is_finished());
    let_base_go.send(()).unwrap();
    assert_eq!(base_waiter.await.unwrap(), "10.0.0.1:8000");
    let_adapter_go.send(()).unwrap();
    assert_eq!(adapter_waiter.await.unwrap(), "10.0.0.1:8000");
    assert!(cluster.load().waiters().is_empty());
    assert_eq!(cluster.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_slot_freed_on_a_peer_two_lines_share_wakes_the_other_line() {
    // The adapter is on the first engine only: the two models want different slots, and wait
    // in two lines.
    let cluster = pooled(&[&["base", "adapter"], &["base"]]);
    let (base, adapter) = (pool(&cluster, "base"), pool(&cluster, "adapter"));
    assert_ne!(
        cluster.pools().line_of(base),
        cluster.pools().line_of(adapter)
    );
    let on_first = select_for(&cluster, adapter).routed().unwrap();
    let on_second = select_for(&cluster, base).routed().unwrap();
    assert_eq!(on_second.slot.peer().id(), "10.0.0.2:8000");
    let (go, done) = tokio::sync::oneshot::channel();
    let waiter = wait_for(&cluster, base, done);
    settle().await;
    assert_eq!(cluster.load().waiters().len(), 1);
    // The adapter's request ends: the base model's waiter, in the other line, takes its slot.
    drop(on_first);
    settle().await;
    assert!(cluster.load().waiters().is_empty());
    go.send(()).unwrap();
    assert_eq!(waiter.await.unwrap(), "10.0.0.1:8000");
    drop(on_second);
    assert_eq!(cluster.in_flight(), 0);
}
