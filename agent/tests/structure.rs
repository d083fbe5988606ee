//! The shape that keeps "one module, one job" (DEVELOPERS.md) true as the code grows,
//! read from the source (laid out by rustfmt, which `scripts/test` enforces): no
//! modules anywhere in the workspace import each other in a circle, at any level of
//! any crate (what two modules share has a module of its own), no function is over 100
//! lines (a long job is split into named steps), and no source file of the workspace's
//! crates, the tests crate aside, is over 800 lines. Test-only code (`#[cfg(test)]`
//! modules, inline or in their own files) is not held to these.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// The longest function allowed, in lines (signature to closing brace).
const MAX_FUNCTION_LINES: usize = 100;

/// The longest source file allowed, in lines.
const MAX_FILE_LINES: usize = 800;

/// The crates whose files are held to `MAX_FILE_LINES` (the tests crate is not).
const CRATES: &[&str] =
    &["agent", "ebpf/common", "ebpf/programs", "iptables-compat", "proto", "tests/lb-standin"];

/// Every module tree of the workspace whose imports must hold no circle: each crate's
/// library (binaries aside: `bin/`), the benchmark binary, whose modules live in
/// `tests/src/bench` (`#[path]`) with that folder as their crate root, and the
/// socket-LB stand-in's kernel object (`tests/lb-standin/src/kernel`).
const MODULE_TREES: &[(&str, &[&str])] = &[
    ("agent/src", &["bin"]),
    ("ebpf/common/src", &[]),
    ("ebpf/programs/src", &["bin"]),
    ("iptables-compat/src", &["bin"]),
    ("proto/src", &[]),
    ("tests/src", &["bin", "bench"]),
    ("tests/src/bench", &[]),
    // The socket-LB stand-in: its shared types (library), and its kernel object's
    // modules, a crate of their own rooted at `kernel/main.rs`.
    ("tests/lb-standin/src", &["kernel"]),
    ("tests/lb-standin/src/kernel", &[]),
];

/// A module path under `src/` (`cni/plugin.rs` → `["cni", "plugin"]`, `lib.rs` → `[]`).
type ModulePath = Vec<String>;

struct Source {
    /// Relative to its crate's `src/`.
    file: PathBuf,
    module: ModulePath,
    /// Its lines in all.
    lines: usize,
    /// The code that ships: the file without its `#[cfg(test)]` items.
    text: String,
}

/// `text` without its `#[cfg(test)]` items (rustfmt puts an item's closing brace at the
/// indentation of its first line), and the modules it declares test-only (`mod x;`).
fn shipping(text: &str) -> (String, Vec<String>) {
    let (mut out, mut test_modules) = (String::new(), Vec::new());
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim() != "#[cfg(test)]" {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let indent = &line[..line.len() - line.trim_start().len()];
        let Some(item) = lines.by_ref().find(|l| !l.trim_start().starts_with("#[")) else { break };
        if let Some(name) = item.trim().strip_prefix("mod ").and_then(|m| m.strip_suffix(';')) {
            test_modules.push(name.to_string());
        } else if !item.trim_end().ends_with(';') && !item.trim_end().ends_with('}') {
            let close = format!("{indent}}}");
            lines.by_ref().find(|l| l.trim_end() == close);
        }
    }
    (out, test_modules)
}

/// The source files of a crate (`crate_dir` relative to the workspace), test-only files
/// left out.
fn sources_of(crate_dir: &str) -> Vec<Source> {
    sources_in(&format!("{crate_dir}/src"), &[])
}

/// The source files under `root` (relative to the workspace) but for the top-level
/// folders `skip`, as modules of a crate rooted there; test-only files left out.
fn sources_in(root: &str, skip: &[&str]) -> Vec<Source> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(root);
    let mut out = Vec::new();
    let mut test_only = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if dir == src && skip.iter().any(|s| path.file_name().is_some_and(|n| n == *s)) {
                    continue;
                }
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let file = path.strip_prefix(&src).unwrap().to_path_buf();
                let mut module: ModulePath =
                    file.with_extension("").iter().map(|p| p.to_string_lossy().into_owned()).collect();
                if matches!(module.last().map(String::as_str), Some("lib" | "main" | "mod")) {
                    module.pop();
                }
                let whole = std::fs::read_to_string(&path).unwrap();
                let (text, tests) = shipping(&whole);
                test_only.extend(tests.into_iter().map(|name| [module.clone(), vec![name]].concat()));
                out.push(Source { file, module, lines: whole.lines().count(), text });
            }
        }
    }
    out.retain(|s| !test_only.iter().any(|t| s.module.starts_with(t)));
    out
}

