//! MoSR (MambaOut super-resolution, traiNNer-redux), inference only, as spandrel's `MoSR`
//! defines it:
//!
//! ```text
//! t  = gblocks.0(x)                          3x3, C -> D
//! for each GatedCNN block:                   LayerNorm (eps 1e-6) over the channels, then
//!     g, i, c = split(fc1(norm(t)))          3x3 D -> 2H, split H, H - K, K
//!     c = dwconv(c)                          depthwise k x k (7 in the releases), with bias
//!     t = Mish(fc2(Mish(g) · cat(i, c))) + t - 0.5      fc2: 3x3 H -> D
//! t  = 1x1(Mish(3x3(Mish(3x3(t)))))          D -> 2D -> D -> D
//! s  = Mish(3x3(Mish(3x3(x)))) + 1x1(x)      the shortcut (ConvBlock), C -> D
//! y  = upsampler(t + s - 0.5)                PixelShuffle ("ps": 3x3 to C s², shuffle),
//!                                            "gps" (3x3 to 8 C s², the 8 groups averaged,
//!                                            shuffle) or DySample ("dys", 4 groups)
//! ```
//!
//! "gps" averages eight convolutions' outputs: that is one convolution with the eight
//! weights averaged, made so at load. The depthwise convolution runs on our CPU kernel
//! ([`depthwise_kxk`]) in f32 on the CPU, elsewhere on candle's grouped convolution.

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::infer::{check_shapes, isqrt, out_width, tensor, ConfigError, Shapes};
use crate::nets::registry::Architecture;
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::conv::{Act, Conv3x3};
use crate::ops::cpu::depthwise::depthwise_kxk;
use crate::ops::cpu::mish_gate;
use crate::ops::dysample::DySample;
use crate::ops::linear::{pointwise_with, Dense};
use crate::ops::norm::{layer_norm, Norm};
use crate::ops::pad::Pad;
use crate::ops::{add, build_layers, LoadPlan};

/// The blocks' LayerNorm epsilon.
const NORM_EPS: f64 = 1e-6;
/// What each block and the shortcut subtract from their sums.
const SHIFT: f64 = 0.5;
/// "gps": the groups of outputs its convolution averages.
const GPS_GROUPS: usize = 8;
/// DySample's groups in MoSR (the reference's default).
const DYSAMPLE_GROUPS: usize = 4;

/// The upsampler after the body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Upsampler {
    /// A 3x3 convolution and PixelShuffle (`upsampler.0`).
    #[serde(rename = "ps")]
    PixelShuffle,
    /// "Geo ensemble PixelShuffle": a 3x3 convolution to eight groups, averaged, then
    /// PixelShuffle (`upsampler.in_to_k`).
    #[serde(rename = "gps")]
    Gps,
    /// DySample (`upsampler.offset`, `scope`, `end_conv`, `init_pos`).
    #[serde(rename = "dys")]
    DySample,
}

/// MoSR's configuration, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MosrConfig {
    pub scale: usize,
    pub in_channels: usize,
    pub out_channels: usize,
    /// Feature channels (`dim`).
    pub dim: usize,
    /// GatedCNN blocks (`n_block`).
    pub blocks: usize,
    /// The gated width (`expansion_ratio · dim`).
    pub hidden: usize,
    /// Channels through the depthwise convolution (`conv_ratio · dim`).
    pub conv_channels: usize,
    /// The depthwise convolution's kernel.
    pub kernel: usize,
    pub upsampler: Upsampler,
}

impl MosrConfig {
    /// The configuration read from the tensor names and shapes, every tensor checked, as the
    /// reference loader reads it.
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let stem = tensor(shapes, "gblocks.0.weight")?;
        if stem.len() != 4 || stem[2] != 3 {
            return Err(ConfigError::shape(
                "gblocks.0.weight",
                stem,
                "; expected a 3x3 convolution",
            ));
        }
        let (dim, in_channels) = (stem[0], stem[1]);
        let mut blocks = 0;
        while shapes.contains_key(&format!("gblocks.{}.fc1.weight", blocks + 1)) {
            blocks += 1;
        }
        let hidden = out_width(shapes, "gblocks.1.fc1.weight")? / 2;
        let conv = tensor(shapes, "gblocks.1.conv.weight")?;
        let (conv_channels, kernel) = match conv {
            [c, 1, k, k2] if k == k2 => (*c, *k),
            _ => (0, 0),
        };
        if conv_channels == 0 || conv_channels > hidden || kernel.is_multiple_of(2) {
            return Err(ConfigError::shape(
                "gblocks.1.conv.weight",
                conv,
                format!("; a depthwise convolution of at most {hidden} channels, odd kernel"),
            ));
        }
        let (upsampler, out_channels, scale) = if shapes.contains_key("upsampler.init_pos") {
            let out = out_width(shapes, "upsampler.end_conv.weight")?;
            let offsets = out_width(shapes, "upsampler.offset.weight")?;
            let s = isqrt(offsets / (2 * DYSAMPLE_GROUPS));
            (Upsampler::DySample, out, s)
        } else if shapes.contains_key("upsampler.in_to_k.weight") {
            let n = out_width(shapes, "upsampler.in_to_k.weight")?;
            (
                Upsampler::Gps,
                in_channels,
                isqrt(n / GPS_GROUPS / in_channels.max(1)),
            )
        } else {
            let n = out_width(shapes, "upsampler.0.weight")?;
            (
                Upsampler::PixelShuffle,
                in_channels,
                isqrt(n / in_channels.max(1)),
            )
        };
        if scale == 0 {
            return Err(ConfigError::Unsupported("an upsampler to no pixels"));
        }
        let cfg = Self {
            scale,
            in_channels,
            out_channels,
            dim,
            blocks,
            hidden,
            conv_channels,
            kernel,
            upsampler,
        };
        check_shapes(
            &cfg.expected_tensors(),
            shapes,
            " (a MoSR variant this build does not run?)",
        )?;
        Ok(cfg)
    }
}

