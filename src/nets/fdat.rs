//! FDAT (Fast Dual Aggregation Transformer, traiNNer-redux), inference only, as spandrel's
//! `FDAT` defines it:
//!
//! ```text
//! x  = x reflect-padded (bottom, right) to a multiple of u and pixel-unshuffled by u
//!                                            (u = 1; 2 or 4 for "unshuffle_mod" x2 and x1)
//! s  = conv_first(x)                         3x3, C·u² -> D
//! t  = group_G(... group_1(s))               group(t) = conv(blocks(t)) + t   (no bias)
//!      block (even: spatial, odd: channel):
//!        n = LayerNorm(t)
//!        a = attention(n)                    spatial: n zero-padded to whole windows, each
//!                                            window's softmax(q kᵀ / √d + bias) v with a free
//!                                            (heads, N, N) bias, proj, cropped; channel:
//!                                            softmax(q̂ k̂ᵀ · temp) over channels, q and k
//!                                            L2-normalised over all tokens, proj
//!        c = GELU(dwconv3x3(n))              no bias
//!        spatial: t += a · sigmoid(1x1(GELU(1x1(mean_hw(c)))))  + c
//!        channel: t += a + c · sigmoid(1x1(a))                   (1x1s without bias)
//!        t += fc2(dwconv3x3(GELU(fc1(LayerNorm(t)))))             (no biases)
//! y  = upsampler(conv_after(t) + s)          conv_after without bias; cropped to (sH, sW)
//! ```
//!
//! The upsampler is one of seven, named by the file's `upsampler.MetaUpsample` (version,
//! kind, scale, widths, groups): one 3x3 (scale 1), PixelShuffle direct, PixelShuffle (a 3x3
//! to `mid`, LeakyReLU 0.01, x2 or x3 stages), nearest+conv (LeakyReLU 0.2), DySample (after
//! a 3x3 to `mid` where that differs), transpose+conv (transposed convolutions, then a 3x3)
//! and pa_up (nearest, 3x3, pixel attention); the eighth, LDA, is refused by name. The
//! attention pads with zero tokens that take part in the softmax, not a reflected image: the
//! network pads nothing itself but for the unshuffle. The channel attention and the channel
//! gate see the whole map, so tiles change the output: the tile planner keeps images whole
//! where it can.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::{crop_nchw, nearest, padded_nhwc, pixel_unshuffle};
use crate::nets::infer::{check_shapes, tensor, ConfigError, Shapes};
use crate::nets::registry::{Architecture, Beyond, Values};
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::attention::channel::channel_attention;
use crate::ops::attention::cpu::window_attention;
use crate::ops::conv::depthwise::Depthwise3x3;
use crate::ops::conv::transposed::Deconv;
use crate::ops::conv::{Act, Conv3x3};
use crate::ops::dysample::DySample;
use crate::ops::linear::{pointwise_with, Dense};
use crate::ops::norm::{layer_norm, Norm};
use crate::ops::pad::Pad;
use crate::ops::windows::RelativeBias;
use crate::ops::{add, build_layers, gelu_erf, mean_hw, scale_leading, LoadPlan};

/// nn.LayerNorm's default epsilon, the blocks' norms.
const EPS: f64 = 1e-5;
/// F.normalize's floor on a norm.
const NORMALIZE_EPS: f64 = 1e-12;
/// The slope of the LeakyReLU after PixelShuffle's and DySample's first convolution
/// (`nn.LeakyReLU()`'s default).
const SLOPE_DEFAULT: f32 = 0.01;
/// The slope of nearest+conv's and pa_up's LeakyReLUs.
const SLOPE: f32 = 0.2;
/// The key of the upsampler's description.
const META: &str = "upsampler.MetaUpsample";
/// The upsampler description's version this reads.
const META_VERSION: usize = 3;

/// The upsampler after the body, as `upsampler.MetaUpsample` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Upsampler {
    /// One 3x3 to the output (every scale-1 model).
    #[serde(rename = "conv")]
    Conv,
    #[serde(rename = "pixelshuffledirect")]
    PixelShuffleDirect,
    #[serde(rename = "pixelshuffle")]
    PixelShuffle,
    #[serde(rename = "nearest+conv")]
    NearestConv,
    #[serde(rename = "dysample")]
    DySample,
    #[serde(rename = "transpose+conv")]
    TransposeConv,
    #[serde(rename = "pa_up")]
    PaUp,
}

impl Upsampler {
    /// The kinds in the order the description's index counts them; `None` for LDA's place.
    const BY_INDEX: [Option<Self>; 8] = [
        Some(Self::Conv),
        Some(Self::PixelShuffleDirect),
        Some(Self::PixelShuffle),
        Some(Self::NearestConv),
        Some(Self::DySample),
        Some(Self::TransposeConv),
        None,
        Some(Self::PaUp),
    ];
}

