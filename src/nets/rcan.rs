//! RCAN (Residual Channel Attention Network, Zhang et al., 2018), inference only, as the
//! authors' code and traiNNer-redux's variant define it:
//!
//! ```text
//! x  = x reflect-padded (bottom, right) to a multiple of u, then, with the mean shift,
//!      sub_mean(255 x)                       a 1x1 convolution (minus the DIV2K mean)
//! x  = pixel-unshuffled by u                 (u = 1, or 2 and 4 for x2 and x1 models
//!                                            whose body runs at a quarter of the input)
//! f0 = head(x)                               3x3, C·u² -> F
//! t  = RG_G(... RG_1(f0))                    RG(t)   = conv(RCAB_B(... RCAB_1(t))) + t
//!                                            RCAB(t) = z · CA(z) + t,
//!                                            z       = conv(relu(conv(t)))
//!                                            CA(z)   = sigmoid(1x1(relu(1x1(mean_hw(z)))))
//! y  = conv(t) + f0
//! y  = (3x3 to 4F, PixelShuffle(2)) per doubling, or (3x3 to 9F, PixelShuffle(3))
//! y  = tail(y)                               3x3, F -> C
//! y  = add_mean(y) / 255                     with the mean shift; cropped to (sH, sW)
//! ```
//!
//! Every convolution has a bias. The channel attention pools the whole map, so tiles change
//! the output: the tile planner keeps images whole where it can. The mean shift's two 1x1
//! convolutions are read from the file (`sub_mean`, `add_mean`), the factor 255 folded into
//! them at load; a file without them has no shift and no scaling, as the reference runs it.
//! Like the reference loader, this reads the activation as ReLU and the residual scale as 1
//! (neither is in the weights).

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::{crop_nchw, padded_nhwc, pixel_unshuffle};
use crate::nets::infer::{check_shapes, out_width, tensor, ConfigError, Shapes};
use crate::nets::registry::Architecture;
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::conv::{Act, Conv3x3};
use crate::ops::gate::ChannelGate;
use crate::ops::linear::Dense;
use crate::ops::pad::Pad;
use crate::ops::{build_layers, LoadPlan};

/// The image range the mean shift works in: the input is multiplied by it first and the
/// output divided by it last.
const RGB_RANGE: f64 = 255.0;
/// The most doublings read (x16): more would be no released model.
const MAX_DOUBLINGS: usize = 4;

/// RCAN's configuration, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RcanConfig {
    pub scale: usize,
    /// Image channels (`n_colors`), in and out.
    pub colors: usize,
    /// Feature channels (`n_feats`).
    pub features: usize,
    /// Residual groups (`n_resgroups`).
    pub groups: usize,
    /// RCABs per group (`n_resblocks`).
    pub blocks: usize,
    /// Channels inside each channel attention (`n_feats / reduction`).
    pub squeeze: usize,
    /// The pixel-unshuffle factor of the input (1: none).
    pub unshuffle: usize,
    /// Whether the file has the mean shift (`sub_mean`, `add_mean`).
    pub mean_shift: bool,
}

impl RcanConfig {
    /// The upsampler's factor per step and its steps: the body's resolution times
    /// `scale · unshuffle`.
    fn upsampling(&self) -> (usize, usize) {
        match self.scale * self.unshuffle {
            3 => (3, 1),
            up => (2, up.trailing_zeros() as usize),
        }
    }

