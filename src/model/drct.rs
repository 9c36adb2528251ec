//! The DRCT network (Dense-Residual-Connected Transformer), inference only.
//!
//! One struct per layer of the official model, each built from a VarBuilder whose path is the
//! state-dict key. Features between layers are kept channels-last, `(B, H, W, C)`, so every
//! token-wise layer is one matmul over contiguous memory and the dense concatenations are
//! plain copies along the last axis.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};

use super::bf16::{Isa, PackedB};
use super::cache::{relative_position_bias, RelativeBias, WindowCache};
use super::config::{DrctConfig, BLOCKS_PER_GROUP};
use super::fused::{Attention, FusedWindowAttention};
use super::norm::{add_gather_norm, layer_norm, norm_gather, Norm};
use super::ops::After;
use super::pad_channels::{Channels, Pad};
use super::rowwise::{self, Act};

/// The RGB mean the official model subtracts (img_range 1.0); not stored in checkpoints.
pub(crate) const RGB_MEAN: [f32; 3] = [0.4488, 0.4371, 0.4040];
/// LayerNorm epsilon of torch's default, which the official model uses.
const LN_EPS: f64 = 1e-5;
/// Slope of the LeakyReLU inside residual dense groups.
const RDG_SLOPE: f64 = 0.2;
/// `nn.LeakyReLU()`'s default slope, used after `conv_before_upsample`.
pub(crate) const UPSAMPLE_SLOPE: f64 = 0.01;
/// Residual scaling of a group's output.
const RDG_RESIDUAL: f64 = 0.2;

fn load_norm(channels: &Channels, vb: VarBuilder) -> Result<Norm> {
    Norm::load(channels, LN_EPS, vb)
}

/// A layer norm over `dim` unpadded channels (the other Swin-family networks' norms).
pub(crate) fn load_layer_norm(dim: usize, vb: VarBuilder) -> Result<Norm> {
    load_norm(&Pad::OFF.one(dim), vb)
}

/// The channels of the input of block `k` of a group: the group's input, then each earlier
/// block's adjusted output, every part padded on its own so that the dense concatenation
/// places it at its padded offset.
fn block_channels(cfg: &DrctConfig, pad: Pad, k: usize) -> Channels {
    pad.one(cfg.embed_dim).then(&pad.parts(k, cfg.growth))
}

/// `w` with axis 0 spread as `rows` and axis 1 as `cols` ([`Channels::spread`]).
fn spread2(w: &Tensor, rows: &Channels, cols: &Channels) -> Result<Tensor> {
    cols.spread(&rows.spread(w, 0)?, 1)
}

/// Upper bound on the patch matrix of one convolution chunk, in elements (64 MiB in f32):
/// large enough for full-speed matmuls, small enough that a high-resolution upsampler
/// convolution never materialises gigabytes.
const CONV_CHUNK_ELEMS: usize = 16 << 20;

/// The same bound on a GPU (256 MiB in bf16): each chunk costs a dozen kernel launches, so
/// larger chunks keep a batch's upsampler to tens of launches instead of hundreds, and the
/// bound stays far below the 2³¹ elements that candle's CUDA kernels can index.
const CONV_CHUNK_ELEMS_GPU: usize = 128 << 20;

/// A 3x3 convolution (stride 1, zero padding 1) on channels-last features.
///
/// On the CPU the kernels of [`super::ops`] run it. Elsewhere the patch matrix of each chunk
/// of rows ([`rowwise::patches3x3`]: one kernel pass on CUDA) is fed to one matmul, with
/// memory bounded by `CONV_CHUNK_ELEMS` (`CONV_CHUNK_ELEMS_GPU` on a GPU) however large the
/// feature map; on CUDA the RGB output layer skips the patch matrix
/// ([`rowwise::conv3x3_narrow`]).
pub struct Conv3x3 {
    /// `(9 * cin, cout)`, rows ordered (dy, dx, cin) to match the patch matrix.
    weight: Tensor,
    bias: Tensor,
    cin: usize,
    /// The weight in bf16, for bf16 products on the CPU ([`Drct::use_bf16_products`]).
    bf16: Option<(Isa, PackedB)>,
}

impl Conv3x3 {
    /// The convolution stored under `vb`, reading `cin` (spread to its padded width) and
    /// writing `cout` channels; [`Self::spread_outputs`] pads those.
    pub fn new(cin: &Channels, cout: usize, vb: VarBuilder) -> Result<Self> {
        let w = cin.spread(&vb.get((cout, cin.real(), 3, 3), "weight")?, 1)?;
        let cin = cin.padded();
        let weight = w
            .permute((2, 3, 1, 0))?
            .reshape((9 * cin, cout))?
            .contiguous()?;
        Ok(Self {
            weight,
            bias: vb.get(cout, "bias")?,
            cin,
            bf16: None,
        })
    }

    /// The convolution stored under `vb` from `cin` to `cout` channels, none padded.
    pub(crate) fn unpadded(cin: usize, cout: usize, vb: VarBuilder) -> Result<Self> {
        Self::new(&Pad::OFF.one(cin), cout, vb)
    }

    /// The same convolution writing its outputs spread as `cout` says, zeros between.
    fn spread_outputs(self, cout: &Channels) -> Result<Self> {
        Ok(Self {
            weight: cout.spread(&self.weight, 1)?.contiguous()?,
            bias: cout.spread(&self.bias, 0)?,
            ..self
        })
    }

    /// Computes with bf16 products from now on and drops the f32 weight. Narrow
    /// convolutions (the RGB output) keep f32: they are computed directly, not as a GEMM.
    pub(crate) fn use_bf16(&mut self, isa: Isa) -> Result<()> {
        let (k, cout) = self.weight.dims2()?;
        if cout <= super::ops::NARROW_CONV {
            return Ok(());
        }
        self.bf16 = Some((isa, pack_bf16(&self.weight, (k, cout), (cout, 1))?));
        self.weight = Tensor::zeros(0, DType::F32, self.weight.device())?;
        Ok(())
    }