/// FDAT's configuration, read from its weights and its upsampler's description.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FdatConfig {
    /// The model's scale (x2 for an unshuffled x2 model, whose upsampler is x4).
    pub scale: usize,
    pub in_channels: usize,
    pub out_channels: usize,
    pub embed_dim: usize,
    /// Residual groups.
    pub groups: usize,
    /// Pairs of blocks (spatial, channel) a group.
    pub depth: usize,
    pub heads: usize,
    /// The spatial attention's window side.
    pub window_size: usize,
    /// The feed-forward network's hidden width.
    pub ffn_hidden: usize,
    /// The channel gate's hidden width (`embed_dim / aim_reduction_ratio`).
    pub gate_hidden: usize,
    /// The upsampler's inner width.
    pub mid_dim: usize,
    pub upsampler: Upsampler,
    /// The input's pixel-unshuffle factor (1: none).
    pub unshuffle: usize,
    /// DySample's groups.
    pub dysample_groups: usize,
}

impl FdatConfig {
    /// The upsampler's scale: the model's, times the unshuffle.
    fn up_scale(&self) -> usize {
        self.scale * self.unshuffle
    }

    /// The configuration read from the tensor names and shapes and the upsampler's
    /// description, every tensor checked, as the reference loader reads it.
    pub fn infer(shapes: &Shapes, values: Values) -> std::result::Result<Self, ConfigError> {
        let meta = values(META).ok_or(ConfigError::Values {
            name: META.into(),
            problem: "cannot be read: FDAT's upsampler is described only there".into(),
        })?;
        let m: Vec<usize> = meta.iter().map(|&v| v.max(0.0) as usize).collect();
        // Widths and counts of a real model are far below this; larger values would only
        // overflow the shape arithmetic below.
        if m.len() != 7 || m[0] != META_VERSION || m.iter().any(|&v| v > 1 << 16) {
            return Err(ConfigError::Values {
                name: META.into(),
                problem: format!("is {meta:?}; expected version {META_VERSION} and 7 values"),
            });
        }
        let (kind, up_scale, out_channels, mid_dim, dysample_groups) =
            (m[1], m[2], m[4], m[5], m[6]);
        let upsampler = match Upsampler::BY_INDEX.get(kind) {
            Some(Some(u)) => *u,
            Some(None) => return Err(ConfigError::Unsupported("FDAT's LDA upsampler")),
            None => {
                return Err(ConfigError::Values {
                    name: META.into(),
                    problem: format!("names upsampler {kind}, which FDAT does not have"),
                })
            }
        };
        let unshuffled = shapes.contains_key("conv_first.1.weight");
        let first = if unshuffled {
            "conv_first.1.weight"
        } else {
            "conv_first.weight"
        };
        let stem = tensor(shapes, first)?;
        if stem.len() != 4 || stem[0] == 0 || stem[1] == 0 {
            return Err(ConfigError::shape(
                first,
                stem,
                "; expected a 3x3 convolution",
            ));
        }
        let embed_dim = stem[0];
        let (in_channels, unshuffle) = if unshuffled {
            // As the reference loader: the input has the output's channels.
            let u = crate::nets::infer::isqrt(stem[1] / out_channels.max(1));
            if u < 2 || up_scale != 4 || !4usize.is_multiple_of(u) {
                return Err(ConfigError::shape(
                    first,
                    stem,
                    format!(
                        "; an unshuffled input of {out_channels} channels wants 4 or 16 times that"
                    ),
                ));
            }
            (out_channels, u)
        } else {
            (stem[1], 1)
        };
        let scale = up_scale / unshuffle;
        let upsampler = if up_scale == 1 {
            Upsampler::Conv
        } else {
            upsampler
        };
        if upsampler == Upsampler::Conv && up_scale != 1 {
            return Err(ConfigError::Unsupported(
                "FDAT's conv upsampler at a scale above 1",
            ));
        }
        let scale_ok = match upsampler {
            Upsampler::Conv => up_scale == 1,
            Upsampler::PixelShuffle | Upsampler::NearestConv | Upsampler::PaUp => {
                up_scale == 3 || up_scale.is_power_of_two()
            }
            Upsampler::TransposeConv => (2..=4).contains(&up_scale),
            Upsampler::PixelShuffleDirect | Upsampler::DySample => up_scale >= 2,
        };
        if !scale_ok || up_scale > 16 {
            return Err(ConfigError::Values {
                name: META.into(),
                problem: format!("names a {upsampler:?} upsampler at scale {up_scale}, which FDAT does not build"),
            });
        }
        let mut groups = 0;
        while shapes.contains_key(&format!("groups.{groups}.conv.weight")) {
            groups += 1;
        }
        let mut blocks = 0;
        while shapes.contains_key(&format!("groups.0.blocks.{blocks}.n1.weight")) {
            blocks += 1;
        }
        let bias = tensor(shapes, "groups.0.blocks.0.attn.bias")?;
        let (heads, window) = match bias {
            [h, n, n2] if n == n2 && *h > 0 => (*h, crate::nets::infer::isqrt(*n)),
            _ => (0, 0),
        };
        if window == 0 || window * window != bias[1] || embed_dim % heads != 0 {
            return Err(ConfigError::shape(
                "groups.0.blocks.0.attn.bias",
                bias,
                format!("; a (heads, N, N) bias of square windows, heads dividing {embed_dim}"),
            ));
        }
        if groups == 0 || blocks == 0 || blocks % 2 != 0 {
            return Err(ConfigError::Unsupported(
                "FDAT groups of no blocks or of an odd number",
            ));
        }
        let ffn_hidden = crate::nets::infer::out_width(shapes, "groups.0.blocks.0.ffn.fc1.weight")?;
        let gate_hidden =
            crate::nets::infer::out_width(shapes, "groups.0.blocks.0.inter.cg.1.weight")?;
        if dysample_groups == 0
            || (upsampler == Upsampler::DySample && mid_dim % dysample_groups != 0)
        {
            return Err(ConfigError::Values {
                name: META.into(),
                problem: format!("names {dysample_groups} DySample groups for {mid_dim} channels"),
            });
        }
        let cfg = Self {
            scale,
            in_channels,
            out_channels,
            embed_dim,
            groups,
            depth: blocks / 2,
            heads,
            window_size: window,
            ffn_hidden,
            gate_hidden,
            mid_dim,
            upsampler,
            unshuffle,
            dysample_groups,
        };
        check_shapes(
            &cfg.expected_tensors(),
            shapes,
            " (an FDAT variant this build does not run?)",
        )?;
        Ok(cfg)
    }

