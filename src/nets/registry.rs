//! Which network a state dict holds, told from its key names, and the configuration of each
//! supported one.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::nets::drct::config::{ConfigError, DrctConfig, BLOCKS_PER_GROUP};
use crate::nets::hat::HatConfig;
use crate::nets::swinir::SwinIrConfig;
use crate::ops::pad::Pad;

/// The architectures this build runs, for messages.
pub const SUPPORTED: &str =
    "DRCT, SwinIR (classical, lightweight and real-world x2/x3/x4) and HAT (HAT-S, HAT, HAT-L, Real_HAT_GAN)";

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ArchConfig {
    Drct(DrctConfig),
    SwinIr(SwinIrConfig),
    Hat(HatConfig),
}

impl ArchConfig {
    /// Tell the architecture from the key names, infer its config and check every tensor.
    pub fn infer(shapes: &BTreeMap<String, Vec<usize>>) -> Result<Self, ConfigError> {
        let any = |f: &dyn Fn(&str) -> bool| shapes.keys().any(|k| f(k));
        let swin_family =
            any(&|k| k.starts_with("layers.") && k.contains(".residual_group.blocks."));
        if swin_family && any(&|k| k.contains(".conv_block.") || k.contains(".overlap_attn.")) {
            return HatConfig::infer(shapes)
                .map(Self::Hat)
                .map_err(|e| ConfigError::Hat(Box::new(e)));
        }
        if swin_family && any(&|k| k.ends_with(".logit_scale") || k.contains(".cpb_mlp.")) {
            return Err(unsupported(
                "a Swin2SR checkpoint (SwinV2 blocks: logit_scale, cpb_mlp)",
            ));
        }
        if swin_family {
            return SwinIrConfig::infer(shapes)
                .map(Self::SwinIr)
                .map_err(|e| ConfigError::SwinIr(Box::new(e)));
        }
        let drct_like = any(&|k| {
            k.strip_prefix("layers.")
                .and_then(|r| r.split('.').nth(1))
                .is_some_and(|p| p.starts_with("swin") || p.starts_with("adjust"))
        });
        if !drct_like {
            if let Some(found) = other_architecture(shapes) {
                return Err(unsupported(found));
            }
            if !shapes.contains_key("conv_first.weight") {
                let sample: Vec<&str> = shapes.keys().take(3).map(String::as_str).collect();
                return Err(unsupported(format!(
                    "an unrecognised architecture (keys {})",
                    sample.join(", ")
                )));
            }
        }
        DrctConfig::infer(shapes).map(Self::Drct)
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Drct(c) if c.groups >= 12 => "DRCT-L",
            Self::Drct(_) => "DRCT",
            Self::SwinIr(c) => c.variant(),
            Self::Hat(c) => c.variant(),
        }
    }

    pub fn window(&self) -> usize {
        match self {
            Self::Drct(c) => c.window,
            Self::SwinIr(c) => c.window,
            Self::Hat(c) => c.window,
        }
    }

    pub fn scale(&self) -> usize {
        match self {
            Self::Drct(c) => c.scale,
            Self::SwinIr(c) => c.scale,
            Self::Hat(c) => c.scale,
        }
    }

    pub fn parameter_count(&self) -> usize {
        match self {
            Self::Drct(c) => c.parameter_count(),
            Self::SwinIr(c) => c.parameter_count(),
            Self::Hat(c) => c.parameter_count(),
        }
    }

    pub fn flops(&self, h: usize, w: usize) -> f64 {
        match self {
            Self::Drct(c) => c.flops(h, w),
            Self::SwinIr(c) => c.flops(h, w),
            Self::Hat(c) => c.flops(h, w),
        }
    }

    pub fn largest_tensor_per_pixel(&self, scores_in_memory: bool, pad: Pad) -> usize {
        match self {
            Self::Drct(c) => c.largest_tensor_per_pixel(scores_in_memory, pad),
            Self::SwinIr(c) => c.largest_tensor_per_pixel(scores_in_memory),
            Self::Hat(c) => c.largest_tensor_per_pixel(scores_in_memory),
        }
    }

    /// The widest attention head of any block.
    pub fn widest_head_dim(&self) -> usize {
        match self {
            Self::Drct(c) => (0..c.groups)
                .flat_map(|g| (0..BLOCKS_PER_GROUP).map(move |k| (g, k)))
                .map(|(g, k)| c.head_dim(g, k))
                .max()
                .unwrap_or(0),
            Self::SwinIr(c) => (0..c.heads.len()).map(|i| c.head_dim(i)).max().unwrap_or(0),
            Self::Hat(c) => (0..c.heads.len()).map(|i| c.head_dim(i)).max().unwrap_or(0),
        }
    }

    /// The most heads of any block.
    pub fn max_heads(&self) -> usize {
        match self {
            Self::Drct(c) => c.heads.iter().flatten().copied().max().unwrap_or(1),
            Self::SwinIr(c) => c.heads.iter().copied().max().unwrap_or(1),
            Self::Hat(c) => c.heads.iter().copied().max().unwrap_or(1),
        }
    }

    /// Attention scores per token that no fused kernel keeps out of memory: HAT's
    /// overlapping cross-attention (heads x overlap window²), run as plain products.
    pub fn unfused_scores_per_token(&self) -> usize {
        match self {
            Self::Hat(c) => {
                c.heads.iter().copied().max().unwrap_or(1) * c.overlap_window * c.overlap_window
            }
            _ => 0,
        }
    }

    /// The widest input of any Swin block.
    pub fn widest_block(&self) -> usize {
        match self {
            Self::Drct(c) => c.block_dim(BLOCKS_PER_GROUP - 1),
            Self::SwinIr(c) => c.embed_dim,
            Self::Hat(c) => c.embed_dim,
        }
    }

    /// The widest MLP hidden layer.
    pub fn max_mlp_hidden(&self) -> usize {
        match self {
            Self::Drct(c) => c.mlp_hidden.iter().copied().max().unwrap_or(0),
            Self::SwinIr(c) => c.mlp_hidden,
            Self::Hat(c) => c.mlp_hidden.max(c.ocab_mlp_hidden),
        }
    }

    /// Channels of the upsampler's feature maps (at least the 3 of the output).
    pub fn upsampler_channels(&self) -> usize {
        match self {
            Self::Drct(c) => c.num_feat,
            Self::SwinIr(c) => c.num_feat.max(3),
            Self::Hat(c) => c.num_feat,
        }
    }
}

fn unsupported(found: impl Into<String>) -> ConfigError {
    ConfigError::OtherArchitecture {
        found: found.into(),
        supported: SUPPORTED,
    }
}

/// Other well-known super-resolution networks, named from their keys.
fn other_architecture(shapes: &BTreeMap<String, Vec<usize>>) -> Option<&'static str> {
    let has = |k: &str| shapes.contains_key(k);
    let prefix = |p: &str| shapes.keys().any(|k| k.starts_with(p));
    if prefix("body.0.rdb1.") || prefix("RRDB_trunk.") || prefix("model.1.sub.0.RDB1.") {
        Some("an ESRGAN / Real-ESRGAN (RRDBNet) checkpoint")
    } else if has("body.0.weight") && !has("conv_first.weight") {
        Some("a Real-ESRGAN compact (SRVGGNetCompact) checkpoint")
    } else {
        None
    }
}
