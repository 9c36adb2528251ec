//! SPAN: parity with the float64 reference (spandrel's SPAN) on the committed fixtures in
//! tests/golden/span/ (written by tests/golden/make_golden_span.py), bf16 on the CPU, tiling,
//! and what the loader reads from the files.

use std::path::PathBuf;

use super::fixtures::{
    assert_bf16_close_in, assert_every_fixture_matches, assert_tiles_blend_to_whole,
    on_each_cpu_path,
};
use crate::checkpoint::Checkpoint;
use crate::nets::span::SpanConfig;
use crate::nets::{config_of, NetConfig};

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/span")
}

/// Every fixture read as the configuration it was made with, and within the f32 bound of
/// the reference. The files' `eval_conv` tensors are random (the reference folds its three
/// branches again on every forward): reading them instead of folding is off by 1e11.
fn f32_matches_float64_reference() {
    let want = [
        "x1",
        "x2",
        "x3",
        "x4",
        "norm true",
        "norm false",
        "safetensors",
        "pth-plain",
        "pth-params",
        "pth-ema",
    ];
    assert_every_fixture_matches(&dir(), &want, |f| {
        let (name, cfg) = (f.name, f.config::<SpanConfig>());
        let norm = f.b("norm");
        assert_eq!(
            (
                cfg.scale,
                cfg.features,
                cfg.norm,
                cfg.in_channels,
                cfg.out_channels
            ),
            (f.n("scale"), f.n("features"), norm, 3, 3),
            "{name}"
        );
        vec![format!("x{}", cfg.scale), format!("norm {norm}")]
    });
}

on_each_cpu_path!(f32_matches_float64_reference =>
    span_f32_matches_float64_reference_on_every_fixture,
    span_f32_matches_float64_reference_on_every_fixture_capped_to_avx2);

/// `{'params_ema': ...}` in a `.pth` (traiNNer's release layout), named in `info`.
#[test]
fn span_params_ema_is_read_and_described() {
    let ck = Checkpoint::load(&dir().join("span_x4_norm.pth")).unwrap();
    assert_eq!(ck.wrapper.as_deref(), Some("params_ema"));
    assert_eq!(ck.config.family(), "SPAN");
    let d = ck.config.describe();
    assert_eq!(d["input_norm"], true);
    assert_eq!(
        (d["features"].as_u64(), d["scale"].as_u64()),
        (Some(4), Some(4))
    );
    let plain = Checkpoint::load(&dir().join("span_x2_no_norm.safetensors")).unwrap();
    assert_eq!(plain.config.describe()["input_norm"], false);
    assert!(plain.config.variant().contains("no input normalisation"));
}

/// bf16 on the CPU against the float64 reference, with the DRCT bounds, and not the f32
/// output; on a CPU without bf16 arithmetic, bf16 must be refused instead.
#[test]
fn span_cpu_bf16_stays_close_to_the_float64_reference() {
    assert_bf16_close_in(&dir(), 0.05, 45.0);
}

/// Hann-blended tiles against the whole image through the command line's path: at least
/// 45 dB, with and without input normalisation.
#[test]
fn span_tiles_blend_to_the_whole_image() {
    let runs = [
        ("span_x4_norm.pth", 64, 16),
        ("span_x2_no_norm.safetensors", 48, 12),
    ]
    .map(|(file, tile, overlap)| (dir().join(file), tile, overlap));
    assert_tiles_blend_to_whole((40, 100, 96, 112), &runs, 45.0);
}

/// The released configuration (48 features, x4), rebuilt as a shape list with and without
/// normalisation, is read back as what it is; the parameter count is the folded network's
/// (the reference module's 2x2x1x1+3x3+... training branches are not counted); x1-x4
/// read their scale from the upsampler.
#[test]
fn released_span_configurations_round_trip() {
    for scale in 1..=4 {
        for norm in [true, false] {
            let c = SpanConfig {
                in_channels: 3,
                out_channels: 3,
                features: 48,
                scale,
                norm,
            };
            let shapes = c.expected_tensors().into_iter().collect();
            let back = crate::nets::registry::infer(&shapes).unwrap();
            assert_eq!(config_of::<SpanConfig>(&back), Some(&c));
        }
    }
    let x4 = SpanConfig {
        in_channels: 3,
        out_channels: 3,
        features: 48,
        scale: 4,
        norm: true,
    };
    // 20 folded 3x3 convolutions (the first from 3 channels), the 1x1 over 4x48 and the
    // upsampler to 48 channels: 411,024 (+ 9,264 + 20,784 ... counted by hand below).
    let folded = (48 * 3 * 9 + 48) + 19 * (48 * 48 * 9 + 48);
    assert_eq!(
        x4.parameter_count(),
        folded + (192 * 48 + 48) + (48 * 48 * 9 + 48)
    );
}

/// A greyscale model builds without input normalisation and is refused with it (the
/// reference's RGB mean makes three channels of its one), in one line; so is a 4-channel
/// one; a missing block and a stray tensor are named.
#[test]
fn span_other_channel_counts_and_broken_files() {
    let c = SpanConfig {
        in_channels: 1,
        out_channels: 1,
        features: 4,
        scale: 2,
        norm: false,
    };
    let shapes: crate::nets::infer::Shapes = c.expected_tensors().into_iter().collect();
    let back = crate::nets::registry::infer(&shapes).unwrap();
    assert_eq!(config_of::<SpanConfig>(&back), Some(&c));
    assert!(back.describe()["input_norm"] == false);
    assert!(back.greyscale());
    assert!(
        super::esrgan::build_zeros(&shapes).is_ok(),
        "greyscale: built"
    );
    let normalised = SpanConfig { norm: true, ..c };
    let rgba = SpanConfig {
        in_channels: 4,
        out_channels: 4,
        ..c
    };
    for (cfg, needle) in [
        (
            normalised,
            "a greyscale SPAN model that normalises by the RGB mean",
        ),
        (rgba, "only RGB (3) and greyscale (1) models run"),
    ] {
        let shapes: crate::nets::infer::Shapes = cfg.expected_tensors().into_iter().collect();
        let err = super::esrgan::build_zeros(&shapes).err().expect("refused");
        let text = err.to_string();
        assert!(text.contains(needle), "{text}");
        assert_eq!(text.lines().count(), 1, "{text}");
    }

    let mut missing = shapes.clone();
    missing.retain(|k, _| !k.starts_with("block_6."));
    let e = crate::nets::registry::infer(&missing)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing tensor block_6.c1_r.sk.weight"), "{e}");
    let mut extra = shapes.clone();
    extra.insert("block_7.c1_r.sk.weight".into(), vec![4, 4, 1, 1]);
    let e = crate::nets::registry::infer(&extra)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unexpected tensor block_7.c1_r.sk.weight"),
        "{e}"
    );
    let mut odd = shapes.clone();
    odd.insert("upsampler.0.weight".into(), vec![7, 4, 3, 3]);
    let e = crate::nets::registry::infer(&odd).unwrap_err().to_string();
    assert!(e.contains("upsampler.0.weight"), "{e}");
}
