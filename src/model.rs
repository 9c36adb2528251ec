//! [`Model`]: a checkpoint's network, built for a device and a precision as the load plan
//! says. Above both the checkpoint readers and the networks, so that neither needs the other.

use candle_core::{DType, Device};

use crate::checkpoint::{Checkpoint, ModelError};
use crate::nets::{ArchConfig, BuildError, Net};
use crate::ops::attention::Attention;
use crate::ops::cpu::bf16;
use crate::ops::pad::Pad;
use crate::ops::LoadPlan;

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
        let pad = match switches.pad_channels {
            Some(multiple) => Pad::from_switch(multiple).map_err(|e| build_error(e.into()))?,
            None => Pad::choose(device, dtype),
        };
        // Only DRCT's layers know how to pad; the others run as they are (a warning only when
        // the variable asked for it).
        let pad = if pad == Pad::OFF || ck.config.pads_channels() {
            pad
        } else {
            if switches.pad_channels.is_some() {
                log::warn!(
                    "{}: applies to DRCT models; this one runs unpadded",
                    crate::switches::PAD_VAR
                );
            }
            Pad::OFF
        };
        let plan = LoadPlan {
            attention,
            pad,
            bf16: isa,
            switches,
        };
        let vb = ck.tensors.var_builder(vb_dtype, device);
        let net = ck
            .config
            .build(&plan, vb)
            .map_err(|e| build_error(e.into()))?;
        let net = if ck.config.greyscale() {
            Box::new(crate::nets::luma::Luma(net))
        } else {
            net
        };
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