/// The agent's source files.
fn sources() -> Vec<Source> {
    let out = sources_of("agent");
    assert!(out.len() > 50, "found only {} source files in the agent", out.len());
    out
}

/// The paths a use tree at the start of `s` names, to the depth it names them:
/// `a::b::{c, d::{e}}, f` → `a::b::c`, `a::b::d::e`; a path in code (`a::b::f(..)`) is
/// one path.
fn use_tree(s: &str) -> Vec<Vec<String>> {
    let path: String = s.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
    let prefix: Vec<String> =
        path.split("::").filter(|p| !p.is_empty() && *p != "self").map(String::from).collect();
    let Some(group) = s[path.len()..].strip_prefix('{') else { return vec![prefix] };
    // The group's items, split at its own commas, each a use tree of its own.
    let (mut depth, mut items, mut item) = (0, Vec::new(), String::new());
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut item));
                continue;
            }
            _ => {}
        }
        item.push(c);
    }
    items.push(item);
    let items = items.iter().map(|i| i.split_whitespace().collect::<String>()).filter(|i| !i.is_empty());
    items.flat_map(|i| use_tree(&i)).map(|tail| [prefix.clone(), tail].concat()).collect()
}

/// The module paths `source` refers to through `crate::` and `super::` (the module
/// itself or an item in it; resolved against the modules there are later).
fn references(source: &Source) -> Vec<ModulePath> {
    let code: String =
        source.text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
    let parent = &source.module[..source.module.len().saturating_sub(1)];
    let mut out = Vec::new();
    for (prefix, base) in [("crate::", &[][..]), ("super::", parent)] {
        for (at, _) in code.match_indices(prefix) {
            if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                continue; // `super::super::`, or part of a longer path
            }
            out.extend(use_tree(&code[at + prefix.len()..]).into_iter().map(|p| [base.to_vec(), p].concat()));
        }
    }
    out
}

/// Per folder (a module with children, the crate's root among them), which of its
/// children import which: an edge `a → b` when something in `a` (or under it) refers to
/// something in `b` (or under it). A module's use of its own parent or children is not
/// an edge between siblings and is not counted.
fn imports(sources: &[Source]) -> BTreeMap<ModulePath, BTreeMap<String, BTreeSet<String>>> {
    let modules: BTreeSet<ModulePath> = sources.iter().map(|s| s.module.clone()).collect();
    let mut graphs: BTreeMap<ModulePath, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for source in sources {
        for mut target in references(source) {
            while !target.is_empty() && !modules.contains(&target) {
                target.pop();
            }
            let common = source.module.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common >= source.module.len() || common >= target.len() {
                continue;
            }
            graphs
                .entry(source.module[..common].to_vec())
                .or_default()
                .entry(source.module[common].clone())
                .or_default()
                .insert(target[common].clone());
        }
    }
    graphs
}

/// The circles in `graphs`, at least one per group of modules that reach each other,
/// each as `folder: a → b → a`.
fn circles(graphs: &BTreeMap<ModulePath, BTreeMap<String, BTreeSet<String>>>) -> Vec<String> {
    let mut circles = Vec::new();
    for (folder, edges) in graphs {
        for start in edges.keys() {
            // Depth-first from `start`, looking for a way back to it through modules no
            // less than it (so a circle is reported from its least module).
            let mut stack = vec![vec![start.clone()]];
            let mut seen = BTreeSet::new();
            while let Some(path) = stack.pop() {
                let last = path.last().unwrap();
                for next in edges.get(last).into_iter().flatten() {
                    if next == start {
                        let folder =
                            if folder.is_empty() { "(crate root)".to_string() } else { folder.join("/") };
                        circles.push(format!("{folder}: {} → {start}", path.join(" → ")));
                    } else if next > start && seen.insert(next.clone()) {
                        stack.push([path.clone(), vec![next.clone()]].concat());
                    }
                }
            }
        }
    }
    circles
}

