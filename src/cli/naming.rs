//! Where each input's result goes.
//!
//! * One named file, no `-o`: `<stem>_<tag>.<ext>` beside it, the tag naming the size:
//!   `x4` (the model's scale), `x3.5` (`--outscale`), `w1920`, `h1080`, `640x480`.
//! * One named file, `-o FILE`: that file; its extension picks the format (it must agree
//!   with `--format` if both are given). `-o` is a folder instead when it is an existing
//!   folder or ends with a path separator.
//! * Otherwise `-o DIR`: folder inputs keep their relative paths under DIR, named files go
//!   to `DIR/<name>`. File names are kept; only the extension changes, with the format.
//! * A folder, no `-o`: the results go to a sibling folder `<folder>_<tag>`, with the
//!   same relative paths and names (as `-o <folder>_<tag>`). Writing beside each input
//!   instead would make the next run over the folder pick the results up as inputs.
//!
//! The format is `--format`, else the input's own, judged by its extension (by its content
//! when the extension says nothing), so that a name's extension always matches its content.
//! An extension is kept as spelt (`.JPEG`) when the format does not change.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf, MAIN_SEPARATOR};

use upscale::io::check_output_parent;

use super::path_error::PathError;
use upscale::Format;

use super::walk::InputFile;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamingOptions {
    /// `-o`: a file for one named input, else a folder.
    pub output: Option<PathBuf>,
    /// What names results made without `-o`: `x4`, `x3.5`, `w1920`, `640x480`
    /// ([`crate::OutputSize::tag`]).
    pub tag: String,
    /// `--format`.
    pub format: Option<Format>,
    pub overwrite: bool,
}

/// `-` on the command line: standard input as an input, standard output as `-o`.
pub fn is_dash(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// What names standard input in messages.
pub const STDIN_NAME: &str = "standard input";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    pub input: InputFile,
    pub output: PathBuf,
    pub format: Format,
    /// The output exists and overwriting was not asked for.
    pub skip: bool,
}

/// One [`Job`] per input, in input order. Fails, before anything is computed, when an output
/// would land under a regular file, on an existing folder, on its own input, or on the
/// output of another input.
pub fn plan_outputs(files: &[InputFile], opts: &NamingOptions) -> Result<Vec<Job>, PathError> {
    let single = files.len() == 1 && files[0].root.is_none();
    let mut jobs = Vec::with_capacity(files.len());
    match &opts.output {
        Some(out) if single && !is_folder_like(out) => {
            let format = file_output_format(out, opts.format, || input_format(&files[0].path))?;
            jobs.push(job(&files[0], out.clone(), format));
        }
        Some(dir) => {
            if dir.exists() && !dir.is_dir() {
                return Err(PathError::bad_output(
                    dir,
                    "is a file; with several inputs or a folder, -o must name a folder",
                ));
            }
            for f in files {
                let (name, format) = same_name(f, opts.format);
                let output = match &f.root {
                    Some(_) => dir.join(f.rel.with_file_name(name)),
                    None => dir.join(name),
                };
                jobs.push(job(f, output, format));
            }
        }
        None => {
            for f in files {
                let (output, format) = match &f.root {
                    None => {
                        let (name, format) = suffixed_name(f, &opts.tag, opts.format);
                        (f.path.with_file_name(name), format)
                    }
                    Some(root) => {
                        let (name, format) = same_name(f, opts.format);
                        let dir = sibling_folder(root, &opts.tag)?;
                        (dir.join(f.rel.with_file_name(name)), format)
                    }
                };
                jobs.push(job(f, output, format));
            }
        }
    }
    check_jobs(&mut jobs, opts.overwrite)?;
    Ok(jobs)
}

fn job(input: &InputFile, output: PathBuf, format: Format) -> Job {
    Job {
        input: input.clone(),
        output,
        format,
        skip: false,
    }
}

/// `-o` names a folder: an existing one, or any path ending with a separator.
pub fn is_folder_like(out: &Path) -> bool {
    let s = out.as_os_str().to_string_lossy();
    out.is_dir() || s.ends_with(MAIN_SEPARATOR) || s.ends_with('/')
}

