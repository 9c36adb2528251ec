//! Accumulates weighted tile outputs into the output image. Holds one weighted sum per
//! output value and one weight per output pixel, so memory is bounded by the output image
//! no matter how many tiles pass through.
//!
//! A canvas, on the host or a device ([`super::device::DeviceCanvas`]), is (C + 1) planes of
//! the output size: the weighted sums, then the weights. [`finish_canvases`] adds the canvases
//! of all lanes and normalises them into the image.

use super::blend::{BlendMode, Weights};
use super::plan::Tile;
use crate::planar::Planar;

pub struct Accumulator {
    channels: usize,
    height: usize,
    width: usize,
    scale: usize,
    sum: Vec<f32>,
    weight: Vec<f32>,
    weights: Weights,
}

impl Accumulator {
    /// An accumulator for the `scale`-times upscaled output of a `height`x`width` input.
    pub fn new(
        channels: usize,
        height: usize,
        width: usize,
        scale: usize,
        mode: BlendMode,
    ) -> Self {
        let (h, w) = (height * scale, width * scale);
        Self {
            channels,
            height: h,
            width: w,
            scale,
            sum: vec![0.0; channels * h * w],
            weight: vec![0.0; h * w],
            weights: Weights::new(mode, scale),
        }
    }

    /// Adds one tile's output, `channels` planes of (tile.y.len*scale)x(tile.x.len*scale).
    pub fn add(&mut self, tile: &Tile, data: &[f32]) {
        let wy = self.weights.axis(&tile.y);
        let wx = self.weights.axis(&tile.x);
        let (th, tw) = (wy.len(), wx.len());
        assert_eq!(data.len(), self.channels * th * tw, "tile output size");
        let (oy, ox) = (tile.y.start * self.scale, tile.x.start * self.scale);
        let plane = self.height * self.width;
        let mut row_w = vec![0.0f32; tw];
        for (r, &fy) in wy.iter().enumerate() {
            // Zero weights are skipped, not multiplied, so crop-and-paste copies values
            // bit-exactly and non-finite values in discarded margins cannot leak in.
            if fy == 0.0 {
                continue;
            }
            for (dst, &fx) in row_w.iter_mut().zip(wx.iter()) {
                *dst = fy * fx;
            }
            let out_row = (oy + r) * self.width + ox;
            add_weights(&mut self.weight[out_row..out_row + tw], &row_w);
            for c in 0..self.channels {
                let src = &data[(c * th + r) * tw..][..tw];
                add_weighted(&mut self.sum[c * plane + out_row..][..tw], src, &row_w);
            }
        }
    }

    #[cfg(test)]
    /// Total weight per output pixel, row-major.
    pub fn weight_sum(&self) -> &[f32] {
        &self.weight
    }

    /// Normalises the weighted sums into the output image.
    #[cfg(test)]
    pub fn finish(self) -> Planar {
        let (c, h, w) = (self.channels, self.height, self.width);
        normalize(c, h, w, self.sum, &self.weight)
    }

    /// The weighted sums and the weights as one canvas, for [`finish_canvases`].
    pub fn into_canvas(self) -> Vec<f32> {
        let mut canvas = self.sum;
        canvas.extend_from_slice(&self.weight);
        canvas
    }
}

/// Adds one tile row's blend weights `row_w` to a canvas row's weights. Shared by the
/// whole-image and the banded accumulators, so both compute every output value alike.
pub(super) fn add_weights(dst: &mut [f32], row_w: &[f32]) {
    for (acc, &w) in dst.iter_mut().zip(row_w) {
        *acc += w;
    }
}

/// Adds one tile row's samples `src`, weighted by `row_w`, to a canvas row's sums.
pub(super) fn add_weighted(dst: &mut [f32], src: &[f32], row_w: &[f32]) {
    for ((acc, &v), &w) in dst.iter_mut().zip(src).zip(row_w) {
        if w != 0.0 {
            *acc += w * v;
        }
    }
}

/// Divides the weighted sums by their weights, pixel by pixel (one plane or one row).
pub(super) fn divide(sum: &mut [f32], weight: &[f32]) {
    for (v, &w) in sum.iter_mut().zip(weight) {
        debug_assert!(w > 0.0, "output pixel with no tile weight");
        *v /= w;
    }
}

/// Sums canvases (see the module documentation) and normalises by the weight plane into the
/// output image. The first canvas is taken as is, so one canvas normalises exactly as
/// [`Accumulator::finish`] does.
pub fn finish_canvases(
    channels: usize,
    height: usize,
    width: usize,
    canvases: Vec<Vec<f32>>,
) -> candle_core::Result<Planar> {
    let plane = height * width;
    let len = (channels + 1) * plane;
    let mut canvases = canvases.into_iter();
    let mut sum = canvases.next().unwrap_or_else(|| vec![0.0; len]);
    if sum.len() != len {
        candle_core::bail!("canvas holds {} values, expected {len}", sum.len());
    }
    for other in canvases {
        if other.len() != len {
            candle_core::bail!("canvas holds {} values, expected {len}", other.len());
        }
        for (acc, v) in sum.iter_mut().zip(&other) {
            *acc += v;
        }
    }
    let weight = sum.split_off(channels * plane);
    Ok(normalize(channels, height, width, sum, &weight))
}

/// The weighted sums `sum` (channels planes) divided by the per-pixel `weight`.
fn normalize(
    channels: usize,
    height: usize,
    width: usize,
    mut sum: Vec<f32>,
    weight: &[f32],
) -> Planar {
    for chunk in sum.chunks_mut((height * width).max(1)) {
        divide(chunk, weight);
    }
    Planar::new(channels, height, width, sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tile::plan::plan;

    #[test]
    fn averages_two_overlapping_tiles() {
        let p = plan(1, 6, 4, 2).unwrap();
        assert_eq!(p.tiles.len(), 2);
        let mut acc = Accumulator::new(1, 1, 6, 1, BlendMode::Average);
        acc.add(&p.tiles[0], &[1.0; 4]);
        acc.add(&p.tiles[1], &[3.0; 4]);
        assert_eq!(acc.weight_sum(), &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0]);
        let out = acc.finish();
        assert_eq!(out.data, vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    }

    #[test]
    fn crop_and_paste_takes_one_tile_per_pixel() {
        let p = plan(1, 6, 4, 2).unwrap();
        let mut acc = Accumulator::new(2, 1, 6, 2, BlendMode::None);
        acc.add(&p.tiles[0], &[1.0; 32]);
        // The second tile's first two output columns fall in its discarded margin.
        let second: Vec<f32> = (0..32)
            .map(|i| if i % 8 < 2 { f32::NAN } else { 3.0 })
            .collect();
        acc.add(&p.tiles[1], &second);
        let out = acc.finish();
        assert_eq!((out.height, out.width), (2, 12));
        for row in out.data.chunks(12) {
            assert_eq!(
                row,
                &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
            );
        }
    }
}
