//! `upscale convert`: any supported checkpoint to a clean safetensors file.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::DType;

use crate::model::Checkpoint;

pub fn parse_dtype(s: &str) -> Result<DType, String> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "fp32" | "float32" => Ok(DType::F32),
        "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        _ => Err(format!("unknown dtype '{s}' (expected f32, f16 or bf16)")),
    }
}

/// Write the validated weights (buffers dropped, keys normalised) with the detected config in
/// the metadata, through a temporary file so a failure never leaves a partial output.
pub fn convert(input: &Path, output: &Path, dtype: DType) -> Result<()> {
    if output.exists() && output.is_dir() {
        bail!("{}: is a directory", output.display());
    }
    let ck = Checkpoint::load(input)?;
    let mut tensors = HashMap::new();
    for (name, t) in &ck.tensors {
        let t = t
            .to_dtype(dtype)
            .with_context(|| format!("{}: converting {name}", input.display()))?;
        tensors.insert(name.clone(), t);
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let arch = match &ck.config {
        crate::model::ArchConfig::Drct(_) => "DRCT",
        crate::model::ArchConfig::SwinIr(_) => "SwinIR",
        crate::model::ArchConfig::Hat(_) => "HAT",
    };
    meta.insert("architecture".to_string(), arch.to_string());
    meta.insert(
        "upscale.config".to_string(),
        serde_json::to_string(&ck.config)?,
    );
    meta.insert(
        "upscale.source".to_string(),
        input
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    if let Some(w) = &ck.wrapper {
        meta.insert("upscale.source_key".to_string(), w.clone());
    }
    let bytes = safetensors::serialize(tensors.iter().map(|(k, v)| (k.as_str(), v)), Some(meta))
        .with_context(|| format!("{}: cannot write", output.display()))?;
    // The same atomic write as images get: ordinary permissions, synced, and a name that
    // folder walks and cleanup recognise as ours if a crash leaves it behind.
    crate::io::write_atomic(output, |w| {
        w.write_all(&bytes)
            .map_err(|e| crate::io::IoError::os(output, e))
    })?;
    Ok(())
}
