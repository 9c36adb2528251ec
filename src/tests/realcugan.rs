//! Real-CUGAN: parity with the float64 reference (spandrel's UpCunet classes) on the
//! committed fixtures in tests/golden/realcugan/ (written by
//! tests/golden/make_golden_realcugan.py), bf16 on the CPU, tiles, and what the loader reads.
//!
//! The fixtures hold no weights (1.3 million parameters a model, at any width): each test
//! draws them again with the generator the script describes, from the tensor list, shapes
//! and scales in the manifest, and writes them to a temporary file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::fixtures::{assert_bf16_close, load_io, max_abs_diff, TOLERANCE};
use crate::checkpoint::Checkpoint;
use crate::model::Model;
use crate::nets::infer::Shapes;
use crate::nets::realcugan::{Form, RealCuganConfig};
use crate::nets::registry::infer;
use crate::nets::{config_of, NetConfig};

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/realcugan")
}

fn manifest() -> Vec<Value> {
    let text = std::fs::read_to_string(dir().join("manifest.json")).expect("manifest");
    let v: Value = serde_json::from_str(&text).expect("manifest json");
    v.as_array().expect("a list of cases").clone()
}

fn fnv1a(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    })
}

/// `n` values of the fixture script's generator (splitmix64 over a counter).
fn draw(name: &str, seed: u64, n: usize, scale: f64) -> Vec<f32> {
    let start = fnv1a(name) ^ seed;
    (1..=n as u64)
        .map(|i| {
            let mut z = start.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f64 / (1u64 << 24) as f64;
            ((2.0 * u - 1.0) * scale) as f32
        })
        .collect()
}

/// The case's tensors as the manifest lists them: (name, shape, scale).
fn tensor_list(case: &Value) -> Vec<(String, Vec<usize>, f64)> {
    case["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let shape = t[1].as_array().unwrap();
            (
                t[0].as_str().unwrap().to_string(),
                shape.iter().map(|d| d.as_u64().unwrap() as usize).collect(),
                t[2].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The case's weights, drawn again, in a `.safetensors` under `dir`.
fn weights(case: &Value, dir: &Path) -> PathBuf {
    let seed = case["seed"].as_u64().unwrap();
    let tensors: HashMap<String, Tensor> = tensor_list(case)
        .into_iter()
        .map(|(name, shape, scale)| {
            let n = shape.iter().product();
            let values = if name == "pro" {
                vec![0.0; n]
            } else {
                draw(&name, seed, n, scale)
            };
            let t = Tensor::from_vec(values, shape, &Device::Cpu).unwrap();
            (name, t)
        })
        .collect();
    let path = dir.join(format!("{}.safetensors", case["name"].as_str().unwrap()));
    candle_core::safetensors::save(&tensors, &path).unwrap();
    path
}

/// Every fixture as a case with its weights drawn into `dir`: how the tests of all
/// families (Winograd's, CUDA's) take Real-CUGAN's.
pub(crate) fn cases(dir: &Path) -> Vec<(super::fixtures::Case, Value)> {
    manifest()
        .into_iter()
        .map(|c| {
            let case = super::fixtures::Case {
                name: c["name"].as_str().unwrap().to_string(),
                weights: weights(&c, dir),
                io: self::dir().join(c["io"].as_str().unwrap()),
                scale: match form(&c) {
                    Form::X3 => 3,
                    Form::X4 => 4,
                    Form::X2 | Form::X2Fast => 2,
                },
            };
            (case, c)
        })
        .collect()
}

fn form(case: &Value) -> Form {
    match case["form"].as_str().unwrap() {
        "x2" => Form::X2,
        "x3" => Form::X3,
        "x4" => Form::X4,
        _ => Form::X2Fast,
    }
}

fn f32_matches_float64_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for case in manifest() {
        let name = case["name"].as_str().unwrap();
        let ck =
            Checkpoint::load(&weights(&case, tmp.path())).unwrap_or_else(|e| panic!("{name}: {e}"));
        let Some(cfg) = config_of::<RealCuganConfig>(&ck.config) else {
            panic!("{name}: not read as Real-CUGAN: {:?}", ck.config);
        };
        assert_eq!(cfg.form, form(&case), "{name}");
        assert_eq!(cfg.pro, case["pro"].as_bool().unwrap(), "{name}");
        assert_eq!((cfg.in_channels, cfg.out_channels), (3, 3), "{name}");
        // The layout is the reference module's state dict, name for name.
        let mut ours = cfg.expected_tensors();
        ours.sort();
        let mut reference: Vec<_> = tensor_list(&case)
            .into_iter()
            .map(|(n, s, _)| (n, s))
            .collect();
        reference.sort();
        assert_eq!(ours, reference, "{name}: the tensors");
        assert_eq!(
            cfg.parameter_count() - usize::from(cfg.pro),
            case["parameters"].as_u64().unwrap() as usize,
            "{name}"
        );
        assert!(ck.config.whole_input_matters(), "{name}");
        seen.insert(format!("{:?}", cfg.form));
        seen.insert(format!("pro {}", cfg.pro));
        let model = Model::from_checkpoint(ck, DType::F32, &Device::Cpu).unwrap();
        let (input, expected) = load_io(&dir().join(case["io"].as_str().unwrap()));
        let out = model.net.forward(&input).unwrap();
        let d = max_abs_diff(&out, &expected);
        eprintln!("{name:<28} max |f32 - f64 reference| = {d:.3e}");
        if d.is_nan() || d > TOLERANCE {
            failures.push(format!("{name}: {d:.3e}"));
        }
    }
    assert!(failures.is_empty(), "over {TOLERANCE:e}: {failures:?}");
    for want in ["X2", "X3", "X4", "X2Fast", "pro true", "pro false"] {
        assert!(seen.contains(want), "no fixture covers {want}");
    }
}

#[test]
fn realcugan_f32_matches_float64_reference_on_every_fixture() {
    f32_matches_float64_reference();
}

/// The same with our kernels held to AVX2 (`UPSCALE_CPU_ISA=avx2`), the path of CPUs without
/// AVX-512.
#[test]
fn realcugan_f32_matches_float64_reference_on_every_fixture_capped_to_avx2() {
    use crate::ops::cpu::isa::{with_cpu_isa, CpuIsa};
    with_cpu_isa(CpuIsa::Avx2, f32_matches_float64_reference);
}

/// The same with no vector kernels at all: candle's operations, which must agree too.
#[test]
fn realcugan_f32_matches_float64_reference_on_candles_operations() {
    use crate::ops::cpu::isa::{with_cpu_isa, CpuIsa};
    with_cpu_isa(CpuIsa::Scalar, f32_matches_float64_reference);
}

/// bf16 on the CPU against the float64 reference, with the DRCT bounds; on a CPU without
/// bf16 arithmetic, bf16 must be refused instead.
#[test]
fn realcugan_cpu_bf16_stays_close_to_the_float64_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: Vec<_> = manifest()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                weights(c, tmp.path()),
                dir().join(c["io"].as_str().unwrap()),
            )
        })
        .collect();
    assert_bf16_close(&cases, 0.05, 45.0);
}

