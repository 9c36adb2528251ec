//! Writes that never leave a partial file under the final name.
//!
//! The data goes to `.NAME.upscale-tmp-PID-SEQ` in the destination's folder (same file
//! system, so the rename is atomic), is synced to disk, then renamed over `NAME`. Any error,
//! or a panic, removes the temporary. A crash can still leave one behind: [`is_temporary`]
//! lets folder walks skip them and [`remove_stale_temporaries`] cleans them up.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use super::{create_output_parent, IoError};

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
    let Some(name) = dest.file_name() else {
        return Err(IoError::bad_output(dest, "not a file name"));
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
        return Err(IoError::os(dest, e));
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

/// Our temporaries under `dir`, at any depth (symlinked folders are not followed).
pub fn find_temporaries(dir: &Path) -> Result<Vec<PathBuf>, IoError> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).map_err(|e| IoError::os(&d, e))? {
            let entry = entry.map_err(|e| IoError::os(&d, e))?;
            let ty = entry
                .file_type()
                .map_err(|e| IoError::os(&entry.path(), e))?;
            if ty.is_dir() {
                stack.push(entry.path());
            } else if ty.is_file() && is_temporary(&entry.path()) {
                found.push(entry.path());
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Removes our temporaries under `dir` not modified for `min_age`, and returns them. The age
/// guard matters because other processes (other shards) may be writing into the same folder
/// right now; a live write touches its temporary continuously.
pub fn remove_stale_temporaries(dir: &Path, min_age: Duration) -> Result<Vec<PathBuf>, IoError> {
    let now = SystemTime::now();
    let mut removed = Vec::new();
    for path in find_temporaries(dir)? {
        let Ok(modified) = fs::metadata(&path).and_then(|m| m.modified()) else {
            continue; // gone already, or no timestamps: leave it
        };
        if now.duration_since(modified).unwrap_or_default() >= min_age {
            match fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(IoError::os(&path, e)),
            }
        }
    }
    Ok(removed)
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
        let t1 = dir.path().join(".a.png.upscale-tmp-12-0");
        let t2 = sub.join(".b.jpg.upscale-tmp-99-3");
        for p in [&t1, &t2] {
            fs::write(p, b"partial").unwrap();
        }
        fs::write(dir.path().join("a.png"), b"x").unwrap();
        fs::write(
            dir.path().join("a.png.upscale-tmp-1-0"),
            b"not hidden: not ours",
        )
        .unwrap();
        assert!(is_temporary(&t1) && !is_temporary(Path::new("a.png")));
        assert_eq!(find_temporaries(dir.path()).unwrap(), {
            let mut v = vec![t1.clone(), t2.clone()];
            v.sort();
            v
        });
        let hour = Duration::from_secs(3600);
        assert!(remove_stale_temporaries(dir.path(), hour)
            .unwrap()
            .is_empty());
        assert_eq!(
            remove_stale_temporaries(dir.path(), Duration::ZERO)
                .unwrap()
                .len(),
            2
        );
        assert!(find_temporaries(dir.path()).unwrap().is_empty());
        assert!(dir.path().join("a.png").exists());
    }
}
