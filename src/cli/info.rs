//! `upscale info`: what a checkpoint is, from its weights alone.

use serde_json::json;

use crate::model::{Checkpoint, DrctConfig};

pub fn describe(ck: &Checkpoint) -> serde_json::Value {
    let c: &DrctConfig = &ck.config;
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
        "architecture": if c.groups >= 12 { "DRCT-L" } else { "DRCT" },
        "scale": c.scale,
        "parameters": c.parameter_count(),
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
