//! MoSR: parity with the float64 reference (spandrel's MoSR) on the committed fixtures in
//! tests/golden/mosr/ (written by tests/golden/make_golden_mosr.py), bf16 on the CPU, and
//! what the loader reads from the files.

use std::path::PathBuf;

use super::fixtures::{assert_bf16_close_in, assert_every_fixture_matches, on_each_cpu_path};
use crate::checkpoint::Checkpoint;
use crate::nets::mosr::{MosrConfig, Upsampler};
use crate::nets::{config_of, NetConfig};

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/mosr")
}

fn f32_matches_float64_reference() {
    assert_every_fixture_matches(&dir(), &["PixelShuffle", "Gps", "DySample"], |f| {
        let (name, cfg) = (f.name, f.config::<MosrConfig>());
        assert_eq!(
            (cfg.scale, cfg.blocks, cfg.kernel),
            (f.n("scale"), f.n("blocks"), f.n("kernel")),
            "{name}"
        );
        let upsampler = match f.entry["upsampler"].as_str().unwrap() {
            "ps" => Upsampler::PixelShuffle,
            "gps" => Upsampler::Gps,
            _ => Upsampler::DySample,
        };
        assert_eq!(cfg.upsampler, upsampler, "{name}");
        vec![format!("{upsampler:?}")]
    });
}

on_each_cpu_path!(f32_matches_float64_reference =>
    mosr_f32_matches_float64_reference_on_every_fixture,
    mosr_f32_matches_float64_reference_on_every_fixture_capped_to_avx2,
    mosr_f32_matches_float64_reference_on_candles_operations);

/// bf16 on the CPU against the float64 reference, with the DRCT bounds; on a CPU without
/// bf16 arithmetic, bf16 must be refused instead.
#[test]
fn mosr_cpu_bf16_stays_close_to_the_float64_reference() {
    assert_bf16_close_in(&dir(), 0.05, 45.0);
}

/// `info`'s fields; a missing block tensor and an even depthwise kernel named; other channel
/// counts refused when built.
#[test]
fn mosr_is_described_and_broken_files_are_named() {
    let ck = Checkpoint::load(&dir().join("mosr_x2_gps.safetensors")).unwrap();
    assert_eq!(ck.config.variant(), "MoSR (GPS upsampler)");
    let d = ck.config.describe();
    assert_eq!(
        (
            d["hidden"].as_u64(),
            d["conv_channels"].as_u64(),
            d["kernel"].as_u64()
        ),
        (Some(16), Some(4), Some(5))
    );
    let shapes: crate::nets::infer::Shapes = ck
        .tensors
        .names()
        .map(|k| (k.to_string(), ck.tensors.dims(k).unwrap().to_vec()))
        .collect();
    let back = crate::nets::registry::infer(&shapes).unwrap();
    let cfg = config_of::<MosrConfig>(&back).unwrap().clone();
    let mut missing = shapes.clone();
    missing.remove("gblocks.1.fc2.bias");
    let e = crate::nets::registry::infer(&missing)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("MoSR checkpoint: missing tensor gblocks.1.fc2.bias"),
        "{e}"
    );
    let mut even = shapes.clone();
    even.insert("gblocks.1.conv.weight".into(), vec![4, 1, 4, 4]);
    let e = crate::nets::registry::infer(&even).unwrap_err().to_string();
    assert!(e.contains("odd kernel"), "{e}");
    let rgba = MosrConfig {
        in_channels: 4,
        out_channels: 4,
        ..cfg
    };
    let shapes: crate::nets::infer::Shapes = rgba.expected_tensors().into_iter().collect();
    let err = super::esrgan::build_zeros(&shapes).err().expect("refused");
    assert!(
        err.to_string().contains("only RGB (3) and greyscale (1)"),
        "{err}"
    );
}
