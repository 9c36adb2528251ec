//! OmniSR (Omni Aggregation Networks for Lightweight Image Super-Resolution, Wang et al.,
//! CVPR 2023), inference only.
//!
//! The network, as the released code defines it (`residual_layer` holds the groups, each
//! group's own `residual_layer` its blocks and a 1x1 convolution):
//!
//! ```text
//! x  = zero-pad x to a multiple of the window
//! t0 = input(x)                                     3x3, 3 -> F
//! for each group:                                   t = esa(conv1x1(blocks(t)) + t)
//!   for each block (`layer.0` .. `layer.12`):
//!     t = t + pw(se(gelu(dw(gelu(pw(t))))))         0: MBConv, squeeze-excitation F/4
//!     t = t + attention(ln(t)) over w x w blocks    2: heads of F/4, position bias
//!     t = t + gcff(ln2d(t))                         4
//!     t = t + channel_attention(ln2d(t)) per block  5: 4 heads, per w x w block
//!     t = t + gcff(ln2d(t))                         6
//!     t = t + attention(ln(t)) over a grid          8: w x w tokens H/w apart
//!     t = t + gcff(ln2d(t))                         10
//!     t = t + channel_attention(ln2d(t)) per grid   11: the tokens w apart
//!     t = t + gcff(ln2d(t))                         12
//! y  = PixelShuffle(s)(up.0(output(t) + t0)), cropped to sH x sW
//! ```
//!
//! `gcff` is the gated convolutional feed-forward: 1x1 to 2F, a depthwise 3x3, `gelu(first
//! half) · second half`, 1x1 back, no biases. The channel attention takes q, k, v from a 1x1
//! and a depthwise 3x3, normalises q and k over a group's tokens and attends between
//! channels with a learned temperature per head. ESA (enhanced spatial attention): a 1x1 to
//! `max(F/4, 16)` channels, a strided 3x3, a 7x7 max pool with stride 3, a 3x3, a bilinear
//! upscale back to the map's size, plus a 1x1 of the first map, a 1x1 back to F, and the
//! map multiplied by its sigmoid.
//!
//! The grid attentions and ESA reach across the whole image, so a tile's output differs
//! from the whole image's: the tile planner keeps such a model's images whole where memory
//! allows ([`NetConfig::whole_input_matters`]). The reference needs a padded side of 15
//! or more (ESA's pooling); smaller images are padded with zeros up to that here.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::infer::{check_shapes, isqrt, out_width, tensor, ConfigError, Shapes};
use crate::nets::registry::Architecture;
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::attention::channel::channel_attention;
use crate::ops::attention::Attend;
use crate::ops::conv::depthwise::Depthwise3x3;
use crate::ops::conv::Conv3x3;
use crate::ops::cpu::{gelu_gate, modulate};
use crate::ops::linear::Dense;
use crate::ops::norm::{layer_norm, Norm};
use crate::ops::pad::Pad;
use crate::ops::windows::WindowCache;
use crate::ops::{build_layers, mean_hw, scale_leading, LoadPlan};

/// Image channels in and out: only RGB models run.
const CHANNELS: usize = 3;
/// `nn.LayerNorm`'s epsilon (the attentions' pre-norms).
const LN_EPS: f64 = 1e-5;
/// `LayerNorm2d`'s epsilon (the convolutional blocks' pre-norms).
const LN2D_EPS: f64 = 1e-6;
/// F.normalize's floor on a norm.
const NORMALIZE_EPS: f64 = 1e-12;
/// Heads of the channel attentions (fixed in the reference), and the spatial attentions'
/// (`dim_head` is F/4).
const HEADS: usize = 4;
/// The window of a file without position biases: the reference loader's default.
const DEFAULT_WINDOW: usize = 8;
/// The least padded side ESA's strided convolution and 7x7 pooling take.
const MIN_SIDE: usize = 15;
/// Tensors some released files carry from a FLOP counter; the reference loader drops them.
const COUNTER_SUFFIXES: [&str; 2] = ["total_ops", "total_params"];

