//! ESRGAN (Wang et al., 2018) and Real-ESRGAN's RRDBNet (Wang et al., 2021), inference only.
//!
//! The network, as the papers and the released code define it:
//!
//! ```text
//! x  = x reflect-padded (bottom, right) to a multiple of u, pixel-unshuffled by u
//!                                        (u = 1, or 2 and 4 for Real-ESRGAN's x2 and x1)
//! f0 = conv_first(x)                     3x3, C·u² -> F
//! t  = RRDB_n(... RRDB_1(f0))            RRDB(t)  = 0.2 · rdb3(rdb2(rdb1(t))) + t
//!                                        rdb(t)   = 0.2 · conv5(cat(t, x1..x4)) + t,
//!                                        x_k      = lrelu(conv_k(cat(t, x1..x_{k-1})))
//!                                        (conv_k: F + (k-1)·G -> G; conv5: F + 4G -> F)
//! y  = conv_body(t) + f0
//! for each upsampling conv:  y = lrelu(conv_up_k(nearest2(y)))
//! y  = conv_last(lrelu(conv_hr(y)))      cropped to (sH, sW)
//! ```
//!
//! with every LeakyReLU at slope 0.2 and every convolution 3x3 with a bias. The scale is
//! 2^(upsampling convs) / u. The unshuffle factor is read as the reference loader (spandrel)
//! reads it: the first convolution takes 4 or 16 times the last one's output channels.
//!
//! Three key layouts name the same layers: ESRGAN's original `model.N` sequential (the
//! "old arch" most community models use), Real-ESRGAN / BasicSR's names (`conv_first`,
//! `body.N.rdbK.convJ`, `conv_body`, `conv_upK`, `conv_hr`, `conv_last`) and the older
//! BasicSR / BSRGAN names (`RRDB_trunk`, `trunk_conv`, `upconvK`, `HRconv`). The layers are
//! built straight from the file's own names ([`EsrganConfig::key`]); nothing is renamed.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::{crop_nchw, nearest, padded_nhwc, pixel_unshuffle};
use crate::nets::infer::{check_shapes, out_width, tensor, ConfigError, Shapes};
use crate::nets::registry::Architecture;
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::add;
use crate::ops::conv::{dense_block, Act, Conv3x3};
use crate::ops::pad::Pad;
use crate::ops::{build_layers, LoadPlan};

/// Slope of every LeakyReLU in the network.
const SLOPE: f64 = 0.2;
/// The factor each dense block and each RRDB scales its residual branch by.
const RESIDUAL_SCALE: f64 = 0.2;
/// The most upsampling convolutions read (x16): more would be no released model, and the
/// scale must stay a small power of two.
const MAX_UPSAMPLES: usize = 4;

/// How the state dict names the layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Layout {
    /// ESRGAN's original sequential: `model.0`, `model.1.sub.N.RDBk.convj.0`,
    /// `model.1.sub.<blocks>`, `model.3`, `model.6`, ..., then the last two convolutions.
    #[serde(rename = "old-arch")]
    Old,
    /// Real-ESRGAN / BasicSR: `conv_first`, `body.N.rdbk.convj`, `conv_body`, `conv_upK`,
    /// `conv_hr`, `conv_last`.
    #[serde(rename = "real-esrgan")]
    RealEsrgan,
    /// The older BasicSR names (BSRGAN, RealSR): `conv_first`, `RRDB_trunk.N.RDBk.convj`,
    /// `trunk_conv`, `upconvK`, `HRconv`, `conv_last`.
    #[serde(rename = "rrdb-trunk")]
    Trunk,
}

impl Layout {
    /// The layout whose first dense convolution the keys hold, if any.
    fn of(shapes: &Shapes) -> Option<Self> {
        [Self::Old, Self::RealEsrgan, Self::Trunk]
            .into_iter()
            .find(|l| shapes.contains_key(&format!("{}.weight", l.dense(0, 1, 1))))
    }

    /// The prefix of convolution `conv` (1..=5) of dense block `rdb` (1..=3) of RRDB `block`.
    fn dense(self, block: usize, rdb: usize, conv: usize) -> String {
        match self {
            Self::Old => format!("model.1.sub.{block}.RDB{rdb}.conv{conv}.0"),
            Self::RealEsrgan => format!("body.{block}.rdb{rdb}.conv{conv}"),
            Self::Trunk => format!("RRDB_trunk.{block}.RDB{rdb}.conv{conv}"),
        }
    }

    /// The prefix of the `k`-th (from 1) upsampling convolution. In the old layout each
    /// upsampling step is three modules (nearest, conv, LeakyReLU) after `model.1`.
    fn up(self, k: usize) -> String {
        match self {
            Self::Old => format!("model.{}", 3 * k),
            Self::RealEsrgan => format!("conv_up{k}"),
            Self::Trunk => format!("upconv{k}"),
        }
    }
}

