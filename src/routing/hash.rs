//! MurmurHash3 over a canonical, length-prefixed encoding of key parts, hashed as the parts
//! are found.
//!
//! Every part is written as `tag, u32 length, bytes`, so that `("ab", "c")` and `("a", "bc")`
//! never encode to the same bytes and therefore never collide by concatenation.

/// MurmurHash3 x64_128 of `bytes`, folded to 64 bits by xoring its halves.
pub fn murmur64(bytes: &[u8]) -> u64 {
    let mut h = Murmur3::default();
    h.write(bytes);
    h.finish64()
}

const C1: u64 = 0x87c3_7b91_1142_53d5;
const C2: u64 = 0x4cf5_ad43_2745_937f;

/// MurmurHash3 x64_128 (seed 0) fed in pieces, over slices: the same output as hashing the
/// pieces joined, without joining them. (The `murmur3` crate reads through `io::Read`, 16 bytes
/// at a time, and wants the whole input first.)
#[derive(Debug, Default, Clone)]
pub struct Murmur3 {
    h1: u64,
    h2: u64,
    /// The start of a block that has not fully arrived.
    pending: [u8; 16],
    pending_len: usize,
    len: u64,
}

impl Murmur3 {
    pub fn write(&mut self, mut bytes: &[u8]) {
        self.len += bytes.len() as u64;
        if self.pending_len > 0 {
            // Under 16 bytes: a loop, where a variable-length copy is a call to memcpy.
            let take = bytes.len().min(16 - self.pending_len);
            for (slot, &b) in self.pending[self.pending_len..]
                .iter_mut()
                .zip(&bytes[..take])
            {
                *slot = b;
            }
            self.pending_len += take;
            bytes = &bytes[take..];
            if self.pending_len < 16 {
                return;
            }
            let block = self.pending;
            self.block(&block);
            self.pending_len = 0;
        }
        let mut blocks = bytes.chunks_exact(16);
        // In locals: the state stays in registers through the loop.
        let (mut h1, mut h2) = (self.h1, self.h2);
        for block in &mut blocks {
            (h1, h2) = round(h1, h2, block.try_into().unwrap_or(&[0; 16]));
        }
        (self.h1, self.h2) = (h1, h2);
        let rest = blocks.remainder();
        for (slot, &b) in self.pending.iter_mut().zip(rest) {
            *slot = b;
        }
        self.pending_len = rest.len();
    }

    fn block(&mut self, block: &[u8; 16]) {
        (self.h1, self.h2) = round(self.h1, self.h2, block);
    }

    /// The 128-bit hash as the `murmur3` crate returns it: `h2` high, `h1` low.
    pub fn finish128(&self) -> u128 {
        let (mut h1, mut h2) = (self.h1, self.h2);
        let tail = &self.pending[..self.pending_len];
        let word = |bytes: &[u8]| {
            bytes
                .iter()
                .rev()
                .fold(0u64, |w, &b| (w << 8) | u64::from(b))
        };
        if tail.len() > 8 {
            h2 ^= mix_k2(word(&tail[8..]));
        }
        if !tail.is_empty() {
            h1 ^= mix_k1(word(&tail[..tail.len().min(8)]));
        }
        h1 ^= self.len;
        h2 ^= self.len;
        h1 = h1.wrapping_add(h2);
        h2 = h2.wrapping_add(h1);
        h1 = fmix64(h1);
        h2 = fmix64(h2);
        h1 = h1.wrapping_add(h2);
        h2 = h2.wrapping_add(h1);
        (u128::from(h2) << 64) | u128::from(h1)
    }

    /// The 128-bit hash folded to 64 bits by xoring its halves.
    pub fn finish64(&self) -> u64 {
        let h = self.finish128();
        (h as u64) ^ ((h >> 64) as u64)
    }
}

/// `5·c1 + c2`: the constants of a round's two halves, as its expanded h2 adds them.
const ROUND_CONSTANT: u64 = 0x52dc_e729u64.wrapping_mul(5).wrapping_add(0x3849_5ab5);

