//! The workspace's crates and the daemon's modules depend on each other one way
//! (docs/ARCHITECTURE.md). This test reads every `.rs` file of the daemon library — the
//! crate root and every folder's index (`mod.rs`) included — resolves every `crate::`,
//! `super::` and `self::` path to the module it names (through the indexes' `pub use`
//! re-exports), and fails on:
//!
//! - an import cycle among the daemon's top-level modules, or among the modules of any
//!   folder (`store/`, `dataplane/`, `control/`, `persist/`, `pack/`, …), of the kernels crate and
//!   of packctl's `bench/`;
//! - an arrow from a lower layer to a higher one, for every top-level module; the crate
//!   root (`lib.rs`) is the bottom layer: what it defined every module could use, so it
//!   imports nothing (a handle to everything kept there would reach up to both planes);
//! - a workspace crate depending on a workspace crate ARCHITECTURE.md does not allow;
//! - in every crate, a module importing what its folder's index (`lib.rs`, `main.rs`,
//!   `mod.rs`) defines: an index is its folder's table of contents (module declarations,
//!   re-exports), the top of its folder, so an arrow to it is an arrow up. The one
//!   exception is a hub ARCHITECTURE.md names ([`HUBS`]: the store's `Inner`, which its
//!   children's `impl` blocks extend). What an index re-exports from another crate it does
//!   not define;
//! - in every crate, its `sys` (the bottom floor: system calls, FFI) importing anything of
//!   its crate outside `sys`.
//!
//! The daemon's crate root is its bottom layer (it defines nothing). Modules declared inline
//! (`mod avx2 { … }`) are read as modules of their own. The cycle check runs among each
//! folder's children. Items under `#[cfg(test)]` (and the
//! files of test modules declared so) and comments are not read; what follows a test item
//! is. Every crate of the workspace is checked: a new member is checked as soon as it is
//! listed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// The daemon's layers, bottom up (ARCHITECTURE.md "Inside the daemon"). A module may use
/// modules of its own layer or below; the cycle check keeps same-layer arrows one way.
const LAYERS: &[&[&str]] = &[
    &["lib", "sys"],
    &["access", "limits", "source", "key", "pack", "ratelog", "telemetry"],
    &["store", "blocking"],
    &["service"],
    &["dataplane", "control", "persist"],
    &["config", "metrics"],
    &["server"],
];

fn layer_of(module: &str) -> usize {
    LAYERS.iter().position(|l| l.contains(&module)).unwrap_or_else(|| {
        panic!("daemon module {module} is in no layer: add it to LAYERS here and to ARCHITECTURE.md")
    })
}

/// One source file: its module path (`["store", "flight"]`; `[]` for the crate root),
/// whether it is an index (`lib.rs`, `mod.rs`: its children are named without a prefix),
/// and its text without test modules.
struct File {
    module: Vec<String>,
    index: bool,
    text: String,
    /// The whole file, tests included.
    raw: String,
}

/// Every `.rs` file under `dir` (a crate's `src`), but for binaries' `main.rs`.
fn files(dir: &Path) -> Vec<File> {
    let mut out = Vec::new();
    for p in rs_files(dir) {
        let rel = p.strip_prefix(dir).unwrap();
        let mut module: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
        let last = module.pop().unwrap();
        let index = matches!(last.as_str(), "lib.rs" | "mod.rs" | "main.rs");
        match last.as_str() {
            // A binary beside a library is a crate of its own; a binary alone is the root.
            "main.rs" if module.is_empty() && p.with_file_name("lib.rs").exists() => continue,
            "lib.rs" | "mod.rs" | "main.rs" => {}
            other => module.push(other.trim_end_matches(".rs").to_string()),
        }
        let raw = std::fs::read_to_string(&p).unwrap();
        let text = without_tests(&raw);
        // Comments name modules without using them.
        let text: String = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
        inline_modules(File { module, index, text, raw }, &mut out);
    }
    // Files of test modules declared elsewhere (`#[cfg(test)] mod tests;`) are not read.
    let tests: BTreeSet<Vec<String>> = out.iter().flat_map(test_modules).collect();
    out.retain(|f| !tests.contains(&f.module));
    out
}

