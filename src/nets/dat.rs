//! DAT (Dual Aggregation Transformer, Chen et al., ICCV 2023), super-resolution, inference
//! only: DAT, DAT-S, DAT-2 and DAT-light.
//!
//! The network, as the paper and spandrel's `DAT.py` define it:
//!
//! ```text
//! x  = x - mean;  f0 = conv_first(x);  t = before_RG.1(tokens(f0))   (a LayerNorm)
//! for each residual group i:
//!     u = t
//!     for each block j:       even j: spatial window attention, odd j: channel attention
//!         u = u + attn(norm1(u));  u = u + sgfn(norm2(u))
//!     t = conv_i(u) + t                                    1conv or 3conv
//! b  = conv_after_body(norm(t)) + f0
//! y  = pixel shuffle (conv_before_upsample, LeakyReLU 0.01, stages, conv_last), or one
//!      3x3 and one shuffle (DAT-light) + mean
//! ```
//!
//! The outer structure is the Swin frame ([`Frame`]) with `before_RG.1` as its patch norm; the
//! network does not pad its input. Inside, each spatial block zero-pads q, k and v (after the
//! qkv projection) to a multiple of the larger split size, and splits its channels: the first
//! half attends in `split[0] x split[1]` windows, the second in `split[1] x split[0]` ones,
//! each head with a bias from the position MLP (computed here once, at load: it depends only
//! on the window's shape). Some spatial blocks shift both halves by half a window and mask as
//! Swin does: in even groups blocks 2, 6, 10..., in odd groups blocks 0, 4, 8....
//!
//! Both kinds of block run a depthwise 3x3 convolution (with BatchNorm, folded into it at load,
//! and GELU) on v beside the attention, and mix the two (the adaptive interaction module):
//! each is multiplied by a sigmoid map computed from the other, per channel (mean-pooled, two
//! 1x1 convolutions) or per pixel (two 1x1 convolutions to one channel). The channel
//! attention normalises q and k over all tokens of the image and attends between channels
//! with a learned temperature per head; the SGFN gates half of its hidden channels with a
//! depthwise 3x3 convolution of the other half's LayerNorm.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::{AfterBody, Frame, Tail};
use crate::nets::infer::{
    check_shapes, out_width, pixel_shuffle_scale, pixel_shuffle_stages, tensor, ConfigError, Shapes,
};
use crate::nets::registry::{Architecture, Beyond, Values};
use crate::nets::swin::load_layer_norm;
use crate::nets::{uniform, ArchConfig, Net, NetConfig};
use crate::ops::attention::channel::channel_attention;
use crate::ops::attention::cpu::rectangle_attention;
use crate::ops::conv::depthwise::Depthwise3x3;
use crate::ops::conv::Conv3x3;
use crate::ops::cpu::bf16::Isa;
use crate::ops::cpu::cpu_slice;
use crate::ops::cpu::depthwise::{gated_sum, Gate, Rows, Then};
use crate::ops::linear::Dense;
use crate::ops::norm::{layer_norm, Norm};
use crate::ops::pad::Pad;
use crate::ops::windows::{RelativeBias, MASK_VALUE};
use crate::ops::{add, build_layers, gelu_erf, mean_hw, scale_leading, LoadPlan};

/// BatchNorm's and LayerNorm's epsilon in the official model (torch's defaults).
const EPS: f64 = 1e-5;
/// F.normalize's floor on a norm.
const NORMALIZE_EPS: f64 = 1e-12;

/// The upsampler after the body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Upsampler {
    /// `conv_before_upsample`, pixel-shuffle stages over `num_feat` channels, `conv_last`.
    PixelShuffle { num_feat: usize },
    /// One 3x3 to `3 * scale²` channels and one shuffle (DAT-light).
    Direct,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DatConfig {
    pub embed_dim: usize,
    /// Blocks of each residual group.
    pub depths: Vec<usize>,
    /// Heads of each group's channel attention; each half of its spatial attention has half
    /// as many.
    pub heads: Vec<usize>,
    /// Window height and width of the spatial attention's first half (the second half's
    /// windows are the transpose).
    pub split: [usize; 2],
    /// Hidden width of the SGFN (embed_dim x expansion factor).
    pub ffn_hidden: usize,
    pub qkv_bias: bool,
    /// The residual connections are 3conv (3x3 to E/4, 1x1, 3x3 back), else one 3x3.
    pub three_conv: bool,
    pub upsampler: Upsampler,
    pub in_chans: usize,
    pub scale: usize,
}

/// Width of the position MLP for a spatial block of width `e` (each half sees `e / 2`
/// channels; the official model divides by 4 twice).
fn pos_dim(e: usize) -> usize {
    e / 2 / 4 / 4
}

/// Whether block `j` of group `i` shifts its windows (only even blocks are spatial).
fn shifted(i: usize, j: usize) -> bool {
    if i.is_multiple_of(2) {
        j >= 2 && (j - 2).is_multiple_of(4)
    } else {
        j.is_multiple_of(4)
    }
}

