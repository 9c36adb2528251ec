//! The networks: one module per architecture (its configuration inferred from the weights,
//! its layers wired together), the Swin-family layers they share, and the registry that
//! tells them apart. Nothing here chooses a device or a kernel: the operations in
//! [`crate::ops`] do that when they are built.

pub mod compact;
pub mod drct;
pub mod esrgan;
mod frame;
pub mod hat;
pub mod infer;
pub mod registry;
pub mod swin;
pub mod swinir;

use candle_core::{DType, Device, Module};
use candle_nn::VarBuilder;

pub use crate::checkpoint::pth::{PthError, PthTensorError};
pub use crate::checkpoint::{Checkpoint, Source};
pub use crate::ops::attention::Attention;
use crate::ops::cpu::bf16;
use crate::ops::pad::Pad;
use crate::ops::LoadPlan;
pub use crate::switches::EnvError;
pub use infer::ConfigError;

/// Why a checkpoint could not become a network. Every variant names the file (or the
/// embedded model) it came from; the cause, where there is one, is both quoted in the message
/// and kept as the error's `source()`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
#[non_exhaustive]
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
#[non_exhaustive]
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
    /// The configuration loads (`info` describes it) but this build does not run it.
    #[error("{0}")]
    Unsupported(String),
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

/// A network, built: the forward pass and what the engine asks of it.
pub(crate) trait Net: Module + Send + Sync {
    /// The dtype it computes in.
    fn dtype(&self) -> DType;

    /// How its channels were padded at load (only DRCT's layers pad).
    fn padding(&self) -> Pad {
        Pad::OFF
    }

    /// Number of distinct padded sizes whose shift mask (or region labels) is cached.
    #[cfg(test)]
    fn cached_masks(&self) -> usize;
}

/// What an architecture's configuration, read from its weights, tells the rest of the
/// crate: names for `info`, sizes for the tile planner, and how to build the network.
pub(crate) trait NetConfig: std::fmt::Debug + Send + Sync {
    /// The architecture, as its registry entry names it (`"DRCT"`).
    fn family(&self) -> &'static str;

    /// The variant's name (`"DRCT-L"`, `"SwinIR-M"`, `"HAT-S"`).
    fn variant(&self) -> &'static str;

    /// The upscaling factor.
    fn scale(&self) -> usize;

    /// The multiple the network pads its input to (its attention window; 1 for none).
    fn window(&self) -> usize;

    /// Learned parameters.
    fn parameter_count(&self) -> usize;

    /// Multiply-adds x2 of one forward pass over a padded `h x w` input.
    fn flops(&self, h: usize, w: usize) -> f64;

    /// The configuration as `info --json` shows it (beside the fields every model has).
    fn describe(&self) -> serde_json::Value;

    /// The configuration serialised, for a converted file's metadata.
    fn to_json(&self) -> String;

    /// The widest attention head of any block (0 without attention).
    fn widest_head_dim(&self) -> usize;

    /// The most values any one intermediate tensor holds per padded input pixel (the bound
    /// candle's 32-bit CUDA indexing puts on a forward pass).
    fn largest_tensor_per_pixel(&self, scores_in_memory: bool, pad: Pad) -> usize;

    /// Values live at once per input pixel at the peak of a forward pass, from the shapes
    /// alone (the tile planner's analytic cost).
    fn activations_per_pixel(&self, scores_in_memory: bool, pad: Pad) -> f64;

    /// Why this configuration cannot run in the RGB pipeline, if it cannot: a model with
    /// other image channels still loads, for `info`, and is refused when built.
    fn refusal(&self) -> Option<String> {
        None
    }

    /// Whether the network's layers can pad their channels (`UPSCALE_PAD_CHANNELS`).
    fn pads_channels(&self) -> bool {
        false
    }

    /// The network stored under `vb`, built as `plan` says.
    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> candle_core::Result<Box<dyn Net>>;

    /// For tests that compare one architecture's configuration.
    #[cfg(test)]
    fn as_any(&self) -> &dyn std::any::Any;
}

/// One value where every entry agrees (the released models), else the list.
pub(crate) fn uniform(v: &[usize]) -> serde_json::Value {
    match v.first() {
        Some(first) if v.iter().all(|x| x == first) => serde_json::json!(first),
        _ => serde_json::json!(v),
    }
}

/// A configuration of any registered architecture.
pub(crate) type ArchConfig = std::sync::Arc<dyn NetConfig>;

/// `c` as architecture `T`'s configuration, if it is one.
#[cfg(test)]
pub(crate) fn config_of<T: 'static>(c: &ArchConfig) -> Option<&T> {
    c.as_any().downcast_ref()
}

/// A network ready to run.
pub struct Model {
    pub net: Box<dyn Net>,
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
        if let Some(why) = ck.config.refusal() {
            return Err(build_error(BuildError::Unsupported(why)));
        }
        let cpu_bf16 = dtype == DType::BF16 && device.is_cpu();
        let isa = match (cpu_bf16, bf16::isa()) {
            (false, _) => None,
            (true, Some(isa)) => Some(isa),
            (true, None) => return Err(build_error(BuildError::NoCpuBf16)),
        };
        let vb_dtype = if cpu_bf16 { DType::F32 } else { dtype };
        let switches = crate::switches::checked().map_err(|e| build_error(e.into()))?;
        let mut pad = Pad::from_switch(switches.pad_channels).map_err(|e| build_error(e.into()))?;
        if !ck.config.pads_channels() && pad != Pad::OFF {
            // Only DRCT's layers know how to pad; the others run as they are.
            log::warn!(
                "{}: applies to DRCT models; this one runs unpadded",
                crate::switches::PAD_VAR
            );
            pad = Pad::OFF;
        }
        let plan = LoadPlan {
            attention,
            pad,
            bf16: isa,
        };
        let vb = VarBuilder::from_tensors(ck.tensors, vb_dtype, device);
        let net = ck
            .config
            .build(&plan, vb)
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
