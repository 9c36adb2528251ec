//! Tests of the machinery behind the public API on real models and the committed fixtures:
//! parity with the float64 reference, lanes, crafted checkpoints and, with `--features
//! cuda`, the GPU kernels and device paths. The command line is tested from tests/.

use std::path::PathBuf;

mod checkpoint_mutations;
mod compact;
mod dat;
mod esrgan;
pub(crate) mod fixtures;
mod golden;
#[cfg(feature = "cuda")]
mod gpu;
mod hat;
mod lanes;
mod layout;
mod other_architectures;
mod pth;
mod span;
mod swinir;
mod tile_blend;
mod winograd;

/// x2, one group: the fastest real model, used wherever the model itself is not the point.
const FAST_MODEL: &str = "x2_w8_b2.safetensors";

/// The repository the fixtures are read from: `UPSCALE_REPO` when set (a test binary carried
/// to another machine with the fixtures beside it), else this package's source folder.
fn repo() -> PathBuf {
    std::env::var_os("UPSCALE_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn golden(name: &str) -> PathBuf {
    repo().join("tests/golden").join(name)
}
