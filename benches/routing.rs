//! One routing decision, end to end, key extraction from a large chat body, and the prompt
//! record's lookups against prompt length and record size.
//!
//! `cargo bench --bench routing`

use std::collections::BTreeSet;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use http::{HeaderMap, Method};
use pingora_load_balancing::discovery::Static;
use pingora_load_balancing::selection::Consistent;
use pingora_load_balancing::{Backend, Backends, LoadBalancer};
use prefixlb::routing::hash::KeyEncoder;
use prefixlb::routing::*;

fn specs(n: usize) -> Vec<PeerSpec> {
    (0..n)
        .map(|i| format!("10.2.{}.{}:8000", i / 250, i % 250 + 1))
        .map(|addr| PeerSpec::new(addr.parse().unwrap()).max_in_flight(64))
        .collect()
}

/// Hash a 1 KiB prefix, walk the ring, check the bound, take and release the slot: under the
/// default policy (`least_cost`, which prices the first peers and reads the prompt record) and
/// under `bounded_consistent_hash`.
fn decision(c: &mut Criterion) {
    let prefix: Vec<u8> = (0..1024u32).map(|i| b'a' + (i % 26) as u8).collect();
    let mut group = c.benchmark_group("decision");
    let bounded = Balance {
        policy: Policy::BoundedConsistentHash,
        ..Balance::default()
    };
    let policies = [("least_cost", Balance::default()), ("bounded", bounded)];
    for ((name, balance), n) in policies
        .iter()
        .flat_map(|p| [4usize, 16, 64, 256].map(|n| (p, n)))
    {
        let cluster = Cluster::new(&specs(n), RingConfig::default());
        // A standing load, so the bound is computed against real numbers.
        let _standing: Vec<_> = (0..n as u64 * 2)
            .filter_map(|i| {
                cluster
                    .select(balance, Some(i * 0x9e37_79b9_7f4a_7c15), &[])
                    .routed()
            })
            .collect();
        let mut salt = 0u64;
        let id = BenchmarkId::new(format!("{name}_1KiB_key"), n);
        group.bench_with_input(id, &n, |b, _| {
            b.iter(|| {
                salt = salt.wrapping_add(1);
                let mut enc = KeyEncoder::default();
                enc.part(b'm', &salt.to_le_bytes());
                enc.part(b'c', black_box(&prefix));
                let routed = cluster.select(balance, Some(enc.finish()), &[]);
                black_box(routed)
            })
        });
    }
    group.finish();
}

/// The same decision through Pingora's own `LoadBalancer::select_with` (over our ring and over
/// Pingora's Ketama ring), with the bound checked in `accept`: the cost of its generic path.
fn pingora_paths(c: &mut Criterion) {
    let mut group = c.benchmark_group("select_16_peers");
    let cluster = Cluster::new(&specs(16), RingConfig::default());
    let balance = Balance::default();
    let backends: BTreeSet<Backend> = cluster.ring().peers().iter().cloned().collect();
    let ours: LoadBalancer<Ring> =
        LoadBalancer::from_backends(Backends::new(Static::new(backends.clone())));
    let ketama: LoadBalancer<Consistent> =
        LoadBalancer::from_backends(Backends::new(Static::new(backends)));
    for lb in [&ours as &dyn Updatable, &ketama] {
        lb.refresh();
    }
    let mut salt = 0u64;
    group.bench_function("prefixlb_cluster_select", |b| {
        b.iter(|| {
            salt = salt.wrapping_add(0x9e37_79b9_7f4a_7c15);
            black_box(cluster.select(&balance, Some(salt), &[]))
        })
    });
    group.bench_function("pingora_select_with_our_ring", |b| {
        b.iter(|| {
            salt = salt.wrapping_add(0x9e37_79b9_7f4a_7c15);
            black_box(ours.select_with(&salt.to_be_bytes(), 256, |b, healthy| {
                healthy && b.weight > 0
            }))
        })
    });
    group.bench_function("pingora_select_with_ketama", |b| {
        b.iter(|| {
            salt = salt.wrapping_add(0x9e37_79b9_7f4a_7c15);
            black_box(ketama.select_with(&salt.to_be_bytes(), 256, |b, healthy| {
                healthy && b.weight > 0
            }))
        })
    });
    group.finish();
}

trait Updatable {
    fn refresh(&self);
}

impl<S> Updatable for LoadBalancer<S>
where
    S: pingora_load_balancing::selection::BackendSelection + 'static,
    S::Iter: pingora_load_balancing::selection::BackendIter,
{
    fn refresh(&self) {
        futures_util::FutureExt::now_or_never(self.update())
            .expect("static discovery does not block")
            .expect("static discovery does not fail");
        assert!(self.select(b"probe", 256).is_some());
    }
}

