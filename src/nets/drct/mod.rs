//! The DRCT network (Dense-Residual-Connected Transformer), inference only.
//!
//! One struct per layer of the official model, each built from a VarBuilder whose path is the
//! state-dict key; the layers it shares with SwinIR and HAT are in [`crate::nets::swin`]. Features
//! between layers are kept channels-last, `(B, H, W, C)`, so the dense concatenations are
//! plain copies along the last axis.

pub mod config;

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::nets::drct::config::{DrctConfig, BLOCKS_PER_GROUP};
use crate::nets::frame::{AfterBody, Frame, SwinNet, Tail};
use crate::nets::registry::{swin_family, Architecture, Shapes};
use crate::nets::swin::{BlockShape, SwinBlock};
use crate::nets::{ArchConfig, ConfigError};
use crate::ops::conv::Conv3x3;
use crate::ops::linear::{pointwise_padded, Dense};
use crate::ops::pad::{Channels, Pad};
use crate::ops::windows::WindowCache;
use crate::ops::LoadPlan;

/// DRCT's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "DRCT"
    }

    fn loads(&self) -> &'static str {
        ""
    }

    /// Residual dense groups of `swinK` blocks and `adjustK` convolutions.
    fn detect(&self, shapes: &Shapes) -> bool {
        !swin_family(shapes)
            && shapes.keys().any(|k| {
                k.strip_prefix("layers.")
                    .and_then(|r| r.split('.').nth(1))
                    .is_some_and(|p| p.starts_with("swin") || p.starts_with("adjust"))
            })
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        Ok(std::sync::Arc::new(DrctConfig::infer(shapes)?))
    }
}

/// Slope of the LeakyReLU inside residual dense groups.
const RDG_SLOPE: f64 = 0.2;
/// Residual scaling of a group's output.
const RDG_RESIDUAL: f64 = 0.2;

/// The channels of the input of block `k` of a group: the group's input, then each earlier
/// block's adjusted output, every part padded on its own so that the dense concatenation
/// places it at its padded offset.
fn block_channels(cfg: &DrctConfig, pad: Pad, k: usize) -> Channels {
    pad.one(cfg.embed_dim).then(&pad.parts(k, cfg.growth))
}

/// Block `k` of group `g`: swin2 and swin4 (odd positions) use shifted windows.
fn drct_block(
    cfg: &DrctConfig,
    (g, k): (usize, usize),
    windows: &WindowCache,
    plan: &LoadPlan,
    vb: VarBuilder,
) -> Result<SwinBlock> {
    let shape = BlockShape {
        dim: cfg.block_dim(k),
        heads: cfg.heads[g][k],
        mlp_hidden: cfg.mlp_hidden[k],
        window: cfg.window,
        shifted: k % 2 == 1,
    };
    let channels = block_channels(cfg, plan.pad, k);
    SwinBlock::padded(shape, &channels, windows, plan, vb)
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
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        let pad = plan.pad;
        let mut blocks = Vec::with_capacity(BLOCKS_PER_GROUP);
        let mut adjust = Vec::with_capacity(BLOCKS_PER_GROUP);
        for k in 0..BLOCKS_PER_GROUP {
            let swin = vb.pp(format!("swin{}", k + 1));
            blocks.push(drct_block(cfg, (g, k), windows, plan, swin)?);
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
                plan,
                vb,
            )?);
        }
        Ok(Self { blocks, adjust })
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
            dense = adjust.forward_cat_leaky(&out, &dense, RDG_SLOPE)?;
        }
        unreachable!("a group always has {BLOCKS_PER_GROUP} blocks")
    }
}

/// DRCT: the Swin frame around its residual dense groups.
pub(crate) type Drct = SwinNet<Rdg>;

