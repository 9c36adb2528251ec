//! Tiled inference: cut an image into overlapping same-shape tiles, run them through a
//! model in batches, and blend the outputs back together.
//!
//! Only one batch of tiles is alive at a time besides the output accumulator, so memory
//! stays bounded however large the image. When the device runs out of memory the batch is
//! halved, then the tile, and the run carries on.

pub mod auto;
pub mod band;
pub mod blend;
pub mod device;
pub mod lanes;
pub mod plan;
pub mod stitch;

#[cfg(test)]
mod lane_tests;
#[cfg(test)]
pub(crate) mod tests;

use candle_core::{Device, Tensor};

pub use blend::BlendMode;
#[cfg(test)]
pub use lanes::run_lanes;
pub use lanes::{Canvas, LaneStats};
pub use plan::PlanError;
#[cfg(test)]
pub use plan::{plan, Plan};
#[cfg(test)]
pub use stitch::Accumulator;

#[cfg(test)]
use crate::planar::Planar;

/// A super-resolution model as the tiler sees it.
pub trait TileModel {
    fn scale(&self) -> usize;
    /// x: (B, C, h, w) f32 on the model's device, values in \[0, 1\]; returns (B, C, h*s, w*s).
    /// The model pads to its window multiple itself, so any tile size is valid input.
    fn forward_batch(&self, x: &Tensor) -> candle_core::Result<Tensor>;
    fn device(&self) -> &Device;
}

#[derive(Clone, Debug, PartialEq)]
pub struct TileOptions {
    /// Tile side in input pixels; 0 runs the whole image as one tile.
    pub tile: usize,
    /// Input pixels shared by neighbouring tiles.
    pub overlap: usize,
    /// Tiles per forward pass.
    pub batch: usize,
    pub blend: BlendMode,
}

impl Default for TileOptions {
    fn default() -> Self {
        Self {
            tile: 0,
            overlap: 32,
            batch: 1,
            blend: BlendMode::default(),
        }
    }
}

/// How an image was tiled.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TileStats {
    /// Tiles in the plan that produced the output.
    pub tiles: usize,
    /// Forward passes that produced the output.
    pub batches: usize,
    /// Tile shape (rows, columns) and batch size finally used, after any back-off.
    pub tile_shape: (usize, usize),
    /// Tiles per forward pass finally used.
    pub batch: usize,
    /// Forward passes that ran out of memory and were retried smaller.
    pub oom_retries: usize,
}

/// Smallest part of a tile that no neighbour overlaps when the back-off shrinks tiles.
const MIN_CORE: usize = 8;

/// Whether a model error is the device running out of memory, which a smaller batch or
/// tile may avoid. candle reports CUDA's failure only as text.
pub fn is_out_of_memory(err: &candle_core::Error) -> bool {
    let msg = err.to_string().to_ascii_lowercase();
    msg.contains("out of memory") || msg.contains("out_of_memory")
}

/// Why an image could not be upscaled.
/// Why an image could not be upscaled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TileError {
    /// The image cannot be cut into tiles as asked.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The network failed (other than by running out of memory).
    #[error(transparent)]
    Model(#[from] candle_core::Error),
    /// Out of memory even after halving the batch and the tile down to their floors.
    #[error("out of memory even with one {h}x{w} tile per batch: {source}")]
    OutOfMemory {
        /// The last tile's height in input pixels.
        h: usize,
        /// The last tile's width in input pixels.
        w: usize,
        /// The device's out-of-memory error.
        source: candle_core::Error,
    },
    /// The lanes given cannot run together (none, or different models), or one panicked.
    #[error("{0}")]
    Lanes(&'static str),
}

impl From<TileError> for crate::Error {
    fn from(e: TileError) -> Self {
        let kind = match &e {
            TileError::Plan(_) => crate::ErrorKind::InvalidOption,
            TileError::OutOfMemory { .. } => crate::ErrorKind::OutOfMemory,
            _ => crate::ErrorKind::Run,
        };
        crate::Error::new(kind, e)
    }
}

/// Upscales `image` tile by tile on one model, blending on the host: the scheduler of
/// [`run_lanes`] with one lane, as the tests call it.
#[cfg(test)]
pub fn run_tiled<M: TileModel + Sync>(
    model: &M,
    image: &Planar,
    opts: &TileOptions,
) -> Result<(Planar, TileStats), TileError> {
    let (out, stats, _) = run_lanes(std::slice::from_ref(model), image, opts, Canvas::Host)?;
    Ok((out, stats))
}
