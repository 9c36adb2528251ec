//! SwinIR: parity with the float64 reference (spandrel's SwinIR, the official architecture) on
//! the committed fixtures in tests/golden/swinir/ (written by tests/golden/make_golden_swinir.py),
//! bf16 on the CPU, tiling, and the checks a loader owes a bad or foreign file.

use std::collections::BTreeSet;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

use super::fixtures::{
    assert_bf16_close, assert_shift_masks_cached, assert_tiles_blend_to_whole, load_io, manifest,
    max_abs_diff, TOLERANCE,
};
use crate::checkpoint::{Checkpoint, Source};
use crate::model::Model;
use crate::nets::swinir::SwinIrConfig;
use crate::nets::swinir::{ResiConnection, Upsampler};
use crate::nets::{config_of, NetConfig};

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/swinir")
}

struct Case {
    name: String,
    weights: PathBuf,
    io: PathBuf,
    scale: usize,
    upsampler: String,
    resi: String,
}

fn cases() -> Vec<Case> {
    manifest(&dir())
        .into_iter()
        .map(|(c, entry)| Case {
            name: c.name,
            weights: c.weights,
            io: c.io,
            scale: c.scale,
            upsampler: entry["upsampler"].as_str().unwrap().to_string(),
            resi: entry["resi_connection"].as_str().unwrap().to_string(),
        })
        .collect()
}

fn swinir(ck: &Checkpoint) -> &crate::nets::swinir::SwinIrConfig {
    match config_of::<SwinIrConfig>(&ck.config) {
        Some(c) => c,
        None => panic!("not read as SwinIR: {:?}", ck.config),
    }
}

#[test]
fn swinir_f32_matches_float64_reference_on_every_fixture() {
    let cases = cases();
    let mut kinds = BTreeSet::new();
    let mut failures = Vec::new();
    for case in &cases {
        let ck = Checkpoint::load(&case.weights).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let cfg = swinir(&ck);
        assert_eq!(cfg.scale, case.scale, "{}: scale", case.name);
        assert_eq!(cfg.upsampler.name(), case.upsampler, "{}", case.name);
        let resi = match cfg.resi_connection {
            ResiConnection::OneConv => "1conv",
            ResiConnection::ThreeConv => "3conv",
        };
        assert_eq!(resi, case.resi, "{}", case.name);
        // The reference loader's rule: window 7 means the JPEG models' range of 255.
        let range = if cfg.window == 7 { 255.0 } else { 1.0 };
        assert_eq!(cfg.img_range, range, "{}: img_range", case.name);
        kinds.insert((case.upsampler.clone(), case.scale));
        kinds.insert((format!("window {}", cfg.window), 0));
        kinds.insert((case.resi.clone(), 0));
        let model = Model::from_checkpoint(ck, DType::F32, &Device::Cpu).unwrap();
        let (input, expected) = load_io(&case.io);
        let out = model.net.forward(&input).unwrap();
        let d = max_abs_diff(&out, &expected);
        eprintln!("{:<28} max |f32 - f64 reference| = {d:.3e}", case.name);
        if d.is_nan() || d > TOLERANCE {
            failures.push(format!("{}: {d:.3e}", case.name));
        }
    }
    assert!(failures.is_empty(), "over {TOLERANCE:e}: {failures:?}");
    // Every upsampler at every scale it is released in, and both residual connections.
    for want in [
        ("pixelshuffle", 2),
        ("pixelshuffle", 3),
        ("pixelshuffle", 4),
        ("pixelshuffledirect", 2),
        ("pixelshuffledirect", 3),
        ("pixelshuffledirect", 4),
        ("nearest+conv", 2),
        ("nearest+conv", 4),
        ("nearest+conv", 8),
        ("none", 1),
        ("window 7", 0),
        ("window 8", 0),
        ("1conv", 0),
        ("3conv", 0),
    ] {
        assert!(
            kinds.contains(&(want.0.to_string(), want.1)),
            "no fixture covers {want:?}"
        );
    }
}

