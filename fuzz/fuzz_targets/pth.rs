//! Any bytes as a PyTorch `.pth` file (read from disk, as the product does): an error or a
//! model, never a panic.
#![no_main]

use candle_core::{DType, Device};
use libfuzzer_sys::fuzz_target;
use upscale::model::{Checkpoint, Model};

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("upscale-fuzz-{}.pth", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(ck) = Checkpoint::load(&path) {
        let _ = Model::from_checkpoint(ck, DType::F32, &Device::Cpu);
    }
    let _ = std::fs::remove_file(&path);
});