impl DatConfig {
    pub fn variant(&self) -> &'static str {
        match (
            self.upsampler,
            self.split,
            self.ffn_hidden / self.embed_dim.max(1),
        ) {
            (Upsampler::Direct, _, _) => "DAT-light",
            (_, [8, 16], _) => "DAT-S",
            (_, _, 2) => "DAT-2",
            _ => "DAT",
        }
    }

    pub fn expansion_factor(&self) -> f64 {
        self.ffn_hidden as f64 / self.embed_dim as f64
    }

    /// The side the spatial attention pads its maps to a multiple of.
    pub fn pad_multiple(&self) -> usize {
        self.split[0].max(self.split[1])
    }

    fn stages(&self) -> Vec<usize> {
        pixel_shuffle_stages(self.scale)
    }

    fn branch_heads(&self, group: usize) -> usize {
        self.heads[group] / 2
    }

    fn rpe_rows(&self) -> usize {
        (2 * self.split[0] - 1) * (2 * self.split[1] - 1)
    }

    /// The configuration of a DAT state dict, every tensor checked; the split sizes are read
    /// from the values of the position MLP's input grid (`rpe_biases`), whose shape alone
    /// does not tell height from width.
    pub fn infer(shapes: &Shapes, values: Values) -> std::result::Result<Self, ConfigError> {
        let name = "conv_first.weight";
        let cf = tensor(shapes, name)?;
        if cf.len() != 4 || cf[0] == 0 || cf[2] != 3 || cf[3] != 3 {
            return Err(ConfigError::shape(name, cf, "; expected [E, in, 3, 3]"));
        }
        let (embed_dim, in_chans) = (cf[0], cf[1]);
        if !embed_dim.is_multiple_of(2) || pos_dim(embed_dim) == 0 {
            return Err(ConfigError::shape(
                name,
                cf,
                "; DAT needs an even width of at least 32",
            ));
        }
        let depths = group_depths(shapes)?;
        let mut heads = Vec::with_capacity(depths.len());
        for (i, &d) in depths.iter().enumerate() {
            let h = if d >= 2 {
                out_width(shapes, &format!("layers.{i}.blocks.1.attn.temperature"))?
            } else {
                2 * out_width(
                    shapes,
                    &format!("layers.{i}.blocks.0.attn.attns.0.pos.pos3.2.weight"),
                )?
            };
            if h < 2 || !embed_dim.is_multiple_of(h) || !(embed_dim / 2).is_multiple_of(h / 2) {
                return Err(ConfigError::Heads {
                    block: format!("layers.{i}"),
                    width: embed_dim,
                    heads: h,
                });
            }
            heads.push(h);
        }
        let split = split_sizes(values)?;
        let ffn_hidden = out_width(shapes, "layers.0.blocks.0.ffn.fc1.weight")?;
        let upsampler = if shapes.contains_key("conv_last.weight") {
            Upsampler::PixelShuffle {
                num_feat: out_width(shapes, "conv_before_upsample.0.weight")?,
            }
        } else {
            Upsampler::Direct
        };
        let scale = match upsampler {
            Upsampler::PixelShuffle { num_feat } => pixel_shuffle_scale(shapes, num_feat)?,
            Upsampler::Direct => {
                let out = out_width(shapes, "upsample.0.weight")?;
                let s = crate::nets::infer::isqrt(out / in_chans.max(1));
                if s < 2 || s * s * in_chans != out {
                    return Err(ConfigError::DirectUpsampler(out));
                }
                s
            }
        };
        let cfg = Self {
            embed_dim,
            depths,
            heads,
            split,
            ffn_hidden,
            qkv_bias: shapes.contains_key("layers.0.blocks.0.attn.qkv.bias"),
            three_conv: shapes.contains_key("conv_after_body.0.weight"),
            upsampler,
            in_chans,
            scale,
        };
        if !cfg.ffn_hidden.is_multiple_of(2) {
            return Err(ConfigError::shape(
                "layers.0.blocks.0.ffn.fc1.weight",
                tensor(shapes, "layers.0.blocks.0.ffn.fc1.weight")?,
                ": the SGFN splits an even hidden width",
            ));
        }
        check_shapes(
            &cfg.expected_tensors(),
            shapes,
            " (an unsupported DAT variant or another architecture)",
        )?;
        // Every spatial block's two grids must be the windows read from the first.
        for (i, &d) in cfg.depths.iter().enumerate() {
            for j in (0..d).step_by(2) {
                for (b, [hs, ws]) in [cfg.split, [cfg.split[1], cfg.split[0]]]
                    .into_iter()
                    .enumerate()
                {
                    let name = format!("layers.{i}.blocks.{j}.attn.attns.{b}.rpe_biases");
                    if values(&name).as_deref() != Some(&offset_grid(hs, ws)[..]) {
                        return Err(ConfigError::Values {
                            name,
                            problem: format!("is not the offset grid of {hs}x{ws} windows"),
                        });
                    }
                }
            }
        }
        Ok(cfg)
    }
}

/// Blocks of each group `layers.i.blocks.j`, or what is wrong with the keys.
fn group_depths(shapes: &Shapes) -> std::result::Result<Vec<usize>, ConfigError> {
    let mut depths: Vec<usize> = Vec::new();
    for key in shapes.keys() {
        let Some(rest) = key.strip_prefix("layers.") else {
            continue;
        };
        let mut parts = rest.split('.');
        let bad = || ConfigError::Unexpected {
            name: key.clone(),
            hint: "",
        };
        let i: usize = parts.next().and_then(|i| i.parse().ok()).ok_or_else(bad)?;
        if depths.len() <= i {
            depths.resize(i + 1, 0);
        }
        if parts.next() == Some("blocks") {
            let j: usize = parts.next().and_then(|j| j.parse().ok()).ok_or_else(bad)?;
            depths[i] = depths[i].max(j + 1);
        }
    }
    if depths.is_empty() {
        return Err(ConfigError::NoSwinGroups);
    }
    if let Some(i) = depths.iter().position(|&d| d == 0) {
        return Err(ConfigError::EmptyGroup(i));
    }
    Ok(depths)
}

/// The split sizes from the first spatial block's first grid: its last row is
/// `(split[0] - 1, split[1] - 1)`.
fn split_sizes(values: Values) -> std::result::Result<[usize; 2], ConfigError> {
    let name = "layers.0.blocks.0.attn.attns.0.rpe_biases";
    let v = values(name).ok_or_else(|| ConfigError::missing(name, ""))?;
    let n = v.len();
    let last = if n >= 2 {
        [v[n - 2], v[n - 1]]
    } else {
        [-1.0; 2]
    };
    if last
        .iter()
        .any(|&x| !(0.0..=255.0).contains(&x) || x.fract() != 0.0)
    {
        return Err(ConfigError::Values {
            name: name.into(),
            problem: "does not end in a window's largest offsets".into(),
        });
    }
    Ok([last[0] as usize + 1, last[1] as usize + 1])
}

/// The position MLP's input for `hs x ws` windows: every offset `(dy, dx)`, `dy` outer, as
/// the official `rpe_biases` holds them, flattened.
pub(crate) fn offset_grid(hs: usize, ws: usize) -> Vec<f32> {
    let (hs, ws) = (hs as i64, ws as i64);
    let mut v = Vec::with_capacity((4 * hs * ws) as usize * 2);
    for dy in 1 - hs..hs {
        for dx in 1 - ws..ws {
            v.push(dy as f32);
            v.push(dx as f32);
        }
    }
    v
}

// ----------------------------------------------------------------------------------------
// layers
// ----------------------------------------------------------------------------------------

/// The channels-last depthwise 3x3 convolution under `vb`, with the BatchNorm after it (when
/// there is one) folded into its taps and bias.
fn depthwise(c: usize, vb: VarBuilder, bn: Option<VarBuilder>) -> Result<Depthwise3x3> {
    let w = vb.get((c, 1, 3, 3), "weight")?.reshape((c, 9))?;
    let (w, b) = folded(w, vb.get(c, "bias")?, bn)?;
    Depthwise3x3::new(&w, b)
}

