//! Upscale an image held in memory with the embedded default model, as a program that embeds
//! the library would:
//!
//!     cargo run --release --example upscale_in_memory [-- OUTPUT.png]

use upscale::{DeviceChoice, Options, Upscaler};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let opts = Options {
        device: DeviceChoice::Cpu,
        ..Options::default()
    };
    let up = Upscaler::open(None, &opts)?;
    for w in up.warnings() {
        eprintln!("warning: {w}");
    }
    // A synthetic picture: colour ramps and a ring, so the output has edges to show.
    let img = image::RgbImage::from_fn(64, 48, |x, y| {
        let (dx, dy) = (x as f32 - 32.0, y as f32 - 24.0);
        let ring = if (dx.hypot(dy) - 14.0).abs() < 2.0 {
            255
        } else {
            0
        };
        image::Rgb([(x * 4) as u8, (y * 5) as u8, ring])
    });
    let out = up.upscale(&image::DynamicImage::ImageRgb8(img))?;
    println!(
        "64x48 -> {}x{} with a x{} model",
        out.width(),
        out.height(),
        up.scale()
    );
    if let Some(path) = std::env::args().nth(1) {
        out.save(&path)?;
        println!("wrote {path}");
    }
    Ok(())
}
