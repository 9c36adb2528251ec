//! ESRGAN (RRDBNet): parity with the float64 reference (spandrel's RRDBNet) on the committed
//! fixtures in tests/golden/esrgan/ (written by tests/golden/make_golden_esrgan.py), bf16 on
//! the CPU, tiling, and what the loader reads from the files.

use std::path::PathBuf;

use candle_core::{DType, Device};

use super::fixtures::{
    assert_bf16_close_in, assert_every_fixture_matches, assert_tiles_blend_to_whole,
    on_each_cpu_path,
};
use crate::checkpoint::Checkpoint;
use crate::model::Model;
use crate::nets::esrgan::{EsrganConfig, Layout};
use crate::nets::{config_of, NetConfig};

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/esrgan")
}

/// The configuration each manifest entry was generated with.
fn expected(entry: &serde_json::Value) -> (Layout, [usize; 5]) {
    let n = |k: &str| entry[k].as_u64().unwrap() as usize;
    let layout = match entry["layout"].as_str().unwrap() {
        "old" => Layout::Old,
        "real" => Layout::RealEsrgan,
        "trunk" => Layout::Trunk,
        other => panic!("layout {other}"),
    };
    let fields = [
        n("scale"),
        n("filters"),
        n("growth"),
        n("blocks"),
        n("unshuffle"),
    ];
    (layout, fields)
}

fn f32_matches_float64_reference() {
    let want = ["x1", "x2", "x4", "x8", "Old", "RealEsrgan", "Trunk"];
    assert_every_fixture_matches(&dir(), &want, |f| {
        let (name, cfg) = (f.name, f.config::<EsrganConfig>());
        let (layout, [scale, filters, growth, blocks, unshuffle]) = expected(f.entry);
        assert_eq!(cfg.layout, layout, "{name}");
        assert_eq!(
            (
                cfg.scale,
                cfg.filters,
                cfg.growth,
                cfg.blocks,
                cfg.unshuffle
            ),
            (scale, filters, growth, blocks, unshuffle),
            "{name}"
        );
        assert_eq!((cfg.in_channels, cfg.out_channels), (3, 3), "{name}");
        vec![format!("x{scale}"), format!("{layout:?}")]
    });
}

on_each_cpu_path!(f32_matches_float64_reference =>
    esrgan_f32_matches_float64_reference_on_every_fixture,
    esrgan_f32_matches_float64_reference_on_every_fixture_capped_to_avx2);

/// The Real-ESRGAN release layout: `{'params_ema': ...}` in a `.pth`, named in `info`.
#[test]
fn esrgan_params_ema_is_read_and_described() {
    let ck = Checkpoint::load(&dir().join("esrgan_x4_real.pth")).unwrap();
    assert_eq!(ck.wrapper.as_deref(), Some("params_ema"));
    assert_eq!(ck.config.family(), "ESRGAN");
    assert_eq!(ck.config.variant(), "Real-ESRGAN (RRDBNet)");
    let d = ck.config.describe();
    assert_eq!(d["layout"], "real-esrgan");
    assert_eq!(d["blocks"], 1);
    assert_eq!(d["growth"], 6);
}

/// bf16 on the CPU against the float64 reference, with the DRCT bounds, and not the f32
/// output; on a CPU without bf16 arithmetic, bf16 must be refused instead.
#[test]
fn esrgan_cpu_bf16_stays_close_to_the_float64_reference() {
    assert_bf16_close_in(&dir(), 0.05, 45.0);
}

/// Hann-blended tiles against the whole image through the command line's path: at least
/// 45 dB, for a plain x4 model and one that unshuffles its input.
#[test]
fn esrgan_tiles_blend_to_the_whole_image() {
    let runs = [
        ("esrgan_x4_real.pth", 64, 16),
        ("esrgan_x2_unshuffle.safetensors", 64, 16),
    ]
    .map(|(file, tile, overlap)| (dir().join(file), tile, overlap));
    assert_tiles_blend_to_whole((40, 100, 96, 112), &runs, 45.0);
}

