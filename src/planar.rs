//! A host image in planar (CHW) f32 layout, values nominally in [0, 1].
//!
//! This is the one image type shared by io, tiling and metrics, so that no module needs
//! to know another module's representation.

/// An image as `channels` planes of f32 samples, nominally in [0, 1]: what [`crate::io`]
/// decodes to and encodes from, what the model runs on and what [`crate::metrics`] measure.
#[derive(Clone, Debug, PartialEq)]
pub struct Planar {
    /// Planes: 3 for RGB, 1 for alpha or gray.
    pub channels: usize,
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
    /// `channels * height * width` values, channel-major, rows top to bottom.
    pub data: Vec<f32>,
}

impl Planar {
    /// An image of `data`, which must hold `channels * height * width` values (panics
    /// otherwise).
    pub fn new(channels: usize, height: usize, width: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), channels * height * width, "planar buffer size");
        Self {
            channels,
            height,
            width,
            data,
        }
    }

    /// An all-zero image.
    pub fn zeros(channels: usize, height: usize, width: usize) -> Self {
        Self::new(
            channels,
            height,
            width,
            vec![0.0; channels * height * width],
        )
    }

    /// Channel `c`'s samples, row by row.
    pub fn plane(&self, c: usize) -> &[f32] {
        let n = self.height * self.width;
        &self.data[c * n..(c + 1) * n]
    }

    /// Channel `c`'s samples, row by row, to change.
    pub fn plane_mut(&mut self, c: usize) -> &mut [f32] {
        let n = self.height * self.width;
        &mut self.data[c * n..(c + 1) * n]
    }

    /// The sample of channel `c` at row `y`, column `x`.
    pub fn get(&self, c: usize, y: usize, x: usize) -> f32 {
        self.data[(c * self.height + y) * self.width + x]
    }
}

/// The eight symmetries of the square (flips and transposition) that test-time
/// self-ensemble averages over. Symmetry `k` flips columns if bit 0 is set, rows if bit 1 is,
/// then transposes if bit 2 is.
pub const SYMMETRIES: u8 = 8;

impl Planar {
    /// This image under symmetry `k` (see [`SYMMETRIES`]).
    pub(crate) fn transformed(&self, k: u8) -> Planar {
        let (h, w) = (self.height, self.width);
        let transpose = k & 4 != 0;
        let (oh, ow) = if transpose { (w, h) } else { (h, w) };
        let mut out = Planar::zeros(self.channels, oh, ow);
        for c in 0..self.channels {
            let src = self.plane(c);
            let dst = out.plane_mut(c);
            for (i, v) in dst.iter_mut().enumerate() {
                let (oy, ox) = (i / ow, i % ow);
                let (y, x) = if transpose { (ox, oy) } else { (oy, ox) };
                let x = if k & 1 != 0 { w - 1 - x } else { x };
                let y = if k & 2 != 0 { h - 1 - y } else { y };
                *v = src[y * w + x];
            }
        }
        out
    }

    /// The inverse of [`Planar::transformed`]: `img.transformed(k).untransformed(k) == img`.
    pub(crate) fn untransformed(&self, k: u8) -> Planar {
        // Flips are their own inverses and commute with each other; only the order of the
        // transposition and the flips changes: transposing first swaps what the bits flip.
        if k & 4 == 0 {
            self.transformed(k)
        } else {
            let swapped = 4 | ((k & 1) << 1) | ((k & 2) >> 1);
            self.transformed(swapped)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(c: usize, h: usize, w: usize) -> Planar {
        Planar::new(c, h, w, (0..c * h * w).map(|i| i as f32).collect())
    }

    #[test]
    fn every_symmetry_is_undone_by_its_inverse() {
        let img = ramp(2, 3, 5);
        let mut seen = Vec::new();
        for k in 0..SYMMETRIES {
            let t = img.transformed(k);
            assert_eq!(
                (t.height, t.width),
                if k & 4 != 0 { (5, 3) } else { (3, 5) }
            );
            assert_eq!(t.untransformed(k), img, "symmetry {k}");
            seen.push(t.data);
        }
        seen.sort_by(|a, b| a.partial_cmp(b).unwrap());
        seen.dedup();
        assert_eq!(seen.len(), 8, "the eight symmetries are distinct");
    }

    #[test]
    fn symmetries_move_corners_as_named() {
        // 2x3: top-left 0, top-right 2, bottom-left 3.
        let img = ramp(1, 2, 3);
        assert_eq!(img.transformed(1).get(0, 0, 0), 2.0); // columns flipped
        assert_eq!(img.transformed(2).get(0, 0, 0), 3.0); // rows flipped
        let t = img.transformed(4); // transposed: 3x2
        assert_eq!((t.get(0, 0, 1), t.get(0, 1, 0)), (3.0, 1.0));
    }
}
