//! Seams, measured: PSNR of tiled output against whole-image output for each blend mode and
//! overlap, with a real model on real photos. Whole-image inference is the reference, so any
//! difference is what tiling costs.

use std::path::PathBuf;

use candle_core::{DType, Device};

use crate::checkpoint::Checkpoint;
use crate::engine::Engine;
use crate::metrics::{psnr, Measure};
use crate::tile::{run_tiled, BlendMode, TileOptions};

#[test]
#[ignore = "a measurement: TILE_BLEND='MODEL TILE IMAGE...' cargo test --release --lib tile_blend -- --ignored --nocapture"]
fn tile_blend() -> Result<(), Box<dyn std::error::Error>> {
    let spec = std::env::var("TILE_BLEND").map_err(|_| "set TILE_BLEND='MODEL TILE IMAGE...'")?;
    let args: Vec<&str> = spec.split_whitespace().collect();
    if args.len() < 3 {
        return Err("TILE_BLEND='MODEL TILE IMAGE...'".into());
    }
    let model = PathBuf::from(args[0]);
    let tile: usize = args[1].parse()?;
    let engine = Engine::new(Checkpoint::load(&model)?, Device::Cpu, DType::F32)?;
    println!(
        "model {} (x{}), tile {tile}",
        model.display(),
        engine.scale()
    );
    println!("| image | size | overlap | hann dB | average dB | none dB |");
    println!("|---|---|---|---|---|---|");
    for path in &args[2..] {
        let img = crate::io::decode(path.as_ref())?.rgb;
        let whole_opts = TileOptions {
            tile: 0,
            ..TileOptions::default()
        };
        let (whole, _) = run_tiled(&engine, &img, &whole_opts)?;
        for overlap in [8, 16, 32] {
            let mut row = Vec::new();
            for blend in [BlendMode::Hann, BlendMode::Average, BlendMode::None] {
                let opts = TileOptions {
                    tile,
                    overlap,
                    batch: 4,
                    blend,
                };
                let (tiled, _) = run_tiled(&engine, &img, &opts)?;
                row.push(psnr(&tiled, &whole, 0, Measure::Rgb)?);
            }
            let name = PathBuf::from(path);
            println!(
                "| {} | {}x{} | {overlap} | {:.2} | {:.2} | {:.2} |",
                name.file_name().unwrap_or_default().to_string_lossy(),
                img.width,
                img.height,
                row[0],
                row[1],
                row[2]
            );
        }
    }
    Ok(())
}
