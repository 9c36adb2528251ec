//! HAT (Hybrid Attention Transformer, Chen et al., CVPR 2023), super-resolution, inference only.
//!
//! The network, as the paper and the official `hat_arch.py` define it:
//!
//! ```text
//! x  = x - mean;  f0 = conv_first(x);  t = patch_embed.norm(tokens(f0))
//! for each residual hybrid attention group (RHAG) i:
//!     u = t
//!     for each hybrid attention block (HAB) j:       plain / half-window shift, alternating
//!         n = norm1(u)
//!         c = CAB(n) * conv_scale                    CAB: 3x3 E->E/compress, GELU, 3x3 back
//!                                                    to E, times channel attention
//!                                                    sigmoid(1x1(relu(1x1(mean_hw(.)))))
//!         u = u + window_attention(n) + c;  u = u + mlp(norm2(u))
//!     u = OCAB(u)                                    overlapping cross-attention (below)
//!     t = conv_i(u) + t
//! b  = conv_after_body(norm(t)) + f0
//! y  = conv_last(upsample(lrelu_0.01(conv_before_upsample(b)))) + mean
//! ```
//!
//! OCAB: queries from `ws x ws` windows, keys and values from `ows x ows` windows centred on
//! them (`ows = ws + overlap_ratio * ws`, zero outside the image, no mask), a relative
//! position bias of `(ws + ows - 1)^2` rows, then `proj` plus the input and an MLP. The
//! official bias index is `(dy + ws - ows + 1) * (ws + ows - 1) + (dx + ws - ows + 1)` with
//! `(dy, dx)` the key's position minus the query's; it goes negative, and PyTorch's indexing
//! wraps negative indices, so the row used is that index modulo the table's length.
//!
//! On CUDA the OCAB's attention is one kernel
//! ([`crate::ops::attention::cuda::FusedOverlapAttention`]) that reads each neighbourhood
//! straight from the token map; `UPSCALE_CUDA_OCA=0` or `--attention reference` runs candle's
//! graph instead, which the CPU always runs.
//!
//! `conv_scale` is not stored in checkpoints: every released model uses 0.01. The HAB is
//! DRCT's Swin block ([`crate::nets::swin::SwinBlock`]) with the CAB term added to its residual.

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::{AfterBody, Frame, SwinNet, Tail};
use crate::nets::infer::ConfigError;
use crate::nets::infer::{
    check_shapes, isqrt, out_width, pixel_shuffle_scale, pixel_shuffle_stages, swin_layout, tensor,
    Shapes, SwinLayout,
};
use crate::nets::registry::{swin_family, Architecture};
use crate::nets::swin::{load_layer_norm, BlockShape, Mlp, SwinBlock, SwinCost};
use crate::nets::{uniform, ArchConfig, Net, NetConfig};
use crate::ops::attention::OverlapAttend;
use crate::ops::conv::Conv3x3;
use crate::ops::linear::{pointwise, Dense};
use crate::ops::norm::{layer_norm, Norm};
use crate::ops::pad::Pad;
use crate::ops::windows::WindowCache;
use crate::ops::{scale_leading, LoadPlan};

/// The weight of the convolution branch in every released HAT model (not in the weights).
pub const CONV_SCALE: f64 = 0.01;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HatConfig {
    pub embed_dim: usize,
    /// HABs of each group (RHAG).
    pub depths: Vec<usize>,
    /// Heads of each group (its HABs and its OCAB).
    pub heads: Vec<usize>,
    pub window: usize,
    /// Side of the OCAB key/value windows.
    pub overlap_window: usize,
    pub mlp_hidden: usize,
    pub ocab_mlp_hidden: usize,
    /// Width inside the CAB (embed_dim / compress_ratio).
    pub cab_width: usize,
    /// Width inside the channel attention (embed_dim / squeeze_factor).
    pub squeeze_width: usize,
    pub patch_norm: bool,
    /// A 3x3 convolution closes each group and the body ("1conv"); absent means the
    /// identity.
    pub group_conv: bool,
    pub num_feat: usize,
    pub scale: usize,
}

