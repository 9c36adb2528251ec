//! Swin2SR (Conde et al., 2022), inference only: SwinIR with SwinV2 blocks.
//!
//! The network, as the official `network_swin2sr.py` defines it:
//!
//! ```text
//! x  = (x - mean) * img_range                     (img_range 255 for window 7, else 1)
//! f0 = conv_first(x)                              3x3, 3 -> E
//! t  = patch_embed.norm(patch_embed.proj(f0))     a 1x1, then the norm when patch_norm
//! for each RSTB i:  t = patch_embed_i.proj(conv_i(swin_v2_blocks_i(t))) + t
//! b  = conv_after_body(norm(t)) + f0              1conv or 3conv, as SwinIR's
//! tail: SwinIR's pixelshuffle, pixelshuffledirect, nearest+conv (x4) or none, or
//! pixelshuffle_aux:  y = lrelu_0.01(conv_before_upsample(b)); a = conv_aux(y) (RGB);
//!                    y = upsample(lrelu_0.01(conv_after_aux(a))) + conv_bicubic(bicubic_s(x));
//!                    conv_last(y)
//! y  = that / img_range + mean, cropped to (sH, sW)
//! ```
//!
//! A SwinV2 block puts its norms after the attention and the MLP (`x + norm1(attn(x))`,
//! then `x + norm2(mlp(x))`), and its attention is a scaled cosine: `cos(q, k) *
//! exp(min(logit_scale, ln 100))` per head, plus `16 sigmoid(cpb_mlp(coords))`, a
//! continuous position bias whose two-layer MLP reads log-spaced window offsets. Here the
//! MLP is evaluated once at load into an ordinary bias table, q and k are normalised with the
//! scale folded into q ([`normalise_qk`]), and the window attention of every other Swin
//! block ([`Attend`]) does the rest. On the CPU in f32 the whole block runs a window at a
//! time, as SwinIR's does ([`swin_block_by_windows`], its post-norm form). The qkv layer has biases for q and v only (`q_bias`,
//! `v_bias`): one bias with zeros for k.
//!
//! Nothing but the buffers records the window (`relative_position_index`), and whether the
//! blocks shift: a model trained at one window or less has no `attn_mask` and no shift, as
//! the reference loader reads it. Both come from the buffers' shapes, or, in a file
//! `upscale convert` wrote (no buffers), from the configuration in its metadata.
//!
//! The reference's `pixelshuffle_aux` resizes its input to `s` times the size the caller
//! gave, after its own padding: called on a size that is no window multiple, that stretches
//! the bicubic branch against the upsampled features. The input is padded first here, as
//! the official test script pads it, so the branch is an exact `s`-fold resize and tiles
//! agree with the whole image. `pixelshuffle_hf` (a second body; no release uses it) is
//! refused by name.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::{AfterBody, Frame, SwinNet, Tail};
use crate::nets::infer::{
    check_shapes, isqrt, out_width, pixel_shuffle_scale, pixel_shuffle_stages, swin_depths, tensor,
    ConfigError, Shapes,
};
use crate::nets::registry::{swin_family, swin_v2, Architecture, Beyond};
use crate::nets::swin::{load_layer_norm, Mlp, SwinCost};
use crate::nets::swinir::{largest_tensor, ResiConnection};
use crate::nets::{uniform, ArchConfig, Net, NetConfig};
use crate::ops::attention::cosine::normalise_qk;
use crate::ops::attention::Attend;
use crate::ops::block::{swin_block_by_windows, SwinLayers};
use crate::ops::linear::{pointwise_with, Dense};
use crate::ops::norm::{layer_norm, norm_gather, Norm};
use crate::ops::pad::Pad;
use crate::ops::windows::WindowCache;
use crate::ops::{add, build_layers, LoadPlan};

/// Hidden width of the continuous position bias's MLP (fixed by the architecture).
const CPB_HIDDEN: usize = 512;

