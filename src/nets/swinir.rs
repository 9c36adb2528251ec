//! SwinIR (Liang et al., 2021), super-resolution variants, inference only.
//!
//! The network, as the paper and the official `network_swinir.py` define it:
//!
//! ```text
//! x  = x - mean                                   (img_range 1, the DIV2K RGB mean)
//! f0 = conv_first(x)                              3x3, 3 -> E
//! t  = patch_embed.norm(tokens(f0))               when patch_norm
//! for each RSTB i:  t = conv_i(swin_blocks_i(t)) + t
//!                                                 blocks alternate plain / half-window shift;
//!                                                 conv_i is one 3x3 ("1conv") or 3x3 E->E/4,
//!                                                 lrelu 0.2, 1x1, lrelu 0.2, 3x3 E/4->E ("3conv")
//! b  = conv_after_body(norm(t)) + f0              same 1conv / 3conv choice
//! pixelshuffle:        conv_last(upsample(lrelu_0.01(conv_before_upsample(b))))
//! pixelshuffledirect:  PixelShuffle(s)(upsample.0(b))           (the lightweight models)
//! nearest+conv:        y = lrelu_0.01(conv_before_upsample(b));
//!                      y = lrelu_0.2(conv_up1(nearest2(y))); [x4, x8: the same with
//!                      conv_up2, then conv_up3]
//!                      conv_last(lrelu_0.2(conv_hr(y)))         (the real-world models)
//! none:                x + conv_last(b)           (denoising and JPEG models, scale 1)
//! y  = that + mean, cropped to (sH, sW)
//! ```
//!
//! The JPEG models (the only ones released with window 7) work on `(x - mean) * 255` and
//! divide by 255 before adding the mean back: the reference loader infers that `img_range`
//! from the window, as nothing in the file records it, and so does [`SwinIrConfig::infer`].
//!
//! The Swin block is DRCT's ([`crate::nets::swin::SwinBlock`]): the same LayerNorms, window
//! attention with relative position bias and shift mask, and erf-GELU MLP. The input is
//! reflect-padded (edge not repeated) on the bottom and right to a window multiple, as the
//! official network's own `check_image_size` does, and the output cropped.
//!
//! The configuration is read from the state dict alone and every tensor is checked against
//! it before anything is built, as for DRCT.

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::{AfterBody, Frame, SwinNet, Tail};
use crate::nets::hat;
use crate::nets::infer::{
    check_shapes, isqrt, out_width, pixel_shuffle_scale, pixel_shuffle_stages, swin_layout, tensor,
    ConfigError, Shapes, SwinLayout, UNEXPECTED_SWINIR,
};
use crate::nets::registry::{swin_family, swin_v2, Architecture};
use crate::nets::swin::{BlockShape, SwinBlock, SwinCost};
use crate::nets::{uniform, ArchConfig, Net, NetConfig};
use crate::ops::conv::Conv3x3;
use crate::ops::pad::Pad;
use crate::ops::windows::WindowCache;
use crate::ops::{add, build_layers, LoadPlan};

/// The convolution closing each residual group and the body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ResiConnection {
    /// One 3x3 convolution (`conv.weight`).
    #[serde(rename = "1conv")]
    OneConv,
    /// 3x3 to E/4, LeakyReLU, 1x1, LeakyReLU, 3x3 back to E (`conv.0`, `conv.2`, `conv.4`).
    #[serde(rename = "3conv")]
    ThreeConv,
}

impl ResiConnection {
    /// Its tensors under `p` on a body `e` channels wide.
    pub(crate) fn tensors(self, e: usize, p: &str) -> Vec<(String, Vec<usize>)> {
        let q = e / 4;
        let convs: Vec<(String, usize, usize, usize)> = match self {
            Self::OneConv => vec![(p.to_string(), e, e, 3)],
            Self::ThreeConv => vec![
                (format!("{p}.0"), q, e, 3),
                (format!("{p}.2"), q, q, 1),
                (format!("{p}.4"), e, q, 3),
            ],
        };
        let mut t = Vec::new();
        for (name, cout, cin, k) in convs {
            t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
            t.push((format!("{name}.bias"), vec![cout]));
        }
        t
    }

