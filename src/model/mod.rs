//! The DRCT model: config inference, checkpoint reading, the network and its caches.

pub mod bf16;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod cuda_off;
pub mod drct;
pub mod epilogue;
pub mod fused;
pub mod norm;
pub mod ops;
pub mod pad_channels;
pub mod rowwise;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

pub use checkpoint::{Checkpoint, Source};
pub use config::DrctConfig;
pub use drct::Drct;
pub use fused::Attention;

/// Why a checkpoint could not become a network. Every variant names the file (or the
/// embedded model) it came from.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file could not be read.
    #[error("{path}: {msg}")]
    Io {
        /// The file's path.
        path: String,
        /// What the operating system said.
        msg: String,
    },
    /// The file is not a checkpoint this crate reads, or holds no DRCT state dict.
    #[error("{origin}: {msg}")]
    File {
        /// The file, or the embedded model's name.
        origin: String,
        /// What is wrong with it.
        msg: String,
    },
    /// One tensor is missing, misshapen or of an unusable dtype.
    #[error("{origin}: tensor {name}: {msg}")]
    Tensor {
        /// The file, or the embedded model's name.
        origin: String,
        /// The tensor's state-dict key.
        name: String,
        /// What is wrong with it.
        msg: String,
    },
    /// The tensors are consistent but the network could not be built from them.
    #[error("{origin}: building the network: {msg}")]
    Build {
        /// The file, or the embedded model's name.
        origin: String,
        /// What failed.
        msg: String,
    },
}

impl ModelError {
    pub(crate) fn file(source: &Source, msg: &str) -> Self {
        Self::File {
            origin: source.to_string(),
            msg: msg.to_string(),
        }
    }

    pub(crate) fn tensor(source: &Source, name: &str, msg: &str) -> Self {
        Self::Tensor {
            origin: source.to_string(),
            name: name.to_string(),
            msg: msg.to_string(),
        }
    }
}

/// A network ready to run.
pub struct Model {
    pub net: Drct,
}

impl Model {
    #[cfg(test)]
    /// Build the network from a validated checkpoint, converting weights to `dtype` on `device`
    /// (bf16 on the CPU: f32 activations, bf16 weights and products).
    pub fn from_checkpoint(
        ck: Checkpoint,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::from_checkpoint_with(ck, dtype, device, Attention::default())
    }

    /// [`Model::from_checkpoint`] with a choice of attention implementation.
    pub fn from_checkpoint_with(
        ck: Checkpoint,
        dtype: DType,
        device: &Device,
        attention: Attention,
    ) -> Result<Self, ModelError> {
        let build_error = |msg: String| ModelError::Build {
            origin: ck.source.to_string(),
            msg,
        };
        // bf16 on the CPU keeps f32 activations and runs the products in bf16: the weights
        // are read in f32 and packed by the network.
        let cpu_bf16 = dtype == DType::BF16 && device.is_cpu();
        let isa = match (cpu_bf16, bf16::isa()) {
            (false, _) => None,
            (true, Some(isa)) => Some(isa),
            (true, None) => return Err(build_error(
                "bf16 on the CPU needs AMX, or AVX512-BF16 on an AMD core; this CPU has neither"
                    .into(),
            )),
        };
        let vb_dtype = if cpu_bf16 { DType::F32 } else { dtype };
        let pad = pad_channels::current().map_err(build_error)?;
        let vb = VarBuilder::from_tensors(ck.tensors, vb_dtype, device);
        let mut net = Drct::with_attention(&ck.config, vb, attention, pad)
            .map_err(|e| build_error(e.to_string()))?;
        if let Some(isa) = isa {
            net.use_bf16_products(isa)
                .map_err(|e| build_error(e.to_string()))?;
        }
        Ok(Self { net })
    }

    #[cfg(test)]
    pub fn load(path: &std::path::Path, dtype: DType, device: &Device) -> Result<Self, ModelError> {
        Self::from_checkpoint(Checkpoint::load(path)?, dtype, device)
    }

    pub fn config(&self) -> &DrctConfig {
        self.net.config()
    }
}