/// `f`, and each module it declares inline (`mod avx2 { … }`) as a file of its own, so
/// that a `super::` inside one names `f`'s module.
fn inline_modules(mut f: File, out: &mut Vec<File>) {
    while let Some((at, name)) = f.text.match_indices("mod ").find_map(|(at, _)| {
        let before = f.text[..at].chars().next_back();
        let rest = &f.text[at + 4..];
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let open = rest[name.len()..].trim_start().starts_with('{');
        (before.is_none_or(|c| !(c.is_alphanumeric() || c == '_')) && !name.is_empty() && open).then_some((at, name))
    }) {
        let Some(end) = item_end(&f.text[at..]) else { break };
        let body = f.text[at..at + end].to_string();
        let inner = body[body.find('{').unwrap() + 1..body.len() - 1].to_string();
        f.text.replace_range(at..at + end, "");
        let mut module = f.module.clone();
        module.push(name);
        inline_modules(File { module, index: false, text: inner, raw: String::new() }, out);
    }
    out.push(f);
}

/// The modules `f` declares under `#[cfg(test)]` without a body (their files are tests).
fn test_modules(f: &File) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    for (at, _) in f.raw.match_indices("#[cfg(test)]") {
        let rest = &f.raw[at + "#[cfg(test)]".len()..];
        let item = item_end(rest).map_or(rest, |end| &rest[..end]);
        let path = item.split("#[path = \"").nth(1).and_then(|p| p.split('"').next());
        let Some(name) = item.trim_end().strip_suffix(';').and_then(|i| i.rsplit("mod ").next()) else { continue };
        // `mod x;` is `x` under this module; `#[path]` names a file beside this one.
        let mut module = f.module.clone();
        if path.is_some() && !f.index {
            module.pop();
        }
        module.push(path.map_or(name.trim(), |p| p.trim_end_matches(".rs")).to_string());
        found.push(module);
    }
    found
}

/// Where the item that starts `text` (after an attribute: more attributes, then the item)
/// ends: after its first `;` or its first `{…}` block at depth 0, string and character
/// literals and comments skipped.
fn item_end(text: &str) -> Option<usize> {
    let b = text.as_bytes();
    let (mut i, mut depth) = (0, 0usize);
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'r' if b.get(i + 1) == Some(&b'#') && (i == 0 || !b[i - 1].is_ascii_alphanumeric()) => {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                let close = format!("\"{}", "#".repeat(hashes));
                i += 1 + hashes + 1;
                i += text[i.min(text.len())..].find(&close).map_or(b.len(), |e| e + close.len()) - 1;
            }
            b'\'' if b.get(i + 2) == Some(&b'\'') || (b.get(i + 1) == Some(&b'\\') && b.get(i + 3) == Some(&b'\'')) => {
                i += if b[i + 1] == b'\\' { 3 } else { 2 };
            }
            b'[' | b'(' => depth += 1,
            b']' | b')' => depth = depth.saturating_sub(1),
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            b';' if depth == 0 => return Some(i + 1),
            _ => {}
        }
        i += 1;
    }
    None
}

/// `text` without the items under `#[cfg(test)]`.
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        rest = item_end(after).map_or("", |end| &after[end..]);
    }
    out.push_str(rest);
    out
}

/// The paths a file names: each `crate::…`, `super::…` or `self::…` (and, in an index,
/// `child::…` for each of `children`, as `self::child::…`), as segments, with `{a, b::c}`
/// groups expanded one level.
fn paths(text: &str, children: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let bare: Vec<String> = children.iter().map(|c| format!("{c}::")).collect();
    let starts = ["crate::", "super::", "self::"].into_iter().map(str::to_string).chain(bare);
    for start in starts {
        let start = start.as_str();
        for (at, _) in text.match_indices(start) {
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_' || bytes[at - 1] == b':') {
                continue;
            }
            let rest = &text[at..];
            let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
            let mut head: Vec<String> = rest[..end].split("::").filter(|s| !s.is_empty()).map(str::to_string).collect();
            if !["crate::", "super::", "self::"].contains(&start) {
                head.insert(0, "self".to_string());
            }
            if rest[end..].starts_with('!') && start == "crate::" {
                // A `#[macro_export]` macro is named at the crate root but defined in a
                // module: the arrow goes to that module.
                if let Some(name) = head.get(1) {
                    out.push(vec!["macro!".to_string(), name.clone()]);
                }
                continue;
            }
            if rest[end..].starts_with('{') {
                let group = &rest[end + 1..];
                let close = group.find('}').unwrap_or(group.len());
                for item in group[..close].split(',') {
                    let mut p = head.clone();
                    p.extend(item.trim().split("::").map(|s| s.trim().to_string()).filter(|s| !s.is_empty()));
                    out.push(p);
                }
            } else {
                out.push(head);
            }
        }
    }
    out
}

