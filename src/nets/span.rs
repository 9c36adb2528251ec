//! SPAN (Swift Parameter-free Attention Network, Wan et al., 2024), inference only.
//!
//! The network, as the released code defines it:
//!
//! ```text
//! x  = (x - rgb_mean) · 255                  unless the file holds the `no_norm` buffer
//! f0 = conv_1(x)                             C -> F
//! b1 = SPAB_1(f0), ..., b6 = SPAB_6(b5)      each also returns silu(o1); the sixth's is
//!                                            kept (b5')
//! SPAB(t): o1 = c1(t); o2 = c2(silu(o1)); o3 = c3(silu(o2))
//!          = (o3 + t) · (sigmoid(o3) - 0.5)  the parameter-free attention
//! y  = conv_cat(cat(f0, conv_2(b6), b1, b5'))  1x1, 4F -> F
//! y  = PixelShuffle(s)(upsampler.0(y))       3x3, F -> C'·s²
//! ```
//!
//! Every `conv_1`, `conv_2` and `cK_r` is a three-branch convolution (Conv3XC): a 1x1
//! (C -> 2C), a 3x3 without padding (2C -> 2F) and a 1x1 (2F -> F), plus a 1x1 skip (C -> F).
//! In eval mode the reference folds the four into one padded 3x3 (`eval_conv`) on every
//! forward, whatever `eval_conv` the file holds; here they are folded once at load, in f64
//! ([`fold`]), and the stored `eval_conv` is checked for its shape and not read. The output
//! is neither de-normalised nor added to an upscaled input: trained models learn it whole.
//! The reference returns its first convolution's output from each block but applies its SiLU
//! in place (`nn.SiLU(inplace=True)`), so what it concatenates as b5' is silu(o1).

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::infer::{check_shapes, isqrt, out_width, tensor, ConfigError, Shapes};
use crate::nets::registry::Architecture;
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::conv::{Act, Conv3x3};
use crate::ops::cpu::gemm_f64;
use crate::ops::linear::{pointwise_with, Dense};
use crate::ops::pad::Pad;
use crate::ops::{build_layers, LoadPlan};

/// The reference's RGB mean (`rgb_mean`), as the float32 values its module holds.
const RGB_MEAN: [f32; 3] = [0.4488, 0.4371, 0.4040];
/// The reference's `img_range`: the normalised input is scaled by it.
const IMG_RANGE: f64 = 255.0;
/// The attention blocks; the reference builds six whatever the file, and names them.
const BLOCKS: usize = 6;
/// Conv3XC's hidden width over its input's and output's (`gain1=2` everywhere in SPAN).
const GAIN: usize = 2;

/// SPAN's configuration, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SpanConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    /// Feature channels (`feature_channels`).
    pub features: usize,
    pub scale: usize,
    /// Whether the input is normalised (`(x - rgb_mean) · 255`): every file without the
    /// `no_norm` buffer.
    pub norm: bool,
}

impl SpanConfig {
    /// The three-branch convolutions, as (name, in, out).
    fn conv3xc(&self) -> Vec<(String, usize, usize)> {
        let f = self.features;
        let mut v = vec![("conv_1".to_string(), self.in_channels, f)];
        for b in 1..=BLOCKS {
            for k in 1..=3 {
                v.push((format!("block_{b}.c{k}_r"), f, f));
            }
        }
        v.push(("conv_2".to_string(), f, f));
        v
    }

    fn upsampler_outputs(&self) -> usize {
        self.out_channels * self.scale * self.scale
    }

    /// The configuration read from the tensor names and shapes, every tensor checked.
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let sk = "conv_1.sk.weight";
        let features = out_width(shapes, sk)?;
        let in_channels = tensor(shapes, sk)?[1];
        let up = "upsampler.0.weight";
        let outputs = out_width(shapes, up)?;
        // The reference's reading of a pixel-shuffle width: the first of the input's
        // channels, 3, 4 and 1 that leaves a square.
        let (scale, out_channels) = [in_channels, 3, 4, 1]
            .into_iter()
            .filter(|&c| c > 0 && outputs.is_multiple_of(c))
            .map(|c| (isqrt(outputs / c), c))
            .find(|&(s, c)| s * s * c == outputs)
            .ok_or_else(|| {
                ConfigError::shape(
                    up,
                    &shapes[up],
                    ": not scale² times 1, 3, 4 or the input's channels",
                )
            })?;
        let cfg = SpanConfig {
            in_channels,
            out_channels,
            features,
            scale,
            norm: !shapes.contains_key("no_norm"),
        };
        check_shapes(&cfg.expected_tensors(), shapes, " (SPAN holds six blocks)")?;
        Ok(cfg)
    }
}

