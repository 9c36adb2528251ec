//! Tests that need an NVIDIA GPU. They are compiled with `--features cuda` (CI builds them)
//! and run on a GPU machine: scripts/gpu-pack.sh carries this one binary there, and
//! scripts/gpu-run.sh runs it with `UPSCALE_REPO` pointing at the fixtures. Without a GPU every
//! test fails with a message saying so; none passes by skipping.
#![cfg(feature = "cuda")]

#[path = "../common/mod.rs"]
mod common;

mod kernels;
mod lanes;
mod parity;

use candle_core::Device;

/// The GPU the tests run on.
pub fn gpu() -> Device {
    Device::new_cuda(0).expect("an NVIDIA GPU: these tests run on a GPU machine")
}
