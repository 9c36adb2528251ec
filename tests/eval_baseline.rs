//! The project's own quality gate: the shipped default model on the committed held-out photos
//! must not lose PSNR against the committed baseline (tests/photos/baseline_x4.json), with the
//! default inference settings, the configuration that ships.
//!
//! After an intended change of model or settings, rewrite the baseline with:
//! `upscale eval --hr tests/photos --scale 4 --write_baseline tests/photos/baseline_x4.json`

#![cfg(feature = "embedded-model")]

use std::path::Path;

#[test]
fn default_model_holds_its_baseline_and_beats_bicubic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_upscale"))
        .current_dir(root)
        .args([
            "eval",
            "--hr",
            "tests/photos",
            "--scale",
            "4",
            "--device",
            "cpu",
        ])
        .args(["--baseline", "tests/photos/baseline_x4.json", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "quality gate failed:\n{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["images"].as_array().unwrap().len(), 4);
    let gain = report["mean_gain_y"].as_f64().unwrap();
    // The model card promises at least +1.2 dB Y-PSNR over MATLAB bicubic on these photos.
    assert!(
        gain >= 1.2,
        "the default model must beat bicubic by 1.2 dB, gained {gain} dB"
    );
}