/// The upsampler at the end of the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Upsampler {
    /// Classical SR: as SwinIR's.
    #[serde(rename = "pixelshuffle")]
    PixelShuffle,
    /// Compressed-input SR: the classical upsampler with an RGB output fed back and the
    /// input's bicubic resize added ([`Tail::Aux`]).
    #[serde(rename = "pixelshuffle_aux")]
    PixelShuffleAux,
    /// Lightweight SR: one 3x3 straight to `3 * s * s` channels and one pixel shuffle.
    #[serde(rename = "pixelshuffledirect")]
    PixelShuffleDirect,
    /// Real-world SR, x4: two nearest-neighbour x2 steps, each followed by a 3x3.
    #[serde(rename = "nearest+conv")]
    NearestConv,
    /// Restoration at scale 1 (JPEG artefact removal): the input plus `conv_last`.
    #[serde(rename = "none")]
    None,
}

impl Upsampler {
    pub fn name(self) -> &'static str {
        match self {
            Self::PixelShuffle => "pixelshuffle",
            Self::PixelShuffleAux => "pixelshuffle_aux",
            Self::PixelShuffleDirect => "pixelshuffledirect",
            Self::NearestConv => "nearest+conv",
            Self::None => "none",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Swin2SrConfig {
    pub embed_dim: usize,
    /// Swin blocks of each residual group (RSTB).
    pub depths: Vec<usize>,
    /// Heads of each residual group.
    pub heads: Vec<usize>,
    pub window: usize,
    /// Whether every second block shifts its windows (not when trained at one window).
    pub shifted: bool,
    pub mlp_hidden: usize,
    pub patch_norm: bool,
    /// Whether the attention has q and v biases.
    pub qkv_bias: bool,
    pub resi_connection: ResiConnection,
    pub upsampler: Upsampler,
    /// Channels of the upsampler (0 for pixelshuffledirect and none).
    pub num_feat: usize,
    pub scale: usize,
    /// The input's scale inside the network: 255 for window 7 (the JPEG model), else 1.
    pub img_range: f64,
}

/// A 3x3 convolution's tensors, `cout` x `cin`.
fn conv(t: &mut Vec<(String, Vec<usize>)>, name: &str, cout: usize, cin: usize) {
    t.push((format!("{name}.weight"), vec![cout, cin, 3, 3]));
    t.push((format!("{name}.bias"), vec![cout]));
}

impl Swin2SrConfig {
    /// The released model these numbers match, else a plain "Swin2SR".
    pub fn variant(&self) -> &'static str {
        let uniform = |d: usize, h: usize| {
            self.depths.iter().all(|&x| x == d) && self.heads.iter().all(|&x| x == h)
        };
        match (self.embed_dim, self.depths.len(), self.upsampler) {
            (60, 4, Upsampler::PixelShuffleDirect) if uniform(6, 6) => "Swin2SR (lightweight)",
            (180, 6, Upsampler::PixelShuffle) if uniform(6, 6) => "Swin2SR (classical)",
            (180, 6, Upsampler::PixelShuffleAux) if uniform(6, 6) => "Swin2SR (compressed input)",
            (180, 6, Upsampler::NearestConv) if uniform(6, 6) => "Swin2SR (real-world)",
            (180, 6, Upsampler::None) if uniform(6, 6) => "Swin2SR (JPEG artefact removal)",
            _ => "Swin2SR",
        }
    }

    pub fn head_dim(&self, layer: usize) -> usize {
        self.embed_dim / self.heads[layer]
    }

    fn push_resi(&self, t: &mut Vec<(String, Vec<usize>)>, p: &str) {
        t.extend(self.resi_connection.tensors(self.embed_dim, p));
    }

    /// A 1x1 `patch_embed.proj` under `p`.
    fn push_proj(&self, t: &mut Vec<(String, Vec<usize>)>, p: &str) {
        let e = self.embed_dim;
        t.push((format!("{p}patch_embed.proj.weight"), vec![e, e, 1, 1]));
        t.push((format!("{p}patch_embed.proj.bias"), vec![e]));
    }

    /// Pixel-shuffle factor of each stage of the classical and aux upsamplers.
    pub fn upsample_stages(&self) -> Vec<usize> {
        pixel_shuffle_stages(self.scale)
    }

    /// Infer the config from the parameters' names and shapes and the buffers' shapes (or a
    /// converted file's stored configuration), then check every tensor against it.
    pub fn infer(shapes: &Shapes, beyond: &Beyond) -> std::result::Result<Self, ConfigError> {
        let name = "conv_first.weight";
        let cf = tensor(shapes, name)?;
        if cf.len() != 4 || cf[0] == 0 || cf[2] != 3 || cf[3] != 3 {
            return Err(ConfigError::shape(name, cf, "; expected [E, 3, 3, 3]"));
        }
        if cf[1] != 3 {
            return Err(ConfigError::NotRgb {
                arch: "Swin2SR",
                channels: cf[1],
            });
        }
        let embed_dim = cf[0];
        let proj = "patch_embed.proj.weight";
        let p = tensor(shapes, proj)?;
        if p.len() == 4 && (p[2] != 1 || p[3] != 1) {
            return Err(ConfigError::Unsupported("a patch size other than 1"));
        }
        let depths = swin_depths(shapes)?;
        let mut heads = Vec::with_capacity(depths.len());
        for i in 0..depths.len() {
            let name = format!("layers.{i}.residual_group.blocks.0.attn.logit_scale");
            let t = tensor(shapes, &name)?;
            let h = t.first().copied().unwrap_or(0);
            if t.len() != 3 || h == 0 || !embed_dim.is_multiple_of(h) {
                return Err(ConfigError::shape(
                    &name,
                    t,
                    format!("; expected [heads, 1, 1], heads dividing the width {embed_dim}"),
                ));
            }
            heads.push(h);
        }
        let (window, shifted) = window_and_shift(beyond)?;
        let block0 = "layers.0.residual_group.blocks.0";
        let width = |name: &str| out_width(shapes, name);
        let mlp_hidden = width(&format!("{block0}.mlp.fc1.weight"))?;
        let resi_connection = if shapes.contains_key("conv_after_body.0.weight") {
            ResiConnection::ThreeConv
        } else {
            ResiConnection::OneConv
        };
        if resi_connection == ResiConnection::ThreeConv && (embed_dim < 4 || embed_dim % 4 != 0) {
            return Err(ConfigError::ThreeConvWidth(embed_dim));
        }
        let has = |name: &str| shapes.contains_key(name);
        let (upsampler, num_feat, scale) = if has("conv_after_body_hf.weight") {
            return Err(ConfigError::Unsupported(
                "the pixelshuffle_hf upsampler (a second body for high frequencies)",
            ));
        } else if has("conv_bicubic.weight") {
            let f = width("conv_before_upsample.0.weight")?;
            (
                Upsampler::PixelShuffleAux,
                f,
                pixel_shuffle_scale(shapes, f)?,
            )
        } else if has("conv_hr.weight") || has("conv_up1.weight") {
            // The reference runs two nearest x2 steps, whatever the file holds.
            (
                Upsampler::NearestConv,
                width("conv_before_upsample.0.weight")?,
                4,
            )
        } else if has("conv_before_upsample.0.weight") {
            let f = width("conv_before_upsample.0.weight")?;
            (Upsampler::PixelShuffle, f, pixel_shuffle_scale(shapes, f)?)
        } else if has("upsample.0.weight") {
            let out = width("upsample.0.weight")?;
            let s = isqrt(out / 3);
            if s < 2 || 3 * s * s != out {
                return Err(ConfigError::DirectUpsampler(out));
            }
            (Upsampler::PixelShuffleDirect, 0, s)
        } else if has("conv_last.weight") {
            (Upsampler::None, 0, 1)
        } else {
            return Err(ConfigError::NoUpsampler);
        };
        let cfg = Swin2SrConfig {
            embed_dim,
            depths,
            heads,
            window,
            shifted,
            mlp_hidden,
            patch_norm: has("patch_embed.norm.weight"),
            qkv_bias: has(&format!("{block0}.attn.q_bias")),
            resi_connection,
            upsampler,
            num_feat,
            scale,
            // The reference loader's rule, as for SwinIR: only the JPEG model has window 7.
            img_range: if window == 7 { 255.0 } else { 1.0 },
        };
        check_shapes(&cfg.expected_tensors(), shapes, UNEXPECTED)?;
        Ok(cfg)
    }
}

/// What [`check_shapes`] adds to an unexpected tensor's name.
const UNEXPECTED: &str = " (an unsupported Swin2SR variant or another architecture)";

/// The window and whether the blocks shift: from the buffers' shapes (the first block's
/// `relative_position_index`, `(N, N)` with `N` the window squared, or its
/// `relative_coords_table`, `(1, 2w-1, 2w-1, 2)`; a shift wherever an `attn_mask` is), else
/// from a converted file's stored configuration.
fn window_and_shift(beyond: &Beyond) -> std::result::Result<(usize, bool), ConfigError> {
    let block0 = "layers.0.residual_group.blocks.0.attn";
    let buffers = beyond.buffers;
    let from_index = buffers
        .get(&format!("{block0}.relative_position_index"))
        .map(|s| match s.as_slice() {
            [n, m] if n == m && isqrt(*n) * isqrt(*n) == *n => Some(isqrt(*n)),
            _ => None,
        });
    let from_table = buffers
        .get(&format!("{block0}.relative_coords_table"))
        .map(|s| match s.as_slice() {
            [1, a, b, 2] if a == b && a % 2 == 1 => Some(a.div_ceil(2)),
            _ => None,
        });
    let window = match from_index.or(from_table) {
        Some(Some(w)) => Some((w, buffers.keys().any(|k| k.ends_with(".attn_mask")))),
        Some(None) => {
            return Err(ConfigError::Values {
                name: format!("{block0}.relative_position_index"),
                problem: "does not have the shape of a square window's".into(),
            })
        }
        None => beyond.stored.and_then(stored_window),
    };
    match window {
        Some((w, shifted)) if (2..=64).contains(&w) => Ok((w, shifted)),
        Some((w, _)) => Err(ConfigError::Values {
            name: format!("{block0}.relative_position_index"),
            problem: format!("gives a window of {w}; 2 to 64 are supported"),
        }),
        None => Err(ConfigError::NoWindow),
    }
}

/// The window and shift a converted file's stored configuration records.
fn stored_window(json: &str) -> Option<(usize, bool)> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let window = usize::try_from(v.get("window")?.as_u64()?).ok()?;
    Some((window, v.get("shifted")?.as_bool()?))
}

