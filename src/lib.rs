//! upscale: DRCT, SwinIR and HAT super-resolution.
//!
//! Programs that embed it need [`Upscaler`] and its [`Options`]: open a model once (official
//! `.pth`/`.safetensors` weights or the embedded default), then upscale `image` crate images
//! in memory. Everything else is the command-line tool's own machinery and private to it;
//! [`main`] is the tool itself (feature `cli`, on by default).
//!
//! Data flow: `io` decodes a file into a `planar::Planar` image, `tile` plans and stitches
//! overlapping tiles, `model` runs the DRCT network on batches of tiles, `io` encodes the
//! result through a temporary file and a rename. `metrics` holds the BasicSR-exact PSNR/SSIM
//! and the MATLAB-style bicubic resize used by `upscale eval`.

// Without the command-line tool, the machinery that only it drives (folder runs, eval, bench
// figures) is still compiled, unused.
#![cfg_attr(not(feature = "cli"), allow(dead_code, unused_imports))]

mod api;
#[cfg(feature = "cli")]
mod cli;
mod engine;
mod eval;
#[cfg(feature = "cuda")]
mod gpu;
mod io;
mod metrics;
mod model;
mod pipeline;
mod planar;
mod size;
#[cfg(test)]
mod tests;
mod tile;

pub use api::{cpu_computes_bf16, Error, Options, Upscaler};
#[cfg(feature = "cli")]
pub use cli::main;
pub use engine::{DeviceChoice, EngineError, Precision};
pub use model::fused::Attention;
pub use model::ModelError;
pub use size::OutputSize;
pub use tile::{BlendMode, PlanError, TileError};
