//! Tiling that hands the output on in bands of rows, for images whose output canvas would not
//! fit in memory. Tiles run in the plan's raster order on one lane, blending on the host into
//! a window of output rows; once no tile still to come touches a row, the rows above it are
//! final: they are normalised and handed to the caller, and their memory is freed. The window
//! holds about one tile row of output, so memory is bounded by the model, the batch and that
//! band, not by the image.
//!
//! The blending is [`super::stitch`]'s arithmetic in the same order (tiles in plan order, the
//! batch halving as the one-lane scheduler does), so the bands put together are the image
//! the one-lane host scheduler (`run_lanes` with one lane) returns, bit for bit.

use std::collections::VecDeque;

use super::blend::{BlendMode, Weights};
use super::lanes::{cut_on_host, forward_checked};
use super::plan::{plan, Tile};
use super::stitch::{add_weighted, add_weights, divide};
use super::{is_out_of_memory, TileError, TileModel, TileOptions, TileStats};
use crate::planar::Planar;

/// The rows of the output canvas not yet handed on: weighted sums per channel and the
/// weights, one entry per row.
struct Window {
    channels: usize,
    width: usize,
    scale: usize,
    /// The output row of the first entry.
    top: usize,
    /// Per row: `channels` runs of `width` sums, then `width` weights.
    rows: VecDeque<Vec<f32>>,
    weights: Weights,
}

impl Window {
    fn new(channels: usize, width: usize, scale: usize, mode: BlendMode) -> Self {
        Self {
            channels,
            width,
            scale,
            top: 0,
            rows: VecDeque::new(),
            weights: Weights::new(mode, scale),
        }
    }

    /// Adds one tile's output, as [`super::stitch::Accumulator::add`] does.
    fn add(&mut self, tile: &Tile, data: &[f32]) {
        let wy = self.weights.axis(&tile.y);
        let wx = self.weights.axis(&tile.x);
        let (th, tw) = (wy.len(), wx.len());
        assert_eq!(data.len(), self.channels * th * tw, "tile output size");
        let (oy, ox) = (tile.y.start * self.scale, tile.x.start * self.scale);
        assert!(oy >= self.top, "a tile touches rows already handed on");
        let (c, w) = (self.channels, self.width);
        while self.top + self.rows.len() < oy + th {
            self.rows.push_back(vec![0.0; (c + 1) * w]);
        }
        let mut row_w = vec![0.0f32; tw];
        for (r, &fy) in wy.iter().enumerate() {
            if fy == 0.0 {
                continue;
            }
            for (dst, &fx) in row_w.iter_mut().zip(wx.iter()) {
                *dst = fy * fx;
            }
            let row = &mut self.rows[oy + r - self.top];
            add_weights(&mut row[c * w + ox..][..tw], &row_w);
            for ch in 0..c {
                let src = &data[(ch * th + r) * tw..][..tw];
                add_weighted(&mut row[ch * w + ox..][..tw], src, &row_w);
            }
        }
    }

    /// Rows from the top up to output row `end`, normalised, as `channels` planes; they
    /// leave the window.
    fn take_until(&mut self, end: usize) -> Planar {
        let (c, w) = (self.channels, self.width);
        let n = end.saturating_sub(self.top).min(self.rows.len());
        let mut data = vec![0.0f32; c * n * w];
        for (r, mut row) in self.rows.drain(..n).enumerate() {
            let (sums, weight) = row.split_at_mut(c * w);
            for ch in 0..c {
                let sum = &mut sums[ch * w..][..w];
                divide(sum, weight);
                data[(ch * n + r) * w..][..w].copy_from_slice(sum);
            }
        }
        self.top += n;
        Planar::new(c, n, w, data)
    }
}