    /// Whether DySample has a 3x3 to `mid_dim` in front of it.
    fn dysample_pre(&self) -> bool {
        self.mid_dim != self.embed_dim
    }

    /// The upsampler's stages of nearest or shuffled upsampling: one of 3, or doublings.
    fn stages(&self) -> (usize, usize) {
        match self.up_scale() {
            3 => (3, 1),
            s => (2, s.trailing_zeros() as usize),
        }
    }
}

/// The tensors of a convolution `(cout, cin, k, k)`, with its bias where `bias`.
fn conv(
    t: &mut Vec<(String, Vec<usize>)>,
    name: &str,
    (cin, cout, k): (usize, usize, usize),
    bias: bool,
) {
    t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
    if bias {
        t.push((format!("{name}.bias"), vec![cout]));
    }
}

impl NetConfig for FdatConfig {
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (d, o, m, s) = (
            self.embed_dim,
            self.out_channels,
            self.mid_dim,
            self.up_scale(),
        );
        let (f, r, n) = (
            self.ffn_hidden,
            self.gate_hidden,
            self.window_size * self.window_size,
        );
        let mut t = Vec::new();
        let u = self.unshuffle;
        let first = if u > 1 { "conv_first.1" } else { "conv_first" };
        conv(&mut t, first, (self.in_channels * u * u, d, 3), true);
        for g in 0..self.groups {
            for b in 0..2 * self.depth {
                let p = format!("groups.{g}.blocks.{b}");
                for norm in ["n1", "n2"] {
                    t.push((format!("{p}.{norm}.weight"), vec![d]));
                    t.push((format!("{p}.{norm}.bias"), vec![d]));
                }
                if b % 2 == 0 {
                    t.push((format!("{p}.attn.bias"), vec![self.heads, n, n]));
                } else {
                    t.push((format!("{p}.attn.temp"), vec![self.heads, 1, 1]));
                }
                t.push((format!("{p}.attn.qkv.weight"), vec![3 * d, d]));
                t.push((format!("{p}.attn.proj.weight"), vec![d, d]));
                t.push((format!("{p}.attn.proj.bias"), vec![d]));
                t.push((format!("{p}.conv.0.weight"), vec![d, 1, 3, 3]));
                conv(&mut t, &format!("{p}.inter.sg.0"), (d, 1, 1), false);
                conv(&mut t, &format!("{p}.inter.cg.1"), (d, r, 1), false);
                conv(&mut t, &format!("{p}.inter.cg.3"), (r, d, 1), false);
                t.push((format!("{p}.ffn.fc1.weight"), vec![f, d]));
                t.push((format!("{p}.ffn.fc2.weight"), vec![d, f]));
                t.push((format!("{p}.ffn.smix.weight"), vec![f, 1, 3, 3]));
            }
            conv(&mut t, &format!("groups.{g}.conv"), (d, d, 3), false);
        }
        conv(&mut t, "conv_after", (d, d, 3), false);
        let up = |t: &mut Vec<_>, i: usize, cio: (usize, usize, usize)| {
            conv(t, &format!("upsampler.{i}"), cio, true)
        };
        match self.upsampler {
            Upsampler::Conv => up(&mut t, 0, (d, o, 3)),
            Upsampler::PixelShuffleDirect => up(&mut t, 0, (d, o * s * s, 3)),
            Upsampler::PixelShuffle => {
                let (r, k) = self.stages();
                up(&mut t, 0, (d, m, 3));
                for i in 0..k {
                    up(&mut t, 2 + 2 * i, (m, r * r * m, 3));
                }
                up(&mut t, 2 + 2 * k, (m, o, 3));
            }
            Upsampler::NearestConv => {
                let (_, k) = self.stages();
                for i in 0..k {
                    up(&mut t, 3 * i, (d, d, 3));
                }
                up(&mut t, 3 * k, (d, d, 3));
                up(&mut t, 3 * k + 2, (d, o, 3));
            }
            Upsampler::DySample => {
                let at = if self.dysample_pre() {
                    up(&mut t, 0, (d, m, 3));
                    2
                } else {
                    0
                };
                let p = format!("upsampler.{at}");
                let oc = 2 * self.dysample_groups * s * s;
                conv(&mut t, &format!("{p}.end_conv"), (m, o, 1), true);
                conv(&mut t, &format!("{p}.offset"), (m, oc, 1), true);
                conv(&mut t, &format!("{p}.scope"), (m, oc, 1), false);
                t.push((format!("{p}.init_pos"), vec![1, oc, 1, 1]));
            }
            Upsampler::TransposeConv => {
                // ConvTranspose2d weights are (in, out, k, k).
                let (k, mid) = if s == 3 {
                    (3, o)
                } else {
                    (4, if s == 4 { d } else { o })
                };
                t.push(("upsampler.0.weight".into(), vec![d, mid, k, k]));
                t.push(("upsampler.0.bias".into(), vec![mid]));
                if s == 4 {
                    t.push(("upsampler.2.weight".into(), vec![d, o, 4, 4]));
                    t.push(("upsampler.2.bias".into(), vec![o]));
                    up(&mut t, 3, (o, o, 3));
                } else {
                    up(&mut t, 1, (o, o, 3));
                }
            }
            Upsampler::PaUp => {
                let (_, k) = self.stages();
                for i in 0..k {
                    let cin = if i == 0 { d } else { m };
                    up(&mut t, 6 * i + 1, (cin, m, 3));
                    conv(
                        &mut t,
                        &format!("upsampler.{}.conv.0", 6 * i + 2),
                        (m, m, 1),
                        true,
                    );
                    up(&mut t, 6 * i + 4, (m, m, 3));
                }
                up(&mut t, 6 * k, (m, o, 3));
            }
        }
        t.push((META.into(), vec![7]));
        t
    }

    /// The learned parameters: the upsampler's description is a buffer.
    fn parameter_count(&self) -> usize {
        crate::nets::infer::parameters(&self.expected_tensors()) - 7
    }

    /// The linear layers', convolutions' and attention products' multiply-adds a pixel (the
    /// upsampler's at each resolution it runs at); norms, activations and gates left out.
    fn flops(&self, h: usize, w: usize) -> f64 {
        let (d, f, n) = (
            self.embed_dim,
            self.ffn_hidden,
            self.window_size * self.window_size,
        );
        let (o, m, s, u) = (
            self.out_channels,
            self.mid_dim,
            self.up_scale(),
            self.unshuffle,
        );
        let pixels = (h * w) as f64 / (u * u) as f64;
        let head = d / self.heads.max(1);
        let common = 4 * d * d + 9 * d + 2 * d * f + 9 * f;
        let spatial = common + 2 * n * d;
        let channel = common + 2 * d * head;
        let body = 9 * self.in_channels * u * u * d
            + self.groups * (self.depth * (spatial + channel) + 9 * d * d)
            + 9 * d * d;
        let (r, k) = self.stages();
        let area = |i: usize| (r * r).pow(i as u32);
        let up: usize = match self.upsampler {
            Upsampler::Conv => 9 * d * o,
            Upsampler::PixelShuffleDirect => 9 * d * o * s * s,
            Upsampler::PixelShuffle => {
                9 * d * m
                    + (0..k).map(|i| area(i) * 9 * m * r * r * m).sum::<usize>()
                    + s * s * 9 * m * o
            }
            Upsampler::NearestConv => {
                (0..k).map(|i| area(i) * 9 * d * d).sum::<usize>() + s * s * 9 * d * (d + o)
            }
            Upsampler::DySample => {
                let pre = if self.dysample_pre() { 9 * d * m } else { 0 };
                pre + m * 4 * self.dysample_groups * s * s + s * s * m * o
            }
            Upsampler::TransposeConv => s * s * (d * d + 9 * o * o + d * o),
            Upsampler::PaUp => {
                (1..=k)
                    .map(|i| area(i) * (9 * d * m + m * m + 9 * m * m))
                    .sum::<usize>()
                    + s * s * 9 * m * o
            }
        };
        2.0 * (body + up) as f64 * pixels
    }

    fn family(&self) -> &'static str {
        "FDAT"
    }

    fn variant(&self) -> &'static str {
        match (self.embed_dim, self.groups) {
            (180, 6) => "FDAT-XL",
            (96, _) => "FDAT-tiny",
            (108, _) => "FDAT-light",
            (120, _) => "FDAT-medium",
            (180, _) => "FDAT-large",
            _ => "FDAT",
        }
    }

    fn scale(&self) -> usize {
        self.scale
    }

    /// The unshuffle factor: the input is padded to its multiple (the attention pads its
    /// windows itself).
    fn window(&self) -> usize {
        self.unshuffle
    }

    fn describe(&self) -> serde_json::Value {
        json!({
            "scale": self.scale,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "embed_dim": self.embed_dim,
            "groups": self.groups,
            "depth_per_group": self.depth,
            "heads": self.heads,
            "window": self.window_size,
            "ffn_hidden": self.ffn_hidden,
            "gate_hidden": self.gate_hidden,
            "mid_dim": self.mid_dim,
            "upsampler": self.upsampler,
            "unshuffle": self.unshuffle,
        })
    }

    fn widest_head_dim(&self) -> usize {
        self.embed_dim / self.heads.max(1)
    }

    /// The spatial attention's scores (in memory off the CPU, where they run on candle's
    /// products), qkv, the feed-forward network's hidden layer, or the upsampler's widest map.
    fn largest_tensor_per_pixel(&self, _: bool, _: Pad) -> usize {
        let n = self.window_size * self.window_size;
        let s = self.up_scale();
        let up = (self.mid_dim.max(self.embed_dim) * s * s).max(4 * self.mid_dim);
        let u2 = self.unshuffle * self.unshuffle;
        [self.heads * n, 3 * self.embed_dim, self.ffn_hidden, up]
            .into_iter()
            .max()
            .unwrap_or(1)
            .div_ceil(u2)
    }

    /// A block holds its input, the norm, qkv, the scores, the attention's and the
    /// convolution's outputs and the sum, then the hidden layer twice; the upsampler its
    /// widest map and its input.
    fn activations_per_pixel(&self, _: bool, _: Pad) -> f64 {
        let (d, f) = (self.embed_dim as f64, self.ffn_hidden as f64);
        let n = (self.window_size * self.window_size) as f64;
        let s = self.up_scale() as f64;
        let body = 9.0 * d + 2.0 * f + 2.0 * self.heads as f64 * n;
        let up = 3.0 * (self.mid_dim.max(self.embed_dim) as f64) * s * s;
        body.max(up) / (self.unshuffle * self.unshuffle) as f64
    }

    fn refusal(&self) -> Option<String> {
        let channels = (self.in_channels, self.out_channels);
        (channels != (3, 3)).then(|| {
            format!(
                "an FDAT model with {} input and {} output channels: only RGB (3) models run",
                self.in_channels, self.out_channels
            )
        })
    }

    fn whole_input_matters(&self) -> bool {
        true
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(Fdat::new(self, plan, vb)?))
    }
}