/// A crate's modules and its indexes' re-exports.
struct Crate {
    files: Vec<File>,
    modules: BTreeSet<Vec<String>>,
    /// (index module, item) → the child module it comes from (empty: another crate).
    reexports: BTreeMap<(Vec<String>, String), Vec<String>>,
}

impl Crate {
    fn read(src: &Path) -> Self {
        let files = files(src);
        let modules: BTreeSet<Vec<String>> = files.iter().map(|f| f.module.clone()).collect();
        let mut reexports = BTreeMap::new();
        for f in &files {
            for line in f.text.lines() {
                let Some(rest) = line.trim().strip_prefix("pub use ") else { continue };
                let Some((child, items)) = rest.split_once("::") else { continue };
                let mut from = f.module.clone();
                from.push(child.to_string());
                // What an index re-exports of another crate (`pub use packd_kernels::Dtype`)
                // it does not define: it resolves to nothing of this crate.
                let external = !modules.contains(&from) && !["crate", "self", "super"].contains(&child);
                if !modules.contains(&from) && !external {
                    continue;
                }
                let items = items.trim_end_matches(';').trim_start_matches('{').trim_end_matches('}');
                for item in items.split(',') {
                    let name = item.trim().rsplit(' ').next().unwrap_or("").rsplit("::").next().unwrap_or("").trim();
                    if !name.is_empty() {
                        reexports.insert(
                            (f.module.clone(), name.to_string()),
                            if external { Vec::new() } else { from.clone() },
                        );
                    }
                }
            }
        }
        Crate { files, modules, reexports }
    }

    /// The module a path named from `module` resolves to (the deepest module it names,
    /// an item re-exported by an index counting as its child's; a macro, the module that
    /// defines it).
    fn resolve(&self, module: &[String], path: &[String]) -> Option<Vec<String>> {
        let mut at: Vec<String> = Vec::new();
        let mut segs = path.iter().peekable();
        match segs.next()?.as_str() {
            "macro!" => {
                let rule = format!("macro_rules! {}", segs.next()?);
                return self.files.iter().find(|f| f.text.contains(&rule)).map(|f| f.module.clone());
            }
            "crate" => {}
            "self" => at = module.to_vec(),
            "super" => {
                at = module.to_vec();
                at.pop()?;
                while segs.peek().is_some_and(|s| *s == "super") {
                    segs.next();
                    at.pop()?;
                }
            }
            _ => return None,
        }
        for seg in segs {
            let mut next = at.clone();
            next.push(seg.clone());
            if self.modules.contains(&next) {
                at = next;
            } else if let Some(child) = self.reexports.get(&(at.clone(), seg.clone())) {
                if child.is_empty() {
                    return None;
                }
                at = child.clone();
                break;
            } else {
                break;
            }
        }
        Some(at)
    }

    /// Arrows between modules: for every folder (the crate root included), which of its
    /// children uses which, where `"index"` is the folder's own file.
    fn graphs(&self) -> BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> {
        let mut out: BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
        for f in &self.files {
            let children: Vec<String> = if f.index {
                self.modules
                    .iter()
                    .filter(|m| m.len() == f.module.len() + 1 && m.starts_with(&f.module))
                    .map(|m| m[f.module.len()].clone())
                    .collect()
            } else {
                Vec::new()
            };
            for path in paths(&f.text, &children) {
                let Some(target) = self.resolve(&f.module, &path) else { continue };
                let common = f.module.iter().zip(&target).take_while(|(a, b)| a == b).count();
                let child = |m: &[String]| m.get(common).cloned().unwrap_or_else(|| "index".to_string());
                let (from, to) = (child(&f.module), child(&target));
                if from != to {
                    out.entry(f.module[..common].to_vec()).or_default().entry(from).or_default().insert(to);
                }
            }
        }
        out
    }
}

