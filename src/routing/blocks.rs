//! A prompt cut into fixed blocks, the way an engine cuts its tokens into KV-cache blocks: each
//! block is named by the hash of everything from the prompt's start to the block's end, so two
//! prompts share a block's name exactly when they agree up to its end. Where prompts went is
//! remembered per block by the prefix record, which reads these chains (and is not read
//! here); the deepest block a peer holds is how much of a new prompt it has cached.
//!
//! The chain hashes the prompt as the body carries it, from the start of its value (`messages`,
//! `prompt` or `text`) to the end of what was read, after the model when that came first: a
//! client resends its history byte for byte, so a later turn's chain starts with every block
//! of the turns before, and nothing is decoded for it.

use super::hash::Murmur3;

/// Bytes per block: about 256 tokens of English.
pub const BLOCK_BYTES: u64 = 1024;

/// Blocks named at most, from the prompt's start: 64 KiB, the default peek window. Past them
/// two prompts are priced as the same.
pub const MAX_BLOCKS: usize = 64;

/// Named points of a chain: the blocks' ends and the key's.
const MAX_CUTS: usize = MAX_BLOCKS + 1;

/// The named points of one prompt, shallowest first.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Blocks {
    hashes: [u64; MAX_CUTS],
    /// Bytes of the chain (the model's, then the body's from the prompt on) up to each point.
    ends: [u32; MAX_CUTS],
    len: u8,
    /// The point where the routing key ends: a peer holding it has seen this conversation.
    key: Option<u8>,
    /// The chain's length, past the last point too.
    bytes: u32,
    turn: Turn,
}

/// Where a prompt stands in its conversation, as its body shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Turn {
    /// Not a conversation's messages (a raw prompt, a key alone): it cannot tell.
    #[default]
    Unknown,
    /// Nothing follows its key: no peer can hold more of it than the part it shares with
    /// other conversations.
    Opening,
    /// More follows its key: whoever sent its opening has seen the conversation.
    Later,
}

impl Default for Blocks {
    #[inline]
    fn default() -> Self {
        Self {
            hashes: [0; MAX_CUTS],
            ends: [0; MAX_CUTS],
            len: 0,
            key: None,
            bytes: 0,
            turn: Turn::Unknown,
        }
    }
}

impl std::fmt::Debug for Blocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blocks")
            .field("ends", &&self.ends[..self.len()])
            .field("key", &self.key)
            .field("bytes", &self.bytes)
            .field("turn", &self.turn)
            .finish()
    }
}

impl Blocks {
    /// The chain of a body's prompt: the model's bytes (when it came before the prompt), then
    /// the body from the prompt's start on, its key's end named.
    pub fn of_prompt(body: &[u8], model: Option<&[u8]>, start: usize, key_end: usize) -> Self {
        let mut c = ChainEncoder::default();
        if let Some(model) = model {
            c.write(model);
        }
        let start = start.min(body.len());
        let key_end = key_end.clamp(start, body.len());
        c.write(&body[start..key_end]);
        c.key_ends();
        c.write(&body[key_end..]);
        c.finish()
    }

    /// A prompt known only by its key (a session header, no prompt read): one point, the key
    /// itself.
    pub fn of_key(hash: u64) -> Self {
        let mut b = Self::default();
        b.name_key(hash);
        b
    }

