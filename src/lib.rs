//! upscale: DRCT super-resolution.
//!
//! Data flow: `io` decodes a file into a [`planar::Planar`] image, `tile` plans and stitches
//! overlapping tiles, `model` runs the DRCT network on batches of tiles, `io` encodes the
//! result through a temporary file and a rename. `metrics` holds the BasicSR-exact PSNR/SSIM
//! and the MATLAB-style bicubic resize used by `upscale eval`.

pub mod cli;
pub mod engine;
pub mod eval;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod io;
pub mod metrics;
pub mod model;
pub mod planar;
pub mod tile;