/// `t`'s values (contiguous, CPU f32) as a vector.
fn host(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// A layer's weight `w` (an output channel per row) and bias `b` with the BatchNorm under `bn`
/// after it (when there is one) folded in.
fn folded(w: Tensor, b: Tensor, bn: Option<VarBuilder>) -> Result<(Tensor, Tensor)> {
    let Some(bn) = bn else {
        return Ok((w, b));
    };
    let (s, t) = batch_norm(b.dim(0)?, bn)?;
    Ok((w.broadcast_mul(&s.unsqueeze(1)?)?, ((b * &s)? + t)?))
}

/// BatchNorm in eval mode as `x * scale + shift`, per channel.
fn batch_norm(c: usize, vb: VarBuilder) -> Result<(Tensor, Tensor)> {
    let g = vb.get(c, "weight")?;
    let b = vb.get(c, "bias")?;
    let m = vb.get(c, "running_mean")?;
    let v = vb.get(c, "running_var")?;
    let s = (g / (v + EPS)?.sqrt()?)?;
    let t = (b - (m * &s)?)?;
    Ok((s, t))
}

/// A 1x1 convolution on channels-last tokens, the BatchNorm after it (if any) folded in.
fn pointwise_bn(cin: usize, cout: usize, vb: VarBuilder, bn: Option<VarBuilder>) -> Result<Dense> {
    let w = vb.get((cout, cin, 1, 1), "weight")?.reshape((cout, cin))?;
    let (w, b) = folded(w, vb.get(cout, "bias")?, bn)?;
    // These run on one token per image (the pooled channel map) or to one channel: plain f32.
    Dense::new(w, b, &LoadPlan::default())
}

/// The adaptive interaction module's two maps, each before its sigmoid.
struct Interaction {
    /// Mean-pooled, 1x1 to C/8 (BatchNorm folded), GELU, 1x1 back to C.
    channel: (Dense, Dense),
    /// 1x1 to C/16 (BatchNorm folded), GELU, 1x1 to one channel.
    spatial: (Dense, Dense),
}

impl Interaction {
    fn new(c: usize, vb: &VarBuilder) -> Result<Self> {
        let ci = vb.pp("channel_interaction");
        let si = vb.pp("spatial_interaction");
        Ok(Self {
            channel: (
                pointwise_bn(c, c / 8, ci.pp("1"), Some(ci.pp("2")))?,
                pointwise_bn(c / 8, c, ci.pp("4"), None)?,
            ),
            spatial: (
                pointwise_bn(c, c / 16, si.pp("0"), Some(si.pp("1")))?,
                pointwise_bn(c / 16, 1, si.pp("3"), None)?,
            ),
        })
    }

    /// `sigmoid(channel map of x)`, `(B, 1, 1, C)`.
    fn channel_gate(&self, x: &Tensor) -> Result<Tensor> {
        let y = gelu_erf(&self.channel.0.forward(&mean_hw(x)?)?)?;
        candle_nn::ops::sigmoid(&self.channel.1.forward(&y)?)
    }

    /// `sigmoid(spatial map of x)`, `(B, H, W, 1)`.
    fn spatial_gate(&self, x: &Tensor) -> Result<Tensor> {
        let y = gelu_erf(&self.spatial.0.forward(x)?)?;
        candle_nn::ops::sigmoid(&self.spatial.1.forward(&y)?)
    }
}

/// The qkv projection with head_dim^-0.5 folded into its query rows (`scale` 1 for none), and
/// a zero bias when the file has none.
fn qkv(c: usize, bias: bool, scale: f64, plan: &LoadPlan, vb: VarBuilder) -> Result<Dense> {
    let w = vb.get((3 * c, c), "weight")?;
    let b = if bias {
        vb.get(3 * c, "bias")?
    } else {
        Tensor::zeros(3 * c, vb.dtype(), vb.device())?
    };
    let w = scale_leading(&w, c, scale)?;
    let b = scale_leading(&b, c, scale)?;
    Dense::new(w, b, plan)
}

/// The masks of one spatial branch's shifted windows for each padded size, shared by every
/// block of the network.
#[derive(Clone, Default)]
struct MaskCache(Arc<Mutex<Vec<(MaskKey, Tensor)>>>);

/// Padded height and width, window height and width.
type MaskKey = (usize, usize, usize, usize);

/// Sizes kept: a tiled image uses one or two, a folder of whole images one per size.
const CACHED_SIZES: usize = 8;

impl MaskCache {
    fn get(&self, key: MaskKey, dtype: DType, device: &Device) -> Result<Tensor> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, m)) = map.iter().find(|(k, _)| *k == key) {
            return Ok(m.clone());
        }
        let (hp, wp, hs, ws) = key;
        let n = hs * ws;
        let mask = Tensor::from_vec(shift_mask(key), ((hp / hs) * (wp / ws), n, n), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?;
        if map.len() == CACHED_SIZES {
            map.remove(0);
        }
        map.push((key, mask.clone()));
        Ok(mask)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().map(|m| m.len()).unwrap_or(0)
    }
}

/// The shifted-window mask of an `hp x wp` map in `hs x ws` windows shifted by half a
/// window: 0 between tokens of the same region of the rolled map, [`MASK_VALUE`] otherwise.
/// The regions are Swin's: the rows before `hp - hs`, those before `hp - hs/2`, the rest (and
/// the same for columns).
fn shift_mask((hp, wp, hs, ws): MaskKey) -> Vec<f32> {
    let region = |y: usize, size: usize, win: usize| {
        if y < size - win {
            0
        } else if y < size - win / 2 {
            1
        } else {
            2
        }
    };
    let n = hs * ws;
    let mut out = Vec::with_capacity((hp / hs) * (wp / ws) * n * n);
    for wy in 0..hp / hs {
        for wx in 0..wp / ws {
            let label = |i: usize| {
                let (y, x) = (wy * hs + i / ws, wx * ws + i % ws);
                3 * region(y, hp, hs) + region(x, wp, ws)
            };
            let labels: Vec<usize> = (0..n).map(label).collect();
            for &a in &labels {
                out.extend(
                    labels
                        .iter()
                        .map(|&b| if a == b { 0.0 } else { MASK_VALUE }),
                );
            }
        }
    }
    out
}

/// `x` `(B, H, W, C)` rolled by `(dy, dx)` as torch.roll does: `out[y] = x[(y - dy) mod H]`.
fn roll(x: &Tensor, dy: isize, dx: isize) -> Result<Tensor> {
    let mut x = x.clone();
    for (axis, d) in [(1, dy), (2, dx)] {
        let n = x.dim(axis)?;
        let k = d.rem_euclid(n as isize) as usize;
        if k != 0 {
            x = Tensor::cat(
                &[x.narrow(axis, n - k, k)?, x.narrow(axis, 0, n - k)?],
                axis,
            )?;
        }
    }
    Ok(x)
}

/// One half of a spatial block: attention in `hs x ws` windows with the position bias.
struct Branch {
    heads: usize,
    hs: usize,
    ws: usize,
    /// `(heads, N, N)`, gathered at load off the CPU.
    bias: Option<Tensor>,
    /// The same bias as its table, which the CPU kernel reads.
    table: RelativeBias,
}

impl Branch {
    fn new((c, heads): (usize, usize), (hs, ws): (usize, usize), vb: VarBuilder) -> Result<Self> {
        let table = position_table(c, heads, (hs, ws), vb.pp("pos"))?;
        let table: Vec<f32> = table.iter().map(|&v| v as f32).collect();
        let rows = table.len() / heads;
        let table = RelativeBias::rectangular(
            &Tensor::from_vec(table, (rows, heads), &Device::Cpu)?,
            (hs, ws),
        )?;
        let bias = table.for_graph(vb.dtype(), vb.device())?;
        Ok(Self {
            heads,
            hs,
            ws,
            bias,
            table,
        })
    }