/// SwinV2's attention: qkv with q and v biases, the scaled cosine with the continuous
/// position bias, proj.
struct CosineAttention {
    qkv: Dense,
    /// Each head's `exp(min(logit_scale, ln 100))`.
    scales: Vec<f32>,
    attend: Attend,
    proj: Dense,
}

impl CosineAttention {
    fn new(cfg: &Swin2SrConfig, heads: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let dim = cfg.embed_dim;
        let weight = vb.pp("qkv").get((3 * dim, dim), "weight")?;
        let bias = if cfg.qkv_bias {
            let zeros = Tensor::zeros(dim, weight.dtype(), weight.device())?;
            Tensor::cat(
                &[&vb.get(dim, "q_bias")?, &zeros, &vb.get(dim, "v_bias")?],
                0,
            )?
        } else {
            Tensor::zeros(3 * dim, weight.dtype(), weight.device())?
        };
        // The scale and the bias table from the stored f32 values, whatever the model's dtype.
        let f32s = vb.to_dtype(DType::F32);
        let max = 100f64.ln();
        let scales = host(f32s.get((heads, 1, 1), "logit_scale")?)?
            .into_iter()
            .map(|l| l.min(max).exp() as f32)
            .collect();
        let table = position_bias_table(heads, cfg.window, f32s.pp("cpb_mlp"))?;
        let table = Tensor::from_vec(table, ((2 * cfg.window - 1).pow(2), heads), &Device::Cpu)?
            .to_dtype(vb.dtype())?
            .to_device(vb.device())?;
        // The logits are cosines times a scale of up to 100: q or k rounded to bf16 (2^-9)
        // would move them by tenths, so under the CPU's bf16 products qkv and the attention
        // stay f32 (proj and the MLP take bf16 as in any block).
        let f32_plan = LoadPlan {
            bf16: None,
            ..*plan
        };
        Ok(Self {
            qkv: Dense::new(weight, bias, &f32_plan)?,
            scales,
            attend: Attend::new(&table, heads, dim / heads, cfg.window, &f32_plan)?,
            proj: Dense::load_unpadded(dim, dim, plan, vb.pp("proj"))?,
        })
    }

