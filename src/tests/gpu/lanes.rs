//! Lanes and the blend kernel on a GPU: two lanes on cuda:0 against one lane and against the
//! CPU on a real fixture model, and the CUDA canvas against the host accumulator.

use super::gpu;
use crate::engine::lanes::{pool_peak, Lanes};
use crate::engine::{DeviceChoice, Engine};
use crate::model::Checkpoint;
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
        (DType::F32, crate::model::fused::Attention::Fused),
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
