//! FDAT: parity with the float64 reference (spandrel's FDAT) on the committed fixtures in
//! tests/golden/fdat/ (written by tests/golden/make_golden_fdat.py), bf16 on the CPU, tiling,
//! and what the loader reads from the files and refuses.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

use super::fixtures::{
    assert_bf16_close_in, assert_every_fixture_matches, assert_tiles_blend_to_whole,
    on_each_cpu_path,
};
use crate::checkpoint::Checkpoint;
use crate::nets::fdat::{FdatConfig, Upsampler};
use crate::nets::NetConfig;

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/fdat")
}

/// Every fixture read as the configuration it was made with, and within the f32 bound of
/// the reference; with no vector kernels the depthwise convolutions and the channel
/// attention run on candle's operations.
fn f32_matches_float64_reference() {
    let want = [
        "conv",
        "pixelshuffledirect",
        "pixelshuffle",
        "nearest+conv",
        "dysample",
        "transpose+conv",
        "pa_up",
        "x1",
        "x2",
        "x3",
        "x4",
        "window padded",
        "unshuffle 2",
        "dysample with its 3x3",
        "safetensors",
        "pth-plain",
        "pth-params",
        "pth-ema",
    ];
    assert_every_fixture_matches(&dir(), &want, |f| {
        let (name, cfg) = (f.name, f.config::<FdatConfig>());
        let upsampler = serde_json::to_value(cfg.upsampler).unwrap();
        assert_eq!(upsampler, f.entry["upsampler"], "{name}");
        assert_eq!(
            (
                cfg.scale,
                cfg.embed_dim,
                cfg.groups,
                cfg.depth,
                cfg.heads,
                cfg.window_size,
                cfg.mid_dim,
                cfg.unshuffle > 1
            ),
            (
                f.n("scale"),
                f.n("embed_dim"),
                f.n("groups"),
                f.n("depth"),
                f.n("heads"),
                f.n("window"),
                f.n("mid_dim"),
                f.b("unshuffle")
            ),
            "{name}"
        );
        assert!(f.checkpoint.config.whole_input_matters(), "{name}");
        let (_, _, h, w) = f.input.dims4().unwrap();
        let padded = h % cfg.window_size != 0 || w % cfg.window_size != 0;
        let mut labels = vec![
            upsampler.as_str().unwrap().to_string(),
            format!("x{}", cfg.scale),
            format!("unshuffle {}", cfg.unshuffle),
        ];
        if padded {
            labels.push("window padded".into());
        }
        if cfg.upsampler == Upsampler::DySample && cfg.mid_dim != cfg.embed_dim {
            labels.push("dysample with its 3x3".into());
        }
        labels
    });
}

on_each_cpu_path!(f32_matches_float64_reference =>
    fdat_f32_matches_float64_reference_on_every_fixture,
    fdat_f32_matches_float64_reference_on_every_fixture_capped_to_avx2,
    fdat_f32_matches_float64_reference_on_candles_operations);

/// bf16 on the CPU against the float64 reference, with the other families' bounds; on a CPU
/// without bf16 arithmetic, bf16 must be refused instead.
#[test]
fn fdat_cpu_bf16_stays_close_to_the_float64_reference() {
    assert_bf16_close_in(&dir(), 0.05, 45.0);
}

/// Hann-blended tiles against the whole image through the command line's path. The channel
/// attention and the channel gate see the whole map they are given, so tiles differ from
/// the whole image by the model's own definition (the planner keeps such images whole where
/// memory allows); the bound still catches a misplaced or unblended tile.
#[test]
fn fdat_tiles_blend_to_the_whole_image() {
    let files = [
        ("fdat_x4_ps.safetensors", 64, 24),
        ("fdat_x2_tc.pth", 48, 16),
    ]
    .map(|(file, tile, overlap)| (dir().join(file), tile, overlap));
    assert_tiles_blend_to_whole((40, 100, 96, 112), &files, 20.0);
}

/// A fixture's tensors, the upsampler's description included.
fn tensors(file: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir().join(file), &Device::Cpu).unwrap()
}

