//! PLKSR (Partial Large Kernel CNNs for Efficient Super-Resolution, Lee et al., 2024) in its
//! original form and in the "Real" form traiNNer-redux trains, inference only.
//!
//! RealPLKSR, as the released code defines it (`feats` is one `nn.Sequential`):
//!
//! ```text
//! t = feats.0(x)                               3x3, 3 -> F
//! for each block i in 1..=n:
//!   u = layer_norm(t)                          only in LayerNorm models (channels, eps 1e-6)
//!   u = conv(Mish(conv(u)))                    channel_mixer: 3x3 F -> 2F, 3x3 2F -> F
//!   u[:p] = lk(u[:p])                          a k x k convolution on the first p channels
//!   u = u · sigmoid(conv(u))                   attn (element-wise attention), if present
//!   u = refine(u)                              1x1
//!   t = GroupNorm(4)(u) + t                    LayerNorm models: u + t
//! (feats.(n+1) is a dropout, absent at inference)
//! y = feats.(n+2)(t) + repeat(x, s²)           3x3, F -> 3·s², plus each input channel
//!                                              repeated s² times (channel c·s² + k is x_c)
//! y = PixelShuffle(s)(y)                       so the input, upscaled nearest, is added
//! ```
//!
//! A DySample upsampler (`to_img.*`, [`DySample`]) replaces the pixel shuffle in some models:
//! it samples `y` (before any shuffle, its channels in the reference's order) at learned
//! points. The GroupNorm's 4 groups are not stored: 4 is what every release uses and what the
//! reference loader assumes.
//!
//! The original PLKSR differs in its blocks and nothing else: no norms, and its channel mixer
//! (spelt `channe_mixer` in its files) is one of three pairs with the exact GELU between,
//! told apart by the kernel sides the file holds: CCM (3x3 to 2F, 1x1 back), ICCM (1x1, 3x3)
//! or DCCM (3x3, 3x3). Its last convolution is `feats.(n+1)` (no dropout before it). The
//! large kernel is the plain partial one (`lk.conv`); the sparse and rectangular ablation
//! kernels of the paper (`lk.convs.*`, `lk.mn_conv`) are refused by name, and the identity
//! the large kernel can add in training code (`with_idt`) is off, as the reference loader
//! assumes: the file cannot tell.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::infer::{check_shapes, isqrt, out_width, tensor, ConfigError, Shapes};
use crate::nets::registry::Architecture;
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::conv::partial::PartialConv;
use crate::ops::conv::{pixel_shuffle_nhwc_reordered, Act, Conv3x3};
use crate::ops::dysample::DySample;
use crate::ops::linear::{pointwise_with, Dense};
use crate::ops::norm::group::{GroupNorm, GROUP_NORM_EPS};
use crate::ops::norm::{layer_norm, Norm};
use crate::ops::pad::Pad;
use crate::ops::{add, build_layers, LoadPlan};

/// The GroupNorm's groups: not in the file; every release and the reference use 4.
const NORM_GROUPS: usize = 4;
/// The LayerNorm's epsilon in the LayerNorm models.
const LAYER_NORM_EPS: f64 = 1e-6;
/// Image channels in and out: the reference builds RGB models only.
const CHANNELS: usize = 3;

/// The channel mixer opening each block, which also tells the two forms apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Mixer {
    /// RealPLKSR's: 3x3 to 2F, Mish, 3x3 back (`channel_mixer`); each block also has a
    /// GroupNorm or a LayerNorm.
    #[serde(rename = "real")]
    Real,
    /// The original's CCM: 3x3 to 2F, GELU, 1x1 back (`channe_mixer`).
    #[serde(rename = "CCM")]
    Ccm,
    /// The original's ICCM: 1x1 to 2F, GELU, 3x3 back.
    #[serde(rename = "ICCM")]
    Iccm,
    /// The original's DCCM: 3x3 to 2F, GELU, 3x3 back.
    #[serde(rename = "DCCM")]
    Dccm,
}