    /// The same convolution with output channel k computing the old channel `order[k]`.
    pub(crate) fn reorder_outputs(self, order: Vec<u32>) -> Result<Self> {
        let idx = Tensor::from_vec(order, self.bias.dim(0)?, self.bias.device())?;
        Ok(Self {
            weight: self.weight.index_select(&idx, 1)?,
            bias: self.bias.index_select(&idx, 0)?,
            ..self
        })
    }

    /// This convolution followed by PixelShuffle by `r`, its outputs being in (i, j, c)
    /// order ([`Self::reorder_outputs`] with [`shuffle_order`]). On the CPU the products are
    /// written into the shuffled layout directly.
    pub(crate) fn forward_shuffled(&self, x: &Tensor, r: usize) -> Result<Tensor> {
        let x = x.contiguous()?;
        let fused = match &self.bf16 {
            Some((isa, w)) => {
                super::ops::conv3x3_shuffled_bf16(&x, *isa, w, &self.bias, r, CONV_CHUNK_ELEMS)?
            }
            None => {
                super::ops::conv3x3_shuffled(&x, &self.weight, &self.bias, r, CONV_CHUNK_ELEMS)?
            }
        };
        match fused {
            Some(y) => Ok(y),
            None => pixel_shuffle_nhwc_reordered(&self.forward(&x)?, r),
        }
    }

    /// The same convolution with `shift` added to its bias.
    pub(crate) fn add_to_bias(self, shift: &Tensor) -> Result<Self> {
        Ok(Self {
            bias: (&self.bias + shift)?,
            ..self
        })
    }
}

impl Module for Conv3x3 {
    /// `x`: `(B, H, W, cin)`; returns `(B, H, W, cout)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some((isa, w)) = &self.bf16 {
            return super::ops::conv3x3_bf16(
                &x.contiguous()?,
                *isa,
                w,
                &self.bias,
                CONV_CHUNK_ELEMS,
            );
        }
        if let Some(y) =
            super::ops::conv3x3(&x.contiguous()?, &self.weight, &self.bias, CONV_CHUNK_ELEMS)?
        {
            return Ok(y);
        }
        let (b, h, w, c) = x.dims4()?;
        debug_assert_eq!(c, self.cin);
        if rowwise::ours(x) && self.bias.dim(0)? <= rowwise::NARROW_CONV_MAX {
            return rowwise::conv3x3_narrow(x, &self.weight, &self.bias);
        }
        let chunk = if x.device().is_cpu() {
            CONV_CHUNK_ELEMS
        } else {
            CONV_CHUNK_ELEMS_GPU
        };
        let rows = (chunk / (b * w * 9 * c).max(1)).clamp(1, h);
        let mut outs = Vec::with_capacity(h.div_ceil(rows));
        let mut y = 0;
        while y < h {
            let n = rows.min(h - y);
            let out = rowwise::patches3x3(x, y, n)?.matmul(&self.weight)?;
            let out = rowwise::bias_act(&out, &self.bias, None, Act::None)?;
            outs.push(out.reshape((b, n, w, ()))?);
            y += n;
        }
        if outs.len() == 1 {
            Ok(outs.remove(0))
        } else {
            Tensor::cat(&outs, 1)
        }
    }
}

/// PyTorch's PixelShuffle moves channel `c*r*r + i*r + j` of pixel (y, x) to pixel
/// (y*r + i, x*r + j), channel c. Feeding it a convolution whose output channels were put in
/// (i, j, c) order instead ([`shuffle_order`]) makes every moved run of channels contiguous,
/// so the shuffle copies blocks of `r * c` values rather than single elements.
fn pixel_shuffle_nhwc_reordered(x: &Tensor, r: usize) -> Result<Tensor> {
    if let Some(y) = super::ops::pixel_shuffle_reordered(x, r)? {
        return Ok(y);
    }
    let (b, h, w, c) = x.dims4()?;
    let c_out = c / (r * r);
    x.reshape((b, h, w, r, r, c_out))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((b, h * r, w * r, c_out))
}

/// For output channel `(i*r + j)*c_out + c` of the reordered convolution, the official
/// channel `c*r*r + i*r + j` it takes its weights from.
pub(crate) fn shuffle_order(c_out: usize, r: usize) -> Vec<u32> {
    let mut order = Vec::with_capacity(c_out * r * r);
    for ij in 0..r * r {
        for c in 0..c_out {
            order.push((c * r * r + ij) as u32);
        }
    }
    order
}

/// A linear layer (`nn.Linear` keys). On the CPU in f32 the bias is folded into the GEMM
/// ([`super::ops::linear`]), in bf16 the weights are packed for it; elsewhere it is candle's
/// layer.
pub enum Dense {
    Candle(Linear),
    Bf16 {
        isa: Isa,
        /// `(k, n)`: the weight transposed and packed.
        weight: PackedB,
        bias: Tensor,
    },
}

impl Dense {
    pub fn new(weight: Tensor, bias: Tensor) -> Self {
        Self::Candle(Linear::new(weight, Some(bias)))
    }

    /// The `nn.Linear` stored under `vb`, from `cin` to `cout` channels, both spread to
    /// their padded widths.
    pub fn load(cin: &Channels, cout: &Channels, vb: VarBuilder) -> Result<Self> {
        let w = vb.get((cout.real(), cin.real()), "weight")?;
        Ok(Self::new(
            spread2(&w, cout, cin)?,
            cout.spread(&vb.get(cout.real(), "bias")?, 0)?,
        ))
    }

    /// The `nn.Linear` stored under `vb`, from `cin` to `cout` channels, none padded.
    pub(crate) fn load_unpadded(cin: usize, cout: usize, vb: VarBuilder) -> Result<Self> {
        Self::load(&Pad::OFF.one(cin), &Pad::OFF.one(cout), vb)
    }

    /// Computes with bf16 products from now on; the f32 weight is dropped.
    pub(crate) fn use_bf16(&mut self, isa: Isa) -> Result<()> {
        if let Self::Candle(inner) = self {
            let (n, k) = inner.weight().dims2()?;
            let bias = match inner.bias() {
                Some(b) => b.to_dtype(DType::F32)?,
                None => Tensor::zeros(n, DType::F32, inner.weight().device())?,
            };
            *self = Self::Bf16 {
                isa,
                weight: pack_bf16(inner.weight(), (k, n), (1, k))?,
                bias,
            };
        }
        Ok(())
    }
}

