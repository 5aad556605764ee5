//! `least_cost` on its own: where the cost rule sends a request, the ceilings it never
//! crosses, that equal states choose alike, and that every slot gives back what it counted.

mod cold;
mod properties;
mod queues;
mod sessions;
mod shared_prefixes;

use std::sync::Arc;

use prefixlb::routing::hash::murmur64;
use prefixlb::routing::*;

pub(crate) const COST: Balance = Balance {
    policy: Policy::LeastCost,
    balance_factor: Some(DEFAULT_BALANCE_FACTOR),
    cost: CostModel::DEFAULT,
};

pub(crate) const PLACED: Balance = Balance {
    cost: CostModel {
        shared_prefix_placement: Placement::Always,
        ..CostModel::DEFAULT
    },
    ..COST
};

pub(crate) fn specs(n: usize, max_in_flight: u32) -> Vec<PeerSpec> {
    (0..n)
        .map(|i| PeerSpec::new(format!("10.2.0.{}:8000", i + 1).parse().unwrap()))
        .map(|spec| spec.max_in_flight(max_in_flight))
        .collect()
}

pub(crate) fn key(i: u64) -> u64 {
    murmur64(&i.to_le_bytes())
}

/// The peers of `h`'s walk, in order.
pub(crate) fn walk(c: &Cluster, h: u64) -> Vec<Arc<Peer>> {
    c.ring()
        .walk(h)
        .map(|i| Arc::clone(&c.peers()[i]))
        .collect()
}

pub(crate) fn ask(h: u64, tokens: u32) -> Demand {
    Demand {
        prompt_tokens: tokens,
        ..Demand::from(Some(h))
    }
}

/// A completions prompt's demand, as the proxy makes it.
pub(crate) fn completion(prompt: &str) -> Demand {
    demand_of(
        "/v1/completions",
        serde_json::json!({"model": "m", "prompt": prompt}),
    )
}

/// A chat turn's demand, as the proxy makes it: its key and block chain from the body.
pub(crate) fn chat(messages: &[(&str, &str)]) -> Demand {
    session_chat(None, messages)
}

/// A chat turn's demand with its session named in the `x-session-id` header, when `session`.
pub(crate) fn session_chat(session: Option<&str>, messages: &[(&str, &str)]) -> Demand {
    let messages: Vec<_> = messages
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
    demand_with("/v1/chat/completions", body, session)
}

fn demand_of(path: &str, body: serde_json::Value) -> Demand {
    demand_with(path, body.to_string(), None)
}

/// The demand of a request to `path` with `body`, and `session` in the header, as the proxy
/// makes it.
pub(crate) fn demand_with(path: &str, body: String, session: Option<&str>) -> Demand {
    let mut headers = http::HeaderMap::new();
    if let Some(session) = session {
        headers.insert("x-session-id", session.parse().unwrap());
    }
    let keys = KeyExtractor::default();
    let key = match keys.key_for(&RequestParts {
        method: &http::Method::POST,
        path,
        headers: &headers,
        client: None,
        body: body.as_bytes(),
        end: BodyEnd::Complete,
    }) {
        Extract::Key(k) => k,
        other => panic!("a whole body has a key: {other:?}"),
    };
    keys.demand(&key, body.len())
}

/// `n` requests in flight on `peer`, their prefill done.
pub(crate) fn streams(peer: &Arc<Peer>, n: usize) -> Vec<Slot> {
    (0..n).map(|_| peer.take()).collect()
}

/// Marks `peer` as an engine that runs `slots` requests at once (it was seen to queue).
pub(crate) fn known_slots(peer: &Peer, slots: u32) {
    peer.set_engine(Some(EngineReport {
        running: slots,
        waiting: 1,
        kv_cache_usage: None,
        work: None,
    }));
    // The queue is gone; what it taught of the slots stays.
    peer.set_engine(Some(EngineReport {
        running: 0,
        waiting: 0,
        kv_cache_usage: None,
        work: None,
    }));
}
