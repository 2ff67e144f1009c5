//! Every relative link of the README, the changelog and `docs/` points to a file that exists,
//! and a `#fragment` to a heading (or an `<a id>`) of that file, as GitHub makes them. No
//! server, no network: links to `http(s)://` are not followed.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Pages other work is writing while this test lands: a link to one of them passes while it is
/// absent; once it exists it is checked like any other. (Issue 35's two, docs/operations.md and
/// docs/migrating-from-pgbouncer.md, have landed.)
const WRITTEN_ELSEWHERE: &[&str] = &[];

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    markdown_under(&root.join("docs"), &mut pages);
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, fragment) = match target.split_once('#') {
                Some((path, fragment)) => (path, Some(fragment)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            let name = || format!("{}: {target}", page.strip_prefix(root).unwrap().display());
            if !file.exists() {
                let pending = normalize(&file)
                    .strip_prefix(root)
                    .ok()
                    .and_then(|p| p.to_str())
                    .is_some_and(|p| WRITTEN_ELSEWHERE.contains(&p));
                if !pending {
                    broken.push(format!("{}: no such file", name()));
                }
                continue;
            }
            if let Some(fragment) = fragment {
                let anchors = std::fs::read_to_string(&file)
                    .map(|t| anchors(&t))
                    .unwrap_or_default();
                if !anchors.contains(fragment) {
                    broken.push(format!("{}: no such heading in that file", name()));
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: is the link reader broken?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The `.md` files under `dir`, recursively.
fn markdown_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            markdown_under(&path, out);
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
}

/// `a/b/../c` as `a/c`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The text outside fenced code blocks, line by line, with inline code spans blanked.
fn prose(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut out = String::new();
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
                out.push(c);
            } else {
                out.push(if in_code { ' ' } else { c });
            }
        }
        lines.push(out);
    }
    lines
}

/// The targets of the `[text](target)` links of a page.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            if !target.is_empty() {
                out.push(target.to_string());
            }
            rest = &rest[end..];
        }
    }
    out
}

/// The fragments a page answers to: its headings as GitHub makes their ids (lower case,
/// punctuation dropped, spaces as hyphens, `-1`, `-2` for repeats), and `<a id="...">` /
/// `<a name="...">`.
fn anchors(text: &str) -> HashSet<String> {
    let mut found = HashSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        for attr in ["id=\"", "name=\""] {
            let mut rest = line;
            while let Some(at) = rest.find(&format!("<a {attr}")) {
                rest = &rest[at + 3 + attr.len()..];
                if let Some(end) = rest.find('"') {
                    found.insert(rest[..end].to_string());
                }
            }
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let slug: String = line[hashes..]
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let mut id = slug.clone();
        let mut n = 0;
        while found.contains(&id) {
            n += 1;
            id = format!("{slug}-{n}");
        }
        found.insert(id);
    }
    found
}
