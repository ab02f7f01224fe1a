//! Generates the Rust side of the CUDA kernels' launch ABI from `kernels/`, points the
//! processes cargo runs at the NVRTC the test command installs, and, with the `ffi` feature,
//! compiles the C++ half of the cxx bridge (`src/ffi/mod.rs`; the torch adapter it calls,
//! `cpp/torch_comms.h`, is compiled by the torch extension build, against the installed torch).
//!
//! The kernel table `kernels/sdp4bit_kernels.h` (one `SDP_KERNEL(name, body, parameter struct,
//! widest load, widest store, pointer parameters)` line per kernel), the `.cu` files defining
//! the bodies and the parameter structs of `kernels/sdp4bit_abi.h` become `$OUT_DIR/kernels.rs`
//! (the `Kernel` enum, `SOURCES`, `HEADERS`; included by `src/backend/cuda/source.rs`) and
//! `$OUT_DIR/abi.rs` (the `#[repr(C)]` mirrors; included by `src/backend/cuda/abi.rs`). The
//! build fails, naming the file, when a body is defined by no `.cu` file or by two, when a `.cu`
//! file defines a body (a template `..._of`) the table lacks, or when a struct has a field
//! without a comment or padding.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let root = PathBuf::from(env("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env("OUT_DIR"));
    if let Err(e) = kernel_abi(&root.join("kernels"), &out) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    nvrtc_dirs(&root);
    #[cfg(feature = "ffi")]
    {
        cxx_build::bridge("src/ffi/mod.rs")
            .std("c++17")
            .compile("sdp4bit-ffi");
        println!("cargo:rerun-if-changed=src/ffi/mod.rs");
        println!("cargo:rerun-if-changed=cpp/torch_comms.h");
    }
}

/// A variable cargo sets for build scripts.
fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("cargo sets {name}"))
}

/// Points `SDP4BIT_NVRTC_DIRS` of the processes cargo runs (`cargo test`, `run`, `bench`) at
/// the NVRTC that `scripts/env.sh`'s `sdp4bit_nvrtc` installs into `.cache/`, after the
/// directories the variable lists when cargo builds, so that a contributor's `cargo test`
/// finds it without `LD_LIBRARY_PATH`. The library reads the variable only at run time: what
/// it does in a user's process is unchanged. Nothing is set where `scripts/env.sh` is absent
/// (an sdist).
fn nvrtc_dirs(root: &Path) {
    let script = root.join("scripts/env.sh");
    let Ok(text) = std::fs::read_to_string(&script) else {
        return;
    };
    println!("cargo:rerun-if-changed={}", script.display());
    println!("cargo:rerun-if-env-changed=SDP4BIT_NVRTC_DIRS");
    let Some(version) = text
        .lines()
        .find_map(|line| line.strip_prefix("SDP4BIT_NVRTC_VERSION="))
    else {
        return;
    };
    let mut dirs: Vec<PathBuf> = std::env::var_os("SDP4BIT_NVRTC_DIRS")
        .iter()
        .flat_map(std::env::split_paths)
        .collect();
    dirs.push(root.join(format!(".cache/nvrtc-{}/nvidia/cu13/lib", version.trim())));
    if let Ok(dirs) = std::env::join_paths(dirs) {
        let dirs = dirs.to_string_lossy();
        println!("cargo:rustc-env=SDP4BIT_NVRTC_DIRS={dirs}");
    }
}

/// A line of the kernel table.
struct Kernel {
    name: String,
    /// The template in a `.cu` file its entry points instantiate.
    body: String,
    /// The C name of its parameter struct.
    params: String,
    /// Widths in bits of its widest global load and store (0: none).
    widest_load: u32,
    widest_store: u32,
    pointers: Vec<Pointer>,
    /// The comment above its line.
    doc: String,
}

/// A pointer parameter: `[const] ELEMENT* NAME`.
struct Pointer {
    name: String,
    /// The element type, with its `const`.
    element: String,
    element_bytes: usize,
}

/// A field of a struct of `sdp4bit_abi.h`.
struct Field {
    name: String,
    /// The struct it is, when it is one (defined above it).
    nested: Option<String>,
    /// Its Rust type: a scalar, or the nested struct's mirror.
    rust: String,
    comment: String,
}