impl Dense {
    /// `residual + self(x)`; on the CPU the GEMM accumulates onto the residual, so the sum
    /// costs no pass of its own.
    fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.forward_then(x, After::Residual(residual))
    }

    /// `gelu(self(x))`; on the CPU each block of output rows goes through the GELU as soon
    /// as the GEMM has finished it, while it is in cache.
    fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_then(x, After::Gelu)
    }

    /// `cat([prev, leaky_relu(self(x))], -1)`: the dense connection of a residual group.
    fn forward_cat_leaky(&self, x: &Tensor, prev: &Tensor) -> Result<Tensor> {
        if let (Self::Candle(inner), true) = (self, x.device().is_cuda()) {
            let y = unrows(&token_gemm(inner, x)?, prev)?;
            let act = Act::Leaky(RDG_SLOPE as f32);
            return rowwise::cat_bias_act(prev, &y, dense_bias(inner)?, act);
        }
        cat_leaky(prev, &self.forward(x)?)
    }

    /// `acc + self(x)` written into `acc`'s buffer, on CUDA in bf16 and f16 (see
    /// [`super::epilogue`]); `None` elsewhere. The caller gives `acc` up: every tensor that
    /// shares its storage sees the sum.
    fn accumulate_onto(&self, x: &Tensor, acc: Tensor) -> Result<Option<Tensor>> {
        let Self::Candle(inner) = self else {
            return Ok(None);
        };
        if !x.device().is_cuda() {
            return Ok(None);
        }
        let acc2 = rows(&acc)?;
        let done = super::epilogue::accumulate_linear_bias(
            &acc2,
            &rows(x)?,
            inner.weight(),
            dense_bias(inner)?,
        )?;
        done.then(|| acc2.reshape(acc.shape())).transpose()
    }

    fn forward_then(&self, x: &Tensor, after: After) -> Result<Tensor> {
        match self {
            Self::Candle(inner) if x.device().is_cuda() => {
                let bias = dense_bias(inner)?;
                let fused = match after {
                    After::Nothing => {
                        super::epilogue::linear_bias(&rows(x)?, inner.weight(), bias)?
                    }
                    After::Gelu if super::epilogue::gelu_epilogue() => {
                        super::epilogue::linear_bias_gelu(&rows(x)?, inner.weight(), bias)?
                    }
                    _ => None,
                };
                if let Some(y) = fused {
                    return unrows(&y, x);
                }
                let y = token_gemm(inner, x)?;
                let (residual, act) = match after {
                    After::Nothing => (None, Act::None),
                    After::Residual(r) => (Some(r.reshape(y.shape())?.contiguous()?), Act::None),
                    After::Gelu => (None, Act::Gelu),
                };
                let y = rowwise::bias_act(&y, bias, residual.as_ref(), act)?;
                unrows(&y, x)
            }
            Self::Candle(inner) => {
                if let Some(y) = super::ops::linear(x, inner.weight(), inner.bias(), after)? {
                    return Ok(y);
                }
                let y = inner.forward(x)?;
                match after {
                    After::Nothing => Ok(y),
                    After::Residual(r) => r + y,
                    // The official model uses nn.GELU(): the exact erf form.
                    After::Gelu => super::ops::gelu_erf(&y),
                }
            }
            Self::Bf16 { isa, weight, bias } => {
                let residual;
                let after = match after {
                    After::Residual(r) => {
                        residual = r.contiguous()?;
                        After::Residual(&residual)
                    }
                    other => other,
                };
                super::ops::linear_bf16(&x.contiguous()?, *isa, weight, bias, after)
            }
        }
    }
}

/// `t` `(.., c)` as the 2-D `(tokens, c)` its linear layers multiply.
fn rows(t: &Tensor) -> Result<Tensor> {
    let c = t.dim(D::Minus1)?;
    t.reshape((t.elem_count() / c.max(1), c))
}

/// `y` `(tokens, n)` back in the leading axes of `like` `(.., c)`: `(.., n)`.
fn unrows(y: &Tensor, like: &Tensor) -> Result<Tensor> {
    let mut dims = like.dims().to_vec();
    match dims.last_mut() {
        Some(last) => *last = y.dim(1)?,
        None => candle_core::bail!("a linear layer's input has a channel axis"),
    }
    y.reshape(dims)
}

/// `x · wᵀ` over all tokens of `x` `(.., cin)` as one 2-D GEMM: `(tokens, cout)`, without
/// the bias. candle's `Linear` would broadcast the weight over the leading axes (a batched
/// GEMM) and add the bias with its strided broadcast kernel.
fn token_gemm(inner: &Linear, x: &Tensor) -> Result<Tensor> {
    rows(x)?.matmul(&inner.weight().t()?)
}

fn dense_bias(inner: &Linear) -> Result<&Tensor> {
    match inner.bias() {
        Some(b) => Ok(b),
        None => candle_core::bail!("linear layers here always have a bias"),
    }
}

impl Module for Dense {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_then(x, After::Nothing)
    }
}

/// The `k x n` view `w[r * rs + c * cs]` of a CPU weight, packed for bf16 products; read in
/// place, without copying the weight out first.
fn pack_bf16(w: &Tensor, kn: (usize, usize), strides: (usize, usize)) -> Result<PackedB> {
    let w = w.to_dtype(DType::F32)?.contiguous()?;
    let (guard, layout) = w.storage_and_layout();
    let values = super::ops::cpu_slice(&guard, layout)?;
    Ok(PackedB::new(values, kn, strides))
}

/// A 1x1 convolution applied to channels-last tokens is a linear layer (unpadded channels).
pub(crate) fn pointwise(cin: usize, cout: usize, vb: VarBuilder) -> Result<Dense> {
    pointwise_padded(&Pad::OFF.one(cin), &Pad::OFF.one(cout), 1.0, vb)
}

