//! Any bytes as a safetensors checkpoint: loading, validation and building the network must
//! return an error or a model, never panic; a model that loads must run on a tiny input.
#![no_main]

use candle_core::{DType, Device, Module, Tensor};
use libfuzzer_sys::fuzz_target;
use upscale::model::{Checkpoint, Model, Source};

fuzz_target!(|data: &[u8]| {
    let Ok(ck) = Checkpoint::from_safetensors_bytes(data, Source::Embedded("fuzz")) else {
        return;
    };
    let Ok(model) = Model::from_checkpoint(ck, DType::F32, &Device::Cpu) else {
        return;
    };
    if let Ok(x) = Tensor::zeros((1, 3, 8, 8), DType::F32, &Device::Cpu) {
        let _ = model.net.forward(&x);
    }
});
