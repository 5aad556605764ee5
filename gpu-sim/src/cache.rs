//! The prefix KV cache of one simulated GPU: blocks of tokens named by chained hashes, so that
//! a block is a hit only if every block before it is too (as vLLM's automatic prefix caching
//! and SGLang's radix cache behave), evicted least recently used first.

use std::num::NonZeroUsize;

use lru::LruCache;

pub struct PrefixCache {
    blocks: LruCache<u64, ()>,
    capacity: usize,
}

/// What a prompt found in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// Leading full blocks already cached.
    pub hit_blocks: usize,
    pub total_blocks: usize,
}

/// MurmurHash3 x64_128 folded to 64 bits: a block's name, as an engine's own hash would give.
fn murmur64(bytes: &[u8]) -> u64 {
    let h = murmur3::murmur3_x64_128(&mut &bytes[..], 0).unwrap_or_default();
    (h as u64) ^ ((h >> 64) as u64)
}

/// The chained hashes of a prompt's full blocks; a trailing partial block is never cached.
pub fn block_hashes(prompt: &[u8], block_bytes: usize) -> Vec<u64> {
    let mut prev = 0u64;
    prompt
        .chunks_exact(block_bytes.max(1))
        .map(|block| {
            let mut bytes = Vec::with_capacity(8 + block.len());
            bytes.extend_from_slice(&prev.to_le_bytes());
            bytes.extend_from_slice(block);
            prev = murmur64(&bytes);
            prev
        })
        .collect()
}

impl PrefixCache {
    pub fn new(capacity_blocks: usize) -> Self {
        Self {
            blocks: LruCache::unbounded(),
            capacity: capacity_blocks,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Counts the leading cached blocks, marking them recently used.
    pub fn lookup(&mut self, hashes: &[u64]) -> Lookup {
        let hit_blocks = hashes
            .iter()
            .take_while(|h| self.blocks.get(h).is_some())
            .count();
        Lookup {
            hit_blocks,
            total_blocks: hashes.len(),
        }
    }

    /// Stores a prompt's blocks after its prefill, evicting the least recently used beyond
    /// capacity; returns how many blocks were evicted.
    pub fn insert(&mut self, hashes: &[u64]) -> usize {
        for &h in hashes.iter().rev() {
            self.blocks.put(h, ());
        }
        let Some(cap) = NonZeroUsize::new(self.capacity) else {
            let n = self.blocks.len();
            self.blocks.clear();
            return n;
        };
        let mut evicted = 0;
        while self.blocks.len() > cap.get() {
            self.blocks.pop_lru();
            evicted += 1;
        }
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_hits_only_after_its_whole_prefix() {
        let a = block_hashes(b"aaaabbbbcccc", 4);
        let b = block_hashes(b"xxxxbbbbcccc", 4);
        assert_eq!(a.len(), 3);
        assert_ne!(
            a[1], b[1],
            "same block text after a different prefix is another block"
        );
        let mut cache = PrefixCache::new(10);
        cache.insert(&a);
        assert_eq!(cache.lookup(&a).hit_blocks, 3);
        assert_eq!(cache.lookup(&b).hit_blocks, 0);
        let longer = block_hashes(b"aaaabbbbccccdddd", 4);
        assert_eq!(
            cache.lookup(&longer),
            Lookup {
                hit_blocks: 3,
                total_blocks: 4
            }
        );
    }

    #[test]
    fn least_recently_used_blocks_go_first() {
        let a = block_hashes(b"aaaabbbb", 4);
        let b = block_hashes(b"ccccdddd", 4);
        let mut cache = PrefixCache::new(3);
        cache.insert(&a);
        cache.insert(&b);
        assert_eq!(cache.len(), 3);
        // a's tail went first, its head stays: a still hits one block.
        assert_eq!(cache.lookup(&a).hit_blocks, 1);
        assert_eq!(cache.lookup(&b).hit_blocks, 2);
        // Now a's head is the oldest block: the next insert evicts it.
        cache.insert(&block_hashes(b"eeee", 4));
        assert_eq!(cache.lookup(&a).hit_blocks, 0);
        assert_eq!(cache.lookup(&b).hit_blocks, 2);
    }
}
