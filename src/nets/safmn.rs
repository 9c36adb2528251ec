//! SAFMN (Spatially-Adaptive Feature Modulation Network, Sun et al., ICCV 2023), inference
//! only, as spandrel's `SAFMN` defines it and its model descriptor runs it:
//!
//! ```text
//! x  = x reflect-padded (bottom, right) to a multiple of 8
//! f  = to_feat(x)                            3x3, 3 -> D
//! t  = block_N(... block_1(f)) + f
//!      block(t):
//!        n = LayerNorm(t)                    eps 1e-6, over the channels
//!        s_0 = dwconv3x3(n_0)                n in four quarters of D/4 channels;
//!        s_i = nearest_{2^i}(dwconv3x3(maxpool_{2^i}(n_i)))   for i = 1, 2, 3
//!        t = GELU(1x1(cat(s))) · n + t       the aggregation
//!        t = 1x1(GELU(3x3(LayerNorm(t)))) + t    the convolutional channel mixer, D -> H -> D
//! y  = PixelShuffle(3x3(t)), cropped         3x3 to 3 s²
//! ```
//!
//! Every convolution has a bias. The pooling is adaptive max pooling to a 2^i-th of the map,
//! which on a multiple of 8 is plain `2^i x 2^i` max pooling: the reason the input is padded.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::{crop_nchw, nearest, padded_nhwc};
use crate::nets::infer::{check_shapes, out_width, tensor, ConfigError, Shapes};
use crate::nets::registry::Architecture;
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::conv::depthwise::Depthwise3x3;
use crate::ops::conv::{Act, Conv3x3};
use crate::ops::linear::{pointwise_with, Dense};
use crate::ops::norm::{layer_norm, Norm};
use crate::ops::pad::Pad;
use crate::ops::{add, build_layers, LoadPlan};

/// The LayerNorms' epsilon.
const EPS: f64 = 1e-6;
/// The scales the feature modulation pools to, each a quarter of the channels.
const LEVELS: usize = 4;
/// The multiple the input is padded to: the coarsest level pools `2^3 x 2^3` pixels.
const MULTIPLE: usize = 1 << (LEVELS - 1);

/// SAFMN's configuration, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SafmnConfig {
    pub scale: usize,
    /// Feature channels (`dim`).
    pub dim: usize,
    /// Feature modulation blocks (`n_blocks`).
    pub blocks: usize,
    /// The channel mixer's hidden width (`ffn_scale · dim`).
    pub hidden: usize,
}

impl SafmnConfig {
    /// The configuration read from the tensor names and shapes, every tensor checked, as the
    /// reference loader reads it.
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let stem = tensor(shapes, "to_feat.weight")?;
        if stem.len() != 4 || stem[1] != 3 || stem[0] == 0 || stem[0] % LEVELS != 0 {
            return Err(ConfigError::shape(
                "to_feat.weight",
                stem,
                "; expected a 3x3 convolution from RGB to a multiple of 4 channels",
            ));
        }
        let dim = stem[0];
        let mut blocks = 0;
        while shapes.contains_key(&format!("feats.{blocks}.norm1.weight")) {
            blocks += 1;
        }
        let hidden = out_width(shapes, "feats.0.ccm.ccm.0.weight")?;
        let out = out_width(shapes, "to_img.0.weight")?;
        let scale = crate::nets::infer::isqrt(out / 3);
        if scale == 0 || 3 * scale * scale != out || scale > 8 {
            return Err(ConfigError::shape(
                "to_img.0.weight",
                tensor(shapes, "to_img.0.weight")?,
                "; expected 3 s² outputs for a scale s of 1 to 8",
            ));
        }
        let cfg = Self {
            scale,
            dim,
            blocks,
            hidden,
        };
        check_shapes(
            &cfg.expected_tensors(),
            shapes,
            " (a SAFMN variant this build does not run?)",
        )?;
        Ok(cfg)
    }
}

/// The tensors of a convolution `(cout, cin, k, k)` with its bias.
fn conv(t: &mut Vec<(String, Vec<usize>)>, name: &str, (cin, cout, k): (usize, usize, usize)) {
    t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
    t.push((format!("{name}.bias"), vec![cout]));
}