    /// The layers stored under `vb` on a body `e` channels wide.
    pub(crate) fn build(self, e: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<AfterBody> {
        Ok(match self {
            Self::OneConv => AfterBody::One(Conv3x3::unpadded(e, e, plan, vb)?),
            Self::ThreeConv => AfterBody::three(e, plan, vb)?,
        })
    }
}

/// The most values one intermediate tensor of a SwinIR-like network (SwinIR, Swin2SR) holds
/// per padded input pixel (see [`super::DrctConfig::largest_tensor_per_pixel`]): the scores
/// of `heads` heads over `window`-square windows where they are in memory, qkv (3 x the
/// width `e`), the MLP's hidden layer, or the upsampler's maps (`feat` channels, `scale`²).
pub(crate) fn largest_tensor(
    (window, heads, e, mlp_hidden): (usize, usize, usize, usize),
    (feat, scale): (usize, usize),
    scores_in_memory: bool,
) -> usize {
    let scores = if scores_in_memory {
        heads * window * window
    } else {
        0
    };
    let upsampler = feat.max(3) * scale * scale;
    [scores, 3 * e, mlp_hidden, upsampler]
        .into_iter()
        .max()
        .unwrap_or(1)
}

/// The upsampler at the end of the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Upsampler {
    /// Classical SR: a 3x3 to `num_feat`, then pixel-shuffle stages, then `conv_last`.
    #[serde(rename = "pixelshuffle")]
    PixelShuffle,
    /// Lightweight SR: one 3x3 straight to `3 * s * s` channels and one pixel shuffle.
    #[serde(rename = "pixelshuffledirect")]
    PixelShuffleDirect,
    /// Real-world SR: nearest-neighbour x2 steps, each followed by a 3x3.
    #[serde(rename = "nearest+conv")]
    NearestConv,
    /// Restoration at scale 1 (denoising, JPEG artefact removal): no upsampler, the input
    /// plus `conv_last` of the body's output.
    #[serde(rename = "none")]
    None,
}

