//! DRCT hyper-parameters, inferred from the shapes of a state dict and validated.
//!
//! Nothing here is read from a side file: released checkpoints carry no config, so every
//! number comes from a tensor shape, and every shape the network will use is checked before
//! a single layer is built. That way a wrong or foreign file fails here, with the tensor's
//! name, instead of deep inside a matmul.

use std::collections::BTreeMap;

use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use super::Drct;
use crate::nets::infer::ConfigError;
use crate::nets::swin::SwinCost;
use crate::nets::{Net, NetConfig};
use crate::ops::LoadPlan;

use crate::ops::pad::Pad;

/// Blocks per residual dense group: the official RDG hard-codes five, whatever `depths` says.
pub const BLOCKS_PER_GROUP: usize = 5;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DrctConfig {
    pub embed_dim: usize,
    pub groups: usize,
    pub window: usize,
    /// Heads of swin1..swin5 for each group (the official code takes one head count per
    /// group and derives the wider blocks' counts from it).
    pub heads: Vec<[usize; BLOCKS_PER_GROUP]>,
    pub growth: usize,
    /// Hidden width of each block's MLP (blocks 4 and 5 use ratio 1 in the official code).
    pub mlp_hidden: [usize; BLOCKS_PER_GROUP],
    pub num_feat: usize,
    pub scale: usize,
    pub patch_norm: bool,
    /// `conv_after_body` present ("1conv"); absent means the identity residual.
    pub conv_after_body: bool,
}

impl DrctConfig {
    /// Channel width of block `k` (0-based) inside a group.
    pub fn block_dim(&self, k: usize) -> usize {
        self.embed_dim + k * self.growth
    }

    pub fn head_dim(&self, g: usize, k: usize) -> usize {
        self.block_dim(k) / self.heads[g][k]
    }

    /// Pixel-shuffle factor of each upsampler stage: x3 is one stage of 3, powers of two are
    /// stages of 2.
    pub fn upsample_stages(&self) -> Vec<usize> {
        if self.scale == 3 {
            vec![3]
        } else {
            vec![2; self.scale.trailing_zeros() as usize]
        }
    }

    /// The most values any one intermediate tensor of a forward pass holds per padded input
    /// pixel: the attention scores (heads x window², unless a fused kernel keeps them out of
    /// memory), qkv, the MLP's hidden layer, the widest dense concatenation or the upsampler's
    /// last map, each at its width padded as `pad` says (`UPSCALE_PAD_CHANNELS`; qkv pads
    /// every head). Convolution patch matrices are chunked to a fixed size and do not grow
    /// with the input.
    pub fn largest_tensor_per_pixel(&self, scores_in_memory: bool, pad: Pad) -> usize {
        let n = self.window * self.window;
        let heads = self.heads.iter().flatten().copied().max().unwrap_or(1);
        let scores = if scores_in_memory { heads * n } else { 0 };
        let qkv = (0..self.groups)
            .flat_map(|g| (0..BLOCKS_PER_GROUP).map(move |k| (g, k)))
            .map(|(g, k)| 3 * self.heads[g][k] * pad.width(self.head_dim(g, k)))
            .max()
            .unwrap_or(0);
        let widest = pad.width(self.embed_dim) + (BLOCKS_PER_GROUP - 1) * pad.width(self.growth);
        let hidden = pad.width(self.mlp_hidden.iter().copied().max().unwrap_or(0));
        let upsampler = pad.width(self.num_feat).max(3) * self.scale * self.scale;
        [scores, qkv, widest, hidden, upsampler]
            .into_iter()
            .max()
            .unwrap_or(1)
    }

