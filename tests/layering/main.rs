//! The crate's modules depend only downwards, so a newcomer can read it bottom up and a change
//! in a layer cannot reach the layers below it:
//!
//! ```text
//! ffi                      (the torch extension's bridge)
//! self_check               (a CUDA bucket's kernels against the host, before its first step)
//! collective               (the algorithms, over Comm and Backend)
//! backend::cpu | backend::cuda   (the fused passes; neither names the other)
//! backend (the Backend trait), codec, config, error, hadamard, plan, rng
//! ```
//!
//! The check reads the sources (`src/**.rs`) and fails on any path in non-test code that
//! names a module its layer must not: a `use`, or an inline path such as
//! `crate::collective::Comm` or `super::super::collective::Comm`. Test code (`#[cfg(test)]`
//! items) may name anything; comments and doc links are not code.

use std::path::Path;

mod rust_source;

use rust_source::{module_of, named_paths};

/// A layering rule: the non-test code of the modules under `modules` names nothing under any
/// of `forbidden`.
struct Rule {
    modules: &'static str,
    forbidden: &'static [&'static str],
}

const RULES: [Rule; 11] = [
    Rule {
        modules: "crate::backend",
        forbidden: &["crate::collective", "crate::self_check", "crate::ffi"],
    },
    Rule {
        modules: "crate::backend::cpu",
        forbidden: &["crate::backend::cuda"],
    },
    Rule {
        modules: "crate::backend::cuda",
        forbidden: &["crate::backend::cpu"],
    },
    Rule {
        modules: "crate::collective",
        forbidden: &["crate::self_check", "crate::ffi"],
    },
    Rule {
        modules: "crate::self_check",
        forbidden: &["crate::ffi"],
    },
    Rule {
        modules: "crate::codec",
        forbidden: &["crate::backend", "crate::collective", "crate::ffi"],
    },
    Rule {
        modules: "crate::config",
        forbidden: &["crate::backend", "crate::collective", "crate::ffi"],
    },
    Rule {
        modules: "crate::error",
        forbidden: &["crate::backend", "crate::collective", "crate::ffi"],
    },
    Rule {
        modules: "crate::hadamard",
        forbidden: &["crate::backend", "crate::collective", "crate::ffi"],
    },
    Rule {
        modules: "crate::plan",
        forbidden: &["crate::backend", "crate::collective", "crate::ffi"],
    },
    Rule {
        modules: "crate::rng",
        forbidden: &["crate::backend", "crate::collective", "crate::ffi"],
    },
];

/// Whether `path` is `prefix` or lies under it (`crate::a::b` is under `crate::a`, but
/// `crate::ab` is not).
fn under(path: &str, prefix: &str) -> bool {
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with("::"))
}

/// Every violation of [`RULES`] by the source `text` of module `module`.
fn violations(module: &[String], text: &str) -> Vec<String> {
    let module_path = module.join("::");
    let segments: Vec<&str> = module.iter().map(String::as_str).collect();
    let paths = named_paths(&segments, text);
    let mut out = Vec::new();
    for rule in RULES.iter().filter(|r| under(&module_path, r.modules)) {
        for path in &paths {
            if let Some(layer) = rule.forbidden.iter().find(|f| under(path, f)) {
                out.push(format!(
                    "{module_path} names {path}, but {} must not depend on {layer}",
                    rule.modules
                ));
            }
        }
    }
    out
}

/// The `.rs` files under `dir`, as paths relative to `root` with `/` separators.
fn rust_files(root: &Path, dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).expect("read a source directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path.strip_prefix(root).expect("under the root");
            out.push(relative.to_string_lossy().replace('\\', "/"));
        }
    }
}

#[test]
fn every_module_names_only_the_layers_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &src, &mut files);
    files.sort();
    assert!(
        files.iter().any(|f| f.starts_with("backend/cuda/")),
        "the sources were not found under {}",
        src.display()
    );
    let mut problems = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(src.join(file)).expect("read a source file");
        problems.extend(
            violations(&module_of(file), &text)
                .into_iter()
                .map(|v| format!("src/{file}: {v}")),
        );
    }
    assert!(
        problems.is_empty(),
        "layering violations (move the shared item below both layers, e.g. into codec):\n{}",
        problems.join("\n")
    );
}

/// The check has teeth: planted violations in every form are found, and what is allowed
/// (test code, comments, strings, paths to lower layers) is not reported.
#[test]
fn planted_violations_are_found() {
    let module = |path: &str| module_of(path);
    let cases: [(&str, &str, usize); 13] = [
        (
            "backend/cpu/host.rs",
            "use crate::collective::check_len;",
            1,
        ),
        (
            "backend/cpu/host.rs",
            "use super::super::super::collective::Comm;",
            1,
        ),
        (
            "backend/device.rs",
            "use super::super::collective::Comm;",
            1,
        ),
        (
            "backend/cpu/host.rs",
            "use crate::{codec::slab, collective::{Comm, local}};",
            2,
        ),
        (
            "backend/cpu/host.rs",
            "fn f() { crate::collective::check_len(1, 2, 3); }",
            1,
        ),
        (
            "backend/cuda/backend.rs",
            "use crate::backend::cpu::weight::WeightEncoding;",
            1,
        ),
        ("backend/cuda/mod.rs", "use super::cpu::Host;", 1),
        (
            "backend/cuda/backend.rs",
            "use super::super::cpu as host;",
            1,
        ),
        (
            "backend/device.rs",
            "mod inner { use super::super::super::collective::Comm; }",
            1,
        ),
        (
            "backend/cuda/abi.rs",
            "#[cfg(test)]\nmod tests { use crate::backend::cpu::Host; }",
            0,
        ),
        (
            "backend/cpu/host.rs",
            "// use crate::collective::Comm;\n/// [`Comm`](crate::collective::Comm)",
            0,
        ),
        (
            "backend/cpu/host.rs",
            "const S: &str = \"crate::collective::Comm\"; use crate::codec::sum::SumElement;",
            0,
        ),
        (
            "collective/gradient.rs",
            "use crate::backend::cpu::Host; use crate::error::check_len;",
            0,
        ),
    ];
    for (file, text, want) in cases {
        let found = violations(&module(file), text);
        assert_eq!(found.len(), want, "{file}: {text:?} -> {found:?}");
    }
}