/// The tensors of a convolution `(cout, cin, k, k)` with its bias.
fn conv(t: &mut Vec<(String, Vec<usize>)>, name: &str, (cin, cout, k): (usize, usize, usize)) {
    t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
    t.push((format!("{name}.bias"), vec![cout]));
}

impl NetConfig for MosrConfig {
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (c, d, h, n) = (self.in_channels, self.dim, self.hidden, self.blocks);
        let (o, s) = (self.out_channels, self.scale);
        let mut t = Vec::new();
        conv(&mut t, "gblocks.0", (c, d, 3));
        for b in 1..=n {
            let p = format!("gblocks.{b}");
            t.push((format!("{p}.norm.weight"), vec![d]));
            t.push((format!("{p}.norm.bias"), vec![d]));
            conv(&mut t, &format!("{p}.fc1"), (d, 2 * h, 3));
            t.push((
                format!("{p}.conv.weight"),
                vec![self.conv_channels, 1, self.kernel, self.kernel],
            ));
            t.push((format!("{p}.conv.bias"), vec![self.conv_channels]));
            conv(&mut t, &format!("{p}.fc2"), (h, d, 3));
        }
        conv(&mut t, &format!("gblocks.{}", n + 1), (d, 2 * d, 3));
        conv(&mut t, &format!("gblocks.{}", n + 3), (2 * d, d, 3));
        conv(&mut t, &format!("gblocks.{}", n + 5), (d, d, 1));
        conv(&mut t, "shortcut.block.0", (c, d, 3));
        conv(&mut t, "shortcut.block.2", (d, d, 3));
        conv(&mut t, "shortcut.conv11", (c, d, 1));
        match self.upsampler {
            Upsampler::PixelShuffle => conv(&mut t, "upsampler.0", (d, o * s * s, 3)),
            Upsampler::Gps => conv(&mut t, "upsampler.in_to_k", (d, GPS_GROUPS * o * s * s, 3)),
            Upsampler::DySample => {
                let oc = 2 * DYSAMPLE_GROUPS * s * s;
                conv(&mut t, "upsampler.end_conv", (d, o, 1));
                conv(&mut t, "upsampler.offset", (d, oc, 1));
                t.push(("upsampler.scope.weight".into(), vec![oc, d, 1, 1]));
                t.push(("upsampler.init_pos".into(), vec![1, oc, 1, 1]));
            }
        }
        t
    }

    /// The convolutions' multiply-adds a pixel (the upsampler's at the input's resolution);
    /// the norms, activations and DySample's sampling are left out.
    fn flops(&self, h: usize, w: usize) -> f64 {
        let (c, d, hid) = (self.in_channels, self.dim, self.hidden);
        let k2 = self.kernel * self.kernel;
        let block = 9 * d * 2 * hid + k2 * self.conv_channels + 9 * hid * d;
        let up = match self.upsampler {
            Upsampler::PixelShuffle | Upsampler::Gps => {
                9 * d * self.out_channels * self.scale.pow(2)
            }
            Upsampler::DySample => {
                d * (4 * DYSAMPLE_GROUPS * self.scale.pow(2) + self.out_channels)
            }
        };
        let per_pixel = 9 * c * d
            + self.blocks * block
            + 9 * d * 2 * d * 2
            + d * d
            + 9 * c * d
            + 9 * d * d
            + c * d
            + up;
        2.0 * (per_pixel * h * w) as f64
    }

    fn family(&self) -> &'static str {
        "MoSR"
    }

    fn variant(&self) -> &'static str {
        match self.upsampler {
            Upsampler::PixelShuffle => "MoSR",
            Upsampler::Gps => "MoSR (GPS upsampler)",
            Upsampler::DySample => "MoSR (DySample upsampler)",
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
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "dim": self.dim,
            "blocks": self.blocks,
            "hidden": self.hidden,
            "conv_channels": self.conv_channels,
            "kernel": self.kernel,
            "upsampler": self.upsampler,
        })
    }

    /// The blocks' `fc1` output (2H channels), or the upsampler's before its shuffle.
    fn largest_tensor_per_pixel(&self, _: bool, _: Pad) -> usize {
        let up = self.out_channels * self.scale.pow(2);
        (2 * self.hidden).max(2 * self.dim).max(up)
    }

    /// A block holds its input, the norm's output, `fc1`'s, the gated product and `fc2`'s,
    /// beside the shortcut; the depthwise convolution copies its channels to and from
    /// channels-first.
    fn activations_per_pixel(&self, _: bool, _: Pad) -> f64 {
        let (d, h) = (self.dim as f64, self.hidden as f64);
        let out = (self.out_channels * self.scale.pow(2)) as f64;
        (3.0 * d + 5.0 * h + 3.0 * self.conv_channels as f64).max(2.0 * d + 2.0 * out)
    }

    fn refusal(&self) -> Option<String> {
        let channels = (self.in_channels, self.out_channels);
        (channels != (3, 3) && channels != (1, 1)).then(|| {
            format!(
                "a MoSR model with {} input and {} output channels: only RGB (3) and \
                 greyscale (1) models run",
                self.in_channels, self.out_channels
            )
        })
    }

    fn greyscale(&self) -> bool {
        (self.in_channels, self.out_channels) == (1, 1)
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(Mosr::new(self, plan, vb)?))
    }
}

