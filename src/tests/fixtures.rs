//! The golden fixtures (tests/golden/): each case's weights, input and the float64 reference
//! output of the official model, listed in manifest.json.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::checkpoint::Checkpoint;
use crate::model::Model;
use crate::nets::config_of;

/// A float32 port lands within ~3e-6 of the float64 reference; every bug class we know of
/// (tanh GELU, LayerNorm eps, bias index, mask, slopes, padding) lands above 5e-5.
pub const TOLERANCE: f64 = 2e-5;

pub fn golden_dir() -> PathBuf {
    crate::tests::repo().join("tests/golden")
}

pub struct Case {
    pub name: String,
    pub weights: PathBuf,
    pub io: PathBuf,
    pub scale: usize,
}

pub fn cases() -> Vec<Case> {
    manifest(&golden_dir())
        .into_iter()
        .map(|(case, _)| case)
        .collect()
}

/// Every case listed in `dir/manifest.json` (a list, or an object holding it under `cases`),
/// its paths joined to `dir`, with the entry itself for the fields a family adds.
pub fn manifest(dir: &Path) -> Vec<(Case, serde_json::Value)> {
    let text = std::fs::read_to_string(dir.join("manifest.json")).expect("manifest");
    let v: serde_json::Value = serde_json::from_str(&text).expect("manifest json");
    let list = v
        .get("cases")
        .and_then(|c| c.as_array())
        .or_else(|| v.as_array())
        .expect("manifest: a list of cases");
    list.iter()
        .map(|c| {
            let case = Case {
                name: c["name"].as_str().unwrap().to_string(),
                weights: dir.join(c["weights"].as_str().unwrap()),
                io: dir.join(c["io"].as_str().unwrap()),
                scale: c["scale"].as_u64().unwrap() as usize,
            };
            (case, c.clone())
        })
        .collect()
}

/// The families with fixtures of their own under tests/golden/ (DRCT's are at its top).
pub const FAMILIES: [&str; 14] = [
    "swinir",
    "swin2sr",
    "hat",
    "esrgan",
    "compact",
    "span",
    "dat",
    "plksr",
    "omnisr",
    "realcugan",
    "rcan",
    "mosr",
    "fdat",
    "safmn",
];

/// The cases of one family's fixtures (`""` for DRCT's), weights included: Real-CUGAN's
/// hold none and are drawn again into `tmp` (see `src/tests/realcugan.rs`).
pub fn family_cases(family: &str, tmp: &Path) -> Vec<(Case, serde_json::Value)> {
    if family == "realcugan" {
        super::realcugan::cases(tmp)
    } else {
        manifest(&golden_dir().join(family))
    }
}

/// One fixture as a family's check sees it ([`assert_every_fixture_matches`]): its manifest
/// entry, the checkpoint as read (a check may change its configuration where the file cannot
/// say it, as Compact's LeakyReLU), and its input and float64 reference output.
pub struct Fixture<'a> {
    pub name: &'a str,
    pub weights: &'a Path,
    pub entry: &'a serde_json::Value,
    pub checkpoint: Checkpoint,
    pub input: Tensor,
    pub expected: Tensor,
}

impl Fixture<'_> {
    /// The configuration the checkpoint was read as, which must be a `C`.
    pub fn config<C: 'static>(&self) -> &C {
        config_of::<C>(&self.checkpoint.config).unwrap_or_else(|| {
            panic!(
                "{}: not read as {}: {:?}",
                self.name,
                std::any::type_name::<C>(),
                self.checkpoint.config
            )
        })
    }

    /// The entry's number `key`.
    pub fn n(&self, key: &str) -> usize {
        let v = self.entry[key].as_u64();
        v.unwrap_or_else(|| panic!("{}: no number {key} in the manifest", self.name)) as usize
    }

    /// The entry's flag `key`.
    pub fn b(&self, key: &str) -> bool {
        let v = self.entry[key].as_bool();
        v.unwrap_or_else(|| panic!("{}: no flag {key} in the manifest", self.name))
    }
}

