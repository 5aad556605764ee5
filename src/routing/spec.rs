//! A peer as configured or discovered, checked: its address, weight, ceiling, TLS name and
//! models. [`PeerSpec::new`] and its setters are the one way the code outside the config
//! builds one.

use std::net::SocketAddr;

/// The largest weight a peer may have: weights are relative, and this bounds a peer's ring
/// points (weight × vnodes, 12 bytes each) and its share of the round-robin rotation.
pub const MAX_WEIGHT: u32 = 100;

/// `max_in_flight` of a peer that has no fixed ceiling.
pub const UNLIMITED: u32 = u32::MAX;

/// A peer's relative share of keys and load: from 1 to [`MAX_WEIGHT`], by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Weight(u8);

impl Weight {
    pub const ONE: Weight = Weight(1);

    /// `None` outside 1..=[`MAX_WEIGHT`].
    pub fn new(weight: u32) -> Option<Self> {
        (1..=MAX_WEIGHT)
            .contains(&weight)
            .then_some(Weight(weight as u8))
    }

    /// The nearest weight, for weights set by others (SRV records, Pingora backends) where
    /// refusing the peer would be worse than bounding it.
    pub fn clamped(weight: u64) -> Self {
        Weight(weight.clamp(1, u64::from(MAX_WEIGHT)) as u8)
    }

    pub fn get(self) -> u32 {
        u32::from(self.0)
    }
}

/// One peer as configured or discovered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    pub addr: SocketAddr,
    pub weight: Weight,
    /// The fixed in-flight ceiling; [`UNLIMITED`] for none.
    pub max_in_flight: u32,
    /// Reached over TLS, its certificate checked for this name; `None`: plain HTTP.
    pub tls: Option<String>,
    /// The models it serves (base models and adapters); `None`: any.
    pub models: Option<Vec<String>>,
}

impl PeerSpec {
    /// A peer at `addr` of weight one, without a ceiling, over plain HTTP, serving any model.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            weight: Weight::ONE,
            max_in_flight: UNLIMITED,
            tls: None,
            models: None,
        }
    }

    pub fn weight(self, weight: Weight) -> Self {
        Self { weight, ..self }
    }

    pub fn max_in_flight(self, max_in_flight: u32) -> Self {
        Self {
            max_in_flight,
            ..self
        }
    }

    /// Reached over TLS, its certificate checked for `name`.
    pub fn tls(self, name: impl Into<String>) -> Self {
        Self {
            tls: Some(name.into()),
            ..self
        }
    }

    /// Serving only `models`.
    pub fn models<S: Into<String>>(self, models: impl IntoIterator<Item = S>) -> Self {
        Self {
            models: Some(models.into_iter().map(Into::into).collect()),
            ..self
        }
    }
}

/// Peers in address order, each address once (the first listing wins): the one order every
/// cluster and every comparison of peer lists uses.
pub fn canonical(mut specs: Vec<PeerSpec>) -> Vec<PeerSpec> {
    specs.sort_by_key(|s| s.addr);
    specs.dedup_by_key(|s| s.addr);
    specs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_holds_its_range_by_construction() {
        assert_eq!(Weight::new(0), None);
        assert_eq!(Weight::new(101), None);
        assert_eq!(Weight::new(100).map(Weight::get), Some(100));
        assert_eq!(Weight::clamped(0).get(), 1);
        assert_eq!(Weight::clamped(65_535).get(), MAX_WEIGHT);
    }

    #[test]
    fn canonical_sorts_and_keeps_the_first_of_each_address() {
        let at = |port: u16, w: u32| {
            PeerSpec::new(([127, 0, 0, 1], port).into()).weight(Weight::new(w).unwrap())
        };
        assert_eq!(
            canonical(vec![at(3, 1), at(1, 2), at(3, 5)]),
            vec![at(1, 2), at(3, 1)]
        );
    }
}