/// The released configurations, rebuilt as shape lists in each layout, are read back as
/// what they are, with the parameter counts of the reference's modules
/// (RealESRGAN_x4plus 16,697,987; RealESRGAN_x2plus 16,703,171; the 6-block anime model
/// 4,467,779), and an x8 old-arch model reads as x8.
#[test]
fn released_esrgan_configurations_round_trip() {
    let cfg = |layout, blocks, upsamples, unshuffle, scale| EsrganConfig {
        layout,
        in_channels: 3,
        out_channels: 3,
        filters: 64,
        growth: 32,
        blocks,
        upsamples,
        unshuffle,
        scale,
    };
    for (c, params) in [
        (cfg(Layout::RealEsrgan, 23, 2, 1, 4), Some(16_697_987)),
        (cfg(Layout::RealEsrgan, 23, 2, 2, 2), Some(16_703_171)),
        (cfg(Layout::RealEsrgan, 23, 2, 4, 1), None),
        (cfg(Layout::RealEsrgan, 6, 2, 1, 4), Some(4_467_779)),
        (cfg(Layout::Old, 23, 2, 1, 4), Some(16_697_987)),
        (cfg(Layout::Old, 23, 3, 1, 8), None),
        (cfg(Layout::Old, 23, 1, 1, 2), None),
        (cfg(Layout::Trunk, 23, 2, 1, 4), Some(16_697_987)),
    ] {
        let shapes = c.expected_tensors().into_iter().collect();
        let back = crate::nets::registry::infer(&shapes).unwrap();
        assert_eq!(config_of::<EsrganConfig>(&back), Some(&c.clone()));
        if let Some(p) = params {
            assert_eq!(c.parameter_count(), p, "{c:?}");
        }
    }
}

/// 1- and 4-channel models load (`info` describes them); greyscale ones (1 and 1) build, the
/// others are refused when built, with one line that says why; a file missing one tensor, or
/// with one too many, names it.
#[test]
fn esrgan_other_channel_counts_and_broken_files() {
    let mut c = EsrganConfig {
        layout: Layout::Old,
        in_channels: 1,
        out_channels: 1,
        filters: 8,
        growth: 4,
        blocks: 1,
        upsamples: 2,
        unshuffle: 1,
        scale: 4,
    };
    for (channels, unshuffle, scale) in [(1, 1, 4), (4, 1, 4), (1, 2, 2)] {
        c.in_channels = channels;
        c.out_channels = channels;
        c.unshuffle = unshuffle;
        c.scale = scale;
        let shapes: crate::nets::infer::Shapes = c.expected_tensors().into_iter().collect();
        let back = crate::nets::registry::infer(&shapes).unwrap();
        assert_eq!(config_of::<EsrganConfig>(&back), Some(&c.clone()));
        if channels == 1 {
            assert!(back.greyscale());
            assert!(build_zeros(&shapes).is_ok(), "greyscale: built");
            continue;
        }
        let err = build_zeros(&shapes).err().expect("not RGB: refused");
        let text = err.to_string();
        assert!(text.contains("only RGB (3 and 3) and greyscale"), "{text}");
        assert_eq!(text.lines().count(), 1, "{text}");
    }
    c.in_channels = 3;
    c.out_channels = 3;
    let shapes: crate::nets::infer::Shapes = c.expected_tensors().into_iter().collect();
    let mut missing = shapes.clone();
    missing.remove("model.1.sub.0.RDB2.conv3.0.bias");
    let e = crate::nets::registry::infer(&missing)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("missing tensor model.1.sub.0.RDB2.conv3.0.bias"),
        "{e}"
    );
    let mut extra = shapes.clone();
    extra.insert("model.1.sub.0.RDB1.conv1x1.weight".into(), vec![8, 8, 1, 1]);
    let e = crate::nets::registry::infer(&extra)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unexpected tensor model.1.sub.0.RDB1.conv1x1.weight"),
        "{e}"
    );
    // x2 by its one upsampling step, but 16x the output's channels in: unshuffled by 4.
    c.upsamples = 1;
    c.scale = 2;
    let mut shrinking: crate::nets::infer::Shapes = c.expected_tensors().into_iter().collect();
    shrinking.insert("model.0.weight".into(), vec![8, 48, 3, 3]);
    let e = crate::nets::registry::infer(&shrinking)
        .unwrap_err()
        .to_string();
    assert!(e.contains("shrink"), "{e}");
}

/// A checkpoint of zeros with these shapes, built on the CPU.
pub(crate) fn build_zeros(
    shapes: &crate::nets::infer::Shapes,
) -> Result<Model, crate::checkpoint::ModelError> {
    let config = crate::nets::registry::infer(shapes).unwrap();
    let tensors = shapes
        .iter()
        .map(|(k, s)| {
            let t = candle_core::Tensor::zeros(s.as_slice(), DType::F32, &Device::Cpu);
            (k.clone(), t.unwrap())
        })
        .collect();
    let ck = Checkpoint {
        source: crate::checkpoint::Source::Embedded("zeros"),
        config,
        tensors,
        metadata: Default::default(),
        wrapper: None,
    };
    Model::from_checkpoint(ck, DType::F32, &Device::Cpu)
}
