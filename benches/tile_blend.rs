//! Seams, measured: PSNR of tiled output against whole-image output for each blend mode and
//! overlap, with a real model on real photos. Whole-image inference is the reference, so any
//! difference is what tiling costs.
//!
//! usage: cargo bench --bench tile_blend -- MODEL TILE IMAGE...

use std::path::PathBuf;

use candle_core::{DType, Device};
use upscale::engine::Engine;
use upscale::metrics::{psnr, Measure};
use upscale::model::Checkpoint;
use upscale::tile::{run_tiled, BlendMode, TileOptions};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.len() < 3 {
        anyhow::bail!("usage: tile_blend MODEL TILE IMAGE...");
    }
    let model = PathBuf::from(&args[0]);
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
        let img = upscale::io::decode(path.as_ref())?.rgb;
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
                    quiet: true,
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