/// The values of tensor `name` under `vb` with shape `dims`, in f32 on the host.
fn values(vb: &VarBuilder, dims: &[usize], name: &str) -> Result<Vec<f32>> {
    vb.get_with_hints_dtype(dims, name, Default::default(), DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()
}

/// The values of tensor `name` under `vb` with shape `dims`, in f64 on the host.
fn values_f64(vb: &VarBuilder, dims: &[usize], name: &str) -> Result<Vec<f64>> {
    Ok(values(vb, dims, name)?.into_iter().map(f64::from).collect())
}

/// Conv3XC under `vb`, from `cin` to `cout` channels, as one 3x3 convolution's weight
/// `(cout, cin, 3, 3)` and bias, folded in f64 as the reference's eval mode folds it:
///
/// ```text
/// W[o, i, k] = Σ_m w3[o, m] Σ_n w2[m, n, k] w1[n, i]   (+ sk[o, i] at the centre tap)
/// B[o]       = Σ_m w3[o, m] (Σ_{n,k} w2[m, n, k] b1[n] + b2[m]) + b3[o] + sk_b[o]
/// ```
///
/// (w1: the first 1x1, w2: the 3x3, w3: the last 1x1). The 3x3 is unpadded in training,
/// its input padded after the first 1x1; folded, the first 1x1's bias reaches the border
/// taps too, as in the reference's eval mode. One tap at a time, so that every intermediate
/// is a few tens of kilobytes: the whole fold's products at once were megabytes of fresh
/// memory per layer, paged in at load.
fn fold(cin: usize, cout: usize, vb: &VarBuilder) -> Result<(Vec<f64>, Vec<f64>)> {
    let (n1, m2) = (GAIN * cin, GAIN * cout);
    let w1 = values_f64(vb, &[n1, cin, 1, 1], "conv.0.weight")?;
    let b1 = values_f64(vb, &[n1], "conv.0.bias")?;
    // The 3x3 stays in f32, read a tap at a time.
    let w2 = values(vb, &[m2, n1, 3, 3], "conv.1.weight")?;
    let b2 = values_f64(vb, &[m2], "conv.1.bias")?;
    let w3 = values_f64(vb, &[cout, m2, 1, 1], "conv.2.weight")?;
    let b3 = values_f64(vb, &[cout], "conv.2.bias")?;
    let sk = values_f64(vb, &[cout, cin, 1, 1], "sk.weight")?;
    let sk_b = values_f64(vb, &[cout], "sk.bias")?;
    // c[m] = Σ_{n,k} w2[m, n, k] b1[n] + b2[m]: what the first 1x1's bias becomes.
    let mut c = b2;
    for (m, c) in c.iter_mut().enumerate() {
        for (n, &b) in b1.iter().enumerate() {
            let taps = &w2[(m * n1 + n) * 9..][..9];
            *c += taps.iter().map(|&t| f64::from(t)).sum::<f64>() * b;
        }
    }
    let bias: Vec<f64> = (0..cout)
        .map(|o| {
            let mixed: f64 = (0..m2).map(|m| w3[o * m2 + m] * c[m]).sum();
            b3[o] + mixed + sk_b[o]
        })
        .collect();
    let mut weight = vec![0.0; cout * cin * 9];
    let (mut tap, mut a, mut by_tap) = (
        vec![0.0; m2 * n1],
        vec![0.0; m2 * cin],
        vec![0.0; cout * cin],
    );
    for k in 0..9 {
        // tap[m, n] = w2[m, n, k]; a = tap · w1 (m2 x cin); by_tap = w3 · a (cout x cin).
        for (t, &w) in tap.iter_mut().zip(w2.iter().skip(k).step_by(9)) {
            *t = f64::from(w);
        }
        a.fill(0.0);
        gemm_f64(&tap, &w1, (m2, n1, cin), &mut a);
        by_tap.fill(0.0);
        gemm_f64(&w3, &a, (cout, m2, cin), &mut by_tap);
        if k == 4 {
            for (t, &s) in by_tap.iter_mut().zip(&sk) {
                *t += s;
            }
        }
        for (oi, &v) in by_tap.iter().enumerate() {
            weight[oi * 9 + k] = v;
        }
    }
    Ok((weight, bias))
}

/// Conv3XC under `vb`, folded ([`fold`]), as the 3x3 convolution layer `plan` asks for.
fn folded_conv(cin: usize, cout: usize, plan: &LoadPlan, vb: &VarBuilder) -> Result<Conv3x3> {
    let (w, b) = fold(cin, cout, vb)?;
    let (dtype, device) = (vb.dtype(), vb.device());
    let as_layer = |v: Vec<f64>, shape: &[usize]| {
        Tensor::from_vec(v, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    };
    let tensors = HashMap::from([
        ("weight".to_string(), as_layer(w, &[cout, cin, 3, 3])?),
        ("bias".to_string(), as_layer(b, &[cout])?),
    ]);
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    Conv3x3::unpadded(cin, cout, plan, vb)
}

/// Swift parameter-free attention block: three folded convolutions with SiLU between,
/// their output gating the block's residual sum.
struct Spab {
    convs: [Conv3x3; 3],
}

impl Spab {
    /// `(out, silu(o1))`: the block's output and its first convolution's, activated.
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        // Each activation (and the attention) as its convolution's outputs are written.
        let [c1, c2, c3] = &self.convs;
        let a1 = c1.forward_act(x, Act::Silu)?;
        let a2 = c2.forward_act(&a1, Act::Silu)?;
        Ok((c3.forward_act(&a2, Act::Gate(x))?, a1))
    }
}

pub struct Span {
    /// `(x - mean) · 255` on the input, when the model normalises it: the mean `(C)`.
    mean: Option<Tensor>,
    first: Conv3x3,
    blocks: Vec<Spab>,
    last: Conv3x3,
    cat: Dense,
    /// The upsampling convolution, shuffled by `scale` (plain at scale 1).
    up: Conv3x3,
    scale: usize,
    dtype: DType,
}

impl Span {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &SpanConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (f, c, s) = (cfg.features, cfg.out_channels, cfg.scale);
        let blocks = build_layers(vb.device(), BLOCKS, |b| {
            let conv =
                |k: usize| folded_conv(f, f, plan, &vb.pp(format!("block_{}.c{k}_r", b + 1)));
            Ok(Spab {
                convs: [conv(1)?, conv(2)?, conv(3)?],
            })
        })?;
        let mean = cfg
            .norm
            .then(|| Tensor::new(&RGB_MEAN[..], vb.device())?.to_dtype(vb.dtype()))
            .transpose()?;
        let vb_up = vb.pp("upsampler.0");
        let up = if s == 1 {
            Conv3x3::unpadded(f, c, plan, vb_up)?
        } else {
            Conv3x3::shuffled(&Pad::OFF.one(f), (c, s), Pad::OFF, plan, vb_up)?
        };
        Ok(Self {
            mean,
            first: folded_conv(cfg.in_channels, f, plan, &vb.pp("conv_1"))?,
            blocks,
            last: folded_conv(f, f, plan, &vb.pp("conv_2"))?,
            cat: pointwise_with(4 * f, f, plan, vb.pp("conv_cat"))?,
            up,
            scale: s,
            dtype: vb.dtype(),
        })
    }
}

