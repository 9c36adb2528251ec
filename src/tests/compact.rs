//! Real-ESRGAN Compact (SRVGGNetCompact): parity with the float64 reference (spandrel's
//! SRVGGNetCompact) on the committed fixtures in tests/golden/compact/ (written by
//! tests/golden/make_golden_esrgan.py), bf16 on the CPU, tiling, and what the loader reads.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device};

use super::fixtures::{
    assert_bf16_close, assert_every_fixture_matches, assert_tiles_blend_to_whole, manifest,
    max_abs_diff, on_each_cpu_path, TOLERANCE,
};
use crate::checkpoint::Checkpoint;
use crate::model::Model;
use crate::nets::compact::{Activation, CompactConfig};
use crate::nets::{config_of, NetConfig};

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/compact")
}

/// The LeakyReLU fixture: its file cannot say so, and is read as ReLU.
const LEAKY: &str = "compact_x1_leakyrelu";

fn f32_matches_float64_reference() {
    let want = ["x1", "x2", "x3", "x4", "PRelu", "Relu", "LeakyRelu"];
    assert_every_fixture_matches(&dir(), &want, |f| {
        let (name, cfg) = (f.name, f.config::<CompactConfig>().clone());
        assert_eq!(
            (cfg.scale, cfg.features, cfg.convs, cfg.channels),
            (f.n("scale"), f.n("features"), f.n("convs"), 3),
            "{name}"
        );
        let activation = match f.entry["activation"].as_str().unwrap() {
            "prelu" => Activation::PRelu,
            "relu" => Activation::Relu,
            _ => Activation::LeakyRelu,
        };
        if activation == Activation::LeakyRelu {
            // Read as ReLU, which is measurably not the reference: then set as it was made.
            assert_eq!(cfg.activation, Activation::Relu, "{name}");
            let relu = Model::load(f.weights, DType::F32, &Device::Cpu).unwrap();
            let d = max_abs_diff(&relu.net.forward(&f.input).unwrap(), &f.expected);
            assert!(d > 100.0 * TOLERANCE, "{name}: ReLU gave {d:.3e}");
            let mut c = cfg.clone();
            c.activation = Activation::LeakyRelu;
            f.checkpoint.config = Arc::new(c);
        } else {
            assert_eq!(cfg.activation, activation, "{name}");
        }
        vec![format!("x{}", cfg.scale), format!("{activation:?}")]
    });
}

on_each_cpu_path!(f32_matches_float64_reference =>
    compact_f32_matches_float64_reference_on_every_fixture,
    compact_f32_matches_float64_reference_on_every_fixture_capped_to_avx2);

/// The release layout of realesr-general-x4v3.pth: `{'params': ...}`, named in `info`.
#[test]
fn compact_params_is_read_and_described() {
    let ck = Checkpoint::load(&dir().join("compact_x4_prelu.pth")).unwrap();
    assert_eq!(ck.wrapper.as_deref(), Some("params"));
    assert_eq!(ck.config.family(), "Compact");
    let d = ck.config.describe();
    assert_eq!(d["activation"], "prelu");
    assert_eq!(
        (d["features"].as_u64(), d["convs"].as_u64()),
        (Some(8), Some(3))
    );
    let relu = Checkpoint::load(&dir().join("compact_x2_relu.safetensors")).unwrap();
    let text = relu.config.describe()["activation"].to_string();
    assert!(text.contains("relu (assumed"), "{text}");
}

/// bf16 on the CPU against the float64 reference, with the DRCT bounds, and not the f32
/// output; on a CPU without bf16 arithmetic, bf16 must be refused instead. The LeakyReLU
/// fixture is left out: its file is read as ReLU.
#[test]
fn compact_cpu_bf16_stays_close_to_the_float64_reference() {
    let cases: Vec<_> = manifest(&dir())
        .into_iter()
        .filter(|(c, _)| c.name != LEAKY)
        .map(|(c, _)| (c.name, c.weights, c.io))
        .collect();
    assert_bf16_close(&cases, 0.05, 45.0);
}

/// Hann-blended tiles against the whole image through the command line's path: at least
/// 45 dB.
#[test]
fn compact_tiles_blend_to_the_whole_image() {
    let runs = [
        ("compact_x4_prelu.pth", 64, 16),
        ("compact_x3_prelu.safetensors", 48, 12),
    ]
    .map(|(file, tile, overlap)| (dir().join(file), tile, overlap));
    assert_tiles_blend_to_whole((40, 100, 96, 112), &runs, 45.0);
}

/// The released configurations, rebuilt as shape lists, are read back as what they are, with
/// the parameter counts of the reference's module (realesr-general-x4v3 1,213,296;
/// realesr-animevideov3 621,424).
#[test]
fn released_compact_configurations_round_trip() {
    for (convs, params) in [(32, 1_213_296), (16, 621_424)] {
        let c = CompactConfig {
            channels: 3,
            features: 64,
            convs,
            activation: Activation::PRelu,
            scale: 4,
        };
        let shapes = c.expected_tensors().into_iter().collect();
        let back = crate::nets::registry::infer(&shapes).unwrap();
        assert_eq!(config_of::<CompactConfig>(&back), Some(&c));
        assert_eq!(c.parameter_count(), params);
    }
}

/// A 1-channel model loads and is refused when built, in one line; gaps and strays in
/// `body` are named.
#[test]
fn compact_other_channel_counts_and_broken_files() {
    let rgba = CompactConfig {
        channels: 4,
        features: 4,
        convs: 2,
        activation: Activation::PRelu,
        scale: 2,
    };
    let shapes: crate::nets::infer::Shapes = rgba.expected_tensors().into_iter().collect();
    let back = crate::nets::registry::infer(&shapes).unwrap();
    assert_eq!(config_of::<CompactConfig>(&back), Some(&rgba));
    let err = super::esrgan::build_zeros(&shapes)
        .err()
        .expect("not RGB: refused");
    let text = err.to_string();
    assert!(text.contains("only RGB (3) and greyscale (1)"), "{text}");
    assert_eq!(text.lines().count(), 1, "{text}");

    let c = CompactConfig {
        channels: 1,
        ..rgba
    };
    let shapes: crate::nets::infer::Shapes = c.expected_tensors().into_iter().collect();
    assert!(
        super::esrgan::build_zeros(&shapes).is_ok(),
        "greyscale: built"
    );

    let mut gap = shapes.clone();
    gap.insert("body.4000000000.weight".into(), vec![4, 4, 3, 3]);
    let e = crate::nets::registry::infer(&gap).unwrap_err().to_string();
    assert!(e.contains("missing tensor body.8.weight"), "{e}");
    let mut stray = shapes.clone();
    stray.insert("tail.weight".into(), vec![3]);
    let e = crate::nets::registry::infer(&stray)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unexpected tensor tail.weight"), "{e}");
    let mut half_prelu = shapes.clone();
    half_prelu.remove("body.3.weight");
    let e = crate::nets::registry::infer(&half_prelu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing tensor body.3.weight"), "{e}");
}
