//! The operations the Swin-family networks are built from, one type each. A layer is built
//! from the weights where they will run and the network's [`LoadPlan`], and picks its
//! implementation and prepares its weights then (bf16 panels on the CPU): the network code
//! above only says what to compute, never where, and nothing changes a layer after it is built.
//!
//! | operation | type | CPU, f32 | CPU, bf16 products | CUDA | reference |
//! |---|---|---|---|---|---|
//! | linear (and 1x1 convolution) | [`linear::Dense`] | `linear::cpu::linear` | `linear::cpu::linear_bf16` | `linear::cuda` (cuBLASLt) and `linear::rowwise` (its epilogues) | candle's `Linear` |
//! | 3x3 convolution | [`conv::Conv3x3`] | `conv::cpu::conv3x3` | `conv::cpu::conv3x3_bf16` | `conv::cuda::patches3x3` + GEMM, `conv::cuda::conv3x3_narrow` | the same patch GEMM |
//! | window attention | [`attention::Attend`] | `attention::cpu::window_attention` | the same, bf16 products | `attention::cuda` (kernels/window_attention.cu) | candle's graph |
//! | overlapping cross-attention (HAT) | [`attention::OverlapAttend`] | `attention::cpu::overlap_attention` | the same, bf16 products | `attention::cuda` (kernels/window_attention.cu) | candle's graph |
//! | channel gate (squeeze-and-excitation) | `gate::ChannelGate` | the mean in `cpu::centre_mean`, the product in `cpu::centre` | (f32) | candle's ops | candle's ops |
//! | layer norm | [`norm::Norm`] | `norm::cpu` | (f32) | `norm::cuda` | candle's `layer_norm` |
//! | a whole Swin block, a window at a time | `block::swin_block_by_windows` | `attention::cpu::swin_block` | (its steps) | (its steps) | its steps in turn |
//!
//! Each operation's folder holds its type and reference (`mod.rs`), its CPU half (`cpu.rs`)
//! and, where it has kernels of its own, its CUDA half (`cuda.rs`; Dense's row-wise
//! epilogues in `linear/rowwise.rs`, beside its cuBLASLt GEMMs). What several operations
//! share stays apart: the GEMM driver and f32 panel microkernels in [`crate::ops::cpu`], the bf16
//! packing and microkernels in [`crate::ops::cpu::bf16`], the row-wise CUDA kernels' switch and launch
//! helpers in [`crate::ops::rowwise`] (the kernels are one CUDA module, kernels/rowwise.cu). Each
//! has a test against the reference column.

pub mod attention;
pub(crate) mod block;
pub mod conv;
pub mod cpu;
pub mod dysample;
pub(crate) mod gate;
pub mod linear;
pub mod norm;
pub mod pad;
pub(crate) mod resize;
pub mod rowwise;
pub mod windows;

use candle_core::{Device, Result, Tensor};
use rayon::prelude::*;

use crate::ops::cpu::bf16::Isa;
use crate::ops::pad::Pad;
use crate::switches::Switches;
use attention::Attention;

/// Element-wise operations the networks call directly; each picks its implementation from
/// its input (our CPU kernel for contiguous f32 on the CPU, candle's op elsewhere).
pub(crate) use cpu::{gelu_erf, mean_hw};

/// `a + b`: the CPU kernel where it applies, else candle's op (the same sum either way).
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    match cpu::add(a, b)? {
        Some(sum) => Ok(sum),
        None => a + b,
    }
}

/// `x` `(B, H, W, C)` less `t` pixels on every side: one pass on the CPU.
pub(crate) fn crop(x: &Tensor, t: usize) -> Result<Tensor> {
    if let Some(y) = cpu::centre(x, t, cpu::Centre::Plain)? {
        return Ok(y);
    }
    let (_, h, w, _) = x.dims4()?;
    x.narrow(1, t, h - 2 * t)?
        .narrow(2, t, w - 2 * t)?
        .contiguous()
}

/// `t` with its first `n` entries along axis 0 multiplied by `by`, the same values as
/// `cat([t.narrow(0, 0, n) * by, t.narrow(0, n, ..)])`: a qkv projection with head_dim^-0.5
/// folded into its query rows. One copy on the CPU in f32, where the narrow, the scaling and
/// the concatenation made two.
pub(crate) fn scale_leading(t: &Tensor, n: usize, by: f64) -> Result<Tensor> {
    let rows = t.dim(0)?;
    if n > rows {
        candle_core::bail!("scaling {n} of {rows} rows");
    }
    if !cpu::use_kernel(t) {
        return Tensor::cat(&[(t.narrow(0, 0, n)? * by)?, t.narrow(0, n, rows - n)?], 0);
    }
    let scaled = n * (t.elem_count() / rows.max(1));
    let (guard, layout) = t.storage_and_layout();
    let values = cpu::cpu_slice(&guard, layout)?;
    let by = by as f32;
    // As candle's `affine(by, 0)` computes it: the added zero turns a -0 product into +0.
    let out: Vec<f32> = values[..scaled]
        .iter()
        .map(|&v| v * by + 0.0)
        .chain(values[scaled..].iter().copied())
        .collect();
    drop(guard);
    Tensor::from_vec(out, t.shape(), t.device())
}

/// The choices a network is built with, made once at load and handed to each layer that
/// depends on them, so that every layer is in its final form when it is constructed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadPlan {
    /// How window attention runs on CUDA devices.
    pub attention: Attention,
    /// How DRCT's channels are padded ([`crate::ops::pad`]); the other networks read
    /// their layers unpadded whatever it says.
    pub pad: Pad,
    /// bf16 products with f32 sums on the CPU, on these instructions: the layers on the CPU
    /// pack their weights for them at construction. Layers elsewhere ignore it.
    pub bf16: Option<Isa>,
    /// The tuning switches ([`crate::switches`]) the layers choose their implementation by:
    /// which of our CUDA kernels they leave out, HAT's overlap kernel, Winograd on the CPU.
    pub switches: Switches,
}

impl LoadPlan {
    /// [`LoadPlan::bf16`] for a layer on `device`: `None` off the CPU.
    pub fn cpu_bf16(&self, device: &Device) -> Option<Isa> {
        self.bf16.filter(|_| Backend::of(device) == Backend::Cpu)
    }
}

/// Where a layer's weights live, which decides its implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    /// Our CPU kernels (f32; candle's ops for other dtypes).
    Cpu,
    /// Our CUDA kernels and cuBLASLt epilogues, candle's CUDA ops between.
    Cuda,
    /// Any other device: candle's ops alone.
    Other,
}

impl Backend {
    pub(crate) fn of(device: &Device) -> Self {
        match device {
            Device::Cpu => Self::Cpu,
            Device::Cuda(_) => Self::Cuda,
            _ => Self::Other,
        }
    }
}

/// `build(i)` for `i` in `0..n`, in parallel when the weights go to the CPU: each layer
/// rearranges its weights at load (scaled queries, convolution weights in patch order), and
/// one layer at a time took a tenth of a small image's whole run. Elsewhere one after another,
/// so the uploads to a GPU's stream keep one order.
pub(crate) fn build_layers<T: Send>(
    device: &Device,
    n: usize,
    build: impl Fn(usize) -> Result<T> + Sync + Send,
) -> Result<Vec<T>> {
    match Backend::of(device) {
        Backend::Cpu => (0..n).into_par_iter().map(build).collect(),
        Backend::Cuda | Backend::Other => (0..n).map(build).collect(),
    }
}

#[cfg(test)]
mod tests;
