//! `upscale info`: what a checkpoint is, from its weights alone.

use serde_json::json;

use crate::model::{ArchConfig, Checkpoint, DrctConfig, HatConfig, SwinIrConfig};

pub fn describe(ck: &Checkpoint) -> serde_json::Value {
    match &ck.config {
        ArchConfig::Drct(c) => describe_drct(ck, c),
        ArchConfig::SwinIr(c) => describe_swinir(ck, c),
        ArchConfig::Hat(c) => describe_hat(ck, c),
    }
}

fn describe_drct(ck: &Checkpoint, c: &DrctConfig) -> serde_json::Value {
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
        "model": ck.source.to_string(),
        "name": ck.metadata.get("upscale.name"),
        "architecture": ck.config.name(),
        "scale": c.scale,
        "parameters": ck.config.parameter_count(),
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
        "state_dict_key": ck.wrapper,
    })
}

fn describe_swinir(ck: &Checkpoint, c: &SwinIrConfig) -> serde_json::Value {
    let uniform = |v: &[usize]| {
        if v.iter().all(|x| *x == v[0]) {
            json!(v[0])
        } else {
            json!(v)
        }
    };
    let head_dims: Vec<usize> = (0..c.heads.len()).map(|i| c.head_dim(i)).collect();
    json!({
        "model": ck.source.to_string(),
        "name": ck.metadata.get("upscale.name"),
        "architecture": ck.config.name(),
        "scale": c.scale,
        "parameters": ck.config.parameter_count(),
        "upsampler": c.upsampler.name(),
        "resi_connection": c.resi_connection,
        "groups": c.depths.len(),
        "depths": uniform(&c.depths),
        "embed_dim": c.embed_dim,
        "window": c.window,
        "heads": uniform(&c.heads),
        "head_dims": uniform(&head_dims),
        "mlp_hidden": c.mlp_hidden,
        "num_feat": (c.num_feat > 0).then_some(c.num_feat),
        "patch_norm": c.patch_norm,
        "state_dict_key": ck.wrapper,
    })
}

fn describe_hat(ck: &Checkpoint, c: &HatConfig) -> serde_json::Value {
    let uniform = |v: &[usize]| {
        if v.iter().all(|x| *x == v[0]) {
            json!(v[0])
        } else {
            json!(v)
        }
    };
    let head_dims: Vec<usize> = (0..c.heads.len()).map(|i| c.head_dim(i)).collect();
    json!({
        "model": ck.source.to_string(),
        "name": ck.metadata.get("upscale.name"),
        "architecture": ck.config.name(),
        "scale": c.scale,
        "parameters": ck.config.parameter_count(),
        "groups": c.depths.len(),
        "depths": uniform(&c.depths),
        "embed_dim": c.embed_dim,
        "window": c.window,
        "overlap_window": c.overlap_window,
        "overlap_ratio": c.overlap_ratio(),
        "compress_ratio": c.compress_ratio(),
        "squeeze_factor": c.squeeze_factor(),
        "conv_scale": crate::model::hat::CONV_SCALE,
        "heads": uniform(&c.heads),
        "head_dims": uniform(&head_dims),
        "mlp_hidden": c.mlp_hidden,
        "num_feat": c.num_feat,
        "patch_norm": c.patch_norm,
        "state_dict_key": ck.wrapper,
    })
}

pub fn render_text(v: &serde_json::Value) -> String {
    let mut s = String::new();
    if let Some(obj) = v.as_object() {
        for (k, val) in obj {
            if val.is_null() {
                continue;
            }
            let shown = match val {
                serde_json::Value::String(x) => x.clone(),
                other => other.to_string(),
            };
            s.push_str(&format!("{k:<16} {shown}\n"));
        }
    }
    s
}