/// A depthwise `k x k` convolution with its bias, on channels-last maps.
struct Depthwise {
    /// `(C, 1, k, k)`.
    weight: Tensor,
    /// `(1, C, 1, 1)`.
    bias: Tensor,
    kernel: usize,
    /// The taps `(k², C)` and bias for the CPU kernel, where the layer is on the CPU in f32.
    host: Option<(Vec<f32>, Vec<f32>)>,
}

impl Depthwise {
    fn new(weight: Tensor, bias: Tensor, kernel: usize) -> Result<Self> {
        let c = weight.dim(0)?;
        let host = (weight.device().is_cpu() && weight.dtype() == candle_core::DType::F32)
            .then(|| -> Result<_> {
                let taps = weight.reshape((c, kernel * kernel))?.t()?.contiguous()?;
                Ok((taps.flatten_all()?.to_vec1()?, bias.to_vec1()?))
            })
            .transpose()?;
        Ok(Self {
            weight,
            bias: bias.reshape((1, c, 1, 1))?,
            kernel,
            host,
        })
    }
}

impl Module for Depthwise {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some((taps, bias)) = &self.host {
            // Read in place, also where `x` is a range of a wider map's channels.
            if let Some(y) = depthwise_kxk(x, self.kernel, (taps, bias))? {
                return Ok(y);
            }
        }
        // candle's grouped convolution, one channel at a time (also the kernel's reference).
        let c = x.dim(3)?;
        let y = x
            .permute((0, 3, 1, 2))?
            .contiguous()?
            .conv2d(&self.weight, self.kernel / 2, 1, 1, c)?
            .broadcast_add(&self.bias)?;
        y.permute((0, 2, 3, 1))?.contiguous()
    }
}

/// MambaOut's gated CNN block.
struct GatedBlock {
    norm: Norm,
    fc1: Conv3x3,
    conv: Depthwise,
    fc2: Conv3x3,
    hidden: usize,
}

impl Module for GatedBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.hidden;
        let y = self.fc1.forward(&layer_norm(&self.norm, x)?)?;
        let k = self.conv.weight.dim(0)?;
        let c = self.conv.forward(&y.narrow(3, 2 * h - k, k)?)?;
        // On the CPU the gate, the concatenation and the product are one pass.
        let gated = match mish_gate(&y, h, &c)? {
            Some(gated) => gated,
            None => {
                let g = Act::Mish.apply(&y.narrow(3, 0, h)?.contiguous()?)?;
                (g * Tensor::cat(&[&y.narrow(3, h, h - k)?, &c], 3)?)?
            }
        };
        let z = self.fc2.forward_act(&gated, Act::Mish)?;
        add(&z, x)?.affine(1.0, -SHIFT)
    }
}

/// The upsampler, built.
enum Up {
    /// A convolution whose outputs PixelShuffle by the scale moves (ps, and gps folded).
    Shuffle(Conv3x3, usize),
    DySample(DySample),
}

