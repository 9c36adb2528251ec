//! Greyscale models (one image channel in and out: ESRGAN, Compact, RCAN, SPAN, SwinIR, MoSR)
//! against the float64 reference on the committed fixtures in tests/golden/grey/ (written by
//! tests/golden/make_golden_grey.py), fed as the pipeline feeds them: RGB images whose three
//! channels are equal, or a colour image read as its luma.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

use super::fixtures::{load_io, manifest, max_abs_diff, TOLERANCE};
use crate::checkpoint::Checkpoint;
use crate::model::Model;

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/grey")
}

/// Each fixture's one-channel input as a grey RGB image, through the model: every output
/// channel is the reference's one, within the f32 bound (the luma of equal channels is the
/// grey value itself, to a rounding).
#[test]
fn greyscale_models_match_the_float64_reference_on_grey_images() {
    let mut families = std::collections::BTreeSet::new();
    for (case, entry) in manifest(&dir()) {
        let name = &case.name;
        let ck = Checkpoint::load(&case.weights).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(ck.config.greyscale(), "{name}: not read as greyscale");
        assert_eq!(ck.config.family(), entry["family"].as_str().unwrap());
        families.insert(ck.config.family());
        let model = Model::from_checkpoint(ck, DType::F32, &Device::Cpu).unwrap();
        let (input, expected) = load_io(&case.io);
        assert_eq!(input.dim(1).unwrap(), 1);
        let rgb = input.repeat((1, 3, 1, 1)).unwrap();
        let out = model.net.forward(&rgb).unwrap();
        assert_eq!(out.dim(1).unwrap(), 3, "{name}");
        for c in 0..3 {
            let d = max_abs_diff(&out.narrow(1, c, 1).unwrap(), &expected);
            eprintln!("{name:<20} channel {c}: max |f32 - f64 reference| = {d:.3e}");
            assert!(d <= TOLERANCE, "{name}, channel {c}: {d:.3e}");
        }
    }
    assert_eq!(families.len(), 6, "{families:?}");
}

/// A colour image reaches a greyscale model as its BT.601 luma (computed here in f64), and
/// the output's three channels are equal.
#[test]
fn greyscale_models_read_a_colour_image_as_its_luma() {
    let path = dir().join("rcan_x2_grey.safetensors");
    let model = Model::load(&path, DType::F32, &Device::Cpu).unwrap();
    let x = Tensor::rand(0f32, 1.0, (1, 3, 10, 7), &Device::Cpu).unwrap();
    let v: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
    let n = 10 * 7;
    let grey: Vec<f32> = (0..n)
        .map(|i| {
            let (r, g, b) = (v[i] as f64, v[n + i] as f64, v[2 * n + i] as f64);
            (0.299 * r + 0.587 * g + 0.114 * b) as f32
        })
        .collect();
    let grey = Tensor::from_vec(grey, (1, 1, 10, 7), &Device::Cpu).unwrap();
    let out = model.net.forward(&x).unwrap();
    let want = model
        .net
        .forward(&grey.repeat((1, 3, 1, 1)).unwrap())
        .unwrap();
    let d = max_abs_diff(&out, &want);
    assert!(d < 1e-5, "{d:e}");
    for c in 1..3 {
        let d = max_abs_diff(&out.narrow(1, c, 1).unwrap(), &out.narrow(1, 0, 1).unwrap());
        assert_eq!(d, 0.0, "channel {c} differs from channel 0");
    }
}
