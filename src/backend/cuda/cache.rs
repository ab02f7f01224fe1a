//! The on-disk cache of compiled kernels: the image of every specialisation (a CUBIN, or PTX)
//! kept in a directory shared by the processes of a node, keyed by everything that decides its
//! bytes, so that a job compiles each specialisation once per node and a restart not at all.
//!
//! The directory is `SDP4BIT_KERNEL_CACHE_DIR`, else `$XDG_CACHE_HOME/sdp4bit/kernels`, else
//! `~/.cache/sdp4bit/kernels`; `SDP4BIT_KERNEL_CACHE=0` turns the cache off. A key is a hash of
//! the program's source (the wrapper and every kernel source and header), the NVRTC options and
//! target (the GPU architecture), the NVRTC version and the driver version. One process
//! compiles a missing image while holding an exclusive lock on `KEY.lock`; the others wait for
//! the lock and then read what it wrote. The image is written to a temporary file and renamed
//! into place, so no reader sees half a file, and its header records the key, the length and a
//! checksum, so a damaged file is compiled again and replaced. The cache only saves time: where
//! the directory cannot be made, locked or written, the image is compiled in the process and
//! used (said once on stderr), never a wrong one.

use std::fs::{self, File, OpenOptions};
use std::hash::Hasher as _;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Once;

use fnv::FnvHasher;

use super::compile::{OPTIONS, Target};
use super::source::{HEADERS, SOURCES};
use crate::error::Result;

/// The first line of every cached image.
const MAGIC: &str = "sdp4bit kernel image 1";

/// Where the cache lives, or `None` when it is off (`SDP4BIT_KERNEL_CACHE=0`) or no directory
/// can be named.
pub fn directory() -> Option<PathBuf> {
    if std::env::var_os("SDP4BIT_KERNEL_CACHE").is_some_and(|v| v == "0") {
        return None;
    }
    if let Some(dir) = std::env::var_os("SDP4BIT_KERNEL_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache")))?;
    Some(base.join("sdp4bit").join("kernels"))
}

/// The cache key of the program `code` compiled for `target` by NVRTC `nvrtc` (major, minor)
/// for a driver of CUDA version `driver`: 32 hex digits.
pub fn key(code: &str, target: Target, nvrtc: (u32, u32), driver: i32) -> String {
    let mut parts: Vec<String> = vec![
        code.to_string(),
        format!("{target:?}"),
        format!("nvrtc {}.{}", nvrtc.0, nvrtc.1),
        format!("driver {driver}"),
    ];
    parts.extend(OPTIONS.iter().map(|o| o.to_string()));
    for (name, text) in HEADERS
        .iter()
        .copied()
        .chain(SOURCES.iter().map(|s| (s.file, s.code)))
    {
        parts.push(format!("{name}\n{text}"));
    }
    let halves = [0u64, 1].map(|seed| {
        let mut hasher = FnvHasher::with_key(0xcbf2_9ce4_8422_2325 ^ seed);
        for part in &parts {
            hasher.write(&(part.len() as u64).to_le_bytes());
            hasher.write(part.as_bytes());
        }
        hasher.finish()
    });
    format!("{:016x}{:016x}", halves[0], halves[1])
}

/// The image cached under `key` in `dir`, or the one `compile` makes, which is then cached.
/// `compile` runs at most once per key and node while every process waits for it.
pub fn image(
    dir: Option<&Path>,
    key: &str,
    compile: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let Some(dir) = dir else {
        return compile();
    };
    if let Some(image) = read(dir, key) {
        return Ok(image);
    }
    let lock = match lock(dir, key) {
        Ok(lock) => lock,
        Err(e) => {
            warn_once(&format!("cannot lock {}: {e}", dir.display()));
            return compile();
        }
    };
    // Another process may have written it while this one waited for the lock.
    if let Some(image) = read(dir, key) {
        return Ok(image);
    }
    let image = compile()?;
    if let Err(e) = write(dir, key, &image) {
        warn_once(&format!("cannot write to {}: {e}", dir.display()));
    }
    drop(lock);
    Ok(image)
}

/// Says once per process that the cache is not used, and why.
fn warn_once(why: &str) {
    static WARNED: Once = Once::new();
    WARNED.call_once(|| {
        eprintln!(
            "sdp4bit: the kernel cache is not used ({why}); kernels are compiled in this process \
             (set SDP4BIT_KERNEL_CACHE_DIR to a writable directory)"
        );
    });
}

/// The exclusive lock on `KEY.lock` in `dir` (made if missing), held until dropped.
pub(super) fn lock(dir: &Path, key: &str) -> std::io::Result<File> {
    fs::create_dir_all(dir)?;
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(format!("{key}.lock")))?;
    file.lock()?;
    Ok(file)
}