/// A linear layer stored without a bias (zero).
fn linear(cin: usize, cout: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<Dense> {
    let w = vb.get((cout, cin), "weight")?;
    let b = Tensor::zeros(cout, w.dtype(), w.device())?;
    Dense::new(w, b, plan)
}

/// A block's attention.
enum Attention {
    /// Windows of `window`² tokens with a free `(heads, N, N)` bias; its values for the
    /// CPU kernel where the layer is on the CPU in f32.
    Spatial {
        bias: Tensor,
        table: Option<RelativeBias>,
        window: usize,
    },
    /// Over channels, with a temperature per head (`(heads, 1, 1)`; its values for the
    /// CPU kernel).
    Channel { temp: Tensor, host: Vec<f32> },
}

struct Block {
    n1: Norm,
    n2: Norm,
    attention: Attention,
    heads: usize,
    qkv: Dense,
    proj: Dense,
    conv: Depthwise3x3,
    /// The spatial gate's 1x1 `(C, 1)`; the channel gate's two 1x1s, `(C, r)` and `(r, C)`.
    spatial_gate: Tensor,
    channel_gate: (Tensor, Tensor),
    fc1: Dense,
    smix: Depthwise3x3,
    fc2: Dense,
}

impl Block {
    fn new(cfg: &FdatConfig, spatial: bool, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (d, f, r, h) = (cfg.embed_dim, cfg.ffn_hidden, cfg.gate_hidden, cfg.heads);
        let n = cfg.window_size * cfg.window_size;
        let attention = if spatial {
            let bias = vb.get((h, n, n), "attn.bias")?;
            let on_cpu = bias.device().is_cpu() && bias.dtype() == DType::F32;
            Attention::Spatial {
                table: on_cpu
                    .then(|| RelativeBias::full(&bias, cfg.window_size))
                    .transpose()?,
                bias,
                window: cfg.window_size,
            }
        } else {
            let temp = vb.get((h, 1, 1), "attn.temp")?;
            let host = temp.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            Attention::Channel { temp, host }
        };
        let one_by_one = |name: &str, (cin, cout): (usize, usize)| -> Result<Tensor> {
            vb.get((cout, cin, 1, 1), name)?
                .reshape((cout, cin))?
                .t()?
                .contiguous()
        };
        Ok(Self {
            n1: Norm::load(&Pad::OFF.one(d), EPS, vb.pp("n1"))?,
            n2: Norm::load(&Pad::OFF.one(d), EPS, vb.pp("n2"))?,
            attention,
            heads: h,
            qkv: {
                // The spatial attention's 1/√(head dim) folded into q's weights, as the
                // window kernel takes q.
                let w = vb.get((3 * d, d), "attn.qkv.weight")?;
                let w = match spatial {
                    true => scale_leading(&w, d, ((d / h) as f64).powf(-0.5))?,
                    false => w,
                };
                let zeros = Tensor::zeros(3 * d, w.dtype(), w.device())?;
                Dense::new(w, zeros, plan)?
            },
            proj: Dense::load_unpadded(d, d, plan, vb.pp("attn.proj"))?,
            conv: Depthwise3x3::load(d, false, vb.pp("conv.0"))?,
            spatial_gate: one_by_one("inter.sg.0.weight", (d, 1))?,
            channel_gate: (
                one_by_one("inter.cg.1.weight", (d, r))?,
                one_by_one("inter.cg.3.weight", (r, d))?,
            ),
            fc1: linear(d, f, plan, vb.pp("ffn.fc1"))?,
            smix: Depthwise3x3::load(f, false, vb.pp("ffn.smix"))?,
            fc2: linear(f, d, plan, vb.pp("ffn.fc2"))?,
        })
    }

    /// Window attention of `x` `(B, H, W, C)`: zero tokens pad the map to whole windows
    /// (they take part in every softmax of their windows, as in the reference), then each
    /// window's heads, the projection, and the padding cropped.
    fn spatial(
        &self,
        x: &Tensor,
        (bias, table): (&Tensor, Option<&RelativeBias>),
        ws: usize,
    ) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let (hp, wp) = (h.div_ceil(ws) * ws, w.div_ceil(ws) * ws);
        let (ny, nx, n) = (hp / ws, wp / ws, ws * ws);
        let (heads, bw) = (self.heads, b * ny * nx);
        let d = c / heads;
        let windows = x
            .pad_with_zeros(1, 0, hp - h)?
            .pad_with_zeros(2, 0, wp - w)?
            .reshape((b, ny, ws, nx, ws, c))?
            .permute((0, 1, 3, 2, 4, 5))?
            .contiguous()?
            .reshape((bw, n, c))?;
        let qkv = self.qkv.forward(&windows)?;
        let fused = match table {
            Some(table) => window_attention(&qkv, table, None, None)?,
            None => None,
        };
        let y = match fused {
            Some(y) => y,
            None => {
                let qkv = qkv
                    .reshape((bw, n, 3, heads, d))?
                    .permute((2, 0, 3, 1, 4))?;
                let part = |i: usize| qkv.get(i)?.contiguous();
                let (q, k, v) = (part(0)?, part(1)?, part(2)?);
                let scores = q.matmul(&k.t()?.contiguous()?)?.broadcast_add(bias)?;
                let p = candle_nn::ops::softmax_last_dim(&scores)?;
                p.matmul(&v)?
                    .transpose(1, 2)?
                    .contiguous()?
                    .reshape((bw, n, c))?
            }
        };
        self.proj
            .forward(&y)?
            .reshape((b, ny, nx, ws, ws, c))?
            .permute((0, 1, 3, 2, 4, 5))?
            .contiguous()?
            .reshape((b, hp, wp, c))?
            .narrow(1, 0, h)?
            .narrow(2, 0, w)?
            .contiguous()
    }

    /// Channel attention of `x` `(B, H, W, C)` over all its tokens, then the projection.
    fn channel(&self, x: &Tensor, temp: &Tensor, host: &[f32]) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let (heads, n) = (self.heads, h * w);
        let d = c / heads;
        let qkv = self.qkv.forward(x)?.reshape((b, n, 3 * c))?.contiguous()?;
        let attended = if qkv.device().is_cpu() && qkv.dtype() == DType::F32 {
            channel_attention(&qkv, heads, host, NORMALIZE_EPS as f32)?
        } else {
            // (B, heads, d, N): each head's channels as rows over all tokens.
            let rows = |j: usize| {
                qkv.narrow(2, j * c, c)?
                    .reshape((b, n, heads, d))?
                    .permute((0, 2, 3, 1))?
                    .contiguous()
            };
            let unit = |t: Tensor| -> Result<Tensor> {
                let norm = t.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
                t.broadcast_div(&norm.clamp(NORMALIZE_EPS, f64::INFINITY)?)
            };
            let (q, k, v) = (unit(rows(0)?)?, unit(rows(1)?)?, rows(2)?);
            let scores = q.matmul(&k.t()?.contiguous()?)?.broadcast_mul(temp)?;
            let p = candle_nn::ops::softmax_last_dim(&scores)?;
            p.matmul(&v)?
                .permute((0, 3, 1, 2))?
                .contiguous()?
                .reshape((b, n, c))?
        };
        self.proj.forward(&attended)?.reshape((b, h, w, c))
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let n = layer_norm(&self.n1, x)?;
        let conv = self.conv.forward_gelu_if(&n, true)?;
        let fused = match &self.attention {
            Attention::Spatial {
                bias,
                table,
                window,
            } => {
                let a = self.spatial(&n, (bias, table.as_ref()), *window)?;
                // The convolution's mean gives the attention a gate per channel.
                let (w1, w3) = &self.channel_gate;
                let pooled = mean_hw(&conv)?.reshape((b, c))?;
                let gate = gelu_erf(&pooled.matmul(w1)?)?.matmul(w3)?;
                let gate = candle_nn::ops::sigmoid(&gate)?.reshape((b, 1, 1, c))?;
                add(&a.broadcast_mul(&gate)?, &conv)?
            }
            Attention::Channel { temp, host } => {
                let a = self.channel(&n, temp, host)?;
                // The attention gives the convolution a gate per token.
                let gate = a.reshape((b * h * w, c))?.matmul(&self.spatial_gate)?;
                let gate = candle_nn::ops::sigmoid(&gate)?.reshape((b, h, w, 1))?;
                add(&a, &conv.broadcast_mul(&gate)?)?
            }
        };
        let x = add(x, &fused)?;
        let hidden = self.fc1.forward_gelu(&layer_norm(&self.n2, &x)?)?;
        let mixed = self.smix.forward_gelu_if(&hidden, false)?;
        self.fc2.forward_residual(&mixed, &x)
    }
}