    /// Infer the config from tensor names and shapes, then check every tensor against it.
    pub fn infer(shapes: &BTreeMap<String, Vec<usize>>) -> Result<Self, ConfigError> {
        let t = Shapes(shapes);
        let cf = t.get("conv_first.weight")?;
        if cf.len() != 4 || cf[0] == 0 || cf[1] != 3 || cf[2] != 3 || cf[3] != 3 {
            return Err(ConfigError::shape(
                "conv_first.weight",
                cf,
                "; a DRCT RGB model has [E, 3, 3, 3]",
            ));
        }
        let embed_dim = cf[0];
        if shapes.contains_key("absolute_pos_embed") {
            return Err(ConfigError::Unsupported(
                "absolute position embedding (ape=True)",
            ));
        }
        if shapes.keys().any(|k| k.starts_with("conv_after_body.0.")) {
            return Err(ConfigError::Unsupported("the '3conv' residual connection"));
        }
        let groups = t.groups()?;
        let window = t.window()?;
        let growth = t.width("layers.0.adjust1.weight")?;
        let heads = t.heads(groups, embed_dim, growth)?;
        let mut mlp_hidden = [0; BLOCKS_PER_GROUP];
        for (k, hidden) in mlp_hidden.iter_mut().enumerate() {
            *hidden = t.width(&format!("layers.0.swin{}.mlp.fc1.weight", k + 1))?;
        }
        let num_feat = t.width("conv_before_upsample.0.weight")?;
        let scale = t.upsampler_scale(num_feat)?;

        let cfg = DrctConfig {
            embed_dim,
            groups,
            window,
            heads,
            growth,
            mlp_hidden,
            num_feat,
            scale,
            patch_norm: shapes.contains_key("patch_embed.norm.weight"),
            conv_after_body: shapes.contains_key("conv_after_body.weight"),
        };
        cfg.check_shapes(shapes)?;
        Ok(cfg)
    }

    /// Every expected tensor present with its exact shape, and nothing unexplained left over.
    fn check_shapes(&self, shapes: &BTreeMap<String, Vec<usize>>) -> Result<(), ConfigError> {
        let expected = self.expected_tensors();
        for (name, shape) in &expected {
            match shapes.get(name) {
                None => return Err(ConfigError::missing(name, "")),
                Some(found) if found != shape => {
                    return Err(ConfigError::shape(
                        name,
                        found,
                        format!(" but the inferred config needs {shape:?}"),
                    ))
                }
                Some(_) => {}
            }
        }
        if expected.len() != shapes.len() {
            let known: std::collections::HashSet<&str> =
                expected.iter().map(|(n, _)| n.as_str()).collect();
            if let Some(extra) = shapes.keys().find(|k| !known.contains(k.as_str())) {
                return Err(ConfigError::Unexpected {
                    name: extra.clone(),
                    hint: " (an unsupported DRCT variant or another architecture)",
                });
            }
        }
        Ok(())
    }
}

