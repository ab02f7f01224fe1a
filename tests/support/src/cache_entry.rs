//! Directories no other thread or process shares: the entries of the test builds' caches,
//! made whole or not at all, and private working directories. Both come from tempfile, whose
//! names are created exclusively, so two callers never meet in one directory (a name made of
//! the process id and the clock's nanoseconds is not unique among threads, nor on a machine
//! whose clock is coarse).

use std::path::Path;

use tempfile::TempDir;

/// Makes the cache entry `dir`: `fill` writes it into a private staging directory beside it,
/// which is then renamed into place. When another thread or process made the same entry first,
/// its copy stays (either will do) and this one is removed.
pub fn make_entry(
    dir: &Path,
    fill: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), String> {
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Err(format!("{}: not a cache entry's path", dir.display()));
    };
    let staging = private_dir(parent, &format!(".{}.staging-", name.to_string_lossy()))?;
    fill(staging.path())?;
    // A failed rename means the entry exists (a directory that is not empty); dropping
    // `staging` removes this copy, and nothing once the rename has moved it.
    let _ = std::fs::rename(staging.path(), dir);
    Ok(())
}

/// Makes the cache entry `dir` of `files` (names and contents).
pub fn write_entry<N: AsRef<Path>, T: AsRef<[u8]>>(
    dir: &Path,
    files: &[(N, T)],
) -> Result<(), String> {
    make_entry(dir, |staging| {
        files.iter().try_for_each(|(name, bytes)| {
            let path = staging.join(name);
            std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))
        })
    })
}

/// A new directory in `parent`, named `prefix` and random characters, removed when dropped.
pub fn private_dir(parent: &Path, prefix: &str) -> Result<TempDir, String> {
    std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(parent)
        .map_err(|e| format!("a directory in {}: {e}", parent.display()))
}
