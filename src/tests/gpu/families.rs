//! Every architecture other than DRCT on CUDA, on the committed fixtures of its family
//! (tests/golden/<family>/): f32 against the float64 reference with the bound the CPU is held
//! to, bf16 and fp16 finite and close. The DRCT fixtures are in [`super::parity`].

use std::sync::Arc;

use candle_core::DType;

use crate::checkpoint::Checkpoint;
use crate::model::Model;
use crate::nets::compact::{Activation, CompactConfig};
use crate::nets::config_of;
use crate::tests::fixtures::*;

/// The fixture's checkpoint, read as `upscale` reads it, except that Compact's LeakyReLU
/// fixture (which a file cannot tell from ReLU) is set to what it was made with.
fn checkpoint(
    weights: &std::path::Path,
    entry: &serde_json::Value,
) -> Result<Checkpoint, crate::checkpoint::ModelError> {
    let mut ck = Checkpoint::load(weights)?;
    if entry["activation"].as_str() == Some("leakyrelu") {
        if let Some(cfg) = config_of::<CompactConfig>(&ck.config) {
            let mut c = cfg.clone();
            c.activation = Activation::LeakyRelu;
            ck.config = Arc::new(c);
        }
    }
    Ok(ck)
}

#[test]
fn every_family_matches_the_reference_on_cuda_in_each_precision() {
    let gpu = super::gpu();
    let mut failures = Vec::new();
    let tmp = tempfile::tempdir().unwrap();
    for family in FAMILIES {
        let cases = family_cases(family, tmp.path());
        assert!(!cases.is_empty(), "no {family} fixtures");
        for (case, entry) in cases {
            let (input, expected) = load_io(&case.io);
            let x = input.to_device(&gpu).unwrap();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let what = format!("{family} {} {dtype:?}", case.name);
                let model = checkpoint(&case.weights, &entry)
                    .map_err(|e| e.to_string())
                    .and_then(|ck| {
                        Model::from_checkpoint(ck, dtype, &gpu).map_err(|e| e.to_string())
                    });
                let out = match model {
                    Ok(model) => model.net.forward(&x).and_then(|y| y.to_dtype(DType::F32)),
                    Err(e) => {
                        failures.push(format!("{what}: {e}"));
                        continue;
                    }
                };
                let out = match out {
                    Ok(out) => out,
                    Err(e) => {
                        failures.push(format!("{what}: {e}"));
                        continue;
                    }
                };
                let (max, rms) = (
                    max_abs_diff(&out, &expected),
                    super::rms_diff(&out, &expected),
                );
                eprintln!("{what:<48} max {max:.3e}, rms {rms:.3e} vs the float64 reference");
                // f32: the CPU's bound (only the order of the sums differs). bf16 and fp16 keep
                // 8 and 11 significant bits (about 4e-3 and 5e-4 relative per rounding); a wrong
                // kernel or layout lands at the scale of the output itself (0.1 to 1). NaN
                // fails both.
                let ok = match dtype {
                    DType::F32 => max < TOLERANCE,
                    _ => rms < 2e-2,
                };
                if !ok {
                    failures.push(format!("{what}: max {max:.3e}, rms {rms:.3e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