/// One convolution of the network, by role.
#[derive(Clone, Copy)]
enum Layer {
    First,
    Dense {
        block: usize,
        rdb: usize,
        conv: usize,
    },
    Body,
    Up(usize),
    Hr,
    Last,
}

/// RRDBNet's configuration, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EsrganConfig {
    pub layout: Layout,
    /// Image channels the network reads (before the unshuffle).
    pub in_channels: usize,
    /// Image channels it writes.
    pub out_channels: usize,
    /// Feature channels (`num_feat`, `nf`).
    pub filters: usize,
    /// Growth channels of each dense convolution (`num_grow_ch`, `gc`).
    pub growth: usize,
    /// RRDBs.
    pub blocks: usize,
    /// Nearest x2 + convolution steps.
    pub upsamples: usize,
    /// The pixel-unshuffle factor of the input (1: none).
    pub unshuffle: usize,
    pub scale: usize,
}

impl EsrganConfig {
    /// The state-dict prefix of `layer` in this file's layout.
    fn key(&self, layer: Layer) -> String {
        let l = self.layout;
        let u = self.upsamples;
        match (l, layer) {
            (_, Layer::Dense { block, rdb, conv }) => l.dense(block, rdb, conv),
            (_, Layer::Up(k)) => l.up(k),
            (Layout::Old, Layer::First) => "model.0".into(),
            (Layout::Old, Layer::Body) => format!("model.1.sub.{}", self.blocks),
            // After the upsampling steps: conv_hr, its LeakyReLU, conv_last.
            (Layout::Old, Layer::Hr) => format!("model.{}", 3 * u + 2),
            (Layout::Old, Layer::Last) => format!("model.{}", 3 * u + 4),
            (_, Layer::First) => "conv_first".into(),
            (_, Layer::Last) => "conv_last".into(),
            (Layout::RealEsrgan, Layer::Body) => "conv_body".into(),
            (Layout::RealEsrgan, Layer::Hr) => "conv_hr".into(),
            (Layout::Trunk, Layer::Body) => "trunk_conv".into(),
            (Layout::Trunk, Layer::Hr) => "HRconv".into(),
        }
    }

    /// Input and output channels of convolution `conv` (1..=5) of a dense block: each reads
    /// the block's input and the outputs of the convolutions before it.
    fn dense_channels(&self, conv: usize) -> (usize, usize) {
        let (f, g) = (self.filters, self.growth);
        let cout = if conv == 5 { f } else { g };
        (f + (conv - 1) * g, cout)
    }

    /// Every convolution as (layer, input channels, output channels, output pixels per
    /// input pixel), in forward order.
    fn convs(&self) -> Vec<(Layer, usize, usize, f64)> {
        let f = self.filters;
        let body = 1.0 / (self.unshuffle * self.unshuffle) as f64;
        let in_ch = self.in_channels * self.unshuffle * self.unshuffle;
        let mut v = vec![(Layer::First, in_ch, f, body)];
        for block in 0..self.blocks {
            for rdb in 1..=3 {
                for conv in 1..=5 {
                    let (cin, cout) = self.dense_channels(conv);
                    v.push((Layer::Dense { block, rdb, conv }, cin, cout, body));
                }
            }
        }
        v.push((Layer::Body, f, f, body));
        for k in 1..=self.upsamples {
            v.push((Layer::Up(k), f, f, body * (1usize << (2 * k)) as f64));
        }
        let hr = body * (1usize << (2 * self.upsamples)) as f64;
        v.push((Layer::Hr, f, f, hr));
        v.push((Layer::Last, f, self.out_channels, hr));
        v
    }

