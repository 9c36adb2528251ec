//! upscale: DRCT, SwinIR and HAT super-resolution.
//!
//! Programs that embed it need [`Upscaler`] and its [`Options`]: open a model once (official
//! `.pth`/`.safetensors` weights or the embedded default), then upscale `image` crate images
//! in memory ([`Upscaler::upscale`]) or image files ([`Upscaler::upscale_file`]: metadata
//! kept, the output never half-written). Warnings go through the `log` crate. Everything else
//! is the command-line tool's own machinery, private to it and compiled only with the `cli`
//! feature (on by default); [`main`] is the tool itself.
//!
//! Data flow: `io` decodes a file into a `planar::Planar` image, `tile` plans and stitches
//! overlapping tiles, `model` runs the DRCT network on batches of tiles, `io` encodes the
//! result through a temporary file and a rename. `metrics` holds the BasicSR-exact PSNR/SSIM
//! and the MATLAB-style bicubic resize used by `upscale eval`.

#![warn(missing_docs)]

mod api;
#[cfg(feature = "cli")]
mod cli;
mod engine;
#[cfg(feature = "cli")]
mod eval;
#[cfg(feature = "cuda")]
mod gpu;
mod io;
#[cfg(feature = "cli")]
mod metrics;
mod model;
#[cfg(feature = "cli")]
mod pipeline;
mod planar;
mod size;
#[cfg(test)]
mod tests;
mod tile;

pub use api::{cpu_computes_bf16, Error, Options, Upscaler};
#[cfg(feature = "cli")]
pub use cli::main;
pub use engine::{DeviceChoice, DeviceError, EngineError, Precision};
pub use io::{Format, IoError, OutputError};
pub use model::Attention;
pub use model::{
    BuildError, ConfigError, EnvError, ModelError, PthError, PthTensorError, TensorError,
};
pub use size::OutputSize;
pub use tile::{BlendMode, PlanError, TileError};
