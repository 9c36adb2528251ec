//! [`Upscaler::bench`]: latency, throughput, memory and FLOP rate of one configuration on a
//! synthetic image.
//!
//! Device memory is the peak of each GPU's default memory pool over the timed runs (every
//! candle allocation comes from it; cuBLAS workspaces and the CUDA context do not).

use std::time::Instant;

use candle_core::DType;
use serde::Serialize;

use crate::api::Upscaler;
use crate::engine::lanes::{pool_peak, reset_pool_peaks};
use crate::engine::probe::{pattern, peak_rss_bytes};
use crate::error::Error;
use crate::ops::cpu::bf16::Isa;
use crate::tile::LaneStats;

pub use crate::engine::lanes::PoolPeak as DevicePool;

/// What one configuration measured. It serialises to the object `upscale bench --json`
/// prints (less `flop_utilisation`, which needs the device's peak rate from the caller).
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// The first lane's device, as candle prints it.
    pub device: String,
    /// The weights' and activations' type, as candle prints it.
    pub dtype: String,
    /// Which CPU kernel ran the bf16 products (`amx` or `avx512-bf16`; their speed differs
    /// by 2-3x); `None` off the CPU or in another precision.
    pub cpu_bf16_kernel: Option<&'static str>,
    /// The vector instructions our CPU kernels ran (`avx512`, `avx2` or `scalar`: what the
    /// CPU has, held down by `UPSCALE_CPU_ISA`); `None` off the CPU.
    pub cpu_isa: Option<&'static str>,
    /// `UPSCALE_PAD_CHANNELS`: the multiple every channel width was padded to, 0 for none.
    pub pad_channels: usize,
    /// The synthetic input, (height, width).
    pub input: (usize, usize),
    /// The model's upscaling factor.
    pub scale: usize,
    /// The tile (rows, columns) finally used.
    pub tile: (usize, usize),
    /// Tiles per run.
    pub tiles: usize,
    /// Tiles per forward pass finally used.
    pub batch: usize,
    /// Timed runs.
    pub reps: usize,
    /// The median of `seconds`.
    pub median_s: f64,
    /// The fastest of `seconds`.
    pub min_s: f64,
    /// Each timed run's wall time.
    pub seconds: Vec<f64>,
    /// Input megapixels per second at the median.
    pub input_mpix_per_s: f64,
    /// Tiles per second at the median.
    pub tiles_per_s: f64,
    /// The model's floating-point work per run, in TFLOP (tiles padded to the window).
    pub model_tflop: f64,
    /// `model_tflop` per median second.
    pub achieved_tflops: f64,
    /// The process's peak resident memory (Linux; `None` elsewhere).
    pub peak_rss_bytes: Option<u64>,
    /// The sum of the GPUs' pool peaks over the timed runs; `None` on the CPU.
    pub peak_device_bytes: Option<u64>,
    /// Each GPU's pool peaks.
    pub device_pools: Vec<DevicePool>,
    /// Lanes the image was spread over.
    pub lanes: usize,
    /// Work per lane over the timed runs.
    pub lane_stats: Vec<LaneStats>,
    /// What the automatic tile plans with, when asked for.
    pub tile_cost_bytes_per_pixel: Option<TileCost>,
}

/// Memory per input pixel that the automatic tile size is planned with.
#[derive(Clone, Debug, Serialize)]
pub struct TileCost {
    /// The analytic bound that lets small images skip the probe.
    pub bound: f64,
    /// The probe's reading (CPU only).
    pub measured: Option<f64>,
}

impl Upscaler {
    /// Runs a deterministic synthetic `height` x `width` image `warmup` times untimed (for
    /// allocations and caches), then `reps` times (at least once) timed, with the tiling
    /// this upscaler was opened with. With `tile_cost`, one probe forward pass on the CPU
    /// measures the memory per pixel first; its memory then shows in the peak.
    pub fn bench(
        &self,
        (height, width): (usize, usize),
        warmup: usize,
        reps: usize,
        tile_cost: bool,
    ) -> Result<BenchReport, Error> {
        let pool = self.lanes();
        let engine = pool.primary();
        let image = pattern(height, width);
        let opts = pool.tile_options(self.settings(), height, width);
        // Before the warm-up: the probe's reading starts from a reset peak and must see the
        // allocator as a fresh process does. Only on request: the probe's memory stays with
        // the process and would raise the reported peak of a small input.
        let measured = tile_cost
            .then(|| engine.measure_bytes_per_pixel())
            .flatten();
        for _ in 0..warmup {
            pool.run(&image, &opts)?;
        }
        let devices = pool.devices();
        for d in &devices {
            reset_pool_peaks(d);
        }
        let mut seconds = Vec::with_capacity(reps);
        let mut stats = None;
        let mut lanes = Vec::new();
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            let (_, s, l) = pool.run(&image, &opts)?;
            seconds.push(t.elapsed().as_secs_f64());
            stats = Some(s);
            LaneStats::merge(&mut lanes, &l);
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
        let mpix = (height * width) as f64 / 1e6;
        Ok(BenchReport {
            device: format!("{:?}", engine.device),
            dtype: format!("{:?}", engine.dtype),
            cpu_bf16_kernel: (engine.device.is_cpu() && engine.dtype == DType::BF16)
                .then(crate::ops::cpu::bf16::isa)
                .flatten()
                .map(|isa| match isa {
                    Isa::Amx => "amx",
                    Isa::Avx512 => "avx512-bf16",
                }),
            cpu_isa: engine
                .device
                .is_cpu()
                .then(|| crate::ops::cpu::isa::cpu_isa().name()),
            pad_channels: engine.model.net.padding().multiple(),
            input: (height, width),
            scale: cfg.scale(),
            tile: (th, tw),
            tiles: stats.tiles,
            batch: stats.batch,
            reps: seconds.len(),
            median_s: median,
            min_s: sorted[0],
            input_mpix_per_s: mpix / median,
            tiles_per_s: stats.tiles as f64 / median,
            model_tflop: flops / 1e12,
            achieved_tflops: flops / median / 1e12,
            seconds,
            peak_rss_bytes: peak_rss_bytes(),
            peak_device_bytes: peak_device,
            device_pools: pools,
            lanes: pool.count(),
            lane_stats: lanes,
            tile_cost_bytes_per_pixel: tile_cost.then(|| TileCost {
                bound: engine.bytes_per_pixel_bound(),
                measured,
            }),
        })
    }
}
