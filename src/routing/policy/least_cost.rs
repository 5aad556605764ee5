//! The default policy: the cheapest of the key's first peers, and of the peers holding part of
//! its prompt, by the cost rule ([`crate::routing::cost`]), under the bound (floored at what the
//! engine runs at once). Another peer must beat the prompt's home by a margin, so that noise
//! does not move keys.

use std::fmt::Write;
use std::sync::Arc;
use std::time::Instant;

use super::balance::{Balance, BoundInputs};
use super::decision::{Decision, Demand, Route, Routed};
use super::view::View;
use crate::routing::blocks::Blocks;
use crate::routing::cost::{Placement, Pricing, MAX_CANDIDATES};
use crate::routing::peer::Peer;
use crate::routing::record::Holdings;
use crate::routing::slot::Slot;

/// What a copy onto a full engine adds to its price in milliseconds: more than any price, so
/// that it comes after every peer priced in full.
const PRICED_OUT: u64 = 1 << 48;

/// Prices the first usable peers of the key's walk and the peers that hold part of the
/// prompt lately (and, for a new conversation on a shared prefix, the least loaded peer,
/// with the conversation's turns to come), and takes the cheapest one under its bound;
/// when all of those are at theirs, the first peer further on with room. Another peer wins
/// over the prompt's home (its primary, or the peer holding most of it once the record has
/// seen its conversation) only by more than the tuning's `spill_margin` (and, from a
/// conversation's own home, its `spill_share` of home's cost; from a peer holding most of the
/// prompt, that share of the prefill it would do beyond home's), and ties go to home, then to
/// the earlier peer of the walk, so that processes that see the same loads choose alike and
/// noise does not move keys. With the tuning's `copies_need_room`, a peer that would prefill
/// more of the prompt than home comes after all the others while its engine's running slots
/// are all taken.
pub fn select(view: &View, balance: &Balance, hash: u64, demand: &Demand) -> Decision {
    let tuning = &balance.cost.tuning;
    let prompt_tokens = demand.prompt_tokens;
    let want = balance.cost.candidates.clamp(1, MAX_CANDIDATES) as usize;
    let held = view.record.holdings(&demand.blocks);
    if demand.blocks.is_later_turn() {
        view.record.coverage.observe(held.knows_key());
    }
    let alone = match balance.cost.shared_prefix_placement {
        Placement::Auto => view.record.coverage.alone(),
        Placement::Always => true,
        Placement::Never => false,
    };
    // The primary holds a conversation the record has not seen by construction: another
    // process may have sent it there, and no peer holding only its system prompt is priced
    // above it. With shared-prefix placement, the only process knows better: a
    // conversation new to it is new, and goes where its system prompt went, or, cold
    // everywhere, where it is cheapest. So does an opening, new to every process: no peer
    // holds more of it than its shared part. Otherwise a key of which nothing is held
    // anywhere goes to its primary, where every process looks.
    let by_construction =
        !held.knows_key() && !alone && (held.is_empty() || !demand.blocks.is_opening());
    let cold = held.is_empty() && !demand.blocks.key_only();
    let hit_of = |first: bool, peer: &Peer| {
        let share = held.share(peer.serial());
        match (by_construction, first) {
            (true, true) => share.max(tuning.warm_hit),
            (true, false) => share.min(tuning.warm_hit),
            (false, _) => share,
        }
    };
    // A new conversation on a shared prefix settles where it goes: its turns to come are
    // priced there too, each the size of what this one adds to the shared part, and the
    // least loaded peer is priced beside the holders. A cold peer then wins one when the
    // warm ones are busy enough that the prefix's prefill pays for itself.
    let new_conversation = !held.is_empty() && (!held.knows_key() || held.deepest_is_shared());
    let mut walk = view.ring.walk(hash);
    let widen = new_conversation || (alone && held.is_empty());
    let (candidates, steps) = gather(view, &mut walk, want, &held, widen);
    let (candidates, n) = (candidates.idx, candidates.n);
    let mut hits = [0.0; MAX_CANDIDATES as usize];
    for (place, &idx) in candidates[..n].iter().enumerate() {
        hits[place] = hit_of(place == 0, &view.peers[idx]);
    }
    // Where the prompt is at home: the peer holding most of it once the record has seen
    // this conversation (its newest turns are there), else its primary. Another peer must
    // beat home by the margin, so that noise moves neither.
    let holds_most = (0..n).fold(0, |best, p| if hits[p] > hits[best] { p } else { best });
    let home = if by_construction { 0 } else { holds_most };
    let turn_tokens = if new_conversation {
        balance.cost.uncached(prompt_tokens, hits[holds_most]) as u32
    } else {
        0
    };
    // (cost in whole milliseconds, ring index, place among the priced, share held). Costs
    // are compared to the millisecond: finer differences are noise of each process's
    // learned stream times, and would break ties that processes should break alike.
    let mut priced = [(0u64, 0, 0, 0.0); MAX_CANDIDATES as usize];
    // Whether each priced peer's engine had every running slot taken, as priced.
    let mut slots_taken = [false; MAX_CANDIDATES as usize];
    // The prefill each priced peer would do beyond home's, in milliseconds at its rate.
    let mut copy_ms = [0u64; MAX_CANDIDATES as usize];
    // Why a request went where it did cannot be read afterwards: the state it was priced on
    // is gone a moment later. At debug level each decision says it (without the key, which,
    // unkeyed, would confirm a guessed prompt).
    let mut trace = log::log_enabled!(log::Level::Debug).then(String::new);
    for (place, &idx) in candidates[..n].iter().enumerate() {
        let hit = hits[place];
        // One read of the peer's state for this request's price and its later turns'.
        let now = view.peers[idx].pricing(hit);
        let mut cost = balance.cost.estimate(&now, prompt_tokens);
        if new_conversation {
            // Later turns come after the prefill queued there now has drained.
            let later = Pricing {
                prefill_queue: 0,
                hit: 0.0,
                ..now
            };
            cost += tuning.future_turns * balance.cost.estimate(&later, turn_tokens);
        }
        priced[place] = ((cost * 1000.0).round() as u64, idx, place, hit);
        slots_taken[place] = now.slots_taken();
        let beyond_home = (hits[home] - hit).max(0.0) * f64::from(prompt_tokens);
        copy_ms[place] = (beyond_home / balance.cost.rate(&now) * 1000.0).round() as u64;
        if let Some(trace) = trace.as_mut() {
            let _ = write!(
                trace,
                " {}: cost_ms={} copy_ms={} hit={hit:.2} load={}/{} prefill_queue={} rate={:.0} \
                 decode_ms={};",
                view.peers[idx].id(),
                priced[place].0,
                copy_ms[place],
                now.load,
                now.capacity,
                now.prefill_queue,
                balance.cost.rate(&now),
                now.decode.map_or(0, |d| d.as_millis()),
            );
        }
    }
    // Besides a conversation's own peer, a peer holding most of the prompt, as much as any
    // other, is a home: sent on, the request prefills a long shared document (or a history
    // two peers hold) again. The priced shares are the record's but by construction or of a
    // prompt known by its key alone, where they are assumed: no such home for those.
    let measured = !by_construction && !demand.blocks.key_only();
    let deepest = hits[..n].iter().copied().fold(0.0, f64::max);
    let home_by_share = |hit: f64| measured && deepest > tuning.prefix_home_share && hit >= deepest;
    // A later turn held by one peer alone is its conversation's own there as well: its system
    // prompt was its own, or went nowhere else.
    let sole = held
        .sole_holder()
        .filter(|_| demand.blocks.is_later_turn() && held.knows_key());
    let shared_home = held.conversation_home();
    let conversation = shared_home.or(sole);
    // A conversation's own turns leave its history only for a clear gain, a share of home's
    // cost, where home is that conversation's peer (not when its peer went unpriced, unusable).
    // Other requests, and a sole holder's turns besides, leave a peer holding most of their
    // prompt only for more than that share of the prefill they make the other peer do: a
    // copy holds the GPU it lands on and what arrives there meanwhile, which its price counts
    // only in part. Any other home is left for any gain.
    let spill_margin = tuning.spill_margin.as_millis() as u64;
    let margin = if conversation == Some(view.peers[candidates[home]].serial()) {
        spill_margin.max((priced[home].0 as f64 * tuning.spill_share) as u64)
    } else {
        spill_margin
    };
    let copy_hurdle = shared_home.is_none() && home_by_share(hits[home]);
    for p in priced[..n].iter_mut().filter(|p| p.2 != home) {
        p.0 += if copy_hurdle {
            margin.max((copy_ms[p.2] as f64 * tuning.spill_share) as u64)
        } else {
            margin
        };
        // A copy onto an engine with no slot free is tried only when home refuses, and
        // then in the order of its price among the others priced out.
        if tuning.copies_need_room && p.3 < hits[home] && slots_taken[p.2] {
            p.0 = p.0.saturating_add(PRICED_OUT);
        }
    }
    let priced = &mut priced[..n];
    priced.sort_unstable_by_key(|&(cost, _, place, _)| (cost, place != home, place));
    let record = |slot: &Slot, moved: bool| {
        // A key without its prompt that stays home, as most do, is left out: what the
        // record would say of it, the ring says already.
        if moved || !held.is_empty() || !demand.blocks.key_only() {
            let at = slot.priced_at().unwrap_or_else(Instant::now);
            let serial = slot.peer().serial();
            view.record.record_at(&demand.blocks, serial, at);
            // A session's name goes on record beside its prompt, so that a turn of it known
            // by the header alone (its body unread, or naming no prompt) finds where it went.
            if demand.session && !demand.blocks.key_only() {
                view.record.record_at(&Blocks::of_key(hash), serial, at);
            }
        }
    };
    // The bound's floor keeps a conversation's turn at its home, where it prefills only its
    // newest part, and so does a peer holding most of the prompt, as much as any.
    let is_home = |peer: &Peer, hit: f64| conversation == Some(peer.serial()) || home_by_share(hit);
    for &(_, idx, place, hit) in priced.iter() {
        let peer = &view.peers[idx];
        let bound = balance.bound(BoundInputs {
            home: is_home(peer, hit),
            ..view.bound_inputs(peer)
        });
        let Some(mut slot) = peer.try_take(bound) else {
            continue;
        };
        // Nobody holds a prompt the record has never seen served: the primary's share is
        // assumed for the choice (another process may have warmed it), but the prefill it
        // queues there is expected whole, so that the next requests for the prompt do not
        // wait behind it as if it were a turn.
        let expected = if cold { 0.0 } else { hit };
        slot.expect_prefill(
            prompt_tokens,
            expected,
            balance.cost.uncached(prompt_tokens, expected),
        );
        let route = match place {
            0 => Route::Primary,
            _ if hit > 0.0 => Route::Replica,
            _ => Route::Overflow,
        };
        if let Some(trace) = &trace {
            log::debug!(
                "least_cost chose {} (home {}, margin {margin} ms, {prompt_tokens} tokens, new \
                 conversation: {new_conversation}); priced before the margin:{trace}",
                peer.id(),
                view.peers[candidates[home]].id(),
            );
        }
        record(&slot, place > 0);
        return Decision::Routed(Routed { slot, route, steps });
    }
    let take = |p: &Arc<Peer>| {
        let mut slot = p.try_take(view.bound(balance, p))?;
        slot.expect_prefill(
            prompt_tokens,
            0.0,
            balance.cost.uncached(prompt_tokens, 0.0),
        );
        record(&slot, true);
        Some(slot)
    };
    if let Some(trace) = &trace {
        log::debug!("least_cost: every peer priced is at its bound, priced:{trace}");
    }
    let seen = priced.len() as u32;
    match view.walk_select(walk, seen, take) {
        Decision::Routed(r) => Decision::Routed(Routed {
            steps: steps + r.steps - seen,
            ..r
        }),
        other => other,
    }
}