    fn head(&self) -> &'static str {
        if self.unshuffle > 1 {
            "head.1"
        } else {
            "head.0"
        }
    }

    /// The configuration read from the tensor names and shapes, every tensor checked. As the
    /// reference loader reads it: a second head entry means the input is pixel-unshuffled,
    /// by the square root of its channels over the output's, and the upsampler then
    /// quadruples.
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let unshuffled = shapes.contains_key("head.1.weight");
        let head = if unshuffled { "head.1" } else { "head.0" };
        let head_shape = tensor(shapes, &format!("{head}.weight"))?;
        if head_shape.len() != 4 || head_shape[2] != 3 || head_shape[3] != 3 {
            return Err(ConfigError::shape(
                &format!("{head}.weight"),
                head_shape,
                "; only RCANs with 3x3 convolutions run",
            ));
        }
        let features = head_shape[0];
        let colors = out_width(shapes, "tail.1.weight")?;
        let mut groups = 0;
        while shapes.contains_key(&format!("body.{groups}.body.0.body.0.weight")) {
            groups += 1;
        }
        let mut blocks = 0;
        while shapes.contains_key(&format!("body.0.body.{blocks}.body.0.weight")) {
            blocks += 1;
        }
        let mut steps = 0;
        while shapes.contains_key(&format!("tail.0.{}.weight", 2 * steps)) {
            steps += 1;
            if steps > MAX_DOUBLINGS {
                return Err(ConfigError::Unsupported(
                    "more than 4 upsampling convolutions",
                ));
            }
        }
        let first_up = out_width(shapes, "tail.0.0.weight")?;
        let up = if first_up == 9 * features && steps == 1 {
            3
        } else {
            1 << steps
        };
        let unshuffle = if unshuffled {
            let d = (1..=4)
                .find(|d| d * d * colors == head_shape[1])
                .filter(|&d| d > 1 && up == 4 && 4 % d == 0);
            d.ok_or_else(|| {
                ConfigError::shape(
                    "head.1.weight",
                    head_shape,
                    format!(
                        "; an unshuffled input of {colors} channels wants 4 or 16 times that \
                         and an x4 upsampler"
                    ),
                )
            })?
        } else {
            1
        };
        let squeeze = out_width(shapes, "body.0.body.0.body.3.conv_du.0.weight")?;
        let cfg = Self {
            scale: up / unshuffle,
            colors,
            features,
            groups,
            blocks,
            squeeze,
            unshuffle,
            mean_shift: shapes.contains_key("sub_mean.weight"),
        };
        check_shapes(
            &cfg.expected_tensors(),
            shapes,
            " (an RCAN variant this build does not run?)",
        )?;
        Ok(cfg)
    }
}

/// The tensors of a convolution `(cout, cin, k, k)` with its bias.
fn conv(t: &mut Vec<(String, Vec<usize>)>, name: &str, (cin, cout, k): (usize, usize, usize)) {
    t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
    t.push((format!("{name}.bias"), vec![cout]));
}

