//! The router's settings: `routing`, `endpoints` (as the key reads them), `outlier` and
//! `advanced`.

use std::time::Duration;

use http::HeaderName;

use super::values::{at_least_one, millis, non_negative, path, share};
use crate::config::error::ConfigError;
use crate::config::schema::routing::{Endpoints, Key, Outlier, Routing};
use crate::config::schema::tuning::Advanced;
use crate::routing::cost::{CostModel, MAX_CANDIDATES};
use crate::routing::{
    Balance, KeyConfig, KeySource, OutlierPolicy, RingConfig, Tuning, MAX_VNODES_PER_WEIGHT,
};
use crate::settings::RouterSettings;

/// The record's budget: from 1 MiB to 4 GiB (millions of prompts' worth).
const RECORD_BYTES: std::ops::RangeInclusive<usize> = 1 << 20..=4096 << 20;

pub fn router(
    r: &Routing,
    endpoints: &Endpoints,
    o: &Outlier,
    a: &Advanced,
) -> Result<RouterSettings, ConfigError> {
    if let Some(c) = r.balance_factor {
        if !(c.is_finite() && c >= 1.0) {
            return Err(ConfigError::new(
                "routing.balance_factor",
                format!("must be a number ≥ 1 (or null for none), not {c}"),
            ));
        }
    }
    let rate = r.least_cost.prefill_tokens_per_second;
    if !(rate.is_finite() && rate >= 1.0) {
        return Err(ConfigError::new(
            "routing.least_cost.prefill_tokens_per_second",
            format!("must be a number ≥ 1, not {rate}"),
        ));
    }
    if !(1..=MAX_CANDIDATES).contains(&r.least_cost.candidates) {
        return Err(ConfigError::new(
            "routing.least_cost.candidates",
            format!("must be from 1 to {MAX_CANDIDATES}"),
        ));
    }
    if !(1..=MAX_VNODES_PER_WEIGHT).contains(&a.vnodes_per_weight) {
        return Err(ConfigError::new(
            "advanced.vnodes_per_weight",
            format!("must be from 1 to {MAX_VNODES_PER_WEIGHT}"),
        ));
    }
    if !RECORD_BYTES.contains(&a.prefix_record_bytes) {
        return Err(ConfigError::new(
            "advanced.prefix_record_bytes",
            format!(
                "must be from {} to {}",
                RECORD_BYTES.start(),
                RECORD_BYTES.end()
            ),
        ));
    }
    let base_ejection = millis("outlier.base_ejection_ms", o.base_ejection_ms)?;
    if o.max_ejection_ms < o.base_ejection_ms {
        return Err(ConfigError::new(
            "outlier.max_ejection_ms",
            "must be at least base_ejection_ms",
        ));
    }
    Ok(RouterSettings {
        keys: keys(&r.key, endpoints)?,
        balance: Balance {
            policy: r.policy,
            balance_factor: r.balance_factor,
            cost: CostModel {
                prefill_tokens_per_sec: rate,
                candidates: r.least_cost.candidates,
                shared_prefix_placement: r.least_cost.shared_prefix_placement,
                tuning: tuning(a)?,
            },
        },
        ring: RingConfig {
            vnodes_per_weight: a.vnodes_per_weight,
        },
        record_bytes: a.prefix_record_bytes,
        outlier: OutlierPolicy {
            consecutive_failures: o.consecutive_failures,
            base_ejection,
            max_ejection: Duration::from_millis(o.max_ejection_ms),
            max_ejected_percent: match o.max_ejected_percent {
                p @ 0..=100 => p,
                _ => {
                    return Err(ConfigError::new(
                        "outlier.max_ejected_percent",
                        "must be from 0 to 100",
                    ))
                }
            },
        },
    })
}

fn tuning(a: &Advanced) -> Result<Tuning, ConfigError> {
    let field = |name: &str| format!("advanced.{name}");
    let floor = |name: &str, n: u32| at_least_one(&field(name), n.into()).map(|()| n);
    Ok(Tuning {
        warm_hit: share(&field("warm_hit"), a.warm_hit)?,
        earlier_hit: share(&field("earlier_hit"), a.earlier_hit)?,
        decode_share: share(&field("decode_share"), a.decode_share)?,
        arrivals: non_negative(&field("arrivals"), a.arrivals)?,
        default_decode: millis(&field("default_decode_ms"), a.default_decode_ms)?,
        // No margin is a choice a sweep may make: any cheaper peer takes the request.
        spill_margin: Duration::from_millis(a.spill_margin_ms),
        spill_share: share(&field("spill_share"), a.spill_share)?,
        copies_need_room: a.copies_need_room,
        future_turns: non_negative(&field("future_turns"), a.future_turns)?,
        unknown_capacity_floor: floor("unknown_capacity_floor", a.unknown_capacity_floor)?,
        conversation_floor: floor("conversation_floor", a.conversation_floor)?,
        conversation_queue: non_negative(&field("conversation_queue"), a.conversation_queue)?,
        prefix_home_share: share(&field("prefix_home_share"), a.prefix_home_share)?,
        chars_per_token: floor("chars_per_token", a.chars_per_token)?,
        warm_for: millis(&field("warm_for_ms"), a.warm_for_ms)?,
        learn_prefill_rate: a.learn_prefill_rate,
        eviction_margin: non_negative(&field("eviction_margin"), a.eviction_margin)?,
    })
}

fn keys(k: &Key, endpoints: &Endpoints) -> Result<KeyConfig, ConfigError> {
    at_least_one("routing.key.prefix_chars", k.prefix_chars as u64)?;
    for (i, s) in k.sources.iter().enumerate() {
        if matches!(s, KeySource::ClientAddr | KeySource::None) {
            return Err(ConfigError::new(
                format!("routing.key.sources[{i}]"),
                "is a fallback, not a source: set routing.key.fallback",
            ));
        }
    }
    let session_header = HeaderName::from_bytes(k.session_header.as_bytes()).map_err(|_| {
        ConfigError::new(
            "routing.key.session_header",
            format!("`{}` is not a valid header name", k.session_header),
        )
    })?;
    let on = |source: KeySource, field: &str, p: &str| -> Result<Option<String>, ConfigError> {
        path(&format!("endpoints.{field}"), p)?;
        Ok(k.sources.contains(&source).then(|| p.to_owned()))
    };
    Ok(KeyConfig {
        session_header: k
            .sources
            .contains(&KeySource::SessionHeader)
            .then_some(session_header),
        chat_path: on(KeySource::Chat, "chat_path", &endpoints.chat_path)?,
        completions_path: on(
            KeySource::Completions,
            "completions_path",
            &endpoints.completions_path,
        )?,
        generate_path: on(
            KeySource::Generate,
            "generate_path",
            &endpoints.generate_path,
        )?,
        messages_path: on(
            KeySource::Messages,
            "messages_path",
            &endpoints.messages_path,
        )?,
        responses_path: on(
            KeySource::Responses,
            "responses_path",
            &endpoints.responses_path,
        )?,
        prefix_chars: k.prefix_chars,
        fallback: k.fallback,
    })
}