impl NetConfig for SafmnConfig {
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (d, h, s) = (self.dim, self.hidden, self.scale);
        let mut t = Vec::new();
        conv(&mut t, "to_feat", (3, d, 3));
        for b in 0..self.blocks {
            let p = format!("feats.{b}");
            for norm in ["norm1", "norm2"] {
                t.push((format!("{p}.{norm}.weight"), vec![d]));
                t.push((format!("{p}.{norm}.bias"), vec![d]));
            }
            for i in 0..LEVELS {
                conv(&mut t, &format!("{p}.safm.mfr.{i}"), (1, d / LEVELS, 3));
            }
            conv(&mut t, &format!("{p}.safm.aggr"), (d, d, 1));
            conv(&mut t, &format!("{p}.ccm.ccm.0"), (d, h, 3));
            conv(&mut t, &format!("{p}.ccm.ccm.2"), (h, d, 1));
        }
        conv(&mut t, "to_img.0", (d, 3 * s * s, 3));
        t
    }

    /// The convolutions' multiply-adds a pixel (the depthwise ones at each level's
    /// resolution); norms, pooling and activations left out.
    fn flops(&self, h: usize, w: usize) -> f64 {
        let (d, hid, s) = (self.dim, self.hidden, self.scale);
        let levels: f64 = (0..LEVELS).map(|i| 1.0 / 4f64.powi(i as i32)).sum();
        let block = 9.0 * (d / LEVELS) as f64 * levels + (d * d + 9 * d * hid + hid * d) as f64;
        let per_pixel = (27 * d) as f64 + self.blocks as f64 * block + (9 * d * 3 * s * s) as f64;
        2.0 * per_pixel * (h * w) as f64
    }

    fn family(&self) -> &'static str {
        "SAFMN"
    }

    fn variant(&self) -> &'static str {
        match (self.dim, self.blocks) {
            (36, 8) => "SAFMN",
            (128, 16) => "SAFMN-L",
            _ => "SAFMN (custom)",
        }
    }

    fn scale(&self) -> usize {
        self.scale
    }

    fn window(&self) -> usize {
        MULTIPLE
    }

    fn describe(&self) -> serde_json::Value {
        json!({
            "scale": self.scale,
            "dim": self.dim,
            "blocks": self.blocks,
            "hidden": self.hidden,
        })
    }

    /// The channel mixer's hidden layer, or the output convolution's map before its shuffle.
    fn largest_tensor_per_pixel(&self, _: bool, _: Pad) -> usize {
        self.hidden.max(3 * self.scale * self.scale).max(self.dim)
    }

    /// A block holds its input, the norm, the four levels and their concatenation, the
    /// aggregation and the sum, then the mixer's hidden layer.
    fn activations_per_pixel(&self, _: bool, _: Pad) -> f64 {
        let (d, h) = (self.dim as f64, self.hidden as f64);
        let s2 = (self.scale * self.scale) as f64;
        (7.0 * d + 2.0 * h).max(2.0 * d + 6.0 * s2)
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(Safmn::new(self, plan, vb)?))
    }
}

/// `x` `(B, H, W, C)` max-pooled over `r x r` blocks (`H`, `W` multiples of `r`).
fn max_pool(x: &Tensor, r: usize) -> Result<Tensor> {
    let (b, h, w, c) = x.dims4()?;
    x.reshape((b, h / r, r, w / r, r, c))?.max(4)?.max(2)
}

struct Block {
    norm1: Norm,
    /// Each level's depthwise convolution.
    levels: Vec<Depthwise3x3>,
    aggr: Dense,
    norm2: Norm,
    mix: Conv3x3,
    out: Dense,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = layer_norm(&self.norm1, x)?;
        let quarter = n.dim(3)? / LEVELS;
        let mut parts = Vec::with_capacity(LEVELS);
        for (i, conv) in self.levels.iter().enumerate() {
            let part = n.narrow(3, i * quarter, quarter)?.contiguous()?;
            parts.push(match i {
                0 => conv.forward_gelu_if(&part, false)?,
                _ => {
                    let r = 1 << i;
                    nearest(&conv.forward_gelu_if(&max_pool(&part, r)?, false)?, r)?
                }
            });
        }
        let aggregated = self.aggr.forward_gelu(&Tensor::cat(&parts, 3)?)?;
        let t = add(&(aggregated * &n)?, x)?;
        let hidden = self
            .mix
            .forward_act(&layer_norm(&self.norm2, &t)?, Act::Gelu)?;
        self.out.forward_residual(&hidden, &t)
    }
}

pub struct Safmn {
    to_feat: Conv3x3,
    blocks: Vec<Block>,
    to_img: Conv3x3,
    scale: usize,
    dtype: DType,
}

impl Safmn {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &SafmnConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (d, h, s) = (cfg.dim, cfg.hidden, cfg.scale);
        let blocks = build_layers(vb.device(), cfg.blocks, |b| {
            let vb = vb.pp(format!("feats.{b}"));
            Ok(Block {
                norm1: Norm::load(&Pad::OFF.one(d), EPS, vb.pp("norm1"))?,
                levels: (0..LEVELS)
                    .map(|i| Depthwise3x3::load(d / LEVELS, true, vb.pp(format!("safm.mfr.{i}"))))
                    .collect::<Result<_>>()?,
                aggr: pointwise_with(d, d, plan, vb.pp("safm.aggr"))?,
                norm2: Norm::load(&Pad::OFF.one(d), EPS, vb.pp("norm2"))?,
                mix: Conv3x3::unpadded(d, h, plan, vb.pp("ccm.ccm.0"))?,
                out: pointwise_with(h, d, plan, vb.pp("ccm.ccm.2"))?,
            })
        })?;
        Ok(Self {
            to_feat: Conv3x3::unpadded(3, d, plan, vb.pp("to_feat"))?,
            blocks,
            to_img: Conv3x3::shuffled_with_bias(d, (3, s), true, plan, vb.pp("to_img.0"))?,
            scale: s,
            dtype: vb.dtype(),
        })
    }
}

impl Net for Safmn {
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for Safmn {
    /// `x`: `(B, 3, H, W)` in [0, 1], any H and W; returns `(B, 3, sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (x, (h, w)) = padded_nhwc(x, self.dtype, MULTIPLE)?;
        let x = x.contiguous()?;
        let f = self.to_feat.forward(&x)?;
        let mut t = f.clone();
        for block in &self.blocks {
            t = block.forward(&t)?;
        }
        let y = self.to_img.forward_shuffled(&add(&t, &f)?, self.scale)?;
        crop_nchw(&y, (h * self.scale, w * self.scale))
    }
}

/// SAFMN's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "SAFMN"
    }

    fn loads(&self) -> &'static str {
        "SAFMN and SAFMN-L, any width and depth"
    }

    /// The feature modulation's level convolutions under `feats.N.safm`.
    fn detect(&self, shapes: &Shapes) -> bool {
        shapes.contains_key("to_feat.weight") && shapes.contains_key("feats.0.safm.mfr.0.weight")
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match SafmnConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::Safmn(Box::new(e))),
        }
    }
}
