//! Lanes on a real model, on the CPU: two lanes (each its own engine and weights) against
//! one, and the device-canvas path against the host accumulator.

use candle_core::{DType, Device};

use crate::checkpoint::Checkpoint;
use crate::engine::lanes::Lanes;
use crate::engine::Engine;
use crate::planar::Planar;
use crate::tile::tests::max_diff;
use crate::tile::{run_lanes, BlendMode, Canvas, TileOptions};

fn engine() -> Engine {
    let ck = Checkpoint::load(&super::golden(super::FAST_MODEL)).unwrap();
    Engine::new(ck, Device::Cpu, DType::F32).unwrap()
}

fn opts(blend: BlendMode) -> TileOptions {
    TileOptions {
        tile: 16,
        overlap: 4,
        batch: 3,
        blend,
    }
}

fn bits(p: &Planar) -> Vec<u32> {
    p.data.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn two_lanes_match_one_on_a_real_model() {
    let image = crate::engine::probe::pattern(37, 45);
    let single = Lanes::single(engine());
    let two = Lanes::from_engines(vec![engine(), engine()]).unwrap();
    assert_eq!((two.count(), two.per_device()), (2, 2));
    for blend in [BlendMode::Hann, BlendMode::Average, BlendMode::None] {
        let (host, host_stats, host_lanes) = single.run(&image, &opts(blend)).unwrap();
        assert_eq!(host_lanes.len(), 1);
        assert_eq!(host_lanes[0].tiles, host_stats.tiles);

        // One lane through the device canvas: the same sums in the same order.
        let (one, _, _) =
            run_lanes(single.engines(), &image, &opts(blend), Canvas::Device).unwrap();
        assert_eq!(bits(&one), bits(&host), "{blend:?}");

        let (out, stats, lanes) = two.run(&image, &opts(blend)).unwrap();
        assert_eq!(
            (stats.tiles, stats.batches),
            (host_stats.tiles, host_stats.batches)
        );
        assert_eq!(lanes.len(), 2);
        assert_eq!(lanes.iter().map(|l| l.tiles).sum::<usize>(), stats.tiles);
        assert_eq!(
            lanes.iter().map(|l| l.batches).sum::<usize>(),
            stats.batches
        );
        if blend == BlendMode::None {
            assert_eq!(bits(&out), bits(&host));
        } else {
            let d = max_diff(&out, &host);
            assert!(d <= 1e-6, "{blend:?}: {d}");
        }
    }
}