/// A 1x1 convolution applied to channels-last tokens is a linear layer; its output is
/// multiplied by `scale` (weights and bias scaled at load).
fn pointwise_padded(cin: &Channels, cout: &Channels, scale: f64, vb: VarBuilder) -> Result<Dense> {
    let (ci, co) = (cin.real(), cout.real());
    let w = vb.get((co, ci, 1, 1), "weight")?.reshape((co, ci))?;
    let b = vb.get(co, "bias")?;
    let (w, b) = if scale == 1.0 {
        (w, b)
    } else {
        ((w * scale)?, (b * scale)?)
    };
    Ok(Dense::new(spread2(&w, cout, cin)?, cout.spread(&b, 0)?))
}

/// `cat([x, leaky_relu(y)], -1)`: the dense connection inside a group.
fn cat_leaky(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    match super::ops::cat_leaky(x, y, RDG_SLOPE as f32)? {
        Some(out) => Ok(out),
        None => Tensor::cat(&[x, &candle_nn::ops::leaky_relu(y, RDG_SLOPE)?], D::Minus1),
    }
}

pub struct Mlp {
    fc1: Dense,
    fc2: Dense,
}

impl Mlp {
    pub fn new(dim: &Channels, hidden: &Channels, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            fc1: Dense::load(dim, hidden, vb.pp("fc1"))?,
            fc2: Dense::load(hidden, dim, vb.pp("fc2"))?,
        })
    }

    /// The MLP stored under `vb`, `dim` -> `hidden` -> `dim` channels, none padded.
    pub(crate) fn unpadded(dim: usize, hidden: usize, vb: VarBuilder) -> Result<Self> {
        Self::new(&Pad::OFF.one(dim), &Pad::OFF.one(hidden), vb)
    }
}

impl Mlp {
    pub(crate) fn use_bf16(&mut self, isa: Isa) -> Result<()> {
        self.fc1.use_bf16(isa)?;
        self.fc2.use_bf16(isa)
    }
}

impl Mlp {
    /// `residual + mlp(x)`. Takes the residual by value: on CUDA in bf16 and f16 the second
    /// layer adds onto its buffer in place.
    pub(crate) fn forward_residual(&self, x: &Tensor, residual: Tensor) -> Result<Tensor> {
        // The official model uses nn.GELU(): the exact erf form, not the tanh approximation.
        let hidden = self.fc1.forward_gelu(x)?;
        if let Some(y) = self.fc2.accumulate_onto(&hidden, residual.clone())? {
            return Ok(y);
        }
        self.fc2.forward_residual(&hidden, &residual)
    }
}

pub struct WindowAttention {
    qkv: Dense,
    proj: Dense,
    heads: usize,
    /// Padded, when the model is ([`super::pad_channels`]).
    head_dim: usize,
    window: usize,
    /// The table, read directly by the CPU kernel.
    table: RelativeBias,
    /// `(heads, N, N)`, gathered from the table at load for the CUDA kernel and candle's
    /// graph; `None` for a model on the CPU, whose kernel never needs it.
    bias: Option<Tensor>,
    attention: Attention,
    /// bf16 products on the CPU, on these instructions.
    bf16: Option<Isa>,
}

impl WindowAttention {
    /// The attention of a block over `channels`, its heads' dims padded as `pad` says.
    pub fn new(
        channels: &Channels,
        heads: usize,
        ws: usize,
        attention: Attention,
        pad: Pad,
        vb: VarBuilder,
    ) -> Result<Self> {
        let dim = channels.real();
        let head_dim = dim / heads;
        // Fold head_dim^-0.5 into the query rows of qkv: one multiply at load instead of a
        // pass over q in every forward. The real head dim's: padded dims add zero products.
        let scale = (head_dim as f64).powf(-0.5);
        let w = vb.pp("qkv").get((3 * dim, dim), "weight")?;
        let b = vb.pp("qkv").get(3 * dim, "bias")?;
        let w = Tensor::cat(
            &[(w.narrow(0, 0, dim)? * scale)?, w.narrow(0, dim, 2 * dim)?],
            0,
        )?;
        let b = Tensor::cat(
            &[(b.narrow(0, 0, dim)? * scale)?, b.narrow(0, dim, 2 * dim)?],
            0,
        )?;
        // Every head of q, k and v padded on its own, with zero columns that add nothing to
        // q·k and leave zeros in the output, which proj reads with zero weights.
        let head_channels = pad.parts(heads, head_dim);
        let qkv_channels = pad.parts(3 * heads, head_dim);
        let w = spread2(&w, &qkv_channels, channels)?;
        let b = qkv_channels.spread(&b, 0)?;
        let table = vb.get(
            ((2 * ws - 1) * (2 * ws - 1), heads),
            "relative_position_bias_table",
        )?;
        let bias = if table.device().is_cpu() {
            None
        } else {
            Some(relative_position_bias(&table, ws)?)
        };
        Ok(Self {
            qkv: Dense::new(w, b),
            proj: Dense::load(&head_channels, channels, vb.pp("proj"))?,
            heads,
            head_dim: pad.width(head_dim),
            window: ws,
            table: RelativeBias::new(&table, ws)?,
            bias,
            attention,
            bf16: None,
        })
    }

    fn use_bf16(&mut self, isa: Isa) -> Result<()> {
        self.qkv.use_bf16(isa)?;
        self.proj.use_bf16(isa)?;
        self.bf16 = Some(isa);
        Ok(())
    }

    /// Whether [`Self::forward_fused`] is the path for inputs on `device`: the CPU keeps its
    /// own fused f32 kernel, which takes the stored mask, and head dims the CUDA kernel has no
    /// variant for take candle's graph.
    pub fn runs_fused(&self, device: &Device) -> bool {
        self.attention.is_fused() && device.is_cuda() && self.head_dim <= super::fused::MAX_HEAD_DIM
    }