    /// Makes an empty chain [`Blocks::of_key`]'s, where it lies.
    #[inline]
    pub(crate) fn name_key(&mut self, hash: u64) {
        debug_assert!(self.is_empty());
        self.push(hash, 0);
        self.key = Some(0);
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// The name of point `i` (0 is the shallowest).
    pub fn hash(&self, i: usize) -> u64 {
        self.hashes[i]
    }

    /// Bytes of the chain up to point `i`.
    pub fn end(&self, i: usize) -> u32 {
        self.ends[i]
    }

    pub fn hashes(&self) -> &[u64] {
        &self.hashes[..self.len()]
    }

    /// The point where the key ends, when it is named.
    pub fn key_point(&self) -> Option<usize> {
        self.key.map(usize::from)
    }

    /// The chain's length: all of the prompt that was read.
    pub fn bytes(&self) -> u32 {
        self.bytes
    }

    /// The same chain, marked as `turn` of its conversation.
    pub fn turn(self, turn: Turn) -> Self {
        Self { turn, ..self }
    }

    pub fn is_opening(&self) -> bool {
        self.turn == Turn::Opening
    }

    /// Whether the prompt is a conversation's turn after its opening.
    pub fn is_later_turn(&self) -> bool {
        self.turn == Turn::Later
    }

    /// Whether the chain is a key alone: no prompt was read.
    pub fn key_only(&self) -> bool {
        self.len == 1 && self.key == Some(0) && self.bytes == 0
    }

    #[inline]
    fn push(&mut self, hash: u64, end: u64) {
        let i = self.len();
        // 0 marks an empty entry of the record.
        self.hashes[i] = hash.max(1);
        self.ends[i] = u32::try_from(end).unwrap_or(u32::MAX);
        self.len += 1;
    }
}

/// Hashes a prompt's bytes into its chain, naming a point at each block's end.
#[derive(Debug, Clone, Default)]
pub struct ChainEncoder {
    hash: Murmur3,
    blocks: Blocks,
    /// Block points named so far (the key's is not one).
    named: usize,
    /// Bytes written, the unhashed ones past the named blocks too.
    bytes: u64,
}

impl ChainEncoder {
    /// Names the point reached as the key's end.
    pub fn key_ends(&mut self) {
        if self.blocks.key.is_some() {
            return;
        }
        let at = self.bytes;
        let b = &mut self.blocks;
        if b.len > 0 && u64::from(b.ends[b.len() - 1]) == at {
            b.key = Some(b.len - 1);
        } else if self.named < MAX_BLOCKS {
            let hash = self.hash.finish64();
            b.push(hash, at);
            b.key = Some(b.len - 1);
        }
    }

    pub fn write(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.named == MAX_BLOCKS {
                // Past the named blocks only the length counts.
                self.bytes += bytes.len() as u64;
                return;
            }
            let room = (BLOCK_BYTES - self.bytes % BLOCK_BYTES) as usize;
            let take = room.min(bytes.len());
            self.hash.write(&bytes[..take]);
            self.bytes += take as u64;
            bytes = &bytes[take..];
            if take == room {
                let hash = self.hash.finish64();
                self.blocks.push(hash, self.bytes);
                self.named += 1;
            }
        }
    }

    pub fn finish(&self) -> Blocks {
        Blocks {
            bytes: u32::try_from(self.bytes).unwrap_or(u32::MAX),
            ..self.blocks
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(parts: &[&[u8]]) -> Blocks {
        let mut c = ChainEncoder::default();
        for p in parts {
            c.write(p);
        }
        c.finish()
    }

    #[test]
    fn prompts_share_the_blocks_they_agree_on() {
        let common = vec![b'a'; 3000];
        let a = chain(&[&common, b"first question"]);
        let b = chain(&[&common, b"second question, longer"]);
        // Blocks end at 1024 and 2048 bytes: both inside the common text.
        assert_eq!(a.len(), 2);
        assert_eq!(a.hashes(), b.hashes());
        assert_eq!(a.end(1), 2048);
        let c = chain(&[&vec![b'a'; 1500], b"x", &vec![b'a'; 1499]]);
        assert_eq!(c.hash(0), a.hash(0));
        assert_ne!(c.hash(1), a.hash(1), "they differ before 2048");
        assert_eq!(a.bytes(), 3014);
    }

    #[test]
    fn the_chain_does_not_depend_on_how_the_bytes_came() {
        let bytes: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        let whole = chain(&[&bytes]);
        let pieces = chain(&[
            &bytes[..7],
            &bytes[7..1024],
            &bytes[1024..3001],
            &bytes[3001..],
        ]);
        assert_eq!(whole, pieces);
    }

    #[test]
    fn the_key_end_is_a_point_of_its_own() {
        let body = [vec![b's'; 1500], vec![b'u'; 1000]].concat();
        let b = Blocks::of_prompt(&body, Some(b"\"m\""), 0, 1500);
        // 1024, the key's end (3 bytes of model and 1500 of prompt), 2048.
        assert_eq!(b.len(), 3);
        assert_eq!(b.key_point(), Some(1));
        assert_eq!(b.end(1), 1503);
        assert_eq!(b.end(2), 2048);
        assert_eq!(b.bytes(), 2503);
        let other_model = Blocks::of_prompt(&body, Some(b"\"n\""), 0, 1500);
        assert_ne!(
            other_model.hash(0),
            b.hash(0),
            "one model's cache is not another's"
        );
    }

    #[test]
    fn no_more_than_the_window_of_blocks_is_named() {
        let b = chain(&[&vec![b'x'; 200_000]]);
        assert_eq!(b.len(), MAX_BLOCKS);
        assert_eq!(b.bytes(), 200_000);
        assert_eq!(b.end(MAX_BLOCKS - 1), (MAX_BLOCKS as u32) * 1024);
    }
}
