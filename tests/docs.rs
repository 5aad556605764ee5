//! The documents' links hold: every relative link in `README.md` and `docs/*.md` names a file
//! that exists, and every `#anchor` a heading of the document it names, as GitHub makes
//! anchors. The docs move sections between files as runs age into their history files; a link
//! left pointing at the old place would otherwise break silently.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files
}

/// GitHub's anchor for a heading's text: lower case, with everything but letters, digits,
/// `-`, `_` and spaces dropped and each space made a hyphen.
fn slug(text: &str) -> String {
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// A document's anchors (a repeated heading's get `-1`, `-2`, ...) and the links it holds.
struct Document {
    anchors: BTreeSet<String>,
    links: Vec<String>,
}

fn read(path: &Path) -> Document {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut anchors = BTreeSet::new();
    let mut repeats = BTreeMap::<String, usize>::new();
    let mut links = Vec::new();
    let mut heading: Option<String> = None;
    for event in Parser::new_ext(&text, Options::ENABLE_TABLES) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                let base = slug(&heading.take().unwrap_or_default());
                let n = repeats.entry(base.clone()).or_default();
                anchors.insert(match *n {
                    0 => base,
                    n => format!("{base}-{n}"),
                });
                *n += 1;
            }
            Event::Start(Tag::Link { dest_url, .. }) => links.push(dest_url.into_string()),
            _ => {}
        }
    }
    Document { anchors, links }
}

#[test]
fn anchors_are_made_as_github_makes_them() {
    assert_eq!(
        slug("`least_cost`, pools and the prompt record, 2026-12-02"),
        "least_cost-pools-and-the-prompt-record-2026-12-02"
    );
    assert_eq!(
        slug("Every router with -sps 0: 2026-12-06 (×3)"),
        "every-router-with--sps-0-2026-12-06-3"
    );
    let doc = "# Runs\n\n## Memory\n\n### Memory\n\n[a](#memory-1) [b](other.md#x)\n";
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("doc.md");
    std::fs::write(&path, doc).unwrap();
    let read = read(&path);
    assert_eq!(
        read.anchors.into_iter().collect::<Vec<_>>(),
        ["memory", "memory-1", "runs"]
    );
    assert_eq!(read.links, ["#memory-1", "other.md#x"]);
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut docs: BTreeMap<PathBuf, Document> = documents()
        .into_iter()
        .map(|p| (p.canonicalize().unwrap(), read(&p)))
        .collect();
    let mut checked = 0;
    let mut broken = Vec::new();
    let sources: Vec<PathBuf> = docs.keys().cloned().collect();
    for source in &sources {
        let links = docs[source].links.clone();
        for link in links {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, anchor) = match link.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (link.as_str(), None),
            };
            let target = if file.is_empty() {
                source.clone()
            } else {
                match source.parent().unwrap().join(file).canonicalize() {
                    Ok(target) => target,
                    Err(_) => {
                        broken.push(format!("{}: {link}: no such file", source.display()));
                        continue;
                    }
                }
            };
            // Anchors into other files (a source line's) are GitHub's to make, not a heading's.
            let Some(anchor) = anchor.filter(|_| target.extension().is_some_and(|e| e == "md"))
            else {
                continue;
            };
            let named = docs
                .entry(target.clone())
                .or_insert_with(|| read(&target))
                .anchors
                .contains(anchor);
            if !named {
                broken.push(format!("{}: {link}: no such heading", source.display()));
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} relative links found: the reading is broken"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
