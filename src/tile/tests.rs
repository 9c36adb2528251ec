//! Whole-pipeline checks with stand-in models that are pointwise, so any difference
//! between the tiled and the whole-image output is the tiler's fault.

use std::sync::Mutex;

use candle_core::{Device, Tensor};
use proptest::prelude::*;

use super::*;

/// Nearest-neighbour upsampling of `x * 0.7 + 0.1`.
pub(super) struct Pointwise {
    scale: usize,
    device: Device,
}

impl Pointwise {
    pub(super) fn new(scale: usize) -> Self {
        Self {
            scale,
            device: Device::Cpu,
        }
    }
}

impl TileModel for Pointwise {
    fn scale(&self) -> usize {
        self.scale
    }

    fn forward_batch(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (_, _, h, w) = x.dims4()?;
        x.affine(0.7, 0.1)?
            .upsample_nearest2d(h * self.scale, w * self.scale)
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// Fails like CUDA does when a batch holds more than `max_pixels` input pixels, and
/// records the shape of every call.
struct Limited {
    inner: Pointwise,
    max_pixels: usize,
    calls: Mutex<Vec<(usize, usize, usize)>>,
}

impl Limited {
    fn new(scale: usize, max_pixels: usize) -> Self {
        Self {
            inner: Pointwise::new(scale),
            max_pixels,
            calls: Mutex::new(Vec::new()),
        }
    }
}

impl TileModel for Limited {
    fn scale(&self) -> usize {
        self.inner.scale
    }

    fn forward_batch(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, _, h, w) = x.dims4()?;
        self.calls.lock().unwrap().push((b, h, w));
        if b * h * w > self.max_pixels {
            return Err(candle_core::Error::Msg(
                "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
            )
            .context("conv_last"));
        }
        self.inner.forward_batch(x)
    }

    fn device(&self) -> &Device {
        self.inner.device()
    }
}

pub(super) fn test_image(c: usize, h: usize, w: usize, seed: u64) -> Planar {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let data = (0..c * h * w)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect();
    Planar::new(c, h, w, data)
}

fn whole(model: &(impl TileModel + Sync), image: &Planar) -> Planar {
    let opts = TileOptions {
        tile: 0,
        ..TileOptions::default()
    };
    run_tiled(model, image, &opts).unwrap().0
}

pub(crate) fn max_diff(a: &Planar, b: &Planar) -> f32 {
    assert_eq!(
        (a.channels, a.height, a.width),
        (b.channels, b.height, b.width)
    );
    a.data
        .iter()
        .zip(&b.data)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub(super) fn opts_for(tile: usize, overlap: usize, batch: usize, blend: BlendMode) -> TileOptions {
    TileOptions {
        tile,
        overlap,
        batch,
        blend,
    }
}

/// Image sides, weighted towards the awkward ones.
pub(super) fn side() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(1),
        Just(2),
        Just(13),
        Just(31),
        Just(37),
        Just(53),
        1usize..=60
    ]
}

/// (tile, overlap) with overlap < tile, or the whole image.
pub(super) fn tiling() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        1 => (0usize..=40).prop_map(|o| (0, o)),
        6 => (1usize..=48).prop_flat_map(|t| (Just(t), 0..t)),
    ]
}