impl Mixer {
    /// The kernel sides of the mixer's two convolutions.
    fn kernels(self) -> (usize, usize) {
        match self {
            Self::Real | Self::Dccm => (3, 3),
            Self::Ccm => (3, 1),
            Self::Iccm => (1, 3),
        }
    }

    /// The name of the mixer in the state dict (the original's typo included).
    fn key(self) -> &'static str {
        match self {
            Self::Real => "channel_mixer",
            _ => "channe_mixer",
        }
    }

    fn original(self) -> bool {
        self != Self::Real
    }
}

/// PLKSR's or RealPLKSR's configuration, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlksrConfig {
    /// The channel mixer, which also says which form this is.
    pub mixer: Mixer,
    /// Feature channels (`dim`).
    pub features: usize,
    /// Blocks (`n_blocks`).
    pub blocks: usize,
    pub scale: usize,
    /// The large kernel's side (`kernel_size`).
    pub kernel: usize,
    /// The channels the large kernel convolves (`dim · split_ratio`).
    pub partial: usize,
    /// Whether the blocks have the element-wise attention (`use_ea`).
    pub attention: bool,
    /// Whether each block opens with a LayerNorm and drops its GroupNorm (`layer_norm`).
    pub layer_norm: bool,
    /// Whether the upsampler is DySample (`dysample`) rather than PixelShuffle.
    pub dysample: bool,
}

impl PlksrConfig {
    /// The index in `feats` of the last convolution: RealPLKSR has a dropout before it.
    fn last_index(&self) -> usize {
        self.blocks + if self.mixer.original() { 1 } else { 2 }
    }

