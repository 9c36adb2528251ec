//! HAT: parity with the float64 reference (spandrel's HAT, the official architecture) on the
//! committed fixtures in tests/golden/hat/ (written by tests/golden/make_golden_hat.py), bf16
//! on the CPU, tiling, and what the loader reads from the files.

use std::path::PathBuf;

use candle_core::{DType, Device, Module};

use super::fixtures::{assert_bf16_products, load_io, max_abs_diff, TOLERANCE};
use crate::model::{ArchConfig, Checkpoint, Model};

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/hat")
}

/// (name, weights, io, scale, window) of every case in the manifest.
fn cases() -> Vec<(String, PathBuf, PathBuf, usize, usize)> {
    let text = std::fs::read_to_string(dir().join("manifest.json")).expect("manifest");
    let v: serde_json::Value = serde_json::from_str(&text).expect("manifest json");
    v.as_array()
        .expect("a list of cases")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                dir().join(c["weights"].as_str().unwrap()),
                dir().join(c["io"].as_str().unwrap()),
                c["scale"].as_u64().unwrap() as usize,
                c["window"].as_u64().unwrap() as usize,
            )
        })
        .collect()
}

#[test]
fn hat_f32_matches_float64_reference_on_every_fixture() {
    let mut failures = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (name, weights, io, scale, window) in cases() {
        let ck = Checkpoint::load(&weights).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ArchConfig::Hat(cfg) = &ck.config else {
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
    let ArchConfig::Hat(c) = &ck.config else {
        panic!("not HAT")
    };
    assert_eq!((c.compress_ratio(), c.squeeze_factor()), (2.0, 4.0));
    assert_eq!(c.overlap_ratio(), 0.5);
    assert_eq!(ck.config.name(), "HAT");
}

/// bf16 on the CPU against the float64 reference, with the DRCT bounds, and not the f32
/// output; on a CPU without bf16 arithmetic, bf16 must be refused instead.
#[test]
fn hat_cpu_bf16_stays_close_to_the_float64_reference() {
    let cases = cases();
    if !crate::model::bf16::supported() {
        let err = Model::load(&cases[0].1, DType::BF16, &Device::Cpu)
            .err()
            .expect("bf16 without bf16 instructions must be refused");
        assert!(err.to_string().contains("AVX512-BF16"), "{err}");
        eprintln!("this CPU has no bf16 arithmetic: checked that bf16 is refused");
        return;
    }
    let mut failures = Vec::new();
    for (name, weights, io, _, _) in &cases {
        let model = Model::load(weights, DType::BF16, &Device::Cpu).unwrap();
        let (input, expected) = load_io(io);
        let out = model.net.forward(&input).unwrap();
        assert_bf16_products(name, weights, &input, &out);
        let d = max_abs_diff(&out, &expected);
        let mse = (out.to_dtype(DType::F64).unwrap() - expected.to_dtype(DType::F64).unwrap())
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        let psnr = -10.0 * mse.log10();
        eprintln!("{name:<28} bf16: max |bf16 - f64| = {d:.3e}, PSNR {psnr:.1} dB");
        if !(d <= 0.05 && psnr >= 45.0) {
            failures.push(format!("{name}: max {d:.3e}, {psnr:.1} dB"));
        }
    }
    assert!(failures.is_empty(), "bf16 out of tolerance: {failures:?}");
}

/// Hann-blended tiles against the whole image through the command line's path: at least
/// 45 dB. The channel attention pools over what it is given, a tile or the whole image,
/// which tiling cannot reproduce exactly; the bound holds all the same.
#[test]
fn hat_tiles_blend_to_the_whole_image() {
    use crate::engine::lanes::Lanes;
    use crate::engine::Engine;
    use crate::io::{Decoded, Format};
    use crate::metrics::{psnr, Measure};
    use crate::planar::Planar;
    use crate::tile::auto::{TileChoice, TileSettings};
    let photo = crate::io::decode(&crate::tests::repo().join("tests/photos/coffee.png"))
        .unwrap()
        .rgb;
    let (top, left, h, w) = (40, 100, 192, 224);
    let mut data = Vec::with_capacity(3 * h * w);
    for c in 0..3 {
        for y in 0..h {
            for x in 0..w {
                data.push(photo.get(c, top + y, left + x));
            }
        }
    }
    let dec = Decoded {
        rgb: Planar::new(3, h, w, data),
        alpha: None,
        gray: false,
        bit_depth: 8,
        format: Format::Png,
        metadata: Default::default(),
    };
    // Tiles and overlaps in proportion to the window: 64/16 for window 8, 128/48 for 16.
    for (name, tile, overlap) in [("hat_x2_w8", 64, 16), ("hat_x3_w16", 128, 48)] {
        let weights = dir().join(format!("{name}.safetensors"));
        let engine =
            Engine::new(Checkpoint::load(&weights).unwrap(), Device::Cpu, DType::F32).unwrap();
        let lanes = Lanes::single(engine);
        let settings = |tile| TileSettings {
            choice: TileChoice::Fixed(tile),
            overlap,
            batch: Some(2),
            blend: crate::tile::BlendMode::Hann,
            tta: false,
        };
        let whole = lanes.upscale_decoded(&dec, &settings(0)).unwrap().rgb;
        let tiled = lanes.upscale_decoded(&dec, &settings(tile)).unwrap().rgb;
        let db = psnr(&tiled, &whole, 0, Measure::Rgb).unwrap();
        eprintln!("{name:<20} tiled ({tile}, overlap {overlap}, Hann) vs whole: {db:.1} dB");
        assert!(db >= 45.0, "{name}: {db:.1} dB");
    }
}

/// The released configurations, rebuilt as shape lists, are recognised as what they are, with
/// the parameter counts the HAT paper gives for x4 (HAT 20.8M, HAT-L 40.8M).
#[test]
fn released_hat_configurations_round_trip() {
    use crate::model::HatConfig;
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
        let back = ArchConfig::infer(&shapes).unwrap();
        assert_eq!(back, ArchConfig::Hat(c.clone()));
        assert_eq!(back.name(), name);
        eprintln!("{name}: {} parameters", c.parameter_count());
        if let Some(m) = params {
            let got = c.parameter_count() as f64 / 1e6;
            assert!((got - m).abs() < 0.05, "{name}: {got:.2}M");
        }
    }
}
