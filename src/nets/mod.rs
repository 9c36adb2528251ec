//! The networks: one module per architecture (its configuration inferred from the weights,
//! its layers wired together), the Swin-family layers they share, and the registry that
//! tells them apart. Nothing here chooses a device or a kernel: the operations in
//! [`crate::ops`] do that when they are built.

pub mod compact;
pub mod dat;
pub mod drct;
pub mod esrgan;
pub mod fdat;
mod frame;
pub mod hat;
pub mod infer;
pub(crate) mod luma;
pub mod mosr;
pub mod omnisr;
pub mod plksr;
pub mod rcan;
pub mod realcugan;
pub mod registry;
pub mod safmn;
pub mod span;
pub mod swin;
pub mod swin2sr;
pub mod swinir;

use candle_core::{DType, Module};
use candle_nn::VarBuilder;

use crate::ops::pad::Pad;
use crate::ops::LoadPlan;
pub use crate::switches::EnvError;
pub use infer::ConfigError;

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

/// What every configuration answers the same way, from its serialisable fields.
pub(crate) trait Serialised {
    /// The configuration serialised, for a converted file's metadata.
    fn to_json(&self) -> String;

    /// For tests that compare one architecture's configuration.
    #[cfg(test)]
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<T: serde::Serialize + 'static> Serialised for T {
    fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    #[cfg(test)]
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// What an architecture's configuration, read from its weights, tells the rest of the
/// crate: names for `info`, sizes for the tile planner, and how to build the network.
pub(crate) trait NetConfig: Serialised + std::fmt::Debug + Send + Sync {
    /// The architecture, as its registry entry names it (`"DRCT"`).
    fn family(&self) -> &'static str;

    /// The variant's name (`"DRCT-L"`, `"SwinIR-M"`, `"HAT-S"`).
    fn variant(&self) -> &'static str;

    /// The upscaling factor.
    fn scale(&self) -> usize;

    /// The multiple the network pads its input to (its attention window; 1 for none).
    fn window(&self) -> usize;

    /// Every tensor the network reads, with its shape: what loading checks the file against,
    /// and what the parameter count sums.
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)>;

    /// Learned parameters.
    fn parameter_count(&self) -> usize {
        infer::parameters(&self.expected_tensors())
    }

    /// Multiply-adds x2 of one forward pass over a padded `h x w` input.
    fn flops(&self, h: usize, w: usize) -> f64;

    /// The configuration as `info --json` shows it (beside the fields every model has).
    fn describe(&self) -> serde_json::Value;

    /// The widest attention head of any block (0 without attention).
    fn widest_head_dim(&self) -> usize {
        0
    }

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

    /// Whether the network reads and writes one image channel: it then runs on the image's
    /// luma ([`luma::Luma`]).
    fn greyscale(&self) -> bool {
        false
    }

    /// Whether the network's output depends on its whole input (GroupNorm's statistics, or
    /// attention and pooling across the image), so that tiles change its output (the tile
    /// planner keeps such images whole where it can).
    fn whole_input_matters(&self) -> bool {
        false
    }

    /// Whether the network's layers can pad their channels (`UPSCALE_PAD_CHANNELS`).
    fn pads_channels(&self) -> bool {
        false
    }

    /// The network stored under `vb`, built as `plan` says.
    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> candle_core::Result<Box<dyn Net>>;
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
