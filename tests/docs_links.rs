//! Every relative link in the README and the book resolves to a file of
//! the repository: the docs cannot point at something that moved.

use std::path::{Path, PathBuf};

/// The Markdown files users read: the README and the book's chapters.
fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md"), root.join("bench/README.md")];
    let book = root.join("docs/src");
    for entry in std::fs::read_dir(&book).expect("docs/src exists").flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files
}

/// The targets of `[text](target)` links in `text`.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let end = rest.find(')').unwrap_or(rest.len());
        let target = rest[..end].split_whitespace().next().unwrap_or("");
        out.push(target.to_owned());
        rest = &rest[end..];
    }
    out
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    let files = documents();
    assert!(files.len() > 5, "the book has chapters");
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = file.parent().unwrap();
        for target in links(&text) {
            let local = target.split('#').next().unwrap_or("");
            if local.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            if !dir.join(local).exists() {
                broken.push(format!("{}: {target}", file.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_reader_finds_links() {
    assert_eq!(
        links("see [a](x.md) and [b](../y.md#z \"t\") but not (c)"),
        ["x.md", "../y.md#z"]
    );
}

#[test]
fn the_book_lists_every_chapter() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/src");
    let summary = std::fs::read_to_string(root.join("SUMMARY.md")).unwrap();
    for entry in std::fs::read_dir(&root).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") && name != "SUMMARY.md" {
            assert!(
                summary.contains(&format!("({name})")),
                "{name} is not in SUMMARY.md"
            );
        }
    }
}