/// Folders whose index defines the state its children extend (crate, folder), which
/// ARCHITECTURE.md names.
const HUBS: &[(&str, &str)] = &[("daemon", "store")];

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

/// What a crate's problems are: cycles in any folder, and (for the daemon) upward arrows.
fn problems(src: &Path, layered: bool) -> Vec<String> {
    let krate = Crate::read(src);
    let mut found = Vec::new();
    for (folder, g) in krate.graphs() {
        let name = if folder.is_empty() { "the crate root".to_string() } else { folder.join("/") };
        // A folder's index is its hub (see the top of this file): the cycle check runs
        // among its children, and at the crate root the index is the bottom layer.
        let mut children = g.clone();
        if !(layered && folder.is_empty()) {
            children.remove("index");
            for targets in children.values_mut() {
                targets.remove("index");
            }
        }
        if let Some(c) = cycle(&children) {
            found.push(format!("import cycle in {name}: {}", c.join(" -> ")));
        }
        // An index is its folder's table of contents: what it defines, its children do not
        // import (but in a hub ARCHITECTURE.md names).
        let indexed = krate.files.iter().any(|f| f.index && f.module == folder);
        if indexed && !HUBS.iter().any(|(c, f)| src.ends_with(format!("{c}/src")) && folder.join("/") == *f) {
            for (from, targets) in &g {
                // (`sys` up to the crate root is the `sys` rule's, below.)
                if from != "index" && targets.contains("index") && !(folder.is_empty() && from == "sys") {
                    let index =
                        if folder.is_empty() { "the crate root".to_string() } else { format!("{name}'s index") };
                    found.push(format!("{from} imports what {index} defines"));
                }
            }
        }
        // A crate's `sys` is its bottom floor: it imports nothing of its crate above it.
        if folder.is_empty()
            && let Some(up) = g.get("sys")
        {
            for to in up {
                let to = if to == "index" { "the crate root" } else { to };
                found.push(format!("sys imports {to}, above it"));
            }
        }
        if layered && folder.is_empty() {
            for (from, targets) in &g {
                let from_layer = layer_of(if from == "index" { "lib" } else { from });
                for to in targets {
                    let to_layer = layer_of(if to == "index" { "lib" } else { to });
                    if to_layer > from_layer {
                        found.push(format!("{from} (layer {from_layer}) reaches up to {to} (layer {to_layer})"));
                    }
                }
            }
        }
    }
    found
}

#[test]
fn the_daemon_modules_form_layers_without_cycles_in_any_folder() {
    let found = problems(&root().join("daemon/src"), true);
    assert!(found.is_empty(), "the daemon's modules:\n{}", found.join("\n"));
    // Every top-level module has a layer (a new one must be placed).
    for f in files(&root().join("daemon/src")) {
        if let Some(top) = f.module.first() {
            layer_of(top);
        }
    }
}

/// The workspace's members, as the root manifest lists them.
fn members() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let line = text.lines().find(|l| l.trim_start().starts_with("members")).expect("workspace members");
    line.split('"').skip(1).step_by(2).map(str::to_string).collect()
}

#[test]
fn every_crate_of_the_workspace_has_no_cycles_inside() {
    let members = members();
    assert!(members.len() >= 13 && members.contains(&"interpose".to_string()), "{members:?}");
    let mut checked = 0;
    for m in &members {
        let src = root().join(m).join("src");
        if !src.is_dir() {
            continue;
        }
        let found = problems(&src, m == "daemon");
        assert!(found.is_empty(), "{m}:\n{}", found.join("\n"));
        checked += 1;
    }
    assert_eq!(checked, members.len(), "every member has a src/ to check");
}

