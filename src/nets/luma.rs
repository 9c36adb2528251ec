//! Greyscale models (one image channel in and out: SwinIR's denoising and JPEG models, ESRGAN,
//! Compact, RCAN, SPAN, MoSR) in the RGB pipeline: the network runs on the image's luma, and its
//! output fills all three channels, which the writer then stores as a grey image where the
//! source was one. A grey source's three channels are equal, so its luma is the grey value
//! itself; a colour source is read as BT.601 luma (0.299 R + 0.587 G + 0.114 B), what OpenCV's
//! conversion to grey and the tools built on it give such a model.

use candle_core::{DType, Module, Result, Tensor};

use crate::nets::Net;

/// BT.601's weights of R, G and B in luma.
const LUMA: [f64; 3] = [0.299, 0.587, 0.114];

/// A one-channel network, fed and read as an RGB one.
pub(crate) struct Luma(pub Box<dyn Net>);

/// The luma `(B, 1, H, W)` of `x` `(B, 3, H, W)`.
pub(crate) fn luma(x: &Tensor) -> Result<Tensor> {
    let channel = |c: usize| x.narrow(1, c, 1)?.affine(LUMA[c], 0.0);
    (channel(0)? + channel(1)?)? + channel(2)?
}

impl Module for Luma {
    /// `x`: `(B, 3, H, W)`; returns `(B, 3, sH, sW)`, the three channels equal.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.0.forward(&luma(x)?)?;
        let (b, _, h, w) = y.dims4()?;
        y.broadcast_as((b, 3, h, w))?.contiguous()
    }
}

impl Net for Luma {
    fn dtype(&self) -> DType {
        self.0.dtype()
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        self.0.cached_masks()
    }
}