#[inline(always)]
fn round(h1: u64, h2: u64, block: &[u8; 16]) -> (u64, u64) {
    let (lo, hi) = block.split_at(8);
    let k1 = u64::from_le_bytes(lo.try_into().unwrap_or_default());
    let k2 = u64::from_le_bytes(hi.try_into().unwrap_or_default());
    // The reference round is `h1 = (rotl(h1 ^ k1', 27) + h2) * 5 + c1`, then
    // `h2 = (rotl(h2 ^ k2', 31) + h1) * 5 + c2`: the new h2 waits for the new h1, six dependent
    // steps a block. Expanded (`h2 = 25·s + 5·rotl(..) + 5·c1 + c2`, the same value modulo
    // 2^64), both halves hang off `s` and a block takes five: the 1 KiB key of a routing
    // decision hashes in 6-9% less time (`murmur3_x64_128/prefixlb/1024`, the two rounds in
    // turn twice, 2026-12-04: 149-151 ns against 160-164).
    let s = (h1 ^ mix_k1(k1)).rotate_left(27).wrapping_add(h2);
    let t = (h2 ^ mix_k2(k2)).rotate_left(31);
    let h1 = s.wrapping_mul(5).wrapping_add(0x52dc_e729);
    let h2 = s
        .wrapping_mul(25)
        .wrapping_add(t.wrapping_mul(5).wrapping_add(ROUND_CONSTANT));
    (h1, h2)
}

#[inline(always)]
fn mix_k1(k: u64) -> u64 {
    k.wrapping_mul(C1).rotate_left(31).wrapping_mul(C2)
}

#[inline(always)]
fn mix_k2(k: u64) -> u64 {
    k.wrapping_mul(C2).rotate_left(33).wrapping_mul(C1)
}

fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// Builds the canonical encoding of a routing key, part by part, hashing it as it goes: nothing
/// is copied but the few bytes of a block that has not fully arrived.
#[derive(Debug, Default, Clone)]
pub struct KeyEncoder {
    hash: Murmur3,
}

impl KeyEncoder {
    /// Appends one part. The tag says what the part is (model, role, text, ...), so that equal
    /// bytes in different roles encode differently.
    pub fn part(&mut self, tag: u8, bytes: &[u8]) {
        // Parts come from a body capped by the peek limit, far below 4 GiB.
        let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
        let mut head = [0u8; 5];
        head[0] = tag;
        head[1..].copy_from_slice(&len.to_le_bytes());
        self.hash.write(&head);
        self.hash.write(&bytes[..len as usize]);
    }

    pub fn is_empty(&self) -> bool {
        self.hash.len == 0
    }

    pub fn finish(&self) -> u64 {
        self.hash.finish64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    #[test]
    fn splits_do_not_collide() {
        let mut a = KeyEncoder::default();
        a.part(b't', b"ab");
        a.part(b't', b"c");
        let mut b = KeyEncoder::default();
        b.part(b't', b"a");
        b.part(b't', b"bc");
        assert_ne!(a.finish(), b.finish());
    }

    #[test]
    fn tags_separate_equal_bytes() {
        let mut a = KeyEncoder::default();
        a.part(b'm', b"x");
        let mut b = KeyEncoder::default();
        b.part(b'u', b"x");
        assert_ne!(a.finish(), b.finish());
    }

    proptest::proptest! {
        /// Fed in any pieces, the hash is the `murmur3` crate's hash of them joined: keys and
        /// ring positions do not move.
        #[test]
        fn streamed_pieces_hash_as_the_murmur3_crate_does(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..600),
            cuts in proptest::collection::vec(0usize..600, 0..6),
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort_unstable();
            let mut h = Murmur3::default();
            let mut from = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                h.write(&bytes[from..cut]);
                from = cut;
            }
            let reference = murmur3::murmur3_x64_128(&mut Cursor::new(&bytes), 0).unwrap();
            proptest::prop_assert_eq!(h.finish128(), reference);
        }
    }

    #[test]
    fn matches_reference_murmur3_vector() {
        // Reference x64_128 of "hello" with seed 0 is cbd8a7b341bd9b02 5b1e906a48ae1d19.
        let h = murmur3::murmur3_x64_128(&mut Cursor::new(b"hello"), 0).unwrap();
        assert_eq!(murmur64(b"hello"), (h as u64) ^ ((h >> 64) as u64));
        assert_eq!(h, 0x5b1e906a48ae1d19_cbd8a7b341bd9b02);
    }
}