/// The official wrapper holds other weights under `params`: only `params_ema` matches the
/// reference, so the f32 test above proves which one was read; here the choice is named.
#[test]
fn swinir_pth_wrappers_are_read() {
    let ck = Checkpoint::load(&dir().join("classical_x4_ema.pth")).unwrap();
    assert_eq!(ck.wrapper.as_deref(), Some("params_ema"));
    let ck = Checkpoint::load(&dir().join("realworld_x2_nonorm.pth")).unwrap();
    assert_eq!(ck.wrapper, None);
    assert!(!swinir(&ck).patch_norm);
}

/// bf16 on the CPU against the float64 reference, with the DRCT bounds (see golden.rs), and
/// not the f32 output; on a CPU without bf16 arithmetic the model must refuse bf16 instead.
/// The real-world x8 fixture has a bound of its own: three steepened LeakyReLU stages
/// (make_golden_swinir.py's `boost`) amplify any rounding, and an emulation of the bf16
/// products in PyTorch (tests/golden/bf16_emulation.py) puts it at 42.0 dB and 0.042, where
/// the others land at 47.7-62.9 dB.
#[test]
fn swinir_cpu_bf16_stays_close_to_the_float64_reference() {
    let (steep, cases): (Vec<_>, Vec<_>) = cases()
        .into_iter()
        .map(|c| (c.name, c.weights, c.io))
        .partition(|(name, _, _)| name == "realworld_x8");
    assert_eq!(steep.len(), 1);
    assert_bf16_close(&cases, 0.05, 45.0);
    assert_bf16_close(&steep, 0.1, 38.0);
}

#[test]
fn swinir_shift_masks_are_cached_per_size() {
    let case = &cases()[0];
    assert_shift_masks_cached(&case.weights, &case.io);
}

/// Tiles blended with the Hann window against the whole image, on a photo, through the
/// path the command line takes, for each kind of upsampler: at least 45 dB.
#[test]
fn swinir_tiles_blend_to_the_whole_image() {
    // Sides that are window multiples: the whole image then needs no padding, which a tile
    // at the border does not see either. (With random weights, what two rows of reflected
    // padding change near the border alone would be some 20 dB.)
    let runs = ["classical_x2", "lightweight_x3", "realworld_x4_3conv"]
        .map(|name| (dir().join(format!("{name}.safetensors")), 64, 16));
    assert_tiles_blend_to_whole((40, 100, 128, 160), &runs, 45.0);
    // The JPEG models' window 7, at sides that are multiples of it.
    let runs = [(dir().join("jpeg_color_w7.safetensors"), 63, 21)];
    assert_tiles_blend_to_whole((40, 100, 126, 154), &runs, 45.0);
}

