//! Lanes and the blend kernel on a GPU: two lanes on cuda:0 against one lane and against the
//! CPU on a real fixture model, and the CUDA canvas against the host accumulator.

use super::gpu;
use crate::checkpoint::Checkpoint;
use crate::engine::lanes::{pool_peak, Lanes};
use crate::engine::{DeviceChoice, Engine};
use crate::tile::blend::Weights;
use crate::tile::device::{weight_table, DeviceCanvas};
use crate::tile::stitch::finish_canvases;
use crate::tile::tests::max_diff;
use crate::tile::{plan, Accumulator, BlendMode, TileOptions};
use candle_core::{DType, Device, Tensor};

fn checkpoint() -> Checkpoint {
    Checkpoint::load(&crate::tests::golden(crate::tests::FAST_MODEL)).unwrap()
}

fn cuda_lanes(streams: usize) -> Lanes {
    let mut warnings = Vec::new();
    let lanes = Lanes::open(
        checkpoint(),
        gpu(),
        (DType::F32, crate::ops::attention::Attention::Fused),
        &DeviceChoice::Cuda(vec![0]),
        streams,
        &mut |w| warnings.push(w),
    )
    .unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    lanes
}

#[test]
fn two_cuda_lanes_match_one_and_the_cpu() {
    let image = crate::engine::probe::pattern(83, 101);
    let opts = TileOptions {
        tile: 32,
        overlap: 8,
        batch: 2,
        blend: BlendMode::Hann,
    };
    let cpu = Lanes::single(Engine::new(checkpoint(), Device::Cpu, DType::F32).unwrap());
    let (reference, ref_stats, _) = cpu.run(&image, &opts).unwrap();
    let one = cuda_lanes(1);
    let two = cuda_lanes(2);
    assert_eq!((one.count(), two.count()), (1, 2));
    let (a, a_stats, a_lanes) = one.run(&image, &opts).unwrap();
    let (b, b_stats, b_lanes) = two.run(&image, &opts).unwrap();
    let (d_cpu, d_lanes) = (max_diff(&a, &reference), max_diff(&b, &a));
    eprintln!("cuda f32: one lane {d_cpu:.3e} vs cpu, two lanes {d_lanes:.3e} vs one");
    assert!(d_cpu < 1e-4, "one lane vs cpu: {d_cpu}");
    assert!(d_lanes < 1e-5, "two lanes vs one: {d_lanes}");
    assert_eq!(a_stats.tiles, ref_stats.tiles);
    assert_eq!(b_stats.tiles, ref_stats.tiles);
    assert_eq!(a_lanes.len(), 1);
    assert_eq!(b_lanes.len(), 2);
    assert!(b_lanes.iter().all(|l| l.device == "cuda:0"));
    assert_eq!(
        b_lanes.iter().map(|l| l.tiles).sum::<usize>(),
        b_stats.tiles
    );
    eprintln!("lanes: {b_lanes:?}");
    let peak = pool_peak(&two.engines()[0].device).expect("the memory pool reports peaks");
    assert!(peak.used_high_bytes > 0, "{peak:?}");
}

#[test]
fn cuda_blend_kernel_matches_the_host_accumulator() {
    let dev = gpu();
    let c = 3;
    for mode in [BlendMode::Hann, BlendMode::Average, BlendMode::None] {
        for s in [1, 2, 3, 4] {
            let (h, w) = (37, 53);
            let p = plan(h, w, 16, 6).unwrap();
            let (th, tw) = (p.tile_h * s, p.tile_w * s);
            let mut weights = Weights::new(mode, s);
            let mut host = Accumulator::new(c, h, w, s, mode);
            let canvas = DeviceCanvas::new(c, h, w, s, &dev).unwrap();
            let table = weight_table(&p, mode, s, &dev).unwrap();
            for (k, t) in p.tiles.iter().enumerate() {
                let (wy, wx) = (weights.axis(&t.y), weights.axis(&t.x));
                // NaN wherever the weight is zero: it must not reach the output.
                let data: Vec<f32> = (0..c * th * tw)
                    .map(|i| {
                        if wy[(i / tw) % th] * wx[i % tw] == 0.0 {
                            f32::NAN
                        } else {
                            ((i * 7919 + k * 104_729) % 1000) as f32 / 997.0
                        }
                    })
                    .collect();
                host.add(t, &data);
                let out = Tensor::from_vec(data, (1, c, th, tw), &dev).unwrap();
                canvas.add(t, &out, 0, &table, k).unwrap();
            }
            let device = finish_canvases(c, h * s, w * s, vec![canvas.download().unwrap()]);
            let device = device.unwrap();
            let host = host.finish();
            let same = host
                .data
                .iter()
                .zip(&device.data)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{mode:?} x{s}: the kernel differs from the host");
        }
    }
}

