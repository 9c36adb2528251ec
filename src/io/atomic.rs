//! Writes that never leave a partial file under the final name.
//!
//! The data goes to `.NAME.upscale-tmp-PID-SEQ` in the destination's folder (same file
//! system, so the rename is atomic), is synced to disk, then renamed over `NAME`. Any error,
//! or a panic, removes the temporary. A crash can still leave one behind: [`is_temporary`]
//! lets folder walks skip them and [`remove_stale_temporaries`] cleans up those of a run's
//! own outputs.

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsStr;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use super::IoError;

/// Part of every temporary's name, after `.NAME`.
pub const TEMP_TAG: &str = ".upscale-tmp-";

/// True for a file name of the form `.NAME.upscale-tmp-...`.
pub fn is_temporary(path: &Path) -> bool {
    path.file_name().is_some_and(|n| {
        let n = n.to_string_lossy();
        n.starts_with('.') && n.contains(TEMP_TAG)
    })
}

/// Creates `dest`'s missing parent folders, then runs `write` on a buffered temporary file
/// and renames it to `dest` (replacing a file already there) only if `write` succeeded.
pub fn write_atomic<F>(dest: &Path, write: F) -> Result<(), IoError>
where
    F: FnOnce(&mut BufWriter<File>) -> Result<(), IoError>,
{
    write_atomic_with(dest, write)
}

/// [`write_atomic`] for a `write` whose errors are not only the file's (the network's, when
/// an image is written while it is computed).
pub fn write_atomic_with<F, E>(dest: &Path, write: F) -> Result<(), E>
where
    F: FnOnce(&mut BufWriter<File>) -> Result<(), E>,
    E: From<IoError>,
{
    let Some(name) = dest.file_name() else {
        return Err(IoError::bad_output(dest, "not a file name").into());
    };
    create_output_parent(dest)?;
    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let (tmp_path, file) = create_temporary(dir, name).map_err(|e| IoError::os(dest, e))?;
    let mut guard = RemoveOnDrop(Some(tmp_path));

    let mut w = BufWriter::with_capacity(1 << 20, file);
    write(&mut w)?;
    let file = w
        .into_inner()
        .map_err(|e| IoError::os(dest, e.into_error()))?;
    // Without the sync a crash soon after the rename can leave an empty or partial file
    // under the final name on some file systems.
    file.sync_all().map_err(|e| IoError::os(dest, e))?;
    drop(file);

    let tmp_path = guard.0.take().expect("set above");
    if let Err(e) = fs::rename(&tmp_path, dest) {
        guard.0 = Some(tmp_path);
        return Err(IoError::os(dest, e).into());
    }
    Ok(())
}

struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

fn create_temporary(dir: &Path, name: &std::ffi::OsStr) -> std::io::Result<(PathBuf, File)> {
    // PID keeps processes sharing an output folder apart; the counter keeps threads apart.
    static SEQ: AtomicU64 = AtomicU64::new(0);
    loop {
        let mut tmp_name = OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(
            "{TEMP_TAG}{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let path = dir.join(tmp_name);
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(f) => return Ok((path, f)),
            // Left by a dead process that had our PID; take the next number.
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// The final name a temporary was writing, from `.NAME.upscale-tmp-PID-SEQ`.
fn temporary_target(file_name: &str) -> Option<&str> {
    file_name
        .strip_prefix('.')?
        .rsplit_once(TEMP_TAG)
        .map(|(name, _)| name)
}

/// Removes the temporaries that writers of `outputs` left behind (a killed run) and that have
/// not been touched for `min_age` (so a live writer, even another process's, keeps its own).
/// Only the outputs' own folders are read, not below them, and only temporaries of exactly
/// these outputs are removed. Returns what was removed.
pub fn remove_stale_temporaries(
    outputs: &[&Path],
    min_age: Duration,
) -> Result<Vec<PathBuf>, IoError> {
    let mut by_dir: BTreeMap<&Path, HashSet<&OsStr>> = BTreeMap::new();
    for out in outputs {
        let dir = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if let Some(name) = out.file_name() {
            by_dir.entry(dir).or_default().insert(name);
        }
    }
    let now = SystemTime::now();
    let mut removed = Vec::new();
    for (dir, names) in by_dir {
        let entries = match fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(IoError::os(dir, e)),
        };
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let ours = file_name
                .to_str()
                .and_then(temporary_target)
                .is_some_and(|t| names.contains(OsStr::new(t)));
            if !ours || !entry.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let Ok(modified) = entry.metadata().and_then(|m| m.modified()) else {
                continue; // gone already, or no timestamps: leave it
            };
            if now.duration_since(modified).unwrap_or_default() >= min_age {
                let path = entry.path();
                match fs::remove_file(&path) {
                    Ok(()) => removed.push(path),
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(IoError::os(&path, e)),
                }
            }
        }
    }
    removed.sort();
    Ok(removed)
}

/// Fails when a folder that would have to hold `path` is an existing regular file
/// (`-o notes.txt/out.png`). Creates nothing.
pub fn check_output_parent(path: &Path) -> Result<(), IoError> {
    let mut ancestor = path.parent();
    while let Some(a) = ancestor {
        let probe = if a.as_os_str().is_empty() {
            Path::new(".")
        } else {
            a
        };
        match fs::metadata(probe) {
            Ok(m) if m.is_dir() => return Ok(()),
            Ok(_) => {
                return Err(IoError::bad_output(
                    path,
                    format!("cannot be created: {} is a file, not a folder", a.display()),
                ))
            }
            // Missing, or under a file further up: keep climbing to find which.
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
                ancestor = a.parent();
            }
            Err(e) => return Err(IoError::os(probe, e)),
        }
    }
    Ok(())
}