    /// `q`, `k`, `v`: `(B, Hp, Wp, Cb)` zero-padded maps (rolled when shifted); `mask`
    /// `(nW, N, N)` for shifted windows. Returns `(B, Hp, Wp, Cb)`.
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, hp, wp, c) = q.dims4()?;
        let (hs, ws, heads) = (self.hs, self.ws, self.heads);
        let (nh, nw, n, d) = (hp / hs, wp / ws, hs * ws, c / heads);
        let windows = |t: &Tensor| {
            t.reshape((b * nh, hs, nw, ws, heads, d))?
                .permute((0, 2, 4, 1, 3, 5))?
                .contiguous()?
                .reshape((b * nh * nw, heads, n, d))
        };
        let (q, k, v) = (windows(q)?, windows(k)?, windows(v)?);
        let bias = match &self.bias {
            Some(b) => b.clone(),
            None => self.table.tensor(q.dtype(), q.device())?,
        };
        let scores = q.matmul(&k.t()?.contiguous()?)?.broadcast_add(&bias)?;
        let scores = match mask {
            Some(m) => scores
                .reshape((b, nh * nw, heads, n, n))?
                .broadcast_add(&m.unsqueeze(1)?.unsqueeze(0)?)?
                .reshape((b * nh * nw, heads, n, n))?,
            None => scores,
        };
        let p = candle_nn::ops::softmax_last_dim(&scores)?;
        p.matmul(&v)?
            .reshape((b * nh, nw, heads, hs, ws, d))?
            .permute((0, 3, 1, 4, 2, 5))?
            .contiguous()?
            .reshape((b, hp, wp, c))
    }
}

/// The position MLP of one branch evaluated on every offset of an `hs x ws` window, in f64
/// on the host: `((2hs-1)(2ws-1), heads)`, row-major.
fn position_table(
    c: usize,
    heads: usize,
    (hs, ws): (usize, usize),
    vb: VarBuilder,
) -> Result<Vec<f64>> {
    let p = pos_dim(2 * c);
    let host = |t: Tensor| -> Result<Vec<f64>> {
        t.to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()
    };
    // Each weight transposed, `(cin, cout)`: the products below then run along contiguous
    // output rows (vectorised) instead of one serial dot product per output.
    let linear = |vb: VarBuilder, cin: usize, cout: usize| -> Result<(Vec<f64>, Vec<f64>)> {
        Ok((
            host(vb.get((cout, cin), "weight")?.t()?)?,
            host(vb.get(cout, "bias")?)?,
        ))
    };
    let norm = |vb: VarBuilder| -> Result<(Vec<f64>, Vec<f64>)> {
        Ok((host(vb.get(p, "weight")?)?, host(vb.get(p, "bias")?)?))
    };
    let apply = |x: &[f64], (w, b): &(Vec<f64>, Vec<f64>)| -> Vec<f64> {
        let mut y = vec![0f64; b.len()];
        for (&xi, row) in x.iter().zip(w.chunks_exact(b.len())) {
            y.iter_mut().zip(row).for_each(|(y, w)| *y += xi * w);
        }
        y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
        y
    };
    // LayerNorm, then ReLU.
    let norm_relu = |x: &[f64], (g, b): &(Vec<f64>, Vec<f64>)| -> Vec<f64> {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let inv = 1.0 / (var + EPS).sqrt();
        x.iter()
            .zip(g.iter().zip(b))
            .map(|(v, (g, b))| ((v - mean) * inv * g + b).max(0.0))
            .collect()
    };
    let proj = linear(vb.pp("pos_proj"), 2, p)?;
    let stages = [
        (norm(vb.pp("pos1.0"))?, linear(vb.pp("pos1.2"), p, p)?),
        (norm(vb.pp("pos2.0"))?, linear(vb.pp("pos2.2"), p, p)?),
        (norm(vb.pp("pos3.0"))?, linear(vb.pp("pos3.2"), p, heads)?),
    ];
    let grid = offset_grid(hs, ws);
    let mut table = Vec::with_capacity(grid.len() / 2 * heads);
    for offset in grid.chunks(2) {
        let mut x = apply(&[offset[0] as f64, offset[1] as f64], &proj);
        for (n, l) in &stages {
            x = apply(&norm_relu(&x, n), l);
        }
        table.extend(x);
    }
    Ok(table)
}

/// The depthwise convolution beside either attention, and its output projection.
struct Aim {
    dwconv: Depthwise3x3,
    interaction: Interaction,
    proj: Dense,
}

impl Aim {
    fn new(c: usize, plan: &LoadPlan, vb: &VarBuilder) -> Result<Self> {
        Ok(Self {
            dwconv: depthwise(c, vb.pp("dwconv.0"), Some(vb.pp("dwconv.1")))?,
            interaction: Interaction::new(c, vb)?,
            proj: Dense::load_unpadded(c, c, plan, vb.pp("proj"))?,
        })
    }

    /// The GELU of the folded convolution of `v` `(B, H, W, C)`.
    fn conv(&self, v: &Tensor) -> Result<Tensor> {
        gelu_erf(&self.dwconv.forward(v)?)
    }

    /// The interaction's mix of the attention's output and the convolution's (both `(b, h,
    /// w, c)`, on the CPU), then the projection onto `residual`: `mode` says which gate the convolution
    /// gives the attention (the attention gives the convolution the other kind).
    fn mix(
        &self,
        (attended, mode): (Tensor, Mode),
        conv: Vec<f32>,
        (b, h, w, c): (usize, usize, usize, usize),
        residual: &Tensor,
    ) -> Result<Tensor> {
        let device = residual.device();
        let attended = attended.reshape((b, h, w, c))?;
        let conv = Tensor::from_vec(conv, (b, h, w, c), device)?;
        let i = &self.interaction;
        let (for_attention, for_conv) = match mode {
            Mode::ChannelFromConv => (i.channel_gate(&conv)?, i.spatial_gate(&attended)?),
            Mode::TokenFromConv => (i.spatial_gate(&conv)?, i.channel_gate(&attended)?),
        };
        let (ga, gx) = (host(&for_attention)?, host(&for_conv)?);
        let channel_first = matches!(mode, Mode::ChannelFromConv);
        let (a_guard, a_layout) = attended.storage_and_layout();
        let (c_guard, c_layout) = conv.storage_and_layout();
        let mixed = gated_sum(
            (cpu_slice(&a_guard, a_layout)?, gate_of(&ga, channel_first)),
            (cpu_slice(&c_guard, c_layout)?, gate_of(&gx, !channel_first)),
            (b, h * w, c),
        );
        drop((a_guard, c_guard));
        let mixed = Tensor::from_vec(mixed, (b, h, w, c), device)?;
        self.proj.forward_residual(&mixed, residual)
    }
}

/// A per-channel gate or a per-token one.
fn gate_of(g: &[f32], channel: bool) -> Gate<'_> {
    match channel {
        true => Gate::Channel(g),
        false => Gate::Token(g),
    }
}

/// Which gate the convolution's output gives the attention's in [`Aim::mix`].
#[derive(Clone, Copy)]
enum Mode {
    /// Per channel (spatial blocks); the attention gives a per-token one.
    ChannelFromConv,
    /// Per token (channel blocks); the attention gives a per-channel one.
    TokenFromConv,
}

/// The spatial attention of an even block.
struct SpatialAttention {
    qkv: Dense,
    branches: [Branch; 2],
    aim: Aim,
    shifted: bool,
    pad: usize,
    masks: MaskCache,
    /// bf16 products in the CPU kernel's attention, on these instructions.
    bf16: Option<Isa>,
}