/// OmniSR's configuration, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OmniSrConfig {
    /// Feature channels (`num_feat`).
    pub features: usize,
    /// Residual groups (`res_num`).
    pub groups: usize,
    /// Blocks per group (`block_num`).
    pub blocks: usize,
    /// Attention window side (`window_size`).
    pub window: usize,
    /// Whether the spatial attentions have a relative position bias (`pe`).
    pub position_bias: bool,
    /// Whether the outer convolutions and each group's 1x1 have biases (`bias`).
    pub bias: bool,
    pub scale: usize,
    pub in_channels: usize,
    pub out_channels: usize,
}

impl OmniSrConfig {
    /// The configuration read from the tensor names and shapes, every tensor checked (the
    /// FLOP counter's tensors some files carry are ignored, as the reference does).
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let input = tensor(shapes, "input.weight")?;
        let (features, in_channels) = match input {
            [f, c, 3, 3] if *f > 0 && *c > 0 => (*f, *c),
            _ => {
                return Err(ConfigError::shape(
                    "input.weight",
                    input,
                    "; expected (F, C, 3, 3)",
                ))
            }
        };
        if !features.is_multiple_of(HEADS) {
            return Err(ConfigError::shape(
                "input.weight",
                input,
                format!(": {features} features do not split into {HEADS} heads"),
            ));
        }
        let up = out_width(shapes, "up.0.weight")?;
        // The output channels are the input's where that gives a square scale, as the
        // reference loader reads them.
        let (scale, out_channels) = [in_channels, 3, 1, 4]
            .into_iter()
            .find_map(|c| {
                let s = isqrt(up / c);
                (up.is_multiple_of(c) && s > 0 && s * s * c == up).then_some((s, c))
            })
            .ok_or_else(|| {
                ConfigError::shape("up.0.weight", &shapes["up.0.weight"], ": not C x scale²")
            })?;
        let count = |name: &dyn Fn(usize) -> String| {
            (0..).take_while(|&i| shapes.contains_key(&name(i))).count()
        };
        let groups = count(&|g| format!("residual_layer.{g}.esa.conv1.weight"));
        let blocks = count(&|j| format!("residual_layer.0.residual_layer.{j}.layer.0.fn.0.weight"));
        if groups == 0 || blocks == 0 {
            return Err(ConfigError::missing(
                "residual_layer.0.residual_layer.0.layer.0.fn.0.weight",
                " (no blocks)",
            ));
        }
        let bias_table = "residual_layer.0.residual_layer.0.layer.2.fn.rel_pos_bias.weight";
        let (window, position_bias) = match shapes.get(bias_table) {
            Some(s) => {
                // A scalar or empty table is refused here, never indexed.
                let rows = s.first().copied().unwrap_or(0);
                let side = isqrt(rows);
                if s.len() != 2 || side * side != rows || side.is_multiple_of(2) {
                    return Err(ConfigError::shape(
                        bias_table,
                        s,
                        "; expected ((2w - 1)², heads)",
                    ));
                }
                (side.div_ceil(2), true)
            }
            None => (DEFAULT_WINDOW, false),
        };
        let cfg = OmniSrConfig {
            features,
            groups,
            blocks,
            window,
            position_bias,
            bias: shapes.contains_key("input.bias"),
            scale,
            in_channels,
            out_channels,
        };
        let kept: Shapes = shapes
            .iter()
            .filter(|(k, _)| !COUNTER_SUFFIXES.iter().any(|s| k.ends_with(s)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        check_shapes(&cfg.expected_tensors(), &kept, " (not an OmniSR tensor)")?;
        Ok(cfg)
    }

    /// ESA's channels.
    fn esa_channels(&self) -> usize {
        (self.features / 4).max(16)
    }

    /// The padded side for a side of `n`: a multiple of the window, and at least what ESA
    /// takes.
    fn padded(&self, n: usize) -> usize {
        n.max(MIN_SIDE).next_multiple_of(self.window)
    }
}

/// A 1x1 convolution as a linear layer over channels-last tokens, with its bias or a zero
/// one; `scale` multiplies the first `scaled` outputs (weights and bias).
fn pointwise(
    (cin, cout): (usize, usize),
    bias: bool,
    (scaled, scale): (usize, f64),
    plan: &LoadPlan,
    vb: VarBuilder,
) -> Result<Dense> {
    let w = match vb.get((cout, cin, 1, 1), "weight") {
        Ok(w) => w.reshape((cout, cin))?,
        // `nn.Linear`'s weight (the spatial attentions').
        Err(_) => vb.get((cout, cin), "weight")?,
    };
    let b = match bias {
        true => vb.get(cout, "bias")?,
        false => Tensor::zeros(cout, vb.dtype(), vb.device())?,
    };
    Dense::new(
        scale_leading(&w, scaled, scale)?,
        scale_leading(&b, scaled, scale)?,
        plan,
    )
}

/// A bias-free 1x1 convolution or linear layer.
fn plain(cin: usize, cout: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<Dense> {
    pointwise((cin, cout), false, (0, 1.0), plan, vb)
}

/// How a map's tokens are grouped for an attention.
#[derive(Clone, Copy)]
enum Grouping {
    /// Contiguous `s x s` blocks, tokens in row order.
    Blocks(usize),
    /// The tokens `a` rows and `b` columns apart, one group per offset: each group one
    /// token of every `a x b` block, in the blocks' row order.
    Grid(usize, usize),
}

impl Grouping {
    /// `(B, H, W, C)` into `(groups, tokens, C)`.
    fn gather(self, x: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let (a, bb) = self.split();
        let t = x.reshape((b, h / a, a, w / bb, bb, c))?;
        let (t, tokens) = match self {
            Grouping::Blocks(_) => (t.permute((0, 1, 3, 2, 4, 5))?, a * bb),
            Grouping::Grid(..) => (t.permute((0, 2, 4, 1, 3, 5))?, (h / a) * (w / bb)),
        };
        t.contiguous()?.reshape(((), tokens, c))
    }

    /// [`Self::gather`]'s inverse, back to `(b, h, w, C)`.
    fn scatter(self, x: &Tensor, (b, h, w): (usize, usize, usize)) -> Result<Tensor> {
        let c = x.dim(D::Minus1)?;
        let (a, bb) = self.split();
        let t = match self {
            Grouping::Blocks(_) => x
                .reshape((b, h / a, w / bb, a, bb, c))?
                .permute((0, 1, 3, 2, 4, 5))?,
            Grouping::Grid(..) => x
                .reshape((b, a, bb, h / a, w / bb, c))?
                .permute((0, 3, 1, 4, 2, 5))?,
        };
        t.contiguous()?.reshape((b, h, w, c))
    }

    /// The map's rows and columns as `(H/a, a)` and `(W/b, b)`.
    fn split(self) -> (usize, usize) {
        match self {
            Grouping::Blocks(s) => (s, s),
            Grouping::Grid(a, b) => (a, b),
        }
    }
}

/// MBConv (expansion 1): 1x1, GELU, depthwise 3x3, GELU, squeeze-excitation, 1x1, plus
/// the input.
struct MbConv {
    expand: Dense,
    dw: Depthwise3x3,
    squeeze: (Dense, Dense),
    project: Dense,
}

impl MbConv {
    fn new(f: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let cpu_f32 = LoadPlan::default();
        Ok(Self {
            expand: pointwise((f, f), true, (0, 1.0), plan, vb.pp("0"))?,
            dw: Depthwise3x3::load(f, true, vb.pp("2"))?,
            // One token per image: kept in f32 whatever the plan, as HAT's channel attention.
            squeeze: (
                plain(f, f / 4, &cpu_f32, vb.pp("4.gate.1"))?,
                plain(f / 4, f, &cpu_f32, vb.pp("4.gate.3"))?,
            ),
            project: pointwise((f, f), true, (0, 1.0), plan, vb.pp("5"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self
            .dw
            .forward_gelu_if(&self.expand.forward_gelu(x)?, true)?;
        let s = mean_hw(&h)?;
        let g = candle_nn::ops::silu(&self.squeeze.0.forward(&s)?)?;
        let g = candle_nn::ops::sigmoid(&self.squeeze.1.forward(&g)?)?;
        self.project.forward_residual(&h.broadcast_mul(&g)?, x)
    }
}

/// Multi-head self-attention within groups of `window²` tokens, with a relative position
/// bias (zero in files without one), after a LayerNorm; the output added to the input.
struct SpatialAttention {
    norm: Norm,
    qkv: Dense,
    out: Dense,
    attend: Attend,
    windows: WindowCache,
    window: usize,
    grid: bool,
}

impl SpatialAttention {
    fn new(cfg: &OmniSrConfig, grid: bool, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (f, w) = (cfg.features, cfg.window);
        let d = f / HEADS;
        let fnv = vb.pp("fn");
        let rows = (2 * w - 1) * (2 * w - 1);
        let table = match cfg.position_bias {
            true => fnv.pp("rel_pos_bias").get((rows, HEADS), "weight")?,
            false => Tensor::zeros((rows, HEADS), vb.dtype(), vb.device())?,
        };
        // dim_head^-0.5 folded into the query rows.
        let scale = (d as f64).powf(-0.5);
        Ok(Self {
            norm: Norm::load(&Pad::OFF.one(f), LN_EPS, vb.pp("norm"))?,
            qkv: pointwise((f, 3 * f), false, (f, scale), plan, fnv.pp("to_qkv"))?,
            out: plain(f, f, plan, fnv.pp("to_out.0"))?,
            attend: Attend::new(&table, HEADS, d, w, plan)?,
            windows: WindowCache::new(w, vb.dtype(), vb.device()),
            window: w,
            grid,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, w, _) = x.dims4()?;
        let s = self.window;
        let grouping = match self.grid {
            true => Grouping::Grid(h / s, w / s),
            false => Grouping::Blocks(s),
        };
        let tokens = grouping.gather(&layer_norm(&self.norm, x)?)?;
        let attended =
            self.attend
                .forward(&self.qkv.forward(&tokens)?, (h, w), false, &self.windows)?;
        // The projection is per token: made after the scatter, it adds onto the residual.
        self.out
            .forward_residual(&grouping.scatter(&attended, (b, h, w))?, x)
    }
}

/// Channel attention within groups of tokens (`window x window` blocks, or the tokens
/// `window` apart), after a LayerNorm2d; the output added to the input.
struct ChannelAttention {
    norm: Norm,
    qkv: Dense,
    dw: Depthwise3x3,
    temperature: Tensor,
    project: Dense,
    window: usize,
    grid: bool,
}

impl ChannelAttention {
    fn new(cfg: &OmniSrConfig, grid: bool, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let f = cfg.features;
        let fnv = vb.pp("fn");
        Ok(Self {
            norm: Norm::load(&Pad::OFF.one(f), LN2D_EPS, vb.pp("norm"))?,
            qkv: plain(f, 3 * f, plan, fnv.pp("qkv"))?,
            dw: Depthwise3x3::load(3 * f, false, fnv.pp("qkv_dwconv"))?,
            temperature: fnv.get((HEADS, 1, 1), "temperature")?,
            project: plain(f, f, plan, fnv.pp("project_out"))?,
            window: cfg.window,
            grid,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let s = self.window;
        let grouping = match self.grid {
            true => Grouping::Grid(s, s),
            false => Grouping::Blocks(s),
        };
        let qkv = self
            .dw
            .forward_gelu_if(&self.qkv.forward(&layer_norm(&self.norm, x)?)?, false)?;
        let groups = grouping.gather(&qkv)?;
        let attended = if self.dw.takes(&groups) {
            let temperature: Vec<f32> = self.temperature.flatten_all()?.to_vec1()?;
            channel_attention(&groups, HEADS, &temperature, NORMALIZE_EPS as f32)?
        } else {
            self.graph(&groups, c)?
        };
        let y = grouping.scatter(&attended, (b, h, w))?;
        self.project.forward_residual(&y, x)
    }

    /// The attention on candle's operations: `groups` `(G, N, 3C)` into `(G, N, C)`.
    fn graph(&self, groups: &Tensor, c: usize) -> Result<Tensor> {
        let (g, n, _) = groups.dims3()?;
        let d = c / HEADS;
        // (G, heads, d, N): each head's channels as rows over the group's tokens.
        let rows = |j: usize| {
            groups
                .narrow(2, j * c, c)?
                .reshape((g, n, HEADS, d))?
                .permute((0, 2, 3, 1))?
                .contiguous()
        };
        let unit = |t: Tensor| -> Result<Tensor> {
            let norm = t.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
            t.broadcast_div(&norm.clamp(NORMALIZE_EPS, f64::INFINITY)?)
        };
        let (q, k, v) = (unit(rows(0)?)?, unit(rows(1)?)?, rows(2)?);
        let scores = q
            .matmul(&k.t()?.contiguous()?)?
            .broadcast_mul(&self.temperature)?;
        let p = candle_nn::ops::softmax_last_dim(&scores)?;
        p.matmul(&v)?
            .permute((0, 3, 1, 2))?
            .contiguous()?
            .reshape((g, n, c))
    }
}

/// The gated convolutional feed-forward after a LayerNorm2d; its output added to the input.
struct Gcff {
    norm: Norm,
    project_in: Dense,
    dw: Depthwise3x3,
    project_out: Dense,
}

impl Gcff {
    fn new(f: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let fnv = vb.pp("fn");
        Ok(Self {
            norm: Norm::load(&Pad::OFF.one(f), LN2D_EPS, vb.pp("norm"))?,
            project_in: plain(f, 2 * f, plan, fnv.pp("project_in"))?,
            dw: Depthwise3x3::load(2 * f, false, fnv.pp("dwconv"))?,
            project_out: plain(f, f, plan, fnv.pp("project_out"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.project_in.forward(&layer_norm(&self.norm, x)?)?;
        let h = self.dw.forward_gelu_if(&h, false)?;
        self.project_out.forward_residual(&gelu_gate(&h)?, x)
    }
}

/// One OSA block (see the module's account).
struct Block {
    mbconv: MbConv,
    attention: SpatialAttention,
    ffn: [Gcff; 4],
    channel: ChannelAttention,
    grid_attention: SpatialAttention,
    grid_channel: ChannelAttention,
}

impl Block {
    fn new(cfg: &OmniSrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let f = cfg.features;
        let l = vb.pp("layer");
        let ffn = |i: usize| Gcff::new(f, plan, l.pp(i));
        Ok(Self {
            mbconv: MbConv::new(f, plan, l.pp("0.fn"))?,
            attention: SpatialAttention::new(cfg, false, plan, l.pp("2"))?,
            ffn: [ffn(4)?, ffn(6)?, ffn(10)?, ffn(12)?],
            channel: ChannelAttention::new(cfg, false, plan, l.pp("5"))?,
            grid_attention: SpatialAttention::new(cfg, true, plan, l.pp("8"))?,
            grid_channel: ChannelAttention::new(cfg, true, plan, l.pp("11"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.mbconv.forward(x)?;
        let x = self.attention.forward(&x)?;
        let x = self.ffn[0].forward(&x)?;
        let x = self.channel.forward(&x)?;
        let x = self.ffn[1].forward(&x)?;
        let x = self.grid_attention.forward(&x)?;
        let x = self.ffn[2].forward(&x)?;
        let x = self.grid_channel.forward(&x)?;
        self.ffn[3].forward(&x)
    }
}

/// Enhanced spatial attention: the map times a sigmoid computed at reduced resolution.
struct Esa {
    conv1: Dense,
    conv_f: Dense,
    /// The strided and the small 3x3 convolutions, `(f, f, 3, 3)` with their biases, run on
    /// candle's convolution (maps a sixth of the image's side).
    conv2: (Tensor, Tensor),
    conv3: (Tensor, Tensor),
    conv4: Dense,
}

impl Esa {
    fn new(cfg: &OmniSrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (n, f) = (cfg.features, cfg.esa_channels());
        let conv = |vb: VarBuilder| -> Result<(Tensor, Tensor)> {
            Ok((vb.get((f, f, 3, 3), "weight")?, vb.get(f, "bias")?))
        };
        Ok(Self {
            conv1: pointwise((n, f), true, (0, 1.0), plan, vb.pp("conv1"))?,
            conv_f: pointwise((f, f), true, (0, 1.0), plan, vb.pp("conv_f"))?,
            conv2: conv(vb.pp("conv2"))?,
            conv3: conv(vb.pp("conv3"))?,
            conv4: pointwise((f, n), true, (0, 1.0), plan, vb.pp("conv4"))?,
        })
    }

    /// `x`: `(B, H, W, F)` with H and W at least [`MIN_SIDE`].
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, h, w, _) = x.dims4()?;
        let c1 = self.conv1.forward(x)?;
        let nchw = c1.permute((0, 3, 1, 2))?.contiguous()?;
        let bias = |b: &Tensor| b.reshape((1, (), 1, 1));
        let reduced = nchw
            .conv2d(&self.conv2.0, 0, 2, 1, 1)?
            .broadcast_add(&bias(&self.conv2.1)?)?;
        let pooled = reduced.max_pool2d_with_stride(7, 3)?;
        let c3 = pooled
            .conv2d(&self.conv3.0, 1, 1, 1, 1)?
            .broadcast_add(&bias(&self.conv3.1)?)?;
        let up = bilinear(&c3, (h, w))?.permute((0, 2, 3, 1))?.contiguous()?;
        let cf = self.conv_f.forward(&c1)?;
        modulate(&self.conv4.forward(&(up + cf)?)?, x)
    }
}

/// The weights of PyTorch's bilinear resize (`align_corners=False`) from `n` to `m` samples,
/// `(m, n)`: row `i` holds the two weights of output `i`'s neighbours.
fn bilinear_weights(n: usize, m: usize) -> Vec<f64> {
    let mut w = vec![0f64; m * n];
    let scale = n as f64 / m as f64;
    for (i, row) in w.chunks_exact_mut(n).enumerate() {
        let src = ((i as f64 + 0.5) * scale - 0.5).max(0.0);
        let i0 = (src.floor() as usize).min(n - 1);
        let i1 = (i0 + 1).min(n - 1);
        let l = src - i0 as f64;
        row[i0] += 1.0 - l;
        row[i1] += l;
    }
    w
}

/// `x` `(B, C, h, w)` resized to `(B, C, H, W)` as PyTorch's bilinear mode does without
/// aligned corners: two products with the interpolation weights, on any device.
fn bilinear(x: &Tensor, (h, w): (usize, usize)) -> Result<Tensor> {
    let (_, _, hi, wi) = x.dims4()?;
    let weights = |n, m| -> Result<Tensor> {
        Tensor::from_vec(bilinear_weights(n, m), (m, n), &Device::Cpu)?
            .to_dtype(x.dtype())?
            .to_device(x.device())
    };
    let rows = weights(hi, h)?;
    let cols = weights(wi, w)?.t()?.contiguous()?;
    let across = x.broadcast_matmul(&cols)?;
    rows.broadcast_left(x.dims()[..2].to_vec())?
        .contiguous()?
        .matmul(&across.contiguous()?)
}

/// One residual group: its blocks, a 1x1 convolution onto the input, then ESA.
struct Group {
    blocks: Vec<Block>,
    conv: Dense,
    esa: Esa,
}

impl Group {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut u = x.clone();
        for b in &self.blocks {
            u = b.forward(&u)?;
        }
        self.esa.forward(&self.conv.forward_residual(&u, x)?)
    }
}

pub struct OmniSr {
    input: Conv3x3,
    groups: Vec<Group>,
    output: Conv3x3,
    /// The upsampling convolution, its outputs in PixelShuffle's (i, j, c) order above x1.
    up: Conv3x3,
    cfg: OmniSrConfig,
    dtype: DType,
}

impl OmniSr {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &OmniSrConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (f, s) = (cfg.features, cfg.scale);
        let conv =
            |cin, cout, vb: VarBuilder| Conv3x3::load_with_bias(cin, cout, cfg.bias, plan, vb);
        let vb_groups = vb.pp("residual_layer");
        let groups = build_layers(vb.device(), cfg.groups, |g| {
            let vg = vb_groups.pp(g);
            let inner = vg.pp("residual_layer");
            Ok(Group {
                blocks: (0..cfg.blocks)
                    .map(|j| Block::new(cfg, plan, inner.pp(j)))
                    .collect::<Result<_>>()?,
                conv: pointwise((f, f), cfg.bias, (0, 1.0), plan, inner.pp(cfg.blocks))?,
                esa: Esa::new(cfg, plan, vg.pp("esa"))?,
            })
        })?;
        let up = if s == 1 {
            conv(f, cfg.out_channels, vb.pp("up.0"))?
        } else {
            Conv3x3::shuffled_with_bias(f, (cfg.out_channels, s), cfg.bias, plan, vb.pp("up.0"))?
        };
        Ok(Self {
            input: conv(cfg.in_channels, f, vb.pp("input"))?,
            groups,
            output: conv(f, f, vb.pp("output"))?,
            up,
            cfg: cfg.clone(),
            dtype: vb.dtype(),
        })
    }
}

impl Net for OmniSr {
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for OmniSr {
    /// `x`: `(B, 3, H, W)` in [0, 1], any H and W; returns `(B, 3, sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, h, w) = x.dims4()?;
        let (hp, wp) = (self.cfg.padded(h), self.cfg.padded(w));
        let x = x
            .to_dtype(self.dtype)?
            .permute((0, 2, 3, 1))?
            .pad_with_zeros(1, 0, hp - h)?
            .pad_with_zeros(2, 0, wp - w)?
            .contiguous()?;
        let t0 = self.input.forward(&x)?;
        let mut t = t0.clone();
        for g in &self.groups {
            t = g.forward(&t)?;
        }
        let t = self.output.forward_residual(&t, 1.0, &t0)?;
        let s = self.cfg.scale;
        let y = match s {
            1 => self.up.forward(&t)?,
            _ => self.up.forward_shuffled(&t, s)?,
        };
        y.narrow(1, 0, h * s)?
            .narrow(2, 0, w * s)?
            .permute((0, 3, 1, 2))?
            .contiguous()
    }
}

/// OmniSR's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "OmniSR"
    }

    fn loads(&self) -> &'static str {
        "x1-x4, any window, with or without position bias"
    }

    /// The first block's MBConv, the input convolution and the upsampler, as the reference
    /// loader tells OmniSR apart.
    fn detect(&self, shapes: &Shapes) -> bool {
        [
            "residual_layer.0.residual_layer.0.layer.0.fn.0.weight",
            "input.weight",
            "up.0.weight",
        ]
        .iter()
        .all(|k| shapes.contains_key(*k))
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match OmniSrConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::OmniSr(Box::new(e))),
        }
    }
}

impl NetConfig for OmniSrConfig {
    /// Every tensor the configuration implies, with its shape.
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (f, e, w) = (self.features, self.esa_channels(), self.window);
        let mut t: Vec<(String, Vec<usize>)> = Vec::new();
        let mut push = |name: String, shape: Vec<usize>| t.push((name, shape));
        let conv = |push: &mut dyn FnMut(String, Vec<usize>),
                    name: &str,
                    shape: Vec<usize>,
                    bias: bool| {
            if bias {
                push(format!("{name}.bias"), vec![shape[0]]);
            }
            push(format!("{name}.weight"), shape);
        };
        conv(
            &mut push,
            "input",
            vec![f, self.in_channels, 3, 3],
            self.bias,
        );
        conv(&mut push, "output", vec![f, f, 3, 3], self.bias);
        let up = self.out_channels * self.scale * self.scale;
        conv(&mut push, "up.0", vec![up, f, 3, 3], self.bias);
        for g in 0..self.groups {
            let gp = format!("residual_layer.{g}");
            for j in 0..self.blocks {
                let l = format!("{gp}.residual_layer.{j}.layer");
                conv(&mut push, &format!("{l}.0.fn.0"), vec![f, f, 1, 1], true);
                conv(&mut push, &format!("{l}.0.fn.2"), vec![f, 1, 3, 3], true);
                push(format!("{l}.0.fn.4.gate.1.weight"), vec![f / 4, f]);
                push(format!("{l}.0.fn.4.gate.3.weight"), vec![f, f / 4]);
                conv(&mut push, &format!("{l}.0.fn.5"), vec![f, f, 1, 1], true);
                for i in [2, 8] {
                    conv(&mut push, &format!("{l}.{i}.norm"), vec![f], true);
                    push(format!("{l}.{i}.fn.to_qkv.weight"), vec![3 * f, f]);
                    push(format!("{l}.{i}.fn.to_out.0.weight"), vec![f, f]);
                    if self.position_bias {
                        let rows = (2 * w - 1) * (2 * w - 1);
                        push(format!("{l}.{i}.fn.rel_pos_bias.weight"), vec![rows, HEADS]);
                    }
                }
                for i in [4, 6, 10, 12] {
                    conv(&mut push, &format!("{l}.{i}.norm"), vec![f], true);
                    push(
                        format!("{l}.{i}.fn.project_in.weight"),
                        vec![2 * f, f, 1, 1],
                    );
                    push(format!("{l}.{i}.fn.dwconv.weight"), vec![2 * f, 1, 3, 3]);
                    push(format!("{l}.{i}.fn.project_out.weight"), vec![f, f, 1, 1]);
                }
                for i in [5, 11] {
                    conv(&mut push, &format!("{l}.{i}.norm"), vec![f], true);
                    push(format!("{l}.{i}.fn.temperature"), vec![HEADS, 1, 1]);
                    push(format!("{l}.{i}.fn.qkv.weight"), vec![3 * f, f, 1, 1]);
                    push(
                        format!("{l}.{i}.fn.qkv_dwconv.weight"),
                        vec![3 * f, 1, 3, 3],
                    );
                    push(format!("{l}.{i}.fn.project_out.weight"), vec![f, f, 1, 1]);
                }
            }
            let last = format!("{gp}.residual_layer.{}", self.blocks);
            conv(&mut push, &last, vec![f, f, 1, 1], self.bias);
            let esa = format!("{gp}.esa");
            conv(&mut push, &format!("{esa}.conv1"), vec![e, f, 1, 1], true);
            conv(&mut push, &format!("{esa}.conv_f"), vec![e, e, 1, 1], true);
            conv(&mut push, &format!("{esa}.conv2"), vec![e, e, 3, 3], true);
            conv(&mut push, &format!("{esa}.conv3"), vec![e, e, 3, 3], true);
            conv(&mut push, &format!("{esa}.conv4"), vec![f, e, 1, 1], true);
        }
        t
    }

    /// The multiply-adds of the convolutions, linear layers and attentions, x2 (norms,
    /// activations and ESA's reduced maps left out).
    fn flops(&self, h: usize, w: usize) -> f64 {
        let (f, e) = (self.features, self.esa_channels());
        let n = self.window * self.window;
        let mbconv = 2 * f * f + 9 * f;
        let spatial = 4 * f * f + 2 * n * f;
        let gcff = 3 * f * f + 18 * f;
        let channel = 4 * f * f + 27 * f + 2 * f * f / HEADS;
        let block = mbconv + 2 * spatial + 4 * gcff + 2 * channel;
        let group = self.blocks * block + f * f + 2 * f * e + e * e;
        let up = self.out_channels * self.scale * self.scale;
        let per_pixel = 9 * self.in_channels * f + self.groups * group + 9 * f * f + 9 * f * up;
        2.0 * (per_pixel * h * w) as f64
    }

    fn family(&self) -> &'static str {
        "OmniSR"
    }

    fn variant(&self) -> &'static str {
        "OmniSR"
    }

    fn scale(&self) -> usize {
        self.scale
    }

    fn window(&self) -> usize {
        self.window
    }

    fn describe(&self) -> serde_json::Value {
        json!({
            "scale": self.scale,
            "features": self.features,
            "groups": self.groups,
            "blocks_per_group": self.blocks,
            "window": self.window,
            "position_bias": self.position_bias,
            "bias": self.bias,
        })
    }

    fn widest_head_dim(&self) -> usize {
        self.features / HEADS
    }

    fn largest_tensor_per_pixel(&self, scores_in_memory: bool, _: Pad) -> usize {
        let scores = if scores_in_memory {
            HEADS * self.window * self.window
        } else {
            0
        };
        let up = self.out_channels * self.scale * self.scale;
        (3 * self.features).max(scores).max(up)
    }

    /// In a block: the input, its norm, qkv (3F), the grouped copy of qkv and the attended
    /// map; or the feed-forward's 2F hidden map, its convolution and the gated half. At the
    /// end the upsampling convolution's output and its shuffled copy.
    fn activations_per_pixel(&self, scores_in_memory: bool, _: Pad) -> f64 {
        let f = self.features as f64;
        let scores = if scores_in_memory {
            (HEADS * self.window * self.window) as f64
        } else {
            0.0
        };
        let up = (self.out_channels * self.scale * self.scale) as f64;
        (9.0 * f + 2.0 * scores).max(f + 2.0 * up)
    }

    fn refusal(&self) -> Option<String> {
        ((self.in_channels, self.out_channels) != (CHANNELS, CHANNELS)).then(|| {
            format!(
                "an OmniSR model with {} input and {} output channels: only RGB models \
                 (3 and 3) run",
                self.in_channels, self.out_channels
            )
        })
    }

    /// The grid attentions and ESA reach across the whole image.
    fn whole_input_matters(&self) -> bool {
        true
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(OmniSr::new(self, plan, vb)?))
    }
}