#[test]
fn the_checker_sees_an_upward_import_and_a_cycle() {
    // The checker itself: a store module naming the server, and two dataplane files naming
    // each other, are found (so a green run means something).
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    for (path, text) in [
        ("lib.rs", "pub mod store;\npub mod server;\npub mod dataplane;\n"),
        ("store/mod.rs", "mod flight;\npub use flight::Leader;\n"),
        ("store/flight.rs", "use crate::server::Wiring;\npub struct Leader;\n"),
        ("server/mod.rs", "pub struct Wiring;\n"),
        ("dataplane/mod.rs", "mod a;\nmod b;\n"),
        ("dataplane/a.rs", "use super::b::B;\npub struct A;\n"),
        ("dataplane/b.rs", "use super::a::A;\npub struct B;\n"),
    ] {
        let p = src.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let found = problems(src, true);
    assert!(found.iter().any(|p| p.contains("store (layer 2) reaches up to server")), "{found:?}");
    assert!(found.iter().any(|p| p.contains("import cycle in dataplane")), "{found:?}");
}

#[test]
fn the_checker_sees_a_sys_module_reaching_up() {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in [
        ("lib.rs", "mod cache;\nmod sys;\npub struct State;\n"),
        ("cache.rs", "pub struct Cache;\n"),
        ("sys/mod.rs", "pub mod hooks;\npub use hooks::hook;\n"),
        ("sys/hooks.rs", "use crate::cache::Cache;\nuse crate::State;\npub fn hook() {}\n"),
    ] {
        let p = dir.path().join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let found = problems(dir.path(), false);
    assert_eq!(found, ["sys imports cache, above it", "sys imports the crate root, above it"], "{found:?}");
}

#[test]
fn the_checker_sees_a_module_importing_its_index() {
    // An item defined in an index and used by a child is found, in a plain crate and in a
    // folder; another crate's item re-exported by the index, `super::` inside an inline
    // module, and an exported macro (named at the root, defined in a module) are not.
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in [
        ("lib.rs", "mod conn;\nmod wire;\nmod simd;\nmod entry;\npub use other_crate::Shared;\npub enum Error {}\n"),
        ("conn.rs", "use crate::Error;\nuse crate::Shared;\nuse crate::wire::Frame;\n"),
        ("entry.rs", "#[macro_export]\nmacro_rules! say { ($($t:tt)*) => {}; }\n"),
        ("wire.rs", "pub struct Frame;\nfn f() {\n    crate::say!(\"x\");\n}\n"),
        ("simd/mod.rs", "mod x86;\npub enum IsaKind {}\n"),
        ("simd/x86.rs", "use super::IsaKind;\nfn f() {}\nmod avx2 {\n    use super::f;\n}\n"),
    ] {
        let p = dir.path().join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let found = problems(dir.path(), false);
    assert_eq!(
        found,
        ["conn imports what the crate root defines", "x86 imports what simd's index defines"],
        "{found:?}"
    );
}

#[test]
fn the_checker_reads_past_test_items_and_skips_only_them() {
    // Code after a `#[cfg(test)]` item is read; the item itself, and a test module's file
    // (`#[cfg(test)] mod tests;`), are not.
    let plant = |flight: &str| {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in [
            ("lib.rs", "pub mod store;\npub mod server;\n"),
            (
                "store/mod.rs",
                "#[cfg(test)]\nmod tests;\nmod flight;\n#[cfg(test)]\nmod inline {\n    use crate::server::Wiring;\n    \
                 fn f() -> &'static str { \"}\" }\n}\npub use flight::Leader;\n",
            ),
            ("store/tests.rs", "use crate::server::Wiring;\n"),
            ("store/flight.rs", flight),
            ("server/mod.rs", "pub struct Wiring;\n"),
        ] {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        problems(dir.path(), true)
    };
    let hidden = plant("#[cfg(test)]\nfn t() -> char { '{' }\nuse crate::server::Wiring;\npub struct Leader;\n");
    assert_eq!(hidden, ["store (layer 2) reaches up to server (layer 6)"], "{hidden:?}");
    let clean = plant("#[cfg(test)]\nfn t() -> char { '{' }\npub struct Leader;\n");
    assert!(clean.is_empty(), "test items and test files counted: {clean:?}");
}

/// The workspace crates each crate depends on (`[dependencies]` and
/// `[build-dependencies]`, by package name).
fn crate_deps(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).unwrap();
    let mut out = BTreeSet::new();
    let mut in_deps = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            // Every kind: normal, build and dev, for any target.
            in_deps = line.ends_with("dependencies]");
            continue;
        }
        if !in_deps || line.starts_with('#') {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else { continue };
        let name = value
            .split_once("package")
            .and_then(|(_, p)| p.split('"').nth(1))
            .map_or_else(|| key.trim().trim_end_matches(".workspace").to_string(), str::to_string);
        if name.starts_with("packd") || name == "packctl" {
            out.insert(name);
        }
    }
    out
}

#[test]
fn the_crates_depend_on_each_other_only_as_architecture_md_allows() {
    // ARCHITECTURE.md's arrows.
    let allowed: &[(&str, &str, &[&str])] = &[
        ("proto", "packd-proto", &[]),
        ("client", "packd-client", &["packd-proto"]),
        ("interpose", "packd-interpose", &["packd-client"]),
        ("xnnpack", "packd-xnnpack", &["packd-client", "packd-interpose"]),
        ("xnnpack/preload", "packd-xnnpack-preload", &["packd-xnnpack", "packd-interpose"]),
        ("llama", "packd-llama", &["packd-client", "packd-interpose"]),
        ("litert", "packd-litert", &["packd-client", "packd-interpose"]),
        ("onnxruntime", "packd-onnxruntime", &["packd-client", "packd-interpose"]),
        ("onnxruntime/c", "packd-onnxruntime-c", &["packd-onnxruntime", "packd-interpose"]),
        ("capi", "packd-capi", &["packd-xnnpack", "packd-client"]),
        ("kernels", "packd-kernels", &[]),
        ("daemon", "packd", &["packd-proto", "packd-kernels"]),
        ("python", "packd-python", &["packd-client", "packd-xnnpack", "packd-litert", "packd-onnxruntime"]),
        ("testkit", "packd-testkit", &["packd", "packd-proto"]),
        ("packctl", "packctl", &["packd-client", "packd-proto", "packd-testkit", "packd"]),
        ("tests", "packd-tests", &["packd", "packd-client", "packd-proto", "packd-testkit"]),
    ];
    // Dev-dependencies drawn apart: xnnpack's unit tests start the daemon with the suite's
    // helpers.
    let dev: &[(&str, &str)] = &[("xnnpack", "packd-tests")];
    let listed: BTreeSet<&str> = allowed.iter().map(|(dir, ..)| *dir).collect();
    for m in members() {
        assert!(listed.contains(m.as_str()), "crate {m} has no arrows here: add them (and to ARCHITECTURE.md)");
    }
    for (dir, name, may) in allowed {
        let deps = crate_deps(&root().join(dir).join("Cargo.toml"));
        let extra: Vec<&String> = deps
            .iter()
            .filter(|d| !may.contains(&d.as_str()) && d.as_str() != *name && !dev.contains(&(*dir, d.as_str())))
            .collect();
        assert!(extra.is_empty(), "{name} depends on {extra:?}, which ARCHITECTURE.md does not allow it");
    }
    // And the document says so.
    let doc = std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap();
    for line in [
        "packd (daemon) → packd-proto, packd-kernels",
        "packd-client   → packd-proto",
        "packd-testkit  → packd, packd-proto",
        "packd-tests    → packd, packd-client, packd-proto, packd-testkit",
        "packd-xnnpack (tests) → packd-tests",
        "packd-interpose → packd-client",
        "packd-xnnpack  → packd-client, packd-interpose",
        "packd-llama    → packd-client, packd-interpose",
        "packd-litert   → packd-client, packd-interpose",
        "packd-onnxruntime → packd-client, packd-interpose",
        "packd-onnxruntime-c → packd-onnxruntime, packd-interpose",
        "python         → packd-client, packd-xnnpack, packd-litert, packd-onnxruntime",
    ] {
        assert!(doc.contains(line), "ARCHITECTURE.md lost the arrow {line:?}");
    }
    // Nothing in the daemon library or the client depends on the test kit.
    for dir in ["daemon", "client"] {
        assert!(!crate_deps(&root().join(dir).join("Cargo.toml")).contains("packd-testkit"), "{dir} uses the testkit");
    }
    // packctl uses the daemon library's modules that ARCHITECTURE.md names, no others.
    let used = daemon_modules_used(&root().join("packctl/src"));
    let named = ["pack", "source", "key", "persist::cache", "sys::memfd", "sys::proc"];
    let other: Vec<&String> = used.iter().filter(|m| !named.iter().any(|n| m.starts_with(n))).collect();
    assert!(other.is_empty(), "packctl uses the daemon's {other:?}, which ARCHITECTURE.md does not allow it");
    for n in named {
        assert!(doc.contains(&format!("`{n}`")), "ARCHITECTURE.md does not name packctl's use of `{n}`");
    }
}

#[test]
fn the_crate_checks_see_every_dependency_kind_and_packctls_daemon_modules() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("Cargo.toml");
    std::fs::write(
        &manifest,
        "[dependencies]\npackd-client.workspace = true\n[dev-dependencies]\npackd-tests = { path = \"../tests\" }\n\
         [target.'cfg(unix)'.dependencies]\nx = { package = \"packd-proto\", path = \"../proto\" }\n",
    )
    .unwrap();
    let deps: Vec<String> = crate_deps(&manifest).into_iter().collect();
    assert_eq!(deps, ["packd-client", "packd-proto", "packd-tests"]);
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("bench")).unwrap();
    std::fs::write(src.join("main.rs"), "use packd::config::Config;\n#[cfg(test)]\nuse packd::server::X;\n").unwrap();
    std::fs::write(src.join("bench/a.rs"), "let m = packd::persist::cache::read(p);\nlet n = mypackd::sys::x();\n")
        .unwrap();
    let used: Vec<String> = daemon_modules_used(&src).into_iter().collect();
    assert_eq!(used, ["config", "persist::cache"]);
}

