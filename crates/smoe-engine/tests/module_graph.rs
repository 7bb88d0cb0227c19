//! The engine's top-level modules depend on each other in one direction only: a `crate::X`
//! path in module A is an edge A → X, and the graph of those edges has no cycle. (A cycle is how
//! a layer of the engine starts to know about the one above it: the store about the GPU decoder,
//! the GPU blocks about the executors.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable src dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a source file belongs to (`src/store/cache.rs` → `store`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next().expect("a component");
    let name = first.as_os_str().to_string_lossy();
    name.trim_end_matches(".rs").to_string()
}

/// `crate::X` paths in code (not comments) of one file.
fn uses(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            let after = &rest[i + "crate::".len()..];
            let name: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
            rest = after;
        }
    }
    out
}

/// The names `lib.rs` re-exports at the crate root (`pub use module::{A, B}`), with the module
/// each comes from, so that `crate::A` counts as a use of that module.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        let names = names.trim_matches(|c: char| c == '{' || c == '}' || c.is_whitespace());
        for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            out.insert(name.to_string(), module.trim().to_string());
        }
    }
    out
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    rust_files(&src, &mut files);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(&src, f)).collect();
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let roots = reexports(&lib);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let from = module_of(&src, f);
        if from == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("readable source");
        for used in uses(&text) {
            let to = roots.get(&used).cloned().unwrap_or(used);
            if to != from && modules.contains(&to) {
                edges.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    edges
}

/// A cycle through `start`, if any (depth-first).
fn cycle_from(
    g: &BTreeMap<String, BTreeSet<String>>,
    start: &str,
    at: &str,
    path: &mut Vec<String>,
) -> Option<Vec<String>> {
    for next in g.get(at).into_iter().flatten() {
        if next == start {
            let mut c = path.clone();
            c.push(start.to_string());
            return Some(c);
        }
        if !path.contains(next) {
            path.push(next.clone());
            if let Some(c) = cycle_from(g, start, next, path) {
                return Some(c);
            }
            path.pop();
        }
    }
    None
}

#[test]
fn top_level_modules_form_no_cycle() {
    let g = graph();
    let cycles: Vec<String> = g
        .keys()
        .filter_map(|m| cycle_from(&g, m, m, &mut vec![m.clone()]))
        .map(|c| c.join(" → "))
        .collect();
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_check_sees_edges_and_cycles() {
    let text = "use crate::store::Experts; // crate::gpu in a comment\nlet x = crate::spec::X;";
    assert_eq!(
        uses(text),
        BTreeSet::from(["store".to_string(), "spec".to_string()])
    );
    let roots =
        reexports("pub mod a;\npub use engine::{Engine, Session};\npub use error::EngineError;");
    assert_eq!(roots["Session"], "engine");
    assert_eq!(roots["EngineError"], "error");
    let g = BTreeMap::from([
        ("a".to_string(), BTreeSet::from(["b".to_string()])),
        ("b".to_string(), BTreeSet::from(["a".to_string()])),
    ]);
    assert!(cycle_from(&g, "a", "a", &mut vec!["a".into()]).is_some());
}