impl HatConfig {
    pub fn variant(&self) -> &'static str {
        let uniform = |d: usize| self.depths.iter().all(|&x| x == d);
        match (self.embed_dim, self.depths.len(), self.cab_width) {
            (144, 6, 6) if uniform(6) => "HAT-S",
            (180, 6, 60) if uniform(6) => "HAT",
            (180, 12, 60) if uniform(6) => "HAT-L",
            _ => "HAT",
        }
    }

    pub fn compress_ratio(&self) -> f64 {
        self.embed_dim as f64 / self.cab_width as f64
    }

    pub fn squeeze_factor(&self) -> f64 {
        self.embed_dim as f64 / self.squeeze_width as f64
    }

    pub fn overlap_ratio(&self) -> f64 {
        (self.overlap_window - self.window) as f64 / self.window as f64
    }

    pub fn head_dim(&self, layer: usize) -> usize {
        self.embed_dim / self.heads[layer]
    }

    fn ocab_table_rows(&self) -> usize {
        let side = self.window + self.overlap_window - 1;
        side * side
    }

    pub fn upsample_stages(&self) -> Vec<usize> {
        pixel_shuffle_stages(self.scale)
    }

    pub fn largest_tensor_per_pixel(&self, scores_in_memory: bool) -> usize {
        let heads = self.heads.iter().copied().max().unwrap_or(1);
        // OCAB's scores, heads x ows² per query, as candle's graph holds them (on the CPU, and
        // on CUDA with UPSCALE_CUDA_OCA=0); the fused kernel holds none, so this stays an upper
        // bound there.
        let ocab = heads * self.overlap_window * self.overlap_window;
        let sa = if scores_in_memory {
            heads * self.window * self.window
        } else {
            0
        };
        let upsampler = self.num_feat.max(3) * self.scale * self.scale;
        [
            sa,
            ocab,
            3 * self.embed_dim,
            self.mlp_hidden.max(self.ocab_mlp_hidden),
            upsampler,
        ]
        .into_iter()
        .max()
        .unwrap_or(1)
    }

    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let first = |name: &str| out_width(shapes, name);
        let name = "conv_first.weight";
        let cf = tensor(shapes, name)?;
        if cf.len() != 4 || cf[0] == 0 || cf[1] != 3 || cf[2] != 3 || cf[3] != 3 {
            return Err(ConfigError::shape(
                name,
                cf,
                "; an RGB HAT model has [E, 3, 3, 3]",
            ));
        }
        let embed_dim = cf[0];
        let SwinLayout {
            depths,
            window,
            heads,
        } = swin_layout(shapes, embed_dim)?;
        let b0 = "layers.0.residual_group.blocks.0";
        let ocab_name = "layers.0.residual_group.overlap_attn.relative_position_bias_table";
        let ot = tensor(shapes, ocab_name)?;
        let oside = if ot.len() == 2 { isqrt(ot[0]) } else { 0 };
        if ot.len() != 2 || oside * oside != ot[0] || oside < 2 * window - 1 {
            return Err(ConfigError::shape(
                ocab_name,
                ot,
                "; expected [(window+overlap_window-1)^2, heads]",
            ));
        }
        let overlap_window = oside + 1 - window;
        if (overlap_window - window) % 2 != 0 {
            return Err(ConfigError::OverlapMargins {
                overlap: overlap_window,
                window,
            });
        }
        let num_feat = first("conv_before_upsample.0.weight")?;
        let cfg = HatConfig {
            embed_dim,
            depths,
            heads,
            window,
            overlap_window,
            mlp_hidden: first(&format!("{b0}.mlp.fc1.weight"))?,
            ocab_mlp_hidden: first("layers.0.residual_group.overlap_attn.mlp.fc1.weight")?,
            cab_width: first(&format!("{b0}.conv_block.cab.0.weight"))?,
            squeeze_width: first(&format!("{b0}.conv_block.cab.3.attention.1.weight"))?,
            patch_norm: shapes.contains_key("patch_embed.norm.weight"),
            group_conv: shapes.contains_key("layers.0.conv.weight"),
            num_feat,
            scale: pixel_shuffle_scale(shapes, num_feat)?,
        };
        check_shapes(
            &cfg.expected_tensors(),
            shapes,
            " (an unsupported HAT variant or another architecture)",
        )?;
        Ok(cfg)
    }
}

/// Channel attention block: the convolution branch of a HAB.
struct Cab {
    conv1: Conv3x3,
    conv2: Conv3x3,
    squeeze: Dense,
    excite: Dense,
}

impl Cab {
    fn new(cfg: &HatConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let e = cfg.embed_dim;
        let ca = vb.pp("3.attention");
        Ok(Self {
            conv1: Conv3x3::unpadded(e, cfg.cab_width, plan, vb.pp("0"))?,
            conv2: Conv3x3::unpadded(cfg.cab_width, e, plan, vb.pp("2"))?,
            squeeze: pointwise(e, cfg.squeeze_width, ca.pp("1"))?,
            excite: pointwise(cfg.squeeze_width, e, ca.pp("3"))?,
        })
    }

