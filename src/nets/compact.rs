//! Real-ESRGAN Compact (SRVGGNetCompact, Wang et al., 2021), inference only.
//!
//! The network, as the released code defines it:
//!
//! ```text
//! y = act(body.0(x))                       3x3, C -> F
//! for each k in 1..=n:  y = act(body.2k(y))  3x3, F -> F
//! y = PixelShuffle(s)(body.(2n+2)(y))      3x3, F -> C·s²
//! y = y + nearest_s(x)                     the network learns the residual of the
//!                                          nearest-neighbour upscale
//! ```
//!
//! The activation is one of three, the same everywhere: PReLU with one slope per feature
//! channel (`body.(2k+1).weight`, shape `[F]`; every released model), ReLU, or LeakyReLU with
//! slope 0.1. The last two hold no weights, so a file cannot tell them apart; the reference
//! loader (spandrel, like Real-ESRGAN's own inference script) builds every Compact model with
//! PReLU and refuses a file without its weights. Such files are read here as ReLU (the first
//! of the reference class's options), and `info` says so ([`Activation::Relu`]).

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::nearest;
use crate::nets::infer::{check_shapes, isqrt, out_width, tensor, ConfigError, Shapes};
use crate::nets::registry::Architecture;
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::add;
use crate::ops::conv::{Act as ConvAct, Conv3x3};
use crate::ops::pad::Pad;
use crate::ops::{build_layers, LoadPlan};

/// The reference's LeakyReLU slope (`act_type="leakyrelu"`).
const LEAKY_SLOPE: f64 = 0.1;

/// The activation after every convolution but the last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Activation {
    /// One learned slope per feature channel for negative inputs (`body.(2k+1).weight`).
    #[serde(rename = "prelu")]
    PRelu,
    /// What a file without PReLU weights is read as: ReLU and LeakyReLU leave no weights
    /// to tell them apart by.
    #[serde(rename = "relu (assumed: no PReLU weights)")]
    Relu,
    /// LeakyReLU, slope 0.1; never inferred (see [`Activation::Relu`]), built when a
    /// configuration names it.
    #[serde(rename = "leakyrelu")]
    #[cfg_attr(not(test), allow(dead_code))]
    LeakyRelu,
}

/// SRVGGNetCompact's configuration, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CompactConfig {
    /// Image channels in and out.
    pub channels: usize,
    /// Feature channels (`num_feat`).
    pub features: usize,
    /// Convolutions between the first and the last (`num_conv`).
    pub convs: usize,
    pub activation: Activation,
    pub scale: usize,
}

impl CompactConfig {
    /// The index of the last convolution in `body`.
    fn last(&self) -> usize {
        2 * self.convs + 2
    }

    /// The configuration read from the tensor names and shapes, every tensor checked.
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        // The highest index in `body` is the last convolution.
        let mut last = 0;
        for key in shapes.keys() {
            let index = key
                .strip_prefix("body.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|i| i.parse::<usize>().ok());
            match index {
                Some(i) => last = last.max(i),
                None => {
                    return Err(ConfigError::Unexpected {
                        name: key.clone(),
                        hint: " (a Compact model holds body.N tensors only)",
                    })
                }
            }
        }
        let last_name = format!("body.{last}.weight");
        if last < 2 || last % 2 == 1 {
            return Err(ConfigError::shape(
                &last_name,
                shapes.get(&last_name).map_or(&[][..], Vec::as_slice),
                "; the last layer of a Compact model is a convolution at an even index from 2",
            ));
        }
        let features = out_width(shapes, "body.0.weight")?;
        let channels = tensor(shapes, "body.0.weight")?[1];
        let outputs = out_width(shapes, &last_name)?;
        // The nearest-upscaled input is added to the output: both have the input's channels.
        let scale = isqrt(outputs / channels.max(1));
        if channels == 0 || scale == 0 || scale * scale * channels != outputs {
            return Err(ConfigError::shape(
                &last_name,
                tensor(shapes, &last_name)?,
                format!(": not {channels} x scale^2 outputs (the input's channels, shuffled)"),
            ));
        }
        // Each convolution in between must be there: a crafted index far beyond the rest is
        // refused at the first gap, before any list of its length is made.
        for k in 1..=(last - 2) / 2 {
            tensor(shapes, &format!("body.{}.weight", 2 * k))?;
        }
        let activation = if shapes.contains_key("body.1.weight") {
            Activation::PRelu
        } else {
            Activation::Relu
        };
        let cfg = CompactConfig {
            channels,
            features,
            convs: (last - 2) / 2,
            activation,
            scale,
        };
        check_shapes(&cfg.expected_tensors(), shapes, "")?;
        Ok(cfg)
    }
}

/// The activation of one layer, with its weights where it has any.
enum Act {
    /// `max(x, 0) + slope · min(x, 0)`, `slope` `(F)` broadcast over the channels-last axis.
    PRelu(Tensor),
    Relu,
    LeakyRelu,
}

impl Act {
    fn new(kind: Activation, features: usize, vb: VarBuilder) -> Result<Self> {
        Ok(match kind {
            Activation::PRelu => Self::PRelu(vb.get(features, "weight")?),
            Activation::Relu => Self::Relu,
            Activation::LeakyRelu => Self::LeakyRelu,
        })
    }
}

