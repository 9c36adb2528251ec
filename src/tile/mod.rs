//! Tiled inference: cut an image into overlapping same-shape tiles, run them through a
//! model in batches, and blend the outputs back together.
//!
//! Only one batch of tiles is alive at a time besides the output accumulator, so memory
//! stays bounded however large the image. When the device runs out of memory the batch is
//! halved, then the tile, and the run carries on.

pub mod auto;
pub mod blend;
pub mod device;
pub mod lanes;
pub mod plan;
pub mod stitch;

#[cfg(test)]
mod lane_tests;
#[cfg(test)]
pub(crate) mod tests;

use candle_core::{DType, Device, Tensor};

pub use blend::BlendMode;
pub use lanes::{run_lanes, LaneStats};
pub use plan::{plan, Plan, PlanError, Tile};
pub use stitch::Accumulator;

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

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TileStats {
    /// Tiles in the plan that produced the output.
    pub tiles: usize,
    /// Forward passes that produced the output.
    pub batches: usize,
    /// Tile shape (rows, columns) and batch size finally used, after any back-off.
    pub tile_shape: (usize, usize),
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
#[derive(Debug, thiserror::Error)]
pub enum TileError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Model(#[from] candle_core::Error),
    #[error("out of memory even with one {h}x{w} tile per batch: {source}")]
    OutOfMemory {
        h: usize,
        w: usize,
        source: candle_core::Error,
    },
    /// The lanes given cannot run together (none, or different models), or one panicked.
    #[error("{0}")]
    Lanes(&'static str),
}

/// Upscales `image` tile by tile. See the module documentation.
pub fn run_tiled<M: TileModel + ?Sized>(
    model: &M,
    image: &Planar,
    opts: &TileOptions,
) -> Result<(Planar, TileStats), TileError> {
    let scale = model.scale();
    if scale == 0 {
        return Err(TileError::Lanes("model scale must be positive"));
    }
    let mut tile = opts.tile;
    let mut batch = opts.batch.max(1);
    let mut oom_retries = 0;
    loop {
        let plan = plan(image.height, image.width, tile, opts.overlap)?;
        let mut acc =
            Accumulator::new(image.channels, image.height, image.width, scale, opts.blend);
        let mut next = 0;
        let mut batches = 0;
        let mut shrunk = false;
        while next < plan.tiles.len() {
            let group = &plan.tiles[next..(next + batch).min(plan.tiles.len())];
            match forward_group(model, image, &plan, group) {
                Ok(out) => {
                    let per_tile = out.len() / group.len();
                    for (t, data) in group.iter().zip(out.chunks(per_tile)) {
                        acc.add(t, data);
                    }
                    next += group.len();
                    batches += 1;
                }
                Err(err) if is_out_of_memory(&err) => {
                    oom_retries += 1;
                    if group.len() > 1 {
                        batch = group.len() / 2;
                    } else {
                        let current = plan.tile_h.max(plan.tile_w);
                        let smaller = (current / 2).max(2 * opts.overlap + MIN_CORE);
                        if smaller >= current {
                            return Err(TileError::OutOfMemory {
                                h: plan.tile_h,
                                w: plan.tile_w,
                                source: err,
                            });
                        }
                        tile = smaller;
                        shrunk = true;
                    }
                    if oom_retries == 1 {
                        log::warn!("out of memory; retrying with smaller batches or tiles");
                    }
                    if shrunk {
                        // Blend weights depend on the tile geometry, so tiles of the old
                        // plan cannot be mixed with the new one: start over.
                        break;
                    }
                }
                Err(err) => return Err(err.into()),
            }
        }
        if shrunk {
            continue;
        }
        let stats = TileStats {
            tiles: plan.tiles.len(),
            batches,
            tile_shape: (plan.tile_h, plan.tile_w),
            batch,
            oom_retries,
        };
        return Ok((acc.finish(), stats));
    }
}

/// Runs one batch of same-shape tiles and returns their outputs back to back, each
/// C x (tile_h*s) x (tile_w*s).
fn forward_group<M: TileModel + ?Sized>(
    model: &M,
    image: &Planar,
    plan: &Plan,
    group: &[Tile],
) -> candle_core::Result<Vec<f32>> {
    let (c, th, tw) = (image.channels, plan.tile_h, plan.tile_w);
    let mut input = Vec::with_capacity(group.len() * c * th * tw);
    for t in group {
        for ch in 0..c {
            let plane = image.plane(ch);
            for y in t.y.start..t.y.end() {
                input.extend_from_slice(&plane[y * image.width + t.x.start..][..tw]);
            }
        }
    }
    let x = Tensor::from_vec(input, (group.len(), c, th, tw), model.device())?;
    let y = model.forward_batch(&x)?;
    let s = model.scale();
    let expected = [group.len(), c, th * s, tw * s];
    if y.dims() != expected {
        candle_core::bail!(
            "model returned shape {:?} for input {:?}, expected {expected:?}",
            y.dims(),
            x.dims()
        );
    }
    y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}