    /// The configuration read from the tensor names and shapes, every tensor checked.
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let original = shapes.contains_key("feats.1.channe_mixer.0.weight");
        for (key, what) in [
            (
                "feats.1.lk.convs.0.weight",
                "PLKSR's sparse large kernel (SparsePLK)",
            ),
            (
                "feats.1.lk.mn_conv.weight",
                "PLKSR's rectangular sparse large kernel",
            ),
        ] {
            if shapes.contains_key(key) {
                return Err(ConfigError::Unsupported(what));
            }
        }
        let first = "feats.0.weight";
        let features = out_width(shapes, first)?;
        // The highest index in `feats` is the last convolution, after n blocks (and, in
        // RealPLKSR, a dropout).
        let highest = shapes
            .keys()
            .filter_map(|k| {
                k.strip_prefix("feats.")?
                    .split('.')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .max()
            .unwrap_or(0);
        // After the blocks: the last convolution, and RealPLKSR's dropout before it.
        let after = if original { 1 } else { 2 };
        if highest <= after {
            return Err(ConfigError::missing(
                &format!("feats.{}.weight", after + 1),
                " (no blocks)",
            ));
        }
        let blocks = highest - after;
        let mixer = if original {
            let kernel = |i: usize| {
                let name = format!("feats.1.channe_mixer.{i}.weight");
                tensor(shapes, &name).map(|s| (name, s.to_vec()))
            };
            let ((_, k0), (name, k2)) = (kernel(0)?, kernel(2)?);
            let side = |s: &[usize]| s.get(2).copied().unwrap_or(0);
            match (side(&k0), side(&k2)) {
                (3, 1) => Mixer::Ccm,
                (1, 3) => Mixer::Iccm,
                (3, 3) => Mixer::Dccm,
                (a, _) => {
                    return Err(ConfigError::shape(
                        &name,
                        &k2,
                        format!(
                            " after a {a}x{a} convolution: not a CCM, ICCM or DCCM channel mixer"
                        ),
                    ))
                }
            }
        } else {
            Mixer::Real
        };
        // Every block holds at least eight tensors: an index past what the file can hold is
        // a block that is missing (and would make the expected list as long as the index).
        if blocks * 8 > shapes.len() {
            let absent = (1..=blocks)
                .map(|i| format!("feats.{i}.{}.0.weight", mixer.key()))
                .find(|k| !shapes.contains_key(k))
                .unwrap_or_else(|| format!("feats.{blocks}.refine.weight"));
            return Err(ConfigError::missing(&absent, ""));
        }
        let last = format!("feats.{}.weight", blocks + after);
        let outputs = out_width(shapes, &last)?;
        let scale = isqrt(outputs / CHANNELS);
        if scale == 0 || scale * scale * CHANNELS != outputs {
            return Err(ConfigError::shape(
                &last,
                &shapes[&last],
                ": outputs are not 3 x scale²",
            ));
        }
        let lk = "feats.1.lk.conv.weight";
        let lk_shape = tensor(shapes, lk)?;
        let (partial, kernel) = match lk_shape {
            [p, _, k, _] => (*p, *k),
            _ => return Err(ConfigError::shape(lk, lk_shape, "; expected 4 dimensions")),
        };
        if kernel.is_multiple_of(2) || partial == 0 || partial > features {
            return Err(ConfigError::shape(
                lk,
                lk_shape,
                format!("; expected an odd kernel on 1 to {features} channels"),
            ));
        }
        let cfg = PlksrConfig {
            mixer,
            features,
            blocks,
            scale,
            kernel,
            partial,
            attention: shapes.contains_key("feats.1.attn.f.0.weight"),
            layer_norm: shapes.contains_key("feats.1.layer_norm.weight"),
            dysample: shapes.contains_key("to_img.init_pos"),
        };
        if mixer == Mixer::Real && !cfg.layer_norm && !features.is_multiple_of(NORM_GROUPS) {
            return Err(ConfigError::shape(
                "feats.1.norm.weight",
                &[features],
                format!(": GroupNorm's {NORM_GROUPS} groups need a multiple of {NORM_GROUPS}"),
            ));
        }
        let hint = if original {
            " (not a PLKSR tensor)"
        } else {
            " (not a RealPLKSR tensor)"
        };
        check_shapes(&cfg.expected_tensors(), shapes, hint)?;
        Ok(cfg)
    }

    /// DySample's groups: 4, or 3 at odd scales (the reference's choice).
    fn dysample_groups(&self) -> usize {
        if self.scale % 2 == 1 {
            CHANNELS
        } else {
            4
        }
    }
}

/// A convolution of the channel mixer: a 3x3 or a 1x1.
enum MixerConv {
    Three(Conv3x3),
    One(Dense),
}

impl MixerConv {
    fn new(k: usize, (cin, cout): (usize, usize), plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        Ok(if k == 1 {
            Self::One(pointwise_with(cin, cout, plan, vb)?)
        } else {
            Self::Three(Conv3x3::unpadded(cin, cout, plan, vb)?)
        })
    }

    /// `act` of the convolution of `x`, where possible as the outputs are written.
    fn forward_act(&self, x: &Tensor, act: Act) -> Result<Tensor> {
        match (self, act) {
            (Self::Three(c), act) => c.forward_act(x, act),
            (Self::One(d), Act::Gelu) => d.forward_gelu(x),
            (Self::One(d), act) => act.apply(&d.forward(x)?),
        }
    }
}

impl Module for MixerConv {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Three(c) => c.forward(x),
            Self::One(d) => d.forward(x),
        }
    }
}

/// One block (see the module's account).
struct Block {
    layer_norm: Option<Norm>,
    expand: MixerConv,
    /// The activation between the mixer's convolutions: Mish in RealPLKSR, else GELU.
    act: Act<'static>,
    reduce: MixerConv,
    lk: PartialConv,
    attention: Option<Conv3x3>,
    refine: Dense,
    norm: Option<GroupNorm>,
}