/// The daemon library's modules (`pack`, `persist::cache`, …) the code under `src` names.
fn daemon_modules_used(src: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for f in files_with_main(src) {
        for (at, _) in f.match_indices("packd::") {
            if at > 0 && (f.as_bytes()[at - 1].is_ascii_alphanumeric() || f.as_bytes()[at - 1] == b'_') {
                continue;
            }
            let rest = &f[at + "packd::".len()..];
            let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
            let path: Vec<&str> = rest[..end].split("::").filter(|s| !s.is_empty()).collect();
            // A module path: lower-case segments, up to two deep.
            let module: Vec<&str> = path
                .iter()
                .take_while(|s| s.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
                .take(2)
                .copied()
                .collect();
            if !module.is_empty() {
                out.insert(module.join("::"));
            }
        }
    }
    out
}

/// The text of every `.rs` file under `src`, `main.rs` included, tests cut.
fn files_with_main(src: &Path) -> Vec<String> {
    rs_files(src).iter().map(|p| without_tests(&std::fs::read_to_string(p).unwrap())).collect()
}

/// Every `.rs` file under `dir`.
fn rs_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let p = entry.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }
    out
}

/// What a library crate's code says when it builds an error from a message it formats
/// (the error is then a string, not a type): an error variant given `format!(…)`, a
/// `(reason, String)` tuple as a `Result`'s error, or a variant that only passes a string
/// through (`#[error("{0}")] V(String)`), or a closure that makes one of any string. Strings
/// that are data (a name, a path, the daemon's or the caller's own words) are fields of
/// typed variants. (`std::io::Error`'s own custom errors are left alone: its type is std's.)
fn stringly_errors(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut at = 0;
    while let Some(i) = flat[at..].find("format!(") {
        let i = at + i;
        at = i + 1;
        // What the formatted text is handed to: `X::Y(format!(` or `X::Y { f: format!(`,
        // or `X::io(format!(`.
        let before = flat[..i].trim_end();
        let before = before.strip_suffix('(').map(str::trim_end).or_else(|| {
            let b = before.strip_suffix(':')?;
            let open = b.rfind('{')?;
            (!b[open..].contains('}')).then(|| b[..open].trim_end())
        });
        let Some(before) = before else { continue };
        let callee = before.rsplit(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).next().unwrap_or("");
        let mut parts = callee.rsplit("::");
        let (last, owner) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let is_error =
            ["Error", "Fault", "Refused", "Refusal", "Why", "Private", "Lost"].iter().any(|e| owner.ends_with(e));
        let variant = last.chars().next().is_some_and(char::is_uppercase) || last == "io";
        if is_error && variant {
            found.push(format!("{callee} is given a formatted message"));
        }
    }
    for (i, _) in flat.match_indices(", String)>") {
        if flat[..i].rfind("Result<").is_some_and(|r| !flat[r..i].contains(';')) {
            found.push("a Result's error is a tuple with a String".to_string());
        }
    }
    // A closure that makes an error of any string it is given (`|reason: String| E::V { reason }`).
    for (i, _) in flat.match_indices(": String|") {
        let made = flat[i + ": String|".len()..].trim_start();
        let head = made.split(['(', '{', ';']).next().unwrap_or("");
        let std_io = head.trim().starts_with("io::Error") || head.trim().starts_with("std::io::Error");
        if (head.contains("Error::") || head.contains("Fault::")) && !std_io {
            found.push(format!("a closure makes {} of any String", head.trim()));
        }
    }
    for (i, _) in flat.match_indices("#[error(\"{0}\")]") {
        let next = flat[i..].split_once(")]").map_or("", |(_, rest)| rest.trim_start());
        if next.split_once('(').is_some_and(|(_, rest)| rest.starts_with("String)")) {
            let name = next.split('(').next().unwrap_or("");
            found.push(format!("{name} only passes a String through"));
        }
    }
    found
}

