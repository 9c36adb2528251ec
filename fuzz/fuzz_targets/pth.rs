//! Any bytes as a `.pth` checkpoint, through the library's front door as a program that
//! embeds it would call it: opening must return an error or a model, never panic, and a model
//! that opens must upscale a tiny image.
#![no_main]

use libfuzzer_sys::fuzz_target;
use upscale::{DeviceChoice, Options, Precision, Upscaler};

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("upscale-fuzz-{}.pth", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let opts = Options {
        device: DeviceChoice::Cpu,
        precision: Precision::Fp32,
        ..Options::default()
    };
    if let Ok(up) = Upscaler::open(Some(&path), &opts) {
        let _ = up.upscale(&image::DynamicImage::new_rgb8(8, 8));
    }
    let _ = std::fs::remove_file(&path);
});
