//! [`ModelFile`]: what a weight file holds, read from its tensors alone, and its
//! conversion to a clean `.safetensors` file.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use candle_core::DType;
use serde_json::json;

use crate::checkpoint::{Checkpoint, Source};
use crate::engine::{read_checkpoint, Precision};
use crate::error::{Error, ErrorKind};

/// A checkpoint, validated: its architecture and configuration inferred from the tensors
/// and every tensor checked against them.
pub struct ModelFile {
    ck: Checkpoint,
}

impl ModelFile {
    /// Reads `path` (a `.pth` or `.safetensors` file), or the embedded default model when
    /// `None`.
    pub fn open(path: Option<&Path>) -> Result<Self, Error> {
        Ok(Self {
            ck: read_checkpoint(path)?,
        })
    }

    /// The variant's name, e.g. `DRCT-L`, `SwinIR-M` or `HAT-S`.
    pub fn variant(&self) -> &'static str {
        self.ck.config.variant()
    }

    /// The model's upscaling factor.
    pub fn scale(&self) -> usize {
        self.ck.config.scale()
    }

    /// Learned parameters in the network.
    pub fn parameter_count(&self) -> usize {
        self.ck.config.parameter_count()
    }

    /// Everything known about the model as one JSON object (what `upscale info --json`
    /// prints): where it came from, the architecture, the parameter count, the wrapper key
    /// of a `.pth` state dict, and the architecture's configuration (scale, groups, width,
    /// window, heads, ...). A value that is the same for every group or block is given once.
    pub fn describe(&self) -> serde_json::Value {
        let ck = &self.ck;
        with_common(ck, ck.config.describe())
    }

    /// Writes the validated weights in `precision` to `output` (`Auto` is fp32, what every
    /// checkpoint holds once loaded):
    /// buffers dropped, keys normalised, the architecture and the detected configuration in
    /// the metadata with the original file's name. The write goes through a temporary
    /// file, so a failure never leaves a partial output.
    pub fn write_safetensors(&self, output: &Path, precision: Precision) -> Result<(), Error> {
        let ck = &self.ck;
        let dtype = match precision {
            Precision::Auto | Precision::Fp32 => DType::F32,
            Precision::Fp16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        };
        fn failed(
            origin: String,
            step: &str,
            source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
        ) -> Error {
            let (step, source) = (step.to_string(), source.into());
            let e = ConvertError {
                origin,
                step,
                source,
            };
            Error::new(ErrorKind::Convert, e)
        }
        let mut tensors = HashMap::new();
        for name in ck.tensors.names() {
            let t = ck.tensors.get(name).expect("a listed name");
            // Integer tensors (FDAT's upsampler description) keep their type: other loaders
            // index with their values.
            let to = match ck.tensors.stored_dtype(name) {
                Some(stored) if !stored.is_float() => stored,
                _ => dtype,
            };
            let t = t
                .map_err(|e| failed(ck.source.to_string(), &format!("converting {name}"), e))?
                .to_dtype(to)
                .map_err(|e| failed(ck.source.to_string(), &format!("converting {name}"), e))?;
            tensors.insert(name.to_string(), t);
        }
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let arch = ck.config.family();
        meta.insert("architecture".to_string(), arch.to_string());
        meta.insert("upscale.config".to_string(), ck.config.to_json());
        meta.insert(
            "upscale.source".to_string(),
            match &ck.source {
                Source::File(path) => path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                Source::Embedded(name) => name.to_string(),
            },
        );
        if let Some(w) = &ck.wrapper {
            meta.insert("upscale.source_key".to_string(), w.clone());
        }
        let bytes =
            safetensors::serialize(tensors.iter().map(|(k, v)| (k.as_str(), v)), Some(meta))
                .map_err(|e| failed(output.display().to_string(), "cannot write", e))?;
        // The same atomic write as images get: ordinary permissions, synced, and a name that
        // folder walks and cleanup recognise as ours if a crash leaves it behind.
        crate::io::write_atomic(output, |w| w.write_all(&bytes))?;
        Ok(())
    }
}

/// A checkpoint that could not be converted: the file, the step that failed (`converting
/// NAME` for a tensor, `cannot write`), and why (candle's, serde_json's or safetensors' error).
#[derive(Debug, thiserror::Error)]
#[error("{origin}: {step}")]
struct ConvertError {
    origin: String,
    step: String,
    #[source]
    source: Box<dyn std::error::Error + Send + Sync>,
}

/// What every architecture reports, with `fields` added.
fn with_common(ck: &Checkpoint, fields: serde_json::Value) -> serde_json::Value {
    let mut v = json!({
        "model": ck.source.to_string(),
        "name": ck.metadata.get("upscale.name"),
        "architecture": ck.config.variant(),
        "parameters": ck.config.parameter_count(),
        "state_dict_key": ck.wrapper,
    });
    if let (Some(all), serde_json::Value::Object(more)) = (v.as_object_mut(), fields) {
        all.extend(more);
    }
    v
}