impl NetConfig for DrctConfig {
    /// Every tensor the network needs, with its shape. The single source of truth for both
    /// validation and the parameter count.
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let e = self.embed_dim;
        let ws = self.window;
        let f = self.num_feat;
        let mut t: Vec<(String, Vec<usize>)> = Vec::new();
        let mut push = |name: String, shape: Vec<usize>| t.push((name, shape));
        push("conv_first.weight".into(), vec![e, 3, 3, 3]);
        push("conv_first.bias".into(), vec![e]);
        if self.patch_norm {
            push("patch_embed.norm.weight".into(), vec![e]);
            push("patch_embed.norm.bias".into(), vec![e]);
        }
        for g in 0..self.groups {
            for k in 0..BLOCKS_PER_GROUP {
                let d = self.block_dim(k);
                let h = self.mlp_hidden[k];
                let p = format!("layers.{g}.swin{}", k + 1);
                push(format!("{p}.norm1.weight"), vec![d]);
                push(format!("{p}.norm1.bias"), vec![d]);
                push(
                    format!("{p}.attn.relative_position_bias_table"),
                    vec![(2 * ws - 1) * (2 * ws - 1), self.heads[g][k]],
                );
                push(format!("{p}.attn.qkv.weight"), vec![3 * d, d]);
                push(format!("{p}.attn.qkv.bias"), vec![3 * d]);
                push(format!("{p}.attn.proj.weight"), vec![d, d]);
                push(format!("{p}.attn.proj.bias"), vec![d]);
                push(format!("{p}.norm2.weight"), vec![d]);
                push(format!("{p}.norm2.bias"), vec![d]);
                push(format!("{p}.mlp.fc1.weight"), vec![h, d]);
                push(format!("{p}.mlp.fc1.bias"), vec![h]);
                push(format!("{p}.mlp.fc2.weight"), vec![d, h]);
                push(format!("{p}.mlp.fc2.bias"), vec![d]);
                let out = if k + 1 == BLOCKS_PER_GROUP {
                    e
                } else {
                    self.growth
                };
                let a = format!("layers.{g}.adjust{}", k + 1);
                push(format!("{a}.weight"), vec![out, d, 1, 1]);
                push(format!("{a}.bias"), vec![out]);
            }
        }
        push("norm.weight".into(), vec![e]);
        push("norm.bias".into(), vec![e]);
        if self.conv_after_body {
            push("conv_after_body.weight".into(), vec![e, e, 3, 3]);
            push("conv_after_body.bias".into(), vec![e]);
        }
        push("conv_before_upsample.0.weight".into(), vec![f, e, 3, 3]);
        push("conv_before_upsample.0.bias".into(), vec![f]);
        for (i, r) in self.upsample_stages().iter().enumerate() {
            push(
                format!("upsample.{}.weight", 2 * i),
                vec![r * r * f, f, 3, 3],
            );
            push(format!("upsample.{}.bias", 2 * i), vec![r * r * f]);
        }
        push("conv_last.weight".into(), vec![3, f, 3, 3]);
        push("conv_last.bias".into(), vec![3]);
        t
    }

    /// Multiply-adds x2 of one forward pass over a padded `h x w` input: the convolutions,
    /// every linear layer and both attention matmuls. Element-wise work is left out, as FLOP
    /// counts conventionally do.
    fn flops(&self, h: usize, w: usize) -> f64 {
        let l = (h * w) as f64;
        let e = self.embed_dim as f64;
        let f = self.num_feat as f64;
        let n = (self.window * self.window) as f64;
        let mut total = 2.0 * l * 27.0 * e; // conv_first
        for _ in 0..self.groups {
            for k in 0..BLOCKS_PER_GROUP {
                let d = self.block_dim(k) as f64;
                let hid = self.mlp_hidden[k] as f64;
                let out = if k + 1 == BLOCKS_PER_GROUP {
                    e
                } else {
                    self.growth as f64
                };
                total += 2.0 * l * (3.0 * d * d + d * d + 2.0 * d * hid + d * out);
                total += 2.0 * 2.0 * l * n * d; // q.k^T and attn.v
            }
        }
        if self.conv_after_body {
            total += 2.0 * l * 9.0 * e * e;
        }
        total += 2.0 * l * 9.0 * e * f; // conv_before_upsample
        let mut pixels = l;
        for r in self.upsample_stages() {
            let r = r as f64;
            total += 2.0 * pixels * 9.0 * f * r * r * f;
            pixels *= r * r;
        }
        total + 2.0 * pixels * 9.0 * f * 3.0 // conv_last
    }

    fn family(&self) -> &'static str {
        "DRCT"
    }

    fn variant(&self) -> &'static str {
        if self.groups >= 12 {
            "DRCT-L"
        } else {
            "DRCT"
        }
    }

    fn scale(&self) -> usize {
        self.scale
    }

    fn window(&self) -> usize {
        self.window
    }

    fn describe(&self) -> serde_json::Value {
        let c = self;
        let head_dims: Vec<Vec<usize>> = (0..c.groups)
            .map(|g| (0..c.heads[g].len()).map(|k| c.head_dim(g, k)).collect())
            .collect();
        // One row per group is noise for the released models, where all groups agree.
        let (heads, head_dims) = if c.heads.iter().all(|h| *h == c.heads[0]) {
            (json!(c.heads[0]), json!(head_dims[0]))
        } else {
            (json!(c.heads), json!(head_dims))
        };
        json!({
            "scale": c.scale,
            "groups": c.groups,
            "embed_dim": c.embed_dim,
            "window": c.window,
            "heads": heads,
            "head_dims": head_dims,
            "growth": c.growth,
            "mlp_hidden": c.mlp_hidden,
            "num_feat": c.num_feat,
            "patch_norm": c.patch_norm,
            "conv_after_body": c.conv_after_body,
        })
    }

    fn widest_head_dim(&self) -> usize {
        (0..self.groups)
            .flat_map(|g| (0..BLOCKS_PER_GROUP).map(move |k| (g, k)))
            .map(|(g, k)| self.head_dim(g, k))
            .max()
            .unwrap_or(0)
    }

    fn largest_tensor_per_pixel(&self, scores_in_memory: bool, pad: Pad) -> usize {
        DrctConfig::largest_tensor_per_pixel(self, scores_in_memory, pad)
    }

    fn activations_per_pixel(&self, scores_in_memory: bool, pad: Pad) -> f64 {
        SwinCost {
            window: self.window,
            // A block's input is padded part by part: the group's input, then each growth.
            block: pad.width(self.embed_dim) + (BLOCKS_PER_GROUP - 1) * pad.width(self.growth),
            heads: self.heads.iter().flatten().copied().max().unwrap_or(1),
            unfused_scores: 0,
            mlp_hidden: self.mlp_hidden.iter().copied().max().unwrap_or(0),
            upsampler: self.num_feat,
            scale: self.scale,
        }
        .activations_per_pixel(scores_in_memory, pad)
    }

    fn pads_channels(&self) -> bool {
        true
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> candle_core::Result<Box<dyn Net>> {
        Ok(Box::new(Drct::new(self, plan, vb)?))
    }
}

