//! Every `docs/numerics.md §N` cited in the sources (Rust, CUDA, C++) and every `§N` inside
//! that page names a section the page has, so code comments can cite sections without the
//! citations going stale when the page is reorganised.

use std::collections::BTreeSet;
use std::path::Path;

/// The section numbers of the page's headings (`## §4 ...`, `### §4.1 ...`).
fn sections(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|line| line.starts_with('#'))
        .filter_map(|line| line.trim_start_matches('#').trim().strip_prefix('§'))
        .map(|rest| section_number(rest).to_string())
        .collect()
}

/// The section number at the start of `text` (`4.1` of `4.1 Weight codecs`), possibly empty.
fn section_number(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    text[..end].trim_end_matches('.')
}

/// The sections cited right after each `docs/numerics.md` in `text`: `§1`, `§7.1, §7.2`,
/// `§1 and §8` (a `§` without a number, as in a placeholder `§N`, cites nothing).
fn citations(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices("numerics.md") {
        let mut rest = &text[at + "numerics.md".len()..];
        loop {
            rest = rest.trim_start_matches([' ', ',', '/', '\n']);
            rest = rest.strip_prefix("and ").unwrap_or(rest);
            let Some(after) = rest
                .strip_prefix('§')
                .filter(|a| a.starts_with(|c: char| c.is_ascii_digit()))
            else {
                break;
            };
            out.push(section_number(after).to_string());
            rest = &after[section_number(after).len()..];
        }
    }
    out
}

/// The sections cited anywhere in the page itself (numbered ones only).
fn internal_references(page: &str) -> Vec<String> {
    page.lines()
        .filter(|line| !line.starts_with('#'))
        .flat_map(|line| line.split('§').skip(1).map(section_number))
        .filter(|number| !number.is_empty())
        .map(str::to_string)
        .collect()
}

/// The source files under `dir` whose extension is one of `extensions`.
fn sources(dir: &Path, extensions: &[&str], out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read a source directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            sources(&path, extensions, out);
        } else if path
            .extension()
            .is_some_and(|e| extensions.iter().any(|x| e == *x))
        {
            out.push(path);
        }
    }
}

#[test]
fn every_cited_section_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/numerics.md")).expect("docs/numerics.md");
    let known = sections(&page);
    assert!(
        known.contains("1") && known.contains("7.1"),
        "headings not found: {known:?}"
    );
    let mut problems = Vec::new();
    for reference in internal_references(&page) {
        if !known.contains(&reference) {
            problems.push(format!("docs/numerics.md cites §{reference}"));
        }
    }
    let mut files = Vec::new();
    for dir in [
        "src",
        "tests",
        "bench",
        "kernels",
        "cpp",
        "examples",
        "sdp4bit",
        "megatron_patch",
        "docs",
    ] {
        sources(
            &root.join(dir),
            &["rs", "cu", "cuh", "h", "cpp", "py", "md"],
            &mut files,
        );
    }
    let mut cited = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read a source file");
        for reference in citations(&text) {
            cited += 1;
            if !known.contains(&reference) {
                let shown = file.strip_prefix(root).unwrap_or(file).display();
                problems.push(format!("{shown} cites docs/numerics.md §{reference}"));
            }
        }
    }
    assert!(cited > 0, "no citation found: the scan is broken");
    assert!(
        problems.is_empty(),
        "citations of sections docs/numerics.md does not have (known: {known:?}):\n{}",
        problems.join("\n")
    );
}

#[test]
fn citation_forms_are_read() {
    assert_eq!(
        citations("(docs/numerics.md §7.1, §7.2, §7.4) and docs/numerics.md §1 and §8."),
        ["7.1", "7.2", "7.4", "1", "8"]
    );
    assert_eq!(citations("docs/numerics.md §3 / `hadamard.rs`"), ["3"]);
    assert_eq!(
        citations("`docs/numerics.md`; nothing cited"),
        Vec::<String>::new()
    );
    assert_eq!(
        sections("# Title\n## §0 Words\n### §1.2 Asymmetric groups\ntext §9"),
        BTreeSet::from(["0".to_string(), "1.2".to_string()])
    );
}
