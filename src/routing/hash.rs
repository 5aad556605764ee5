//! MurmurHash3 over a canonical, length-prefixed encoding of key parts.
//!
//! Every part is written as `tag, u32 length, bytes`, so that `("ab", "c")` and `("a", "bc")`
//! never encode to the same bytes and therefore never collide by concatenation.

/// MurmurHash3 x64_128 of `bytes`, folded to 64 bits by xoring its halves.
pub fn murmur64(bytes: &[u8]) -> u64 {
    // Reading from an in-memory slice cannot fail. A bare slice, not a Cursor: its `Read` inlines
    // to a copy, where a Cursor's position bookkeeping costs more than the hash rounds.
    let mut source = bytes;
    let h = murmur3::murmur3_x64_128(&mut source, 0).unwrap_or_default();
    (h as u64) ^ ((h >> 64) as u64)
}

/// Builds the canonical encoding of a routing key, part by part.
#[derive(Debug, Default, Clone)]
pub struct KeyEncoder {
    buf: Vec<u8>,
}

impl KeyEncoder {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            buf: Vec::with_capacity(capacity),
        }
    }

    /// Appends one part. The tag says what the part is (model, role, text, ...), so that equal
    /// bytes in different roles encode differently.
    pub fn part(&mut self, tag: u8, bytes: &[u8]) {
        // Parts come from a body capped by the peek limit, far below 4 GiB.
        let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
        self.buf.push(tag);
        self.buf.extend_from_slice(&len.to_le_bytes());
        self.buf.extend_from_slice(&bytes[..len as usize]);
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn finish(&self) -> u64 {
        murmur64(&self.buf)
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

    #[test]
    fn matches_reference_murmur3_vector() {
        // Reference x64_128 of "hello" with seed 0 is cbd8a7b341bd9b02 5b1e906a48ae1d19.
        let h = murmur3::murmur3_x64_128(&mut Cursor::new(b"hello"), 0).unwrap();
        assert_eq!(murmur64(b"hello"), (h as u64) ^ ((h >> 64) as u64));
        assert_eq!(h, 0x5b1e906a48ae1d19_cbd8a7b341bd9b02);
    }
}