impl Upsampler {
    pub fn name(self) -> &'static str {
        match self {
            Self::PixelShuffle => "pixelshuffle",
            Self::PixelShuffleDirect => "pixelshuffledirect",
            Self::NearestConv => "nearest+conv",
            Self::None => "none",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SwinIrConfig {
    pub embed_dim: usize,
    /// Swin blocks of each residual group (RSTB).
    pub depths: Vec<usize>,
    /// Heads of each residual group (every block of a group has the same).
    pub heads: Vec<usize>,
    pub window: usize,
    pub mlp_hidden: usize,
    pub patch_norm: bool,
    pub resi_connection: ResiConnection,
    pub upsampler: Upsampler,
    /// Channels of the upsampler (0 for pixelshuffledirect and none: neither has its own).
    pub num_feat: usize,
    pub scale: usize,
    /// The input's scale inside the network: 255 for window 7 (the JPEG models), else 1.
    pub img_range: f64,
    /// Image channels in and out: 3, or 1 for the greyscale denoising and JPEG models (which
    /// subtract no mean).
    pub channels: usize,
}

impl SwinIrConfig {
    /// The released family member these numbers match, else a plain "SwinIR".
    pub fn variant(&self) -> &'static str {
        let uniform = |d: usize, h: usize| {
            self.depths.iter().all(|&x| x == d) && self.heads.iter().all(|&x| x == h)
        };
        match (self.embed_dim, self.depths.len(), self.upsampler) {
            (60, 4, Upsampler::PixelShuffleDirect) if uniform(6, 6) => "SwinIR-S (lightweight)",
            (180, 6, Upsampler::NearestConv) if uniform(6, 6) => "SwinIR-M (real-world)",
            (240, 9, Upsampler::NearestConv) if uniform(6, 8) => "SwinIR-L (real-world)",
            (180, 6, Upsampler::None) if uniform(6, 6) && self.window == 7 => {
                if self.channels == 1 {
                    "SwinIR-M (greyscale JPEG artefact removal)"
                } else {
                    "SwinIR-M (JPEG artefact removal)"
                }
            }
            (180, 6, Upsampler::None) if uniform(6, 6) && self.channels == 1 => {
                "SwinIR-M (greyscale denoising)"
            }
            (180, 6, Upsampler::None) if uniform(6, 6) => "SwinIR-M (denoising)",
            (180, 6, _) if uniform(6, 6) => "SwinIR-M (classical)",
            _ => "SwinIR",
        }
    }

    pub fn head_dim(&self, layer: usize) -> usize {
        self.embed_dim / self.heads[layer]
    }

    fn push_resi(&self, t: &mut Vec<(String, Vec<usize>)>, p: &str) {
        t.extend(self.resi_connection.tensors(self.embed_dim, p));
    }

    /// Pixel-shuffle factor of each stage of the classical upsampler.
    pub fn upsample_stages(&self) -> Vec<usize> {
        pixel_shuffle_stages(self.scale)
    }

    /// The most values one intermediate tensor holds per padded input pixel (see
    /// [`super::DrctConfig::largest_tensor_per_pixel`]).
    pub fn largest_tensor_per_pixel(&self, scores_in_memory: bool) -> usize {
        let heads = self.heads.iter().copied().max().unwrap_or(1);
        largest_tensor(
            (self.window, heads, self.embed_dim, self.mlp_hidden),
            (self.num_feat, self.scale),
            scores_in_memory,
        )
    }

    /// Output pixels per input pixel of the convolution named `name`.
    fn conv_area(&self, name: &str) -> f64 {
        let s2 = (self.scale * self.scale) as f64;
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
            "conv_up3.weight" => 64.0,
            "conv_hr.weight" | "conv_last.weight" => s2,
            _ => 1.0,
        }
    }

    /// Infer the config from tensor names and shapes, then check every tensor against it.
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let name = "conv_first.weight";
        let cf = tensor(shapes, name)?;
        if cf.len() != 4 || cf[0] == 0 || cf[2] != 3 || cf[3] != 3 {
            return Err(ConfigError::shape(
                name,
                cf,
                "; a SwinIR model has [E, 3, 3, 3]",
            ));
        }
        let channels = cf[1];
        let embed_dim = cf[0];
        let SwinLayout {
            depths,
            window,
            heads,
        } = swin_layout(shapes, embed_dim)?;
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
        let (upsampler, num_feat, scale) = if shapes.contains_key("conv_up1.weight") {
            let f = width("conv_before_upsample.0.weight")?;
            // One nearest x2 and convolution per `conv_upK`.
            let scale = match (
                shapes.contains_key("conv_up2.weight"),
                shapes.contains_key("conv_up3.weight"),
            ) {
                (true, true) => 8,
                (true, false) => 4,
                _ => 2,
            };
            (Upsampler::NearestConv, f, scale)
        } else if shapes.contains_key("conv_before_upsample.0.weight") {
            let f = width("conv_before_upsample.0.weight")?;
            (Upsampler::PixelShuffle, f, pixel_shuffle_scale(shapes, f)?)
        } else if shapes.contains_key("upsample.0.weight") {
            let out = width("upsample.0.weight")?;
            let s = isqrt(out / 3);
            if s < 2 || 3 * s * s != out {
                return Err(ConfigError::DirectUpsampler(out));
            }
            (Upsampler::PixelShuffleDirect, 0, s)
        } else if shapes.contains_key("conv_last.weight") {
            (Upsampler::None, 0, 1)
        } else {
            return Err(ConfigError::NoUpsampler);
        };
        // Greyscale SwinIR models were released for denoising and JPEG only: their residual
        // tail is the one that takes any channel count.
        if channels != 3 && !(channels == 1 && upsampler == Upsampler::None) {
            return Err(ConfigError::NotRgb {
                arch: "SwinIR",
                channels,
            });
        }
        let cfg = SwinIrConfig {
            embed_dim,
            depths,
            heads,
            window,
            mlp_hidden,
            patch_norm: shapes.contains_key("patch_embed.norm.weight"),
            resi_connection,
            upsampler,
            num_feat,
            scale,
            // The reference loader's rule: only the JPEG models have window 7.
            img_range: if window == 7 { 255.0 } else { 1.0 },
            channels,
        };
        check_shapes(&cfg.expected_tensors(), shapes, UNEXPECTED_SWINIR)?;
        Ok(cfg)
    }
}