struct Group {
    blocks: Vec<Block>,
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

/// The upsampler, built.
enum Up {
    Conv(Conv3x3),
    Direct(Conv3x3, usize),
    Shuffle {
        first: Conv3x3,
        stages: Vec<Conv3x3>,
        factor: usize,
        last: Conv3x3,
    },
    Nearest {
        stages: Vec<Conv3x3>,
        factor: usize,
        hr: Conv3x3,
        last: Conv3x3,
    },
    DySample(Option<Conv3x3>, DySample),
    Transposed(Vec<Deconv>, Conv3x3),
    /// Per stage: the 3x3 after the nearest upsampling, the pixel attention's 1x1 and the
    /// second 3x3.
    Pa {
        stages: Vec<(Conv3x3, Dense, Conv3x3)>,
        factor: usize,
        last: Conv3x3,
    },
}

impl Up {
    fn new(cfg: &FdatConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (d, o, m, s) = (cfg.embed_dim, cfg.out_channels, cfg.mid_dim, cfg.up_scale());
        let conv = |cin, cout, i: usize| Conv3x3::unpadded(cin, cout, plan, vb.pp(i.to_string()));
        let (factor, k) = cfg.stages();
        Ok(match cfg.upsampler {
            Upsampler::Conv => Self::Conv(conv(d, o, 0)?),
            Upsampler::PixelShuffleDirect => Self::Direct(
                Conv3x3::shuffled_with_bias(d, (o, s), true, plan, vb.pp("0"))?,
                s,
            ),
            Upsampler::PixelShuffle => Self::Shuffle {
                first: conv(d, m, 0)?,
                stages: (0..k)
                    .map(|i| {
                        let vb = vb.pp((2 + 2 * i).to_string());
                        Conv3x3::shuffled_with_bias(m, (m, factor), true, plan, vb)
                    })
                    .collect::<Result<_>>()?,
                factor,
                last: conv(m, o, 2 + 2 * k)?,
            },
            Upsampler::NearestConv => Self::Nearest {
                stages: (0..k).map(|i| conv(d, d, 3 * i)).collect::<Result<_>>()?,
                factor,
                hr: conv(d, d, 3 * k)?,
                last: conv(d, o, 3 * k + 2)?,
            },
            Upsampler::DySample => {
                let pre = cfg.dysample_pre();
                let at = if pre { 2 } else { 0 };
                Self::DySample(
                    pre.then(|| conv(d, m, 0)).transpose()?,
                    DySample::new(
                        (m, o),
                        (s, cfg.dysample_groups),
                        true,
                        plan,
                        vb.pp(at.to_string()),
                    )?,
                )
            }
            Upsampler::TransposeConv => {
                let t = |cio, ksp, i: &str| Deconv::new(cio, ksp, plan, vb.pp(i));
                let ts = match s {
                    2 => vec![t((d, o), (4, 2, 1), "0")?],
                    3 => vec![t((d, o), (3, 3, 0), "0")?],
                    _ => vec![t((d, d), (4, 2, 1), "0")?, t((d, o), (4, 2, 1), "2")?],
                };
                let last = conv(o, o, ts.len() * 2 - 1)?;
                Self::Transposed(ts, last)
            }
            Upsampler::PaUp => Self::Pa {
                stages: (0..k)
                    .map(|i| {
                        let cin = if i == 0 { d } else { m };
                        let pa = vb.pp(format!("{}.conv.0", 6 * i + 2));
                        Ok((
                            conv(cin, m, 6 * i + 1)?,
                            pointwise_with(m, m, plan, pa)?,
                            conv(m, m, 6 * i + 4)?,
                        ))
                    })
                    .collect::<Result<_>>()?,
                factor,
                last: conv(m, o, 6 * k)?,
            },
        })
    }