/// A state dict's shapes, read the way config inference needs them: every miss or odd
/// shape is an error naming the tensor.
struct Shapes<'a>(&'a BTreeMap<String, Vec<usize>>);

impl Shapes<'_> {
    fn get(&self, name: &str) -> Result<&Vec<usize>, ConfigError> {
        self.0
            .get(name)
            .ok_or_else(|| ConfigError::missing(name, " (not a DRCT checkpoint?)"))
    }

    /// The output width a layer's weight declares; a crafted file can hold a scalar or an
    /// empty tensor where a matrix belongs.
    fn width(&self, name: &str) -> Result<usize, ConfigError> {
        let shape = self.get(name)?;
        match shape.first() {
            Some(&n) if n > 0 && shape.len() >= 2 => Ok(n),
            _ => Err(ConfigError::shape(
                name,
                shape,
                "; expected a non-empty weight matrix",
            )),
        }
    }

    /// Residual groups: one past the highest `layers.N`.
    fn groups(&self) -> Result<usize, ConfigError> {
        let mut groups = 0;
        for key in self.0.keys() {
            if let Some(rest) = key.strip_prefix("layers.") {
                let idx = rest.split('.').next().unwrap_or("");
                let i: usize = idx.parse().map_err(|_| ConfigError::Unexpected {
                    name: key.clone(),
                    hint: "",
                })?;
                groups = groups.max(i + 1);
            }
        }
        if groups == 0 {
            return Err(ConfigError::NoGroups);
        }
        Ok(groups)
    }

    /// The window side, from the `(2w-1)^2` rows of the first bias table.
    fn window(&self) -> Result<usize, ConfigError> {
        let name = "layers.0.swin1.attn.relative_position_bias_table";
        let table = self.get(name)?;
        if table.len() != 2 {
            return Err(ConfigError::shape(name, table, "; expected 2 dims"));
        }
        let side = isqrt(table[0]);
        if side * side != table[0] || side.is_multiple_of(2) {
            return Err(ConfigError::WindowRows {
                name: name.to_string(),
                rows: table[0],
            });
        }
        Ok(side.div_ceil(2))
    }

    /// Heads of every block: the columns of its bias table, which must divide its width.
    fn heads(
        &self,
        groups: usize,
        embed_dim: usize,
        growth: usize,
    ) -> Result<Vec<[usize; BLOCKS_PER_GROUP]>, ConfigError> {
        let mut heads = vec![[0; BLOCKS_PER_GROUP]; groups];
        for (g, group_heads) in heads.iter_mut().enumerate() {
            for (k, h) in group_heads.iter_mut().enumerate() {
                let p = format!("layers.{g}.swin{}", k + 1);
                let table = format!("{p}.attn.relative_position_bias_table");
                let t = self.get(&table)?;
                *h = *t.get(1).ok_or_else(|| ConfigError::shape(&table, t, ""))?;
                let d = embed_dim + k * growth;
                if *h == 0 || !d.is_multiple_of(*h) {
                    return Err(ConfigError::Heads {
                        block: p,
                        width: d,
                        heads: *h,
                    });
                }
            }
        }
        Ok(heads)
    }

    /// The product of the pixel-shuffle stages (`upsample.0`, `upsample.2`, ...).
    fn upsampler_scale(&self, num_feat: usize) -> Result<usize, ConfigError> {
        let mut scale = 1;
        let mut stage = 0;
        while self
            .0
            .contains_key(&format!("upsample.{}.weight", 2 * stage))
        {
            let name = format!("upsample.{}.weight", 2 * stage);
            let w = self.get(&name)?;
            let r2 = self.width(&name)? / num_feat;
            let r = isqrt(r2);
            if r * r * num_feat != w[0] || !(r == 2 || r == 3) {
                return Err(ConfigError::shape(
                    &name,
                    w,
                    format!(": not a pixel-shuffle stage of 2 or 3 over {num_feat} channels"),
                ));
            }
            scale *= r;
            stage += 1;
        }
        if stage == 0 {
            return Err(ConfigError::missing(
                "upsample.0.weight",
                " (only the pixel-shuffle upsampler is supported)",
            ));
        }
        if !(scale == 3 || (scale.is_power_of_two() && scale >= 2)) || (scale % 3 == 0 && stage > 1)
        {
            return Err(ConfigError::Upsampler {
                scale,
                stages: stage,
            });
        }
        Ok(scale)
    }
}

