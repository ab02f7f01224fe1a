//! The crate's modules depend only downwards, so a newcomer can read it bottom up, a change
//! in a layer cannot reach the layers below it, and no two modules import each other:
//!
//! ```text
//! ffi                            (the torch extension's bridge)
//! kernel_check                   (a CUDA bucket's kernels against the host, before its first step)
//! collective                     (the algorithms, over Comm and Backend)
//! backend::cpu | backend::cuda   (the fused passes)
//! backend                        (the Backend trait)
//! layout                         (topology, padding, the swizzled layout)
//! codec                          (the group quantizer, the bytes of a slab)
//! config | rng | hadamard
//! error
//! ```
//!
//! A module names only its own module tree and the layers below its own; modules of one layer
//! (`a | b`) name neither each other. An import loop between any of them must name a module
//! of its own layer or above somewhere, so every loop fails the check (`an_injected_loop_fails`
//! feeds it one). Every module of `src/` belongs to a layer: a new one fails until it is
//! placed in [`LAYERS`]. Inside one module tree, where the layers allow every edge, the files'
//! imports must not form a loop either ([`file_loops`]; backend::cuda once had one).
//!
//! The check reads the sources (`src/**.rs`) and fails on any path in non-test code that
//! names a module its layer must not: a `use`, or an inline path such as
//! `crate::collective::Comm` or `super::super::collective::Comm`. Test code (`#[cfg(test)]`
//! items) may name anything; comments and doc links are not code.

use std::path::Path;

mod rust_source;

use rust_source::{module_of, named_paths};

/// The layers, bottom up, each a list of modules (with their submodules, unless a submodule
/// is listed itself).
const LAYERS: &[&[&str]] = &[
    &["crate::error"],
    &["crate::config", "crate::rng", "crate::hadamard"],
    &["crate::codec"],
    &["crate::layout"],
    &["crate::backend"],
    &["crate::backend::cpu", "crate::backend::cuda"],
    &["crate::collective"],
    &["crate::kernel_check"],
    &["crate::ffi"],
];

/// Whether `path` is `prefix` or lies under it (`crate::a::b` is under `crate::a`, but
/// `crate::ab` is not).
fn under(path: &str, prefix: &str) -> bool {
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with("::"))
}

/// The listed module `path` belongs to (the longest one it lies under) and its layer.
fn layer_of(path: &str) -> Option<(&'static str, usize)> {
    LAYERS
        .iter()
        .enumerate()
        .flat_map(|(layer, modules)| modules.iter().map(move |&m| (m, layer)))
        .filter(|&(module, _)| under(path, module))
        .max_by_key(|&(module, _)| module.len())
}

/// Every violation of the layers by the source `text` of module `module`.
fn violations(module: &[String], text: &str) -> Vec<String> {
    let module_path = module.join("::");
    let Some((own, layer)) = layer_of(&module_path) else {
        return vec![format!("{module_path} is in no layer (add it to LAYERS)")];
    };
    let segments: Vec<&str> = module.iter().map(String::as_str).collect();
    named_paths(&segments, text)
        .into_iter()
        .filter_map(|path| match layer_of(&path) {
            None => Some(format!("{module_path} names {path}, which is in no layer")),
            Some((other, other_layer)) if other != own && other_layer >= layer => Some(format!(
                "{module_path} names {path}, but {own} must not depend on {other} (its layer \
                 {layer} is not above {other_layer})"
            )),
            _ => None,
        })
        .collect()
}

/// Every violation in a source tree of `(path relative to src/, text)`; `lib.rs`, the crate
/// root, only declares the modules. Besides the layers: any loop of imports between files
/// ([`file_loops`]), which the layers cannot see inside one module tree.
fn tree_violations(files: &[(String, String)]) -> Vec<String> {
    let mut out: Vec<String> = files
        .iter()
        .filter(|(file, _)| file != "lib.rs")
        .flat_map(|(file, text)| {
            violations(&module_of(file), text)
                .into_iter()
                .map(move |v| format!("src/{file}: {v}"))
        })
        .collect();
    out.extend(file_loops(files));
    out
}