    /// `cab(x) * CONV_SCALE` for `x` `(B, H, W, C)`, as its two factors: the convolutions'
    /// output `z` `(B, H, W, C)` and the channel attention times `CONV_SCALE`, `s` `(B, C)`.
    /// The block adds `z * s` in the pass that sums its residual, rather than multiplying
    /// here in a pass of its own.
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let z = self
            .conv2
            .forward(&crate::ops::gelu_erf(&self.conv1.forward(x)?)?)?;
        let pooled = crate::ops::mean_hw(&z)?;
        let y = self.squeeze.forward(&pooled)?.relu()?;
        let y = (candle_nn::ops::sigmoid(&self.excite.forward(&y)?)? * CONV_SCALE)?;
        let (b, c) = (y.dim(0)?, y.dim(3)?);
        Ok((z, y.reshape((b, c))?))
    }
}

struct Hab {
    swin: SwinBlock,
    cab: Cab,
}

impl Module for Hab {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (z, s) = self.cab.forward(&layer_norm(self.swin.norm1(), x)?)?;
        self.swin.forward_plus(x, Some((&z, &s)))
    }
}

/// Overlapping cross-attention block.
struct Ocab {
    norm1: Norm,
    /// Query rows pre-scaled by head_dim^-0.5.
    qkv: Dense,
    proj: Dense,
    /// `(heads, ws², ows²)`, gathered from the table at load.
    attend: OverlapAttend,
    norm2: Norm,
    mlp: Mlp,
}

impl Ocab {
    fn new(cfg: &HatConfig, heads: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let e = cfg.embed_dim;
        let (ws, ows) = (cfg.window, cfg.overlap_window);
        let scale = ((e / heads) as f64).powf(-0.5);
        let w = vb.pp("qkv").get((3 * e, e), "weight")?;
        let b = vb.pp("qkv").get(3 * e, "bias")?;
        let w = scale_leading(&w, e, scale)?;
        let b = scale_leading(&b, e, scale)?;
        let table = vb.get(
            (cfg.ocab_table_rows(), heads),
            "relative_position_bias_table",
        )?;
        Ok(Self {
            norm1: load_layer_norm(e, vb.pp("norm1"))?,
            qkv: Dense::new(w, b, plan)?,
            proj: Dense::load_unpadded(e, e, plan, vb.pp("proj"))?,
            attend: OverlapAttend::new(&table, heads, (ws, ows), plan)?,
            norm2: load_layer_norm(e, vb.pp("norm2"))?,
            mlp: Mlp::unpadded(e, cfg.ocab_mlp_hidden, plan, vb.pp("mlp"))?,
        })
    }
}

impl Module for Ocab {
    /// `x`: `(B, H, W, C)` with H and W multiples of the window.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let qkv = self.qkv.forward(&layer_norm(&self.norm1, x)?)?;
        let y = self.attend.forward(&qkv)?;
        let x = (self.proj.forward(&y)? + x)?;
        self.mlp.forward_residual(&layer_norm(&self.norm2, &x)?, x)
    }
}

pub(crate) struct Rhag {
    blocks: Vec<Hab>,
    ocab: Ocab,
    conv: Option<Conv3x3>,
}

impl Module for Rhag {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut u = x.clone();
        for b in &self.blocks {
            u = b.forward(&u)?;
        }
        let u = self.ocab.forward(&u)?;
        match &self.conv {
            Some(conv) => conv.forward(&u)? + x,
            None => u + x,
        }
    }
}

/// HAT: the Swin frame around its residual hybrid attention groups.
pub(crate) type Hat = SwinNet<Rhag>;