/// The format of an output file named `out`: its extension's, else `asked` (`--format`),
/// else `input()`'s. An extension that disagrees with `asked` is an error.
pub fn file_output_format(
    out: &Path,
    asked: Option<Format>,
    input: impl FnOnce() -> Format,
) -> Result<Format, PathError> {
    match (Format::from_path(out), asked) {
        (Some(by_name), Some(asked)) if by_name != asked => Err(PathError::bad_output(
            out,
            format!("the extension says {by_name} but --format says {asked}"),
        )),
        (Some(by_name), _) => Ok(by_name),
        (None, Some(asked)) => Ok(asked),
        (None, None) => Ok(input()),
    }
}

/// The input's format by extension, else by content; PNG when neither tells (the file will
/// fail to decode anyway).
fn input_format(path: &Path) -> Format {
    Format::from_path(path)
        .or_else(|| {
            let mut head = Vec::with_capacity(16);
            File::open(path)
                .and_then(|f| f.take(16).read_to_end(&mut head))
                .ok()?;
            Format::sniff(&head)
        })
        .unwrap_or(Format::Png)
}

/// Splits a file name into the part before a recognised image extension, and that
/// extension; a name without one is all base (`photo.v2` stays whole).
fn split_name(name: &OsStr) -> (OsString, Option<&str>) {
    let path = Path::new(name);
    match (path.file_stem(), path.extension().and_then(OsStr::to_str)) {
        (Some(stem), Some(ext)) if Format::from_extension(ext).is_some() => {
            (stem.to_os_string(), Some(ext))
        }
        _ => (name.to_os_string(), None),
    }
}

/// `base + suffix + "." + ext`, keeping the input's extension spelling when it already
/// names `format`.
fn build_name(f: &InputFile, suffix: &str, asked: Option<Format>) -> (OsString, Format) {
    let file_name = f.path.file_name().unwrap_or(f.path.as_os_str());
    let (mut name, ext) = split_name(file_name);
    let format = asked.unwrap_or_else(|| input_format(&f.path));
    let ext = match ext {
        Some(e) if Format::from_extension(e) == Some(format) => e,
        _ => format.extension(),
    };
    name.push(suffix);
    name.push(".");
    name.push(ext);
    (name, format)
}

fn same_name(f: &InputFile, asked: Option<Format>) -> (OsString, Format) {
    build_name(f, "", asked)
}

fn suffixed_name(f: &InputFile, tag: &str, asked: Option<Format>) -> (OsString, Format) {
    build_name(f, &format!("_{tag}"), asked)
}

/// `photos` -> `photos_x4` next to it. `.` and `..` have no name of their own, so those are
/// resolved first.
fn sibling_folder(root: &Path, tag: &str) -> Result<PathBuf, PathError> {
    let named = match root.file_name() {
        Some(_) => root.to_path_buf(),
        None => fs::canonicalize(root).map_err(|e| PathError::os(root, e))?,
    };
    let Some(name) = named.file_name() else {
        return Err(PathError::bad_output(
            root,
            "has no folder name to derive an output folder from; give -o",
        ));
    };
    let mut out = name.to_os_string();
    out.push(format!("_{tag}"));
    Ok(named.with_file_name(out))
}