/// A struct of `sdp4bit_abi.h`, laid out as C does.
struct Struct {
    fields: Vec<Field>,
    size: usize,
    align: usize,
    /// Whether it holds a float (its mirror is then not `Eq`), nested structs included.
    float: bool,
}

/// Reads the kernel table, the structs and the `.cu` files of `dir` and writes `kernels.rs` and
/// `abi.rs` into `out`.
fn kernel_abi(dir: &Path, out: &Path) -> Result<(), String> {
    println!("cargo:rerun-if-changed={}", dir.display());
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name)).map_err(|e| format!("kernels/{name}: {e}"))
    };
    let kernels = kernel_table(&read("sdp4bit_kernels.h")?)
        .map_err(|e| format!("kernels/sdp4bit_kernels.h: {e}"))?;
    let structs =
        structs(&read("sdp4bit_abi.h")?).map_err(|e| format!("kernels/sdp4bit_abi.h: {e}"))?;
    if let Some(k) = kernels.iter().find(|k| !structs.contains_key(&k.params)) {
        return Err(format!(
            "the kernel {} takes struct {}, which kernels/sdp4bit_abi.h does not define",
            k.name, k.params
        ));
    }
    let mut files = Vec::new();
    let mut headers = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| format!("kernels/: {e}"))? {
        let name = entry.map_err(|e| format!("kernels/: {e}"))?.file_name();
        let name = name.to_string_lossy().into_owned();
        if name.ends_with(".cu") {
            files.push(name);
        } else if name.ends_with(".h") || name.ends_with(".cuh") {
            headers.push(name);
        }
    }
    headers.sort();
    let mut defined_in: BTreeMap<String, String> = BTreeMap::new();
    for file in &files {
        for body in bodies(&read(file)?) {
            if !kernels.iter().any(|k| k.body == body) {
                return Err(format!(
                    "kernels/{file} defines the body {body}, which kernels/sdp4bit_kernels.h \
                     does not list"
                ));
            }
            if let Some(other) = defined_in.insert(body.clone(), file.clone()) {
                return Err(format!(
                    "the body {body} is defined by kernels/{other} and by kernels/{file}"
                ));
            }
        }
    }
    // Every file with its kernels, in the order of the table's first kernel of each.
    let mut sources: Vec<(&str, Vec<&Kernel>)> = Vec::new();
    for kernel in &kernels {
        let file = defined_in.get(&kernel.body).ok_or_else(|| {
            format!(
                "no kernels/*.cu file defines the body {} of the kernel {}",
                kernel.body, kernel.name
            )
        })?;
        match sources.iter_mut().find(|(f, _)| f == file) {
            Some((_, listed)) => listed.push(kernel),
            None => sources.push((file, vec![kernel])),
        }
    }
    if let Some(file) = files.iter().find(|f| !sources.iter().any(|(s, _)| s == f)) {
        return Err(format!("kernels/{file} defines no kernel"));
    }
    let write = |name: &str, code: String| {
        std::fs::write(out.join(name), code).map_err(|e| format!("write {name}: {e}"))
    };
    write("kernels.rs", kernels_rs(dir, &kernels, &sources, &headers))?;
    write("abi.rs", abi_rs(&kernels, &structs))
}

/// The lines of the kernel table.
fn kernel_table(text: &str) -> Result<Vec<Kernel>, String> {
    let mut kernels: Vec<Kernel> = Vec::new();
    let mut doc: Vec<&str> = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let at = |what: String| format!("line {}: {what}", number + 1);
        let line = line.trim();
        if let Some(comment) = line.strip_prefix("//") {
            doc.push(comment.trim());
            continue;
        }
        if line.is_empty() {
            doc.clear();
            continue;
        }
        let args = line
            .strip_prefix("SDP_KERNEL(")
            .and_then(|l| l.strip_suffix(')'))
            .ok_or_else(|| at(format!("not a comment or an SDP_KERNEL(...) line: {line}")))?;
        let args: Vec<&str> = args.split(',').map(str::trim).collect();
        let [name, body, params, load, store, pointers @ ..] = &args[..] else {
            return Err(at(
                "SDP_KERNEL needs a name, a body, a struct and the widest load and store".into(),
            ));
        };
        let width = |bits: &str| {
            bits.parse::<u32>()
                .ok()
                .filter(|b| [0, 8, 16, 32, 64, 128].contains(b))
                .ok_or_else(|| at(format!("{name}: `{bits}` is not an access width in bits")))
        };
        if pointers.is_empty() || kernels.iter().any(|k| k.name == *name) {
            return Err(at(format!("{name} takes no pointer or is listed twice")));
        }
        let pointers = pointers
            .iter()
            .map(|p| pointer(p).ok_or_else(|| at(format!("`{p}` is not `[const] TYPE* NAME`"))))
            .collect::<Result<_, _>>()?;
        kernels.push(Kernel {
            name: name.to_string(),
            body: body.to_string(),
            params: params.to_string(),
            widest_load: width(load)?,
            widest_store: width(store)?,
            pointers,
            doc: doc.join(" "),
        });
        doc.clear();
    }
    Ok(kernels)
}