/// The header of an image: the magic line, the key, the length and the checksum.
fn header(key: &str, image: &[u8]) -> String {
    format!(
        "{MAGIC}\n{key}\n{}\n{:016x}\n",
        image.len(),
        checksum(image)
    )
}

/// FNV-1a of `bytes`.
fn checksum(bytes: &[u8]) -> u64 {
    let mut hasher = FnvHasher::default();
    hasher.write(bytes);
    hasher.finish()
}

/// The image `dir/KEY.image` holds, or `None` when it is missing or does not match its
/// header (another key, a wrong length or checksum).
fn read(dir: &Path, key: &str) -> Option<Vec<u8>> {
    let mut bytes = Vec::new();
    File::open(dir.join(format!("{key}.image")))
        .ok()?
        .read_to_end(&mut bytes)
        .ok()?;
    let mut lines = bytes.splitn(5, |&b| b == b'\n');
    let (magic, stored, _, _) = (lines.next()?, lines.next()?, lines.next()?, lines.next()?);
    let image = lines.next()?;
    let valid = magic == MAGIC.as_bytes()
        && stored == key.as_bytes()
        && bytes.starts_with(header(key, image).as_bytes());
    valid.then(|| image.to_vec())
}

/// Writes `dir/KEY.image` through a temporary file renamed into place.
fn write(dir: &Path, key: &str, image: &[u8]) -> std::io::Result<()> {
    let mut bytes = header(key, image).into_bytes();
    bytes.extend_from_slice(image);
    write_atomically(dir, &format!("{key}.image"), &bytes)
}

/// Writes `dir/NAME` through a temporary file of the same directory renamed into place, so a
/// reader sees the old file or the new one, never half of one. Callers hold the name's
/// [`lock`], so no two writers share the temporary name.
pub(super) fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let temporary = dir.join(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
    let mut file = File::create(&temporary)?;
    file.write_all(bytes)?;
    drop(file);
    fs::rename(&temporary, dir.join(name)).inspect_err(|_| {
        let _ = fs::remove_file(&temporary);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::compile::Arch;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("sdp4bit-cache-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// Concurrent callers of one key compile once; the rest read the image.
    #[test]
    fn one_compile_per_key_among_concurrent_callers() {
        let dir = scratch("concurrent");
        let compiles = AtomicUsize::new(0);
        let images: Vec<Vec<u8>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        image(Some(&dir), "k1", || {
                            compiles.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_millis(50));
                            Ok(b"\x7fELF image".to_vec())
                        })
                        .unwrap()
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        assert_eq!(compiles.load(Ordering::SeqCst), 1);
        assert!(images.iter().all(|i| i == b"\x7fELF image"));
        // A later caller (a restart) compiles nothing.
        let again = image(Some(&dir), "k1", || panic!("compiled again")).unwrap();
        assert_eq!(again, b"\x7fELF image");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A damaged or foreign file is compiled again and replaced; no temporary file is left.
    #[test]
    fn damaged_images_are_replaced() {
        let dir = scratch("damaged");
        image(Some(&dir), "k2", || Ok(vec![1, 2, 3, 4])).unwrap();
        let path = dir.join("k2.image");
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        fs::write(&path, &bytes).unwrap();
        assert_eq!(read(&dir, "k2"), None);
        assert_eq!(
            image(Some(&dir), "k2", || Ok(vec![5, 6])).unwrap(),
            vec![5, 6]
        );
        fs::copy(&path, dir.join("k3.image")).unwrap();
        assert_eq!(read(&dir, "k3"), None, "an image cached under another key");
        let names: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The key changes with every input that decides the image's bytes.
    #[test]
    fn keys_follow_every_input() {
        let arch = Target::Cubin(Arch::SM_90);
        let base = key("code", arch, (13, 0), 13000);
        assert_eq!(base.len(), 32);
        assert_eq!(base, key("code", arch, (13, 0), 13000));
        for other in [
            key("code2", arch, (13, 0), 13000),
            key(
                "code",
                Target::Cubin(Arch {
                    major: 10,
                    minor: 0,
                }),
                (13, 0),
                13000,
            ),
            key("code", Target::Ptx(Arch::SM_90), (13, 0), 13000),
            key("code", arch, (13, 1), 13000),
            key("code", arch, (13, 0), 13010),
        ] {
            assert_ne!(base, other);
        }
    }

    /// Without a directory the image is compiled every time.
    #[test]
    fn no_directory_compiles() {
        let compiles = AtomicUsize::new(0);
        for _ in 0..2 {
            image(None, "k", || {
                compiles.fetch_add(1, Ordering::SeqCst);
                Ok(vec![0])
            })
            .unwrap();
        }
        assert_eq!(compiles.load(Ordering::SeqCst), 2);
    }
}
