//! HAT: parity with the float64 reference (spandrel's HAT, the official architecture) on the
//! committed fixtures in tests/golden/hat/ (written by tests/golden/make_golden_hat.py), bf16
//! on the CPU, tiling, and what the loader reads from the files.

use std::path::PathBuf;

use candle_core::{DType, Device};

use super::fixtures::{
    assert_bf16_close, assert_tiles_blend_to_whole, load_io, manifest, max_abs_diff, TOLERANCE,
};
use crate::checkpoint::Checkpoint;
use crate::model::Model;
use crate::nets::hat::HatConfig;
use crate::nets::{config_of, NetConfig};

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/hat")
}

/// (name, weights, io, scale, window) of every case in the manifest.
fn cases() -> Vec<(String, PathBuf, PathBuf, usize, usize)> {
    manifest(&dir())
        .into_iter()
        .map(|(c, entry)| {
            let window = entry["window"].as_u64().unwrap() as usize;
            (c.name, c.weights, c.io, c.scale, window)
        })
        .collect()
}

#[test]
fn hat_f32_matches_float64_reference_on_every_fixture() {
    hat_f32_matches_float64_reference_on_every_fixture_here();
}

/// The same with our kernels held to AVX2 (`UPSCALE_CPU_ISA=avx2`), the path of CPUs without
/// AVX-512, so that it is checked on every run of the tests.
#[test]
fn hat_f32_matches_float64_reference_on_every_fixture_capped_to_avx2() {
    use crate::ops::cpu::isa::{with_cpu_isa, CpuIsa};
    with_cpu_isa(
        CpuIsa::Avx2,
        hat_f32_matches_float64_reference_on_every_fixture_here,
    );
}

fn hat_f32_matches_float64_reference_on_every_fixture_here() {
    let mut failures = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (name, weights, io, scale, window) in cases() {
        let ck = Checkpoint::load(&weights).unwrap_or_else(|e| panic!("{name}: {e}"));
        let Some(cfg) = config_of::<HatConfig>(&ck.config) else {
            panic!("{name}: not read as HAT: {:?}", ck.config);
        };
        assert_eq!((cfg.scale, cfg.window), (scale, window), "{name}");
        seen.insert(scale);
        seen.insert(100 + window);
        let model = Model::from_checkpoint(ck, DType::F32, &Device::Cpu).unwrap();
        let (input, expected) = load_io(&io);
        let out = model.net.forward(&input).unwrap();
        let d = max_abs_diff(&out, &expected);
        eprintln!("{name:<28} max |f32 - f64 reference| = {d:.3e}");
        if d.is_nan() || d > TOLERANCE {
            failures.push(format!("{name}: {d:.3e}"));
        }
    }
    assert!(failures.is_empty(), "over {TOLERANCE:e}: {failures:?}");
    for want in [2, 3, 4, 108, 116] {
        assert!(seen.contains(&want), "no fixture covers {want}");
    }
}

#[test]
fn hat_params_ema_is_read_and_described() {
    let ck = Checkpoint::load(&dir().join("hat_x4_ema.pth")).unwrap();
    assert_eq!(ck.wrapper.as_deref(), Some("params_ema"));
    let Some(c) = config_of::<HatConfig>(&ck.config) else {
        panic!("not HAT")
    };
    assert_eq!((c.compress_ratio(), c.squeeze_factor()), (2.0, 4.0));
    assert_eq!(c.overlap_ratio(), 0.5);
    assert_eq!(ck.config.variant(), "HAT");
}

/// bf16 on the CPU against the float64 reference, with the DRCT bounds, and not the f32
/// output; on a CPU without bf16 arithmetic, bf16 must be refused instead.
#[test]
fn hat_cpu_bf16_stays_close_to_the_float64_reference() {
    let cases: Vec<_> = cases()
        .into_iter()
        .map(|(name, weights, io, _, _)| (name, weights, io))
        .collect();
    assert_bf16_close(&cases, 0.05, 45.0);
}

/// Hann-blended tiles against the whole image through the command line's path: at least
/// 45 dB. The channel attention pools over what it is given, a tile or the whole image,
/// which tiling cannot reproduce exactly; the bound holds all the same.
#[test]
fn hat_tiles_blend_to_the_whole_image() {
    // Tiles and overlaps in proportion to the window: 64/16 for window 8, 128/48 for 16.
    let runs = [("hat_x2_w8", 64, 16), ("hat_x3_w16", 128, 48)]
        .map(|(name, tile, overlap)| (dir().join(format!("{name}.safetensors")), tile, overlap));
    assert_tiles_blend_to_whole((40, 100, 192, 224), &runs, 45.0);
}

/// The released configurations, rebuilt as shape lists, are recognised as what they are, with
/// the parameter counts the HAT paper gives for x4 (HAT 20.8M, HAT-L 40.8M).
#[test]
fn released_hat_configurations_round_trip() {
    use crate::nets::hat::HatConfig;
    let cfg = |e: usize, groups: usize, cab: usize, squeeze: usize| HatConfig {
        embed_dim: e,
        depths: vec![6; groups],
        heads: vec![6; groups],
        window: 16,
        overlap_window: 24,
        mlp_hidden: 2 * e,
        ocab_mlp_hidden: 2 * e,
        cab_width: cab,
        squeeze_width: squeeze,
        patch_norm: true,
        group_conv: true,
        num_feat: 64,
        scale: 4,
    };
    for (c, name, params) in [
        (cfg(144, 6, 6, 6), "HAT-S", None),
        (cfg(180, 6, 60, 6), "HAT", Some(20.8)),
        (cfg(180, 12, 60, 6), "HAT-L", Some(40.8)),
    ] {
        let shapes = c.expected_tensors().into_iter().collect();
        let back = crate::nets::registry::infer(&shapes).unwrap();
        assert_eq!(config_of::<HatConfig>(&back), Some(&c.clone()));
        assert_eq!(back.variant(), name);
        eprintln!("{name}: {} parameters", c.parameter_count());
        if let Some(m) = params {
            let got = c.parameter_count() as f64 / 1e6;
            assert!((got - m).abs() < 0.05, "{name}: {got:.2}M");
        }
    }
}