/// Peers priced for one request, by ring index, in the order they were found.
struct Candidates {
    idx: [usize; MAX_CANDIDATES as usize],
    n: usize,
}

impl Candidates {
    fn push(&mut self, idx: usize) {
        self.idx[self.n] = idx;
        self.n += 1;
    }

    fn full(&self) -> bool {
        self.n == self.idx.len()
    }
}

/// The first `want` usable peers of `walk` and the usable peers that hold part of the prompt
/// (and, with `widen`, the least loaded other one), with the steps taken on the walk.
fn gather(
    view: &View,
    walk: &mut impl Iterator<Item = usize>,
    want: usize,
    held: &Holdings,
    widen: bool,
) -> (Candidates, u32) {
    let mut candidates = Candidates {
        idx: [0; MAX_CANDIDATES as usize],
        n: 0,
    };
    let mut steps = 0;
    while candidates.n < want {
        let Some(idx) = walk.next() else { break };
        steps += 1;
        if view.usable(&view.peers[idx]) {
            candidates.push(idx);
        }
    }
    // The peers that hold part of the prompt are priced wherever they are on the walk: a
    // conversation that moved may have moved past its first peers.
    if !held.is_empty() || widen {
        let mut idlest: Option<usize> = None;
        for (idx, peer) in view.peers.iter().enumerate() {
            if !view.usable(peer) || candidates.idx[..candidates.n].contains(&idx) {
                continue;
            }
            if !candidates.full() && held.holds(peer.serial()) {
                candidates.push(idx);
            } else if idlest.is_none_or(|i| peer.load() < view.peers[i].load()) {
                idlest = Some(idx);
            }
        }
        // Not a candidate when it was looked at, and only holders were added since.
        if let Some(idx) = idlest.filter(|_| widen && !candidates.full()) {
            candidates.push(idx);
        }
    }
    (candidates, steps)
}
