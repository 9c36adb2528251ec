//! The whole network on the GPU against the float64 reference and the CPU path.

use crate::model::Model;
use candle_core::{DType, Device};

use crate::tests::fixtures::*;

/// f32 on CUDA against the float64 reference and against the CPU; bf16 finite and close.
#[test]
fn cuda_f32_and_bf16_match_the_reference() {
    let gpu = super::gpu();
    for case in cases() {
        let (input, expected) = load_io(&case.io);
        let cpu = Model::load(&case.weights, DType::F32, &Device::Cpu).unwrap();
        let cpu_out = cpu.net.forward(&input).unwrap();
        let cuda = Model::load(&case.weights, DType::F32, &gpu).unwrap();
        let x = input.to_device(&gpu).unwrap();
        let out = cuda
            .net
            .forward(&x)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
        let d_ref = max_abs_diff(&out, &expected);
        let d_cpu = max_abs_diff(&out, &cpu_out);
        eprintln!(
            "{:<28} cuda f32: {d_ref:.3e} vs reference, {d_cpu:.3e} vs cpu",
            case.name
        );
        assert!(d_ref < TOLERANCE && d_cpu < 1e-4, "{}", case.name);
        let bf16 = Model::load(&case.weights, DType::BF16, &gpu).unwrap();
        let out16 = bf16
            .net
            .forward(&x)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
        let values = out16.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        assert!(
            values
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .all(|v| v.is_finite()),
            "bf16 NaN"
        );
        let rms = super::rms_diff(&out16, &expected);
        eprintln!(
            "{:<28} cuda bf16: max {:.3e}, rms {rms:.3e} vs reference",
            case.name,
            max_abs_diff(&out16, &expected)
        );
        // bf16 keeps 8 significant bits (~4e-3 relative per rounding); a wrong kernel or
        // layout lands at the scale of the output itself (~0.1 to 1).
        assert!(rms < 2e-2, "{}: bf16 rms error {rms}", case.name);
    }
}

/// `UPSCALE_CUDA_OFF`'s fallbacks, each part alone and all: candle's ops in place of ours, and
/// ours loaded from PTX rather than the built SASS, must give the same network, in f32 and
/// bf16 (the paths a user on a GPU where one of ours fails is told to take).
#[test]
fn cuda_with_our_paths_off_still_matches_the_reference() {
    use crate::switches::cuda_off::Off;
    let gpu = super::gpu();
    let parts = [
        Off {
            cublaslt: true,
            ..Off::default()
        },
        Off {
            rowwise: true,
            ..Off::default()
        },
        Off {
            sass: true,
            ..Off::default()
        },
        Off::ALL,
    ];
    for case in cases() {
        let (input, expected) = load_io(&case.io);
        let x = input.to_device(&gpu).unwrap();
        for off in parts {
            let run = |dtype: DType| {
                let model = crate::switches::with(
                    |s| s.cuda_off = off,
                    || Model::load(&case.weights, dtype, &gpu),
                );
                let out = model.unwrap().net.forward(&x).unwrap();
                out.to_device(&Device::Cpu).unwrap()
            };
            let d32 = max_abs_diff(&run(DType::F32), &expected);
            let rms16 = super::rms_diff(&run(DType::BF16), &expected);
            eprintln!(
                "{:<28} off {:<16} f32 {d32:.3e} max, bf16 {rms16:.3e} rms vs reference",
                case.name,
                off.names()
            );
            assert!(
                d32 < TOLERANCE,
                "{} with {} off: f32",
                case.name,
                off.names()
            );
            // NaN fails this too.
            assert!(rms16 < 2e-2, "{} with {} off: bf16", case.name, off.names());
        }
    }
}

/// Without `UPSCALE_PAD_CHANNELS`, DRCT on CUDA pads to 16 in bf16 and f16 (the measured
/// winner) and not in f32; `0` turns it off.
#[test]
fn cuda_pads_to_16_in_16_bit_unless_told_otherwise() {
    use crate::ops::pad::Pad;
    let gpu = super::gpu();
    let case = &cases()[0];
    let load = |dtype: DType, pad: Option<usize>| {
        let model = crate::switches::with(
            |s| s.pad_channels = pad,
            || Model::load(&case.weights, dtype, &gpu),
        );
        model.unwrap().net.padding()
    };
    assert_eq!(load(DType::BF16, None), Pad::to(16).unwrap());
    assert_eq!(load(DType::F16, None), Pad::to(16).unwrap());
    assert_eq!(load(DType::F32, None), Pad::OFF);
    assert_eq!(load(DType::BF16, Some(0)), Pad::OFF);
    assert_eq!(load(DType::BF16, Some(8)), Pad::to(8).unwrap());
}

/// `UPSCALE_PAD_CHANNELS` on CUDA: every channel width padded to 8, 16 and 64 with zeros, on
/// our kernels and with all of them off (candle's ops, the norms written out over the real
/// channels). f32 within the reference bound and near the unpadded GPU output (only the
/// order of the sums changes), bf16 as close as unpadded.
#[test]
fn cuda_padded_channels_match_the_reference() {
    use crate::ops::pad::Pad;
    use crate::switches::cuda_off::Off;
    let gpu = super::gpu();
    for case in cases() {
        let (input, expected) = load_io(&case.io);
        let x = input.to_device(&gpu).unwrap();
        let run = |pad: Pad, dtype: DType, off: Off| {
            let model = crate::switches::with(
                |s| {
                    s.pad_channels = Some(pad.multiple());
                    s.cuda_off = off;
                },
                || Model::load(&case.weights, dtype, &gpu),
            );
            let model = model.unwrap();
            assert_eq!(model.net.padding(), pad);
            let out = model.net.forward(&x).unwrap();
            out.to_device(&Device::Cpu).unwrap()
        };
        let plain = run(Pad::OFF, DType::F32, Off::default());
        for m in [8, 16, 64] {
            let pad = Pad::to(m).unwrap();
            for off in [Off::default(), Off::ALL] {
                let out = run(pad, DType::F32, off);
                let d_ref = max_abs_diff(&out, &expected);
                let d_plain = max_abs_diff(&out, &plain);
                let rms16 = super::rms_diff(&run(pad, DType::BF16, off), &expected);
                eprintln!(
                    "{:<28} pad {m:>2} off {:<24} f32 {d_ref:.3e} vs reference, \
                     {d_plain:.3e} vs unpadded; bf16 {rms16:.3e} rms",
                    case.name,
                    off.names()
                );
                let what = format!("{} pad {m} off '{}'", case.name, off.names());
                assert!(d_ref < TOLERANCE && d_plain < 1e-5, "{what}: f32");
                // NaN fails this too.
                assert!(rms16 < 2e-2, "{what}: bf16");
            }
        }
    }
}