fn check_jobs(jobs: &mut [Job], overwrite: bool) -> Result<(), PathError> {
    let mut checked_parents: HashSet<PathBuf> = HashSet::new();
    let mut claimed: HashMap<PathBuf, usize> = HashMap::new();
    for i in 0..jobs.len() {
        let out = jobs[i].output.clone();
        if let Some(&j) = claimed.get(&out) {
            return Err(PathError::bad_output(
                &out,
                format!(
                    "both {} and {} would be written here",
                    jobs[j].input.path.display(),
                    jobs[i].input.path.display()
                ),
            ));
        }
        claimed.insert(out.clone(), i);

        let parent = out.parent().unwrap_or(Path::new("")).to_path_buf();
        if !checked_parents.contains(&parent) {
            check_output_parent(&out)?;
            checked_parents.insert(parent);
        }

        match fs::metadata(&out) {
            Ok(m) if m.is_dir() => {
                return Err(PathError::bad_output(&out, "is a folder, not a file"));
            }
            Ok(_) => {
                if same_file(&out, &jobs[i].input.path) {
                    return Err(PathError::bad_output(&out, "would replace its own input"));
                }
                jobs[i].skip = !overwrite;
            }
            Err(_) => {}
        }
    }
    Ok(())
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::canonicalize(a), fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::walk::walk;

    fn opts(output: Option<&Path>, format: Option<Format>) -> NamingOptions {
        NamingOptions {
            output: output.map(Path::to_path_buf),
            tag: "x4".into(),
            format,
            overwrite: false,
        }
    }

    fn touch(p: &Path) {
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, b"x").unwrap();
    }

    fn one(files: &[InputFile], o: &NamingOptions) -> (PathBuf, Format) {
        let jobs = plan_outputs(files, o).unwrap();
        assert_eq!(jobs.len(), 1);
        (jobs[0].output.clone(), jobs[0].format)
    }

    #[test]
    fn single_file() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let input = d.join("Photo.JPEG");
        touch(&input);
        let files = walk(std::slice::from_ref(&input), false).unwrap();

        assert_eq!(
            one(&files, &opts(None, None)),
            (d.join("Photo_x4.JPEG"), Format::Jpeg)
        );
        assert_eq!(
            one(&files, &opts(None, Some(Format::Jpeg))),
            (d.join("Photo_x4.JPEG"), Format::Jpeg)
        );
        assert_eq!(
            one(&files, &opts(None, Some(Format::Png))),
            (d.join("Photo_x4.png"), Format::Png)
        );
        // -o FILE: its extension decides; without one, --format or the input's format.
        let out = d.join("big.webp");
        assert_eq!(
            one(&files, &opts(Some(&out), None)),
            (out.clone(), Format::Webp)
        );
        let e = plan_outputs(&files, &opts(Some(&out), Some(Format::Png))).unwrap_err();
        assert!(e.to_string().contains("--format"), "{e}");
        let bare = d.join("big");
        assert_eq!(
            one(&files, &opts(Some(&bare), None)),
            (bare.clone(), Format::Jpeg)
        );
        assert_eq!(
            one(&files, &opts(Some(&bare), Some(Format::Tiff))),
            (bare, Format::Tiff)
        );
        // -o naming an existing folder, or ending with a separator: DIR/<name>.
        let outdir = d.join("out");
        fs::create_dir(&outdir).unwrap();
        assert_eq!(
            one(&files, &opts(Some(&outdir), None)).0,
            outdir.join("Photo.JPEG")
        );
        let newdir = PathBuf::from(format!("{}/new/", d.display()));
        assert_eq!(
            one(&files, &opts(Some(&newdir), None)).0,
            d.join("new/Photo.JPEG")
        );

        // No recognised extension: named by content, extension appended to the whole name.
        let odd = d.join("scan.v2");
        fs::write(&odd, b"\x89PNG\r\n\x1a\n........").unwrap();
        let files = walk(&[odd], false).unwrap();
        assert_eq!(
            one(&files, &opts(None, None)),
            (d.join("scan.v2_x4.png"), Format::Png)
        );
    }

    /// A size other than the model's names results by that size, beside files and for
    /// folders alike.
    #[test]
    fn tags_name_the_size() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.png");
        touch(&file);
        let root = dir.path().join("photos");
        touch(&root.join("b.png"));
        for tag in ["x3.5", "w1920", "640x480"] {
            let o = NamingOptions {
                tag: tag.into(),
                ..opts(None, None)
            };
            let jobs = plan_outputs(&walk(std::slice::from_ref(&file), false).unwrap(), &o);
            let name = format!("a_{tag}.png");
            assert_eq!(jobs.unwrap()[0].output, dir.path().join(name));
            let jobs = plan_outputs(&walk(std::slice::from_ref(&root), false).unwrap(), &o);
            let folder = dir.path().join(format!("photos_{tag}"));
            assert_eq!(jobs.unwrap()[0].output, folder.join("b.png"));
        }
    }

    #[test]
    fn folders() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("photos");
        touch(&root.join("a.png"));
        touch(&root.join("sub/b.jpg"));
        let files = walk(std::slice::from_ref(&root), true).unwrap();

        let out = dir.path().join("out");
        let jobs = plan_outputs(&files, &opts(Some(&out), None)).unwrap();
        let outs: Vec<_> = jobs.iter().map(|j| j.output.clone()).collect();
        assert_eq!(outs, [out.join("a.png"), out.join("sub/b.jpg")]);

        let jobs = plan_outputs(&files, &opts(Some(&out), Some(Format::Webp))).unwrap();
        let outs: Vec<_> = jobs.iter().map(|j| j.output.clone()).collect();
        assert_eq!(outs, [out.join("a.webp"), out.join("sub/b.webp")]);
        assert!(jobs.iter().all(|j| j.format == Format::Webp));

        // No -o: a sibling folder photos_x4 with the same layout.
        let jobs = plan_outputs(&files, &opts(None, None)).unwrap();
        let sib = dir.path().join("photos_x4");
        assert_eq!(jobs[0].output, sib.join("a.png"));
        assert_eq!(jobs[1].output, sib.join("sub/b.jpg"));

        // Named files beside a folder, with -o DIR, go to DIR/<name>.
        let extra = dir.path().join("extra.tif");
        touch(&extra);
        let files = walk(&[root.clone(), extra], true).unwrap();
        let jobs = plan_outputs(&files, &opts(Some(&out), None)).unwrap();
        assert_eq!(jobs[0].output, out.join("extra.tif"));
    }

    #[test]
    fn existing_outputs_are_skipped_unless_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("in");
        touch(&root.join("a.png"));
        touch(&root.join("b.png"));
        let out = dir.path().join("out");
        touch(&out.join("a.png"));
        let files = walk(&[root], false).unwrap();
        let mut o = opts(Some(&out), None);
        let skips: Vec<bool> = plan_outputs(&files, &o)
            .unwrap()
            .iter()
            .map(|j| j.skip)
            .collect();
        assert_eq!(skips, [true, false]);
        o.overwrite = true;
        assert!(plan_outputs(&files, &o).unwrap().iter().all(|j| !j.skip));
    }

    #[test]
    fn unusable_outputs_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let input = d.join("a.png");
        touch(&input);
        let txt = d.join("some.txt");
        touch(&txt);
        let single = walk(std::slice::from_ref(&input), false).unwrap();

        let e = plan_outputs(&single, &opts(Some(&txt.join("out.png")), None)).unwrap_err();
        assert!(
            matches!(&e, PathError::Library(l) if l.kind() == upscale::ErrorKind::Output),
            "{e}"
        );
        assert!(
            e.to_string().contains("some.txt is a file, not a folder"),
            "{e}"
        );

        let e = plan_outputs(&single, &opts(Some(&input), None)).unwrap_err();
        assert!(e.to_string().contains("its own input"), "{e}");

        let root = d.join("in");
        touch(&root.join("x.png"));
        let folder = walk(std::slice::from_ref(&root), false).unwrap();
        let e = plan_outputs(&folder, &opts(Some(&txt), None)).unwrap_err();
        assert!(e.to_string().contains("must name a folder"), "{e}");
        let e = plan_outputs(&folder, &opts(Some(&root), None)).unwrap_err();
        assert!(e.to_string().contains("its own input"), "{e}");

        // Two folders with the same layout into one -o DIR.
        let other = d.join("in2");
        touch(&other.join("x.png"));
        let both = walk(&[root, other], false).unwrap();
        let e = plan_outputs(&both, &opts(Some(&d.join("out")), None)).unwrap_err();
        assert!(e.to_string().contains("would be written here"), "{e}");

        // An output name taken by a folder.
        fs::create_dir(d.join("a_x4.png")).unwrap();
        let e = plan_outputs(&single, &opts(None, None)).unwrap_err();
        assert!(e.to_string().contains("is a folder"), "{e}");
    }
}
