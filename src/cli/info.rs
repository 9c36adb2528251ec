//! `upscale info`: what a checkpoint is, from its weights alone ([`upscale::ModelFile`]).

/// The description as aligned `key value` lines, nulls left out.
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
