//! Dependencies between the crate's modules point one way: the
//! configuration depends on the runtime modules, never back, and no module
//! reaches itself through others — at the top level, and among the
//! modules of each folder. This reads the sources and fails with the graph
//! and the cycle when that stops being true.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module → the top-level modules its code names (`crate::x`).
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap().flatten() {
        let path = entry.path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if ["lib", "main", "testing"].contains(&name.as_str()) {
            continue;
        }
        let deps: &mut BTreeSet<String> = graph.entry(name.clone()).or_default();
        for file in rust_files(&path) {
            let text = std::fs::read_to_string(&file).unwrap();
            // Test modules may reach anywhere; only the shipped code counts.
            if file.components().any(|c| c.as_os_str() == "tests") || file.ends_with("tests.rs") {
                continue;
            }
            for line in text.lines() {
                let code = line.split("//").next().unwrap_or("");
                for (i, _) in code.match_indices("crate::") {
                    let rest = &code[i + "crate::".len()..];
                    let module: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !module.is_empty() && module != name && module != "testing" {
                        deps.insert(module);
                    }
                }
            }
        }
    }
    graph
}

fn rust_files(path: &Path) -> Vec<std::path::PathBuf> {
    if path.is_file() {
        return vec![path.to_path_buf()];
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(path).unwrap().flatten() {
        out.extend(rust_files(&entry.path()));
    }
    out.retain(|p| p.extension().is_some_and(|e| e == "rs"));
    out
}

/// A cycle through `from`, as the path of modules, if there is one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        node: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_owned());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = walk(graph, next, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|start| walk(graph, start, &mut Vec::new(), &mut done))
}

#[test]
fn modules_depend_on_each_other_one_way() {
    let graph = graph();
    let shown: String = graph
        .iter()
        .map(|(m, deps)| {
            format!(
                "{m} -> {}\n",
                deps.iter().cloned().collect::<Vec<_>>().join(" ")
            )
        })
        .collect();
    println!("{shown}");
    assert_eq!(cycle(&graph), None, "module graph:\n{shown}");
}

#[test]
fn the_configuration_is_not_a_dependency_of_what_it_builds() {
    let graph = graph();
    for runtime in [
        "identity",
        "client_ip",
        "edge",
        "limits",
        "metrics",
        "routes",
        "respond",
    ] {
        let deps = &graph[runtime];
        assert!(
            !deps.contains("config"),
            "{runtime} depends on config: {deps:?}"
        );
    }
}

/// The modules of `folder` (module path `module`, e.g. `limits::redis`) →
/// the sibling modules their shipped code names, as `crate::module::x` or
/// through `super::`.
fn folder_graph(folder: &Path, module: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut children: BTreeMap<String, Vec<std::path::PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(folder).unwrap().flatten() {
        let path = entry.path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "mod"
            || name == "tests"
            || (path.is_file() && path.extension().is_none_or(|e| e != "rs"))
        {
            continue;
        }
        children.entry(name).or_default().extend(rust_files(&path));
    }
    let mut graph = BTreeMap::new();
    for (child, files) in &children {
        let deps: &mut BTreeSet<String> = graph.entry(child.clone()).or_default();
        for file in files {
            if file.components().any(|c| c.as_os_str() == "tests") || file.ends_with("tests.rs") {
                continue;
            }
            let text: String = std::fs::read_to_string(file)
                .unwrap()
                .lines()
                .map(|l| l.split("//").next().unwrap_or(""))
                .collect::<Vec<_>>()
                .join("\n");
            // How many `super::` reach `folder` from this file's module.
            let depth = file.strip_prefix(folder).unwrap().components().count()
                - usize::from(file.ends_with("mod.rs"));
            let prefixes = [format!("crate::{module}::"), "super::".repeat(depth)];
            for prefix in &prefixes {
                for (i, _) in text.match_indices(prefix.as_str()) {
                    let rest = &text[i + prefix.len()..];
                    if rest.starts_with("super::") {
                        continue;
                    }
                    let names: Vec<&str> = match rest.strip_prefix('{') {
                        Some(group) => group[..group.find('}').unwrap_or(group.len())]
                            .split(',')
                            .collect(),
                        None => vec![rest],
                    };
                    for name in names {
                        let name: String = name
                            .trim()
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        if name != *child && children.contains_key(&name) {
                            deps.insert(name);
                        }
                    }
                }
            }
        }
    }
    graph
}

/// Every folder of modules under `dir`, with its module path.
fn folders(dir: &Path, module: &str, out: &mut Vec<(std::path::PathBuf, String)>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() && path.file_name().is_some_and(|n| n != "tests") {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let inner = if module.is_empty() {
                name
            } else {
                format!("{module}::{name}")
            };
            out.push((path.clone(), inner.clone()));
            folders(&path, &inner, out);
        }
    }
}

#[test]
fn the_modules_of_each_folder_depend_on_each_other_one_way() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    folders(&src, "", &mut all);
    assert!(all.iter().any(|(_, m)| m == "edge"), "{all:?}");
    for (folder, module) in all {
        let graph = folder_graph(&folder, &module);
        assert_eq!(cycle(&graph), None, "{module}: {graph:?}");
    }
}

#[test]
fn a_cycle_is_found() {
    let mut g = BTreeMap::new();
    g.insert("a".to_owned(), BTreeSet::from(["b".to_owned()]));
    g.insert("b".to_owned(), BTreeSet::from(["c".to_owned()]));
    g.insert("c".to_owned(), BTreeSet::from(["a".to_owned()]));
    assert_eq!(
        cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    g.get_mut("c").unwrap().clear();
    assert_eq!(cycle(&g), None);
}