impl SpatialAttention {
    /// `residual` plus the attention of `x`.
    fn forward(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let qkv = self.qkv.forward(x)?;
        // Zero padding after the projection, as the official model pads q, k and v.
        let (hp, wp) = (
            h.div_ceil(self.pad) * self.pad,
            w.div_ceil(self.pad) * self.pad,
        );
        if self.aim.dwconv.takes(&qkv) && c % 2 == 0 {
            return self.forward_cpu(&qkv, (b, h, w, c), (hp, wp), residual);
        }
        let v = qkv.narrow(3, 2 * c, c)?.contiguous()?;
        let padded = qkv
            .pad_with_zeros(1, 0, hp - h)?
            .pad_with_zeros(2, 0, wp - w)?;
        let half = c / 2;
        let mut halves = Vec::with_capacity(2);
        for (i, br) in self.branches.iter().enumerate() {
            let (sy, sx) = (br.hs / 2, br.ws / 2);
            let part = |j: usize| -> Result<Tensor> {
                let t = padded.narrow(3, j * c + i * half, half)?;
                if self.shifted {
                    roll(&t, -(sy as isize), -(sx as isize))
                } else {
                    t.contiguous()
                }
            };
            let mask = if self.shifted {
                Some(
                    self.masks
                        .get((hp, wp, br.hs, br.ws), x.dtype(), x.device())?,
                )
            } else {
                None
            };
            let y = br.forward(&part(0)?, &part(1)?, &part(2)?, mask.as_ref())?;
            let y = if self.shifted {
                roll(&y, sy as isize, sx as isize)?
            } else {
                y
            };
            halves.push(y.narrow(1, 0, h)?.narrow(2, 0, w)?);
        }
        let attended = Tensor::cat(&halves, 3)?.contiguous()?;
        let conv = self.aim.conv(&v)?;
        let i = &self.aim.interaction;
        let mixed = (attended.broadcast_mul(&i.channel_gate(&conv)?)?
            + conv.broadcast_mul(&i.spatial_gate(&attended)?)?)?;
        debug_assert_eq!(mixed.dims(), [b, h, w, c]);
        self.aim.proj.forward_residual(&mixed, residual)
    }

    /// [`Self::forward`] on the CPU kernels, from the projection `qkv` on: each branch's
    /// windows gathered from and scattered to the map directly, the convolution read from v
    /// in place, the mix in one pass.
    fn forward_cpu(
        &self,
        qkv: &Tensor,
        (b, h, w, c): (usize, usize, usize, usize),
        padded: (usize, usize),
        residual: &Tensor,
    ) -> Result<Tensor> {
        let qkv = qkv.contiguous()?;
        let mut attended = vec![0f32; b * h * w * c];
        let (guard, layout) = qkv.storage_and_layout();
        let data = cpu_slice(&guard, layout)?;
        let half = c / 2;
        for (i, br) in self.branches.iter().enumerate() {
            let (group, dims) = ((i * half, half), (b, h, w, c));
            rectangle_attention(
                (data, dims),
                group,
                &br.table,
                padded,
                self.shifted,
                self.bf16,
                &mut attended,
            )?;
        }
        let v = Rows {
            data,
            ld: 3 * c,
            offset: 2 * c,
        };
        let conv = self.aim.dwconv.on_cpu(v, (b, h, w, c), Then::Gelu);
        drop(guard);
        let conv = conv.expect("the caller checked the kernel's weights are on the CPU");
        let attended = Tensor::from_vec(attended, (b, h, w, c), qkv.device())?;
        self.aim.mix(
            (attended, Mode::ChannelFromConv),
            conv,
            (b, h, w, c),
            residual,
        )
    }
}

/// The channel attention of an odd block.
struct ChannelAttention {
    qkv: Dense,
    heads: usize,
    /// `(heads, 1, 1)`.
    temperature: Tensor,
    aim: Aim,
}

impl ChannelAttention {
    /// `residual` plus the attention of `x`.
    fn forward(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = x.dims4()?;
        let (heads, n) = (self.heads, h * w);
        let d = c / heads;
        let qkv = self.qkv.forward(x)?.reshape((b, n, 3 * c))?;
        if self.aim.dwconv.takes(&qkv) {
            return self.forward_cpu(&qkv, (b, h, w, c), residual);
        }
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
        let scores = q
            .matmul(&k.t()?.contiguous()?)?
            .broadcast_mul(&self.temperature)?;
        let p = candle_nn::ops::softmax_last_dim(&scores)?;
        let attended = p
            .matmul(&v)?
            .permute((0, 3, 1, 2))?
            .contiguous()?
            .reshape((b, h, w, c))?;
        let v = qkv
            .narrow(2, 2 * c, c)?
            .contiguous()?
            .reshape((b, h, w, c))?;
        let conv = self.aim.conv(&v)?;
        let i = &self.aim.interaction;
        let mixed = (attended.broadcast_mul(&i.spatial_gate(&conv)?)?
            + conv.broadcast_mul(&i.channel_gate(&attended)?)?)?;
        self.aim.proj.forward_residual(&mixed, residual)
    }

    /// [`Self::forward`] on the CPU kernels, from the projection `qkv` `(B, N, 3C)` on.
    fn forward_cpu(
        &self,
        qkv: &Tensor,
        (b, h, w, c): (usize, usize, usize, usize),
        residual: &Tensor,
    ) -> Result<Tensor> {
        let qkv = qkv.contiguous()?;
        let temperature = host(&self.temperature)?;
        let attended = channel_attention(&qkv, self.heads, &temperature, NORMALIZE_EPS as f32)?;
        let (guard, layout) = qkv.storage_and_layout();
        let v = Rows {
            data: cpu_slice(&guard, layout)?,
            ld: 3 * c,
            offset: 2 * c,
        };
        let conv = self.aim.dwconv.on_cpu(v, (b, h, w, c), Then::Gelu);
        drop(guard);
        let conv = conv.expect("the caller checked the kernel's weights are on the CPU");
        self.aim.mix(
            (attended, Mode::TokenFromConv),
            conv,
            (b, h, w, c),
            residual,
        )
    }
}

enum Attention {
    Spatial(SpatialAttention),
    Channel(ChannelAttention),
}

/// The spatial-gate feed-forward network.
struct Sgfn {
    fc1: Dense,
    norm: Norm,
    conv: Depthwise3x3,
    fc2: Dense,
}

impl Sgfn {
    /// `residual` plus the network's output for `x`.
    fn forward(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let hidden = self.fc1.forward_gelu(x)?;
        let half = hidden.dim(3)? / 2;
        if self.conv.takes(&hidden) {
            // On the CPU the second half is normalised as the convolution reads it, and the
            // product with the first half made as its sums are stored.
            let (b, h, w, _) = hidden.dims4()?;
            let hidden = hidden.contiguous()?;
            let (hg, hl) = hidden.storage_and_layout();
            let data = cpu_slice(&hg, hl)?;
            let (first_half, second_half) = (
                Rows::new(data, 2 * half, 0),
                Rows::new(data, 2 * half, half),
            );
            let dims = (b, h, w, half);
            let gated =
                self.conv
                    .on_cpu_of_norm(&self.norm, second_half, dims, Then::Times(first_half))?;
            drop(hg);
            if let Some(gated) = gated {
                let gated = Tensor::from_vec(gated, (b, h, w, half), x.device())?;
                return self.fc2.forward_residual(&gated, residual);
            }
        }
        let gate = layer_norm(&self.norm, &hidden.narrow(3, half, half)?.contiguous()?)?;
        let gate = self.conv.forward(&gate)?;
        self.fc2
            .forward_residual(&(hidden.narrow(3, 0, half)? * gate)?, residual)
    }
}

