//! `upscale info`: what a checkpoint is, from its weights alone.

use serde_json::json;

use crate::model::{ArchConfig, Checkpoint, DrctConfig, HatConfig, SwinIrConfig};

pub fn describe(ck: &Checkpoint) -> serde_json::Value {
    match &ck.config {
        ArchConfig::Drct(c) => with_common(ck, describe_drct(c)),
        ArchConfig::SwinIr(c) => with_common(ck, describe_swinir(c)),
        ArchConfig::Hat(c) => with_common(ck, describe_hat(c)),
    }
}

/// What every architecture reports, with `fields` added.
fn with_common(ck: &Checkpoint, fields: serde_json::Value) -> serde_json::Value {
    let mut v = json!({
        "model": ck.source.to_string(),
        "name": ck.metadata.get("upscale.name"),
        "architecture": ck.config.name(),
        "parameters": ck.config.parameter_count(),
        "state_dict_key": ck.wrapper,
    });
    if let (Some(all), serde_json::Value::Object(more)) = (v.as_object_mut(), fields) {
        all.extend(more);
    }
    v
}

/// One value where every entry agrees (the released models), else the list.
fn uniform(v: &[usize]) -> serde_json::Value {
    match v.first() {
        Some(first) if v.iter().all(|x| x == first) => json!(first),
        _ => json!(v),
    }
}

fn describe_drct(c: &DrctConfig) -> serde_json::Value {
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

fn describe_swinir(c: &SwinIrConfig) -> serde_json::Value {
    let head_dims: Vec<usize> = (0..c.heads.len()).map(|i| c.head_dim(i)).collect();
    json!({
        "scale": c.scale,
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
    })
}

fn describe_hat(c: &HatConfig) -> serde_json::Value {
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
        "conv_scale": crate::model::hat::CONV_SCALE,
        "heads": uniform(&c.heads),
        "head_dims": uniform(&head_dims),
        "mlp_hidden": c.mlp_hidden,
        "num_feat": c.num_feat,
        "patch_norm": c.patch_norm,
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