/// `tensors` written to a file of their own and loaded: the error, if any.
fn load_error(tensors: &HashMap<String, Tensor>) -> Option<String> {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("crafted.safetensors");
    candle_core::safetensors::save(tensors, &path).unwrap();
    Checkpoint::load(&path).err().map(|e| e.to_string())
}

/// `info`'s fields, and a file's own description of its upsampler read as written.
#[test]
fn fdat_is_described() {
    let ck = Checkpoint::load(&dir().join("fdat_x2_unshuffle.safetensors")).unwrap();
    assert_eq!(ck.config.family(), "FDAT");
    assert_eq!(ck.config.scale(), 2);
    let d = ck.config.describe();
    assert_eq!(d["upsampler"], "pixelshuffle");
    assert_eq!(d["unshuffle"], 2);
    assert_eq!(d["window"], 4);
    assert_eq!(d["ffn_hidden"], 24);
    // The description is a buffer: not among the learned parameters.
    let all: usize = ck
        .config
        .expected_tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    assert_eq!(ck.config.parameter_count(), all - 7);
    let ck = Checkpoint::load(&dir().join("fdat_x4_tc.pth")).unwrap();
    assert_eq!(ck.wrapper, None);
    assert_eq!(ck.config.describe()["upsampler"], "transpose+conv");
}

/// What a broken or unsupported file is told: the LDA upsampler and an unknown one by name,
/// another description version, a missing block tensor, a stray one, and a description
/// whose upsampler does not match the tensors.
#[test]
fn fdat_broken_and_unsupported_files_are_named() {
    let good = tensors("fdat_x4_ps.safetensors");
    assert_eq!(load_error(&good), None);
    let meta = |values: [u8; 7]| Tensor::from_vec(values.to_vec(), 7, &Device::Cpu).unwrap();
    let with_meta = |values: [u8; 7]| {
        let mut t = good.clone();
        t.insert("upsampler.MetaUpsample".into(), meta(values));
        t
    };
    let e = load_error(&with_meta([3, 6, 4, 16, 3, 12, 4])).unwrap();
    assert!(
        e.contains("FDAT checkpoint") && e.contains("LDA upsampler"),
        "{e}"
    );
    let e = load_error(&with_meta([3, 9, 4, 16, 3, 12, 4])).unwrap();
    assert!(e.contains("names upsampler 9"), "{e}");
    let e = load_error(&with_meta([2, 2, 4, 16, 3, 12, 4])).unwrap();
    assert!(e.contains("expected version 3"), "{e}");
    // pixelshuffledirect's description over pixelshuffle's tensors.
    let e = load_error(&with_meta([3, 1, 4, 16, 3, 12, 4])).unwrap();
    assert!(e.contains("upsampler.0.weight"), "{e}");
    let mut missing = good.clone();
    missing.remove("groups.1.blocks.1.ffn.smix.weight");
    let e = load_error(&missing).unwrap();
    assert!(
        e.contains("FDAT checkpoint: missing tensor groups.1.blocks.1.ffn.smix.weight"),
        "{e}"
    );
    let mut stray = good.clone();
    stray.insert(
        "groups.0.blocks.0.attn.qkv.bias".into(),
        Tensor::zeros(48, DType::F32, &Device::Cpu).unwrap(),
    );
    let e = load_error(&stray).unwrap();
    assert!(e.contains("groups.0.blocks.0.attn.qkv.bias"), "{e}");
    let mut f16_meta = good.clone();
    f16_meta.insert(
        "upsampler.MetaUpsample".into(),
        meta([3, 2, 4, 16, 3, 12, 4]).to_dtype(DType::F32).unwrap(),
    );
    assert_eq!(
        load_error(&f16_meta),
        None,
        "a description stored as floats reads alike"
    );
    let rgba = FdatConfig {
        in_channels: 4,
        out_channels: 4,
        ..fdat_config("fdat_x4_ps.safetensors")
    };
    assert!(rgba.refusal().unwrap().contains("only RGB (3)"));
}

fn fdat_config(file: &str) -> FdatConfig {
    let ck = Checkpoint::load(&dir().join(file)).unwrap();
    crate::nets::config_of::<FdatConfig>(&ck.config)
        .unwrap()
        .clone()
}