/// Every fixture in `dir`'s manifest against its float64 reference: `check` asserts what
/// the loader read (the configuration each was made with) and returns the labels of what the
/// fixture covers; each f32 output is within [`TOLERANCE`], and every label in `want` is
/// covered by some fixture (an entry's `weights_format`, where it names one, is a label too).
pub fn assert_every_fixture_matches(
    dir: &Path,
    want: &[&str],
    check: impl Fn(&mut Fixture) -> Vec<String>,
) {
    let mut failures = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (case, entry) in manifest(dir) {
        let name = &case.name;
        let checkpoint = Checkpoint::load(&case.weights).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (input, expected) = load_io(&case.io);
        let mut fixture = Fixture {
            name,
            weights: &case.weights,
            entry: &entry,
            checkpoint,
            input,
            expected,
        };
        seen.extend(check(&mut fixture));
        if let Some(format) = entry["weights_format"].as_str() {
            seen.insert(format.to_string());
        }
        let Fixture {
            checkpoint,
            input,
            expected,
            ..
        } = fixture;
        let model = Model::from_checkpoint(checkpoint, DType::F32, &Device::Cpu).unwrap();
        let d = max_abs_diff(&model.net.forward(&input).unwrap(), &expected);
        eprintln!("{name:<28} max |f32 - f64 reference| = {d:.3e}");
        if d.is_nan() || d > TOLERANCE {
            failures.push(format!("{name}: {d:.3e}"));
        }
    }
    assert!(failures.is_empty(), "over {TOLERANCE:e}: {failures:?}");
    for label in want {
        assert!(seen.contains(*label), "no fixture covers {label}: {seen:?}");
    }
}

/// Tests that run `check` natively, with our kernels held to AVX2 (the path of CPUs without
/// AVX-512, so that it is checked on every run of the tests) and, where a third name is
/// given, with no vector kernels at all (candle's operations, which must agree too).
macro_rules! on_each_cpu_path {
    ($check:path => $native:ident, $avx2:ident $(, $scalar:ident)?) => {
        #[test]
        fn $native() {
            $check()
        }

        #[test]
        fn $avx2() {
            use $crate::ops::cpu::isa::{with_cpu_isa, CpuIsa};
            with_cpu_isa(CpuIsa::Avx2, $check)
        }

        $(
            #[test]
            fn $scalar() {
                use $crate::ops::cpu::isa::{with_cpu_isa, CpuIsa};
                with_cpu_isa(CpuIsa::Scalar, $check)
            }
        )?
    };
}
pub(crate) use on_each_cpu_path;

pub fn load_io(path: &Path) -> (Tensor, Tensor) {
    let t = candle_core::safetensors::load(path, &Device::Cpu).expect("io fixture");
    (t["input"].clone(), t["output"].clone())
}

/// The largest difference of two same-shape tensors, on any devices.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let f64_on_cpu = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
    };
    max_abs(&(f64_on_cpu(a) - f64_on_cpu(b)).unwrap())
}