    /// `y` `(B, H, W, D)` to `(B, sH, sW, out)`.
    fn forward(&self, y: &Tensor) -> Result<Tensor> {
        let leaky = |slope| Act::Leaky(slope);
        match self {
            Self::Conv(c) => c.forward(y),
            Self::Direct(c, s) => c.forward_shuffled(y, *s),
            Self::Shuffle {
                first,
                stages,
                factor,
                last,
            } => {
                let mut y = first.forward_act(y, leaky(SLOPE_DEFAULT))?;
                for stage in stages {
                    y = stage.forward_shuffled(&y, *factor)?;
                }
                last.forward(&y)
            }
            Self::Nearest {
                stages,
                factor,
                hr,
                last,
            } => {
                let mut y = y.clone();
                for stage in stages {
                    y = nearest(&stage.forward_act(&y, leaky(SLOPE))?, *factor)?;
                }
                last.forward(&hr.forward_act(&y, leaky(SLOPE))?)
            }
            Self::DySample(pre, dys) => match pre {
                Some(pre) => dys.forward(&pre.forward_act(y, leaky(SLOPE_DEFAULT))?),
                None => dys.forward(y),
            },
            Self::Transposed(ts, last) => {
                let mut y = ts[0].forward(y)?;
                for t in &ts[1..] {
                    y = t.forward(&gelu_erf(&y)?)?;
                }
                last.forward(&y)
            }
            Self::Pa {
                stages,
                factor,
                last,
            } => {
                let mut y = y.clone();
                for (a, pa, b) in stages {
                    let t = a.forward(&nearest(&y, *factor)?)?;
                    let t = Act::Modulate(&t).apply(&pa.forward(&t)?)?;
                    let t = leaky(SLOPE).apply(&t)?;
                    y = b.forward_act(&t, leaky(SLOPE))?;
                }
                last.forward(&y)
            }
        }
    }
}

pub struct Fdat {
    conv_first: Conv3x3,
    groups: Vec<Group>,
    conv_after: Conv3x3,
    up: Up,
    unshuffle: usize,
    scale: usize,
    dtype: DType,
}

impl Fdat {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &FdatConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (d, u) = (cfg.embed_dim, cfg.unshuffle);
        let first = if u > 1 { "conv_first.1" } else { "conv_first" };
        let groups = build_layers(vb.device(), cfg.groups, |g| {
            let vb = vb.pp(format!("groups.{g}"));
            Ok(Group {
                blocks: (0..2 * cfg.depth)
                    .map(|b| Block::new(cfg, b % 2 == 0, plan, vb.pp(format!("blocks.{b}"))))
                    .collect::<Result<_>>()?,
                conv: Conv3x3::load_with_bias(d, d, false, plan, vb.pp("conv"))?,
            })
        })?;
        Ok(Self {
            conv_first: Conv3x3::unpadded(cfg.in_channels * u * u, d, plan, vb.pp(first))?,
            groups,
            conv_after: Conv3x3::load_with_bias(d, d, false, plan, vb.pp("conv_after"))?,
            up: Up::new(cfg, plan, vb.pp("upsampler"))?,
            unshuffle: u,
            scale: cfg.scale,
            dtype: vb.dtype(),
        })
    }
}