    /// The configuration read from the tensor names and shapes, every tensor checked.
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let layout = Layout::of(shapes).ok_or_else(|| {
            ConfigError::missing(&format!("{}.weight", Layout::RealEsrgan.dense(0, 1, 1)), "")
        })?;
        let mut cfg = EsrganConfig {
            layout,
            in_channels: 0,
            out_channels: 0,
            filters: 0,
            growth: 0,
            blocks: 0,
            upsamples: 0,
            unshuffle: 1,
            scale: 1,
        };
        while shapes.contains_key(&format!("{}.weight", layout.dense(cfg.blocks, 1, 1))) {
            cfg.blocks += 1;
        }
        while shapes.contains_key(&format!("{}.weight", layout.up(cfg.upsamples + 1))) {
            cfg.upsamples += 1;
            if cfg.upsamples > MAX_UPSAMPLES {
                return Err(ConfigError::Unsupported(
                    "more than 4 upsampling convolutions",
                ));
            }
        }
        let first = format!("{}.weight", cfg.key(Layer::First));
        cfg.filters = out_width(shapes, &first)?;
        let in_ch = tensor(shapes, &first)?[1];
        cfg.growth = out_width(shapes, &format!("{}.weight", layout.dense(0, 1, 1)))?;
        cfg.out_channels = out_width(shapes, &format!("{}.weight", cfg.key(Layer::Last)))?;
        let out = cfg.out_channels;
        // As the reference reads it: 4x or 16x the output's channels in is an unshuffled
        // input (Real-ESRGAN's x2 and x1 models), anything else is read as it is.
        cfg.unshuffle = if in_ch == 4 * out {
            2
        } else if in_ch == 16 * out {
            4
        } else {
            1
        };
        cfg.in_channels = in_ch / (cfg.unshuffle * cfg.unshuffle);
        let up = 1usize << cfg.upsamples;
        if up < cfg.unshuffle {
            return Err(ConfigError::UnshuffleScale {
                unshuffle: cfg.unshuffle,
                upsamples: cfg.upsamples,
            });
        }
        cfg.scale = up / cfg.unshuffle;
        check_shapes(
            &cfg.expected_tensors(),
            shapes,
            " (an RRDBNet variant this build does not run: ESRGAN+, or normalisation layers?)",
        )?;
        Ok(cfg)
    }

    /// The model's name, after its release and layout.
    pub fn variant(&self) -> &'static str {
        match self.layout {
            Layout::Old => "ESRGAN",
            Layout::RealEsrgan => "Real-ESRGAN (RRDBNet)",
            Layout::Trunk => "ESRGAN (RRDB_trunk)",
        }
    }
}

/// Residual dense block: five convolutions, each reading the block's input and every
/// earlier output.
struct DenseBlock {
    convs: Vec<Conv3x3>,
}

impl DenseBlock {
    fn new(
        cfg: &EsrganConfig,
        (block, rdb): (usize, usize),
        plan: &LoadPlan,
        vb: &VarBuilder,
    ) -> Result<Self> {
        let convs = (1..=5)
            .map(|conv| {
                let (cin, cout) = cfg.dense_channels(conv);
                let key = cfg.layout.dense(block, rdb, conv);
                Conv3x3::unpadded(cin, cout, plan, vb.pp(key))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { convs })
    }
}

impl DenseBlock {
    /// The block, or with `outer` `(s, r)` `s · block + r`.
    fn forward_outer(&self, x: &Tensor, outer: Option<(f32, &Tensor)>) -> Result<Tensor> {
        let scales = (SLOPE as f32, RESIDUAL_SCALE as f32);
        if let Some(y) = dense_block(&self.convs, x, scales, outer)? {
            return Ok(y);
        }
        let y = self.forward(x)?;
        match outer {
            Some((s, r)) => add(&y.affine(f64::from(s), 0.0)?, r),
            None => Ok(y),
        }
    }
}

impl Module for DenseBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let Some((last, growing)) = self.convs.split_last() else {
            return Ok(x.clone());
        };
        if let Some(y) = dense_block(&self.convs, x, (SLOPE as f32, RESIDUAL_SCALE as f32), None)? {
            return Ok(y);
        }
        // The concatenation grows by G channels per convolution, channels-last: each
        // convolution reads all of it as one input.
        let mut feats = x.clone();
        for conv in growing {
            let y = conv.forward_act(&feats, Act::Leaky(SLOPE as f32))?;
            feats = Tensor::cat(&[&feats, &y], 3)?;
        }
        last.forward_residual(&feats, RESIDUAL_SCALE as f32, x)
    }
}

/// Residual-in-residual dense block: three dense blocks in a row, plus the input.
struct Rrdb {
    rdbs: Vec<DenseBlock>,
}

impl Module for Rrdb {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let Some((last, first)) = self.rdbs.split_last() else {
            return add(&x.affine(RESIDUAL_SCALE, 0.0)?, x);
        };
        let mut t = x.clone();
        for rdb in first {
            t = rdb.forward(&t)?;
        }
        last.forward_outer(&t, Some((RESIDUAL_SCALE as f32, x)))
    }
}

pub struct Esrgan {
    first: Conv3x3,
    blocks: Vec<Rrdb>,
    body: Conv3x3,
    ups: Vec<Conv3x3>,
    hr: Conv3x3,
    last: Conv3x3,
    unshuffle: usize,
    scale: usize,
    dtype: DType,
}