struct Block {
    norm1: Norm,
    attn: Attention,
    norm2: Norm,
    ffn: Sgfn,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Each residual sum is made by its last linear layer's GEMM, onto the residual.
        let n = layer_norm(&self.norm1, x)?;
        let x = match &self.attn {
            Attention::Spatial(s) => s.forward(&n, x)?,
            Attention::Channel(c) => c.forward(&n, x)?,
        };
        self.ffn.forward(&layer_norm(&self.norm2, &x)?, &x)
    }
}

pub(crate) struct Group {
    blocks: Vec<Block>,
    conv: AfterBody,
}

impl Module for Group {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut u = x.clone();
        for b in &self.blocks {
            u = b.forward(&u)?;
        }
        add(&self.conv.forward(&u)?, x)
    }
}

/// DAT: the Swin frame around its residual groups.
pub struct Dat {
    frame: Frame,
    groups: Vec<Group>,
    #[cfg_attr(not(test), allow(dead_code))]
    masks: MaskCache,
}

fn residual_conv(cfg: &DatConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<AfterBody> {
    let e = cfg.embed_dim;
    if cfg.three_conv {
        AfterBody::three(e, plan, vb)
    } else {
        Ok(AfterBody::One(Conv3x3::unpadded(e, e, plan, vb)?))
    }
}

impl Dat {
    /// The network stored under `vb`, built as `plan` says (its channels never padded).
    pub fn new(cfg: &DatConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let plan = &LoadPlan {
            pad: Pad::OFF,
            ..*plan
        };
        let e = cfg.embed_dim;
        let masks = MaskCache::default();
        // Every block of every group, built in parallel on the CPU (each rearranges its
        // weights and evaluates its position MLPs at load).
        let pairs: Vec<(usize, usize)> = cfg
            .depths
            .iter()
            .enumerate()
            .flat_map(|(i, &depth)| (0..depth).map(move |j| (i, j)))
            .collect();
        let block = |k: usize| -> Result<Block> {
            let (i, j) = pairs[k];
            let heads = cfg.heads[i];
            let vb = vb.pp(format!("layers.{i}")).pp(format!("blocks.{j}"));
            let avb = vb.pp("attn");
            let attn = if j.is_multiple_of(2) {
                let bh = cfg.branch_heads(i);
                let scale = ((e / 2 / bh) as f64).powf(-0.5);
                let [a, b] = cfg.split;
                let branch =
                    |k: usize, hw| Branch::new((e / 2, bh), hw, avb.pp(format!("attns.{k}")));
                Attention::Spatial(SpatialAttention {
                    qkv: qkv(e, cfg.qkv_bias, scale, plan, avb.pp("qkv"))?,
                    branches: [branch(0, (a, b))?, branch(1, (b, a))?],
                    aim: Aim::new(e, plan, &avb)?,
                    shifted: shifted(i, j),
                    pad: cfg.pad_multiple(),
                    masks: masks.clone(),
                    bf16: plan.cpu_bf16(vb.device()),
                })
            } else {
                Attention::Channel(ChannelAttention {
                    qkv: qkv(e, cfg.qkv_bias, 1.0, plan, avb.pp("qkv"))?,
                    heads,
                    temperature: avb.get((heads, 1, 1), "temperature")?,
                    aim: Aim::new(e, plan, &avb)?,
                })
            };
            let h = cfg.ffn_hidden;
            let fvb = vb.pp("ffn");
            Ok(Block {
                norm1: load_layer_norm(e, vb.pp("norm1"))?,
                attn,
                norm2: load_layer_norm(e, vb.pp("norm2"))?,
                ffn: Sgfn {
                    fc1: Dense::load_unpadded(e, h, plan, fvb.pp("fc1"))?,
                    norm: load_layer_norm(h / 2, fvb.pp("sg.norm"))?,
                    conv: depthwise(h / 2, fvb.pp("sg.conv"), None)?,
                    fc2: Dense::load_unpadded(h / 2, e, plan, fvb.pp("fc2"))?,
                },
            })
        };
        let mut blocks = build_layers(vb.device(), pairs.len(), block)?.into_iter();
        let convs = build_layers(vb.device(), cfg.depths.len(), |i| {
            residual_conv(cfg, plan, vb.pp(format!("layers.{i}")).pp("conv"))
        })?;
        let groups = cfg
            .depths
            .iter()
            .zip(convs)
            .map(|(&depth, conv)| Group {
                blocks: blocks.by_ref().take(depth).collect(),
                conv,
            })
            .collect();
        let ep = Pad::OFF.one(e);
        let tail = match cfg.upsampler {
            Upsampler::PixelShuffle { num_feat: f } => {
                let f = Pad::OFF.one(f);
                Tail::pixel_shuffle((&ep, &f, f.real()), cfg.stages(), Pad::OFF, plan, &vb)?
            }
            Upsampler::Direct => Tail::direct(e, cfg.scale, plan, &vb)?,
        };
        let after_body = residual_conv(cfg, plan, vb.pp("conv_after_body"))?;
        // The network pads nothing outside its spatial attention: a frame window of 1.
        let mut frame = Frame::new((&ep, false), (after_body, tail), (1, cfg.scale), plan, &vb)?;
        // DAT's norm after conv_first is `before_RG.1`, where the Swin models have
        // `patch_embed.norm`.
        frame.patch_norm = Some(load_layer_norm(e, vb.pp("before_RG.1"))?);
        Ok(Self {
            frame,
            groups,
            masks,
        })
    }
}

impl Module for Dat {
    /// `x`: `(B, 3, H, W)` RGB in [0, 1], any H and W; see [`Frame::forward`].
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.frame.forward(x, |mut t| {
            for g in &self.groups {
                t = g.forward(&t)?;
            }
            Ok(t)
        })
    }
}

impl Net for Dat {
    fn dtype(&self) -> DType {
        self.frame.dtype()
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        self.masks.len()
    }
}

// ----------------------------------------------------------------------------------------
// registry
// ----------------------------------------------------------------------------------------