/// The pointer parameter `[const] ELEMENT* NAME`, of an element type build.rs knows.
fn pointer(param: &str) -> Option<Pointer> {
    let (element, name) = param.rsplit_once('*')?;
    let (element, name) = (element.trim(), name.trim());
    let element_bytes = match element.trim_start_matches("const ") {
        "uint8_t" | "int8_t" => 1,
        "sdp_bf16" | "int16_t" => 2,
        other => scalar(other)?.0,
    };
    let identifier =
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    identifier.then(|| Pointer {
        name: name.into(),
        element: element.into(),
        element_bytes,
    })
}

/// The size and Rust type of a scalar field type build.rs mirrors.
fn scalar(c_type: &str) -> Option<(usize, &'static str)> {
    Some(match c_type {
        "uint16_t" => (2, "u16"),
        "uint32_t" => (4, "u32"),
        "int32_t" => (4, "i32"),
        "uint64_t" => (8, "u64"),
        "float" => (4, "f32"),
        _ => return None,
    })
}

/// The structs `struct NAME {` ... `};` of the ABI header, by name; an error for a field
/// without a comment, of a type build.rs does not mirror, or after padding.
fn structs(text: &str) -> Result<BTreeMap<String, Struct>, String> {
    let mut structs: BTreeMap<String, Struct> = BTreeMap::new();
    let mut open: Option<(String, Struct)> = None;
    for (number, line) in text.lines().enumerate() {
        let at = |what: String| format!("line {}: {what}", number + 1);
        if let Some(name) = line
            .strip_prefix("struct ")
            .and_then(|l| l.strip_suffix(" {"))
        {
            let s = Struct {
                fields: Vec::new(),
                size: 0,
                align: 1,
                float: false,
            };
            open = Some((name.to_string(), s));
            continue;
        }
        if line == "};" {
            if let Some((name, s)) = open.take() {
                if s.size % s.align != 0 {
                    return Err(at(format!("struct {name} ends in padding")));
                }
                structs.insert(name, s);
            }
            continue;
        }
        let Some((_, s)) = open.as_mut() else {
            continue;
        };
        let (declaration, comment) = line
            .split_once("//")
            .ok_or_else(|| at("a field without a comment (its doc in the Rust mirror)".into()))?;
        let (c_type, name) = declaration
            .trim()
            .strip_suffix(';')
            .and_then(|d| d.rsplit_once(' '))
            .ok_or_else(|| at("not a field `TYPE NAME;  // comment`".into()))?;
        let c_type = c_type.trim();
        let (size, align, float, rust) = match c_type.strip_prefix("struct ") {
            Some(nested) => {
                let n = structs
                    .get(nested)
                    .ok_or_else(|| at(format!("struct {nested} is not defined above")))?;
                (n.size, n.align, n.float, camel(nested))
            }
            None => {
                let (size, rust) = scalar(c_type)
                    .ok_or_else(|| at(format!("build.rs does not mirror the type {c_type}")))?;
                (size, size, c_type == "float", rust.to_string())
            }
        };
        if s.size % align != 0 {
            return Err(at(format!("padding before {name}: add an explicit field")));
        }
        s.fields.push(Field {
            name: name.into(),
            nested: c_type.strip_prefix("struct ").map(Into::into),
            rust,
            comment: comment.trim().into(),
        });
        s.size += size;
        s.align = s.align.max(align);
        s.float |= float;
    }
    Ok(structs)
}

