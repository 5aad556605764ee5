//! A consistent-hash ring with virtual nodes, walked clockwise over distinct peers.
//!
//! Each peer owns `weight × vnodes_per_weight` points, placed at MurmurHash3 of the peer's
//! identity and the point's index, so a peer's points depend on nothing but itself: adding or
//! removing a peer moves only the keys that land on its points.

use std::collections::BTreeSet;
use std::sync::Arc;

use pingora_load_balancing::selection::{BackendIter, BackendSelection};
use pingora_load_balancing::Backend;

use super::hash::murmur64;
use super::spec::Weight;

/// Virtual nodes per unit of weight. A peer's key share deviates from its weight share by about
/// `1/sqrt(vnodes)` (one standard deviation), and the worst of N peers by a few of those: 160
/// points leave the worst of 16 peers 17% off, 2048 keep the worst of 256 peers within 8% (the
/// ring tests and `cargo run --release --example ring_balance` measure it). That costs 24 KiB
/// of points per unit of weight.
pub const DEFAULT_VNODES_PER_WEIGHT: u32 = 2048;

/// The most points per unit of weight a configuration may ask for: eight times the default,
/// already within a few percent everywhere; more would cost memory (192 KiB per unit of weight
/// here) and buy no evenness.
pub const MAX_VNODES_PER_WEIGHT: u32 = 16_384;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    pub vnodes_per_weight: u32,
}

impl Default for RingConfig {
    fn default() -> Self {
        Self {
            vnodes_per_weight: DEFAULT_VNODES_PER_WEIGHT,
        }
    }
}

#[derive(Debug)]
pub struct Ring {
    /// Sorted point positions; `owners[i]` is the index in `peers` of the peer at `points[i]`.
    points: Vec<u64>,
    owners: Vec<u32>,
    /// `buckets[b]` is the first point whose top bits are `b` or more: a lookup narrows to a
    /// handful of neighbouring points instead of a binary search over all of them, whose every
    /// step is a cache miss on a ring of tens of thousands of points.
    buckets: Vec<u32>,
    shift: u32,
    peers: Vec<Backend>,
}

impl Ring {
    /// Builds a ring over `peers` in the given order; a peer's index here is its index in
    /// [`Ring::peers`].
    pub fn new(peers: Vec<Backend>, config: RingConfig) -> Self {
        // A peer's point count depends on its own weight alone, so that no membership change
        // moves another peer's points. A backend's weight may come from Pingora's discovery,
        // unchecked: it is bounded here like any other.
        let count = |p: &Backend| {
            u64::from(Weight::clamped(p.weight as u64).get())
                * u64::from(config.vnodes_per_weight.max(1))
        };
        let total: u64 = peers.iter().map(count).sum();
        let mut placed: Vec<(u64, u32)> = Vec::with_capacity(total as usize);
        for (idx, peer) in peers.iter().enumerate() {
            let identity = peer.addr.to_string();
            let mut name = Vec::with_capacity(identity.len() + 12);
            for vnode in 0..count(peer) {
                name.clear();
                name.extend_from_slice(identity.as_bytes());
                name.push(b'#');
                name.extend_from_slice(vnode.to_string().as_bytes());
                placed.push((murmur64(&name), idx as u32));
            }
        }
        // Ties between two peers' points are broken by identity, not by insertion order, so the
        // ring does not depend on the order the peers were listed in.
        placed.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0)
                .then_with(|| peers[a.1 as usize].addr.cmp(&peers[b.1 as usize].addr))
        });
        let (points, owners): (Vec<u64>, Vec<u32>) = placed.into_iter().unzip();
        // About four points per bucket, at most a million buckets.
        let bits = (points.len() / 4)
            .max(2)
            .next_power_of_two()
            .trailing_zeros()
            .min(20);
        let shift = 64 - bits;
        let buckets = (0..=1u64 << bits)
            .map(|b| points.partition_point(|&p| (p >> shift) < b) as u32)
            .collect();
        Self {
            points,
            owners,
            buckets,
            shift,
            peers,
        }
    }

    /// The index of the first point at or after `hash` (the number of points when none is).
    #[inline]
    fn first_at_or_after(&self, hash: u64) -> usize {
        let b = (hash >> self.shift) as usize;
        let (lo, hi) = (self.buckets[b] as usize, self.buckets[b + 1] as usize);
        lo + self.points[lo..hi].partition_point(|&p| p < hash)
    }

    pub fn peers(&self) -> &[Backend] {
        &self.peers
    }

    /// Distinct peer indices in clockwise order from the first point at or after `hash`.
    #[inline]
    pub fn walk(&self, hash: u64) -> Walk<'_> {
        Walk {
            ring: self,
            state: WalkState::new(self, hash),
        }
    }

    /// The peer a key maps to when no peer is loaded or excluded.
    pub fn primary(&self, hash: u64) -> Option<usize> {
        self.walk(hash).next()
    }
}

/// Clockwise walk over distinct peers.
pub struct Walk<'r> {
    ring: &'r Ring,
    state: WalkState,
}

impl Iterator for Walk<'_> {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        self.state.next(self.ring)
    }
}

/// Where a walk is, apart from the ring it walks, so that an iterator owning an `Arc<Ring>`
/// can walk lazily too.
struct WalkState {
    start: usize,
    taken: usize,
    yielded: usize,
    seen: SeenSet,
}

