//! Tests of the machinery behind the public API on real models and the committed fixtures:
//! parity with the float64 reference, lanes, crafted checkpoints and, with `--features
//! cuda`, the GPU kernels and device paths. The command line is tested from tests/.

use std::path::PathBuf;

use candle_core::{Device, Result, Shape, Tensor};

mod checkpoint_mutations;
mod compact;
mod dat;
mod esrgan;
mod fdat;
pub(crate) mod fixtures;
mod golden;
#[cfg(feature = "cuda")]
mod gpu;
mod grey;
mod hat;
mod lanes;
mod layout;
mod mosr;
mod omnisr;
mod other_architectures;
mod plksr;
mod pth;
mod rcan;
mod realcugan;
mod safmn;
mod span;
mod swin2sr;
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

thread_local! {
    /// Draws so far on this thread: each test runs on a thread of its own, so its values
    /// are the same on every run (a rare draw failing a bound now fails it every time).
    static DRAWS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Values of mean `mean` and spread `std` for the unit tests (in place of candle's unseeded
/// `Tensor::randn`) (the sum of four uniforms, centred and scaled
/// to unit variance), from a generator seeded by the test's count of draws.
/// The median of timings (the upper one of an even count), for the in-process benches.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn normal(mean: f32, std: f32, shape: impl Into<Shape>, dev: &Device) -> Result<Tensor> {
    let shape = shape.into();
    let draw = DRAWS.with(|d| {
        d.set(d.get() + 1);
        d.get()
    });
    let mut state = draw.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut uniform = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let values: Vec<f32> = (0..shape.elem_count())
        .map(|_| {
            let sum: f32 = (0..4).map(|_| uniform()).sum();
            mean + std * (sum - 2.0) * 3f32.sqrt()
        })
        .collect();
    Tensor::from_vec(values, shape, dev)
}