    /// `x`: windows `(B*nW, N, C)` of `(B, h, w)` maps, partitioned after a half-window
    /// shift when `shifted`.
    fn forward(
        &self,
        x: &Tensor,
        hw: (usize, usize),
        shifted: bool,
        windows: &WindowCache,
    ) -> Result<Tensor> {
        let qkv = normalise_qk(&self.qkv.forward(x)?, &self.scales)?;
        let out = self.attend.forward(&qkv, hw, shifted, windows)?;
        self.proj.forward(&out)
    }
}

/// `t` as f64 values on the host.
fn host(t: Tensor) -> Result<Vec<f64>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()
}

/// The continuous position bias of a `window`-square window, `16 sigmoid(cpb_mlp(coords))`
/// for every offset, in f64 on the host: `((2w-1)², heads)`, row-major over the offsets as
/// the relative-position tables of the other Swin blocks. The offsets are scaled to [-8, 8]
/// and log-spaced, `sign(c) log2(|c| + 1) / 3`, as the reference's `relative_coords_table`.
fn position_bias_table(heads: usize, window: usize, vb: VarBuilder) -> Result<Vec<f32>> {
    let w1 = host(vb.get((CPB_HIDDEN, 2), "0.weight")?)?;
    let b1 = host(vb.get(CPB_HIDDEN, "0.bias")?)?;
    let w2 = host(vb.get((heads, CPB_HIDDEN), "2.weight")?)?;
    let side = 2 * window - 1;
    let coord = |i: usize| {
        let c = (i as f64 - (window - 1) as f64) / (window - 1) as f64 * 8.0;
        c.signum() * (c.abs() + 1.0).log2() / 8f64.log2()
    };
    let mut table = Vec::with_capacity(side * side * heads);
    let mut hidden = vec![0f64; CPB_HIDDEN];
    for dy in 0..side {
        for dx in 0..side {
            let (y, x) = (coord(dy), coord(dx));
            for (j, h) in hidden.iter_mut().enumerate() {
                *h = (w1[2 * j] * y + w1[2 * j + 1] * x + b1[j]).max(0.0);
            }
            for row in w2.chunks_exact(CPB_HIDDEN) {
                let v: f64 = row.iter().zip(&hidden).map(|(w, h)| w * h).sum();
                table.push((16.0 / (1.0 + (-v).exp())) as f32);
            }
        }
    }
    Ok(table)
}