impl Drct {
    /// The network stored under `vb`, built as `plan` says: window attention on CUDA
    /// devices, channels padded ([`crate::ops::pad`]), bf16 products on the CPU.
    pub fn new(cfg: &DrctConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let pad = plan.pad;
        let e = pad.one(cfg.embed_dim);
        let f = pad.one(cfg.num_feat);
        let windows = WindowCache::new(cfg.window, vb.dtype(), vb.device());
        let layers = (0..cfg.groups)
            .map(|g| {
                let vb = vb.pp(format!("layers.{g}"));
                Rdg::new(cfg, g, &windows, plan, vb)
            })
            .collect::<Result<Vec<_>>>()?;
        let after_body = if cfg.conv_after_body {
            AfterBody::One(Conv3x3::new(&e, &e, plan, vb.pp("conv_after_body"))?)
        } else {
            AfterBody::Identity
        };
        let stages = cfg.upsample_stages();
        let tail = Tail::pixel_shuffle((&e, &f, cfg.num_feat), stages, pad, plan, &vb)?;
        let frame = Frame::new(
            (&e, cfg.patch_norm),
            (after_body, tail),
            (cfg.window, cfg.scale),
            plan,
            &vb,
        )?;
        Ok(SwinNet::assemble(frame, layers, windows, pad))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::nets::swin::{reflect_indices, reflect_pad_bottom_right};
    use crate::nets::Net;
    use crate::ops::norm::layer_norm;
    use crate::tests::fixtures::{cases, load_io, max_abs_diff};
    use candle_core::{DType, Device, D};

    /// A golden fixture's network in f32 on the CPU, its channels padded as `pad` says, and
    /// its configuration.
    fn fixture(name: &str, pad: Pad) -> (Drct, DrctConfig) {
        let case = cases().into_iter().find(|c| c.name == name).expect(name);
        let ck = Checkpoint::load(&case.weights).unwrap();
        let cfg = ck.config.as_any().downcast_ref::<DrctConfig>();
        let cfg = cfg.expect("a DRCT fixture").clone();
        let plan = LoadPlan {
            pad,
            ..LoadPlan::default()
        };
        let vb = ck.tensors.var_builder(DType::F32, &Device::Cpu);
        (Drct::new(&cfg, &plan, vb).unwrap(), cfg)
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
            let (k, n) = d.gemm_dims().unwrap();
            out.push((name, k, n));
        };
        for (g, layer) in net.groups.iter().enumerate() {
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
            let (net, cfg) = fixture(&case.name, pad);
            assert_eq!(net.padding(), pad);
            for (name, k, n) in body_gemms(&net) {
                assert!(k % m == 0 && n % m == 0, "pad {m}: {name} is {k} x {n}");
            }
            let (e, f) = (pad.one(cfg.embed_dim), pad.one(cfg.num_feat));
            let zero = |t: &Tensor, ch: &Channels, what: &str| {
                let v = padding_max(t, ch);
                assert!(v == 0.0, "pad {m}, {what}: {v} on a padded channel");
            };
            let x = reflect_pad_bottom_right(&input, cfg.window).unwrap();
            let x = x
                .permute((0, 2, 3, 1))
                .unwrap()
                .broadcast_sub(&net.frame.mean)
                .unwrap();
            let f0 = net.frame.conv_first.forward(&x).unwrap();
            zero(&f0, &e, "conv_first");
            let mut t = match &net.frame.patch_norm {
                Some(norm) => layer_norm(norm, &f0).unwrap(),
                None => f0.clone(),
            };
            zero(&t, &e, "patch norm");
            for (g, layer) in net.groups.iter().enumerate() {
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
                        dense = adjust.forward_cat_leaky(&out, &dense, RDG_SLOPE).unwrap();
                    } else {
                        t = adjust.forward_residual(&out, &t).unwrap();
                        zero(&t, &e, &format!("group {g} output"));
                    }
                }
            }
            let mut body = layer_norm(&net.frame.norm, &t).unwrap();
            zero(&body, &e, "norm");
            if let AfterBody::One(conv) = &net.frame.after_body {
                body = conv.forward(&body).unwrap();
                zero(&body, &e, "conv_after_body");
            }
            let Tail::PixelShuffle {
                before,
                stages,
                last,
            } = &net.frame.tail
            else {
                panic!("DRCT's tail is a pixel shuffle")
            };
            let mut y = before.forward(&(body + f0).unwrap()).unwrap();
            zero(&y, &f, "conv_before_upsample");
            for (conv, r) in stages {
                y = conv.forward_shuffled(&y, *r).unwrap();
                zero(&y, &f, "upsample");
            }
            assert_eq!(last.forward(&y).unwrap().dim(3).unwrap(), 3);
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
        let (plain, cfg) = fixture(name, Pad::OFF);
        let ws = cfg.window;
        let (h, w) = (2 * ws, 2 * ws);
        for m in [8, 16, 64] {
            let pad = Pad::to(m).unwrap();
            let (net, _) = fixture(name, pad);
            for (g, (a, b)) in plain.groups.iter().zip(&net.groups).enumerate() {
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
