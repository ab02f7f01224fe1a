//! The files of an older commit, taken from git (`git archive`) into a cache directory: the
//! kernel model counts the kernels that ran on a GPU, which later commits change.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache_entry::make_entry;

/// The files under `paths` of `commit` of the repository `repository`, extracted into a
/// directory of `cache` named by the commit and the paths (made once, complete or not at all,
/// so that callers asking for other paths of the same commit never share an incomplete one);
/// its path.
pub fn commit_sources(
    repository: &Path,
    commit: &str,
    paths: &[&str],
    cache: &Path,
) -> Result<PathBuf, String> {
    let named = paths.join("+").replace('/', "_");
    let dir = cache.join(format!("sources-{commit}-{named}"));
    if paths.iter().all(|p| dir.join(p).exists()) {
        return Ok(dir);
    }
    make_entry(&dir, |staging| extract(repository, commit, paths, staging))?;
    Ok(dir)
}

/// Extracts the files under `paths` of `commit` into `into`.
fn extract(repository: &Path, commit: &str, paths: &[&str], into: &Path) -> Result<(), String> {
    let archive = Command::new("git")
        .arg("-C")
        .arg(repository)
        .args(["archive", "--format=tar", commit])
        .args(paths)
        .output()
        .map_err(|e| format!("start git: {e}"))?;
    if !archive.status.success() {
        return Err(format!(
            "git archive {commit} failed (a shallow clone lacks older commits):\n{}",
            String::from_utf8_lossy(&archive.stderr)
        ));
    }
    let tar = into.join("sources.tar");
    std::fs::write(&tar, &archive.stdout).map_err(|e| format!("{}: {e}", tar.display()))?;
    let untar = Command::new("tar")
        .arg("-xf")
        .arg(&tar)
        .arg("-C")
        .arg(into)
        .status()
        .map_err(|e| format!("start tar: {e}"))?;
    let _ = std::fs::remove_file(&tar);
    if untar.success() {
        Ok(())
    } else {
        Err(format!("tar could not extract the sources of {commit}"))
    }
}