impl NetConfig for RcanConfig {
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (f, c, u) = (self.features, self.colors, self.unshuffle);
        let mut t = Vec::new();
        if self.mean_shift {
            conv(&mut t, "sub_mean", (3, 3, 1));
            conv(&mut t, "add_mean", (3, 3, 1));
        }
        conv(&mut t, self.head(), (c * u * u, f, 3));
        for g in 0..self.groups {
            for b in 0..self.blocks {
                let p = format!("body.{g}.body.{b}.body");
                conv(&mut t, &format!("{p}.0"), (f, f, 3));
                conv(&mut t, &format!("{p}.2"), (f, f, 3));
                conv(&mut t, &format!("{p}.3.conv_du.0"), (f, self.squeeze, 1));
                conv(&mut t, &format!("{p}.3.conv_du.2"), (self.squeeze, f, 1));
            }
            conv(&mut t, &format!("body.{g}.body.{}", self.blocks), (f, f, 3));
        }
        conv(&mut t, &format!("body.{}", self.groups), (f, f, 3));
        let (r, steps) = self.upsampling();
        for k in 0..steps {
            conv(&mut t, &format!("tail.0.{}", 2 * k), (f, r * r * f, 3));
        }
        conv(&mut t, "tail.1", (f, c, 3));
        t
    }

    /// The 3x3 convolutions' multiply-adds at the resolution each runs at (the body at
    /// `1 / u²` of the input's pixels); the gates and the mean shift are negligible.
    fn flops(&self, h: usize, w: usize) -> f64 {
        let (f, c, u) = (self.features, self.colors, self.unshuffle);
        let conv = |cin: usize, cout: usize| (9 * cin * cout) as f64;
        let body =
            conv(c * u * u, f) + (self.groups * (2 * self.blocks + 1) + 1) as f64 * conv(f, f);
        let (r, steps) = self.upsampling();
        let mut tail = 0.0;
        let mut area = 1.0;
        for _ in 0..steps {
            tail += area * conv(f, r * r * f);
            area *= (r * r) as f64;
        }
        tail += area * conv(f, c);
        2.0 * (body + tail) * (h * w) as f64 / (u * u) as f64
    }

    fn family(&self) -> &'static str {
        "RCAN"
    }

    fn variant(&self) -> &'static str {
        if self.unshuffle > 1 {
            "RCAN (pixel-unshuffled input)"
        } else {
            "RCAN"
        }
    }

    fn scale(&self) -> usize {
        self.scale
    }

    /// The unshuffle factor: the input is padded to its multiple.
    fn window(&self) -> usize {
        self.unshuffle
    }

    fn describe(&self) -> serde_json::Value {
        json!({
            "scale": self.scale,
            "colors": self.colors,
            "features": self.features,
            "groups": self.groups,
            "blocks": self.blocks,
            "reduction": self.features / self.squeeze.max(1),
            "unshuffle": self.unshuffle,
            "mean_shift": self.mean_shift,
        })
    }

    /// The upsampler's last output, `F` channels at the output's pixels (before or after
    /// its shuffle), per input pixel.
    fn largest_tensor_per_pixel(&self, _: bool, _: Pad) -> usize {
        let up = self.scale * self.unshuffle;
        (self.features * up * up / (self.unshuffle * self.unshuffle)).max(1)
    }

    /// The body holds `f0`, the group's and the block's inputs, the two convolutions'
    /// outputs and the sum; the tail peaks at its last convolution, `F` channels at the
    /// output's pixels and Winograd's transformed blocks of them (2.25 times as many). A
    /// whole process's peak at 256x256 measured 2776 (x4) and 748 (x2) f32 values per input
    /// pixel, the weights left out; these are 13-22% above.
    fn activations_per_pixel(&self, _: bool, _: Pad) -> f64 {
        let f = self.features as f64;
        let u2 = (self.unshuffle * self.unshuffle) as f64;
        let up = (self.scale * self.unshuffle) as f64;
        let body = 6.0 * f;
        let tail = 3.3 * f * up * up;
        body.max(tail) / u2
    }

    fn refusal(&self) -> Option<String> {
        if self.colors == 1 && self.mean_shift {
            // The reference's mean shift is a 3x3 1x1 convolution: it cannot run either.
            return Some("a greyscale RCAN model with an RGB mean shift".into());
        }
        (self.colors != 3 && self.colors != 1).then(|| {
            format!(
                "an RCAN model with {} image channels: only RGB (3) and greyscale (1) models run",
                self.colors
            )
        })
    }

    fn greyscale(&self) -> bool {
        self.colors == 1
    }

    /// Every block's channel attention takes its map's mean.
    fn whole_input_matters(&self) -> bool {
        true
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(Rcan::new(self, plan, vb)?))
    }
}

/// Residual channel attention block.
struct Rcab {
    conv1: Conv3x3,
    conv2: Conv3x3,
    attention: ChannelGate,
}

impl Module for Rcab {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let z = self.conv2.forward(&self.conv1.forward_act(x, Act::Relu)?)?;
        self.attention.forward_plus(&z, x)
    }
}

/// Residual group: RCABs, a convolution, plus the group's input.
struct Group {
    blocks: Vec<Rcab>,
    conv: Conv3x3,
}

impl Module for Group {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut t = x.clone();
        for block in &self.blocks {
            t = block.forward(&t)?;
        }
        self.conv.forward_residual(&t, 1.0, x)
    }
}

pub struct Rcan {
    /// `sub_mean` with the factor 255 folded in, and `add_mean` divided by it.
    shift: Option<(Dense, Dense)>,
    head: Conv3x3,
    groups: Vec<Group>,
    body: Conv3x3,
    /// The upsampler's convolutions, each followed by PixelShuffle by `up_factor`.
    ups: Vec<Conv3x3>,
    up_factor: usize,
    tail: Conv3x3,
    unshuffle: usize,
    scale: usize,
    dtype: DType,
}

