//! Tests that need an NVIDIA GPU, all named `tests::gpu::...`. They are compiled with
//! `--features cuda` (CI builds them) into the library's test binary, which
//! scripts/gpu-pack.sh carries to a GPU machine, and scripts/gpu-run.sh runs them there with
//! `UPSCALE_REPO` pointing at the fixtures. Without a GPU every test fails with a message
//! saying so; none passes by skipping.

mod epilogue;
mod families;
mod kernels;
mod lanes;
mod overlap;
mod parity;
mod rowwise;

use candle_core::Device;

use crate::tests::fixtures::max_abs;

/// The GPU the tests run on. With `UPSCALE_CUDA_OFF` set, the kernel tests would hold
/// candle's fallbacks to themselves and pass whatever our kernels do, so it must be unset.
fn gpu() -> Device {
    assert!(
        std::env::var_os(crate::switches::cuda_off::VAR).is_none(),
        "unset {}: the GPU tests check our kernels",
        crate::switches::cuda_off::VAR
    );
    Device::new_cuda(0).expect("an NVIDIA GPU: these tests run on a GPU machine")
}

/// `d <= bound`, false for NaN.
fn within(d: f64, bound: f64) -> bool {
    d <= bound
}

/// The root-mean-square difference of two same-shape tensors, on any devices.
fn rms_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f64 {
    let f = |t: &candle_core::Tensor| {
        t.to_device(&Device::Cpu)
            .and_then(|t| t.to_dtype(candle_core::DType::F64))
            .unwrap()
    };
    (f(a) - f(b))
        .and_then(|d| d.sqr())
        .and_then(|d| d.mean_all())
        .and_then(|m| m.to_scalar::<f64>())
        .unwrap()
        .sqrt()
}
