//! SAFMN: parity with the float64 reference (spandrel's SAFMN, run as its model descriptor
//! runs it) on the committed fixtures in tests/golden/safmn/ (written by
//! tests/golden/make_golden_safmn.py), bf16 on the CPU, tiling, and what the loader reads.

use std::path::PathBuf;

use super::fixtures::{
    assert_bf16_close_in, assert_every_fixture_matches, assert_tiles_blend_to_whole,
    on_each_cpu_path,
};
use crate::checkpoint::Checkpoint;
use crate::nets::safmn::SafmnConfig;

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/safmn")
}

/// Every fixture read as the configuration it was made with, and within the f32 bound of
/// the reference; with no vector kernels the depthwise convolutions run on candle's
/// operations.
fn f32_matches_float64_reference() {
    let want = [
        "x1",
        "x2",
        "x3",
        "x4",
        "padded true",
        "padded false",
        "safetensors",
        "pth-plain",
        "pth-params",
        "pth-ema",
    ];
    assert_every_fixture_matches(&dir(), &want, |f| {
        let (name, cfg) = (f.name, f.config::<SafmnConfig>());
        assert_eq!(
            (cfg.scale, cfg.dim, cfg.blocks, cfg.hidden),
            (f.n("scale"), f.n("dim"), f.n("blocks"), f.n("hidden")),
            "{name}"
        );
        let (_, _, h, w) = f.input.dims4().unwrap();
        let padded = h % 8 != 0 || w % 8 != 0;
        vec![format!("x{}", cfg.scale), format!("padded {padded}")]
    });
}

on_each_cpu_path!(f32_matches_float64_reference =>
    safmn_f32_matches_float64_reference_on_every_fixture,
    safmn_f32_matches_float64_reference_on_every_fixture_capped_to_avx2,
    safmn_f32_matches_float64_reference_on_candles_operations);

/// bf16 on the CPU against the float64 reference, with the other families' bounds; on a CPU
/// without bf16 arithmetic, bf16 must be refused instead.
#[test]
fn safmn_cpu_bf16_stays_close_to_the_float64_reference() {
    assert_bf16_close_in(&dir(), 0.05, 45.0);
}

/// Hann-blended tiles against the whole image through the command line's path: every layer
/// sees at most the coarsest level's neighbourhood (8x8 blocks pooled, then a 3x3 over
/// them), so tiles with a wide overlap agree with the whole image.
#[test]
fn safmn_tiles_blend_to_the_whole_image() {
    let files = [("safmn_x4.safetensors", 64, 32)]
        .map(|(file, tile, overlap)| (dir().join(file), tile, overlap));
    assert_tiles_blend_to_whole((40, 100, 96, 112), &files, 45.0);
}

/// `info`'s fields; a missing level convolution and a width that is no multiple of four
/// named.
#[test]
fn safmn_is_described_and_broken_files_are_named() {
    let ck = Checkpoint::load(&dir().join("safmn_x2_ema.pth")).unwrap();
    assert_eq!(ck.wrapper.as_deref(), Some("params_ema"));
    assert_eq!(ck.config.family(), "SAFMN");
    assert_eq!(ck.config.window(), 8);
    let d = ck.config.describe();
    assert_eq!(
        (
            d["dim"].as_u64(),
            d["blocks"].as_u64(),
            d["hidden"].as_u64()
        ),
        (Some(8), Some(1), Some(12))
    );
    let shapes: crate::nets::infer::Shapes = ck
        .tensors
        .names()
        .map(|k| (k.to_string(), ck.tensors.dims(k).unwrap().to_vec()))
        .collect();
    let mut missing = shapes.clone();
    missing.remove("feats.0.safm.mfr.3.bias");
    let e = crate::nets::registry::infer(&missing)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("SAFMN checkpoint: missing tensor feats.0.safm.mfr.3.bias"),
        "{e}"
    );
    let mut odd = shapes.clone();
    odd.insert("to_feat.weight".into(), vec![10, 3, 3, 3]);
    let e = crate::nets::registry::infer(&odd).unwrap_err().to_string();
    assert!(e.contains("multiple of 4 channels"), "{e}");
}