/// The convolution closing a residual group or the body: one 3x3 or the 3conv stack.
fn resi(cfg: &SwinIrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<AfterBody> {
    cfg.resi_connection.build(cfg.embed_dim, plan, vb)
}

/// Residual Swin Transformer block: Swin blocks, then the group's convolution, plus the input.
pub(crate) struct Rstb {
    blocks: Vec<SwinBlock>,
    conv: AfterBody,
}

impl Module for Rstb {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut t = x.clone();
        for b in &self.blocks {
            t = b.forward(&t)?;
        }
        add(&self.conv.forward(&t)?, x)
    }
}

/// SwinIR: the Swin frame around its residual Swin transformer blocks.
pub(crate) type SwinIr = SwinNet<Rstb>;

impl SwinIr {
    /// The network stored under `vb`, built as `plan` says (its channels never padded).
    pub fn new(cfg: &SwinIrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let e = cfg.embed_dim;
        let f = cfg.num_feat;
        let windows = WindowCache::new(cfg.window, vb.dtype(), vb.device());
        let build = |i: usize| -> Result<Rstb> {
            let (depth, heads) = (cfg.depths[i], cfg.heads[i]);
            let vb = vb.pp(format!("layers.{i}"));
            let blocks = (0..depth)
                .map(|j| {
                    let shape = BlockShape {
                        dim: e,
                        heads,
                        mlp_hidden: cfg.mlp_hidden,
                        window: cfg.window,
                        shifted: j % 2 == 1,
                    };
                    SwinBlock::with_shape(
                        shape,
                        &windows,
                        plan,
                        vb.pp(format!("residual_group.blocks.{j}")),
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Rstb {
                blocks,
                conv: resi(cfg, plan, vb.pp("conv"))?,
            })
        };
        let layers = build_layers(vb.device(), cfg.depths.len(), build)?;
        let tail = match cfg.upsampler {
            Upsampler::PixelShuffle => {
                let (e, f) = (Pad::OFF.one(e), Pad::OFF.one(f));
                let stages = cfg.upsample_stages();
                Tail::pixel_shuffle((&e, &f, cfg.num_feat), stages, Pad::OFF, plan, &vb)?
            }
            Upsampler::PixelShuffleDirect => Tail::direct(e, cfg.scale, plan, &vb)?,
            Upsampler::NearestConv => Tail::nearest_conv((e, f), cfg.scale, plan, &vb)?,
            Upsampler::None => Tail::residual((e, cfg.channels), plan, &vb)?,
        };
        let after_body = resi(cfg, plan, vb.pp("conv_after_body"))?;
        let frame = Frame::with_channels(
            (&Pad::OFF.one(e), cfg.patch_norm),
            (after_body, tail),
            (cfg.window, cfg.scale, cfg.channels),
            plan,
            &vb,
        )?
        .with_range(cfg.img_range);
        Ok(SwinNet::assemble(frame, layers, windows, Pad::OFF))
    }
}

/// SwinIR's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "SwinIR"
    }

    fn loads(&self) -> &'static str {
        "classical, lightweight and real-world x2/x3/x4 (real-world x8); colour and greyscale denoising and JPEG (x1)"
    }

    /// Residual groups of Swin blocks, without HAT's convolution and cross-attention blocks
    /// and without Swin2SR's SwinV2 attention.
    fn detect(&self, shapes: &Shapes) -> bool {
        swin_family(shapes) && !hat::has_hat_blocks(shapes) && !swin_v2(shapes)
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match SwinIrConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::SwinIr(Box::new(e))),
        }
    }
}