/// Where a library crate may pass words from outside through an error: the adapter kit's
/// `Why::Given` carries packd's answer (`Acquired::Private`) or the caller's own reason
/// (`Why::Engine`, the engine's words at a named step, is a typed variant the rules pass).
const WORDS_FROM_OUTSIDE: &[(&str, &str)] = &[("interpose/src/ledger.rs", "Given only passes a String through")];

#[test]
fn no_library_crate_builds_an_error_from_a_formatted_message() {
    let mut found = Vec::new();
    for m in members() {
        if ["tests", "testkit", "packctl"].contains(&m.as_str()) {
            continue; // not libraries a worker or the service links
        }
        let src = root().join(&m).join("src");
        for p in rs_files(&src) {
            let rel = p.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
            let raw = std::fs::read_to_string(&p).unwrap();
            if test_files(&src).contains(&p) {
                continue;
            }
            let text: String =
                without_tests(&raw).lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
            for f in stringly_errors(&text) {
                if !WORDS_FROM_OUTSIDE.contains(&(rel.as_str(), f.as_str())) {
                    found.push(format!("{rel}: {f}"));
                }
            }
        }
    }
    assert!(found.is_empty(), "errors made of strings:\n{}", found.join("\n"));
}

/// The files of test modules under `src` (`#[cfg(test)] mod tests;`).
fn test_files(src: &Path) -> BTreeSet<PathBuf> {
    let all = files(src);
    let read: BTreeSet<Vec<String>> = all.iter().map(|f| f.module.clone()).collect();
    rs_files(src)
        .into_iter()
        .filter(|p| {
            let rel = p.strip_prefix(src).unwrap();
            let mut module: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            let last = module.pop().unwrap();
            if !matches!(last.as_str(), "lib.rs" | "mod.rs" | "main.rs") {
                module.push(last.trim_end_matches(".rs").to_string());
            }
            !read.contains(&module)
        })
        .collect()
}

