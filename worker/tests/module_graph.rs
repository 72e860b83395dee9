//! The library's top-level modules import each other without cycles (DESIGN §3.1 "no import
//! cycles"; the module map is in `src/lib.rs`).
//!
//! The test reads every source file of the library (`src/**/*.rs` except the binaries' `main.rs`
//! and `bin/`), strips comments and literals, and collects each `crate::<module>` path (with
//! `crate::{a, b::c}` groups, and `super::` paths that climb to the crate root). An edge
//! `a → b` is a file under module `a` naming module `b`. The graph of the modules declared in
//! `lib.rs` must be acyclic; a cycle fails with its path. Names that `lib.rs` re-exports under
//! another name (`pub use memory::pool;`) count as their target module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Source text with comments, string, char and byte literals blanked out (identifiers and
/// punctuation kept), so that a path in a doc comment or a message is not an import.
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c[i] == 'r' && (next == Some('"') || next == Some('#')) && !ident_before(&c, i) {
            // Raw string r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while c.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if c.get(j) != Some(&'"') {
                out.push(c[i]);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && (1..=hashes).all(|k| c.get(j + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
            out.push_str("\"\"");
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c[i] == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a): only literals are skipped.
            if next == Some('\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
                out.push_str("' '");
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                out.push('\'');
                i += 1;
            }
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

fn ident_before(c: &[char], i: usize) -> bool {
    i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_')
}

fn ident_at(s: &str) -> Option<&str> {
    let end = s
        .find(|ch: char| !(ch.is_alphanumeric() || ch == '_'))
        .unwrap_or(s.len());
    (end > 0).then(|| &s[..end])
}

/// The first segment of each path that follows `at` in `rest`: one identifier, or every item of
/// a `{...}` group.
fn first_segments(rest: &str) -> Vec<String> {
    let rest = rest.trim_start();
    if let Some(group) = rest.strip_prefix('{') {
        let mut items = Vec::new();
        let (mut depth, mut start) = (0usize, 0usize);
        for (k, ch) in group.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    items.push(&group[start..k]);
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&group[start..k]);
                    start = k + 1;
                }
                _ => {}
            }
        }
        items
            .iter()
            .filter_map(|it| ident_at(it.trim()))
            .map(str::to_owned)
            .collect()
    } else {
        ident_at(rest).map(str::to_owned).into_iter().collect()
    }
}

/// What a file names at the crate root, given its module path (`["roles", "decode"]` for
/// `src/roles/decode/mod.rs`): `(name, through_super)`. A `super::` chain is resolved from the
/// file's module, so one inside an inline module (`mod tests { use super::… }`) may land one level
/// too high: those names count only when they are modules.
fn named_modules(text: &str, module_path: &[String]) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let mut search = 0;
    while let Some(pos) = text[search..].find("crate::") {
        let at = search + pos;
        search = at + "crate::".len();
        if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
            continue; // e.g. `tandem_crate::`
        }
        out.extend(
            first_segments(&text[search..])
                .into_iter()
                .map(|n| (n, false)),
        );
    }
    let mut search = 0;
    while let Some(pos) = text[search..].find("super::") {
        let at = search + pos;
        search = at + "super::".len();
        if at > 0
            && (bytes[at - 1].is_ascii_alphanumeric()
                || bytes[at - 1] == b'_'
                || bytes[at - 1] == b':')
        {
            continue; // counted with the first `super::` of a chain
        }
        let mut ups = 1;
        let mut rest = &text[search..];
        while let Some(r) = rest.strip_prefix("super::") {
            ups += 1;
            rest = r;
        }
        // `super` climbs from the file's module; reaching the crate root names a top-level module.
        if ups == module_path.len() {
            out.extend(first_segments(rest).into_iter().map(|n| (n, true)));
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Top-level modules declared in `lib.rs`, and the root re-exports `pub use a::b;` (b → a).
fn lib_modules(lib: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let text = strip(lib);
    let mut modules = BTreeSet::new();
    let mut aliases = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        let line = line.strip_prefix("pub ").unwrap_or(line);
        if let Some(m) = line.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            modules.insert(m.trim().to_owned());
        } else if let Some(u) = line.strip_prefix("use ").and_then(|r| r.strip_suffix(';')) {
            let parts: Vec<&str> = u.split("::").map(str::trim).collect();
            if let (Some(first), Some(last)) = (parts.first(), parts.last()) {
                let first = if *first == "crate" { parts[1] } else { first };
                aliases.insert((*last).to_owned(), first.to_owned());
            }
        }
    }
    (modules, aliases)
}