impl Block {
    fn new(cfg: &PlksrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let f = cfg.features;
        let conv = |cin, cout, vb| Conv3x3::unpadded(cin, cout, plan, vb);
        let (k0, k2) = cfg.mixer.kernels();
        let mixer = vb.pp(cfg.mixer.key());
        let real = cfg.mixer == Mixer::Real;
        Ok(Self {
            layer_norm: cfg
                .layer_norm
                .then(|| Norm::load(&Pad::OFF.one(f), LAYER_NORM_EPS, vb.pp("layer_norm")))
                .transpose()?,
            expand: MixerConv::new(k0, (f, 2 * f), plan, mixer.pp("0"))?,
            act: if real { Act::Mish } else { Act::Gelu },
            reduce: MixerConv::new(k2, (2 * f, f), plan, mixer.pp("2"))?,
            lk: PartialConv::new(cfg.partial, cfg.kernel, vb.pp("lk.conv"))?,
            attention: cfg
                .attention
                .then(|| conv(f, f, vb.pp("attn.f.0")))
                .transpose()?,
            refine: pointwise_with(f, f, plan, vb.pp("refine"))?,
            norm: (real && !cfg.layer_norm)
                .then(|| GroupNorm::new(f, NORM_GROUPS, GROUP_NORM_EPS, vb.pp("norm")))
                .transpose()?,
        })
    }
}

impl Module for Block {
    /// `x`: `(B, H, W, F)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let u = match &self.layer_norm {
            Some(norm) => layer_norm(norm, x)?,
            None => x.clone(),
        };
        let u = self.expand.forward_act(&u, self.act)?;
        let u = self.lk.forward(&self.reduce.forward(&u)?)?;
        let u = match &self.attention {
            Some(conv) => conv.forward_act(&u, Act::Modulate(&u))?,
            None => u,
        };
        let u = self.refine.forward(&u)?;
        match &self.norm {
            Some(norm) => norm.forward_residual(&u, x),
            None => add(&u, x),
        }
    }
}

pub struct RealPlksr {
    first: Conv3x3,
    blocks: Vec<Block>,
    /// The last convolution, its outputs in PixelShuffle's (i, j, c) order at scales above 1
    /// when no DySample follows it.
    last: Conv3x3,
    dysample: Option<DySample>,
    scale: usize,
    dtype: DType,
}

impl RealPlksr {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &PlksrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (f, s) = (cfg.features, cfg.scale);
        let vb_feats = vb.pp("feats");
        let blocks = build_layers(vb.device(), cfg.blocks, |i| {
            Block::new(cfg, plan, vb_feats.pp(i + 1))
        })?;
        let vb_last = vb_feats.pp(cfg.last_index());
        let up = CHANNELS * s * s;
        let last = if s == 1 || cfg.dysample {
            Conv3x3::unpadded(f, up, plan, vb_last)?
        } else {
            Conv3x3::shuffled(&Pad::OFF.one(f), (CHANNELS, s), Pad::OFF, plan, vb_last)?
        };
        let dysample = cfg
            .dysample
            .then(|| {
                let groups = cfg.dysample_groups();
                DySample::new((up, CHANNELS), (s, groups), s != 1, plan, vb.pp("to_img"))
            })
            .transpose()?;
        Ok(Self {
            first: Conv3x3::unpadded(CHANNELS, f, plan, vb_feats.pp(0))?,
            blocks,
            last,
            dysample,
            scale: s,
            dtype: vb.dtype(),
        })
    }
}

impl Net for RealPlksr {
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for RealPlksr {
    /// `x`: `(B, 3, H, W)` in [0, 1], any H and W; returns `(B, 3, sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x
            .to_dtype(self.dtype)?
            .permute((0, 2, 3, 1))?
            .contiguous()?;
        let mut t = self.first.forward(&x)?;
        for block in &self.blocks {
            t = block.forward(&t)?;
        }
        let s = self.scale;
        let (b, h, w, c) = x.dims4()?;
        let y = if let Some(dysample) = &self.dysample {
            // repeat_interleave: channel c·s² + k is the input's channel c.
            let repeated = x
                .unsqueeze(4)?
                .broadcast_as((b, h, w, c, s * s))?
                .reshape((b, h, w, c * s * s))?;
            dysample.forward(&self.last.forward_residual(&t, 1.0, &repeated)?)?
        } else if s == 1 {
            self.last.forward_residual(&t, 1.0, &x)?
        } else {
            // The input under each of PixelShuffle's s² positions, in the (i, j, c) order of
            // the last convolution's outputs.
            let repeated = x
                .unsqueeze(3)?
                .broadcast_as((b, h, w, s * s, c))?
                .reshape((b, h, w, s * s * c))?;
            let y = self.last.forward_residual(&t, 1.0, &repeated)?;
            pixel_shuffle_nhwc_reordered(&y, s)?
        };
        y.permute((0, 3, 1, 2))?.contiguous()
    }
}

