//! [`Depthwise3x3`]: a channels-last depthwise 3x3 convolution (zero padding 1): DAT's
//! local branch and spatial gate, OmniSR's, FDAT's and SAFMN's. On the CPU in f32 our kernel
//! runs it together with what follows it ([`crate::ops::cpu::depthwise`]); elsewhere candle's
//! ops, tap by tap, which are also its reference.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::ops::cpu::cpu_slice;
use crate::ops::cpu::depthwise::{depthwise3x3, depthwise3x3_of_norm, Rows, Then};
use crate::ops::gelu_erf;
use crate::ops::norm::cpu::with_row_norm;
use crate::ops::norm::Norm;
use crate::ops::Backend;

/// A depthwise 3x3 convolution with a bias, in the form its device runs.
pub struct Depthwise3x3 {
    /// `(9, C)`: tap `dy * 3 + dx`, one weight per channel.
    taps: Tensor,
    bias: Tensor,
    /// The taps and bias for the CPU kernel, where the layer is on the CPU in f32.
    host: Option<(Vec<f32>, Vec<f32>)>,
}

impl Depthwise3x3 {
    /// The convolution of `weight` `(C, 9)` (a row of taps `dy * 3 + dx` per channel) and
    /// `bias` `(C)`, on their device.
    pub fn new(weight: &Tensor, bias: Tensor) -> Result<Self> {
        let taps = weight.t()?.contiguous()?;
        let host = match Backend::of(taps.device()) == Backend::Cpu && taps.dtype() == DType::F32 {
            true => Some((taps.flatten_all()?.to_vec1()?, bias.to_vec1()?)),
            false => None,
        };
        Ok(Self { taps, bias, host })
    }

    /// The `nn.Conv2d(c, c, 3, padding=1, groups=c)` stored under `vb`, with its bias or,
    /// where `bias` is false, a zero one.
    pub fn load(c: usize, bias: bool, vb: VarBuilder) -> Result<Self> {
        let w = vb.get((c, 1, 3, 3), "weight")?.reshape((c, 9))?;
        let b = match bias {
            true => vb.get(c, "bias")?,
            false => Tensor::zeros(c, vb.dtype(), vb.device())?,
        };
        Self::new(&w, b)
    }

    /// The convolution of `x` `(B, H, W, C)`, then the GELU when `gelu`: on the CPU in one
    /// pass, elsewhere candle's operations.
    pub fn forward_gelu_if(&self, x: &Tensor, gelu: bool) -> Result<Tensor> {
        if self.takes(x) {
            let x = x.contiguous()?;
            let dims = x.dims4()?;
            let (guard, layout) = x.storage_and_layout();
            let rows = Rows::new(cpu_slice(&guard, layout)?, dims.3, 0);
            let then = if gelu { Then::Gelu } else { Then::Identity };
            let out = self.on_cpu(rows, dims, then);
            drop(guard);
            if let Some(out) = out {
                return Tensor::from_vec(out, dims, x.device());
            }
        }
        let y = self.forward(x)?;
        if gelu {
            gelu_erf(&y)
        } else {
            Ok(y)
        }
    }

    /// Whether the CPU kernel takes `x` ([`Depthwise3x3::on_cpu`]): the layer and `x` on
    /// the CPU in f32. A network runs its fused CPU path where this says so.
    pub fn takes(&self, x: &Tensor) -> bool {
        self.host.is_some() && Backend::of(x.device()) == Backend::Cpu && x.dtype() == DType::F32
    }

    /// The CPU kernel on `input`'s `(b, h, w, c)` map, with `then` after it; `None` where
    /// the layer is not on the CPU in f32.
    pub fn on_cpu(
        &self,
        input: Rows,
        dims: (usize, usize, usize, usize),
        then: Then,
    ) -> Option<Vec<f32>> {
        let (taps, bias) = self.host.as_ref()?;
        Some(depthwise3x3(input, dims, (taps, bias), then))
    }

    /// [`Self::on_cpu`] of `norm` applied to `input`, without the normalised map
    /// ([`depthwise3x3_of_norm`]); `None` where the layer or the norm is not on the CPU in
    /// f32.
    pub fn on_cpu_of_norm(
        &self,
        norm: &Norm,
        input: Rows,
        dims: (usize, usize, usize, usize),
        then: Then,
    ) -> Result<Option<Vec<f32>>> {
        let Some((taps, bias)) = self.host.as_ref() else {
            return Ok(None);
        };
        with_row_norm(norm, dims.3, |norm| {
            depthwise3x3_of_norm(input, norm, dims, (taps, bias), then)
        })
    }
}

impl Module for Depthwise3x3 {
    /// `x`: `(B, H, W, C)`; candle's ops, each tap's product added in tap order.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, h, w, _) = x.dims4()?;
        let p = x.pad_with_zeros(1, 1, 1)?.pad_with_zeros(2, 1, 1)?;
        let mut acc = self.bias.reshape((1, 1, 1, ()))?.broadcast_as(x.shape())?;
        for dy in 0..3 {
            for dx in 0..3 {
                let tap = self.taps.get(dy * 3 + dx)?;
                let shifted = p.narrow(1, dy, h)?.narrow(2, dx, w)?;
                acc = (acc + shifted.broadcast_mul(&tap)?)?;
            }
        }
        Ok(acc)
    }
}