impl Hat {
    /// The network stored under `vb`, built as `plan` says (its channels never padded).
    pub fn new(cfg: &HatConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let e = cfg.embed_dim;
        let f = cfg.num_feat;
        let windows = WindowCache::new(cfg.window, vb.dtype(), vb.device());
        let mut layers = Vec::with_capacity(cfg.depths.len());
        for (i, (&depth, &heads)) in cfg.depths.iter().zip(&cfg.heads).enumerate() {
            let vb = vb.pp(format!("layers.{i}"));
            let group = vb.pp("residual_group");
            let blocks = (0..depth)
                .map(|j| {
                    let vb = group.pp(format!("blocks.{j}"));
                    let shape = BlockShape {
                        dim: e,
                        heads,
                        mlp_hidden: cfg.mlp_hidden,
                        window: cfg.window,
                        shifted: j % 2 == 1,
                    };
                    Ok(Hab {
                        swin: SwinBlock::with_shape(shape, &windows, plan, vb.clone())?,
                        cab: Cab::new(cfg, plan, vb.pp("conv_block.cab"))?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            layers.push(Rhag {
                blocks,
                ocab: Ocab::new(cfg, heads, plan, group.pp("overlap_attn"))?,
                conv: if cfg.group_conv {
                    Some(Conv3x3::unpadded(e, e, plan, vb.pp("conv"))?)
                } else {
                    None
                },
            });
        }
        let e = Pad::OFF.one(e);
        let after_body = if cfg.group_conv {
            AfterBody::One(Conv3x3::new(&e, &e, plan, vb.pp("conv_after_body"))?)
        } else {
            AfterBody::Identity
        };
        let stages = cfg.upsample_stages();
        let tail = Tail::pixel_shuffle((&e, &Pad::OFF.one(f), f), stages, Pad::OFF, plan, &vb)?;
        let frame = Frame::new(
            (&e, cfg.patch_norm),
            (after_body, tail),
            (cfg.window, cfg.scale),
            plan,
            &vb,
        )?;
        Ok(SwinNet::assemble(frame, layers, windows, Pad::OFF))
    }
}

/// HAT's registry entry.
pub(crate) struct Arch;

/// Whether the keys have HAT's blocks: a convolution block beside each Swin block, or the
/// overlapping cross-attention closing each group.
pub(crate) fn has_hat_blocks(shapes: &Shapes) -> bool {
    shapes
        .keys()
        .any(|k| k.contains(".conv_block.") || k.contains(".overlap_attn."))
}

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "HAT"
    }

    fn loads(&self) -> &'static str {
        "HAT-S, HAT, HAT-L, Real_HAT_GAN"
    }

    fn detect(&self, shapes: &Shapes) -> bool {
        swin_family(shapes) && has_hat_blocks(shapes)
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match HatConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::Hat(Box::new(e))),
        }
    }
}