/// The module graph of the library at `src`; panics on a name that is neither a module nor an
/// alias (the parser would otherwise miss edges silently).
fn library_graph(src: &Path) -> Graph {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let (modules, aliases) = lib_modules(&lib);
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph: Graph = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for file in files {
        let rel = file.strip_prefix(src).expect("under src");
        let mut path: Vec<String> = rel
            .iter()
            .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
            .collect();
        if path.last().is_some_and(|l| l == "mod") {
            path.pop();
        }
        let top = &path[0];
        if top == "lib" || top == "main" || top == "bin" {
            continue;
        }
        assert!(
            modules.contains(top),
            "{} is not under a module of lib.rs",
            rel.display()
        );
        let text = strip(&std::fs::read_to_string(&file).expect("source"));
        for (name, through_super) in named_modules(&text, &path) {
            let target = aliases.get(&name).cloned().unwrap_or(name.clone());
            if &target == top || (through_super && !modules.contains(&target)) {
                continue;
            }
            assert!(
                modules.contains(&target),
                "{} names crate::{name}, which is not a module of lib.rs",
                rel.display()
            );
            graph.get_mut(top).expect("top").insert(target);
        }
    }
    graph
}

/// A cycle of `graph` as a path `a → b → … → a`, if there is one.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(
        n: &str,
        graph: &Graph,
        marks: &mut BTreeMap<String, Mark>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        marks.insert(n.to_owned(), Mark::Open);
        stack.push(n.to_owned());
        for m in graph.get(n).into_iter().flatten() {
            match marks.get(m).copied().unwrap_or(Mark::New) {
                Mark::Open => {
                    let from = stack.iter().position(|s| s == m).expect("on stack");
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                Mark::New => {
                    if let Some(c) = visit(m, graph, marks, stack) {
                        return Some(c);
                    }
                }
                Mark::Done => {}
            }
        }
        stack.pop();
        marks.insert(n.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for n in graph.keys() {
        if marks.get(n).copied().unwrap_or(Mark::New) == Mark::New {
            let mut stack = Vec::new();
            if let Some(c) = visit(n, graph, &mut marks, &mut stack) {
                return Some(c);
            }
        }
    }
    None
}

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn top_level_modules_import_each_other_without_cycles() {
    let graph = library_graph(&src());
    let edges: usize = graph.values().map(BTreeSet::len).sum();
    for (from, to) in &graph {
        println!(
            "{from} -> {}",
            to.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    // The parser sees the imports it must (else an empty graph would pass).
    assert!(edges > 20, "only {edges} edges found");
    assert!(graph["roles"].contains("release") && graph["transfer"].contains("release"));
    assert!(
        graph["l3"].contains("memory"),
        "`crate::memory::pool` paths count as `memory`"
    );
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "import cycle between top-level modules: {}",
            cycle.join(" -> ")
        );
    }
}

#[test]
fn the_parser_finds_groups_super_paths_and_skips_comments_and_strings() {
    let text = strip(
        "use crate::{a::X, b};\n// crate::c\nlet s = \"crate::d\"; let r = r#\"crate::e\"#;\n\
         let ch = '\"'; fn f<'a>(x: &'a str) { crate::g::h(); }\n/* crate::i */ use super::super::j;",
    );
    let path = vec!["top".to_owned(), "sub".to_owned()];
    let mut found = named_modules(&text, &path);
    found.sort();
    let expected = [("a", false), ("b", false), ("g", false), ("j", true)];
    assert_eq!(found, expected.map(|(n, s)| (n.to_owned(), s)));
}

#[test]
fn the_cycle_check_reports_a_cycle_and_passes_a_dag() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g = Graph::new();
        for (a, b) in edges {
            g.entry((*a).to_owned())
                .or_default()
                .insert((*b).to_owned());
            g.entry((*b).to_owned()).or_default();
        }
        g
    };
    let dag = graph(&[
        ("roles", "release"),
        ("release", "memory"),
        ("roles", "memory"),
    ]);
    assert_eq!(find_cycle(&dag), None);
    let cyclic = graph(&[("memory", "pool"), ("pool", "model"), ("model", "memory")]);
    let cycle = find_cycle(&cyclic).expect("a cycle");
    assert_eq!(cycle.first(), cycle.last());
    assert_eq!(cycle.len(), 4, "{cycle:?}");
}