/// With all but a little of the card held by a ballast, a batch of every tile of an image
/// does not fit: the scheduler halves the batch (or the tile) until it does, the image
/// completes, and it matches a run that never ran short within f32 rounding. This is the
/// path `--tile 2048 --tile_batch_size 16` takes on a card too small for it, on a real out of
/// memory error from the driver rather than a simulated one.
#[test]
fn a_batch_larger_than_free_memory_backs_off_and_completes() {
    use crate::engine::lanes::{pool_idle_bytes, reset_pool_peaks};
    let lanes = cuda_lanes(1);
    let dev = lanes.engines()[0].device.clone();
    let image = crate::engine::probe::pattern(1024, 1024);
    let small = TileOptions {
        tile: 64,
        overlap: 8,
        batch: 1,
        blend: BlendMode::Hann,
    };
    reset_pool_peaks(&dev);
    let (want, want_stats, _) = lanes.run(&image, &small).unwrap();
    let one_batch = pool_peak(&dev)
        .expect("the pool reports peaks")
        .used_high_bytes;
    // Room for twice what the batch-1 run needed at its peak (the weights, the image, the
    // canvas and one tile's activations): a batch of all 361 tiles cannot fit.
    let room = 2 * one_batch.max(32 << 20);
    let spare = lanes.primary().free_memory() + pool_idle_bytes(&dev);
    let mut ballast = Vec::new();
    let mut held = 0u64;
    while held + room < spare {
        // Chunks of at most 1 GiB keep each buffer's element count far from u32 limits.
        let n = (spare - room - held).min(1 << 30);
        ballast.push(Tensor::zeros(n as usize, DType::U8, &dev).unwrap());
        held += n;
    }
    dev.synchronize().unwrap();
    let all = TileOptions {
        batch: want_stats.tiles,
        ..small
    };
    let (got, stats, _) = lanes.run(&image, &all).unwrap();
    drop(ballast);
    eprintln!(
        "held {:.1} GiB, room {} MiB: {} out-of-memory retries, batch {} -> {}, tile {:?}",
        held as f64 / (1u64 << 30) as f64,
        room >> 20,
        stats.oom_retries,
        all.batch,
        stats.batch,
        stats.tile_shape
    );
    assert!(
        stats.oom_retries > 0,
        "the ballast left room for every tile at once"
    );
    assert!(stats.batch < all.batch);
    let d = max_diff(&got, &want);
    assert!(d < 1e-4, "backed-off run vs batch 1: {d}");
}

/// Canvases brought back through the page-locked staging buffers (`UPSCALE_CUDA_PINNED=1`)
/// are the device's values to the bit, for sizes below one buffer, of several buffers with
/// a partial last one (so both buffers are reused), and empty; a second download on the
/// same thread reuses the buffers.
#[test]
fn staged_downloads_bring_back_every_value() {
    use crate::tile::device::staged::{download, CHUNK};
    let dev = gpu();
    for n in [1000, 2 * CHUNK + CHUNK / 2 + 17, 0, 3 * CHUNK] {
        let host: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let t = Tensor::from_vec(host.clone(), n, &dev).unwrap();
        let got = download(&t).unwrap();
        assert_eq!(got.len(), n);
        let differ = got
            .iter()
            .zip(&host)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differ, 0, "{differ} of {n} values differ");
    }
}