/// RealPLKSR's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "RealPLKSR"
    }

    fn loads(&self) -> &'static str {
        "x1-x4, GroupNorm or LayerNorm, with or without its attention"
    }

    /// The first block's channel mixer (spelt right: PLKSR's own files say `channe_mixer`),
    /// large kernel and refinement.
    fn detect(&self, shapes: &Shapes) -> bool {
        [
            "feats.0.weight",
            "feats.1.channel_mixer.0.weight",
            "feats.1.lk.conv.weight",
        ]
        .iter()
        .all(|k| shapes.contains_key(*k))
            && shapes.contains_key("feats.1.refine.weight")
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        infer(shapes)
    }
}

fn infer(shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
    match PlksrConfig::infer(shapes) {
        Ok(c) => Ok(std::sync::Arc::new(c)),
        Err(e) => Err(ConfigError::Plksr(Box::new(e))),
    }
}

/// The original PLKSR's registry entry.
pub(crate) struct OriginalArch;

impl Architecture for OriginalArch {
    fn name(&self) -> &'static str {
        "PLKSR"
    }

    fn loads(&self) -> &'static str {
        "x1-x4, CCM, ICCM or DCCM, with or without its attention"
    }

    /// The first block's channel mixer under the original's name, and its refinement.
    fn detect(&self, shapes: &Shapes) -> bool {
        [
            "feats.0.weight",
            "feats.1.channe_mixer.0.weight",
            "feats.1.refine.weight",
        ]
        .iter()
        .all(|k| shapes.contains_key(*k))
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        infer(shapes)
    }
}