#[test]
fn the_checker_sees_errors_made_of_strings() {
    let planted = "fn a() -> Result<(), (Fallback, String)> { Err((Fallback::Other, \"x\".into())) }\n\
                   fn b(n: u64) -> SourceError { SourceError::Format(format!(\"bad {n}\")) }\n\
                   fn c(p: &str) -> ServerError { ServerError::Usage { what: format!(\"{p}\") } }\n\
                   fn d(p: &str) -> impl Fn(io::Error) -> ServerError { ServerError::io(format!(\"binding {p}\")) }\n\
                   #[derive(Debug, thiserror::Error)]\nenum E {\n    #[error(\"{0}\")]\n    Said(String),\n}\n\
                   fn e(t: &T) { let err = |reason: String| PlanError::Tensor { tensor: t.name.clone(), reason }; }\n\
                   fn fine(n: u64) -> String { let msg = format!(\"{n}\"); Report::private(\"e\", &msg) }\n";
    let found = stringly_errors(planted);
    assert_eq!(
        found,
        [
            "SourceError::Format is given a formatted message",
            "ServerError::Usage is given a formatted message",
            "ServerError::io is given a formatted message",
            "a Result's error is a tuple with a String",
            "a closure makes PlanError::Tensor of any String",
            "Said only passes a String through",
        ],
        "{found:?}"
    );
}
