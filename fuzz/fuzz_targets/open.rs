//! What both fuzz targets do with their bytes, through the library's front door as a program
//! that embeds it would call it.

use upscale::{DeviceChoice, Options, Precision, Upscaler};

/// Writes `data` to a temporary file named `*.{ext}`, opens it as a model on the CPU and, when
/// it opens, upscales a tiny image. Any panic is the finding.
pub fn open_and_run(data: &[u8], ext: &str) {
    let path = std::env::temp_dir().join(format!("upscale-fuzz-{}.{ext}", std::process::id()));
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
}
