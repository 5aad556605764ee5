//! Pools by model: which peers serve which model (a base model or a LoRA adapter on it).
//!
//! A model's name is interned once, as a [`ModelId`] that stays the same across every cluster
//! of a router, so a request can carry it (in its [`super::Demand`]) through rebuilds. A peer
//! lists the models it serves, or lists none and serves any: with no peer listing any, there
//! are no pools and the model is not looked at.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

/// A model's interned name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelId(u32);

impl ModelId {
    /// A model no peer lists: only the peers that list none may serve it.
    pub const UNLISTED: ModelId = ModelId(u32::MAX);
}

/// The names interned so far; only grows, by the names peers list (never by requests).
#[derive(Debug, Default)]
pub struct ModelNames {
    ids: ArcSwap<HashMap<String, ModelId>>,
    writer: Mutex<()>,
}

impl ModelNames {
    /// The id of a name some peer listed at some time.
    pub fn get(&self, name: &str) -> Option<ModelId> {
        self.ids.load().get(name).copied()
    }

    /// The ids of `names`, sorted, interning the new ones.
    pub fn intern(&self, names: &[String]) -> Vec<ModelId> {
        let _one_at_a_time = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let mut ids = HashMap::clone(&self.ids.load());
        let mut out: Vec<ModelId> = names
            .iter()
            .map(|n| {
                let next = ModelId(ids.len() as u32);
                *ids.entry(n.clone()).or_insert(next)
            })
            .collect();
        self.ids.store(Arc::new(ids));
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// The models a peer lists, as written and interned.
#[derive(Debug)]
pub struct Listed {
    names: Vec<String>,
    ids: Vec<ModelId>,
}

impl Listed {
    pub fn new(names: &[String], interned: &ModelNames) -> Self {
        Self {
            names: names.to_vec(),
            ids: interned.intern(names),
        }
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The ids of the names, sorted.
    pub fn ids(&self) -> &[ModelId] {
        &self.ids
    }
}

/// What a request may be served by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolChoice {
    /// Any peer: no pools, or no model asked for and no default.
    Any,
    Model(ModelId),
    /// No peer serves the model.
    Unknown,
}

/// The pools of one cluster: the models its peers list.
#[derive(Debug, Default)]
pub struct Pools {
    /// Every model some member lists, by name.
    listed: Vec<(String, ModelId)>,
    /// Whether some member lists none (and so serves any model).
    open: bool,
    /// Each listed model's waiting line, by id: the smallest id of the models the very same
    /// members serve. A base model and the adapters on the same engines want the same slots,
    /// so they wait in one line, first come, first served.
    lines: Vec<(ModelId, ModelId)>,
}

impl Pools {
    pub fn new(names: &ModelNames, members: impl Iterator<Item = Option<Vec<String>>>) -> Self {
        let mut listed = BTreeMap::new();
        // The members serving each listed model, and those that list none (serving all).
        let mut members_of: BTreeMap<ModelId, Vec<usize>> = BTreeMap::new();
        let mut open_members = Vec::new();
        let mut any_listed = false;
        for (member, models) in members.enumerate() {
            match models {
                Some(models) => {
                    any_listed = true;
                    for id in names.intern(&models) {
                        members_of.entry(id).or_default().push(member);
                    }
                    for name in &models {
                        if let Some(id) = names.get(name) {
                            listed.insert(name.clone(), id);
                        }
                    }
                }
                None => open_members.push(member),
            }
        }
        let mut first_with: BTreeMap<Vec<usize>, ModelId> = BTreeMap::new();
        let lines = members_of
            .into_iter()
            .map(|(id, mut serving)| {
                serving.extend(&open_members);
                serving.sort_unstable();
                (id, *first_with.entry(serving).or_insert(id))
            })
            .collect();
        Self {
            open: !open_members.is_empty() || !any_listed,
            listed: listed.into_iter().collect(),
            lines,
        }
    }

    /// The waiting line of a request for `model`: see `lines`.
    pub fn line_of(&self, model: Option<ModelId>) -> Option<ModelId> {
        let model = model?;
        let line = self.lines.binary_search_by_key(&model, |&(id, _)| id);
        Some(line.map_or(model, |at| self.lines[at].1))
    }

    /// Whether any member lists its models: without, nothing is routed by model.
    pub fn active(&self) -> bool {
        !self.listed.is_empty()
    }

    /// The models the members list, by name (sorted).
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.listed.iter().map(|(name, _)| name.as_str())
    }

    /// The pool of a request for `model` (or `default`, when it names none).
    pub fn choose(&self, model: Option<&str>, default: Option<&str>) -> PoolChoice {
        if !self.active() {
            return PoolChoice::Any;
        }
        let Some(name) = model.or(default) else {
            return PoolChoice::Any;
        };
        match self.listed.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
            Ok(i) => PoolChoice::Model(self.listed[i].1),
            Err(_) if self.open => PoolChoice::Model(ModelId::UNLISTED),
            Err(_) => PoolChoice::Unknown,
        }
    }
}