pub(super) fn mode() -> impl Strategy<Value = BlendMode> {
    prop_oneof![
        Just(BlendMode::Hann),
        Just(BlendMode::Average),
        Just(BlendMode::None)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn plan_covers_the_image_with_same_shape_tiles(
        h in side(), w in side(), (tile, overlap) in tiling()
    ) {
        let p = plan(h, w, tile, overlap).unwrap();
        let mut covered = vec![0u32; h * w];
        for t in &p.tiles {
            prop_assert_eq!((t.y.len, t.x.len), (p.tile_h, p.tile_w));
            prop_assert!(t.y.end() <= h && t.x.end() <= w);
            for y in t.y.start..t.y.end() {
                for x in t.x.start..t.x.end() {
                    covered[y * w + x] += 1;
                }
            }
        }
        prop_assert!(covered.iter().all(|&n| n > 0));
        if tile == 0 || (tile >= h && tile >= w) {
            prop_assert_eq!(p.tiles.len(), 1);
        }
    }

    #[test]
    fn weights_sum_positive_everywhere(
        h in side(), w in side(), (tile, overlap) in tiling(),
        scale in 1usize..=4, blend in mode()
    ) {
        let p = plan(h, w, tile, overlap).unwrap();
        let mut acc = Accumulator::new(1, h, w, scale, blend);
        let zeros = vec![0.0; p.tile_h * p.tile_w * scale * scale];
        for t in &p.tiles {
            acc.add(t, &zeros);
        }
        prop_assert!(acc.weight_sum().iter().all(|&s| s > 0.0));
    }

    #[test]
    fn tiled_output_equals_whole_image_output(
        c in 1usize..=3, h in side(), w in side(), (tile, overlap) in tiling(),
        batch in 1usize..=5, scale in 1usize..=4, blend in mode(), seed in any::<u64>()
    ) {
        let image = test_image(c, h, w, seed);
        let model = Pointwise::new(scale);
        let reference = whole(&model, &image);
        let (out, stats) = run_tiled(&model, &image, &opts_for(tile, overlap, batch, blend)).unwrap();
        prop_assert_eq!(stats.batches, stats.tiles.div_ceil(batch));
        if blend == BlendMode::None {
            prop_assert_eq!(&out, &reference);
        } else {
            // f32 sums drift with the number of tiles covering a pixel; up to half-tile
            // overlaps (at most 3 tiles per axis) that stays within 1e-6, but stride-1
            // tilings pile up dozens of tiles.
            let tol = if tile == 0 || 2 * overlap <= tile { 1e-6 } else { 1e-5 };
            let d = max_diff(&out, &reference);
            prop_assert!(d <= tol, "max difference {}", d);
        }
    }
}

/// A plan of one tile over the whole image skips the canvas: the values the accumulator
/// gives that tile (all its weights are 1), and only such plans take that way.
#[test]
fn a_whole_image_tile_is_the_upscaled_image() -> candle_core::Result<()> {
    let (c, h, w, s) = (3, 13, 37, 2);
    let image = test_image(c, h, w, 5);
    let model = Pointwise::new(s);
    for blend in [BlendMode::Hann, BlendMode::Average, BlendMode::None] {
        let (out, _) = run_tiled(&model, &image, &opts_for(0, 8, 1, blend)).unwrap();
        let p = plan(h, w, 0, 8).unwrap();
        assert!(p.is_whole());
        let x = Tensor::from_vec(image.data.clone(), (1, c, h, w), &Device::Cpu)?;
        let y = model.forward_batch(&x)?.flatten_all()?.to_vec1::<f32>()?;
        let mut acc = Accumulator::new(c, h, w, s, blend);
        acc.add(&p.tiles[0], &y);
        assert_eq!(acc.finish(), out, "{blend:?}");
    }
    assert!(plan(h, w, 64, 8).unwrap().is_whole());
    assert!(!plan(h, w, 16, 4).unwrap().is_whole());
    assert!(!plan(h, w, 13, 4).unwrap().is_whole());
    Ok(())
}

#[test]
fn groups_tiles_into_batches_with_a_ragged_last_one() {
    let model = Limited::new(2, usize::MAX);
    let image = test_image(3, 30, 30, 1);
    // Starts 0, 10, 18 on each axis: nine 12x12 tiles.
    let (_, stats) = run_tiled(&model, &image, &opts_for(12, 2, 4, BlendMode::Hann)).unwrap();
    assert_eq!((stats.tiles, stats.batches), (9, 3));
    assert_eq!(
        *model.calls.lock().unwrap(),
        vec![(4, 12, 12), (4, 12, 12), (1, 12, 12)]
    );
}

#[test]
fn out_of_memory_halves_the_batch() {
    let model = Limited::new(2, 2 * 24 * 24);
    let image = test_image(3, 64, 64, 2);
    // Starts 0, 20, 40 on each axis: nine 24x24 tiles.
    let (out, stats) = run_tiled(&model, &image, &opts_for(24, 4, 4, BlendMode::Hann)).unwrap();
    assert_eq!(
        stats,
        TileStats {
            tiles: 9,
            batches: 5,
            tile_shape: (24, 24),
            batch: 2,
            oom_retries: 1,
        }
    );
    assert!(max_diff(&out, &whole(&Pointwise::new(2), &image)) <= 1e-6);
}

#[test]
fn out_of_memory_at_batch_one_halves_the_tile() {
    let model = Limited::new(2, 300);
    let image = test_image(1, 64, 64, 3);
    let (out, stats) = run_tiled(&model, &image, &opts_for(24, 4, 2, BlendMode::Hann)).unwrap();
    // Batch 2 -> 1, then tile 24 -> 16 (the floor is 2 * overlap + 8).
    assert_eq!(
        (stats.tile_shape, stats.batch, stats.oom_retries),
        ((16, 16), 1, 2)
    );
    assert_eq!(stats.tiles, plan(64, 64, 16, 4).unwrap().tiles.len());
    assert!(max_diff(&out, &whole(&Pointwise::new(2), &image)) <= 1e-6);
}

#[test]
fn whole_image_falls_back_to_tiles() {
    let model = Limited::new(3, 40 * 40);
    let image = test_image(3, 50, 70, 4);
    let (out, stats) = run_tiled(&model, &image, &opts_for(0, 8, 1, BlendMode::Hann)).unwrap();
    // 70 -> 35 fits 35x35 = 1225 pixels.
    assert_eq!((stats.tile_shape, stats.oom_retries), ((35, 35), 1));
    assert!(max_diff(&out, &whole(&Pointwise::new(3), &image)) <= 1e-6);
}

#[test]
fn gives_up_when_the_smallest_tile_does_not_fit() {
    let model = Limited::new(2, 10);
    let image = test_image(1, 64, 64, 5);
    let err = run_tiled(&model, &image, &opts_for(24, 4, 1, BlendMode::Hann)).unwrap_err();
    assert!(matches!(err, super::TileError::OutOfMemory { .. }), "{err}");
}

#[test]
fn other_model_errors_pass_through() {
    struct Broken(Device);
    impl TileModel for Broken {
        fn scale(&self) -> usize {
            2
        }
        fn forward_batch(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            // Wrong output shape.
            Ok(x.clone())
        }
        fn device(&self) -> &Device {
            &self.0
        }
    }
    let image = test_image(1, 8, 8, 6);
    let err = run_tiled(
        &Broken(Device::Cpu),
        &image,
        &opts_for(0, 4, 1, BlendMode::Hann),
    );
    assert!(err.unwrap_err().to_string().contains("shape"));
}

#[test]
fn recognises_out_of_memory_errors() {
    let oom = candle_core::Error::Msg("CUDA_ERROR_OUT_OF_MEMORY".into()).context("matmul");
    assert!(is_out_of_memory(&oom));
    assert!(!is_out_of_memory(&candle_core::Error::Msg(
        "shape mismatch".into()
    )));
}

#[test]
fn rejects_overlap_not_smaller_than_tile() {
    let image = test_image(1, 64, 64, 7);
    let err = run_tiled(
        &Pointwise::new(2),
        &image,
        &opts_for(16, 16, 1, BlendMode::Hann),
    );
    assert!(err.unwrap_err().to_string().contains("overlap"));
}
