//! The layers every Swin-family network here shares (DRCT, SwinIR, HAT): the transformer
//! block with shifted-window attention, its MLP, and the window padding of the input (the
//! frame around a network's body is [`super::frame`]). One struct per layer of the official
//! models, each built from a VarBuilder whose path is the state-dict key. Features are kept
//! channels-last, `(B, H, W, C)`, so every token-wise layer is one matmul over contiguous
//! memory.

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::ops::attention::Attend;
use crate::ops::block::{swin_block_by_windows, SwinLayers};
use crate::ops::linear::{self, spread2, Dense};
use crate::ops::norm::{add_gather_norm, norm_gather, Norm};
use crate::ops::pad::{Channels, Pad};
use crate::ops::windows::WindowCache;
use crate::ops::{scale_leading, LoadPlan};

/// The shapes behind a Swin-family network's analytic memory cost.
pub(crate) struct SwinCost {
    /// Window side.
    pub window: usize,
    /// The widest block input, at its padded width.
    pub block: usize,
    /// The most heads of any block.
    pub heads: usize,
    /// Attention scores per token that no fused kernel keeps out of memory (HAT's
    /// overlapping cross-attention: heads x overlap window²).
    pub unfused_scores: usize,
    /// The widest MLP hidden layer.
    pub mlp_hidden: usize,
    /// Channels of the upsampler's feature maps.
    pub upsampler: usize,
    /// The upscaling factor.
    pub scale: usize,
}

impl SwinCost {
    /// The largest live set of one Swin block, per token: the attention scores and their
    /// softmax (heads x N each, unless the fused kernel keeps them out of memory; HAT's
    /// cross-attention scores always), the dense concatenation, qkv and the MLP hidden
    /// layer, plus the upsampler's high-resolution maps; widths padded as `pad` says.
    pub(crate) fn activations_per_pixel(&self, scores_in_memory: bool, pad: Pad) -> f64 {
        let n = (self.window * self.window) as f64;
        let window_scores = if scores_in_memory {
            self.heads as f64 * n
        } else {
            0.0
        };
        // Window and cross-attention scores live in different blocks, never together.
        let scores = 3.0 * window_scores.max(self.unfused_scores as f64);
        let tokens = scores + 6.0 * self.block as f64 + pad.width(self.mlp_hidden) as f64;
        let s2 = (self.scale * self.scale) as f64;
        let upsampler = 3.0 * pad.width(self.upsampler) as f64 * s2;
        tokens + upsampler
    }
}

/// LayerNorm epsilon of torch's default, which the official models use.
const LN_EPS: f64 = 1e-5;

/// A layer norm over `channels`, normalising the real ones only.
pub(crate) fn load_norm(channels: &Channels, vb: VarBuilder) -> Result<Norm> {
    Norm::load(channels, LN_EPS, vb)
}

/// A layer norm over `dim` unpadded channels (the other Swin-family networks' norms).
pub(crate) fn load_layer_norm(dim: usize, vb: VarBuilder) -> Result<Norm> {
    load_norm(&Pad::OFF.one(dim), vb)
}

/// The two-layer MLP of a transformer block, with the exact GELU between.
pub struct Mlp {
    pub(crate) fc1: Dense,
    pub(crate) fc2: Dense,
    /// Both layers a block of rows at a time where they can ([`linear::mlp_residual`]).
    fused: bool,
}

impl Mlp {
    pub fn new(dim: &Channels, hidden: &Channels, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            fc1: Dense::load(dim, hidden, plan, vb.pp("fc1"))?,
            fc2: Dense::load(hidden, dim, plan, vb.pp("fc2"))?,
            fused: plan.switches.fused_mlp,
        })
    }

    /// The MLP stored under `vb`, `dim` -> `hidden` -> `dim` channels, none padded.
    pub(crate) fn unpadded(
        dim: usize,
        hidden: usize,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        Self::new(&Pad::OFF.one(dim), &Pad::OFF.one(hidden), plan, vb)
    }
}

