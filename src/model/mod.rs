//! The models: config inference, checkpoint reading, the networks (DRCT, SwinIR, HAT) and
//! their caches.

pub mod arch;
pub mod bf16;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub(crate) mod cpu_isa;
pub mod cuda_off;
pub mod drct;
pub mod env;
pub mod hat;
pub mod layers;
pub mod ops;
pub mod pad_channels;
pub mod pth;
pub mod rowwise;
pub mod swin;
pub mod swinir;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;

pub use arch::ArchConfig;
pub use checkpoint::{Checkpoint, Source};
pub use config::ConfigError;
pub use config::DrctConfig;
pub use drct::Drct;
pub use env::EnvError;
pub use hat::Hat;
pub use hat::HatConfig;
pub use layers::attention::Attention;
use layers::LoadPlan;
pub use pth::{PthError, PthTensorError};
pub use swinir::SwinIr;
pub use swinir::SwinIrConfig;

/// Why a checkpoint could not become a network. Every variant names the file (or the
/// embedded model) it came from; the cause, where there is one, is both quoted in the message
/// and kept as the error's `source()`.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file's path.
        path: String,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a checkpoint this crate reads, or holds no state dict.
    #[error("{origin}: {msg}")]
    File {
        /// The file, or the embedded model's name.
        origin: String,
        /// What is wrong with it.
        msg: &'static str,
    },
    /// A `.pth` whose zip archive or pickle could not be read.
    #[error("{origin}: unreadable PyTorch archive: {source}")]
    Archive {
        /// The file.
        origin: String,
        /// What the archive or pickle reader said.
        #[source]
        source: PthError,
    },
    /// A safetensors file whose header could not be read.
    #[error("{origin}: unreadable safetensors: {source}")]
    Safetensors {
        /// The file, or the embedded model's name.
        origin: String,
        /// What the safetensors reader said.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// The tensors do not make a model this build runs: a missing, unexplained or misshapen
    /// tensor, or another architecture.
    #[error("{origin}: {source}")]
    Config {
        /// The file, or the embedded model's name.
        origin: String,
        /// What config inference found.
        #[source]
        source: ConfigError,
    },
    /// One tensor could not be read, or holds a NaN or an infinity.
    #[error("{origin}: tensor {name}: {source}")]
    Tensor {
        /// The file, or the embedded model's name.
        origin: String,
        /// The tensor's state-dict key.
        name: String,
        /// What is wrong with it (boxed: candle's errors are large, and this one would make
        /// every `Result` carrying a `ModelError` larger).
        #[source]
        source: Box<TensorError>,
    },
    /// The tensors are consistent but the network could not be built from them.
    #[error("{origin}: building the network: {source}")]
    Build {
        /// The file, or the embedded model's name.
        origin: String,
        /// What failed.
        #[source]
        source: BuildError,
    },
}

/// Why one tensor of a checkpoint could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    /// It could not be read from a `.pth` archive.
    #[error(transparent)]
    Pth(#[from] PthTensorError),
    /// candle could not read or convert it.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// It holds a NaN or an infinity.
    #[error("holds a non-finite value ({value}) at flat index {index}")]
    NonFinite {
        /// The first such value.
        value: f32,
        /// Its index in the flattened tensor.
        index: usize,
    },
}

/// Why a network could not be built from consistent tensors.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// bf16 on the CPU was asked for on a CPU without the instructions it runs on.
    #[error("bf16 on the CPU needs AMX, or AVX512-BF16 on an AMD core; this CPU has neither")]
    NoCpuBf16,
    /// `UPSCALE_PAD_CHANNELS` holds a value it does not take.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// A layer could not be made of its weights.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    pub(crate) fn file(source: &Source, msg: &'static str) -> Self {
        Self::File {
            origin: source.to_string(),
            msg,
        }
    }

    pub(crate) fn tensor(source: &Source, name: &str, e: impl Into<TensorError>) -> Self {
        Self::Tensor {
            origin: source.to_string(),
            name: name.to_string(),
            source: Box::new(e.into()),
        }
    }
}

/// One of the supported networks, built.
// A model holds one network, built once and never moved in a loop: boxing the larger
// variants would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Network {
    Drct(Drct),
    SwinIr(SwinIr),
    Hat(Hat),
}

impl Network {
    pub fn dtype(&self) -> DType {
        match self {
            Self::Drct(n) => n.dtype(),
            Self::SwinIr(n) => n.dtype(),
            Self::Hat(n) => n.dtype(),
        }
    }

    /// How the channels were padded at load (DRCT only; the others never are).
    pub fn padding(&self) -> pad_channels::Pad {
        match self {
            Self::Drct(n) => n.padding(),
            Self::SwinIr(_) | Self::Hat(_) => pad_channels::Pad::OFF,
        }
    }

    #[cfg(test)]
    /// Number of distinct padded sizes whose shift mask (or region labels) is cached.
    pub fn cached_masks(&self) -> usize {
        match self {
            Self::Drct(n) => n.cached_masks(),
            Self::SwinIr(n) => n.cached_masks(),
            Self::Hat(n) => n.cached_masks(),
        }
    }
}

impl Module for Network {
    /// `x`: `(B, 3, H, W)` RGB in [0, 1], any H and W. Returns `(B, 3, sH, sW)`, unclamped.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Drct(n) => n.forward(x),
            Self::SwinIr(n) => n.forward(x),
            Self::Hat(n) => n.forward(x),
        }
    }
}

/// A network ready to run.
pub struct Model {
    pub net: Network,
    config: ArchConfig,
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
        let build_error = |e: BuildError| ModelError::Build {
            origin: ck.source.to_string(),
            source: e,
        };
        // bf16 on the CPU keeps f32 activations and runs every matrix product (linear layers,
        // convolutions as GEMMs, both attention products) with bf16 operands and f32 sums:
        // the weights are read in f32 and each layer packs its own as it is built.
        let cpu_bf16 = dtype == DType::BF16 && device.is_cpu();
        let isa = match (cpu_bf16, bf16::isa()) {
            (false, _) => None,
            (true, Some(isa)) => Some(isa),
            (true, None) => return Err(build_error(BuildError::NoCpuBf16)),
        };
        let vb_dtype = if cpu_bf16 { DType::F32 } else { dtype };
        let mut pad = pad_channels::current().map_err(|e| build_error(e.into()))?;
        if !matches!(ck.config, ArchConfig::Drct(_)) && pad != pad_channels::Pad::OFF {
            // Only DRCT's layers know how to pad; the others run as they are.
            log::warn!(
                "{}: applies to DRCT models; this one runs unpadded",
                pad_channels::VAR
            );
            pad = pad_channels::Pad::OFF;
        }
        let plan = LoadPlan {
            attention,
            pad,
            bf16: isa,
        };
        let vb = VarBuilder::from_tensors(ck.tensors, vb_dtype, device);
        let net = match &ck.config {
            ArchConfig::Drct(c) => Drct::new(c, &plan, vb).map(Network::Drct),
            ArchConfig::SwinIr(c) => SwinIr::new(c, &plan, vb).map(Network::SwinIr),
            ArchConfig::Hat(c) => Hat::new(c, &plan, vb).map(Network::Hat),
        }
        .map_err(|e| build_error(e.into()))?;
        Ok(Self {
            net,
            config: ck.config,
        })
    }

    #[cfg(test)]
    pub fn load(path: &std::path::Path, dtype: DType, device: &Device) -> Result<Self, ModelError> {
        Self::from_checkpoint(Checkpoint::load(path)?, dtype, device)
    }

    pub fn config(&self) -> &ArchConfig {
        &self.config
    }
}
