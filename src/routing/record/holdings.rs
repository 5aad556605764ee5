//! What the record answers of one prompt: the peers that hold part of it, and how deep, found
//! by reading the prompt's first block, then searching its chain by halves for the deepest
//! block each of its peers holds: a few dozen reads at most, whatever the record holds.

use super::table::{named, Table, Ways, Window, WAYS};
use crate::routing::blocks::Blocks;

/// The shares of a prompt known by its key alone (a session header, no prompt read): the peer
/// that served it last holds all but the newest turn, one that served it earlier the turns up
/// to then.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KeyHits {
    pub last: f64,
    pub earlier: f64,
}

/// What the record knows of one prompt: the peers that hold part of it, and how deep.
#[derive(Debug, Clone, Copy, Default)]
pub struct Holdings {
    /// (serial, chain bytes held, tick last served).
    peers: [(u32, u32, u32); WAYS],
    n: usize,
    knows_key: bool,
    bytes: u32,
    key_only: bool,
    key_hits: KeyHits,
}

impl Holdings {
    /// Whether no peer served any part of the prompt lately.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Whether some peer holds the prompt up to the end of its key: the record has seen this
    /// conversation, not only its system prompt.
    pub fn knows_key(&self) -> bool {
        self.knows_key
    }

    /// The peer that alone holds the deepest part of the prompt while another holds less of
    /// it: where a conversation's own turns are, past a part it shares with others (or past
    /// where it was before it moved).
    pub fn conversation_home(&self) -> Option<u32> {
        // Peers are listed deepest first.
        match self.peers[..self.n] {
            [(serial, deepest, _), (_, next, _), ..] if deepest > next => Some(serial),
            _ => None,
        }
    }

    /// The peer that holds part of the prompt when no other does.
    pub fn sole_holder(&self) -> Option<u32> {
        match self.peers[..self.n] {
            [(serial, _, _)] => Some(serial),
            _ => None,
        }
    }

    /// Whether two peers or more hold the deepest part of the prompt that anyone holds: a
    /// prefix shared by conversations, not one conversation's own turns.
    pub fn deepest_is_shared(&self) -> bool {
        // Peers are listed deepest first.
        matches!(self.peers[..self.n], [(_, a, _), (_, b, _), ..] if a == b)
    }

    pub fn holds(&self, serial: u32) -> bool {
        self.peers[..self.n].iter().any(|&(s, _, _)| s == serial)
    }

    /// The share of the prompt `serial` is expected to hold (`α`, 0 to 1). Of a prompt known by
    /// its key alone, the peer that served it last holds all but the newest turn, one that
    /// served it earlier the turns up to then.
    pub fn share(&self, serial: u32) -> f64 {
        let Some(&(_, depth, seen)) = self.peers[..self.n].iter().find(|p| p.0 == serial) else {
            return 0.0;
        };
        if self.key_only {
            let latest = self.peers[..self.n].iter().all(|p| p.2 <= seen);
            return if latest {
                self.key_hits.last
            } else {
                self.key_hits.earlier
            };
        }
        (f64::from(depth) / f64::from(self.bytes.max(1))).min(1.0)
    }

    /// How much of the prompt named by `blocks` each peer that served part of it within
    /// `window` holds, as `table` has it; `window` is read only when the first block is there.
    pub fn search(
        table: &Table,
        blocks: &Blocks,
        window: impl FnOnce() -> Window,
        key_hits: KeyHits,
    ) -> Self {
        let mut out = Holdings {
            bytes: blocks.bytes(),
            key_only: blocks.key_only(),
            key_hits,
            ..Holdings::default()
        };
        // Most first blocks are unknown or known at once: an unknown one without the clock.
        let Some(first) = blocks.hashes().first().and_then(|&h| table.find(h)) else {
            return out;
        };
        let window = window();
        let at_first = first.fresh(window);
        let mut left: Ways = at_first;
        let remains = |left: &Ways| left.iter().any(|&(s, _)| s != 0);
        let mut deepest = None;
        let mut top = blocks.len();
        while remains(&left) {
            // Each peer holds a prompt's blocks from the first to its deepest (they are
            // recorded together), so "some peer left holds point i" holds up to the deepest
            // of theirs and no further.
            let (mut lo, mut hi, mut at_lo) = (0, top, at_first);
            while lo + 1 < hi {
                let mid = (lo + hi) / 2;
                let ways = table
                    .find(blocks.hash(mid))
                    .map(|e| e.fresh(window))
                    .unwrap_or_default();
                if ways.iter().any(|&(s, _)| s != 0 && named(&left, s)) {
                    (lo, at_lo) = (mid, ways);
                } else {
                    hi = mid;
                }
            }
            // The first round finds the deepest point anyone holds.
            deepest.get_or_insert(lo);
            // At least one peer left is named at `lo` (all of them at point 0): each round
            // takes one depth, and the rest hold less.
            for l in left.iter_mut().filter(|l| l.0 != 0) {
                if let Some(&(_, seen)) = at_lo.iter().find(|w| w.0 == l.0) {
                    out.peers[out.n] = (l.0, blocks.end(lo), seen);
                    out.n += 1;
                    *l = (0, 0);
                }
            }
            top = lo;
        }
        out.knows_key = matches!((blocks.key_point(), deepest), (Some(k), Some(d)) if d >= k);
        out
    }
}