/// The kernel bodies `.cu` source `code` defines: the functions `void NAME_of(` of its top level
/// (a template on its own line before them), the templates the kernel table's entry points
/// instantiate.
fn bodies(code: &str) -> Vec<String> {
    code.lines()
        .filter(|line| line.starts_with("__device__ __forceinline__ void "))
        .filter_map(|line| {
            let name = line["__device__ __forceinline__ void ".len()..]
                .split('(')
                .next()?;
            name.ends_with("_of").then(|| name.to_string())
        })
        .collect()
}

/// `grad_quantize_first` as `GradQuantizeFirst`.
fn camel(name: &str) -> String {
    let upper_first = |part: &str| {
        let mut chars = part.chars();
        chars.next().map_or(String::new(), |first| {
            first.to_ascii_uppercase().to_string() + chars.as_str()
        })
    };
    name.split('_').map(upper_first).collect()
}

/// The arms of a `match self` over every kernel: `Kernel::X => body(x),` each.
fn arms(kernels: &[Kernel], body: impl Fn(&Kernel) -> String) -> String {
    let arm = |k: &Kernel| format!("            Kernel::{} => {},\n", camel(&k.name), body(k));
    kernels.iter().map(arm).collect()
}

/// `$OUT_DIR/kernels.rs`: the `Kernel` enum, `SOURCES` and `HEADERS`.
fn kernels_rs(
    dir: &Path,
    kernels: &[Kernel],
    sources: &[(&str, Vec<&Kernel>)],
    headers: &[String],
) -> String {
    let variant = |k: &Kernel| {
        let doc = format!("`{}`: {}", k.name, k.doc);
        format!("    #[doc = {doc:?}]\n    {},\n", camel(&k.name))
    };
    let variants: String = kernels.iter().map(variant).collect();
    let all: String = kernels
        .iter()
        .map(|k| format!("        Kernel::{},\n", camel(&k.name)))
        .collect();
    let names = arms(kernels, |k| format!("{:?}", k.name));
    let pointers = arms(kernels, |k| {
        let pointer = |p: &Pointer| {
            format!(
                "Pointer {{ name: {:?}, element: {:?}, element_bytes: {} }}",
                p.name, p.element, p.element_bytes
            )
        };
        let list: Vec<String> = k.pointers.iter().map(pointer).collect();
        format!("&[{}]", list.join(", "))
    });
    let params = arms(kernels, |k| format!("{:?}", k.params));
    let bodies = arms(kernels, |k| format!("{:?}", k.body));
    let files = arms(kernels, |k| {
        let (file, _) = sources
            .iter()
            .find(|(_, defined)| defined.iter().any(|d| d.name == k.name))
            .expect("every kernel has a source");
        format!("{file:?}")
    });
    let loads = arms(kernels, |k| k.widest_load.to_string());
    let stores = arms(kernels, |k| k.widest_store.to_string());
    let sizes = arms(kernels, |k| {
        format!("size_of::<super::abi::{}>()", camel(&k.params))
    });
    let path = |name: &str| format!("{:?}", dir.join(name).display().to_string());
    let source = |(file, defined): &(&str, Vec<&Kernel>)| {
        let list: Vec<String> = defined
            .iter()
            .map(|k| format!("Kernel::{}", camel(&k.name)))
            .collect();
        let code = path(file);
        let list = list.join(", ");
        format!(
            "    KernelSource {{ file: {file:?}, code: include_str!({code}), \
             kernels: &[{list}] }},\n"
        )
    };
    let source_list: String = sources.iter().map(source).collect();
    let header_list: String = headers
        .iter()
        .map(|h| format!("    ({h:?}, include_str!({})),\n", path(h)))
        .collect();
    let count = kernels.len();
    let max_pointers = kernels.iter().map(|k| k.pointers.len()).max().unwrap_or(0);
    let (source_count, header_count) = (sources.len(), headers.len());
    format!(
        r#"/// Every kernel of the launch ABI, one per line of `kernels/sdp4bit_kernels.h` and in
/// its order (generated by build.rs); the discriminant indexes the per-device function table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {{
{variants}}}

impl Kernel {{
    /// Number of kernels.
    pub const COUNT: usize = {count};

    /// The most pointer parameters a kernel takes.
    pub const MAX_POINTERS: usize = {max_pointers};