impl Net for Span {
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for Span {
    /// `x`: `(B, C, H, W)` in [0, 1], any H and W; returns `(B, C', sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x
            .to_dtype(self.dtype)?
            .permute((0, 2, 3, 1))?
            .contiguous()?;
        if let Some(mean) = &self.mean {
            x = x.broadcast_sub(mean)?.affine(IMG_RANGE, 0.0)?;
        }
        let f0 = self.first.forward(&x)?;
        let mut t = f0.clone();
        let (mut b1, mut o1) = (None, None);
        for block in &self.blocks {
            let (out, first) = block.forward(&t)?;
            b1.get_or_insert_with(|| out.clone());
            (t, o1) = (out, Some(first));
        }
        let (Some(b1), Some(b5)) = (b1, o1) else {
            candle_core::bail!("SPAN has {BLOCKS} blocks");
        };
        let b6 = self.last.forward(&t)?;
        let y = self.cat.forward_cat(&[&f0, &b6, &b1, &b5])?;
        let y = if self.scale == 1 {
            self.up.forward(&y)?
        } else {
            self.up.forward_shuffled(&y, self.scale)?
        };
        y.permute((0, 3, 1, 2))?.contiguous()
    }
}

/// SPAN's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "SPAN"
    }

    fn loads(&self) -> &'static str {
        "with and without input normalisation, x1-x4"
    }

    /// The first three-branch convolution's skip and the concatenating 1x1, which no other
    /// registered network names.
    fn detect(&self, shapes: &Shapes) -> bool {
        shapes.contains_key("conv_1.sk.weight") && shapes.contains_key("conv_cat.weight")
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match SpanConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::Span(Box::new(e))),
        }
    }
}