pub struct Mosr {
    stem: Conv3x3,
    blocks: Vec<GatedBlock>,
    /// The body's 3x3 D -> 2D and 2D -> D, each followed by Mish, and its 1x1.
    tail: (Conv3x3, Conv3x3, Dense),
    /// The shortcut's two 3x3 convolutions (each followed by Mish) and its 1x1.
    shortcut: (Conv3x3, Conv3x3, Dense),
    up: Up,
    dtype: candle_core::DType,
}

impl Mosr {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &MosrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (c, d, h, n) = (cfg.in_channels, cfg.dim, cfg.hidden, cfg.blocks);
        let conv3 = |cin, cout, key: &str| Conv3x3::unpadded(cin, cout, plan, vb.pp(key));
        let blocks = build_layers(vb.device(), n, |b| {
            let vb = vb.pp(format!("gblocks.{}", b + 1));
            let k = cfg.kernel;
            Ok(GatedBlock {
                norm: Norm::load(&Pad::OFF.one(d), NORM_EPS, vb.pp("norm"))?,
                fc1: Conv3x3::unpadded(d, 2 * h, plan, vb.pp("fc1"))?,
                conv: Depthwise::new(
                    vb.get((cfg.conv_channels, 1, k, k), "conv.weight")?,
                    vb.get(cfg.conv_channels, "conv.bias")?,
                    k,
                )?,
                fc2: Conv3x3::unpadded(h, d, plan, vb.pp("fc2"))?,
                hidden: h,
            })
        })?;
        let (o, s) = (cfg.out_channels, cfg.scale);
        let up = match cfg.upsampler {
            Upsampler::PixelShuffle => Up::Shuffle(
                Conv3x3::shuffled_with_bias(d, (o, s), true, plan, vb.pp("upsampler.0"))?,
                s,
            ),
            Upsampler::Gps => {
                let vb = vb.pp("upsampler.in_to_k");
                let n = o * s * s;
                let w = vb.get((GPS_GROUPS * n, d, 3, 3), "weight")?;
                let b = vb.get(GPS_GROUPS * n, "bias")?;
                // The mean of eight convolutions' outputs is the convolution of their mean.
                let w = w.reshape((GPS_GROUPS, n, d, 3, 3))?.mean(0)?;
                let b = b.reshape((GPS_GROUPS, n))?.mean(0)?;
                Up::Shuffle(Conv3x3::shuffled_from(&w, &b, (o, s), plan)?, s)
            }
            Upsampler::DySample => Up::DySample(DySample::new(
                (d, o),
                (s, DYSAMPLE_GROUPS),
                true,
                plan,
                vb.pp("upsampler"),
            )?),
        };
        Ok(Self {
            stem: conv3(c, d, "gblocks.0")?,
            blocks,
            tail: (
                conv3(d, 2 * d, &format!("gblocks.{}", n + 1))?,
                conv3(2 * d, d, &format!("gblocks.{}", n + 3))?,
                pointwise_with(d, d, plan, vb.pp(format!("gblocks.{}", n + 5)))?,
            ),
            shortcut: (
                conv3(c, d, "shortcut.block.0")?,
                conv3(d, d, "shortcut.block.2")?,
                pointwise_with(c, d, plan, vb.pp("shortcut.conv11"))?,
            ),
            up,
            dtype: vb.dtype(),
        })
    }
}

impl Net for Mosr {
    fn dtype(&self) -> candle_core::DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for Mosr {
    /// `x`: `(B, C, H, W)` in [0, 1], any H and W; returns `(B, C', sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mish = Act::Mish;
        let x = x
            .to_dtype(self.dtype)?
            .permute((0, 2, 3, 1))?
            .contiguous()?;
        let mut t = self.stem.forward(&x)?;
        for block in &self.blocks {
            t = block.forward(&t)?;
        }
        let (a, b, c) = &self.tail;
        let t = c.forward(&b.forward_act(&a.forward_act(&t, mish)?, mish)?)?;
        let (s0, s2, s11) = &self.shortcut;
        let s = s11.forward_residual(&x, &s2.forward_act(&s0.forward_act(&x, mish)?, mish)?)?;
        let y = add(&t, &s)?.affine(1.0, -SHIFT)?;
        let y = match &self.up {
            Up::Shuffle(conv, s) => conv.forward_shuffled(&y, *s)?,
            Up::DySample(d) => d.forward(&y)?,
        };
        y.permute((0, 3, 1, 2))?.contiguous()
    }
}

/// MoSR's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "MoSR"
    }

    fn loads(&self) -> &'static str {
        "ps, gps and DySample upsamplers"
    }

    /// The first GatedCNN block's depthwise convolution under `gblocks.1`, which no other
    /// registered network has.
    fn detect(&self, shapes: &Shapes) -> bool {
        shapes.contains_key("gblocks.0.weight") && shapes.contains_key("gblocks.1.conv.weight")
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match MosrConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::Mosr(Box::new(e))),
        }
    }
}