fn isqrt(n: usize) -> usize {
    let mut r = (n as f64).sqrt() as usize;
    while r * r > n {
        r -= 1;
    }
    while (r + 1) * (r + 1) <= n {
        r += 1;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The released DRCT x4 shape: the parameter count in the paper's repository.
    fn drct_x4() -> DrctConfig {
        DrctConfig {
            embed_dim: 180,
            groups: 6,
            window: 16,
            heads: vec![[6, 4, 2, 6, 4]; 6],
            growth: 32,
            mlp_hidden: [360, 424, 488, 276, 308],
            num_feat: 64,
            scale: 4,
            patch_norm: true,
            conv_after_body: true,
        }
    }

    fn shapes_of(cfg: &DrctConfig) -> BTreeMap<String, Vec<usize>> {
        cfg.expected_tensors().into_iter().collect()
    }

    #[test]
    fn released_parameter_counts() {
        assert_eq!(drct_x4().parameter_count(), 14_139_579);
        let large = DrctConfig {
            groups: 12,
            heads: vec![[6, 4, 2, 6, 4]; 12],
            ..drct_x4()
        };
        assert_eq!(large.parameter_count(), 27_580_719);
    }

    #[test]
    fn flop_count_matches_the_published_figures() {
        // 148.7 GFLOP (DRCT) and 287.8 GFLOP (DRCT-L) at a 64x64 input, x4.
        let g = drct_x4().flops(64, 64) / 1e9;
        assert!((g - 148.7).abs() < 0.5, "{g}");
        let large = DrctConfig {
            groups: 12,
            heads: vec![[6, 4, 2, 6, 4]; 12],
            ..drct_x4()
        };
        let g = large.flops(64, 64) / 1e9;
        assert!((g - 287.8).abs() < 1.0, "{g}");
    }

    #[test]
    fn largest_tensor_is_the_scores_unless_fused() {
        // 6 heads x 16² tokens; without the scores, the x4 upsampler's 64 x 4² channels.
        let off = Pad::OFF;
        assert_eq!(drct_x4().largest_tensor_per_pixel(true, off), 1536);
        assert_eq!(drct_x4().largest_tensor_per_pixel(false, off), 1024);
        let wide = DrctConfig {
            mlp_hidden: [2000, 424, 488, 276, 308],
            ..drct_x4()
        };
        assert_eq!(wide.largest_tensor_per_pixel(false, off), 2000);
        // Padded heads widen qkv: to 64, swin5's 4 heads of 77 take 128 each, 3 x 4 x 128.
        let pad = |m| Pad::to(m).unwrap();
        assert_eq!(drct_x4().largest_tensor_per_pixel(false, pad(64)), 1536);
        assert_eq!(drct_x4().largest_tensor_per_pixel(false, pad(8)), 1024);
    }

    /// Every tensor, in turn, replaced by a scalar, an empty vector or a zero-width matrix:
    /// always an error naming a tensor, never a panic.
    #[test]
    fn degenerate_shapes_are_errors() {
        let cfg = DrctConfig {
            groups: 2,
            heads: vec![[6, 4, 2, 6, 4]; 2],
            ..drct_x4()
        };
        let good = shapes_of(&cfg);
        for name in good.keys() {
            for bad in [vec![], vec![0], vec![0, 4], vec![1]] {
                let mut s = good.clone();
                s.insert(name.clone(), bad.clone());
                let e = std::panic::catch_unwind(|| DrctConfig::infer(&s))
                    .unwrap_or_else(|_| panic!("{name} as {bad:?} panicked"));
                assert!(e.is_err(), "{name} as {bad:?} was accepted");
            }
        }
    }

    #[test]
    fn infer_round_trips_every_variant() {
        for scale in [2, 3, 4, 8] {
            for (patch_norm, conv_after_body) in [(true, true), (false, false)] {
                let cfg = DrctConfig {
                    scale,
                    patch_norm,
                    conv_after_body,
                    ..drct_x4()
                };
                assert_eq!(DrctConfig::infer(&shapes_of(&cfg)).unwrap(), cfg);
            }
        }
    }

    #[test]
    fn rejects_missing_wrong_and_extra_tensors() {
        let cfg = drct_x4();
        let mut s = shapes_of(&cfg);
        s.remove("layers.3.swin2.mlp.fc2.bias");
        let e = DrctConfig::infer(&s).unwrap_err();
        assert!(e.to_string().contains("layers.3.swin2.mlp.fc2.bias"), "{e}");

        let mut s = shapes_of(&cfg);
        s.insert("layers.1.swin4.norm2.weight".into(), vec![275]);
        let e = DrctConfig::infer(&s).unwrap_err();
        assert!(e.to_string().contains("layers.1.swin4.norm2.weight"), "{e}");

        let mut s = shapes_of(&cfg);
        s.insert("layers.0.swin1.attn.extra".into(), vec![1]);
        let e = DrctConfig::infer(&s).unwrap_err();
        assert!(e.to_string().contains("layers.0.swin1.attn.extra"), "{e}");

        let mut s = shapes_of(&cfg);
        s.insert("upsample.0.weight".into(), vec![5 * 64, 64, 3, 3]);
        assert!(DrctConfig::infer(&s)
            .unwrap_err()
            .to_string()
            .contains("upsample.0.weight"));
    }

    #[test]
    fn foreign_state_dict_is_not_drct() {
        let mut s = BTreeMap::new();
        s.insert("conv_first.weight".to_string(), vec![64, 3, 3, 3]);
        s.insert(
            "layers.0.residual_group.blocks.0.norm1.weight".to_string(),
            vec![64],
        );
        assert!(DrctConfig::infer(&s).is_err());
        assert!(DrctConfig::infer(&BTreeMap::new())
            .unwrap_err()
            .to_string()
            .contains("conv_first.weight"));
    }
}