    /// Every kernel, in discriminant order.
    pub const ALL: [Kernel; Self::COUNT] = [
{all}    ];

    /// The kernel's name, which its specialised entry points start with (`NAME__...`).
    pub fn name(self) -> &'static str {{
        match self {{
{names}        }}
    }}

    /// Its pointer parameters, in order.
    pub fn pointers(self) -> &'static [Pointer] {{
        match self {{
{pointers}        }}
    }}

    /// The C name of its parameter struct, passed by value after the pointers.
    pub fn params(self) -> &'static str {{
        match self {{
{params}        }}
    }}

    /// The template of `kernels/` that its entry points instantiate with a spec.
    pub fn body(self) -> &'static str {{
        match self {{
{bodies}        }}
    }}

    /// The `.cu` file of `kernels/` that defines its body.
    pub fn file(self) -> &'static str {{
        match self {{
{files}        }}
    }}

    /// Width in bits of its widest global load, as the kernel table plans it (0: none).
    pub fn widest_load_bits(self) -> u32 {{
        match self {{
{loads}        }}
    }}

    /// Width in bits of its widest global store, as the kernel table plans it (0: none).
    pub fn widest_store_bits(self) -> u32 {{
        match self {{
{stores}        }}
    }}

    /// Bytes of its parameter struct (of its mirror in [`abi`](super::abi)).
    pub fn params_size(self) -> usize {{
        match self {{
{sizes}        }}
    }}
}}

/// Every kernel source, the `.cu` files of `kernels/` in the order of their first kernel
/// (generated by build.rs); each [`Kernel`] is defined by exactly one of them.
pub const SOURCES: [KernelSource; {source_count}] = [
{source_list}];

/// The headers the sources include, as `(include name, contents)`: every `.h` and `.cuh` file
/// of `kernels/`. A specialised entry point's program includes its kernel's source too
/// (`SOURCES`).
pub const HEADERS: [(&str, &str); {header_count}] = [
{header_list}];
"#
    )
}

/// `$OUT_DIR/abi.rs`: the mirror of every struct the kernels' parameters hold, nested ones
/// first, and `AbiParams` for the parameter structs.
fn abi_rs(kernels: &[Kernel], structs: &BTreeMap<String, Struct>) -> String {
    fn visit<'a>(name: &'a str, structs: &'a BTreeMap<String, Struct>, order: &mut Vec<&'a str>) {
        if !order.contains(&name) {
            for nested in structs[name]
                .fields
                .iter()
                .filter_map(|f| f.nested.as_deref())
            {
                visit(nested, structs, order);
            }
            order.push(name);
        }
    }
    let mut order = Vec::new();
    for k in kernels {
        visit(&k.params, structs, &mut order);
    }
    let mut code = String::new();
    for name in order {
        let s = &structs[name];
        let rust = camel(name);
        let users: Vec<String> = kernels
            .iter()
            .filter(|k| k.params == name)
            .map(|k| format!("`{}`", k.name))
            .collect();
        let mut doc =
            format!("`struct {name}` of `kernels/sdp4bit_abi.h` (a mirror made by build.rs)");
        if !users.is_empty() {
            doc += &format!(": the parameters of {}", users.join(", "));
        }
        doc.push('.');
        let eq = if s.float { "" } else { ", Eq" };
        let fields: String = s
            .fields
            .iter()
            .map(|f| {
                format!(
                    "    #[doc = {:?}]\n    pub {}: {},\n",
                    f.comment, f.name, f.rust
                )
            })
            .collect();
        let size = s.size;
        code += &format!(
            r#"#[doc = {doc:?}]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq{eq}, Default)]
pub struct {rust} {{
{fields}}}

// The C layout's size: the fields' sum, without padding.
const _: () = assert!(size_of::<{rust}>() == {size});

// SAFETY: `#[repr(C)]` of `Pod` fields without padding (the size above).
unsafe impl bytemuck::Zeroable for {rust} {{}}
// SAFETY: as above.
unsafe impl bytemuck::Pod for {rust} {{}}

"#
        );
        if !users.is_empty() {
            code += &format!(
                "impl AbiParams for {rust} {{\n    const C_NAME: &'static str = {name:?};\n}}\n\n"
            );
        }
    }
    code
}