    /// The gathered `(heads, N, N)` bias: built at load off the CPU, else now (only candle's
    /// graph on the CPU needs it, for inputs the CPU kernel does not take).
    fn gathered_bias(&self, like: &Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(b) => Ok(b.clone()),
            None => self.table.tensor(like.dtype(), like.device()),
        }
    }

    /// `x`: windows `(B*nW, N, C)` of `(B, h, w)` maps, partitioned after a half-window shift
    /// when `shifted`; the shift mask is computed inside the kernel.
    pub fn forward_fused(
        &self,
        x: &Tensor,
        (h, w): (usize, usize),
        shifted: bool,
    ) -> Result<Tensor> {
        let qkv = self.qkv.forward(x)?;
        let bias = self.gathered_bias(&qkv)?;
        let op = FusedWindowAttention {
            heads: self.heads,
            window: self.window,
            height: h,
            width: w,
            shifted,
            tensor_cores: self.attention == Attention::TensorCore,
        };
        let out = op.apply(&qkv, &bias)?;
        self.proj.forward(&out)
    }

    /// `x`: windows `(B*nW, N, C)` of `(B, h, w)` maps, partitioned after a half-window shift
    /// when `shifted` (then masked as `windows` says for that size).
    pub fn forward(
        &self,
        x: &Tensor,
        (h, w): (usize, usize),
        shifted: bool,
        windows: &WindowCache,
    ) -> Result<Tensor> {
        let (bw, n, _) = x.dims3()?;
        let c = self.heads * self.head_dim;
        let qkv = self.qkv.forward(x)?;
        if qkv.device().is_cpu() {
            let regions = shifted.then(|| windows.regions(h, w)).transpose()?;
            if let Some(out) =
                super::ops::window_attention(&qkv, &self.table, regions.as_deref(), self.bf16)?
            {
                return self.proj.forward(&out);
            }
        }
        let qkv = qkv
            .reshape((bw, n, 3, self.heads, self.head_dim))?
            .permute((2, 0, 3, 1, 4))?;
        let q = qkv.get(0)?.contiguous()?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let mut attn = q.matmul(&k.t()?)?.broadcast_add(&self.gathered_bias(&q)?)?;
        if shifted {
            let mask = windows.mask(h, w)?;
            let nw = mask.dim(0)?;
            attn = attn
                .reshape((bw / nw, nw, self.heads, n, n))?
                .broadcast_add(&mask.unsqueeze(1)?)?
                .reshape((bw, self.heads, n, n))?;
        }
        let attn = candle_nn::ops::softmax_last_dim(&attn)?;
        let out = attn.matmul(&v)?.transpose(1, 2)?.reshape((bw, n, c))?;
        self.proj.forward(&out)
    }
}

pub struct SwinBlock {
    norm1: Norm,
    attn: WindowAttention,
    norm2: Norm,
    mlp: Mlp,
    window: usize,
    shifted: bool,
    windows: WindowCache,
}

impl SwinBlock {
    pub fn new(
        cfg: &DrctConfig,
        g: usize,
        k: usize,
        windows: &WindowCache,
        attention: Attention,
        pad: Pad,
        vb: VarBuilder,
    ) -> Result<Self> {
        let shape = BlockShape {
            dim: cfg.block_dim(k),
            heads: cfg.heads[g][k],
            mlp_hidden: cfg.mlp_hidden[k],
            window: cfg.window,
            // swin2 and swin4 (odd positions) use shifted windows.
            shifted: k % 2 == 1,
        };
        Self::padded(
            shape,
            &block_channels(cfg, pad, k),
            pad,
            windows,
            attention,
            vb,
        )
    }

    /// The block of any Swin-family network: width, heads, MLP width, window and shift, its
    /// channels unpadded.
    pub(crate) fn with_shape(
        s: BlockShape,
        windows: &WindowCache,
        attention: Attention,
        vb: VarBuilder,
    ) -> Result<Self> {
        let pad = Pad::OFF;
        Self::padded(s, &pad.one(s.dim), pad, windows, attention, vb)
    }

    /// The block of shape `s` whose input channels are laid out as `dim`, each part padded
    /// to `pad`'s multiple.
    fn padded(
        s: BlockShape,
        dim: &Channels,
        pad: Pad,
        windows: &WindowCache,
        attention: Attention,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            norm1: load_norm(dim, vb.pp("norm1"))?,
            attn: WindowAttention::new(dim, s.heads, s.window, attention, pad, vb.pp("attn"))?,
            norm2: load_norm(dim, vb.pp("norm2"))?,
            mlp: Mlp::new(dim, &pad.one(s.mlp_hidden), vb.pp("mlp"))?,
            window: s.window,
            shifted: s.shifted,
            windows: windows.clone(),
        })
    }
}

/// The shape of one Swin block (see [`SwinBlock::with_shape`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockShape {
    pub dim: usize,
    pub heads: usize,
    pub mlp_hidden: usize,
    pub window: usize,
    pub shifted: bool,
}

impl SwinBlock {
    pub(crate) fn use_bf16(&mut self, isa: Isa) -> Result<()> {
        self.attn.use_bf16(isa)?;
        self.mlp.use_bf16(isa)
    }
}

impl Module for SwinBlock {
    /// `x`: `(B, H, W, C)` with H and W multiples of the window.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_plus(x, None)
    }
}

impl SwinBlock {
    /// The block's first LayerNorm, for a branch that reads the same normalised input.
    pub(crate) fn norm1(&self) -> &Norm {
        &self.norm1
    }

    /// The block with `extra` `(B, H, W, C)` added to the attention's residual sum, before
    /// the MLP (HAT's convolution branch).
    pub(crate) fn forward_plus(&self, x: &Tensor, extra: Option<&Tensor>) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let ws = self.window;
        let (nh, nw) = (h / ws, w / ws);
        // One gather each way stands for the cyclic shift and the window partition; each is
        // fused with the layer norm next to it.
        let (order, back) = self.windows.partition(h, w, self.shifted)?;
        let x = x.reshape((b, h * w, c))?;
        let windows = norm_gather(&self.norm1, &x, &order)?.reshape((b * nh * nw, ws * ws, c))?;
        let y = if self.attn.runs_fused(x.device()) {
            self.attn.forward_fused(&windows, (h, w), self.shifted)?
        } else {
            self.attn
                .forward(&windows, (h, w), self.shifted, &self.windows)?
        };
        let x = match extra {
            Some(e) => (x + e.reshape((b, h * w, c))?)?,
            None => x,
        };
        let (x, normed) = add_gather_norm(&self.norm2, &x, &y.reshape((b, h * w, c))?, &back)?;
        self.mlp.forward_residual(&normed, x)?.reshape((b, h, w, c))
    }
}