impl NetConfig for HatConfig {
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let e = self.embed_dim;
        let ws = self.window;
        let f = self.num_feat;
        let mut t: Vec<(String, Vec<usize>)> = Vec::new();
        fn conv(t: &mut Vec<(String, Vec<usize>)>, name: &str, cout: usize, cin: usize, k: usize) {
            t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
            t.push((format!("{name}.bias"), vec![cout]));
        }
        fn linear(t: &mut Vec<(String, Vec<usize>)>, name: &str, cout: usize, cin: usize) {
            t.push((format!("{name}.weight"), vec![cout, cin]));
            t.push((format!("{name}.bias"), vec![cout]));
        }
        fn norm(t: &mut Vec<(String, Vec<usize>)>, name: &str, e: usize) {
            t.push((format!("{name}.weight"), vec![e]));
            t.push((format!("{name}.bias"), vec![e]));
        }
        conv(&mut t, "conv_first", e, 3, 3);
        if self.patch_norm {
            norm(&mut t, "patch_embed.norm", e);
        }
        for (i, (&depth, &heads)) in self.depths.iter().zip(&self.heads).enumerate() {
            for j in 0..depth {
                let p = format!("layers.{i}.residual_group.blocks.{j}");
                norm(&mut t, &format!("{p}.norm1"), e);
                conv(
                    &mut t,
                    &format!("{p}.conv_block.cab.0"),
                    self.cab_width,
                    e,
                    3,
                );
                conv(
                    &mut t,
                    &format!("{p}.conv_block.cab.2"),
                    e,
                    self.cab_width,
                    3,
                );
                let ca = format!("{p}.conv_block.cab.3.attention");
                conv(&mut t, &format!("{ca}.1"), self.squeeze_width, e, 1);
                conv(&mut t, &format!("{ca}.3"), e, self.squeeze_width, 1);
                t.push((
                    format!("{p}.attn.relative_position_bias_table"),
                    vec![(2 * ws - 1) * (2 * ws - 1), heads],
                ));
                linear(&mut t, &format!("{p}.attn.qkv"), 3 * e, e);
                linear(&mut t, &format!("{p}.attn.proj"), e, e);
                norm(&mut t, &format!("{p}.norm2"), e);
                linear(&mut t, &format!("{p}.mlp.fc1"), self.mlp_hidden, e);
                linear(&mut t, &format!("{p}.mlp.fc2"), e, self.mlp_hidden);
            }
            let p = format!("layers.{i}.residual_group.overlap_attn");
            norm(&mut t, &format!("{p}.norm1"), e);
            linear(&mut t, &format!("{p}.qkv"), 3 * e, e);
            t.push((
                format!("{p}.relative_position_bias_table"),
                vec![self.ocab_table_rows(), heads],
            ));
            linear(&mut t, &format!("{p}.proj"), e, e);
            norm(&mut t, &format!("{p}.norm2"), e);
            linear(&mut t, &format!("{p}.mlp.fc1"), self.ocab_mlp_hidden, e);
            linear(&mut t, &format!("{p}.mlp.fc2"), e, self.ocab_mlp_hidden);
            if self.group_conv {
                conv(&mut t, &format!("layers.{i}.conv"), e, e, 3);
            }
        }
        norm(&mut t, "norm", e);
        if self.group_conv {
            conv(&mut t, "conv_after_body", e, e, 3);
        }
        conv(&mut t, "conv_before_upsample.0", f, e, 3);
        for (i, r) in self.upsample_stages().iter().enumerate() {
            conv(&mut t, &format!("upsample.{}", 2 * i), r * r * f, f, 3);
        }
        conv(&mut t, "conv_last", 3, f, 3);
        t
    }

    fn flops(&self, h: usize, w: usize) -> f64 {
        let l = (h * w) as f64;
        let e = self.embed_dim as f64;
        let n = (self.window * self.window) as f64;
        let on = (self.overlap_window * self.overlap_window) as f64;
        let cw = self.cab_width as f64;
        let hid = self.mlp_hidden as f64;
        let ohid = self.ocab_mlp_hidden as f64;
        let f = self.num_feat as f64;
        let blocks: f64 = self.depths.iter().sum::<usize>() as f64;
        let groups = self.depths.len() as f64;
        let hab = 2.0 * (4.0 * e * e + 2.0 * e * hid) + 4.0 * n * e + 2.0 * 2.0 * 9.0 * e * cw;
        let ocab = 2.0 * (4.0 * e * e + 2.0 * e * ohid) + 4.0 * on * e;
        let conv = 2.0 * 9.0 * e * e;
        let mut total = l
            * (2.0 * 27.0 * e
                + blocks * hab
                + groups * (ocab + if self.group_conv { conv } else { 0.0 })
                + if self.group_conv { conv } else { 0.0 }
                + 2.0 * 9.0 * e * f);
        let mut pixels = l;
        for r in self.upsample_stages() {
            let r = r as f64;
            total += 2.0 * pixels * 9.0 * f * r * r * f;
            pixels *= r * r;
        }
        total + 2.0 * pixels * 9.0 * f * 3.0
    }

    fn family(&self) -> &'static str {
        "HAT"
    }

    fn variant(&self) -> &'static str {
        HatConfig::variant(self)
    }

    fn describe(&self) -> serde_json::Value {
        let c = self;
        let head_dims: Vec<usize> = (0..c.heads.len()).map(|i| c.head_dim(i)).collect();
        json!({
            "scale": c.scale,
            "groups": c.depths.len(),
            "depths": uniform(&c.depths),
            "embed_dim": c.embed_dim,
            "window": c.window,
            "overlap_window": c.overlap_window,
            "overlap_ratio": c.overlap_ratio(),
            "compress_ratio": c.compress_ratio(),
            "squeeze_factor": c.squeeze_factor(),
            "conv_scale": CONV_SCALE,
            "heads": uniform(&c.heads),
            "head_dims": uniform(&head_dims),
            "mlp_hidden": c.mlp_hidden,
            "num_feat": c.num_feat,
            "patch_norm": c.patch_norm,
        })
    }

    fn activations_per_pixel(&self, scores_in_memory: bool, pad: Pad) -> f64 {
        let heads = self.heads.iter().copied().max().unwrap_or(1);
        SwinCost {
            window: self.window,
            block: self.embed_dim,
            heads,
            unfused_scores: heads * self.overlap_window * self.overlap_window,
            mlp_hidden: self.mlp_hidden.max(self.ocab_mlp_hidden),
            upsampler: self.num_feat,
            scale: self.scale,
        }
        .activations_per_pixel(scores_in_memory, pad)
    }

    fn scale(&self) -> usize {
        self.scale
    }

    fn window(&self) -> usize {
        self.window
    }

    fn widest_head_dim(&self) -> usize {
        (0..self.heads.len())
            .map(|i| self.head_dim(i))
            .max()
            .unwrap_or(0)
    }

    fn largest_tensor_per_pixel(&self, scores_in_memory: bool, _: Pad) -> usize {
        HatConfig::largest_tensor_per_pixel(self, scores_in_memory)
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(Hat::new(self, plan, vb)?))
    }
}
