//! `advanced`: internal tuning an operator leaves alone, a benchmark sweeps. Mostly the cost
//! model's [`Tuning`], one key per field, its meaning and origin documented there.

use serde::Deserialize;

use super::defaults::ms;
use super::switch::switch;
use crate::routing::{LearnedRate, RingConfig, Tuning};

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Advanced {
    /// Ring points per unit of peer weight.
    pub vnodes_per_weight: u32,
    /// Memory of the record of where prompt blocks went.
    pub prefix_record_bytes: usize,
    pub warm_hit: f64,
    pub earlier_hit: f64,
    pub decode_share: f64,
    pub arrivals: f64,
    pub default_decode_ms: u64,
    pub spill_margin_ms: u64,
    pub spill_share: f64,
    pub copies_need_room: bool,
    pub future_turns: f64,
    pub unknown_capacity_floor: u32,
    pub conversation_floor: u32,
    pub conversation_queue: f64,
    pub prefix_home_share: f64,
    pub chars_per_token: u32,
    pub warm_for_ms: u64,
    #[serde(deserialize_with = "switch")]
    pub learn_prefill_rate: LearnedRate,
    pub eviction_margin: f64,
}

impl Default for Advanced {
    fn default() -> Self {
        let t = Tuning::DEFAULT;
        Self {
            vnodes_per_weight: RingConfig::default().vnodes_per_weight,
            prefix_record_bytes: crate::routing::record::DEFAULT_BYTES,
            warm_hit: t.warm_hit,
            earlier_hit: t.earlier_hit,
            decode_share: t.decode_share,
            arrivals: t.arrivals,
            default_decode_ms: ms(t.default_decode),
            spill_margin_ms: ms(t.spill_margin),
            spill_share: t.spill_share,
            copies_need_room: t.copies_need_room,
            future_turns: t.future_turns,
            unknown_capacity_floor: t.unknown_capacity_floor,
            conversation_floor: t.conversation_floor,
            conversation_queue: t.conversation_queue,
            prefix_home_share: t.prefix_home_share,
            chars_per_token: t.chars_per_token,
            warm_for_ms: ms(t.warm_for),
            learn_prefill_rate: t.learn_prefill_rate,
            eviction_margin: t.eviction_margin,
        }
    }
}