/// Residual dense group: five Swin blocks, each reading the concatenation of the group's
/// input and every earlier block's (adjusted) output.
pub struct Rdg {
    blocks: Vec<SwinBlock>,
    adjust: Vec<Dense>,
}

impl Rdg {
    pub fn new(
        cfg: &DrctConfig,
        g: usize,
        windows: &WindowCache,
        attention: Attention,
        pad: Pad,
        vb: VarBuilder,
    ) -> Result<Self> {
        let mut blocks = Vec::with_capacity(BLOCKS_PER_GROUP);
        let mut adjust = Vec::with_capacity(BLOCKS_PER_GROUP);
        for k in 0..BLOCKS_PER_GROUP {
            blocks.push(SwinBlock::new(
                cfg,
                g,
                k,
                windows,
                attention,
                pad,
                vb.pp(format!("swin{}", k + 1)),
            )?);
            let (out, scale) = if k + 1 == BLOCKS_PER_GROUP {
                (cfg.embed_dim, RDG_RESIDUAL)
            } else {
                (cfg.growth, 1.0)
            };
            let vb = vb.pp(format!("adjust{}", k + 1));
            adjust.push(pointwise_padded(
                &block_channels(cfg, pad, k),
                &pad.one(out),
                scale,
                vb,
            )?);
        }
        Ok(Self { blocks, adjust })
    }
}

impl Rdg {
    fn use_bf16(&mut self, isa: Isa) -> Result<()> {
        for b in &mut self.blocks {
            b.use_bf16(isa)?;
        }
        for a in &mut self.adjust {
            a.use_bf16(isa)?;
        }
        Ok(())
    }
}

impl Module for Rdg {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut dense = x.clone();
        let last = BLOCKS_PER_GROUP - 1;
        for (k, (block, adjust)) in self.blocks.iter().zip(&self.adjust).enumerate() {
            let out = block.forward(&dense)?;
            if k == last {
                // The last block has no activation; the group output is scaled (folded into
                // this adjust's weights at load) and added.
                return adjust.forward_residual(&out, x);
            }
            dense = adjust.forward_cat_leaky(&out, &dense)?;
        }
        unreachable!("a group always has {BLOCKS_PER_GROUP} blocks")
    }
}

pub struct Drct {
    conv_first: Conv3x3,
    patch_norm: Option<Norm>,
    layers: Vec<Rdg>,
    norm: Norm,
    conv_after_body: Option<Conv3x3>,
    conv_before_upsample: Conv3x3,
    upsample: Vec<(Conv3x3, usize)>,
    conv_last: Conv3x3,
    mean: Tensor,
    config: DrctConfig,
    /// Shared with every block; kept here to report its size.
    #[cfg_attr(not(test), allow(dead_code))]
    windows: WindowCache,
    dtype: DType,
    device: Device,
    bf16: Option<Isa>,
    pad: Pad,
}

impl Drct {
    /// The network with window attention run as `attention` says on CUDA devices, and its
    /// channels padded as `pad` says ([`super::pad_channels`]).
    pub fn with_attention(
        cfg: &DrctConfig,
        vb: VarBuilder,
        attention: Attention,
        pad: Pad,
    ) -> Result<Self> {
        let e = pad.one(cfg.embed_dim);
        let f = pad.one(cfg.num_feat);
        let windows = WindowCache::new(cfg.window, vb.dtype(), vb.device());
        let layers = (0..cfg.groups)
            .map(|g| {
                let vb = vb.pp(format!("layers.{g}"));
                Rdg::new(cfg, g, &windows, attention, pad, vb)
            })
            .collect::<Result<Vec<_>>>()?;
        let upsample = cfg
            .upsample_stages()
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let nf = cfg.num_feat;
                let conv = Conv3x3::new(&f, r * r * nf, vb.pp(format!("upsample.{}", 2 * i)))?;
                // Reordered to (i, j, c) first, so that each of the r*r groups of channels
                // that PixelShuffle moves to one pixel is padded on its own.
                let conv = conv
                    .reorder_outputs(shuffle_order(nf, r))?
                    .spread_outputs(&pad.parts(r * r, nf))?;
                Ok((conv, r))
            })
            .collect::<Result<Vec<_>>>()?;
        let mean =
            Tensor::from_vec(RGB_MEAN.to_vec(), (1, 1, 1, 3), vb.device())?.to_dtype(vb.dtype())?;
        // The RGB input and output are never padded.
        let rgb = Pad::OFF.one(3);
        Ok(Self {
            conv_first: Conv3x3::new(&rgb, e.real(), vb.pp("conv_first"))?.spread_outputs(&e)?,
            patch_norm: if cfg.patch_norm {
                Some(load_norm(&e, vb.pp("patch_embed.norm"))?)
            } else {
                None
            },
            layers,
            norm: load_norm(&e, vb.pp("norm"))?,
            conv_after_body: if cfg.conv_after_body {
                let conv = Conv3x3::new(&e, e.real(), vb.pp("conv_after_body"))?;
                Some(conv.spread_outputs(&e)?)
            } else {
                None
            },
            conv_before_upsample: Conv3x3::new(&e, f.real(), vb.pp("conv_before_upsample.0"))?
                .spread_outputs(&f)?,
            upsample,
            conv_last: Conv3x3::new(&f, 3, vb.pp("conv_last"))?
                .add_to_bias(&mean.flatten_all()?)?,
            mean,
            config: cfg.clone(),
            windows,
            dtype: vb.dtype(),
            device: vb.device().clone(),
            bf16: None,
            pad,
        })
    }

    /// How the channels were padded at load.
    pub fn padding(&self) -> Pad {
        self.pad
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Runs every matrix product (linear layers, convolutions as GEMMs, both attention
    /// products) with bf16 operands and f32 sums on `isa`, with the weights kept in bf16
    /// only; everything else stays f32. CPU networks built in f32 only.
    pub fn use_bf16_products(&mut self, isa: Isa) -> Result<()> {
        if !self.device.is_cpu() || self.dtype != DType::F32 {
            candle_core::bail!("bf16 products are for f32 networks on the CPU");
        }
        self.conv_first.use_bf16(isa)?;
        for layer in &mut self.layers {
            layer.use_bf16(isa)?;
        }
        for conv in [&mut self.conv_after_body]
            .into_iter()
            .flatten()
            .chain([&mut self.conv_before_upsample, &mut self.conv_last])
            .chain(self.upsample.iter_mut().map(|(c, _)| c))
        {
            conv.use_bf16(isa)?;
        }
        self.bf16 = Some(isa);
        Ok(())
    }

    #[cfg(test)]
    /// Number of distinct padded sizes whose shift mask (or, on the CPU, region labels) is
    /// cached.
    pub fn cached_masks(&self) -> usize {
        self.windows.len()
    }
}

impl Module for Drct {
    /// `x`: `(B, 3, H, W)` RGB in [0, 1], any H and W. Returns `(B, 3, sH, sW)` in the model's
    /// dtype, unclamped. Pads bottom/right to a window multiple as the official test pipeline
    /// does, and crops the padding's output away ([`swin_frame`]).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let shape = (self.dtype, self.config.window, self.config.scale);
        let head = (&self.mean, &self.conv_first, self.patch_norm.as_ref());
        swin_frame(x, shape, head, |f0, mut t| {
            for layer in &self.layers {
                t = layer.forward(&t)?;
            }
            let body = layer_norm(&self.norm, &t)?;
            let body = match &self.conv_after_body {
                Some(conv) => conv.forward(&body)?,
                None => body,
            };
            let mut y = candle_nn::ops::leaky_relu(
                &self.conv_before_upsample.forward(&(body + f0)?)?,
                UPSAMPLE_SLOPE,
            )?;
            for (conv, r) in &self.upsample {
                y = conv.forward_shuffled(&y, *r)?;
            }
            // conv_last's bias already includes the RGB mean the model adds back.
            self.conv_last.forward(&y)
        })
    }
}

