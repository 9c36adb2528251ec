//! Parity with the float64 reference (spandrel's DRCT, which matches the official code) on the
//! committed fixtures in tests/golden/. Each case's weights, input and unclamped reference
//! output were written by tests/golden/make_golden.py; no torch is needed here.

use crate::checkpoint::Checkpoint;

use crate::model::Model;
use crate::ops::pad::Pad;
use candle_core::{DType, Device, Tensor};

use super::fixtures::*;

#[test]
fn f32_matches_float64_reference_on_every_fixture() {
    f32_matches_float64_reference_on_every_fixture_here();
}

/// The same with our kernels held to AVX2 (`UPSCALE_CPU_ISA=avx2`), the path of CPUs without
/// AVX-512, so that it is checked on every run of the tests.
#[test]
fn f32_matches_float64_reference_on_every_fixture_capped_to_avx2() {
    use crate::ops::cpu::isa::{with_cpu_isa, CpuIsa};
    with_cpu_isa(
        CpuIsa::Avx2,
        f32_matches_float64_reference_on_every_fixture_here,
    );
}

fn f32_matches_float64_reference_on_every_fixture_here() {
    let cases = cases();
    assert!(cases.len() >= 5, "expected at least five golden cases");
    let mut scales = std::collections::BTreeSet::new();
    let mut failures = Vec::new();
    for case in &cases {
        let model = Model::load(&case.weights, DType::F32, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(model.config().scale(), case.scale, "{}: scale", case.name);
        scales.insert(case.scale);
        let (input, expected) = load_io(&case.io);
        let out = model.net.forward(&input).unwrap();
        let d = max_abs_diff(&out, &expected);
        eprintln!("{:<28} max |f32 - f64 reference| = {d:.3e}", case.name);
        if d.is_nan() || d > TOLERANCE {
            failures.push(format!("{}: {d:.3e}", case.name));
        }
    }
    assert!(failures.is_empty(), "over {TOLERANCE:e}: {failures:?}");
    assert!(scales.is_superset(&[2, 3, 4].into_iter().collect()));
}

/// bf16 on the CPU (bf16 weights and matrix-product operands, f32 sums and everything else
/// f32) against the float64 reference, on every fixture and the default model. Stated
/// tolerance: PSNR over the [0, 1] range of at least [`BF16_MIN_PSNR`] dB and no value off by
/// more than [`BF16_MAX_ABS`], and not the f32 output (which is within those bounds too). On
/// a CPU without bf16 arithmetic the model must refuse bf16 with a clear error instead.
#[test]
fn cpu_bf16_stays_close_to_the_float64_reference() {
    assert_bf16_close(&all_cases(), BF16_MAX_ABS, BF16_MIN_PSNR);
}

/// Every fixture and the default model: the golden cases' weights, input and float64 output.
fn all_cases() -> Vec<(String, std::path::PathBuf, std::path::PathBuf)> {
    let mut cases: Vec<_> = cases()
        .into_iter()
        .map(|c| (c.name, c.weights, c.io))
        .collect();
    cases.push((
        "default_x4".into(),
        crate::tests::repo().join("models/default_x4.safetensors"),
        golden_dir().join("default_x4.io.safetensors"),
    ));
    cases
}

/// One case run with and without channel padding.
struct PaddedRun {
    name: String,
    /// The float64 reference output.
    expected: Tensor,
    plain: Tensor,
    /// The output padded to each of 8, 16 and 64.
    padded: Vec<(usize, Tensor)>,
}

/// Every fixture and the default model run in `dtype` on the CPU, with and without padding.
fn padded_outputs(dtype: DType) -> Vec<PaddedRun> {
    all_cases()
        .into_iter()
        .map(|(name, weights, io)| {
            let ck = Checkpoint::load(&weights).unwrap();
            let (input, expected) = load_io(&io);
            let run = |pad: Pad| {
                let model = crate::switches::with(
                    |s| s.pad_channels = Some(pad.multiple()),
                    || Model::from_checkpoint(ck.clone(), dtype, &Device::Cpu),
                )
                .unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(model.net.padding(), pad);
                model.net.forward(&input).unwrap()
            };
            let plain = run(Pad::OFF);
            let padded = [8, 16, 64]
                .into_iter()
                .map(|m| (m, run(Pad::to(m).unwrap())))
                .collect();
            PaddedRun {
                name,
                expected,
                plain,
                padded,
            }
        })
        .collect()
}

/// `UPSCALE_PAD_CHANNELS` in f32: zero-padded channels are exact arithmetic, so the padded
/// network stays within the f32 bound of the float64 reference, and within
/// [`PADDED_F32_BOUND`] (relative to the output's largest magnitude) of the unpadded f32
/// output: only the order of the sums changes (other GEMM blockings over longer rows, other
/// vector lanes in the norms).
#[test]
fn padded_channels_keep_the_f32_output() {
    let mut failures = Vec::new();
    for PaddedRun {
        name,
        expected,
        plain,
        padded,
    } in padded_outputs(DType::F32)
    {
        for (m, out) in padded {
            let d_ref = max_abs_diff(&out, &expected);
            let d_plain = max_abs_diff(&out, &plain);
            let range = max_abs_diff(&expected, &expected.zeros_like().unwrap());
            let relative = d_plain / range;
            eprintln!(
                "{name:<28} pad {m:>2}: max |padded - f64| = {d_ref:.3e}, \
                 max |padded - unpadded| = {d_plain:.3e} ({relative:.2e} of max |y| {range:.2})"
            );
            if !(d_ref <= TOLERANCE && relative <= PADDED_F32_BOUND) {
                failures.push(format!("{name} pad {m}: {d_ref:.3e}, {d_plain:.3e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

/// See [`padded_channels_keep_the_f32_output`]. Measured: at most 1.8e-6 (2.6e-6 absolute on
/// outputs up to 2.2; 8.7e-7 before the element-wise polynomials and the Winograd transforms
/// became FMAs), about as far as the f32 output itself lies from the float64 one (up to
/// 2e-6): rounding in another order, a few f32 ulps. Layer norms that divide by the padded
/// width instead of the real one land 0.12 to 1.5 off.
const PADDED_F32_BOUND: f64 = 3e-6;

/// `UPSCALE_PAD_CHANNELS` with bf16 products on the CPU (padded weights packed in bf16, the
/// norms in f32) and with f16 (candle's ops, the norms written out over the real channels):
/// the same bars against the float64 reference as unpadded, and close to the unpadded output
/// of the same dtype.
#[test]
fn padded_channels_keep_the_bf16_and_f16_outputs() {
    let mut failures = Vec::new();
    let dtypes = if crate::ops::cpu::bf16::supported() {
        vec![DType::BF16, DType::F16]
    } else {
        eprintln!("this CPU has no bf16 arithmetic: f16 only");
        vec![DType::F16]
    };
    for dtype in dtypes {
        for PaddedRun {
            name,
            expected,
            plain,
            padded,
        } in padded_outputs(dtype)
        {
            for (m, out) in padded {
                let d_ref = max_abs_diff(&out, &expected);
                let d_plain = max_abs_diff(&out, &plain);
                eprintln!(
                    "{name:<28} {dtype:?} pad {m:>2}: max |padded - f64| = {d_ref:.3e}, \
                     max |padded - unpadded| = {d_plain:.3e}"
                );
                let bound = if dtype == DType::BF16 {
                    BF16_MAX_ABS
                } else {
                    F16_CPU_MAX_ABS
                };
                if !(d_ref <= bound && d_plain <= bound) {
                    failures.push(format!(
                        "{name} {dtype:?} pad {m}: {d_ref:.3e}, {d_plain:.3e}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

/// See [`cpu_bf16_stays_close_to_the_float64_reference`]: bf16 keeps 8 significant bits, so
/// single values may move by a few 1e-3 while the image as a whole stays far above what the
/// eye or an 8-bit file can show (an 8-bit quantisation alone is ~59 dB).
const BF16_MIN_PSNR: f64 = 45.0;
const BF16_MAX_ABS: f64 = 0.05;

/// The largest difference f16 weights and activations on the CPU may make to an output (a
/// path no user reaches: the library computes fp32 on the CPU when fp16 is asked for). On
/// x86 the `gemm` crate sums f16 products in f32; on aarch64 with half-precision arithmetic
/// (every ARMv8.2 core: Apple Silicon, Graviton 2 on) it sums them in f16, whose 11-bit
/// significand moved the fixtures' outputs by 1.0e-2 to 2.5e-2 under qemu.
const F16_CPU_MAX_ABS: f64 = if cfg!(target_arch = "aarch64") {
    0.03
} else {
    0.01
};

#[test]
fn f16_weights_stay_close() {
    // f16 weights are converted at load and, on the CPU, the arithmetic runs in f16 too; the
    // bar is loose, but a broken conversion or a dtype mix-up lands far outside it.
    let case = &cases()[0];
    let (input, expected) = load_io(&case.io);
    let model = Model::load(&case.weights, DType::F16, &Device::Cpu).unwrap();
    let out = model.net.forward(&input).unwrap();
    assert_eq!(out.dtype(), DType::F16);
    let d = max_abs_diff(&out, &expected);
    eprintln!("{} f16: {d:.3e}", case.name);
    assert!(d < F16_CPU_MAX_ABS, "f16: {d}");
}

#[test]
fn shift_masks_are_cached_per_size() {
    let case = &cases()[0];
    assert_shift_masks_cached(&case.weights, &case.io);
}

fn all_finite(t: &Tensor) -> bool {
    crate::tests::fixtures::f32_values(t)
        .iter()
        .all(|v| v.is_finite())
}

#[test]
fn fp16_overflow_is_redone_in_fp32_for_that_tile_only() {
    use crate::checkpoint::Checkpoint;
    use crate::engine::Engine;
    // A batch of two tiles: the fixture's input, and the same input scaled past fp16's 65504
    // (far from f32's limit). In fp16 only the second tile's output becomes inf/NaN; the guard
    // must redo that tile, and only that one, in f32.
    let case = &cases()[0];
    let ck = Checkpoint::load(&case.weights).unwrap();
    let (input, _) = load_io(&case.io);
    let batch = Tensor::cat(&[&input, &(&input * 1e5).unwrap()], 0).unwrap();

    let raw16 = Model::from_checkpoint(ck.clone(), DType::F16, &Device::Cpu).unwrap();
    let y16 = raw16.net.forward(&batch).unwrap();
    assert!(
        all_finite(&y16.get(0).unwrap()),
        "the flat tile must stay finite"
    );
    assert!(
        !all_finite(&y16.get(1).unwrap()),
        "the planted overflow must break plain fp16"
    );

    let guarded = Engine::new(ck.clone(), Device::Cpu, DType::F16).unwrap();
    let y = guarded.forward(&batch).unwrap();
    assert_eq!(
        guarded.fp16_overflows(),
        1,
        "only the broken tile is redone"
    );
    let reference = Engine::new(ck, Device::Cpu, DType::F32)
        .unwrap()
        .forward(&batch)
        .unwrap();
    // The broken tile is the f32 result; the other kept its fp16 output.
    assert_eq!(
        max_abs_diff(&y.get(1).unwrap(), &reference.get(1).unwrap()),
        0.0
    );
    assert_eq!(max_abs_diff(&y.get(0).unwrap(), &y16.get(0).unwrap()), 0.0);
}

#[test]
fn auto_tiles_whole_small_images_and_tiles_huge_ones() {
    use crate::checkpoint::Checkpoint;
    use crate::engine::Engine;
    use crate::tile::auto::{TileChoice, TileSettings};
    let case = &cases()[0];
    let engine = Engine::new(
        Checkpoint::load(&case.weights).unwrap(),
        Device::Cpu,
        DType::F32,
    )
    .unwrap();
    let settings = TileSettings {
        choice: TileChoice::Auto,
        overlap: 16,
        batch: None,
        blend: Default::default(),
        tta: false,
    };
    let small = engine.tile_options(&settings, 64, 48);
    assert_eq!(small.tile, 0, "a small image runs whole");
    assert!(
        !engine.cost_was_measured(),
        "a small image paid for a probe forward pass"
    );
    let cost = engine.bytes_per_pixel();
    // At least the attention scores of one block per pixel: heads x window^2 floats.
    assert!(
        cost > 64.0 * 4.0,
        "measured cost {cost} B/pixel is implausibly small"
    );
    // 40000 x 40000 pixels cannot fit in any machine's free memory at this cost.
    let huge = engine.tile_options(&settings, 40_000, 40_000);
    assert!(huge.tile > 0 && huge.tile < 40_000, "{huge:?}");
    assert_eq!(huge.tile % 8, 0, "tiles are window multiples");
    let bytes = (huge.tile * huge.tile * huge.batch) as f64 * cost;
    assert!(
        bytes <= engine.free_memory() as f64,
        "{huge:?} needs {bytes} bytes"
    );
    // On the CPU the plan stays within 4 GiB (half of it for one pass's activations), however
    // much memory is free: larger tiles are no faster there.
    let (h, w) = (1024, 1024);
    let big = engine.tile_options(&settings, h, w);
    let pass = if big.tile == 0 {
        h * w
    } else {
        big.tile.min(h) * big.tile.min(w) * big.batch
    };
    let bytes = pass as f64 * cost;
    assert!(bytes <= (2u64 << 30) as f64, "{big:?} needs {bytes} bytes");
}

/// The shipped default model against its float64 reference (made by
/// models/make_parity_fixture.py from the committed weights).
#[test]
fn default_model_matches_float64_reference() {
    let root = crate::tests::repo();
    let model = Model::load(
        &root.join("models/default_x4.safetensors"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let (input, expected) = load_io(&golden_dir().join("default_x4.io.safetensors"));
    let out = model.net.forward(&input).unwrap();
    let d = max_abs_diff(&out, &expected);
    eprintln!("default_x4 max |f32 - f64 reference| = {d:.3e}");
    assert!(d < TOLERANCE, "{d}");
}

/// The binary carries exactly the committed file.
#[cfg(feature = "embedded-model")]
#[test]
fn embedded_model_is_the_committed_file() {
    let root = crate::tests::repo();
    let file = std::fs::read(root.join("models/default_x4.safetensors")).unwrap();
    let (_, bytes) = crate::engine::embedded_model().unwrap();
    assert!(bytes == file.as_slice());
}

/// `--tta` is the mean of the eight symmetric runs, each mapped back: an input and its mirror
/// image give mirrored outputs, and the ensemble stays close to the plain output (a symmetry
/// undone the wrong way would land far from it).
#[test]
fn self_ensemble_is_symmetric_and_close_to_the_plain_output() {
    use crate::engine::lanes::Lanes;
    use crate::engine::Engine;
    use crate::io::{Decoded, Format};
    use crate::planar::Planar;
    use crate::tile::auto::{TileChoice, TileSettings};

    // The trained default model: a random-weight fixture has no reason to be near-symmetric.
    let (input, _) = load_io(&golden_dir().join("default_x4.io.safetensors"));
    let (_, c, h, w) = input.dims4().unwrap();
    let rgb = Planar::new(c, h, w, input.flatten_all().unwrap().to_vec1().unwrap());
    let weights = crate::tests::repo().join("models/default_x4.safetensors");
    let engine = Engine::new(
        crate::checkpoint::Checkpoint::load(&weights).unwrap(),
        Device::Cpu,
        DType::F32,
    )
    .unwrap();
    let lanes = Lanes::single(engine);
    let settings = |tta| TileSettings {
        choice: TileChoice::Fixed(0),
        overlap: 0,
        batch: None,
        blend: Default::default(),
        tta,
    };
    let run = |img: &Planar, tta: bool| {
        let dec = Decoded {
            rgb: img.clone(),
            alpha: None,
            gray: false,
            bit_depth: 8,
            format: Format::Png,
            metadata: Default::default(),
        };
        lanes.upscale_decoded(&dec, &settings(tta)).unwrap().rgb
    };
    let plain = run(&rgb, false);
    let ens = run(&rgb, true);
    let mirrored = run(&rgb.transformed(1), true);
    let diff = |a: &Planar, b: &Planar| {
        a.data
            .iter()
            .zip(&b.data)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    assert!(diff(&mirrored.transformed(1), &ens) < 1e-5, "not symmetric");
    let d = diff(&ens, &plain);
    assert!(d > 0.0 && d < 0.1, "ensemble vs plain: {d}");
}