/// A SwinV2 block: norms after the attention and the MLP.
struct Block {
    attn: CosineAttention,
    norm1: Norm,
    fc1: Dense,
    fc2: Dense,
    norm2: Norm,
    window: usize,
    shifted: bool,
    windows: WindowCache,
    /// The whole block a window at a time where it can ([`swin_block_by_windows`]).
    by_windows: bool,
}

impl Module for Block {
    /// `x`: `(B, H, W, C)` with H and W multiples of the window.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.by_windows {
            let layers = SwinLayers {
                norm1: &self.norm1,
                qkv: &self.attn.qkv,
                attend: &self.attn.attend,
                proj: &self.attn.proj,
                norm2: &self.norm2,
                fc1: &self.fc1,
                fc2: &self.fc2,
                v2: Some(&self.attn.scales),
            };
            let shape = (self.window, self.shifted);
            if let Some(y) = swin_block_by_windows(&layers, x, None, shape, &self.windows)? {
                return Ok(y);
            }
        }
        let (b, h, w, c) = x.dims4()?;
        let ws = self.window;
        let (order, back) = self.windows.partition(h, w, self.shifted)?;
        let x = x.reshape((b, h * w, c))?;
        let windows = x
            .index_select(&order, 1)?
            .reshape((b * (h / ws) * (w / ws), ws * ws, c))?;
        let y = self
            .attn
            .forward(&windows, (h, w), self.shifted, &self.windows)?;
        // The norm of each token, and its way back from window order, in one pass.
        let y = norm_gather(&self.norm1, &y.reshape((b, h * w, c))?, &back)?;
        let x = add(&x, &y)?;
        let m = self.fc2.forward(&self.fc1.forward_gelu(&x)?)?;
        add(&x, &layer_norm(&self.norm2, &m)?)?.reshape((b, h, w, c))
    }
}

