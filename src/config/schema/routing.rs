//! How a request's peer is chosen: `routing` (the policy, its parameters, the key),
//! `endpoints` (the engines' API paths) and `outlier`.

use serde::Deserialize;

use super::defaults::ms;
use super::switch::switch;
use crate::routing::{Balance, Fallback, KeyConfig, KeySource, OutlierPolicy, Placement, Policy};

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Routing {
    pub policy: Policy,
    /// `c` of the balance bound; `null` for none (only `max_in_flight` then).
    pub balance_factor: Option<f64>,
    pub least_cost: LeastCost,
    pub key: Key,
}

impl Default for Routing {
    fn default() -> Self {
        let balance = Balance::default();
        Self {
            policy: balance.policy,
            balance_factor: balance.balance_factor,
            least_cost: LeastCost::default(),
            key: Key::default(),
        }
    }
}

/// The parameters of the `least_cost` policy an operator decides.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeastCost {
    /// What a prompt is priced at: the tokens a GPU prefills per second (with
    /// `advanced.learn_prefill_rate`, until each peer has shown its own).
    pub prefill_tokens_per_second: f64,
    /// How many peers of a key's walk are priced, its own first.
    pub candidates: u32,
    /// Whether a conversation new to this process goes where its system prompt went (or,
    /// cold everywhere, where it costs least): `auto`, `true` or `false`.
    #[serde(deserialize_with = "switch")]
    pub shared_prefix_placement: Placement,
}

impl Default for LeastCost {
    fn default() -> Self {
        let cost = Balance::default().cost;
        Self {
            prefill_tokens_per_second: cost.prefill_tokens_per_sec,
            candidates: cost.candidates,
            shared_prefix_placement: cost.shared_prefix_placement,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Key {
    /// Which of session_header, chat, completions, generate, messages and responses may give
    /// a key.
    pub sources: Vec<KeySource>,
    pub session_header: String,
    pub prefix_chars: usize,
    pub fallback: Fallback,
}

impl Default for Key {
    fn default() -> Self {
        let k = KeyConfig::default();
        Self {
            sources: vec![
                KeySource::SessionHeader,
                KeySource::Chat,
                KeySource::Completions,
                KeySource::Generate,
                KeySource::Messages,
                KeySource::Responses,
            ],
            session_header: k
                .session_header
                .map(|h| h.as_str().to_owned())
                .unwrap_or_default(),
            prefix_chars: k.prefix_chars,
            fallback: k.fallback,
        }
    }
}

/// The engines' paths that carry prompts: the key is read from their bodies, and they are
/// always forwarded, whatever `forwarding.allowed_paths` says.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Endpoints {
    pub chat_path: String,
    pub completions_path: String,
    pub generate_path: String,
    pub messages_path: String,
    pub responses_path: String,
}

impl Default for Endpoints {
    fn default() -> Self {
        let k = KeyConfig::default();
        let path = |p: Option<String>| p.unwrap_or_default();
        Self {
            chat_path: path(k.chat_path),
            completions_path: path(k.completions_path),
            generate_path: path(k.generate_path),
            messages_path: path(k.messages_path),
            responses_path: path(k.responses_path),
        }
    }
}

impl Endpoints {
    pub fn paths(&self) -> [&String; 5] {
        [
            &self.chat_path,
            &self.completions_path,
            &self.generate_path,
            &self.messages_path,
            &self.responses_path,
        ]
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Outlier {
    /// 0 turns ejection off.
    pub consecutive_failures: u32,
    pub base_ejection_ms: u64,
    pub max_ejection_ms: u64,
    /// The most peers ejected at once, in percent of the members (one always may be).
    pub max_ejected_percent: u32,
}

impl Default for Outlier {
    fn default() -> Self {
        let o = OutlierPolicy::default();
        Self {
            consecutive_failures: o.consecutive_failures,
            base_ejection_ms: ms(o.base_ejection),
            max_ejection_ms: ms(o.max_ejection),
            max_ejected_percent: o.max_ejected_percent,
        }
    }
}