impl Esrgan {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &EsrganConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let f = cfg.filters;
        let conv = |layer: Layer, cin: usize, cout: usize| {
            Conv3x3::unpadded(cin, cout, plan, vb.pp(cfg.key(layer)))
        };
        let blocks = build_layers(vb.device(), cfg.blocks, |block| {
            let rdbs = (1..=3)
                .map(|rdb| DenseBlock::new(cfg, (block, rdb), plan, &vb))
                .collect::<Result<Vec<_>>>()?;
            Ok(Rrdb { rdbs })
        })?;
        let u2 = cfg.unshuffle * cfg.unshuffle;
        Ok(Self {
            first: conv(Layer::First, cfg.in_channels * u2, f)?,
            blocks,
            body: conv(Layer::Body, f, f)?,
            ups: (1..=cfg.upsamples)
                .map(|k| conv(Layer::Up(k), f, f))
                .collect::<Result<Vec<_>>>()?,
            hr: conv(Layer::Hr, f, f)?,
            last: conv(Layer::Last, f, cfg.out_channels)?,
            unshuffle: cfg.unshuffle,
            scale: cfg.scale,
            dtype: vb.dtype(),
        })
    }
}

impl Net for Esrgan {
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for Esrgan {
    /// `x`: `(B, C, H, W)` in [0, 1], any H and W; returns `(B, C', sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let lrelu = Act::Leaky(SLOPE as f32);
        // The unshuffle needs sizes divisible by its factor: the reference pads as SwinIR
        // does (reflect, bottom and right) and crops the output.
        let (mut x, (h, w)) = padded_nhwc(x, self.dtype, self.unshuffle)?;
        if self.unshuffle > 1 {
            x = pixel_unshuffle(&x, self.unshuffle)?;
        }
        let f0 = self.first.forward(&x)?;
        let mut t = f0.clone();
        for block in &self.blocks {
            t = block.forward(&t)?;
        }
        let mut y = self.body.forward_residual(&t, 1.0, &f0)?;
        for up in &self.ups {
            y = up.forward_act(&nearest(&y, 2)?, lrelu)?;
        }
        let y = self.last.forward(&self.hr.forward_act(&y, lrelu)?)?;
        crop_nchw(&y, (h * self.scale, w * self.scale))
    }
}

/// ESRGAN's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "ESRGAN"
    }

    fn loads(&self) -> &'static str {
        "RRDBNet, old-arch and Real-ESRGAN keys, x1/x2/x4/x8"
    }

    /// The first dense convolution under any of the three layouts' names.
    fn detect(&self, shapes: &Shapes) -> bool {
        Layout::of(shapes).is_some()
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match EsrganConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::Esrgan(Box::new(e))),
        }
    }
}

impl NetConfig for EsrganConfig {
    /// Every tensor the configuration implies, with its shape.
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        self.convs()
            .into_iter()
            .flat_map(|(layer, cin, cout, _)| {
                let p = self.key(layer);
                [
                    (format!("{p}.weight"), vec![cout, cin, 3, 3]),
                    (format!("{p}.bias"), vec![cout]),
                ]
            })
            .collect()
    }

    fn flops(&self, h: usize, w: usize) -> f64 {
        let per_pixel: f64 = self
            .convs()
            .iter()
            .map(|&(_, cin, cout, area)| 2.0 * 9.0 * (cin * cout) as f64 * area)
            .sum();
        per_pixel * (h * w) as f64
    }

    fn family(&self) -> &'static str {
        "ESRGAN"
    }

    fn variant(&self) -> &'static str {
        EsrganConfig::variant(self)
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
            "layout": self.layout,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "filters": self.filters,
            "growth": self.growth,
            "blocks": self.blocks,
            "upsamples": self.upsamples,
            "unshuffle": self.unshuffle,
        })
    }

    fn largest_tensor_per_pixel(&self, _: bool, _: Pad) -> usize {
        let u2 = self.unshuffle * self.unshuffle;
        // The dense concatenation at the body's resolution, or a feature map after the
        // last doubling.
        let dense = (self.filters + 4 * self.growth).div_ceil(u2);
        let hr = self.filters * (1usize << (2 * self.upsamples)) / u2;
        dense.max(hr).max(1)
    }

    /// The body holds the block's and the RRDB's inputs, `f0`, the growing concatenation
    /// and its copy; the tail a doubled map, its convolution and its activation.
    fn activations_per_pixel(&self, _: bool, _: Pad) -> f64 {
        let (f, g) = (self.filters as f64, self.growth as f64);
        let u2 = (self.unshuffle * self.unshuffle) as f64;
        let body = 4.0 * f + 2.0 * (f + 4.0 * g);
        let tail = 3.0 * f * (1usize << (2 * self.upsamples)) as f64 + f;
        body.max(tail) / u2
    }

    fn refusal(&self) -> Option<String> {
        let channels = (self.in_channels, self.out_channels);
        (channels != (3, 3) && channels != (1, 1)).then(|| {
            format!(
                "an ESRGAN model with {} input and {} output channels: only RGB (3 and 3) and \
                 greyscale (1 and 1) models run",
                self.in_channels, self.out_channels
            )
        })
    }

    fn greyscale(&self) -> bool {
        (self.in_channels, self.out_channels) == (1, 1)
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(Esrgan::new(self, plan, vb)?))
    }
}
