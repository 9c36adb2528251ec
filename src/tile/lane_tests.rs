//! Lanes against the single-lane host path, with pointwise stand-in models on the CPU
//! device: the device canvas, the shared queue and the out-of-memory handling are all
//! exercised exactly as on a GPU, only the arithmetic runs on the CPU.

use std::sync::Mutex;
use std::time::Duration;

use candle_core::{Device, Tensor};
use proptest::prelude::*;

use super::tests::{max_diff, mode, opts_for, side, test_image, tiling, Pointwise};
use super::*;

fn bits_equal(a: &Planar, b: &Planar) -> bool {
    (a.channels, a.height, a.width) == (b.channels, b.height, b.width)
        && a.data
            .iter()
            .zip(&b.data)
            .all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Checks that lane stats add up to the run's.
fn check_stats(stats: &TileStats, lanes: &[LaneStats], count: usize) {
    assert_eq!(lanes.len(), count);
    assert_eq!(lanes.iter().map(|l| l.tiles).sum::<usize>(), stats.tiles);
    assert_eq!(
        lanes.iter().map(|l| l.batches).sum::<usize>(),
        stats.batches
    );
    for (i, l) in lanes.iter().enumerate() {
        assert_eq!((l.lane, l.device.as_str()), (i, "cpu"));
        assert!(l.busy_seconds >= 0.0);
        // A lane that ran batches set up an image and brought a canvas back.
        assert_eq!(l.transfer_seconds > 0.0, l.batches > 0, "{l:?}");
        assert!(l.transfer_overlap_seconds <= l.transfer_seconds, "{l:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn lanes_match_the_host_accumulator(
        c in 1usize..=3, h in side(), w in side(), (tile, overlap) in tiling(),
        batch in 1usize..=5, scale in 1usize..=4, blend in mode(), seed in any::<u64>()
    ) {
        let image = test_image(c, h, w, seed);
        let opts = opts_for(tile, overlap, batch, blend);
        let model = Pointwise::new(scale);
        let (host, host_stats) = run_tiled(&model, &image, &opts).unwrap();

        // One lane adds the same tiles in the same order: bit for bit.
        let (one, stats, lanes) = run_lanes(std::slice::from_ref(&model), &image, &opts, Canvas::Device).unwrap();
        prop_assert!(bits_equal(&one, &host));
        prop_assert_eq!(&stats, &host_stats);
        check_stats(&stats, &lanes, 1);

        // Two lanes sum two canvases: crop-and-paste stays exact, blends within rounding.
        let two_models = [Pointwise::new(scale), Pointwise::new(scale)];
        let (two, stats, lanes) = run_lanes(&two_models, &image, &opts, Canvas::Device).unwrap();
        prop_assert_eq!(stats.tiles, host_stats.tiles);
        prop_assert_eq!(stats.batches, host_stats.batches);
        check_stats(&stats, &lanes, 2);
        if blend == BlendMode::None {
            prop_assert!(bits_equal(&two, &host));
        } else {
            let tol = if tile == 0 || 2 * overlap <= tile { 1e-6 } else { 1e-5 };
            let d = max_diff(&two, &host);
            prop_assert!(d <= tol, "max difference {}", d);
        }

        // Canvases left on their devices and finished later: one lane gives the same image
        // bit for bit; two (whose split of the tiles varies) the host's within rounding.
        let one_lane = std::slice::from_ref(&model);
        for (models, exact) in [(one_lane, true), (&two_models[..], blend == BlendMode::None)] {
            let (pending, stats, lanes) =
                lanes::run_lanes_unfinished(models, &image, &opts, Canvas::Device, true).unwrap();
            let got = pending.finish().unwrap();
            if exact {
                prop_assert!(bits_equal(&got, &host));
            } else {
                let d = max_diff(&got, &host);
                prop_assert!(d <= 1e-5, "deferred, max difference {}", d);
            }
            prop_assert_eq!(stats.tiles, host_stats.tiles);
            prop_assert_eq!(lanes.len(), models.len());
        }
    }
}

/// A pointwise model that records the top-left input value of every tile it runs, and can
/// be slowed down (so several lanes get work) or run out of memory above a batch size.
struct Recording {
    inner: Pointwise,
    delay: Duration,
    max_batch: usize,
    seen: Mutex<Vec<f32>>,
}

impl Recording {
    fn new(scale: usize, delay_ms: u64, max_batch: usize) -> Self {
        Self {
            inner: Pointwise::new(scale),
            delay: Duration::from_millis(delay_ms),
            max_batch,
            seen: Mutex::new(Vec::new()),
        }
    }

    fn seen(&self) -> Vec<f32> {
        self.seen.lock().unwrap().clone()
    }
}

impl TileModel for Recording {
    fn scale(&self) -> usize {
        self.inner.scale()
    }

    fn forward_batch(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let b = x.dim(0)?;
        if b > self.max_batch {
            return Err(candle_core::Error::Msg("CUDA_ERROR_OUT_OF_MEMORY".into()));
        }
        std::thread::sleep(self.delay);
        for i in 0..b {
            let corner = x.get(i)?.get(0)?.get(0)?.get(0)?.to_scalar::<f32>()?;
            self.seen.lock().unwrap().push(corner);
        }
        self.inner.forward_batch(x)
    }

    fn device(&self) -> &Device {
        self.inner.device()
    }
}

/// A one-channel image whose value is the pixel's index, so a tile's top-left value says
/// which tile it is.
fn index_image(h: usize, w: usize) -> Planar {
    Planar::new(1, h, w, (0..h * w).map(|i| i as f32).collect())
}

fn corners(plan: &Plan, w: usize) -> Vec<f32> {
    let mut c: Vec<f32> = plan
        .tiles
        .iter()
        .map(|t| (t.y.start * w + t.x.start) as f32)
        .collect();
    c.sort_by(f32::total_cmp);
    c
}

fn sorted(mut v: Vec<f32>) -> Vec<f32> {
    v.sort_by(f32::total_cmp);
    v
}

#[test]
fn every_tile_runs_exactly_once_across_lanes() {
    let (h, w) = (70, 90);
    let image = index_image(h, w);
    let opts = opts_for(16, 4, 2, BlendMode::Hann);
    let lanes = [Recording::new(2, 5, 16), Recording::new(2, 5, 16)];
    let (out, stats, lane_stats) = run_lanes(&lanes, &image, &opts, Canvas::Device).unwrap();
    let plan = plan(h, w, 16, 4).unwrap();
    let all = sorted([lanes[0].seen(), lanes[1].seen()].concat());
    assert_eq!(all, corners(&plan, w));
    check_stats(&stats, &lane_stats, 2);
    for (model, s) in lanes.iter().zip(&lane_stats) {
        assert_eq!(model.seen().len(), s.tiles);
        // Batches take 5 ms, so neither lane can take them all.
        assert!(s.batches > 0, "{lane_stats:?}");
    }
    let (reference, _) = run_tiled(&Pointwise::new(2), &image, &opts).unwrap();
    assert!(max_diff(&out, &reference) <= 1e-6 * 8100.0);
}

#[test]
fn a_lane_out_of_memory_hands_its_tiles_back() {
    let (h, w) = (64, 64);
    let image = index_image(h, w);
    let opts = opts_for(24, 4, 4, BlendMode::Average);
    // Lane 1 fails any batch over 2 tiles; its tiles go back and the batch halves.
    let lanes = [Recording::new(2, 20, 16), Recording::new(2, 2, 2)];
    let (out, stats, lane_stats) = run_lanes(&lanes, &image, &opts, Canvas::Device).unwrap();
    let plan = plan(h, w, 24, 4).unwrap();
    let all = sorted([lanes[0].seen(), lanes[1].seen()].concat());
    assert_eq!(all, corners(&plan, w));
    assert!(stats.oom_retries >= 1);
    assert_eq!(stats.batch, 2);
    check_stats(&stats, &lane_stats, 2);
    let (reference, _) = run_tiled(&Pointwise::new(2), &image, &opts).unwrap();
    assert!(max_diff(&out, &reference) <= 1e-6 * 4096.0);
}

#[test]
fn one_lane_out_of_memory_keeps_the_host_order() {
    let image = test_image(3, 64, 64, 9);
    let opts = opts_for(24, 4, 4, BlendMode::Hann);
    let model = Recording::new(2, 0, 2);
    let (out, stats, _) =
        run_lanes(std::slice::from_ref(&model), &image, &opts, Canvas::Device).unwrap();
    // The same batches as the host path after its back-off: nine tiles, 4 -> 2.
    assert_eq!((stats.batches, stats.batch, stats.oom_retries), (5, 2, 1));
    let (reference, _) = run_tiled(&Pointwise::new(2), &image, &opts).unwrap();
    assert!(bits_equal(&out, &reference));
}

#[test]
fn lanes_shrink_the_tile_when_one_tile_does_not_fit() {
    /// Fails on tiles over `max` pixels, whatever the batch.
    struct Small(Pointwise, usize);
    impl TileModel for Small {
        fn scale(&self) -> usize {
            self.0.scale()
        }
        fn forward_batch(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            let (_, _, h, w) = x.dims4()?;
            if h * w > self.1 {
                return Err(candle_core::Error::Msg("out of memory".into()));
            }
            self.0.forward_batch(x)
        }
        fn device(&self) -> &Device {
            self.0.device()
        }
    }
    let image = test_image(2, 50, 70, 4);
    let lanes = [
        Small(Pointwise::new(3), 40 * 40),
        Small(Pointwise::new(3), 40 * 40),
    ];
    let opts = opts_for(0, 8, 1, BlendMode::Hann);
    let (out, stats, lane_stats) = run_lanes(&lanes, &image, &opts, Canvas::Device).unwrap();
    assert_eq!(stats.tile_shape, (35, 35));
    check_stats(&stats, &lane_stats, 2);
    let (reference, _) = run_tiled(&Pointwise::new(3), &image, &opts).unwrap();
    assert!(max_diff(&out, &reference) <= 1e-6);

    let tiny = [Small(Pointwise::new(3), 10), Small(Pointwise::new(3), 10)];
    let err = run_lanes(
        &tiny,
        &image,
        &opts_for(24, 4, 1, BlendMode::Hann),
        Canvas::Device,
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("out of memory"), "{err:#}");
}

#[test]
fn a_failing_lane_fails_the_image() {
    struct Broken(Device);
    impl TileModel for Broken {
        fn scale(&self) -> usize {
            2
        }
        fn forward_batch(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            Ok(x.clone())
        }
        fn device(&self) -> &Device {
            &self.0
        }
    }
    let image = test_image(1, 40, 40, 6);
    let lanes = [Broken(Device::Cpu), Broken(Device::Cpu)];
    let err = run_lanes(
        &lanes,
        &image,
        &opts_for(16, 4, 1, BlendMode::Hann),
        Canvas::Device,
    )
    .unwrap_err();
    assert!(err.to_string().contains("shape"), "{err:#}");
    let none: [Broken; 0] = [];
    assert!(run_lanes(
        &none,
        &image,
        &opts_for(16, 4, 1, BlendMode::Hann),
        Canvas::Device
    )
    .is_err());
}

#[test]
fn lane_stats_merge_by_lane() {
    let a = |lane, tiles| LaneStats {
        lane,
        device: "cpu".into(),
        batches: 1,
        tiles,
        busy_seconds: 0.5,
        transfer_seconds: 0.25,
        transfer_overlap_seconds: 0.125,
    };
    let mut total = vec![a(1, 3)];
    LaneStats::merge(&mut total, &[a(0, 2), a(1, 4)]);
    assert_eq!(total.len(), 2);
    assert_eq!((total[0].lane, total[0].tiles), (0, 2));
    assert_eq!((total[1].lane, total[1].tiles, total[1].batches), (1, 7, 2));
    assert_eq!(total[1].busy_seconds, 1.0);
    assert_eq!(
        (total[1].transfer_seconds, total[1].transfer_overlap_seconds),
        (0.5, 0.25)
    );
}