/// Whether a peer that lists `served` (sorted; `None`: lists none) serves `model`.
pub fn serves(served: Option<&[ModelId]>, model: ModelId) -> bool {
    match served {
        None => true,
        Some(_) if model == ModelId::UNLISTED => false,
        Some(ids) => ids.binary_search(&model).is_ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(names: &[&str]) -> Option<Vec<String>> {
        Some(names.iter().map(|n| n.to_string()).collect())
    }

    #[test]
    fn names_keep_their_ids_across_pools() {
        let names = ModelNames::default();
        let first = Pools::new(&names, [list(&["a", "b"]), list(&["c"])].into_iter());
        let second = Pools::new(&names, [list(&["c"]), list(&["b"])].into_iter());
        for model in ["b", "c"] {
            assert_eq!(
                first.choose(Some(model), None),
                second.choose(Some(model), None)
            );
        }
        assert_eq!(first.models().collect::<Vec<_>>(), ["a", "b", "c"]);
        assert_eq!(second.choose(Some("a"), None), PoolChoice::Unknown);
    }

    #[test]
    fn models_on_the_same_members_share_a_line() {
        let names = ModelNames::default();
        // Two engines with a base model and an adapter, one with another model, one open.
        let pools = Pools::new(
            &names,
            [
                list(&["base", "adapter"]),
                list(&["adapter", "base"]),
                list(&["other"]),
            ]
            .into_iter(),
        );
        let id = |n| names.get(n);
        assert_eq!(pools.line_of(id("adapter")), pools.line_of(id("base")));
        assert_ne!(pools.line_of(id("other")), pools.line_of(id("base")));
        assert_eq!(pools.line_of(None), None);
        // A member serving only one of them: their slots differ, and so do their lines.
        let apart = Pools::new(
            &names,
            [list(&["base", "adapter"]), list(&["base"]), None].into_iter(),
        );
        assert_ne!(apart.line_of(id("adapter")), apart.line_of(id("base")));
        assert_eq!(
            apart.line_of(Some(ModelId::UNLISTED)),
            Some(ModelId::UNLISTED)
        );
    }

    #[test]
    fn without_listed_models_every_request_goes_anywhere() {
        let names = ModelNames::default();
        let pools = Pools::new(&names, [None, None].into_iter());
        assert!(!pools.active());
        assert_eq!(pools.choose(Some("x"), Some("y")), PoolChoice::Any);
    }

    #[test]
    fn a_model_nobody_lists_goes_to_peers_that_list_none_or_nowhere() {
        let names = ModelNames::default();
        let closed = Pools::new(&names, [list(&["a"])].into_iter());
        assert_eq!(closed.choose(Some("zz"), None), PoolChoice::Unknown);
        assert_eq!(closed.choose(None, None), PoolChoice::Any);
        let a = names.get("a").unwrap();
        assert_eq!(closed.choose(None, Some("a")), PoolChoice::Model(a));
        let open = Pools::new(&names, [list(&["a"]), None].into_iter());
        assert_eq!(
            open.choose(Some("zz"), None),
            PoolChoice::Model(ModelId::UNLISTED)
        );
        assert!(serves(None, ModelId::UNLISTED));
        assert!(!serves(Some(&[a]), ModelId::UNLISTED));
        assert!(serves(Some(&[a]), a));
    }
}