/// A mean-shift 1x1 convolution stored under `vb`, its weight multiplied by `w_scale` and
/// its bias by `b_scale`.
fn mean_shift(vb: VarBuilder, (w_scale, b_scale): (f64, f64)) -> Result<Dense> {
    let w = vb.get((3, 3, 1, 1), "weight")?.reshape((3, 3))?;
    let b = vb.get(3, "bias")?;
    Dense::new((w * w_scale)?, (b * b_scale)?, &LoadPlan::default())
}

impl Rcan {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &RcanConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let f = cfg.features;
        let conv =
            |cin: usize, cout: usize, key: &str| Conv3x3::unpadded(cin, cout, plan, vb.pp(key));
        let groups = build_layers(vb.device(), cfg.groups, |g| {
            let blocks = (0..cfg.blocks)
                .map(|b| {
                    let p = vb.pp(format!("body.{g}.body.{b}.body"));
                    let ca = p.pp("3.conv_du");
                    Ok(Rcab {
                        conv1: Conv3x3::unpadded(f, f, plan, p.pp("0"))?,
                        conv2: Conv3x3::unpadded(f, f, plan, p.pp("2"))?,
                        attention: ChannelGate::new((f, cfg.squeeze), ca.pp("0"), ca.pp("2"))?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Group {
                blocks,
                conv: conv(f, f, &format!("body.{g}.body.{}", cfg.blocks))?,
            })
        })?;
        let (r, steps) = cfg.upsampling();
        let ups = (0..steps)
            .map(|k| {
                Conv3x3::shuffled_with_bias(
                    f,
                    (f, r),
                    true,
                    plan,
                    vb.pp(format!("tail.0.{}", 2 * k)),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let shift = cfg
            .mean_shift
            .then(|| -> Result<_> {
                Ok((
                    mean_shift(vb.pp("sub_mean"), (RGB_RANGE, 1.0))?,
                    mean_shift(vb.pp("add_mean"), (1.0 / RGB_RANGE, 1.0 / RGB_RANGE))?,
                ))
            })
            .transpose()?;
        let u2 = cfg.unshuffle * cfg.unshuffle;
        Ok(Self {
            shift,
            head: conv(cfg.colors * u2, f, cfg.head())?,
            groups,
            body: conv(f, f, &format!("body.{}", cfg.groups))?,
            ups,
            up_factor: r,
            tail: conv(f, cfg.colors, "tail.1")?,
            unshuffle: cfg.unshuffle,
            scale: cfg.scale,
            dtype: vb.dtype(),
        })
    }
}

impl Net for Rcan {
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for Rcan {
    /// `x`: `(B, C, H, W)` in [0, 1], any H and W; returns `(B, C, sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (x, (h, w)) = padded_nhwc(x, self.dtype, self.unshuffle)?;
        let mut x = x.contiguous()?;
        if let Some((sub, _)) = &self.shift {
            x = sub.forward(&x)?;
        }
        if self.unshuffle > 1 {
            x = pixel_unshuffle(&x, self.unshuffle)?;
        }
        let f0 = self.head.forward(&x)?;
        let mut t = f0.clone();
        for group in &self.groups {
            t = group.forward(&t)?;
        }
        let mut y = self.body.forward_residual(&t, 1.0, &f0)?;
        for up in &self.ups {
            y = up.forward_shuffled(&y, self.up_factor)?;
        }
        let mut y = self.tail.forward(&y)?;
        if let Some((_, add)) = &self.shift {
            y = add.forward(&y)?;
        }
        crop_nchw(&y, (h * self.scale, w * self.scale))
    }
}

/// RCAN's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "RCAN"
    }

    fn loads(&self) -> &'static str {
        "x1/x2 (unshuffled input), x2/x3/x4/x8"
    }

    /// The first block's channel attention, under the names RCAN's nested sequentials give
    /// it, which no other registered network has.
    fn detect(&self, shapes: &Shapes) -> bool {
        shapes.contains_key("body.0.body.0.body.3.conv_du.0.weight")
            && shapes.contains_key("tail.1.weight")
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match RcanConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::Rcan(Box::new(e))),
        }
    }
}