/// The functions of `source` over `MAX_FUNCTION_LINES` (`file:line fn name: n lines`),
/// and how many functions it has.
fn long_functions(source: &Source) -> (Vec<String>, usize) {
    let (mut long, mut functions) = (Vec::new(), 0);
    let lines: Vec<&str> = source.text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let signature = trimmed
            .trim_start_matches("pub ")
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ")
            .trim_start_matches("const ")
            .trim_start_matches("async ")
            .trim_start_matches("unsafe ")
            .trim_start_matches("extern \"C\" ");
        let Some(name) = signature.strip_prefix("fn ") else { continue };
        let name: String = name.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        // A declaration without a body (`;`) or a body on one line (`}`) is short.
        let opened = lines[i..].iter().map(|l| l.trim_end()).find(|l| l.ends_with(['{', ';', '}']));
        if !opened.is_some_and(|l| l.ends_with('{')) {
            functions += 1;
            continue;
        }
        // rustfmt closes a function at the indentation it opened it.
        let close = format!("{indent}}}");
        let Some(end) = lines[i..].iter().position(|l| *l == close) else { continue };
        functions += 1;
        if end + 1 > MAX_FUNCTION_LINES {
            long.push(format!("{}:{} fn {name}: {} lines", source.file.display(), i + 1, end + 1));
        }
    }
    (long, functions)
}

#[test]
fn no_modules_import_each_other_in_a_circle_anywhere_in_the_workspace() {
    let mut found = Vec::new();
    for (root, skip) in MODULE_TREES {
        let graphs = imports(&sources_in(root, skip));
        if *root == "agent/src" {
            let edges = |folder: &[&str], module: &str| {
                let folder: ModulePath = folder.iter().map(|f| f.to_string()).collect();
                graphs.get(&folder).is_some_and(|g| g.contains_key(module))
            };
            assert!(edges(&["node", "cni"], "plugin"), "the agent's node/cni imports were not found");
            assert!(edges(&[], "cmd"), "the agent's top-level imports were not found");
        }
        found.extend(circles(&graphs).into_iter().map(|c| format!("{root}: {c}")));
    }
    assert!(found.is_empty(), "modules importing each other in a circle:\n{}", found.join("\n"));
}

/// The node's identity (`sidecar/config/node.rs`) is settings: it must not reach into
/// Envoy's bootstrap, which reads those settings (once an import circle, config/node →
/// envoy/bootstrap → envoy/bootstrap/options → config/node).
#[test]
fn the_nodes_settings_do_not_import_envoys_bootstrap() {
    let sources = sources();
    let node =
        sources.iter().find(|s| s.module == ["sidecar", "config", "node"]).expect("sidecar/config/node.rs");
    let into_envoy: Vec<String> = references(node)
        .into_iter()
        .filter(|r| r.starts_with(&["sidecar".to_string(), "envoy".to_string()]))
        .map(|r| r.join("::"))
        .collect();
    assert!(into_envoy.is_empty(), "config/node.rs refers to {into_envoy:?}");
}

#[test]
fn no_function_is_over_100_lines() {
    let (mut long, mut functions) = (Vec::new(), 0);
    for dir in CRATES {
        for source in sources_of(dir) {
            let (over, n) = long_functions(&source);
            long.extend(over.into_iter().map(|l| format!("{dir}/src/{l}")));
            functions += n;
        }
    }
    assert!(functions > 500, "found only {functions} functions");
    assert!(long.is_empty(), "functions over {MAX_FUNCTION_LINES} lines:\n{}", long.join("\n"));
}

#[test]
fn no_source_file_is_over_800_lines() {
    let mut long = Vec::new();
    let mut files = 0;
    for dir in CRATES {
        for source in sources_of(dir) {
            files += 1;
            if source.lines > MAX_FILE_LINES {
                long.push(format!("{dir}/src/{}: {} lines", source.file.display(), source.lines));
            }
        }
    }
    assert!(files > 80, "found only {files} source files");
    assert!(long.is_empty(), "files over {MAX_FILE_LINES} lines:\n{}", long.join("\n"));
}

