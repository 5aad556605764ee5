//! How far the ring's key shares stray from the weight shares, by vnodes per weight and peer
//! count: the measurement behind `DEFAULT_VNODES_PER_WEIGHT`.
//!
//! `cargo run --release --example ring_balance`

use prefixlb::routing::{Cluster, PeerSpec, RingConfig};

fn main() {
    const SWEEP: u64 = 2_000_000;
    const TRIALS: usize = 5;
    println!("vnodes  peers  worst |share/expected - 1| over {TRIALS} peer sets");
    for vnodes in [160u32, 512, 1024, 2048] {
        for n in [4usize, 16, 64, 256] {
            let mut worst = 0f64;
            for trial in 0..TRIALS {
                let specs: Vec<PeerSpec> = (0..n)
                    .map(|i| format!("10.{trial}.{}.{}:8000", i / 250, i % 250 + 1))
                    .map(|addr| PeerSpec::new(addr.parse().expect("literal address")))
                    .collect();
                let cluster = Cluster::new(
                    &specs,
                    RingConfig {
                        vnodes_per_weight: vnodes,
                    },
                );
                let mut hits = vec![0u64; n];
                let step = u64::MAX / SWEEP;
                for s in 0..SWEEP {
                    if let Some(p) = cluster.ring().primary(s * step) {
                        hits[p] += 1;
                    }
                }
                let mean = SWEEP as f64 / n as f64;
                for h in hits {
                    worst = worst.max((h as f64 / mean - 1.0).abs());
                }
            }
            println!("{vnodes:>6}  {n:>5}  {:>6.1}%", worst * 100.0);
        }
    }
}