impl Mlp {
    /// `residual + mlp(x)`. Takes the residual by value: on CUDA in bf16 and f16 the second
    /// layer adds onto its buffer in place.
    pub(crate) fn forward_residual(&self, x: &Tensor, residual: Tensor) -> Result<Tensor> {
        if self.fused {
            if let Some(y) = linear::mlp_residual((&self.fc1, &self.fc2), x, &residual)? {
                return Ok(y);
            }
        }
        // The official model uses nn.GELU(): the exact erf form, not the tanh approximation.
        let hidden = self.fc1.forward_gelu(x)?;
        if let Some(y) = self.fc2.accumulate_onto(&hidden, residual.clone())? {
            return Ok(y);
        }
        self.fc2.forward_residual(&hidden, &residual)
    }
}

/// Window multi-head self-attention: qkv, the attention of each window
/// ([`Attend`]), proj.
pub struct WindowAttention {
    pub(crate) qkv: Dense,
    pub(crate) proj: Dense,
    attend: Attend,
}

impl WindowAttention {
    /// The attention of a block over `channels`, its heads' dims padded as `plan` says.
    pub fn new(
        channels: &Channels,
        heads: usize,
        ws: usize,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        let pad = plan.pad;
        let dim = channels.real();
        let head_dim = dim / heads;
        // Fold head_dim^-0.5 into the query rows of qkv: one multiply at load instead of a
        // pass over q in every forward. The real head dim's: padded dims add zero products.
        let scale = (head_dim as f64).powf(-0.5);
        let w = vb.pp("qkv").get((3 * dim, dim), "weight")?;
        let b = vb.pp("qkv").get(3 * dim, "bias")?;
        let (w, b) = (
            scale_leading(&w, dim, scale)?,
            scale_leading(&b, dim, scale)?,
        );
        // Every head of q, k and v padded on its own, with zero columns that add nothing to
        // q·k and leave zeros in the output, which proj reads with zero weights.
        let head_channels = pad.parts(heads, head_dim);
        let qkv_channels = pad.parts(3 * heads, head_dim);
        let w = spread2(&w, &qkv_channels, channels)?;
        let b = qkv_channels.spread(&b, 0)?;
        let table = vb.get(
            ((2 * ws - 1) * (2 * ws - 1), heads),
            "relative_position_bias_table",
        )?;
        Ok(Self {
            qkv: Dense::new(w, b, plan)?,
            proj: Dense::load(&head_channels, channels, plan, vb.pp("proj"))?,
            attend: Attend::new(&table, heads, pad.width(head_dim), ws, plan)?,
        })
    }

    /// `x`: windows `(B*nW, N, C)` of `(B, h, w)` maps, partitioned after a half-window shift
    /// when `shifted` (then masked as `windows` says for that size).
    pub fn forward(
        &self,
        x: &Tensor,
        hw: (usize, usize),
        shifted: bool,
        windows: &WindowCache,
    ) -> Result<Tensor> {
        let out = self
            .attend
            .forward(&self.qkv.forward(x)?, hw, shifted, windows)?;
        self.proj.forward(&out)
    }

    /// [`Self::forward`] through the fused op whatever the device: its CPU twin checks the
    /// CUDA kernel's logic.
    #[cfg(test)]
    pub(crate) fn forward_fused(
        &self,
        x: &Tensor,
        hw: (usize, usize),
        shifted: bool,
    ) -> Result<Tensor> {
        let out = self.attend.fused(&self.qkv.forward(x)?, hw, shifted)?;
        self.proj.forward(&out)
    }
}

pub struct SwinBlock {
    pub(crate) norm1: Norm,
    pub(crate) attn: WindowAttention,
    pub(crate) norm2: Norm,
    pub(crate) mlp: Mlp,
    window: usize,
    shifted: bool,
    windows: WindowCache,
    /// The whole block a window at a time where it can ([`swin_block_by_windows`]).
    by_windows: bool,
}

impl SwinBlock {
    /// The block of any Swin-family network: width, heads, MLP width, window and shift, its
    /// channels unpadded whatever `plan` says.
    pub(crate) fn with_shape(
        s: BlockShape,
        windows: &WindowCache,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        let plan = LoadPlan {
            pad: Pad::OFF,
            ..*plan
        };
        Self::padded(s, &plan.pad.one(s.dim), windows, &plan, vb)
    }