/// Our MurmurHash3 x64_128 over slices beside the `murmur3` crate's (the same output), on 1 KiB
/// and on a 24 KiB system prompt.
fn murmur(c: &mut Criterion) {
    let mut group = c.benchmark_group("murmur3_x64_128");
    for size in [1024usize, 24 * 1024] {
        let bytes: Vec<u8> = (0..size).map(|i| i as u8).collect();
        group.throughput(criterion::Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("prefixlb", size), &bytes, |b, bytes| {
            b.iter(|| black_box(prefixlb::routing::hash::murmur64(black_box(bytes))))
        });
        group.bench_with_input(
            BenchmarkId::new("encoder_two_parts", size),
            &bytes,
            |b, bytes| {
                b.iter(|| {
                    let mut enc = KeyEncoder::default();
                    enc.part(b'm', &7u64.to_le_bytes());
                    enc.part(b'c', black_box(bytes));
                    black_box(enc.finish())
                })
            },
        );
        group.bench_with_input(
            BenchmarkId::new("murmur3_crate", size),
            &bytes,
            |b, bytes| {
                b.iter(|| {
                    let mut source = black_box(bytes.as_slice());
                    black_box(murmur3::murmur3_x64_128(&mut source, 0).unwrap_or_default())
                })
            },
        );
    }
    group.finish();
}

fn chat_body(model_first: bool) -> Vec<u8> {
    let system = "You are a hospital triage assistant; follow the protocol. ".repeat(20);
    let mut history = String::new();
    while history.len() < 15 * 1024 {
        history.push_str(r#",{"role":"assistant","content":"Noted. Any fever or shortness of breath?"},{"role":"user","content":"No fever, some shortness of breath when climbing stairs."}"#);
    }
    let messages = format!(
        r#"[{{"role":"system","content":"{system}"}},{{"role":"user","content":"Patient, 54, chest pain since this morning."}}{history}]"#
    );
    let body = if model_first {
        format!(r#"{{"model":"llama-3.1-8b","stream":true,"messages":{messages}}}"#)
    } else {
        format!(r#"{{"messages":{messages},"stream":true,"model":"llama-3.1-8b"}}"#)
    };
    body.into_bytes()
}

fn key_extraction(c: &mut Criterion) {
    let ex = KeyExtractor::default();
    let headers = HeaderMap::new();
    let mut group = c.benchmark_group("key_16KiB_chat");
    for (name, body) in [
        ("model_first", chat_body(true)),
        ("model_last", chat_body(false)),
    ] {
        assert!(body.len() >= 16 * 1024);
        group.bench_function(name, |b| {
            b.iter(|| {
                black_box(ex.key_for(&RequestParts {
                    method: &Method::POST,
                    path: "/v1/chat/completions",
                    headers: &headers,
                    client: None,
                    body: black_box(&body),
                    end: BodyEnd::Complete,
                }))
            })
        });
    }
    group.finish();
}

/// The chain of a completions prompt of `bytes`, distinct per `seed` from its first block.
fn prompt_blocks(seed: u64, bytes: usize) -> Blocks {
    let mut text: Vec<u8> = (0..bytes).map(|i| b'a' + (i % 26) as u8).collect();
    text[..8].copy_from_slice(&seed.to_le_bytes());
    Blocks::of_prompt(&text, None, 0, 2048.min(bytes))
}

/// How deep the peers hold a prompt, and noting where it went, against the prompt's length and
/// how many prompts the record holds: a lookup reads a few dozen entries at most, whatever the
/// record's size.
fn prefix_record(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefix_record");
    for mib in [1usize, 16, 256] {
        let record = PrefixRecord::with_bytes(mib << 20);
        // Full: distinct 64 KiB prompts until every entry was taken, and more.
        let capacity = record.stats().capacity;
        let mut seed = 0;
        while record.stats().used < capacity || seed < capacity / 16 {
            record.record(&prompt_blocks(seed, 64 * 1024), (seed % 8 + 1) as u32);
            seed += 1;
        }
        for kib in [1usize, 8, 32, 64] {
            // A prompt the record holds on three peers: one to its end, two to half of it.
            let prompt = prompt_blocks(u64::MAX - kib as u64, kib * 1024);
            let half = prompt_blocks(u64::MAX - kib as u64, kib * 512);
            record.record(&half, 101);
            record.record(&half, 102);
            record.record(&prompt, 103);
            let id = format!("{mib}MiB/{kib}KiB");
            group.bench_function(BenchmarkId::new("holdings", &id), |b| {
                b.iter(|| black_box(record.holdings(black_box(&prompt))))
            });
            group.bench_function(BenchmarkId::new("record", &id), |b| {
                b.iter(|| record.record(black_box(&prompt), 103))
            });
        }
        let unknown = prompt_blocks(u64::MAX / 2, 64 * 1024);
        group.bench_function(
            BenchmarkId::new("holdings_unknown", format!("{mib}MiB")),
            |b| b.iter(|| black_box(record.holdings(black_box(&unknown)))),
        );
    }
    group.finish();
}

criterion_group!(
    benches,
    murmur,
    decision,
    pingora_paths,
    key_extraction,
    prefix_record
);
criterion_main!(benches);