/// DAT's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "DAT"
    }

    fn loads(&self) -> &'static str {
        "DAT, DAT-S, DAT-2, DAT-light"
    }

    /// DAT's own blocks: the spatial blocks' interaction convolutions or the channel
    /// blocks' temperature (RGT, from the same authors, shares `before_RG` and `attns`).
    fn detect(&self, shapes: &Shapes) -> bool {
        shapes.keys().any(|k| {
            // layers.G.blocks.B.attn.*: the blocks sit right in the groups (CRAFT's and the
            // Swin family's sit in a residual_group).
            let parts: Vec<&str> = k.split('.').collect();
            let in_block = parts.len() > 5 && parts[0] == "layers" && parts[2] == "blocks";
            in_block
                && parts[4] == "attn"
                && matches!(
                    parts[5],
                    "channel_interaction" | "spatial_interaction" | "temperature"
                )
        })
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
        match DatConfig::infer(shapes, values) {
            Ok(c) => Ok(Arc::new(c)),
            Err(e) => Err(ConfigError::Dat(Box::new(e))),
        }
    }
}

type Tensors = Vec<(String, Vec<usize>)>;

fn conv(t: &mut Tensors, name: &str, cout: usize, cin: usize, k: usize) {
    t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
    t.push((format!("{name}.bias"), vec![cout]));
}

fn linear(t: &mut Tensors, name: &str, cout: usize, cin: usize) {
    t.push((format!("{name}.weight"), vec![cout, cin]));
    t.push((format!("{name}.bias"), vec![cout]));
}

fn norm(t: &mut Tensors, name: &str, c: usize) {
    t.push((format!("{name}.weight"), vec![c]));
    t.push((format!("{name}.bias"), vec![c]));
}

fn batch_norm_tensors(t: &mut Tensors, name: &str, c: usize) {
    norm(t, name, c);
    t.push((format!("{name}.running_mean"), vec![c]));
    t.push((format!("{name}.running_var"), vec![c]));
}

fn residual_tensors(t: &mut Tensors, name: &str, e: usize, three: bool) {
    if three {
        conv(t, &format!("{name}.0"), e / 4, e, 3);
        conv(t, &format!("{name}.2"), e / 4, e / 4, 1);
        conv(t, &format!("{name}.4"), e, e / 4, 3);
    } else {
        conv(t, name, e, e, 3);
    }
}

