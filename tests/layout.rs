//! The shape of the source tree, checked so that it does not drift back: imports between files
//! point one way (no circle), the routing core imports nothing outside itself, and no source
//! file grows past 400 lines. The graph is read from the text: every `crate::` and `super::`
//! path outside comments and unit tests, and a `mod.rs`'s re-exports of its children.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 400;

/// A file's module path: `routing/policy` for `src/routing/policy/mod.rs`.
type Module = Vec<String>;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn module_of(root: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(root).unwrap().with_extension("");
    let mut parts: Module = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The code of a file without comments and without its `#[cfg(test)] mod tests`.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(at) => &l[..at],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Every path that starts at `crate::` or `super::`, braces expanded one level.
fn paths(code: &str, module: &Module) -> Vec<Module> {
    let mut found = Vec::new();
    for start in ["crate::", "super::"] {
        for (at, _) in code.match_indices(start) {
            if code[..at].chars().last().is_some_and(is_ident) {
                continue;
            }
            let rest = &code[at..];
            let end = rest
                .find(|c: char| !(is_ident(c) || c == ':'))
                .unwrap_or(rest.len());
            let mut segs: Vec<&str> = rest[..end].split("::").filter(|s| !s.is_empty()).collect();
            let mut base: Module = Vec::new();
            if segs[0] == "super" {
                base = module.clone();
                // `super` from `a/b.rs` is `a`; from `a/b/mod.rs` (module `a/b`) also `a`.
                base.pop();
                segs.remove(0);
                while segs.first() == Some(&"super") {
                    base.pop();
                    segs.remove(0);
                }
            } else {
                segs.remove(0);
            }
            let prefix: Module = base
                .into_iter()
                .chain(segs.iter().map(|s| s.to_string()))
                .collect();
            if rest[end..].starts_with('{') {
                let inner = &rest[end + 1..rest.find('}').unwrap_or(rest.len())];
                for item in inner.split(',') {
                    let first = item.trim().split("::").next().unwrap_or("").trim();
                    if !first.is_empty() && first != "self" {
                        let mut p = prefix.clone();
                        p.push(first.to_owned());
                        found.push(p);
                    }
                }
            }
            found.push(prefix);
        }
    }
    found
}

/// `pub use child::…` in a `mod.rs` (or `lib.rs`): the parent depends on that child.
fn reexported_children(code: &str) -> Vec<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let l = l.strip_prefix("use ")?;
            let l = l.strip_prefix("self::").unwrap_or(l);
            let (first, _) = l.split_once("::")?;
            Some(first.to_owned())
        })
        .collect()
}

fn graph() -> (BTreeMap<Module, BTreeSet<Module>>, BTreeMap<Module, usize>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    let modules: BTreeMap<Module, PathBuf> = files
        .iter()
        .map(|f| (module_of(&root, f), f.clone()))
        .collect();
    let resolve = |path: &Module| -> Option<Module> {
        (0..=path.len())
            .rev()
            .map(|n| path[..n].to_vec())
            .find(|m| modules.contains_key(m))
    };
    let mut edges = BTreeMap::new();
    let mut lines = BTreeMap::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).unwrap();
        lines.insert(module.clone(), text.lines().count());
        let code = code(&text);
        let is_mod_file = file
            .file_name()
            .is_some_and(|n| n == "mod.rs" || n == "lib.rs" || n == "main.rs");
        let mut targets = BTreeSet::new();
        for path in paths(&code, module) {
            if let Some(t) = resolve(&path) {
                if &t != module && !t.is_empty() {
                    targets.insert(t);
                }
            }
        }
        if is_mod_file {
            for child in reexported_children(&code) {
                let mut path = module.clone();
                path.push(child);
                if modules.contains_key(&path) {
                    targets.insert(path);
                }
            }
        }
        edges.insert(module.clone(), targets);
    }
    (edges, lines)
}

/// A circle through `from`, if any: the path back to it.
fn circle(
    edges: &BTreeMap<Module, BTreeSet<Module>>,
    from: &Module,
    at: &Module,
    seen: &mut BTreeSet<Module>,
    path: &mut Vec<Module>,
) -> bool {
    for next in &edges[at] {
        if next == from {
            return true;
        }
        if seen.insert(next.clone()) {
            path.push(next.clone());
            if circle(edges, from, next, seen, path) {
                return true;
            }
            path.pop();
        }
    }
    false
}

#[test]
fn imports_between_files_point_one_way() {
    let (edges, _) = graph();
    assert!(
        edges.values().map(BTreeSet::len).sum::<usize>() > 100,
        "the import graph was not read"
    );
    for module in edges.keys() {
        let mut path = vec![module.clone()];
        if circle(&edges, module, module, &mut BTreeSet::new(), &mut path) {
            let names: Vec<String> = path.iter().map(|m| m.join("/")).collect();
            panic!("an import circle: {} -> back", names.join(" -> "));
        }
    }
}

#[test]
fn the_routing_core_imports_nothing_outside_it() {
    let (edges, _) = graph();
    for (module, targets) in &edges {
        if module.first().map(String::as_str) != Some("routing") {
            continue;
        }
        for t in targets {
            assert_eq!(
                t.first().map(String::as_str),
                Some("routing"),
                "{} imports {}",
                module.join("/"),
                t.join("/")
            );
        }
    }
}

#[test]
fn no_source_file_is_longer_than_400_lines() {
    let (_, lines) = graph();
    let long: Vec<String> = lines
        .iter()
        .filter(|(_, n)| **n > MAX_LINES)
        .map(|(m, n)| format!("{} ({n})", m.join("/")))
        .collect();
    assert!(long.is_empty(), "over {MAX_LINES} lines: {long:?}");
}