impl NetConfig for SwinIrConfig {
    /// Every tensor the network needs, with its shape: the single source of truth for
    /// validation and the parameter count.
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let e = self.embed_dim;
        let ws = self.window;
        let f = self.num_feat;
        let hid = self.mlp_hidden;
        let mut t: Vec<(String, Vec<usize>)> = Vec::new();
        let conv = |t: &mut Vec<(String, Vec<usize>)>, name: &str, cout, cin| {
            t.push((format!("{name}.weight"), vec![cout, cin, 3, 3]));
            t.push((format!("{name}.bias"), vec![cout]));
        };
        conv(&mut t, "conv_first", e, self.channels);
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
                push(
                    "attn.relative_position_bias_table",
                    vec![(2 * ws - 1) * (2 * ws - 1), heads],
                );
                push("attn.qkv.weight", vec![3 * e, e]);
                push("attn.qkv.bias", vec![3 * e]);
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
        }
        t.push(("norm.weight".into(), vec![e]));
        t.push(("norm.bias".into(), vec![e]));
        self.push_resi(&mut t, "conv_after_body");
        match self.upsampler {
            Upsampler::PixelShuffle => {
                conv(&mut t, "conv_before_upsample.0", f, e);
                for (i, r) in self.upsample_stages().iter().enumerate() {
                    conv(&mut t, &format!("upsample.{}", 2 * i), r * r * f, f);
                }
                conv(&mut t, "conv_last", 3, f);
            }
            Upsampler::PixelShuffleDirect => {
                conv(&mut t, "upsample.0", 3 * self.scale * self.scale, e);
            }
            Upsampler::NearestConv => {
                conv(&mut t, "conv_before_upsample.0", f, e);
                conv(&mut t, "conv_up1", f, f);
                if self.scale >= 4 {
                    conv(&mut t, "conv_up2", f, f);
                }
                if self.scale == 8 {
                    conv(&mut t, "conv_up3", f, f);
                }
                conv(&mut t, "conv_hr", f, f);
                conv(&mut t, "conv_last", 3, f);
            }
            Upsampler::None => conv(&mut t, "conv_last", self.channels, e),
        }
        t
    }

    /// Multiply-adds x2 of one forward pass over a padded `h x w` input (convolutions,
    /// linear layers and both attention products).
    fn flops(&self, h: usize, w: usize) -> f64 {
        let per_pixel: f64 = self
            .expected_tensors()
            .iter()
            .filter(|(name, s)| name.ends_with(".weight") && s.len() == 4)
            .map(|(name, s)| {
                // Convolutions run at the resolution their position implies.
                let area = self.conv_area(name);
                2.0 * area * s.iter().product::<usize>() as f64
            })
            .sum();
        let l = (h * w) as f64;
        let e = self.embed_dim as f64;
        let n = (self.window * self.window) as f64;
        let hid = self.mlp_hidden as f64;
        let blocks: usize = self.depths.iter().sum();
        let linear = 2.0 * (4.0 * e * e + 2.0 * e * hid) + 4.0 * n * e;
        l * (per_pixel + blocks as f64 * linear)
    }

    fn family(&self) -> &'static str {
        "SwinIR"
    }

    fn variant(&self) -> &'static str {
        SwinIrConfig::variant(self)
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
            "heads": uniform(&c.heads),
            "head_dims": uniform(&head_dims),
            "mlp_hidden": c.mlp_hidden,
            "num_feat": (c.num_feat > 0).then_some(c.num_feat),
            "patch_norm": c.patch_norm,
            "img_range": c.img_range,
            "channels": c.channels,
        })
    }

    fn greyscale(&self) -> bool {
        self.channels == 1
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
        SwinIrConfig::largest_tensor_per_pixel(self, scores_in_memory)
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(SwinIr::new(self, plan, vb)?))
    }
}