fn shapes(path: &std::path::Path) -> Vec<(String, Tensor)> {
    let t = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let mut v: Vec<_> = t.into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The one-line message a checkpoint of these tensors is refused with, if it is.
fn refusal(tensors: &[(String, Tensor)]) -> Option<String> {
    let bytes = safetensors::serialize(tensors.iter().map(|(k, v)| (k.as_str(), v)), None).unwrap();
    Checkpoint::from_safetensors_bytes(&bytes, Source::Embedded("crafted"))
        .err()
        .map(|e| e.to_string())
}

#[test]
fn swinir_bad_checkpoints_name_the_tensor() {
    let base = shapes(&dir().join("realworld_x4_3conv.safetensors"));
    assert_eq!(refusal(&base), None);

    let missing = "layers.1.residual_group.blocks.1.mlp.fc2.bias";
    let t: Vec<_> = base.iter().filter(|(k, _)| k != missing).cloned().collect();
    let e = refusal(&t).expect("refused");
    assert!(e.contains(missing) && e.contains("SwinIR"), "{e}");

    let bad = "layers.0.conv.2.weight";
    let t: Vec<_> = base
        .iter()
        .map(|(k, v)| {
            if k == bad {
                (
                    k.clone(),
                    Tensor::zeros((4, 4, 3, 3), DType::F32, &Device::Cpu).unwrap(),
                )
            } else {
                (k.clone(), v.clone())
            }
        })
        .collect();
    let e = refusal(&t).expect("refused");
    assert!(e.contains(bad), "{e}");

    let mut t = base.clone();
    t.push((
        "layers.0.residual_group.blocks.0.attn.extra".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    ));
    let e = refusal(&t).expect("refused");
    assert!(e.contains("attn.extra"), "{e}");

    // No upsampler is a restoration model, whose conv_last reads the body's width: this
    // one's reads the upsampler's, and is named.
    let no_upsampler: Vec<_> = base
        .iter()
        .filter(|(k, _)| {
            !(k.starts_with("conv_up") || k.starts_with("conv_hr") || k.starts_with("conv_before"))
        })
        .cloned()
        .collect();
    let e = refusal(&no_upsampler).expect("refused");
    assert!(
        e.contains("conv_last.weight") && e.contains("SwinIR"),
        "{e}"
    );
    // Without conv_last as well, nothing closes the network.
    let t: Vec<_> = no_upsampler
        .into_iter()
        .filter(|(k, _)| !k.starts_with("conv_last"))
        .collect();
    let e = refusal(&t).expect("refused");
    assert!(e.contains("no upsampler") && e.contains("denoising"), "{e}");
}

#[test]
fn foreign_architectures_get_one_line_naming_what_was_found() {
    let base = shapes(&dir().join("classical_x2.safetensors"));
    let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap();
    let mut swin2sr = base.clone();
    swin2sr.push((
        "layers.0.residual_group.blocks.0.attn.logit_scale".into(),
        z(&[6, 1, 1]),
    ));
    // Swin2SR is registered: read as one, the first tensor it lacks is named.
    let e = refusal(&swin2sr).expect("refused");
    assert!(
        e.contains("Swin2SR checkpoint") && e.contains("missing tensor"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");

    // A HAT file missing a tensor is read as HAT, and the tensor named.
    let mut hat = base.clone();
    hat.push((
        "layers.0.residual_group.blocks.0.conv_block.cab.0.weight".into(),
        z(&[8, 24, 3, 3]),
    ));
    let e = refusal(&hat).expect("refused");
    assert!(
        e.contains("HAT checkpoint") && e.contains("missing tensor"),
        "{e}"
    );

    let esrgan = vec![
        ("conv_first.weight".to_string(), z(&[8, 3, 3, 3])),
        ("body.0.rdb1.conv1.weight".to_string(), z(&[8, 8, 3, 3])),
    ];
    // ESRGAN is registered: a truncated file is read as one, and the missing tensor named.
    let e = refusal(&esrgan).expect("refused");
    assert!(
        e.contains("ESRGAN checkpoint") && e.contains("missing tensor"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");

    let other = vec![("encoder.weight".to_string(), z(&[4, 4]))];
    let e = refusal(&other).expect("refused");
    assert!(
        e.contains("unrecognised") && e.contains("encoder.weight"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
}

/// The released configurations, rebuilt as shape lists, are recognised as what they are;
/// the lightweight models' parameter counts are the paper's (878K, 886K, 897K, bias tables
/// aside).
#[test]
fn released_configurations_round_trip() {
    use crate::nets::swinir::SwinIrConfig;
    use ResiConnection::{OneConv, ThreeConv};
    use Upsampler::{NearestConv, PixelShuffle, PixelShuffleDirect};
    let cfg = |e, n: usize, h, up, resi, feat, scale| SwinIrConfig {
        embed_dim: e,
        depths: vec![6; n],
        heads: vec![h; n],
        window: 8,
        mlp_hidden: 2 * e,
        patch_norm: true,
        resi_connection: resi,
        upsampler: up,
        num_feat: feat,
        scale,
        img_range: 1.0,
        channels: 3,
    };
    use Upsampler::None as Restore;
    let jpeg = SwinIrConfig {
        window: 7,
        img_range: 255.0,
        ..cfg(180, 6, 6, Restore, OneConv, 0, 1)
    };
    // 004_grayDN and 006_CAR: one channel in and out.
    let grey_dn = SwinIrConfig {
        channels: 1,
        ..cfg(180, 6, 6, Restore, OneConv, 0, 1)
    };
    let grey_jpeg = SwinIrConfig {
        channels: 1,
        ..jpeg.clone()
    };
    let cases = [
        (
            cfg(180, 6, 6, PixelShuffle, OneConv, 64, 4),
            "SwinIR-M (classical)",
        ),
        (
            cfg(180, 6, 6, PixelShuffle, OneConv, 64, 3),
            "SwinIR-M (classical)",
        ),
        (
            cfg(60, 4, 6, PixelShuffleDirect, OneConv, 0, 2),
            "SwinIR-S (lightweight)",
        ),
        (
            cfg(180, 6, 6, NearestConv, OneConv, 64, 4),
            "SwinIR-M (real-world)",
        ),
        (
            cfg(240, 9, 8, NearestConv, ThreeConv, 64, 4),
            "SwinIR-L (real-world)",
        ),
        (
            cfg(180, 6, 6, NearestConv, OneConv, 64, 8),
            "SwinIR-M (real-world)",
        ),
        (
            cfg(180, 6, 6, Restore, OneConv, 0, 1),
            "SwinIR-M (denoising)",
        ),
        (jpeg, "SwinIR-M (JPEG artefact removal)"),
        (grey_dn, "SwinIR-M (greyscale denoising)"),
        (grey_jpeg, "SwinIR-M (greyscale JPEG artefact removal)"),
    ];
    for (c, name) in cases {
        let shapes = c.expected_tensors().into_iter().collect();
        let back = crate::nets::registry::infer(&shapes).unwrap();
        assert_eq!(config_of::<SwinIrConfig>(&back), Some(&c.clone()));
        assert_eq!(back.variant(), name);
    }
    // The paper's counts leave out the relative position bias tables (24 x 225 x 6).
    for (scale, params) in [(2, 878), (3, 886), (4, 897)] {
        let c = cfg(60, 4, 6, PixelShuffleDirect, OneConv, 0, scale);
        let tables = 24 * 225 * 6;
        assert_eq!(
            (c.parameter_count() - tables + 500) / 1000,
            params,
            "x{scale}"
        );
    }
}

/// SwinIR's refusals are typed errors naming the tensor, and the architecture's wrapper
/// keeps each one as its source: an unexplained tensor, heads that do not divide the width.
#[test]
fn swinir_refusals_are_typed_and_kept_as_the_source() {
    use crate::nets::ConfigError;
    use std::error::Error as _;
    let base: std::collections::BTreeMap<String, Vec<usize>> =
        shapes(&dir().join("realworld_x4_3conv.safetensors"))
            .into_iter()
            .map(|(k, v)| (k, v.dims().to_vec()))
            .collect();
    assert!(crate::nets::registry::infer(&base).is_ok());

    let mut s = base.clone();
    s.insert(
        "layers.0.residual_group.blocks.0.attn.extra".into(),
        vec![3],
    );
    let e = crate::nets::registry::infer(&s).unwrap_err();
    let ConfigError::SwinIr(inner) = &e else {
        panic!("{e:?}")
    };
    assert!(
        matches!(&**inner, ConfigError::Unexpected { name, .. } if name.ends_with("attn.extra")),
        "{inner:?}"
    );
    let source = e.source().expect("the SwinIR wrapper keeps its cause");
    assert_eq!(e.to_string(), format!("SwinIR checkpoint: {source}"));
    assert!(
        source.to_string().contains("unsupported SwinIR variant"),
        "{source}"
    );

    // Six heads read as seven: they no longer divide the width.
    let table = "layers.1.residual_group.blocks.0.attn.relative_position_bias_table";
    let mut s = base.clone();
    s.get_mut(table).unwrap()[1] += 1;
    let e = crate::nets::swinir::SwinIrConfig::infer(&s).unwrap_err();
    assert!(
        matches!(&e, ConfigError::Shape { name, .. } if name == table),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("heads do not divide the width"),
        "{e}"
    );
}
