//! A host image in planar (CHW) f32 layout, values nominally in [0, 1].
//!
//! This is the one image type shared by io, tiling and metrics, so that no module needs
//! to know another module's representation.

#[derive(Clone, Debug, PartialEq)]
pub struct Planar {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    /// `channels * height * width` values, channel-major, rows top to bottom.
    pub data: Vec<f32>,
}

impl Planar {
    pub fn new(channels: usize, height: usize, width: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), channels * height * width, "planar buffer size");
        Self {
            channels,
            height,
            width,
            data,
        }
    }

    pub fn zeros(channels: usize, height: usize, width: usize) -> Self {
        Self::new(
            channels,
            height,
            width,
            vec![0.0; channels * height * width],
        )
    }

    pub fn plane(&self, c: usize) -> &[f32] {
        let n = self.height * self.width;
        &self.data[c * n..(c + 1) * n]
    }

    pub fn plane_mut(&mut self, c: usize) -> &mut [f32] {
        let n = self.height * self.width;
        &mut self.data[c * n..(c + 1) * n]
    }

    pub fn get(&self, c: usize, y: usize, x: usize) -> f32 {
        self.data[(c * self.height + y) * self.width + x]
    }
}