/// Creates the folders that will hold `path`, with [`check_output_parent`]'s clear error
/// when one of them is a file.
fn create_output_parent(path: &Path) -> Result<(), IoError> {
    check_output_parent(path)?;
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => {
            fs::create_dir_all(p).map_err(|e| IoError::os(p, e))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn success_replaces_and_creates_folders() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("a/b/out.bin");
        write_atomic(&dest, |w| {
            w.write_all(b"one").map_err(|e| IoError::os(&dest, e))
        })
        .unwrap();
        write_atomic(&dest, |w| {
            w.write_all(b"two").map_err(|e| IoError::os(&dest, e))
        })
        .unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"two");
        assert_eq!(names(&dir.path().join("a/b")), ["out.bin"]);
    }

    #[test]
    fn error_or_panic_leaves_no_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.bin");
        let e = write_atomic(&dest, |w| {
            w.write_all(&[7; 3 << 20]).unwrap(); // past the buffer: bytes reach the disk
            Err(IoError::bad_output(&dest, "encoder gave up"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("encoder gave up"));
        assert!(names(dir.path()).is_empty());

        let panicked = std::panic::catch_unwind(|| {
            let _ = write_atomic(&dest, |w| {
                w.write_all(b"partial").unwrap();
                panic!("encoder bug");
            });
        });
        assert!(panicked.is_err());
        assert!(names(dir.path()).is_empty());

        // An old complete file survives a failed rewrite untouched.
        fs::write(&dest, b"old").unwrap();
        let _ = write_atomic(&dest, |_| Err(IoError::bad_output(&dest, "no")));
        assert_eq!(fs::read(&dest).unwrap(), b"old");
        assert_eq!(names(dir.path()), ["out.bin"]);
    }

    #[test]
    fn output_under_a_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("some.txt");
        fs::write(&file, b"x").unwrap();
        let dest = file.join("deeper/out.png");
        let e = write_atomic(&dest, |_| Ok(())).unwrap_err();
        assert!(matches!(e, IoError::BadOutput { .. }), "{e}");
        assert!(e.to_string().contains("some.txt is a file"), "{e}");
    }

    #[test]
    fn temporaries_are_recognised_and_stale_ones_removed() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("sub");
        fs::create_dir(&sub).unwrap();
        let ours = dir.path().join(".a.png.upscale-tmp-12-0");
        let other_name = dir.path().join(".c.png.upscale-tmp-12-1");
        let below = sub.join(".a.png.upscale-tmp-99-3");
        for p in [&ours, &other_name, &below] {
            fs::write(p, b"partial").unwrap();
        }
        fs::write(dir.path().join("a.png"), b"x").unwrap();
        let not_hidden = dir.path().join("a.png.upscale-tmp-1-0");
        fs::write(&not_hidden, b"not hidden: not ours").unwrap();
        assert!(is_temporary(&ours) && !is_temporary(Path::new("a.png")));
        assert_eq!(temporary_target(".a.png.upscale-tmp-12-0"), Some("a.png"));
        assert_eq!(temporary_target("a.png.upscale-tmp-12-0"), None);

        let outputs = [dir.path().join("a.png"), dir.path().join("b.png")];
        let outputs: Vec<&Path> = outputs.iter().map(|p| p.as_path()).collect();
        let hour = Duration::from_secs(3600);
        assert!(remove_stale_temporaries(&outputs, hour).unwrap().is_empty());
        assert_eq!(
            remove_stale_temporaries(&outputs, Duration::ZERO).unwrap(),
            vec![ours.clone()]
        );
        // Another output's temporary, one in a folder below and a file that only looks like
        // one stay: this run did not write them.
        for p in [&other_name, &below, &not_hidden] {
            assert!(p.exists(), "{}", p.display());
        }
        assert!(dir.path().join("a.png").exists());
    }
}