impl NetConfig for DatConfig {
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let e = self.embed_dim;
        let h = self.ffn_hidden;
        let p = pos_dim(e);
        let mut t: Tensors = Vec::new();
        conv(&mut t, "conv_first", e, self.in_chans, 3);
        norm(&mut t, "before_RG.1", e);
        for (i, (&depth, &heads)) in self.depths.iter().zip(&self.heads).enumerate() {
            for j in 0..depth {
                let b = format!("layers.{i}.blocks.{j}");
                let a = format!("{b}.attn");
                norm(&mut t, &format!("{b}.norm1"), e);
                t.push((format!("{a}.qkv.weight"), vec![3 * e, e]));
                if self.qkv_bias {
                    t.push((format!("{a}.qkv.bias"), vec![3 * e]));
                }
                linear(&mut t, &format!("{a}.proj"), e, e);
                t.push((format!("{a}.dwconv.0.weight"), vec![e, 1, 3, 3]));
                t.push((format!("{a}.dwconv.0.bias"), vec![e]));
                batch_norm_tensors(&mut t, &format!("{a}.dwconv.1"), e);
                conv(&mut t, &format!("{a}.channel_interaction.1"), e / 8, e, 1);
                batch_norm_tensors(&mut t, &format!("{a}.channel_interaction.2"), e / 8);
                conv(&mut t, &format!("{a}.channel_interaction.4"), e, e / 8, 1);
                conv(&mut t, &format!("{a}.spatial_interaction.0"), e / 16, e, 1);
                batch_norm_tensors(&mut t, &format!("{a}.spatial_interaction.1"), e / 16);
                conv(&mut t, &format!("{a}.spatial_interaction.3"), 1, e / 16, 1);
                if j.is_multiple_of(2) {
                    for k in 0..2 {
                        let s = format!("{a}.attns.{k}");
                        t.push((format!("{s}.rpe_biases"), vec![self.rpe_rows(), 2]));
                        linear(&mut t, &format!("{s}.pos.pos_proj"), p, 2);
                        for m in 1..=3 {
                            norm(&mut t, &format!("{s}.pos.pos{m}.0"), p);
                            let out = if m == 3 { heads / 2 } else { p };
                            linear(&mut t, &format!("{s}.pos.pos{m}.2"), out, p);
                        }
                    }
                } else {
                    t.push((format!("{a}.temperature"), vec![heads, 1, 1]));
                }
                norm(&mut t, &format!("{b}.norm2"), e);
                linear(&mut t, &format!("{b}.ffn.fc1"), h, e);
                norm(&mut t, &format!("{b}.ffn.sg.norm"), h / 2);
                t.push((format!("{b}.ffn.sg.conv.weight"), vec![h / 2, 1, 3, 3]));
                t.push((format!("{b}.ffn.sg.conv.bias"), vec![h / 2]));
                linear(&mut t, &format!("{b}.ffn.fc2"), e, h / 2);
            }
            residual_tensors(&mut t, &format!("layers.{i}.conv"), e, self.three_conv);
        }
        norm(&mut t, "norm", e);
        residual_tensors(&mut t, "conv_after_body", e, self.three_conv);
        match self.upsampler {
            Upsampler::PixelShuffle { num_feat: f } => {
                conv(&mut t, "conv_before_upsample.0", f, e, 3);
                for (i, r) in self.stages().iter().enumerate() {
                    conv(&mut t, &format!("upsample.{}", 2 * i), r * r * f, f, 3);
                }
                conv(&mut t, "conv_last", self.in_chans, f, 3);
            }
            Upsampler::Direct => {
                let s = self.scale;
                conv(&mut t, "upsample.0", s * s * self.in_chans, e, 3);
            }
        }
        t
    }

    /// The learned parameters alone, as the paper counts them: not the BatchNorm statistics
    /// nor the position grids, which the files also hold.
    fn parameter_count(&self) -> usize {
        let learned: Vec<_> = self
            .expected_tensors()
            .into_iter()
            .filter(|(n, _)| !n.ends_with("running_mean") && !n.ends_with("running_var"))
            .filter(|(n, _)| !n.ends_with("rpe_biases"))
            .collect();
        crate::nets::infer::parameters(&learned)
    }

    fn flops(&self, h: usize, w: usize) -> f64 {
        let l = (h * w) as f64;
        let e = self.embed_dim as f64;
        let hid = self.ffn_hidden as f64;
        let n = (self.split[0] * self.split[1]) as f64;
        // Per token: qkv and proj, the FFN, the depthwise convolutions and the interactions.
        let common = 2.0 * (4.0 * e * e + 1.5 * e * hid)
            + 2.0 * 9.0 * (e + hid / 2.0)
            + 2.0 * (e * e / 16.0);
        let mut blocks = 0.0;
        for (i, &d) in self.depths.iter().enumerate() {
            let head_dim = e / self.heads[i] as f64;
            for j in 0..d {
                blocks += common
                    + if j.is_multiple_of(2) {
                        4.0 * n * e
                    } else {
                        4.0 * e * head_dim
                    };
            }
        }
        let groups = self.depths.len() as f64 + 1.0;
        let res = if self.three_conv {
            2.0 * (9.0 * e * e / 4.0 * 2.0 + e * e / 16.0)
        } else {
            2.0 * 9.0 * e * e
        };
        let mut total = l * (2.0 * 27.0 * e + blocks + groups * res);
        match self.upsampler {
            Upsampler::PixelShuffle { num_feat } => {
                let f = num_feat as f64;
                total += l * 2.0 * 9.0 * e * f;
                let mut pixels = l;
                for r in self.stages() {
                    let r = r as f64;
                    total += 2.0 * pixels * 9.0 * f * r * r * f;
                    pixels *= r * r;
                }
                total + 2.0 * pixels * 9.0 * f * 3.0
            }
            Upsampler::Direct => {
                let s2 = (self.scale * self.scale) as f64;
                total + l * 2.0 * 9.0 * e * 3.0 * s2
            }
        }
    }

    fn family(&self) -> &'static str {
        "DAT"
    }

    fn variant(&self) -> &'static str {
        DatConfig::variant(self)
    }

    fn describe(&self) -> serde_json::Value {
        let c = self;
        json!({
            "scale": c.scale,
            "groups": c.depths.len(),
            "depths": uniform(&c.depths),
            "embed_dim": c.embed_dim,
            "heads": uniform(&c.heads),
            "split_size": c.split,
            "expansion_factor": c.expansion_factor(),
            "qkv_bias": c.qkv_bias,
            "resi_connection": if c.three_conv { "3conv" } else { "1conv" },
            "upsampler": match c.upsampler {
                Upsampler::PixelShuffle { .. } => "pixelshuffle",
                Upsampler::Direct => "pixelshuffledirect",
            },
            "num_feat": match c.upsampler {
                Upsampler::PixelShuffle { num_feat } => json!(num_feat),
                Upsampler::Direct => json!(null),
            },
            "in_chans": c.in_chans,
        })
    }

    fn activations_per_pixel(&self, _scores_in_memory: bool, _pad: Pad) -> f64 {
        // The spatial attention's scores and probabilities of one half, its padded q, k, v
        // and their window copies, the block's input, norms and branches, the FFN's hidden
        // layer; and the upsampler's high-resolution maps.
        let n = (self.split[0] * self.split[1]) as f64;
        let heads = self.heads.iter().copied().max().unwrap_or(2) as f64 / 2.0;
        let e = self.embed_dim as f64;
        let s2 = (self.scale * self.scale) as f64;
        let up = match self.upsampler {
            Upsampler::PixelShuffle { num_feat } => 3.0 * num_feat as f64 * s2,
            Upsampler::Direct => 6.0 * s2,
        };
        3.0 * heads * n + 14.0 * e + 2.0 * self.ffn_hidden as f64 + up
    }

    fn scale(&self) -> usize {
        self.scale
    }

    fn window(&self) -> usize {
        self.pad_multiple()
    }

    fn widest_head_dim(&self) -> usize {
        self.heads
            .iter()
            .map(|&h| self.embed_dim / h)
            .max()
            .unwrap_or(0)
    }

    fn largest_tensor_per_pixel(&self, _scores_in_memory: bool, _: Pad) -> usize {
        let n = self.split[0] * self.split[1];
        let heads = self.heads.iter().copied().max().unwrap_or(2) / 2;
        let up = match self.upsampler {
            Upsampler::PixelShuffle { num_feat } => num_feat * self.scale * self.scale,
            Upsampler::Direct => 3 * self.scale * self.scale,
        };
        [heads * n, 3 * self.embed_dim, self.ffn_hidden, up]
            .into_iter()
            .max()
            .unwrap_or(1)
    }

    fn refusal(&self) -> Option<String> {
        (self.in_chans != 3).then(|| {
            format!(
                "a DAT model with {} image channels: only RGB models (3) run",
                self.in_chans
            )
        })
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(Dat::new(self, plan, vb)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::windows::rectangle_regions;

    /// The CPU kernel's region labels mask exactly the pairs the graph's stored mask does,
    /// for both branches' window shapes on a padded map of several windows each way.
    #[test]
    fn region_labels_mask_what_the_stored_mask_masks() {
        for (hs, ws) in [(8, 16), (16, 8), (4, 8)] {
            let (hp, wp) = (3 * hs, 2 * ws);
            let mask = shift_mask((hp, wp, hs, ws));
            let labels = rectangle_regions((hp, wp), (hs, ws));
            let n = hs * ws;
            assert_eq!(labels.len(), (hp / hs) * (wp / ws) * n);
            for (win, l) in labels.chunks_exact(n).enumerate() {
                for i in 0..n {
                    for j in 0..n {
                        let masked = mask[(win * n + i) * n + j] != 0.0;
                        assert_eq!(masked, l[i] != l[j], "{hs}x{ws} window {win}: {i}, {j}");
                    }
                }
            }
        }
    }

    /// The rectangular table reads the bias the branch's gather wrote before: query (yi,
    /// xi) and key (yj, xj) take row (yi - yj + hs - 1) * (2ws - 1) + (xi - xj + ws - 1).
    #[test]
    fn the_rectangular_table_gathers_the_official_index() -> Result<()> {
        let (hs, ws, heads) = (3, 5, 2);
        let rows = (2 * hs - 1) * (2 * ws - 1);
        let values: Vec<f32> = (0..rows * heads).map(|v| v as f32 * 0.25 - 7.0).collect();
        let table = Tensor::from_vec(values.clone(), (rows, heads), &Device::Cpu)?;
        let gathered = RelativeBias::rectangular(&table, (hs, ws))?.gathered();
        let n = hs * ws;
        for h in 0..heads {
            for i in 0..n {
                for j in 0..n {
                    let row = (i / ws + hs - 1 - j / ws) * (2 * ws - 1) + i % ws + ws - 1 - j % ws;
                    assert_eq!(gathered[(h * n + i) * n + j], values[row * heads + h]);
                }
            }
        }
        assert!(RelativeBias::rectangular(&table, (hs + 1, ws)).is_err());
        Ok(())
    }

    #[test]
    fn the_shifted_blocks_are_the_official_ones() {
        let even: Vec<usize> = (0..12).filter(|&j| shifted(0, j)).collect();
        let odd: Vec<usize> = (0..12).filter(|&j| shifted(1, j)).collect();
        assert_eq!(even, [2, 6, 10]);
        assert_eq!(odd, [0, 4, 8]);
    }

    #[test]
    fn the_offset_grid_ends_in_the_largest_offsets() {
        let g = offset_grid(2, 3);
        assert_eq!(g.len(), 2 * 3 * 5);
        assert_eq!(&g[..2], &[-1.0, -2.0]);
        assert_eq!(&g[g.len() - 2..], &[1.0, 2.0]);
    }

    #[test]
    fn roll_matches_torch_roll() {
        let x = Tensor::arange(0f32, 5.0, &Device::Cpu)
            .unwrap()
            .reshape((1, 5, 1, 1))
            .unwrap();
        let v = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // torch.roll([0..5], -2) = [2, 3, 4, 0, 1]
        assert_eq!(v(roll(&x, -2, 0).unwrap()), [2.0, 3.0, 4.0, 0.0, 1.0]);
        assert_eq!(v(roll(&x, 2, 0).unwrap()), [3.0, 4.0, 0.0, 1.0, 2.0]);
    }
}
