//! The prompt record in bounded memory: it allocates its budget once, at most, and nothing
//! more however many distinct prompts pass; the prompts it has just seen stay known.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use prefixlb::routing::blocks::ChainEncoder;
use prefixlb::routing::PrefixRecord;
use proptest::prelude::*;

/// Counts the bytes each thread has allocated and not freed: what the record holds is what
/// the test's thread allocated. Per thread, since the test harness's own thread allocates
/// now and then while the test runs (seen in CI: 900 bytes during the loop below).
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

fn live() -> isize {
    LIVE.with(Cell::get)
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // A const-initialised cell: reading it allocates nothing, even on a thread's first use.
        LIVE.with(|n| n.set(n.get() + layout.size() as isize));
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.with(|n| n.set(n.get() - layout.size() as isize));
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Distinct prompts of two whole blocks and a tail, the counter in their first bytes.
fn prompt(text: &mut [u8], i: u64) -> prefixlb::routing::Blocks {
    text[..8].copy_from_slice(&i.to_le_bytes());
    let mut c = ChainEncoder::default();
    c.write(text);
    c.finish()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2, ..ProptestConfig::default() })]

    #[test]
    fn a_million_distinct_prompts_stay_within_the_budget(
        budget in (64usize << 10)..(4 << 20),
        peers in 1u32..64,
    ) {
        let before = live();
        let record = PrefixRecord::with_bytes(budget);
        let allocated = live() - before;
        prop_assert!(allocated as usize <= budget, "{allocated} bytes for a {budget} budget");
        prop_assert_eq!(record.stats().bytes as isize, allocated);
        let mut text = vec![b'x'; 2100];
        let during = live();
        let prompts = 1_000_000u64;
        for i in 0..prompts {
            record.record(&prompt(&mut text, i), (i % u64::from(peers)) as u32 + 1);
        }
        prop_assert_eq!(live(), during, "the record grew");
        let stats = record.stats();
        prop_assert!(stats.used <= stats.capacity);
        prop_assert_eq!(stats.used, stats.capacity, "a million prompts fill it");
        // Two entries per prompt (its two whole blocks): all but what fits was forgotten.
        prop_assert_eq!(stats.evictions + stats.used, 2 * prompts);
        // The newest prompts are still known, on their peers, through both blocks.
        for i in prompts - 16..prompts {
            let peer = (i % u64::from(peers)) as u32 + 1;
            let held = record.holdings(&prompt(&mut text, i));
            prop_assert!(held.share(peer) > 0.9, "prompt {i}: {}", held.share(peer));
        }
    }
}
