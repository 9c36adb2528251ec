//! upscale: DRCT super-resolution.
//!
//! Programs that embed it need [`Upscaler`] and its [`Options`]: open a model once (official
//! `.pth`/`.safetensors` weights or the embedded default), then upscale `image` crate images
//! in memory. The modules below are the command-line tool's own building blocks.
//!
//! Data flow: `io` decodes a file into a [`planar::Planar`] image, `tile` plans and stitches
//! overlapping tiles, `model` runs the DRCT network on batches of tiles, `io` encodes the
//! result through a temporary file and a rename. `metrics` holds the BasicSR-exact PSNR/SSIM
//! and the MATLAB-style bicubic resize used by `upscale eval`.

mod api;
pub mod cli;
pub mod engine;
pub mod eval;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod io;
pub mod metrics;
pub mod model;
pub mod pipeline;
pub mod planar;
pub mod size;
pub mod tile;

pub use api::{Error, Options, Upscaler};
pub use engine::{DeviceChoice, Precision};
pub use model::fused::Attention;
pub use size::OutputSize;
pub use tile::BlendMode;