/// The frame every Swin-family network runs in: `x` `(B, 3, H, W)` reflect-padded
/// bottom/right to a multiple of the window (as the official test pipelines do), in `dtype`,
/// channels-last with the RGB `mean` subtracted, through `conv_first` (and the patch norm when
/// the model has one); `deep` takes those shallow features and the normalised tokens and
/// returns the model's `(B, sH', sW', 3)` output, whose padding this crops away before going
/// back to channels-first.
pub(crate) fn swin_frame(
    x: &Tensor,
    (dtype, window, scale): (DType, usize, usize),
    (mean, conv_first, patch_norm): (&Tensor, &Conv3x3, Option<&Norm>),
    deep: impl FnOnce(Tensor, Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    let x = reflect_pad_bottom_right(&x.to_dtype(dtype)?, window)?;
    // Channels-last from here on: every layer is a matmul over the channel axis.
    let x = x.permute((0, 2, 3, 1))?.broadcast_sub(mean)?;
    let f0 = conv_first.forward(&x)?;
    let t = match patch_norm {
        Some(norm) => layer_norm(norm, &f0)?,
        None => f0.clone(),
    };
    let y = deep(f0, t)?;
    let y = y.narrow(1, 0, h * scale)?.narrow(2, 0, w * scale)?;
    y.permute((0, 3, 1, 2))?.contiguous()
}

/// Reflect-101 indices (edge not repeated) for extending `size` samples to `padded`. Sizes
/// smaller than the padding fold back and forth, so even a 1-pixel input gets a defined pad.
pub fn reflect_indices(size: usize, padded: usize) -> Vec<u32> {
    (0..padded)
        .map(|i| {
            if size == 1 {
                return 0;
            }
            let period = 2 * (size - 1);
            let m = i % period;
            (if m < size { m } else { period - m }) as u32
        })
        .collect()
}

pub(crate) fn reflect_pad_bottom_right(x: &Tensor, ws: usize) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    let (hp, wp) = (h.div_ceil(ws) * ws, w.div_ceil(ws) * ws);
    let mut x = x.clone();
    if hp != h {
        let idx = Tensor::from_vec(reflect_indices(h, hp), hp, x.device())?;
        x = x.index_select(&idx, 2)?;
    }
    if wp != w {
        let idx = Tensor::from_vec(reflect_indices(w, wp), wp, x.device())?;
        x = x.index_select(&idx, 3)?;
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::pad_channels;
    use crate::model::{Checkpoint, Model};
    use crate::tests::fixtures::{cases, load_io, max_abs_diff};

    /// A golden fixture's network in f32 on the CPU, its channels padded as `pad` says.
    fn fixture(name: &str, pad: Pad) -> Drct {
        let case = cases().into_iter().find(|c| c.name == name).expect(name);
        let ck = Checkpoint::load(&case.weights).unwrap();
        match pad_channels::with(pad, || Model::from_checkpoint(ck, DType::F32, &Device::Cpu))
            .unwrap()
            .net
        {
            super::super::Network::Drct(net) => net,
            _ => panic!("{name} is a DRCT fixture"),
        }
    }

    /// The largest magnitude on the channels of `t`'s last axis that `ch` marks as padding.
    fn padding_max(t: &Tensor, ch: &Channels) -> f32 {
        assert_eq!(t.dim(D::Minus1).unwrap(), ch.padded(), "{:?}", t.dims());
        let padding = (1.0 - ch.mask(DType::F32, t.device()).unwrap()).unwrap();
        let t = t
            .to_dtype(DType::F32)
            .unwrap()
            .broadcast_mul(&padding)
            .unwrap();
        t.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// The dims of every GEMM of the body: `(name, K, N)`.
    fn body_gemms(net: &Drct) -> Vec<(String, usize, usize)> {
        let mut out = Vec::new();
        let mut push = |name: String, d: &Dense| {
            if let Dense::Candle(l) = d {
                let (n, k) = l.weight().dims2().unwrap();
                out.push((name, k, n));
            }
        };
        for (g, layer) in net.layers.iter().enumerate() {
            for (k, (b, a)) in layer.blocks.iter().zip(&layer.adjust).enumerate() {
                push(format!("{g}.{k}.qkv"), &b.attn.qkv);
                push(format!("{g}.{k}.proj"), &b.attn.proj);
                push(format!("{g}.{k}.fc1"), &b.mlp.fc1);
                push(format!("{g}.{k}.fc2"), &b.mlp.fc2);
                push(format!("{g}.{k}.adjust"), a);
            }
        }
        out
    }

    /// A padded network's GEMMs all have K and N multiples of the padding, and every padded
    /// channel of every activation between its layers is exactly zero, from the first
    /// convolution to the last upsampler; the RGB input and output keep their 3 channels.
    #[test]
    fn padded_channels_stay_exactly_zero_between_layers() {
        let case = cases().into_iter().next().unwrap();
        let (input, _) = load_io(&case.io);
        for m in [8, 16, 64] {
            let pad = Pad::to(m).unwrap();
            let net = fixture(&case.name, pad);
            assert_eq!(net.padding(), pad);
            for (name, k, n) in body_gemms(&net) {
                assert!(k % m == 0 && n % m == 0, "pad {m}: {name} is {k} x {n}");
            }
            let cfg = net.config.clone();
            let (e, f) = (pad.one(cfg.embed_dim), pad.one(cfg.num_feat));
            let zero = |t: &Tensor, ch: &Channels, what: &str| {
                let v = padding_max(t, ch);
                assert!(v == 0.0, "pad {m}, {what}: {v} on a padded channel");
            };
            let x = reflect_pad_bottom_right(&input, cfg.window).unwrap();
            let x = x
                .permute((0, 2, 3, 1))
                .unwrap()
                .broadcast_sub(&net.mean)
                .unwrap();
            let f0 = net.conv_first.forward(&x).unwrap();
            zero(&f0, &e, "conv_first");
            let mut t = match &net.patch_norm {
                Some(norm) => layer_norm(norm, &f0).unwrap(),
                None => f0.clone(),
            };
            zero(&t, &e, "patch norm");
            for (g, layer) in net.layers.iter().enumerate() {
                let mut dense = t.clone();
                for (k, (block, adjust)) in layer.blocks.iter().zip(&layer.adjust).enumerate() {
                    let ch = block_channels(&cfg, pad, k);
                    let what = format!("group {g} block {k}");
                    zero(&dense, &ch, &format!("{what} input"));
                    let (heads, d) = (cfg.heads[g][k], cfg.head_dim(g, k));
                    let qkv = block.attn.qkv.forward(&dense).unwrap();
                    zero(&qkv, &pad.parts(3 * heads, d), &format!("{what} qkv"));
                    let out = block.forward(&dense).unwrap();
                    zero(&out, &ch, &what);
                    if k + 1 < BLOCKS_PER_GROUP {
                        dense = adjust.forward_cat_leaky(&out, &dense).unwrap();
                    } else {
                        t = adjust.forward_residual(&out, &t).unwrap();
                        zero(&t, &e, &format!("group {g} output"));
                    }
                }
            }
            let mut body = layer_norm(&net.norm, &t).unwrap();
            zero(&body, &e, "norm");
            if let Some(conv) = &net.conv_after_body {
                body = conv.forward(&body).unwrap();
                zero(&body, &e, "conv_after_body");
            }
            let before = net.conv_before_upsample.forward(&(body + f0).unwrap());
            let mut y = before.unwrap();
            zero(&y, &f, "conv_before_upsample");
            for (conv, r) in &net.upsample {
                y = conv.forward_shuffled(&y, *r).unwrap();
                zero(&y, &f, "upsample");
            }
            assert_eq!(net.conv_last.forward(&y).unwrap().dim(3).unwrap(), 3);
        }
    }

    /// Window attention with zero-padded heads against the unpadded one, both on the CPU
    /// kernel the model runs and on the CPU twin of the CUDA kernel (the fused op), for every
    /// block of a fixture whose head dims are 4, 17, 11, 9, 32 and 5, 13, 8, 19, 11: the real
    /// outputs agree to f32 rounding (the same sums, in another order) and the padded ones
    /// are exactly zero.
    #[test]
    fn padded_heads_attend_as_the_real_ones() {
        let name = "x4_w8_g2";
        let plain = fixture(name, Pad::OFF);
        let cfg = plain.config.clone();
        let ws = cfg.window;
        let (h, w) = (2 * ws, 2 * ws);
        for m in [8, 16, 64] {
            let pad = Pad::to(m).unwrap();
            let net = fixture(name, pad);
            for (g, (a, b)) in plain.layers.iter().zip(&net.layers).enumerate() {
                for k in 0..BLOCKS_PER_GROUP {
                    let ch = block_channels(&cfg, pad, k);
                    let (a, b) = (&a.blocks[k].attn, &b.blocks[k].attn);
                    let shifted = k % 2 == 1;
                    let x = Tensor::randn(0f32, 1.0, (4, ws * ws, ch.real()), &Device::Cpu);
                    let x = x.unwrap();
                    let xp = ch.spread(&x, 2).unwrap();
                    let runs = [
                        (
                            "cpu kernel",
                            a.forward(&x, (h, w), shifted, &plain.windows),
                            b.forward(&xp, (h, w), shifted, &net.windows),
                        ),
                        (
                            "fused twin",
                            a.forward_fused(&x, (h, w), shifted),
                            b.forward_fused(&xp, (h, w), shifted),
                        ),
                    ];
                    for (path, want, got) in runs {
                        let (want, got) = (want.unwrap(), got.unwrap());
                        let what = format!("pad {m}, group {g} block {k}, {path}");
                        assert_eq!(padding_max(&got, &ch), 0.0, "{what}");
                        let d = max_abs_diff(&got, &ch.spread(&want, 2).unwrap());
                        assert!(d < 1e-5, "{what}: {d:e}");
                    }
                }
            }
        }
    }

    #[test]
    fn reflect_101_does_not_repeat_the_edge() {
        assert_eq!(reflect_indices(4, 7), vec![0, 1, 2, 3, 2, 1, 0]);
        assert_eq!(reflect_indices(3, 8), vec![0, 1, 2, 1, 0, 1, 2, 1]);
        assert_eq!(reflect_indices(1, 3), vec![0, 0, 0]);
    }
}
