//! `upscale bench`: latency, throughput, memory and FLOP rate of one configuration.

use std::time::Instant;

use serde_json::json;

use crate::engine::probe::peak_rss_bytes;
use crate::engine::Engine;
use crate::planar::Planar;
use crate::tile::{run_tiled, TileOptions};

pub struct BenchResult {
    pub seconds: Vec<f64>,
    pub json: serde_json::Value,
}

pub fn run(
    engine: &Engine,
    image: &Planar,
    opts: &TileOptions,
    warmup: usize,
    reps: usize,
    peak_tflops: Option<f64>,
) -> anyhow::Result<BenchResult> {
    for _ in 0..warmup {
        run_tiled(engine, image, opts)?;
    }
    let mut seconds = Vec::with_capacity(reps);
    let mut stats = None;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let (_, s) = run_tiled(engine, image, opts)?;
        seconds.push(t.elapsed().as_secs_f64());
        stats = Some(s);
    }
    let stats = stats.expect("at least one rep");
    let mut sorted = seconds.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted[sorted.len() / 2];
    let cfg = engine.model.config();
    let ws = cfg.window;
    let (th, tw) = stats.tile_shape;
    let flops_per_tile = cfg.flops(th.div_ceil(ws) * ws, tw.div_ceil(ws) * ws);
    let flops = flops_per_tile * stats.tiles as f64;
    let mpix = (image.height * image.width) as f64 / 1e6;
    let achieved = flops / median / 1e12;
    let json = json!({
        "device": format!("{:?}", engine.device),
        "dtype": format!("{:?}", engine.dtype),
        "input": [image.height, image.width],
        "scale": cfg.scale,
        "tile": [th, tw],
        "tiles": stats.tiles,
        "batch": stats.batch,
        "reps": seconds.len(),
        "median_s": median,
        "min_s": sorted[0],
        "seconds": seconds,
        "input_mpix_per_s": mpix / median,
        "tiles_per_s": stats.tiles as f64 / median,
        "model_tflop": flops / 1e12,
        "achieved_tflops": achieved,
        "flop_utilisation": peak_tflops.map(|p| achieved / p),
        "peak_rss_bytes": peak_rss_bytes(),
    });
    Ok(BenchResult { seconds, json })
}