/// Every value of `t` (any device, any float dtype) as f32 on the host, flattened.
pub fn f32_values(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// The bits of every value of `t` as f32 ([`f32_values`]): what a test compares when two
/// paths must agree to the bit.
pub fn f32_bits(t: &Tensor) -> Vec<u32> {
    f32_values(t).iter().map(|v| v.to_bits()).collect()
}

/// The largest magnitude in `t`, in f64, on its own device.
pub fn max_abs(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Panics unless `out`, the output of the model in `weights` for `input` with bf16 products
/// on the CPU, differs from its f32 output: the same output would mean that no layer packed
/// its weights for bf16 products at load.
pub fn assert_bf16_products(name: &str, weights: &Path, input: &Tensor, out: &Tensor) {
    let f32 = crate::model::Model::load(weights, DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let want = candle_core::Module::forward(&*f32.net, input).unwrap();
    let d = max_abs_diff(out, &want);
    assert!(d > 0.0, "{name}: bf16 gave the f32 output");
}

/// PSNR in dB of `a` against `b` over the [0, 1] range, in f64.
pub fn psnr_unit(a: &Tensor, b: &Tensor) -> f64 {
    let mse = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    -10.0 * mse.log10()
}

/// bf16 on the CPU against the float64 reference for each (name, weights, io): activations
/// stay f32, the output is not the f32 one, no value is off by more than `max_abs` and the
/// PSNR is at least `min_psnr` dB. On a CPU without bf16 arithmetic the first model must
/// refuse bf16 with an error naming the instructions instead.
pub fn assert_bf16_close(cases: &[(String, PathBuf, PathBuf)], max_abs: f64, min_psnr: f64) {
    if !crate::ops::cpu::bf16::supported() {
        let err = crate::model::Model::load(&cases[0].1, DType::BF16, &Device::Cpu)
            .err()
            .expect("bf16 without bf16 instructions must be refused");
        assert!(err.to_string().contains("AVX512-BF16"), "{err}");
        eprintln!("this CPU has no bf16 arithmetic: checked that bf16 is refused");
        return;
    }
    let mut failures = Vec::new();
    for (name, weights, io) in cases {
        let model = crate::model::Model::load(weights, DType::BF16, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let (input, expected) = load_io(io);
        let out = candle_core::Module::forward(&*model.net, &input).unwrap();
        assert_eq!(out.dtype(), DType::F32, "{name}: activations stay f32");
        assert_bf16_products(name, weights, &input, &out);
        let d = max_abs_diff(&out, &expected);
        let psnr = psnr_unit(&out, &expected);
        eprintln!("{name:<28} bf16: max |bf16 - f64| = {d:.3e}, PSNR {psnr:.1} dB");
        if !(d <= max_abs && psnr >= min_psnr) {
            failures.push(format!("{name}: max {d:.3e}, {psnr:.1} dB"));
        }
    }
    assert!(failures.is_empty(), "bf16 out of tolerance: {failures:?}");
}

/// [`assert_bf16_close`] on every fixture of `dir`'s manifest.
pub fn assert_bf16_close_in(dir: &Path, max_abs: f64, min_psnr: f64) {
    let cases: Vec<_> = manifest(dir)
        .into_iter()
        .map(|(c, _)| (c.name, c.weights, c.io))
        .collect();
    assert_bf16_close(&cases, max_abs, min_psnr);
}

/// Hann-blended tiles against the whole image through the command line's path (the engine's
/// lanes, f32 on the CPU), on the `h` x `w` crop at (`top`, `left`) of tests/photos/coffee.png,
/// for each (weights, tile, overlap): at least `min_db` dB.
pub fn assert_tiles_blend_to_whole(
    crop: (usize, usize, usize, usize),
    runs: &[(PathBuf, usize, usize)],
    min_db: f64,
) {
    use crate::checkpoint::Checkpoint;
    use crate::engine::lanes::Lanes;
    use crate::engine::Engine;
    use crate::io::{Decoded, Format};
    use crate::metrics::{psnr, Measure};
    use crate::planar::Planar;
    use crate::tile::auto::{TileChoice, TileSettings};
    let photo = crate::io::decode(&crate::tests::repo().join("tests/photos/coffee.png"))
        .unwrap()
        .rgb;
    let (top, left, h, w) = crop;
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
    for (weights, tile, overlap) in runs {
        let name = weights.file_stem().unwrap().to_string_lossy();
        let engine =
            Engine::new(Checkpoint::load(weights).unwrap(), Device::Cpu, DType::F32).unwrap();
        let lanes = Lanes::single(engine);
        let settings = |tile| TileSettings {
            choice: TileChoice::Fixed(tile),
            overlap: *overlap,
            batch: Some(2),
            blend: crate::tile::BlendMode::Hann,
            tta: false,
        };
        let whole = lanes.upscale_decoded(&dec, &settings(0)).unwrap().rgb;
        let tiled = lanes.upscale_decoded(&dec, &settings(*tile)).unwrap().rgb;
        let db = psnr(&tiled, &whole, 0, Measure::Rgb).unwrap();
        eprintln!("{name:<20} tiled ({tile}, overlap {overlap}, Hann) vs whole: {db:.1} dB");
        assert!(db >= min_db, "{name}: {db:.1} dB");
    }
}

/// The model in `weights` builds its shift masks once per input size: a second forward pass
/// on `io`'s input reuses them and gives the same output.
pub fn assert_shift_masks_cached(weights: &Path, io: &Path) {
    let model = crate::model::Model::load(weights, DType::F32, &Device::Cpu).unwrap();
    let (input, _) = load_io(io);
    let a = model.net.forward(&input).unwrap();
    assert_eq!(model.net.cached_masks(), 1);
    let b = model.net.forward(&input).unwrap();
    assert_eq!(model.net.cached_masks(), 1);
    assert_eq!(max_abs_diff(&a, &b), 0.0);
}
