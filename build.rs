//! With the `cuda` feature, compiles every CUDA source in kernels/ to PTX and writes
//! `$OUT_DIR/ptx.rs`, one `&str` constant per kernel file (`kernels/blend.cu` becomes
//! `BLEND`), for `src/gpu` to load at run time, and the compute capability it targets. The
//! default build needs no CUDA toolkit.

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
        let result = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "-lineinfo"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-Ikernels")
            .arg("-o")
            .arg(&ptx)
            .arg(src)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
        if !result.status.success() {
            panic!(
                "nvcc failed on {}:\n{}{}",
                src.display(),
                String::from_utf8_lossy(&result.stdout),
                String::from_utf8_lossy(&result.stderr)
            );
        }
        consts.push_str(&format!(
            "pub const {}: &str = include_str!({:?});\n",
            stem.to_ascii_uppercase(),
            ptx.display().to_string()
        ));
    }
    consts.push_str(&format!(
        "/// The compute capability the PTX was built for (`CUDA_COMPUTE_CAP`), times ten.\n\
         pub const COMPUTE_CAP: u32 = {};\n",
        cap.parse::<u32>().unwrap_or(0) * 10
    ));
    std::fs::write(out.join("ptx.rs"), consts).expect("writing ptx.rs");
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