// `#[inline]` down the walk: each policy walks from a module of its own, and a call per step
// across codegen units measured 2% of a bounded decision.
impl WalkState {
    #[inline]
    fn new(ring: &Ring, hash: u64) -> Self {
        Self {
            start: ring.first_at_or_after(hash),
            taken: 0,
            yielded: 0,
            seen: SeenSet::new(ring.peers.len()),
        }
    }

    #[inline]
    fn next(&mut self, ring: &Ring) -> Option<usize> {
        let n = ring.points.len();
        while self.yielded < ring.peers.len() && self.taken < n {
            // `start` is at most `n` and `taken` below it: one wrap at most, where `%` would
            // divide at every step.
            let mut at = self.start + self.taken;
            if at >= n {
                at -= n;
            }
            self.taken += 1;
            let owner = ring.owners[at] as usize;
            if self.seen.insert(owner) {
                self.yielded += 1;
                return Some(owner);
            }
        }
        None
    }
}

/// Which peers a walk has already yielded; inline for up to 128 peers, so the common walk
/// does not allocate.
enum SeenSet {
    Inline(u128),
    Heap(Vec<u64>),
}

impl SeenSet {
    #[inline]
    fn new(peers: usize) -> Self {
        if peers <= 128 {
            SeenSet::Inline(0)
        } else {
            SeenSet::Heap(vec![0; peers.div_ceil(64)])
        }
    }

    /// Records `idx`; true when it was not seen before.
    #[inline]
    fn insert(&mut self, idx: usize) -> bool {
        match self {
            SeenSet::Inline(bits) => {
                let bit = 1u128 << idx;
                let fresh = *bits & bit == 0;
                *bits |= bit;
                fresh
            }
            SeenSet::Heap(words) => {
                let (word, bit) = (idx / 64, 1u64 << (idx % 64));
                let fresh = words[word] & bit == 0;
                words[word] |= bit;
                fresh
            }
        }
    }
}

/// The key given to [`BackendSelection::iter`]: the routing hash as 8 big-endian bytes, as
/// `RoutingKey::hash.to_be_bytes()` gives it. Any other key is hashed with MurmurHash3 first.
pub fn point_of(key: &[u8]) -> u64 {
    match <[u8; 8]>::try_from(key) {
        Ok(bytes) => u64::from_be_bytes(bytes),
        Err(_) => murmur64(key),
    }
}

impl BackendSelection for Ring {
    type Iter = RingIter;
    type Config = RingConfig;

    fn build_with_config(backends: &BTreeSet<Backend>, config: &RingConfig) -> Self {
        Ring::new(backends.iter().cloned().collect(), *config)
    }

    fn build(backends: &BTreeSet<Backend>) -> Self {
        Self::build_with_config(backends, &RingConfig::default())
    }

    fn iter(self: &Arc<Self>, key: &[u8]) -> RingIter {
        RingIter {
            state: WalkState::new(self, point_of(key)),
            ring: Arc::clone(self),
        }
    }
}

/// Pingora's view of a walk: distinct backends in ring order.
pub struct RingIter {
    ring: Arc<Ring>,
    state: WalkState,
}

impl BackendIter for RingIter {
    fn next(&mut self) -> Option<&Backend> {
        let idx = self.state.next(&self.ring)?;
        self.ring.peers.get(idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn backends(n: usize) -> Vec<Backend> {
        (0..n)
            .map(|i| Backend::new(&format!("10.0.{}.{}:8000", i / 250, i % 250 + 1)).unwrap())
            .collect()
    }

    #[test]
    fn walk_yields_every_peer_once() {
        for n in [1, 3, 130, 300] {
            let ring = Ring::new(backends(n), RingConfig::default());
            let mut seen: Vec<usize> = ring.walk(12345).collect();
            assert_eq!(seen.len(), n);
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), n);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(16))]
        /// The bucket index finds the point a binary search over the whole ring finds.
        #[test]
        fn buckets_find_the_first_point_at_or_after_a_hash(
            n in 0usize..40,
            vnodes in 1u32..64,
            hashes in proptest::collection::vec(proptest::num::u64::ANY, 64),
        ) {
            let ring = Ring::new(backends(n), RingConfig { vnodes_per_weight: vnodes });
            let probes = hashes
                .into_iter()
                .chain([0, u64::MAX])
                .chain(ring.points.iter().take(8).copied());
            for h in probes {
                proptest::prop_assert_eq!(
                    ring.first_at_or_after(h),
                    ring.points.partition_point(|&p| p < h)
                );
            }
        }
    }

    #[test]
    fn empty_ring_walks_nothing() {
        let ring = Ring::new(Vec::new(), RingConfig::default());
        assert_eq!(ring.walk(7).next(), None);
    }

    #[test]
    fn order_of_listing_does_not_matter() {
        let mut list = backends(20);
        let a = Ring::new(list.clone(), RingConfig::default());
        list.reverse();
        let b = Ring::new(list, RingConfig::default());
        for k in 0..2000u64 {
            let h = murmur64(&k.to_le_bytes());
            let pa = &a.peers()[a.primary(h).unwrap()];
            let pb = &b.peers()[b.primary(h).unwrap()];
            assert_eq!(pa.addr, pb.addr);
        }
    }
}