impl NetConfig for PlksrConfig {
    /// Every tensor the configuration implies, with its shape.
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (f, p, k) = (self.features, self.partial, self.kernel);
        let mut t = Vec::new();
        let layer = |t: &mut Vec<_>, name: String, weight: Vec<usize>| {
            t.push((format!("{name}.bias"), vec![weight[0]]));
            t.push((format!("{name}.weight"), weight));
        };
        layer(&mut t, "feats.0".into(), vec![f, CHANNELS, 3, 3]);
        for i in 1..=self.blocks {
            let b = format!("feats.{i}");
            if self.layer_norm {
                layer(&mut t, format!("{b}.layer_norm"), vec![f]);
            } else if !self.mixer.original() {
                layer(&mut t, format!("{b}.norm"), vec![f]);
            }
            let (m, (k0, k2)) = (self.mixer.key(), self.mixer.kernels());
            layer(&mut t, format!("{b}.{m}.0"), vec![2 * f, f, k0, k0]);
            layer(&mut t, format!("{b}.{m}.2"), vec![f, 2 * f, k2, k2]);
            layer(&mut t, format!("{b}.lk.conv"), vec![p, p, k, k]);
            if self.attention {
                layer(&mut t, format!("{b}.attn.f.0"), vec![f, f, 3, 3]);
            }
            layer(&mut t, format!("{b}.refine"), vec![f, f, 1, 1]);
        }
        let up = CHANNELS * self.scale * self.scale;
        layer(
            &mut t,
            format!("feats.{}", self.last_index()),
            vec![up, f, 3, 3],
        );
        if self.dysample {
            let offsets = 2 * self.dysample_groups() * self.scale * self.scale;
            layer(&mut t, "to_img.offset".into(), vec![offsets, up, 1, 1]);
            t.push(("to_img.scope.weight".into(), vec![offsets, up, 1, 1]));
            t.push(("to_img.init_pos".into(), vec![1, offsets, 1, 1]));
            if self.scale != 1 {
                layer(&mut t, "to_img.end_conv".into(), vec![CHANNELS, up, 1, 1]);
            }
        }
        t
    }

    /// The multiply-adds of the convolutions, x2 (norms and activations left out).
    fn flops(&self, h: usize, w: usize) -> f64 {
        let (f, p, k) = (self.features, self.partial, self.kernel);
        let attention = if self.attention { 9 * f * f } else { 0 };
        let (k0, k2) = self.mixer.kernels();
        let block = (k0 * k0 + k2 * k2) * f * 2 * f + k * k * p * p + attention + f * f;
        let (s2, up) = (self.scale * self.scale, CHANNELS * self.scale * self.scale);
        let mut per_pixel = 9 * CHANNELS * f + self.blocks * block + 9 * f * up;
        if self.dysample {
            // The offset and scope convolutions, and the end convolution on s² pixels.
            let offsets = 2 * self.dysample_groups() * s2;
            per_pixel += 2 * up * offsets + s2 * up * CHANNELS;
        }
        2.0 * (per_pixel * h * w) as f64
    }

    fn family(&self) -> &'static str {
        if self.mixer.original() {
            "PLKSR"
        } else {
            "RealPLKSR"
        }
    }

    fn variant(&self) -> &'static str {
        match self.mixer {
            Mixer::Ccm => return "PLKSR (CCM)",
            Mixer::Iccm => return "PLKSR (ICCM)",
            Mixer::Dccm => return "PLKSR (DCCM)",
            Mixer::Real => {}
        }
        match (self.layer_norm, self.dysample) {
            (false, false) => "RealPLKSR",
            (true, false) => "RealPLKSR (LayerNorm)",
            (false, true) => "RealPLKSR (DySample)",
            (true, true) => "RealPLKSR (LayerNorm, DySample)",
        }
    }

    fn scale(&self) -> usize {
        self.scale
    }

    fn window(&self) -> usize {
        1
    }

    fn describe(&self) -> serde_json::Value {
        json!({
            "scale": self.scale,
            "features": self.features,
            "blocks": self.blocks,
            "kernel": self.kernel,
            "partial_channels": self.partial,
            "channel_mixer": self.mixer,
            "attention": self.attention,
            "norm": match (self.mixer.original(), self.layer_norm) {
                (true, _) => "none",
                (false, true) => "layer",
                (false, false) => "group",
            },
            "upsampler": if self.dysample { "dysample" } else { "pixelshuffle" },
        })
    }

    fn largest_tensor_per_pixel(&self, _: bool, _: Pad) -> usize {
        let up = CHANNELS * self.scale * self.scale;
        let sampled = if self.dysample {
            up * self.scale * self.scale
        } else {
            0
        };
        (2 * self.features).max(up).max(sampled)
    }

    /// In a block: its input (the residual), the mixer's hidden map and output, the large
    /// kernel's copy and output, the attention's and the refinement's; at the end the last
    /// convolution's output, the repeated input and the shuffled copy.
    /// DySample's: its input and offsets, then its sampled map (`3 s²` channels at `s²`
    /// times the pixels), its end convolution's output beside it.
    fn activations_per_pixel(&self, _: bool, _: Pad) -> f64 {
        let f = self.features as f64;
        let s2 = (self.scale * self.scale) as f64;
        let up = CHANNELS as f64 * s2;
        let shuffle = (6.0 * f).max(f + 3.0 * up);
        if self.dysample {
            shuffle.max(up + 2.0 * up + s2 * (up + CHANNELS as f64))
        } else {
            shuffle
        }
    }

    /// The GroupNorm models: their norms take each map's mean and variance.
    fn whole_input_matters(&self) -> bool {
        !self.mixer.original() && !self.layer_norm
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(RealPlksr::new(self, plan, vb)?))
    }
}
