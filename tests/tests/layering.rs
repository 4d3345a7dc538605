//! The daemon's modules depend on each other one way (docs/ARCHITECTURE.md): this test
//! reads every `crate::module` path in `daemon/src` (and `super::sibling` inside `store/`
//! and packctl's `bench/`) and fails on an import cycle or on an arrow from a lower layer
//! to a higher one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Every `.rs` file under `dir`, with the name of the module directly under `dir` it
/// belongs to.
fn files(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let p = entry.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                let rel = p.strip_prefix(dir).unwrap();
                let first = rel.components().next().unwrap().as_os_str().to_string_lossy();
                let module = first.trim_end_matches(".rs").to_string();
                out.push((module, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    out
}

/// Items the directory's module file (`index`) re-exports, by the module they come from
/// (`pub use budget::{A, B};` makes `A` and `B` stand for `budget`).
fn reexports(dir: &Path, index: &str) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(dir.join(format!("{index}.rs"))).unwrap_or_default();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.trim().strip_prefix("pub use ") else { continue };
        let Some((module, items)) = rest.split_once("::") else { continue };
        let items = items.trim_end_matches(';').trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',') {
            let name = item.trim().rsplit("::").next().unwrap_or("").trim();
            if !name.is_empty() {
                out.insert(name.to_string(), module.to_string());
            }
        }
    }
    out
}

/// The first path segment of each item a file imports or names through `prefix`.
fn named(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, p) in text.match_indices(prefix) {
        let rest = &text[at + p.len()..];
        if let Some(list) = rest.strip_prefix('{') {
            let end = list.find('}').unwrap_or(list.len());
            out.extend(list[..end].split(',').map(|s| s.trim().split("::").next().unwrap_or("").to_string()));
        } else {
            let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
            out.insert(rest[..end].to_string());
        }
    }
    out
}

/// Edges `module -> other` where a file of `module` names `prefix other` (or an item the
/// module file `index` re-exports from `other`).
fn graph(dir: &Path, prefix: &str, index: &str, skip: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    let all = files(dir);
    let via = reexports(dir, index);
    let modules: BTreeSet<String> = all.iter().map(|(m, _)| m.clone()).collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, text) in &all {
        if skip.contains(&module.as_str()) || module == index {
            continue;
        }
        for name in named(text, prefix) {
            let target = if modules.contains(&name) { Some(name) } else { via.get(&name).cloned() };
            if let Some(t) = target.filter(|t| t != module && !skip.contains(&t.as_str())) {
                g.entry(module.clone()).or_default().insert(t);
            }
        }
    }
    g
}

/// A cycle in `g`, if there is one.
fn cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            return Some(path[i..].to_vec());
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, g, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys().find_map(|n| visit(n, g, &mut Vec::new(), &mut done))
}

#[test]
fn the_daemon_modules_form_layers_without_cycles() {
    let g = graph(&root().join("daemon/src"), "crate::", "lib", &["main"]);
    assert_eq!(cycle(&g), None, "import cycle among daemon modules: {g:#?}");
    // The bottom layers never reach up.
    for low in ["sys", "source", "pack", "access", "limits"] {
        for high in ["store", "service", "dataplane", "control", "server", "persist", "config"] {
            assert!(!g.get(low).is_some_and(|d| d.contains(high)), "{low} depends on {high}: {g:#?}");
        }
    }
    assert!(
        !g.get("store")
            .is_some_and(|d| d.iter().any(|m| ["service", "dataplane", "control", "server"].contains(&m.as_str())))
    );
}

#[test]
fn the_store_and_the_benchmarks_have_no_cycles_inside() {
    let store = graph(&root().join("daemon/src/store"), "super::", "mod", &["tests"]);
    assert_eq!(cycle(&store), None, "import cycle inside the store: {store:#?}");
    let bench = graph(&root().join("packctl/src/bench"), "super::", "mod", &[]);
    assert_eq!(cycle(&bench), None, "import cycle among packctl's benchmarks: {bench:#?}");
}