/// Residual Swin transformer block: SwinV2 blocks, the group's convolution and 1x1
/// projection, plus the input.
struct Rstb {
    blocks: Vec<Block>,
    conv: AfterBody,
    proj: Dense,
}

impl Module for Rstb {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut t = x.clone();
        for b in &self.blocks {
            t = b.forward(&t)?;
        }
        self.proj.forward_residual(&self.conv.forward(&t)?, x)
    }
}

/// The convolution closing a residual group or the body: one 3x3 or the 3conv stack.
fn resi(cfg: &Swin2SrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<AfterBody> {
    cfg.resi_connection.build(cfg.embed_dim, plan, vb)
}

/// Swin2SR: the Swin frame around its residual groups of SwinV2 blocks.
type Swin2Sr = SwinNet<Rstb>;

fn build(cfg: &Swin2SrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Swin2Sr> {
    let plan = LoadPlan {
        pad: Pad::OFF,
        ..*plan
    };
    let plan = &plan;
    let (e, f) = (cfg.embed_dim, cfg.num_feat);
    let windows = WindowCache::new(cfg.window, vb.dtype(), vb.device());
    let group = |i: usize| -> Result<Rstb> {
        let vb = vb.pp(format!("layers.{i}"));
        let blocks = (0..cfg.depths[i])
            .map(|j| {
                let vb = vb.pp(format!("residual_group.blocks.{j}"));
                let mlp = Mlp::unpadded(e, cfg.mlp_hidden, plan, vb.pp("mlp"))?;
                Ok(Block {
                    attn: CosineAttention::new(cfg, cfg.heads[i], plan, vb.pp("attn"))?,
                    norm1: load_layer_norm(e, vb.pp("norm1"))?,
                    fc1: mlp.fc1,
                    fc2: mlp.fc2,
                    norm2: load_layer_norm(e, vb.pp("norm2"))?,
                    window: cfg.window,
                    shifted: cfg.shifted && j % 2 == 1,
                    windows: windows.clone(),
                    by_windows: plan.switches.fused_windows,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Rstb {
            blocks,
            conv: resi(cfg, plan, vb.pp("conv"))?,
            proj: pointwise_with(e, e, plan, vb.pp("patch_embed.proj"))?,
        })
    };
    let groups = build_layers(vb.device(), cfg.depths.len(), group)?;
    let tail = match cfg.upsampler {
        Upsampler::PixelShuffle => {
            let (ec, fc) = (Pad::OFF.one(e), Pad::OFF.one(f));
            Tail::pixel_shuffle((&ec, &fc, f), cfg.upsample_stages(), Pad::OFF, plan, &vb)?
        }
        Upsampler::PixelShuffleAux => Tail::aux((e, f), cfg.upsample_stages(), plan, &vb)?,
        Upsampler::PixelShuffleDirect => Tail::direct(e, cfg.scale, plan, &vb)?,
        Upsampler::NearestConv => Tail::nearest_conv((e, f), cfg.scale, plan, &vb)?,
        Upsampler::None => Tail::residual((e, 3), plan, &vb)?,
    };
    let frame = Frame::new(
        (&Pad::OFF.one(e), cfg.patch_norm),
        (resi(cfg, plan, vb.pp("conv_after_body"))?, tail),
        (cfg.window, cfg.scale),
        plan,
        &vb,
    )?
    .with_patch_proj(pointwise_with(e, e, plan, vb.pp("patch_embed.proj"))?)
    .with_range(cfg.img_range);
    Ok(SwinNet::assemble(frame, groups, windows, Pad::OFF))
}

/// Swin2SR's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "Swin2SR"
    }

    fn loads(&self) -> &'static str {
        "classical, lightweight, compressed-input and real-world x2/x3/x4; JPEG (x1)"
    }

    /// Residual groups of SwinV2 blocks (logit scales, the position-bias MLP).
    fn detect(&self, shapes: &Shapes) -> bool {
        swin_family(shapes) && swin_v2(shapes)
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        let buffers = Shapes::new();
        let beyond = Beyond {
            values: &|_| None,
            buffers: &buffers,
            stored: None,
        };
        self.infer_with(shapes, &beyond)
    }

    fn infer_with(
        &self,
        shapes: &Shapes,
        beyond: &Beyond,
    ) -> std::result::Result<ArchConfig, ConfigError> {
        match Swin2SrConfig::infer(shapes, beyond) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::Swin2Sr(Box::new(e))),
        }
    }
}

