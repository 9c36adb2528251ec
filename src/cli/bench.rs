//! `upscale bench`: latency, throughput, memory and FLOP rate of one configuration.
//!
//! Device memory is the peak of each GPU's default memory pool over the timed runs (every
//! candle allocation comes from it; cuBLAS workspaces and the CUDA context do not).

use std::time::Instant;

use candle_core::DType;
use serde_json::json;

use crate::engine::lanes::{pool_peak, reset_pool_peaks, Lanes};
use crate::engine::probe::peak_rss_bytes;
use crate::model::bf16::Isa;
use crate::planar::Planar;
use crate::tile::lanes::merge_lane_stats;
use crate::tile::TileOptions;

pub struct BenchResult {
    pub json: serde_json::Value,
}

pub fn run(
    engine: &Lanes,
    image: &Planar,
    opts: &TileOptions,
    warmup: usize,
    reps: usize,
    peak_tflops: Option<f64>,
    tile_cost: bool,
) -> anyhow::Result<BenchResult> {
    // Before the warm-up: the probe's reading starts from a reset peak and must see the
    // allocator as a fresh process does. Only on request: the probe's memory stays with the
    // process and would raise the reported peak of a small input.
    let measured = tile_cost
        .then(|| engine.measure_bytes_per_pixel())
        .flatten();
    for _ in 0..warmup {
        engine.run(image, opts)?;
    }
    let devices = engine.devices();
    for d in &devices {
        reset_pool_peaks(d);
    }
    let mut seconds = Vec::with_capacity(reps);
    let mut stats = None;
    let mut lanes = Vec::new();
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let (_, s, l) = engine.run(image, opts)?;
        seconds.push(t.elapsed().as_secs_f64());
        stats = Some(s);
        merge_lane_stats(&mut lanes, &l);
    }
    let pools: Vec<_> = devices.iter().filter_map(|d| pool_peak(d)).collect();
    let peak_device =
        (!pools.is_empty()).then(|| pools.iter().map(|p| p.reserved_high_bytes).sum::<u64>());
    let stats = stats.expect("at least one rep");
    let mut sorted = seconds.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted[sorted.len() / 2];
    let cfg = engine.model.config();
    let ws = cfg.window();
    let (th, tw) = stats.tile_shape;
    let flops_per_tile = cfg.flops(th.div_ceil(ws) * ws, tw.div_ceil(ws) * ws);
    let flops = flops_per_tile * stats.tiles as f64;
    let mpix = (image.height * image.width) as f64 / 1e6;
    let achieved = flops / median / 1e12;
    let json = json!({
        "device": format!("{:?}", engine.device),
        "dtype": format!("{:?}", engine.dtype),
        // Which CPU kernel ran the bf16 products (their speed differs by 2-3x), or null.
        "cpu_bf16_kernel": (engine.device.is_cpu() && engine.dtype == DType::BF16)
            .then(crate::model::bf16::isa)
            .flatten()
            .map(|isa| match isa {
                Isa::Amx => "amx",
                Isa::Avx512 => "avx512-bf16",
            }),
        // UPSCALE_PAD_CHANNELS: the multiple every channel width was padded to, 0 for none.
        "pad_channels": engine.model.net.padding().multiple(),
        "input": [image.height, image.width],
        "scale": cfg.scale(),
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
        "peak_device_bytes": peak_device,
        "device_pools": pools,
        "lanes": engine.count(),
        "lane_stats": lanes,
        // With --tile_cost, what the automatic tile plans with: the analytic bound that lets
        // small images skip the probe, and the probe's reading (CPU only).
        "tile_cost_bytes_per_pixel": tile_cost.then(|| json!({
            "bound": engine.bytes_per_pixel_bound(),
            "measured": measured,
        })),
    });
    Ok(BenchResult { json })
}
