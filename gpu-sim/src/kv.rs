//! The KV block pool of the engine model: one budget of blocks shared by the running
//! requests and the cached prefixes, as in vLLM's block manager. A prompt's full blocks are
//! named by their chained hash and shared by every running request that holds them; a named
//! block no running request holds stays cached until a new allocation needs its room (least
//! recently used first). Everything else a request holds (its partial last block, the blocks
//! of its generated tokens) is private to it.

use std::collections::HashMap;

use lru::LruCache;

pub struct KvPool {
    total: usize,
    /// Named blocks held by running requests, with how many hold each.
    held: HashMap<u64, usize>,
    /// Named blocks nobody holds: still hits, evicted when room is needed.
    idle: LruCache<u64, ()>,
    private: usize,
    pub evictions: u64,
}

impl KvPool {
    pub fn new(total_blocks: usize) -> Self {
        Self {
            total: total_blocks,
            held: HashMap::new(),
            idle: LruCache::unbounded(),
            private: 0,
            evictions: 0,
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn used(&self) -> usize {
        self.held.len() + self.idle.len() + self.private
    }

    /// Blocks held by running requests (idle cached blocks are free to take).
    pub fn busy(&self) -> usize {
        self.held.len() + self.private
    }

    fn known(&self, h: &u64) -> bool {
        self.held.contains_key(h) || self.idle.contains(h)
    }

    /// Leading blocks of `hashes` already cached (held or idle).
    pub fn hits(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.known(h)).count()
    }

    /// Takes a hold on a cached block.
    pub fn hold(&mut self, h: u64) {
        self.idle.pop(&h);
        *self.held.entry(h).or_insert(0) += 1;
    }

    /// Gives back a hold; the last one leaves the block cached and idle.
    pub fn release(&mut self, h: u64) {
        if let Some(n) = self.held.get_mut(&h) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&h);
                self.idle.put(h, ());
            }
        }
    }

    /// Takes `n` private blocks, evicting idle cached ones if the pool is full; false (and
    /// nothing taken) if even that leaves too little room.
    pub fn allocate(&mut self, n: usize) -> bool {
        if self.busy() + n > self.total {
            return false;
        }
        while self.used() + n > self.total {
            self.idle.pop_lru();
            self.evictions += 1;
        }
        self.private += n;
        true
    }

    pub fn free_private(&mut self, n: usize) {
        self.private -= n;
    }

    /// A private block whose prompt content is now computed becomes the named block `h`
    /// (or, if another request computed it meanwhile, is freed in favour of that one).
    pub fn name(&mut self, h: u64) {
        self.private -= 1;
        if !self.known(&h) {
            // The freed private block is the room the named one takes.
            self.held.insert(h, 1);
        } else {
            self.hold(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_cached_blocks_make_room_for_running_ones() {
        let mut kv = KvPool::new(4);
        assert!(kv.allocate(3));
        for h in 1..=3 {
            kv.name(h);
        }
        assert_eq!(kv.hits(&[1, 2, 3, 9]), 3);
        assert!(!kv.allocate(2), "three are held, one is free");
        for h in 1..=3 {
            kv.release(h);
        }
        assert!(kv.allocate(2));
        assert_eq!(kv.evictions, 1);
        assert_eq!(kv.hits(&[1, 2, 3]), 0, "the oldest idle block went first");
        assert_eq!(kv.hits(&[2, 3]), 2);
        assert_eq!(kv.used(), 4);
    }
}
