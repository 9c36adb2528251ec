//! Expanding the INPUT arguments into the list of files to process.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use upscale::io::{is_image_path, is_temporary};

use super::path_error::PathError;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InputFile {
    /// The path to open.
    pub path: PathBuf,
    /// The folder argument this file was found under; `None` when named on the command line.
    pub root: Option<PathBuf>,
    /// Path below `root`, or just the file name when named on the command line.
    pub rel: PathBuf,
}

/// Expands files and folders into one list, sorted by path and without duplicates (the same
/// file reached twice, e.g. named and inside a named folder, is kept once, as first reached).
///
/// Named paths that are not folders are always taken, even with no image extension or when
/// missing, so that decoding reports what is wrong with them. From folders only files with an
/// image extension are taken, never our own temporaries; sub-folders only with `recursive`.
/// Symlinked files are taken, symlinked folders are not entered (no cycles).
pub fn walk(inputs: &[PathBuf], recursive: bool) -> Result<Vec<InputFile>, PathError> {
    let mut files = Vec::new();
    for input in inputs {
        if input.is_dir() {
            walk_dir(input, Path::new(""), recursive, &mut files)?;
        } else {
            let rel = input
                .file_name()
                .map_or_else(|| input.clone(), PathBuf::from);
            files.push(InputFile {
                path: input.clone(),
                root: None,
                rel,
            });
        }
    }
    let mut seen = HashSet::new();
    files.retain(|f| seen.insert(fs::canonicalize(&f.path).unwrap_or_else(|_| f.path.clone())));
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(files)
}

fn walk_dir(
    root: &Path,
    rel: &Path,
    recursive: bool,
    out: &mut Vec<InputFile>,
) -> Result<(), PathError> {
    let dir = if rel.as_os_str().is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    };
    for entry in fs::read_dir(&dir).map_err(|e| PathError::os(&dir, e))? {
        let entry = entry.map_err(|e| PathError::os(&dir, e))?;
        let path = entry.path();
        let ty = entry.file_type().map_err(|e| PathError::os(&path, e))?;
        let rel = rel.join(entry.file_name());
        if ty.is_dir() {
            if recursive {
                walk_dir(root, &rel, recursive, out)?;
            }
        } else if is_image_path(&path)
            && !is_temporary(&path)
            && (ty.is_file() || (ty.is_symlink() && path.is_file()))
        {
            out.push(InputFile {
                path,
                root: Some(root.to_path_buf()),
                rel,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(root: &Path, rel: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, b"x").unwrap();
    }

    fn rels(files: &[InputFile]) -> Vec<String> {
        files
            .iter()
            .map(|f| f.rel.to_string_lossy().replace('\\', "/"))
            .collect()
    }

    #[test]
    fn folders_give_sorted_images_only() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("in");
        for rel in [
            "b.png",
            "A.JPG",
            "c.jpeg",
            "notes.txt",
            "README",
            "d.WebP",
            ".e.png.upscale-tmp-42-0",
            "sub/z.tiff",
            "sub/y.tif",
            "sub/skip.gif",
            "sub/deeper/x.png",
        ] {
            touch(&root, rel);
        }
        fs::create_dir_all(root.join("empty")).unwrap();

        let flat = walk(std::slice::from_ref(&root), false).unwrap();
        assert_eq!(rels(&flat), ["A.JPG", "b.png", "c.jpeg", "d.WebP"]);
        assert!(flat
            .iter()
            .all(|f| f.root.as_deref() == Some(root.as_path())));
        assert_eq!(flat[1].path, root.join("b.png"));

        let deep = walk(std::slice::from_ref(&root), true).unwrap();
        assert_eq!(
            rels(&deep),
            [
                "A.JPG",
                "b.png",
                "c.jpeg",
                "d.WebP",
                "sub/deeper/x.png",
                "sub/y.tif",
                "sub/z.tiff"
            ]
        );
    }

    #[test]
    fn named_files_are_always_taken_and_duplicates_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("in");
        touch(&root, "a.png");
        touch(&root, "b.png");
        touch(dir.path(), "notes.txt");
        let missing = dir.path().join("missing.png");
        let inputs = [
            dir.path().join("notes.txt"),
            root.join("a.png"),
            missing.clone(),
            root.clone(),
            root.join("./b.png"),
            root.clone(),
        ];
        let files = walk(&inputs, false).unwrap();
        let paths: Vec<&Path> = files.iter().map(|f| f.path.as_path()).collect();
        assert_eq!(
            paths,
            [
                root.join("a.png").as_path(),
                root.join("b.png").as_path(),
                missing.as_path(),
                dir.path().join("notes.txt").as_path(),
            ]
        );
        // a.png was named before its folder: it keeps the named form.
        assert_eq!(files[0].root, None);
        assert_eq!(files[1].root.as_deref(), Some(root.as_path()));
        assert_eq!(files[2].rel, Path::new("missing.png"));
    }

    #[test]
    fn unreadable_folder_is_an_error_naming_it() {
        // A folder that vanished between listing and walking behaves like an unreadable one.
        let dir = tempfile::tempdir().unwrap();
        let mut out = Vec::new();
        let e = walk_dir(&dir.path().join("gone"), Path::new(""), true, &mut out).unwrap_err();
        assert!(e.to_string().contains("gone"), "{e}");
    }
}
