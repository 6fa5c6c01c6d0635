//! Dependencies between the crate's top-level modules point one way: the
//! configuration depends on the runtime modules, never back, and no module
//! reaches itself through others. This reads the sources and fails with the
//! graph and the cycle when that stops being true.

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
        "auth",
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
