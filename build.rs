//! With the `cuda` feature, compiles every CUDA source in kernels/ to PTX, assembles that PTX
//! into SASS for the target GPU, packs both into a fatbin, and writes `$OUT_DIR/kernels.rs`: one
//! [`Kernels`] constant per kernel file (`kernels/blend.cu` becomes `BLEND`), for `src/gpu` to
//! load at run time, and the compute capability it targets. The default build needs no CUDA
//! toolkit.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in ["NVCC", "CUDA_HOME", "CUDA_COMPUTE_CAP"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .map(|dir| dir.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    sources.retain(|p| p.extension().is_some_and(|e| e == "cu"));
    sources.sort();

    let nvcc = nvcc();
    // The same target as candle's own kernels: the binary runs where those run.
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let mut consts = String::new();
    for src in &sources {
        let stem = src.file_stem().unwrap().to_string_lossy().into_owned();
        let ptx = out.join(format!("{stem}.ptx"));
        let fatbin = out.join(format!("{stem}.fatbin"));
        run(
            Command::new(&nvcc)
                .args(["--ptx", "-O3", "-std=c++17", "-lineinfo"])
                .arg(format!("-arch=compute_{cap}"))
                .arg("-Ikernels")
                .arg("-o")
                .arg(&ptx)
                .arg(src),
            src,
        );
        // The SASS spares each process the driver's compile of the PTX on first use (seconds
        // for the attention kernels, on every start where the driver's cache is off or new,
        // as in a fresh container). The PTX rides along for GPUs newer than the target.
        run(
            Command::new(&nvcc)
                .args(["--fatbin", "-O3", "-lineinfo"])
                .arg(format!(
                    "-gencode=arch=compute_{cap},code=[sm_{cap},compute_{cap}]"
                ))
                .arg("-o")
                .arg(&fatbin)
                .arg(&ptx),
            src,
        );
        check_fatbin(&fatbin, &cap);
        consts.push_str(&format!(
            "pub const {}: Kernels = Kernels {{\n    \
             file: {:?},\n    \
             ptx: include_str!({:?}),\n    \
             fatbin: include_bytes!({:?}),\n}};\n",
            stem.to_ascii_uppercase(),
            format!("{stem}.cu"),
            ptx.display().to_string(),
            fatbin.display().to_string()
        ));
    }
    consts.push_str(&format!(
        "/// The compute capability the kernels were built for (`CUDA_COMPUTE_CAP`), times ten.\n\
         pub const COMPUTE_CAP: u32 = {};\n",
        cap.parse::<u32>().unwrap_or(0) * 10
    ));
    std::fs::write(out.join("kernels.rs"), consts).expect("writing kernels.rs");
    // For `--version`: "9.0" from "90".
    let (major, minor) = cap.split_at(cap.len().saturating_sub(1));
    println!("cargo::rustc-env=UPSCALE_CUDA_CAP={major}.{minor}");
}

/// Stops the build unless `path` holds SASS for `sm_{cap}` (without it every process compiles
/// the PTX on start) and the PTX (without it a newer GPU cannot run the kernels).
fn check_fatbin(path: &Path, cap: &str) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let entries = fatbin_entries(&data)
        .unwrap_or_else(|| panic!("{}: not a fatbin nvcc would write", path.display()));
    let arch: u32 = cap.parse().unwrap_or(0);
    for (kind, what) in [(2, "SASS"), (1, "PTX")] {
        if !entries.contains(&(kind, arch)) {
            panic!(
                "{}: no {what} for compute capability {cap} in it: {entries:?}",
                path.display()
            );
        }
    }
}

/// A fatbin's entries as (kind, architecture), kind 1 for PTX and 2 for an ELF of SASS: a
/// 16-byte header (magic, version, header size, size of the rest), then entries, each a
/// header (kind, version, header size, payload size, ..., architecture at byte 28) and its
/// payload.
fn fatbin_entries(d: &[u8]) -> Option<Vec<(u16, u32)>> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(d.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(d.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(d.get(o..o + 8)?.try_into().ok()?));
    if u32_at(0)? != 0xBA55_ED50 {
        return None;
    }
    let start = usize::from(u16_at(6)?);
    let end = start.checked_add(usize::try_from(u64_at(8)?).ok()?)?;
    let mut found = Vec::new();
    let mut at = start;
    while at < end.min(d.len()) {
        found.push((u16_at(at)?, u32_at(at + 28)?));
        let step = usize::try_from(u32_at(at + 4)?)
            .ok()?
            .checked_add(usize::try_from(u64_at(at + 8)?).ok()?)?;
        if step == 0 {
            return None;
        }
        at = at.checked_add(step)?;
    }
    Some(found)
}

/// Runs an nvcc step on `src`, and stops the build with its output if it fails.
fn run(cmd: &mut Command, src: &Path) {
    let result = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {:?}: {e}", cmd.get_program()));
    if !result.status.success() {
        panic!(
            "nvcc failed on {}:\n{}{}",
            src.display(),
            String::from_utf8_lossy(&result.stdout),
            String::from_utf8_lossy(&result.stderr)
        );
    }
}

/// `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the PATH.
fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return p.into();
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        let p = Path::new(&home).join("bin/nvcc");
        if p.exists() {
            return p;
        }
    }
    "nvcc".into()
}
