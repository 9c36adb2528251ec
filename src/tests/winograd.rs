//! Winograd's F(4x4, 3x3) for the f32 3x3 convolutions on the CPU (`UPSCALE_CPU_WINOGRAD`):
//! every committed fixture of every family, each of its convolutions taken that way whatever
//! its width, against the float64 reference with the same bound as the direct convolution.

use candle_core::{DType, Device};

use super::fixtures::{f32_bits, family_cases, load_io, max_abs_diff, TOLERANCE};
use crate::checkpoint::Checkpoint;
use crate::model::Model;
use crate::nets::compact::{Activation, CompactConfig};
use crate::nets::config_of;

#[test]
fn every_family_matches_float64_reference_with_winograd_convolutions() {
    if !crate::ops::cpu::panels::available() {
        eprintln!("skipped: no AVX2 here, Winograd runs on the panel kernels");
        return;
    }
    let families = std::iter::once("").chain(super::fixtures::FAMILIES);
    let tmp = tempfile::tempdir().unwrap();
    let (mut failures, mut changed) = (Vec::new(), 0);
    for family in families {
        for (case, _) in family_cases(family, tmp.path()) {
            let name = format!("{family}/{}", case.name);
            let (input, expected) = load_io(&case.io);
            let run = |on: bool| {
                crate::switches::with(
                    |s| s.winograd = Some(on),
                    || {
                        let mut ck = Checkpoint::load(&case.weights).unwrap();
                        if case.name == "compact_x1_leakyrelu" {
                            // The file reads as ReLU; the model was made with LeakyReLU.
                            let mut c = config_of::<CompactConfig>(&ck.config).unwrap().clone();
                            c.activation = Activation::LeakyRelu;
                            ck.config = std::sync::Arc::new(c);
                        }
                        let model = Model::from_checkpoint(ck, DType::F32, &Device::Cpu).unwrap();
                        model.net.forward(&input).unwrap()
                    },
                )
            };
            let (on, off) = (run(true), run(false));
            let d = max_abs_diff(&on, &expected);
            eprintln!("{name:<32} max |winograd - f64 reference| = {d:.3e}");
            if d.is_nan() || d > TOLERANCE {
                failures.push(format!("{name}: {d:.3e}"));
            }
            // The switch reached the convolutions: the rounding differs from the direct sum.
            changed += usize::from(f32_bits(&on) != f32_bits(&off));
        }
    }
    assert!(failures.is_empty(), "over {TOLERANCE:e}: {failures:?}");
    assert!(
        changed > 20,
        "only {changed} fixtures changed with the switch"
    );
}