impl NetConfig for Swin2SrConfig {
    /// Every tensor the network needs, with its shape.
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (e, f, hid) = (self.embed_dim, self.num_feat, self.mlp_hidden);
        let mut t: Vec<(String, Vec<usize>)> = Vec::new();
        conv(&mut t, "conv_first", e, 3);
        self.push_proj(&mut t, "");
        if self.patch_norm {
            t.push(("patch_embed.norm.weight".into(), vec![e]));
            t.push(("patch_embed.norm.bias".into(), vec![e]));
        }
        for (i, (&depth, &heads)) in self.depths.iter().zip(&self.heads).enumerate() {
            for j in 0..depth {
                let p = format!("layers.{i}.residual_group.blocks.{j}");
                let mut push =
                    |name: &str, shape: Vec<usize>| t.push((format!("{p}.{name}"), shape));
                push("norm1.weight", vec![e]);
                push("norm1.bias", vec![e]);
                push("attn.logit_scale", vec![heads, 1, 1]);
                push("attn.cpb_mlp.0.weight", vec![CPB_HIDDEN, 2]);
                push("attn.cpb_mlp.0.bias", vec![CPB_HIDDEN]);
                push("attn.cpb_mlp.2.weight", vec![heads, CPB_HIDDEN]);
                push("attn.qkv.weight", vec![3 * e, e]);
                if self.qkv_bias {
                    push("attn.q_bias", vec![e]);
                    push("attn.v_bias", vec![e]);
                }
                push("attn.proj.weight", vec![e, e]);
                push("attn.proj.bias", vec![e]);
                push("norm2.weight", vec![e]);
                push("norm2.bias", vec![e]);
                push("mlp.fc1.weight", vec![hid, e]);
                push("mlp.fc1.bias", vec![hid]);
                push("mlp.fc2.weight", vec![e, hid]);
                push("mlp.fc2.bias", vec![e]);
            }
            self.push_resi(&mut t, &format!("layers.{i}.conv"));
            self.push_proj(&mut t, &format!("layers.{i}."));
        }
        t.push(("norm.weight".into(), vec![e]));
        t.push(("norm.bias".into(), vec![e]));
        self.push_resi(&mut t, "conv_after_body");
        let stages = |t: &mut Vec<(String, Vec<usize>)>| {
            for (i, r) in self.upsample_stages().iter().enumerate() {
                conv(t, &format!("upsample.{}", 2 * i), r * r * f, f);
            }
        };
        match self.upsampler {
            Upsampler::PixelShuffle => {
                conv(&mut t, "conv_before_upsample.0", f, e);
                stages(&mut t);
                conv(&mut t, "conv_last", 3, f);
            }
            Upsampler::PixelShuffleAux => {
                conv(&mut t, "conv_bicubic", f, 3);
                conv(&mut t, "conv_before_upsample.0", f, e);
                conv(&mut t, "conv_aux", 3, f);
                conv(&mut t, "conv_after_aux.0", f, 3);
                stages(&mut t);
                conv(&mut t, "conv_last", 3, f);
            }
            Upsampler::PixelShuffleDirect => {
                conv(&mut t, "upsample.0", 3 * self.scale * self.scale, e);
            }
            Upsampler::NearestConv => {
                conv(&mut t, "conv_before_upsample.0", f, e);
                conv(&mut t, "conv_up1", f, f);
                conv(&mut t, "conv_up2", f, f);
                conv(&mut t, "conv_hr", f, f);
                conv(&mut t, "conv_last", 3, f);
            }
            Upsampler::None => conv(&mut t, "conv_last", 3, e),
        }
        t
    }

    /// Multiply-adds x2 of one forward pass over a padded `h x w` input (convolutions at the
    /// resolution they run at, linear layers, both attention products).
    fn flops(&self, h: usize, w: usize) -> f64 {
        let s2 = (self.scale * self.scale) as f64;
        let area = |name: &str| -> f64 {
            if let Some(rest) = name.strip_prefix("upsample.") {
                let stage: usize = rest
                    .split('.')
                    .next()
                    .and_then(|i| i.parse().ok())
                    .unwrap_or(0);
                let stages = self.upsample_stages();
                return stages[..(stage / 2).min(stages.len())]
                    .iter()
                    .map(|r| (r * r) as f64)
                    .product();
            }
            match name {
                "conv_up1.weight" => 4.0,
                "conv_up2.weight" => 16.0,
                "conv_bicubic.weight" | "conv_hr.weight" => s2,
                "conv_last.weight" if self.upsampler != Upsampler::None => s2,
                _ => 1.0,
            }
        };
        let per_pixel: f64 = self
            .expected_tensors()
            .iter()
            .filter(|(name, s)| name.ends_with(".weight") && s.len() == 4)
            .map(|(name, s)| 2.0 * area(name) * s.iter().product::<usize>() as f64)
            .sum();
        let e = self.embed_dim as f64;
        let n = (self.window * self.window) as f64;
        let hid = self.mlp_hidden as f64;
        let blocks: usize = self.depths.iter().sum();
        let linear = 2.0 * (4.0 * e * e + 2.0 * e * hid) + 4.0 * n * e;
        (h * w) as f64 * (per_pixel + blocks as f64 * linear)
    }

    fn family(&self) -> &'static str {
        "Swin2SR"
    }

    fn variant(&self) -> &'static str {
        Swin2SrConfig::variant(self)
    }

    fn describe(&self) -> serde_json::Value {
        let c = self;
        let head_dims: Vec<usize> = (0..c.heads.len()).map(|i| c.head_dim(i)).collect();
        json!({
            "scale": c.scale,
            "upsampler": c.upsampler.name(),
            "resi_connection": c.resi_connection,
            "groups": c.depths.len(),
            "depths": uniform(&c.depths),
            "embed_dim": c.embed_dim,
            "window": c.window,
            "shifted": c.shifted,
            "heads": uniform(&c.heads),
            "head_dims": uniform(&head_dims),
            "mlp_hidden": c.mlp_hidden,
            "num_feat": (c.num_feat > 0).then_some(c.num_feat),
            "patch_norm": c.patch_norm,
            "qkv_bias": c.qkv_bias,
            "img_range": c.img_range,
        })
    }

    fn activations_per_pixel(&self, scores_in_memory: bool, pad: Pad) -> f64 {
        SwinCost {
            window: self.window,
            block: self.embed_dim,
            heads: self.heads.iter().copied().max().unwrap_or(1),
            unfused_scores: 0,
            mlp_hidden: self.mlp_hidden,
            upsampler: self.num_feat.max(3),
            scale: self.scale,
        }
        .activations_per_pixel(scores_in_memory, pad)
    }

    fn scale(&self) -> usize {
        self.scale
    }

    fn window(&self) -> usize {
        self.window
    }

    fn widest_head_dim(&self) -> usize {
        (0..self.heads.len())
            .map(|i| self.head_dim(i))
            .max()
            .unwrap_or(0)
    }

    fn largest_tensor_per_pixel(&self, scores_in_memory: bool, _: Pad) -> usize {
        let heads = self.heads.iter().copied().max().unwrap_or(1);
        largest_tensor(
            (self.window, heads, self.embed_dim, self.mlp_hidden),
            (self.num_feat, self.scale),
            scores_in_memory,
        )
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(build(self, plan, vb)?))
    }
}
