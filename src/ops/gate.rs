//! A channel gate (squeeze-and-excitation): each channel of a map scaled by
//! `sigmoid(excite(relu(squeeze(mean of the map))))`, the mean per image and channel over
//! the whole map. Real-CUGAN's SEBlock and RCAN's CALayer are this layer; they differ in
//! what the gated map meets after it (a crop, a residual sum), which [`ChannelGate`]'s
//! forwards fuse with the product on the CPU.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::ops::cpu as kernels;
use crate::ops::cpu::{centre_mean, Centre};
use crate::ops::linear::{pointwise, Dense};

/// The gate's two 1x1 convolutions, `c` to `r` channels and back.
pub(crate) struct ChannelGate {
    squeeze: Dense,
    excite: Dense,
}

impl ChannelGate {
    /// The 1x1 convolutions stored under `squeeze` (`c` to `r`) and `excite` (`r` to `c`).
    pub(crate) fn new(
        (c, r): (usize, usize),
        squeeze: VarBuilder,
        excite: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            squeeze: pointwise(c, r, squeeze)?,
            excite: pointwise(r, c, excite)?,
        })
    }

    /// The gate of `x` `(B, H, W, C)`'s centre less `t` pixels a side, `(B, C)`.
    fn gate(&self, x: &Tensor, t: usize) -> Result<Tensor> {
        let (b, _, _, c) = x.dims4()?;
        // The mean in f64 on the CPU, in f32 elsewhere (a map holds hundreds of thousands of
        // values, too many to sum in bf16 or f16).
        let mean = centre_mean(&x.to_dtype(DType::F32)?, t)?
            .reshape((b, c))?
            .to_dtype(x.dtype())?;
        let hidden = self.squeeze.forward(&mean)?.relu()?;
        candle_nn::ops::sigmoid(&self.excite.forward(&hidden)?)
    }

    /// `x`'s centre less `t` pixels a side, gated by the mean of that centre: the crop and
    /// the product one pass on the CPU.
    pub(crate) fn forward_centre(&self, x: &Tensor, t: usize) -> Result<Tensor> {
        let gate = self.gate(x, t)?;
        if let Some(y) = kernels::centre(x, t, Centre::Scaled(&gate))? {
            return Ok(y);
        }
        let (b, h, w, c) = x.dims4()?;
        x.narrow(1, t, h - 2 * t)?
            .narrow(2, t, w - 2 * t)?
            .broadcast_mul(&gate.reshape((b, 1, 1, c))?)
    }

    /// `residual + x · gate(x)`, `residual` shaped as `x`: the product and the sum one pass
    /// on the CPU.
    pub(crate) fn forward_plus(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let gate = self.gate(x, 0)?;
        if let Some(y) = kernels::centre(x, 0, Centre::ScaledPlus(&gate, residual))? {
            return Ok(y);
        }
        let (b, _, _, c) = x.dims4()?;
        x.broadcast_mul(&gate.reshape((b, 1, 1, c))?)? + residual
    }
}