/// The checks themselves, on made-up sources: each finds what it looks for.
mod checks {
    use super::*;

    fn source(file: &str, text: &str) -> Source {
        let module: ModulePath = file.trim_end_matches(".rs").split('/').map(String::from).collect();
        let (text, _) = shipping(text);
        Source { file: file.into(), module, lines: text.lines().count(), text }
    }

    #[test]
    fn a_circle_between_two_modules_of_a_folder_is_found() {
        let plugin = source("cni/plugin.rs", "use super::{repair::repair_id, spec::NetConf};\n");
        let repair = source("cni/repair.rs", "use super::plugin;\nfn f() { plugin::capture() }\n");
        let spec = source("cni/spec.rs", "pub struct NetConf;\n");
        let graphs = imports(&[plugin, repair, spec]);
        assert_eq!(circles(&graphs), ["cni: plugin → repair → plugin"]);
        // Through a third module, and through `crate::` paths.
        let a = source("x/a.rs", "use crate::x::b::B;\n");
        let b = source("x/b.rs", "fn f() -> super::c::C { todo!() }\n");
        let c = source("x/c.rs", "use crate::x::{a, d};\n");
        let d = source("x/d.rs", "");
        assert_eq!(circles(&imports(&[a, b, c, d])), ["x: a → b → c → a"]);
        // One way only is no circle.
        let a = source("x/a.rs", "use super::b;\n");
        let b = source("x/b.rs", "// use super::a;\n");
        assert!(circles(&imports(&[a, b])).is_empty());
    }

    #[test]
    fn a_circle_through_folders_at_the_crate_root_is_found_and_parent_and_child_are_not_one() {
        // The loop issue 47 found: build_info → cli, cli → capture/run → build_info.
        let build_info = source("build_info.rs", "pub fn print(a: &crate::cli::VersionArgs) {}\n");
        let cli = source("cli.rs", "use crate::capture::run;\n");
        let capture = source("capture.rs", "pub mod run;\n");
        let run = source("capture/run.rs", "fn f() { crate::build_info::print() }\n");
        let graphs = imports(&[build_info, cli, capture, run]);
        assert_eq!(circles(&graphs), ["(crate root): build_info → cli → capture → build_info"]);
        // A folder module using its child, and the child its parent, are no circle.
        let node = source("node.rs", "fn f() { crate::node::cni::add() }\n");
        let cni = source("node/cni.rs", "use super::Settings;\nuse crate::node::Settings as S;\n");
        assert!(circles(&imports(&[node, cni])).is_empty());
    }

    #[test]
    fn a_function_over_the_limit_is_found_and_test_code_is_not_held_to_it() {
        let body = "    let x = 1;\n".repeat(MAX_FUNCTION_LINES - 2);
        let at_limit = source("a.rs", &format!("pub async fn fits() {{\n{body}}}\n"));
        assert_eq!(long_functions(&at_limit), (vec![], 1));
        let text = format!(
            "trait T {{\n    fn declared(&self);\n    fn short(&self) {{}}\n}}\n\nimpl S {{\n    fn long(&self) {{\n{body}    let y = 2;\n    }}\n}}\n"
        );
        let (long, functions) = long_functions(&source("b.rs", &text));
        assert_eq!((long, functions), (vec![format!("b.rs:7 fn long: {} lines", MAX_FUNCTION_LINES + 1)], 3));
        let test_only = format!(
            "fn f() {{}}\n\n#[cfg(test)]\nmod tests {{\n    fn long() {{\n{body}    let y = 2;\n    }}\n}}\n"
        );
        assert_eq!(long_functions(&source("c.rs", &test_only)), (vec![], 1));
    }

    #[test]
    fn only_test_items_are_left_out() {
        let text = "mod a;\n#[cfg(test)]\nmod tests;\n#[cfg(test)]\n#[allow(dead_code)]\nfn helper() {\n    1;\n}\nfn ships() {}\n#[cfg(test)]\nmod inline {\n    fn t() {}\n}\nfn also_ships() {}\n";
        let (code, test_modules) = shipping(text);
        assert_eq!(code, "mod a;\nfn ships() {}\nfn also_ships() {}\n");
        assert_eq!(test_modules, ["tests"]);
    }
}
