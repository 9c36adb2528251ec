//! The layer norm, [`Norm`], over the real channels of rows that may carry zero padding.
//!
//! The type and its reference (candle's ops) are here; its CPU half (f32, fused with the token
//! gathers into and out of windows and with the residual add) in [`cpu`], its CUDA half (the
//! same fusions as row-wise kernels) in [`cuda`]. The entry points [`layer_norm`],
//! [`norm_gather`] and [`add_gather_norm`] run the CPU kernels where they apply and hand the
//! rest to the CUDA half, which runs its kernels on CUDA and candle's composition elsewhere.

pub(crate) mod cpu;
pub(crate) mod cuda;
pub mod group;

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{LayerNorm, VarBuilder};

use crate::ops::pad::Channels;
use crate::switches::cuda_off::Off;

pub use cpu::{add_gather_norm, layer_norm, norm_gather};

/// A layer norm over the real channels of rows that may carry zero padding
/// ([`crate::ops::pad`]): the mean and variance count the real channels only, and the
/// weight and bias are zero on the padded ones, so those come out zero again.
pub struct Norm {
    ln: LayerNorm,
    /// For padded rows: 1 on real channels and 0 on padded ones, and the real count.
    real: Option<(Tensor, usize)>,
    /// Our CUDA kernels the gathers with this norm ([`cuda`]) leave out.
    off: Off,
}

impl Norm {
    /// The norm over `channels.real()` channels stored under `vb`, spread to
    /// `channels.padded()`.
    pub fn load(channels: &Channels, eps: f64, vb: VarBuilder) -> Result<Self> {
        let c = channels.real();
        Self::new(channels, vb.get(c, "weight")?, vb.get(c, "bias")?, eps)
    }

    /// The norm with `weight` and `bias` over the real channels of `channels`.
    pub fn new(channels: &Channels, weight: Tensor, bias: Tensor, eps: f64) -> Result<Self> {
        let real = if channels.is_padded() {
            Some((
                channels.mask(weight.dtype(), weight.device())?,
                channels.real(),
            ))
        } else {
            None
        };
        Ok(Self {
            ln: LayerNorm::new(
                channels.spread(&weight, 0)?,
                channels.spread(&bias, 0)?,
                eps,
            ),
            real,
            off: Off::default(),
        })
    }

    /// The same norm, its gathers on CUDA leaving out what `off` (the load plan's
    /// `UPSCALE_CUDA_OFF`) names.
    pub fn with_cuda_off(self, off: Off) -> Self {
        Self { off, ..self }
    }

    /// Our CUDA kernels this norm's gathers leave out.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn cuda_off(&self) -> Off {
        self.off
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn layer_norm(&self) -> &LayerNorm {
        &self.ln
    }

    /// The real-channel mask and count of padded rows; `None` when the rows are not padded.
    pub fn real(&self) -> Option<(&Tensor, usize)> {
        self.real.as_ref().map(|(m, n)| (m, *n))
    }
}

impl Module for Norm {
    /// candle's ops: its layer norm for unpadded rows, else the norm over the real channels
    /// written out (in f32 for narrower dtypes, as candle's own does).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let Some((mask, count)) = &self.real else {
            return self.ln.forward(x);
        };
        let Some(bias) = self.ln.bias() else {
            candle_core::bail!("padded layer norms have a bias");
        };
        let dtype = x.dtype();
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let x = f32_of(x)?;
        let mean = (x.sum_keepdim(D::Minus1)? / *count as f64)?;
        // Padded channels are zero: they add nothing to the sum, and centring them at 0
        // instead of the mean keeps them out of the variance.
        let centred = x.broadcast_sub(&mean.broadcast_mul(&f32_of(mask)?)?)?;
        let var = (centred.sqr()?.sum_keepdim(D::Minus1)? / *count as f64)?;
        let inv = (var + self.ln.eps())?.sqrt()?.recip()?;
        centred
            .broadcast_mul(&inv)?
            .broadcast_mul(&f32_of(self.ln.weight())?)?
            .broadcast_add(&f32_of(bias)?)?
            .to_dtype(dtype)
    }
}