impl Act {
    /// The activation as the convolution before it applies it.
    fn of_conv(&self) -> ConvAct<'_> {
        match self {
            Self::PRelu(slope) => ConvAct::PRelu(slope),
            Self::Relu => ConvAct::Relu,
            Self::LeakyRelu => ConvAct::Leaky(LEAKY_SLOPE as f32),
        }
    }
}

pub struct Compact {
    /// Every convolution but the last, each with its activation.
    layers: Vec<(Conv3x3, Act)>,
    /// The last convolution, shuffled by `scale` (plain at scale 1).
    last: Conv3x3,
    scale: usize,
    dtype: DType,
}

impl Compact {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &CompactConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (c, f, s) = (cfg.channels, cfg.features, cfg.scale);
        // In parallel on the CPU: each convolution reorders its weights.
        let layers = build_layers(vb.device(), cfg.convs + 1, |k| {
            let cin = if k == 0 { c } else { f };
            let conv = Conv3x3::unpadded(cin, f, plan, vb.pp(format!("body.{}", 2 * k)))?;
            let act = Act::new(cfg.activation, f, vb.pp(format!("body.{}", 2 * k + 1)))?;
            Ok((conv, act))
        })?;
        let vb_last = vb.pp(format!("body.{}", cfg.last()));
        let last = if s == 1 {
            Conv3x3::unpadded(f, c, plan, vb_last)?
        } else {
            Conv3x3::shuffled(&Pad::OFF.one(f), (c, s), Pad::OFF, plan, vb_last)?
        };
        Ok(Self {
            layers,
            last,
            scale: s,
            dtype: vb.dtype(),
        })
    }
}

impl Net for Compact {
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for Compact {
    /// `x`: `(B, C, H, W)` in [0, 1], any H and W; returns `(B, C, sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x
            .to_dtype(self.dtype)?
            .permute((0, 2, 3, 1))?
            .contiguous()?;
        let mut y = x.clone();
        for (conv, act) in &self.layers {
            y = conv.forward_act(&y, act.of_conv())?;
        }
        let y = if self.scale == 1 {
            self.last.forward(&y)?
        } else {
            self.last.forward_shuffled(&y, self.scale)?
        };
        let y = add(&y, &nearest(&x, self.scale)?)?;
        y.permute((0, 3, 1, 2))?.contiguous()
    }
}

/// Compact's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "Compact"
    }

    fn loads(&self) -> &'static str {
        "Real-ESRGAN SRVGGNetCompact, x1-x4"
    }

    /// `body.0` and no `conv_first` (every other registered network has one), nor ESRGAN's
    /// dense blocks under `body.N.rdbK`.
    fn detect(&self, shapes: &Shapes) -> bool {
        shapes.contains_key("body.0.weight")
            && !shapes.contains_key("conv_first.weight")
            && !shapes.keys().any(|k| k.starts_with("body.0.rdb"))
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match CompactConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::Compact(Box::new(e))),
        }
    }
}

impl NetConfig for CompactConfig {
    /// Every tensor the configuration implies, with its shape.
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (c, f) = (self.channels, self.features);
        let mut t = Vec::new();
        let mut conv = |i: usize, cout: usize, cin: usize| {
            t.push((format!("body.{i}.weight"), vec![cout, cin, 3, 3]));
            t.push((format!("body.{i}.bias"), vec![cout]));
            if self.activation == Activation::PRelu && i < self.last() {
                t.push((format!("body.{}.weight", i + 1), vec![f]));
            }
        };
        conv(0, f, c);
        for k in 1..=self.convs {
            conv(2 * k, f, f);
        }
        conv(self.last(), c * self.scale * self.scale, f);
        t
    }

    fn flops(&self, h: usize, w: usize) -> f64 {
        let per_pixel: f64 = self
            .expected_tensors()
            .iter()
            .filter(|(_, s)| s.len() == 4)
            .map(|(_, s)| 2.0 * s.iter().product::<usize>() as f64)
            .sum();
        per_pixel * (h * w) as f64
    }

    fn family(&self) -> &'static str {
        "Compact"
    }

    fn variant(&self) -> &'static str {
        "Real-ESRGAN Compact (SRVGGNetCompact)"
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
            "channels": self.channels,
            "features": self.features,
            "convs": self.convs,
            "activation": self.activation,
        })
    }

    fn largest_tensor_per_pixel(&self, _: bool, _: Pad) -> usize {
        self.features
            .max(self.channels * self.scale * self.scale)
            .max(1)
    }

    /// A layer's input, its convolution's output and PReLU's two halves and sum; then the
    /// shuffled output, the upscaled input and their sum.
    fn activations_per_pixel(&self, _: bool, _: Pad) -> f64 {
        let f = self.features as f64;
        let s2 = (self.scale * self.scale) as f64;
        (5.0 * f).max(f + 3.0 * self.channels as f64 * s2)
    }

    fn refusal(&self) -> Option<String> {
        (self.channels != 3 && self.channels != 1).then(|| {
            format!(
                "a Compact model with {} channels: only RGB (3) and greyscale (1) models run",
                self.channels
            )
        })
    }

    fn greyscale(&self) -> bool {
        self.channels == 1
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(Compact::new(self, plan, vb)?))
    }
}