/// The gates' means are the whole map's, so tiles differ from the whole image by the
/// model's definition, and the tile planner keeps such images whole where memory allows.
/// Where it must tile they still blend: at least 45 dB against the whole image for this
/// random model (56 dB measured).
#[test]
fn realcugan_tiles_blend_to_the_whole_image() {
    let tmp = tempfile::tempdir().unwrap();
    let case = manifest()
        .into_iter()
        .find(|c| c["name"] == "realcugan_x2")
        .unwrap();
    let runs = [(weights(&case, tmp.path()), 48, 16)];
    super::fixtures::assert_tiles_blend_to_whole((40, 100, 96, 112), &runs, 45.0);
}

fn shapes_of(case: &Value) -> Shapes {
    tensor_list(case)
        .into_iter()
        .map(|(n, s, _)| (n, s))
        .collect()
}

/// `info`'s fields, and broken or foreign files named.
#[test]
fn realcugan_is_described_and_broken_files_are_named() {
    let cases = manifest();
    let by_name = |n: &str| cases.iter().find(|c| c["name"] == n).unwrap();
    let x4 = infer(&shapes_of(by_name("realcugan_x4_pro"))).unwrap();
    assert_eq!(x4.family(), "Real-CUGAN");
    assert_eq!(x4.variant(), "Real-CUGAN pro x4");
    assert_eq!((x4.scale(), x4.window()), (4, 2));
    let d = x4.describe();
    assert_eq!(
        (d["pro"].as_bool(), d["form"].as_str()),
        (Some(true), Some("x4"))
    );
    let fast = infer(&shapes_of(by_name("realcugan_x2_fast"))).unwrap();
    assert_eq!((fast.scale(), fast.window()), (2, 4));
    assert!(fast.refusal().is_none());

    // A missing tensor is named, with the architecture.
    let mut shapes = shapes_of(by_name("realcugan_x2"));
    shapes.remove("unet2.conv3.seblock.conv2.weight");
    let e = infer(&shapes).unwrap_err().to_string();
    assert!(
        e.starts_with("Real-CUGAN checkpoint: missing tensor unet2.conv3.seblock.conv2.weight"),
        "{e}"
    );
    // The fast x2 has no pro form: its `pro` is a tensor too many.
    let mut shapes = shapes_of(by_name("realcugan_x2_fast"));
    shapes.insert("pro".into(), vec![1]);
    let e = infer(&shapes).unwrap_err().to_string();
    assert!(e.contains("unexpected tensor pro"), "{e}");
    // A greyscale x2 loads for `info` and is refused when built.
    let mut grey = shapes_of(by_name("realcugan_x2"));
    for (name, shape) in grey.iter_mut() {
        if name == "unet1.conv1.conv.0.weight" || name == "unet2.conv1.conv.0.weight" {
            shape[1] = 1;
        }
        if name.ends_with("conv_bottom.weight") {
            let at = if name.starts_with("unet1") { 1 } else { 0 };
            shape[at] = 1;
        }
        if name.ends_with("conv_bottom.bias") {
            shape[0] = 1;
        }
    }
    let grey = infer(&grey).unwrap();
    let refusal = grey.refusal().unwrap();
    assert!(
        refusal.contains("1 input and 1 output channels"),
        "{refusal}"
    );
}

/// A 64x64 input through the x4 pro model, a run each at batch 1 and 2, the same output:
/// the gates' means are per image.
#[test]
fn realcugan_batch_members_are_independent() {
    let tmp = tempfile::tempdir().unwrap();
    let case = manifest()
        .into_iter()
        .find(|c| c["name"] == "realcugan_x4_pro")
        .unwrap();
    let model = Model::load(&weights(&case, tmp.path()), DType::F32, &Device::Cpu).unwrap();
    let (input, _) = load_io(&dir().join(case["io"].as_str().unwrap()));
    let pair = model.net.forward(&input).unwrap();
    let first = model.net.forward(&input.narrow(0, 0, 1).unwrap()).unwrap();
    let d = max_abs_diff(&pair.narrow(0, 0, 1).unwrap(), &first);
    assert!(d < 1e-5, "{d}");
}
