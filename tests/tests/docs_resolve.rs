//! The documents say only what exists: every relative link in the README, ARCHITECTURE.md, the
//! crate READMEs and `docs/` names a file of the repository (and a `#section` a heading of it),
//! every `ptl <command>` the documents name is a command of the built `ptl` (its `--help`
//! answers), and every `cargo xtask <command>` is one the xtask binary dispatches.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::ptl;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Markdown files a reader of the repository is sent to.
fn documents() -> Vec<PathBuf> {
    let r = root();
    let mut files = vec![r.join("README.md"), r.join("ARCHITECTURE.md")];
    for dir in ["docs", "autograd", "capture", "data", "heads", "trainer", "plugins", "export", "assets"] {
        let Ok(entries) = std::fs::read_dir(r.join(dir)) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// The targets of inline links `[text](target)` in `md`, code spans and fenced blocks skipped.
fn link_targets(md: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop code spans so that `[i](j)` inside backticks is not read as a link.
        let mut plain = String::new();
        for (i, piece) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(piece);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let tail = &rest[at + 2..];
            let Some(end) = tail.find(')') else { break };
            out.push(tail[..end].trim().to_string());
            rest = &tail[end..];
        }
    }
    out
}

/// GitHub's anchor of a heading: lower case, spaces to '-', other punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors_of(md: &str) -> BTreeSet<String> {
    md.lines().filter(|l| l.starts_with('#')).map(|l| anchor(l.trim_start_matches('#'))).collect()
}

#[test]
fn every_relative_link_in_the_documents_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap_or_else(|e| panic!("{}: {e}", doc.display()));
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, section) = match target.split_once('#') {
                Some((p, s)) => (p, Some(s)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() { doc.clone() } else { doc.parent().expect("a folder").join(path) };
            if !file.exists() {
                broken.push(format!("{}: `{target}`: no such file", doc.display()));
                continue;
            }
            if let Some(s) = section {
                let md = std::fs::read_to_string(&file).unwrap_or_default();
                if !anchors_of(&md).contains(s) {
                    broken.push(format!("{}: `{target}`: no heading `#{s}` in {}", doc.display(), file.display()));
                }
            }
        }
    }
    assert!(checked >= 10, "only {checked} links found: the link reader is broken");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    println!("{checked} relative links resolve");
}

/// The Rust sources of the workspace's crates (what code comments cite).
fn sources() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() && !p.ends_with("target") {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs" || x == "cu") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    for dir in ["autograd", "capture", "data", "heads", "trainer", "plugins", "export", "xtask", "tests", "src"] {
        walk(&root().join(dir), &mut out);
    }
    out.sort();
    out
}

/// Every `docs/<name>.md` a source names, with the `§n` section that follows it if any.
fn cited_documents(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices("docs/") {
        let tail = &text[at + "docs/".len()..];
        let name: String = tail.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_').collect();
        let Some(after) = tail[name.len()..].strip_prefix(".md") else { continue };
        let section = after.strip_prefix(" §").map(|t| {
            let n: String = t.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
            n.trim_end_matches('.').to_string()
        });
        out.push((format!("docs/{name}.md"), section.filter(|n| !n.is_empty())));
    }
    out
}

/// Whether `md` has a heading numbered `n` ("## 3. Terms", "### 3.2 Box CIoU").
fn has_numbered_heading(md: &str, n: &str) -> bool {
    md.lines().filter(|l| l.starts_with('#')).any(|l| {
        let title = l.trim_start_matches('#').trim_start();
        title.strip_prefix(n).is_some_and(|rest| rest.starts_with(". ") || rest.starts_with(' '))
    })
}

/// Code comments cite documents of the repository: every `docs/<name>.md` a source names exists,
/// and every `§n` after it is a numbered heading of that document.
#[test]
fn every_document_the_code_cites_exists_with_its_section() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for src in sources() {
        let text = std::fs::read_to_string(&src).unwrap_or_default();
        for (doc, section) in cited_documents(&text) {
            checked += 1;
            let Ok(md) = std::fs::read_to_string(root().join(&doc)) else {
                broken.push(format!("{}: `{doc}`: no such file", src.display()));
                continue;
            };
            if let Some(n) = section {
                if !has_numbered_heading(&md, &n) {
                    broken.push(format!("{}: `{doc} §{n}`: no heading numbered {n}", src.display()));
                }
            }
        }
    }
    assert!(checked >= 50, "only {checked} citations found: the citation reader is broken");
    assert!(broken.is_empty(), "citations of missing documents or sections:\n{}", broken.join("\n"));
    assert!(has_numbered_heading("## 3. Terms\n### 3.2 Box", "3.2") && !has_numbered_heading("## 3. Terms", "3.2"));
    println!("{checked} citations of docs/ resolve");
}

/// The first word after `program ` (e.g. "ptl", "cargo xtask") wherever the documents run it: at
/// the start of a line of a code block, or at the start of a code span.
fn named_commands(program: &str) -> BTreeSet<String> {
    let first_word = |tail: &str| -> Option<String> {
        let word: String = tail.chars().take_while(|c| c.is_ascii_lowercase() || *c == '-').collect();
        (!word.is_empty()).then_some(word)
    };
    let prefix = format!("{program} ");
    let mut names = BTreeSet::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap_or_default();
        let mut fenced = false;
        for line in text.lines() {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                continue;
            }
            if fenced {
                names.extend(line.trim_start().strip_prefix(&prefix).and_then(first_word));
                continue;
            }
            for (i, span) in line.split('`').enumerate() {
                if i % 2 == 1 {
                    names.extend(span.strip_prefix(&prefix).and_then(first_word));
                }
            }
        }
    }
    names
}

#[test]
fn every_ptl_command_the_documents_name_exists() {
    let names = named_commands("ptl");
    assert!(names.contains("train"), "the documents name `ptl train`: the command reader is broken ({names:?})");
    let dir = tempfile::tempdir().expect("tempdir");
    for name in &names {
        let o = ptl(&[name, "--help"], dir.path());
        assert!(o.status.success(), "`ptl {name}` is named in the documents but `ptl {name} --help` fails:\n{}", common::text(&o));
    }
    println!("ptl commands named and present: {names:?}");
}

#[test]
fn every_xtask_command_the_documents_name_is_dispatched() {
    let names = named_commands("cargo xtask");
    assert!(names.contains("bench"), "the documents name `cargo xtask bench`: the command reader is broken ({names:?})");
    let main = std::fs::read_to_string(root().join("xtask/src/main.rs")).expect("xtask/src/main.rs");
    for name in &names {
        assert!(
            main.contains(&format!("Some(\"{name}\") =>")),
            "`cargo xtask {name}` is named in the documents but xtask/src/main.rs does not dispatch it"
        );
    }
    println!("xtask commands named and dispatched: {names:?}");
}
