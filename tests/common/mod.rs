//! Helpers shared by the command-line tests: fixture paths, generated images and checks on
//! what a run printed and left on disk.

// Each test binary uses its own subset of these.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;

use image::{ImageBuffer, Luma, LumaA, Rgb, Rgba};

/// The binary under test: this package's build, or the one `UPSCALE_BIN` names (an installed
/// or cross-compiled binary, say).
pub fn bin() -> PathBuf {
    std::env::var_os("UPSCALE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_upscale")))
}

/// x2, one group: the fastest real model, used wherever the model itself is not the point.
pub const FAST_MODEL: &str = "x2_w8_b2.safetensors";

/// The repository the fixtures are read from: `UPSCALE_REPO` when set (a test binary carried
/// to another machine with the fixtures beside it), else this package's source folder.
pub fn repo() -> PathBuf {
    std::env::var_os("UPSCALE_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

pub fn golden(name: &str) -> PathBuf {
    repo().join("tests/golden").join(name)
}

/// `upscale` run from `dir` on the CPU with `model` from the golden fixtures; the caller adds
/// inputs and flags.
pub fn upscale_with(dir: &Path, model: &str) -> assert_cmd::Command {
    let mut cmd = assert_cmd::Command::new(bin());
    cmd.current_dir(dir)
        .arg("-m")
        .arg(golden(model))
        .args(["--device", "cpu"]);
    cmd
}

pub fn upscale(dir: &Path) -> assert_cmd::Command {
    upscale_with(dir, FAST_MODEL)
}

/// `upscale` with no flags added, for subcommands and raw usage errors.
pub fn bare(dir: &Path) -> assert_cmd::Command {
    let mut cmd = assert_cmd::Command::new(bin());
    cmd.current_dir(dir);
    cmd
}

/// Colour ramps plus a finer pattern, so the model sees edges and the output is not flat.
pub fn rgb_image(w: u32, h: u32) -> ImageBuffer<Rgb<u8>, Vec<u8>> {
    ImageBuffer::from_fn(w, h, |x, y| {
        Rgb([
            (x * 255 / w.max(2)) as u8,
            (y * 255 / h.max(2)) as u8,
            ((x * 37 + y * 11) % 256) as u8,
        ])
    })
}

pub fn rgb16_image(w: u32, h: u32) -> ImageBuffer<Rgb<u16>, Vec<u16>> {
    ImageBuffer::from_fn(w, h, |x, y| {
        Rgb([
            (x * 65535 / w.max(2)) as u16,
            (y * 65535 / h.max(2)) as u16,
            ((x * 9001 + y * 313) % 65536) as u16,
        ])
    })
}

pub fn gray_image(w: u32, h: u32) -> ImageBuffer<Luma<u8>, Vec<u8>> {
    ImageBuffer::from_fn(w, h, |x, y| Luma([((x * 13 + y * 7) % 256) as u8]))
}

pub fn gray_alpha_image(w: u32, h: u32) -> ImageBuffer<LumaA<u8>, Vec<u8>> {
    ImageBuffer::from_fn(w, h, |x, y| {
        LumaA([
            ((x * 13 + y * 7) % 256) as u8,
            if x < w / 2 { 255 } else { 60 },
        ])
    })
}

/// Opaque on the left half, mostly transparent on the right: a varying alpha goes through the
/// network, unlike a constant one.
pub fn rgba_image(w: u32, h: u32) -> ImageBuffer<Rgba<u8>, Vec<u8>> {
    let rgb = rgb_image(w, h);
    ImageBuffer::from_fn(w, h, |x, y| {
        let Rgb([r, g, b]) = *rgb.get_pixel(x, y);
        Rgba([r, g, b, if x < w / 2 { 255 } else { 40 }])
    })
}

pub fn write_png(path: &Path, w: u32, h: u32) {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p).unwrap();
    }
    rgb_image(w, h).save(path).unwrap();
}

pub fn write_jpeg(path: &Path, w: u32, h: u32) {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p).unwrap();
    }
    rgb_image(w, h).save(path).unwrap();
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `error:` lines of a run's stderr.
pub fn error_lines(out: &Output) -> Vec<String> {
    stderr(out)
        .lines()
        .filter(|l| l.starts_with("error:"))
        .map(str::to_string)
        .collect()
}

pub fn assert_no_panic(out: &Output) {
    let err = stderr(out);
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "the binary panicked:\n{err}"
    );
}

pub fn assert_success(out: &Output) {
    assert_no_panic(out);
    assert!(
        out.status.success(),
        "exit {:?}\nstderr:\n{}",
        out.status.code(),
        stderr(out)
    );
    assert!(error_lines(out).is_empty(), "{}", stderr(out));
}

/// Every JSON line on stdout; fails on a line that is not JSON.
pub fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    stdout(out)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// The summary line of a `--json` run: the last line, marked `"summary": true`.
pub fn summary(lines: &[serde_json::Value]) -> &serde_json::Value {
    let last = lines.last().expect("no JSON output");
    assert_eq!(
        last["summary"], true,
        "last line is not the summary: {last}"
    );
    last
}

/// Every file under `dir` (any depth), relative to it, with `/` separators.
pub fn files_under(dir: &Path) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap();
                found.insert(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    found
}

/// Leftover partial writes: their names carry `upscale-tmp`.
pub fn temporaries_under(dir: &Path) -> Vec<String> {
    files_under(dir)
        .into_iter()
        .filter(|f| f.contains("upscale-tmp"))
        .collect()
}

/// `upscale info --json MODEL` run in `dir`, which must succeed: the JSON it prints.
pub fn info_json(dir: &Path, model: impl AsRef<std::ffi::OsStr>) -> serde_json::Value {
    let run = bare(dir)
        .args(["info", "--json"])
        .arg(model)
        .output()
        .unwrap();
    assert_success(&run);
    serde_json::from_str(stdout(&run).trim()).unwrap()
}

/// `upscale -m MODEL --device cpu INPUT -o OUTPUT` run in `dir`, which must succeed.
pub fn run_on_cpu(dir: &Path, model: impl AsRef<std::ffi::OsStr>, (input, output): (&str, &str)) {
    let run = bare(dir)
        .arg("-m")
        .arg(model)
        .args(["--device", "cpu", input, "-o", output])
        .output()
        .unwrap();
    assert_success(&run);
}
