//! `upscale convert`: any supported checkpoint to a clean safetensors file.

use std::path::Path;

use anyhow::{bail, Result};
use upscale::{ModelFile, Precision};

pub fn parse_dtype(s: &str) -> Result<Precision, String> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "fp32" | "float32" => Ok(Precision::Fp32),
        "f16" | "fp16" | "float16" | "half" => Ok(Precision::Fp16),
        "bf16" | "bfloat16" => Ok(Precision::Bf16),
        _ => Err(format!("unknown dtype '{s}' (expected f32, f16 or bf16)")),
    }
}

/// Write the validated weights (buffers dropped, keys normalised) with the detected config in
/// the metadata, through a temporary file so a failure never leaves a partial output.
pub fn convert(input: &Path, output: &Path, dtype: Precision) -> Result<()> {
    if output.exists() && output.is_dir() {
        bail!("{}: is a directory", output.display());
    }
    ModelFile::open(Some(input))?.write_safetensors(output, dtype)?;
    Ok(())
}