/// The import loops between the files of a source tree: each file names the file whose module
/// is the longest prefix of a path it names; a module naming its own ancestors (`super::X`,
/// items a `mod.rs` re-exports) or descendants (a `mod.rs` re-exporting them) is not an edge.
/// One line per file that lies on a loop, with the loop.
fn file_loops(files: &[(String, String)]) -> Vec<String> {
    let modules: Vec<String> = files.iter().map(|(f, _)| module_of(f).join("::")).collect();
    let edges: Vec<Vec<usize>> = files
        .iter()
        .zip(&modules)
        .map(|((file, text), own)| {
            let segments = module_of(file);
            let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
            let mut to: Vec<usize> = named_paths(&segments, text)
                .iter()
                .filter_map(|path| {
                    (0..modules.len())
                        .filter(|&i| under(path, &modules[i]))
                        .max_by_key(|&i| modules[i].len())
                })
                .filter(|&i| !under(own, &modules[i]) && !under(&modules[i], own))
                .collect();
            to.sort_unstable();
            to.dedup();
            to
        })
        .collect();
    let mut out = Vec::new();
    for start in 0..files.len() {
        // A path back to `start` from one of its successors, by depth-first search.
        let mut parent = vec![None; files.len()];
        let mut stack: Vec<usize> = edges[start].clone();
        for &next in &edges[start] {
            parent[next] = Some(start);
        }
        while let Some(node) = stack.pop() {
            if node == start {
                let mut through = Vec::new();
                let mut at = parent[start].expect("reached from a predecessor");
                while at != start {
                    through.push(modules[at].as_str());
                    at = parent[at].expect("on the path");
                }
                through.reverse();
                let start_module = modules[start].as_str();
                out.push(format!(
                    "src/{}: an import loop: {start_module} -> {} -> {start_module}",
                    files[start].0,
                    through.join(" -> ")
                ));
                break;
            }
            for &next in &edges[node] {
                if parent[next].is_none() {
                    parent[next] = Some(node);
                    stack.push(next);
                }
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
    let tree: Vec<(String, String)> = files
        .into_iter()
        .map(|file| {
            let text = std::fs::read_to_string(src.join(&file)).expect("read a source file");
            (file, text)
        })
        .collect();
    let problems = tree_violations(&tree);
    assert!(
        problems.is_empty(),
        "layering violations (move the shared item below both layers):\n{}",
        problems.join("\n")
    );
}

/// A tree with an import loop fails, whichever modules the loop joins: two layers (config and
/// codec, the loop this tree once had), two modules of one layer, or three layers.
#[test]
fn an_injected_loop_fails() {
    let tree = |files: &[(&str, &str)]| -> Vec<(String, String)> {
        files
            .iter()
            .map(|&(file, text)| (file.to_string(), text.to_string()))
            .collect()
    };
    let loops: [&[(&str, &str)]; 3] = [
        &[
            ("config.rs", "use crate::codec::quant::QuantSpec;"),
            ("codec/quant.rs", "use crate::config::Rounding;"),
        ],
        &[
            ("rng.rs", "use crate::hadamard::MAX_BLOCK;"),
            ("hadamard.rs", "fn f() { crate::rng::philox(); }"),
        ],
        &[
            ("codec/slab.rs", "use crate::layout::Topology;"),
            ("layout.rs", "use crate::backend::Backend;"),
            ("backend/device.rs", "use crate::codec::slab::SlabLayout;"),
        ],
    ];
    for files in loops {
        let found = tree_violations(&tree(files));
        assert!(!found.is_empty(), "the loop {files:?} was not found");
    }
    // A loop inside one module tree, which the layers allow edge by edge (the four files of
    // backend::cuda once had one), is found as a loop; the same files without the back edge
    // pass, as do a mod.rs re-exporting its children and a child naming `super`.
    let inside = [
        ("backend/cuda/module.rs", "use super::probe::driver;"),
        ("backend/cuda/target.rs", "use super::probe::nvrtc;"),
        (
            "backend/cuda/mod.rs",
            "pub use probe::driver; pub use module::Kernels;",
        ),
    ];
    let back_edge = (
        "backend/cuda/probe.rs",
        "fn f() { super::module::version(); }",
    );
    let looped = tree_violations(&tree(&[inside[0], inside[1], inside[2], back_edge]));
    assert!(
        looped.iter().any(|v| v.contains("an import loop")),
        "{looped:?}"
    );
    let acyclic = [
        inside[0],
        inside[1],
        inside[2],
        ("backend/cuda/probe.rs", "use super::X;"),
    ];
    assert_eq!(tree_violations(&tree(&acyclic)), Vec::<String>::new());
    // The same tree without its loop passes.
    let fine = tree(&[
        ("config.rs", "use crate::error::Result;"),
        ("codec/quant.rs", "use crate::config::Rounding;"),
        ("layout.rs", "use crate::codec::slab::SlabLayout;"),
    ]);
    assert_eq!(tree_violations(&fine), Vec::<String>::new());
    // A module placed in no layer fails, and so does naming one.
    assert_eq!(tree_violations(&tree(&[("telemetry.rs", "")])).len(), 1);
    assert_eq!(
        tree_violations(&tree(&[("codec/sum.rs", "use crate::telemetry::Log;")])).len(),
        1
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
