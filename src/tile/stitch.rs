//! Accumulates weighted tile outputs into the output image. Holds one weighted sum per
//! output value and one weight per output pixel, so memory is bounded by the output image
//! no matter how many tiles pass through.

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
            for (acc, &w) in self.weight[out_row..out_row + tw].iter_mut().zip(&row_w) {
                *acc += w;
            }
            for c in 0..self.channels {
                let src = &data[(c * th + r) * tw..][..tw];
                let dst = &mut self.sum[c * plane + out_row..][..tw];
                for ((acc, &v), &w) in dst.iter_mut().zip(src).zip(&row_w) {
                    if w != 0.0 {
                        *acc += w * v;
                    }
                }
            }
        }
    }

    #[cfg(test)]
    /// Total weight per output pixel, row-major.
    pub fn weight_sum(&self) -> &[f32] {
        &self.weight
    }

    /// Normalises the weighted sums into the output image.
    pub fn finish(self) -> Planar {
        let plane = self.height * self.width;
        let mut data = self.sum;
        for chunk in data.chunks_mut(plane.max(1)) {
            for (v, &w) in chunk.iter_mut().zip(&self.weight) {
                debug_assert!(w > 0.0, "output pixel with no tile weight");
                *v /= w;
            }
        }
        Planar::new(self.channels, self.height, self.width, data)
    }
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