    /// The block of shape `s` whose input channels are laid out as `dim`, each part padded
    /// to the multiple `plan` says.
    pub(crate) fn padded(
        s: BlockShape,
        dim: &Channels,
        windows: &WindowCache,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            norm1: load_norm(dim, vb.pp("norm1"))?.with_cuda_off(plan.switches.cuda_off),
            attn: WindowAttention::new(dim, s.heads, s.window, plan, vb.pp("attn"))?,
            norm2: load_norm(dim, vb.pp("norm2"))?.with_cuda_off(plan.switches.cuda_off),
            mlp: Mlp::new(dim, &plan.pad.one(s.mlp_hidden), plan, vb.pp("mlp"))?,
            window: s.window,
            shifted: s.shifted,
            windows: windows.clone(),
            by_windows: plan.switches.fused_windows,
        })
    }
}

/// The shape of one Swin block (see [`SwinBlock::with_shape`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockShape {
    pub dim: usize,
    pub heads: usize,
    pub mlp_hidden: usize,
    pub window: usize,
    pub shifted: bool,
}

impl Module for SwinBlock {
    /// `x`: `(B, H, W, C)` with H and W multiples of the window.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_plus(x, None)
    }
}

impl SwinBlock {
    /// The block's first LayerNorm, for a branch that reads the same normalised input.
    pub(crate) fn norm1(&self) -> &Norm {
        &self.norm1
    }

    /// The block with `extra` `(z, s)` added to the attention's residual sum, before the MLP:
    /// `z` `(B, H, W, C)` times `s` `(B, C)`, a scale per image and channel (HAT's convolution
    /// branch), summed in the same pass as the residual and its norm.
    pub(crate) fn forward_plus(
        &self,
        x: &Tensor,
        extra: Option<(&Tensor, &Tensor)>,
    ) -> Result<Tensor> {
        if self.by_windows {
            let layers = SwinLayers {
                norm1: &self.norm1,
                qkv: &self.attn.qkv,
                attend: &self.attn.attend,
                proj: &self.attn.proj,
                norm2: &self.norm2,
                fc1: &self.mlp.fc1,
                fc2: &self.mlp.fc2,
                v2: None,
            };
            let shape = (self.window, self.shifted);
            if let Some(y) = swin_block_by_windows(&layers, x, extra, shape, &self.windows)? {
                return Ok(y);
            }
        }
        let (b, h, w, c) = x.dims4()?;
        let ws = self.window;
        let (nh, nw) = (h / ws, w / ws);
        // One gather each way stands for the cyclic shift and the window partition; each is
        // fused with the layer norm next to it.
        let (order, back) = self.windows.partition(h, w, self.shifted)?;
        let x = x.reshape((b, h * w, c))?;
        let windows = norm_gather(&self.norm1, &x, &order)?.reshape((b * nh * nw, ws * ws, c))?;
        let y = self
            .attn
            .forward(&windows, (h, w), self.shifted, &self.windows)?;
        let z = extra.map(|(z, _)| z.reshape((b, h * w, c))).transpose()?;
        let scaled = z.as_ref().zip(extra.map(|(_, s)| s));
        let y = y.reshape((b, h * w, c))?;
        let (x, normed) = add_gather_norm(&self.norm2, &x, scaled, &y, &back)?;
        self.mlp.forward_residual(&normed, x)?.reshape((b, h, w, c))
    }
}

/// Reflect-101 indices (edge not repeated) for extending `size` samples to `padded`. Sizes
/// smaller than the padding fold back and forth, so even a 1-pixel input gets a defined pad.
pub fn reflect_indices(size: usize, padded: usize) -> Vec<u32> {
    (0..padded)
        .map(|i| {
            if size == 1 {
                return 0;
            }
            let period = 2 * (size - 1);
            let m = i % period;
            (if m < size { m } else { period - m }) as u32
        })
        .collect()
}

pub(crate) fn reflect_pad_bottom_right(x: &Tensor, ws: usize) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    let (hp, wp) = (h.div_ceil(ws) * ws, w.div_ceil(ws) * ws);
    let mut x = x.clone();
    if hp != h {
        let idx = Tensor::from_vec(reflect_indices(h, hp), hp, x.device())?;
        x = x.index_select(&idx, 2)?;
    }
    if wp != w {
        let idx = Tensor::from_vec(reflect_indices(w, wp), wp, x.device())?;
        x = x.index_select(&idx, 3)?;
    }
    Ok(x)
}