impl NetConfig for SpanConfig {
    /// The parameters the network computes with: the folded 3x3 convolutions, not the
    /// training branches a file also holds.
    fn parameter_count(&self) -> usize {
        let folded: usize = self
            .conv3xc()
            .iter()
            .map(|(_, cin, cout)| cout * cin * 9 + cout)
            .sum();
        let f = self.features;
        folded + 4 * f * f + f + self.upsampler_outputs() * (9 * f + 1)
    }

    /// Every tensor the configuration implies, with its shape.
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let f = self.features;
        let mut t = Vec::new();
        let mut conv = |name: String, cout: usize, cin: usize, k: usize| {
            t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
            t.push((format!("{name}.bias"), vec![cout]));
        };
        for (name, cin, cout) in self.conv3xc() {
            conv(format!("{name}.sk"), cout, cin, 1);
            conv(format!("{name}.conv.0"), GAIN * cin, cin, 1);
            conv(format!("{name}.conv.1"), GAIN * cout, GAIN * cin, 3);
            conv(format!("{name}.conv.2"), cout, GAIN * cout, 1);
            conv(format!("{name}.eval_conv"), cout, cin, 3);
        }
        conv("conv_cat".into(), f, 4 * f, 1);
        let up = self.out_channels * self.scale * self.scale;
        conv("upsampler.0".into(), up, f, 3);
        if !self.norm {
            t.push(("no_norm".into(), vec![1]));
        }
        t
    }

    /// The folded network's multiply-adds, x2.
    fn flops(&self, h: usize, w: usize) -> f64 {
        let f = self.features;
        let convs: usize = self
            .conv3xc()
            .iter()
            .map(|(_, cin, cout)| 9 * cin * cout)
            .sum();
        let per_pixel = convs + 4 * f * f + 9 * f * self.upsampler_outputs();
        2.0 * (per_pixel * h * w) as f64
    }

    fn family(&self) -> &'static str {
        "SPAN"
    }

    fn variant(&self) -> &'static str {
        if self.norm {
            "SPAN"
        } else {
            "SPAN (no input normalisation)"
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
            "features": self.features,
            "blocks": BLOCKS,
            "input_norm": self.norm,
        })
    }

    fn largest_tensor_per_pixel(&self, _: bool, _: Pad) -> usize {
        (4 * self.features).max(self.upsampler_outputs()).max(1)
    }

    /// In the last block: the kept f0, b1 and o1, its input and three of its own; at the
    /// concatenation its four inputs, the concatenation and its output; then the
    /// upsampler's output and its shuffled copy.
    fn activations_per_pixel(&self, _: bool, _: Pad) -> f64 {
        let f = self.features as f64;
        (9.0 * f).max(f + 2.0 * self.upsampler_outputs() as f64)
    }

    fn refusal(&self) -> Option<String> {
        let channels = (self.in_channels, self.out_channels);
        if channels == (1, 1) && self.norm {
            // The reference subtracts its RGB mean from the one channel: three come out, and
            // its first convolution refuses them.
            return Some("a greyscale SPAN model that normalises by the RGB mean".into());
        }
        (channels != (3, 3) && channels != (1, 1)).then(|| {
            format!(
                "a SPAN model with {} input and {} output channels: only RGB (3) and greyscale \
                 (1) models run",
                self.in_channels, self.out_channels
            )
        })
    }

    fn greyscale(&self) -> bool {
        (self.in_channels, self.out_channels) == (1, 1)
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(Span::new(self, plan, vb)?))
    }
}