impl Net for Fdat {
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for Fdat {
    /// `x`: `(B, C, H, W)` in [0, 1], any H and W; returns `(B, C, sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (x, (h, w)) = padded_nhwc(x, self.dtype, self.unshuffle)?;
        let mut x = x.contiguous()?;
        if self.unshuffle > 1 {
            x = pixel_unshuffle(&x, self.unshuffle)?;
        }
        let shallow = self.conv_first.forward(&x)?;
        let mut t = shallow.clone();
        for group in &self.groups {
            t = group.forward(&t)?;
        }
        let deep = self.conv_after.forward_residual(&t, 1.0, &shallow)?;
        let y = self.up.forward(&deep)?;
        crop_nchw(&y, (h * self.scale, w * self.scale))
    }
}

/// FDAT's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "FDAT"
    }

    fn loads(&self) -> &'static str {
        "tiny to XL; every upsampler but LDA"
    }

    /// The blocks' channel gate under `groups.N.blocks.M.inter` and the upsampler's
    /// description, as the reference loader detects it.
    fn detect(&self, shapes: &Shapes) -> bool {
        shapes.contains_key(META) && shapes.contains_key("groups.0.blocks.0.inter.cg.1.weight")
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        Self::config(shapes, &|_| None)
    }

    fn infer_with(
        &self,
        shapes: &Shapes,
        beyond: &Beyond,
    ) -> std::result::Result<ArchConfig, ConfigError> {
        Self::config(shapes, beyond.values)
    }
}

impl Arch {
    fn config(shapes: &Shapes, values: Values) -> std::result::Result<ArchConfig, ConfigError> {
        match FdatConfig::infer(shapes, values) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::Fdat(Box::new(e))),
        }
    }
}
