//! upscale: DRCT, SwinIR, Swin2SR, HAT, DAT, ESRGAN, Real-ESRGAN Compact, SPAN, PLKSR, RealPLKSR, OmniSR, Real-CUGAN, RCAN, MoSR, FDAT and SAFMN super-resolution, and SwinIR denoising and JPEG restoration.
//!
//! Programs that embed it need [`Upscaler`] and its [`Options`]: open a model once (official
//! `.pth`/`.safetensors` weights or the embedded default), then upscale `image` crate images
//! in memory ([`Upscaler::upscale`]) or image files ([`Upscaler::upscale_file`]: metadata
//! kept, the output never half-written). Warnings go through the `log` crate.
//!
//! Around it, what a program that runs many images needs, and what the `upscale`
//! command-line tool is built on (the tool is the binary crate in `src/main.rs` and
//! `src/cli/`, compiled with the `cli` feature; it reaches this library only through the
//! items below):
//!
//! * [`io`]: image files to planar [`Planar`] images and back, with their ICC profile and
//!   EXIF, and writes that never leave a partial file;
//! * [`Upscaler::upscale_image`] and [`Upscaler::upscale_deferred`]: one decoded image
//!   through the model, with its tiling and per-lane statistics, the latter leaving the
//!   last step to another thread;
//! * [`metrics`]: BasicSR-exact PSNR/SSIM and the MATLAB-style bicubic resize, for quality
//!   gates;
//! * [`ModelFile`]: what a weight file holds (architecture and configuration), and its
//!   conversion to `.safetensors`;
//! * [`Upscaler::bench`]: latency, throughput and memory of one configuration.
//!
//! Data flow: `io` decodes a file into a [`Planar`] image, `tile` plans and stitches
//! overlapping tiles, `nets` runs the network (its operations in `ops`) on batches of tiles, `io` encodes the result
//! through a temporary file and a rename.

#![warn(missing_docs)]

mod api;
mod bench;
mod checkpoint;
mod engine;
mod error;
mod fit;
#[cfg(feature = "cuda")]
mod gpu;
mod inspect;
pub mod io;
pub mod metrics;
mod model;
mod nets;
mod ops;
mod planar;
mod size;
mod switches;
#[cfg(test)]
mod tests;
mod tile;

pub use api::{cpu_computes_bf16, Banded, Options, Pending, Upscaler};
pub use bench::{BenchReport, DevicePool, TileCost};
pub use engine::image::Upscaled;
pub use engine::{DeviceChoice, Precision};
pub use error::{Error, ErrorKind};
pub use fit::Writing;
pub use inspect::ModelFile;
pub use io::Format;
pub use ops::attention::Attention;
pub use planar::Planar;
pub use size::OutputSize;
pub use tile::{BlendMode, LaneStats, TileStats};