/// Upscales `image` on `model`, handing the output to `emit` in bands of rows, top to bottom
/// (each band `channels` planes of its rows at the full output width); see the module
/// documentation. Out of memory halves the batch and retries it, as nothing of a failed
/// batch reaches the canvas; a single tile that does not fit is an error, since rows already
/// handed on cannot be redone with smaller tiles.
pub fn run_banded<M, E>(
    model: &M,
    image: &Planar,
    opts: &TileOptions,
    mut emit: impl FnMut(Planar) -> Result<(), E>,
) -> Result<TileStats, E>
where
    M: TileModel,
    E: From<TileError>,
{
    let scale = model.scale();
    if scale == 0 {
        return Err(TileError::Lanes("model scale must be positive").into());
    }
    let plan = plan(image.height, image.width, opts.tile, opts.overlap).map_err(TileError::from)?;
    let out_h = image.height * scale;
    let mut window = Window::new(image.channels, image.width * scale, scale, opts.blend);
    let mut batch = opts.batch.max(1);
    let (mut next, mut batches, mut oom_retries) = (0, 0, 0);
    while next < plan.tiles.len() {
        let range = next..(next + batch).min(plan.tiles.len());
        let group = &plan.tiles[range.clone()];
        let x = cut_on_host(image, &plan, group, model.device()).map_err(TileError::from)?;
        let y = match forward_checked(model, &x, &plan) {
            Ok(y) => y,
            Err(err) if is_out_of_memory(&err) && group.len() > 1 => {
                if oom_retries == 0 {
                    log::warn!("out of memory; retrying with smaller batches");
                }
                oom_retries += 1;
                batch = group.len() / 2;
                continue;
            }
            Err(err) if is_out_of_memory(&err) => {
                return Err(TileError::OutOfMemory {
                    h: plan.tile_h,
                    w: plan.tile_w,
                    source: err,
                }
                .into())
            }
            Err(err) => return Err(TileError::Model(err).into()),
        };
        let out = y
            .flatten_all()
            .and_then(|y| y.to_vec1::<f32>())
            .map_err(TileError::from)?;
        for (t, data) in group.iter().zip(out.chunks(out.len() / group.len())) {
            window.add(t, data);
        }
        batches += 1;
        next = range.end;
        // Tiles are in raster order, so no tile still to come reaches above the next one's
        // first row.
        let done = match plan.tiles.get(next) {
            Some(t) => t.y.start * scale,
            None => out_h,
        };
        if done > window.top {
            emit(window.take_until(done))?;
        }
    }
    Ok(TileStats {
        tiles: plan.tiles.len(),
        batches,
        tile_shape: (plan.tile_h, plan.tile_w),
        batch,
        oom_retries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tile::run_tiled;
    use crate::tile::tests::Pointwise;

    /// A stand-in whose output depends on each tile's position, so a tile blended in the
    /// wrong place or order changes the result.
    struct Ramp(Pointwise);

    impl TileModel for Ramp {
        fn scale(&self) -> usize {
            self.0.scale()
        }
        fn forward_batch(
            &self,
            x: &candle_core::Tensor,
        ) -> candle_core::Result<candle_core::Tensor> {
            let y = self.0.forward_batch(x)?;
            let (b, c, h, w) = y.dims4()?;
            let ramp: Vec<f32> = (0..b * c * h * w)
                .map(|i| ((i % w) as f32 * 0.013 + (i / w % h) as f32 * 0.007).sin() * 0.1)
                .collect();
            let ramp = candle_core::Tensor::from_vec(ramp, (b, c, h, w), y.device())?;
            y + ramp
        }
        fn device(&self) -> &candle_core::Device {
            self.0.device()
        }
    }

    fn image(c: usize, h: usize, w: usize) -> Planar {
        let data = (0..c * h * w)
            .map(|i| ((i * 7919) % 1000) as f32 / 999.0)
            .collect();
        Planar::new(c, h, w, data)
    }

    /// The bands put together, and how many there were.
    fn banded(model: &Ramp, img: &Planar, opts: &TileOptions) -> (Planar, usize) {
        let mut data = vec![Vec::new(); img.channels];
        let (mut rows, mut bands) = (0, 0);
        run_banded::<_, TileError>(model, img, opts, |band| {
            assert_eq!(band.width, img.width * model.scale());
            for (c, d) in data.iter_mut().enumerate() {
                d.extend_from_slice(band.plane(c));
            }
            rows += band.height;
            bands += 1;
            Ok(())
        })
        .unwrap();
        let w = img.width * model.scale();
        (Planar::new(img.channels, rows, w, data.concat()), bands)
    }

    #[test]
    fn bands_put_together_are_the_whole_image_bit_for_bit() {
        let cases = [
            // (channels, height, width, scale, tile, overlap, batch, blend)
            (3, 37, 53, 2, 16, 4, 1, BlendMode::Hann),
            (3, 37, 53, 2, 16, 4, 3, BlendMode::Hann),
            (3, 61, 29, 3, 12, 5, 2, BlendMode::Average),
            (1, 45, 45, 4, 16, 6, 5, BlendMode::None),
            (3, 9, 70, 2, 16, 4, 4, BlendMode::Hann),
            (3, 33, 21, 1, 0, 4, 1, BlendMode::Hann),
        ];
        for (c, h, w, s, tile, overlap, batch, blend) in cases {
            let model = Ramp(Pointwise::new(s));
            let img = image(c, h, w);
            let opts = TileOptions {
                tile,
                overlap,
                batch,
                blend,
            };
            let (whole, stats) = run_tiled(&model, &img, &opts).unwrap();
            let (bands, count) = banded(&model, &img, &opts);
            assert_eq!((bands.height, bands.width), (whole.height, whole.width));
            let same = bands
                .data
                .iter()
                .zip(&whole.data)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{c}x{h}x{w} x{s} tile {tile}/{overlap} batch {batch}");
            let tile_rows = if tile == 0 {
                1
            } else {
                h.div_ceil(tile - overlap)
            };
            assert!(count > 1 || tile_rows == 1, "one band for {h} rows");
            assert!(stats.tiles > 1 || tile == 0);
        }
    }

    #[test]
    fn bands_are_about_one_tile_row_high() {
        let model = Ramp(Pointwise::new(2));
        let img = image(3, 100, 40);
        let opts = TileOptions {
            tile: 16,
            overlap: 4,
            batch: 2,
            blend: BlendMode::Hann,
        };
        let mut largest = 0;
        run_banded::<_, TileError>(&model, &img, &opts, |band| {
            largest = largest.max(band.height);
            Ok(())
        })
        .unwrap();
        // Output rows of one tile row's stride (12 input rows at x2), never the image.
        assert!(largest <= 16 * 2, "a band of {largest} rows");
    }

    #[test]
    fn an_error_from_the_caller_stops_the_run() {
        let model = Ramp(Pointwise::new(2));
        let img = image(3, 40, 40);
        let opts = TileOptions {
            tile: 16,
            overlap: 4,
            batch: 1,
            blend: BlendMode::Hann,
        };
        let mut calls = 0;
        let r = run_banded(&model, &img, &opts, |_| {
            calls += 1;
            Err(TileError::Lanes("disk full"))
        });
        assert!(matches!(r, Err(TileError::Lanes("disk full"))));
        assert_eq!(calls, 1);
    }
}
