//! OmniSR: parity with the float64 reference (spandrel's OmniSR) on the committed fixtures in
//! tests/golden/omnisr/ (written by tests/golden/make_golden_omnisr.py), bf16 on the CPU,
//! tiling, and what the loader reads from the files.

use std::path::PathBuf;

use super::fixtures::{
    assert_bf16_close_in, assert_every_fixture_matches, assert_tiles_blend_to_whole,
    on_each_cpu_path,
};
use crate::checkpoint::Checkpoint;
use crate::nets::omnisr::OmniSrConfig;
use crate::nets::{config_of, NetConfig};

fn dir() -> PathBuf {
    crate::tests::repo().join("tests/golden/omnisr")
}

/// Every fixture read as the configuration it was made with, and within the f32 bound of
/// the reference.
fn f32_matches_float64_reference() {
    let want = [
        "x1",
        "x2",
        "x3",
        "x4",
        "window 4",
        "window 8",
        "position bias true",
        "position bias false",
        "bias true",
        "bias false",
        "padded true",
        "padded false",
        "safetensors",
        "pth-plain",
        "pth-params",
        "pth-ema",
    ];
    assert_every_fixture_matches(&dir(), &want, |f| {
        let (name, cfg) = (f.name, f.config::<OmniSrConfig>());
        assert_eq!(
            (
                cfg.scale,
                cfg.features,
                cfg.groups,
                cfg.blocks,
                cfg.window,
                cfg.position_bias,
                cfg.bias
            ),
            (
                f.n("scale"),
                f.n("features"),
                f.n("groups"),
                f.n("blocks"),
                f.n("window"),
                f.b("position_bias"),
                f.b("bias")
            ),
            "{name}"
        );
        let padded = f.n("input_h") % cfg.window != 0 || f.n("input_w") % cfg.window != 0;
        vec![
            format!("x{}", cfg.scale),
            format!("window {}", cfg.window),
            format!("position bias {}", cfg.position_bias),
            format!("bias {}", cfg.bias),
            format!("padded {padded}"),
        ]
    });
}

on_each_cpu_path!(f32_matches_float64_reference =>
    omnisr_f32_matches_float64_reference_on_every_fixture,
    omnisr_f32_matches_float64_reference_on_every_fixture_capped_to_avx2,
    omnisr_f32_matches_float64_reference_on_candles_operations);

/// bf16 on the CPU against the float64 reference, with the DRCT bounds; on a CPU without
/// bf16 arithmetic, bf16 must be refused instead.
#[test]
fn omnisr_cpu_bf16_stays_close_to_the_float64_reference() {
    assert_bf16_close_in(&dir(), 0.05, 45.0);
}

/// Hann-blended tiles against the whole image through the command line's path. The grid
/// attentions and ESA see the whole map they are given, so tiles differ from the whole
/// image by the model's own definition (the planner keeps such images whole where memory
/// allows); the bound still catches a misplaced or unblended tile.
#[test]
fn omnisr_tiles_blend_to_the_whole_image() {
    let files = [("omnisr_x2_no_bias.safetensors", 64, 24)]
        .map(|(file, tile, overlap)| (dir().join(file), tile, overlap));
    assert_tiles_blend_to_whole((40, 100, 96, 112), &files, 20.0);
}

/// `info` names the configuration; FLOP counter tensors are ignored; a missing block and a
/// stray tensor are named.
#[test]
fn omnisr_is_described_and_broken_files_are_named() {
    let ck = Checkpoint::load(&dir().join("omnisr_x3_w4.pth")).unwrap();
    assert_eq!(ck.wrapper.as_deref(), Some("params"));
    assert_eq!(ck.config.family(), "OmniSR");
    assert_eq!(ck.config.describe()["window"], 4);
    assert_eq!(ck.config.describe()["position_bias"], true);

    let x4 = released(4);
    let shapes: crate::nets::infer::Shapes = x4.expected_tensors().into_iter().collect();
    let mut counted = shapes.clone();
    counted.insert("total_ops".into(), vec![1]);
    counted.insert("residual_layer.0.esa.total_params".into(), vec![1]);
    let back = crate::nets::registry::infer(&counted).unwrap();
    assert_eq!(config_of::<OmniSrConfig>(&back), Some(&x4));
    let mut missing = shapes.clone();
    missing.retain(|k, _| !k.starts_with("residual_layer.3.residual_layer.0.layer.11."));
    let e = crate::nets::registry::infer(&missing)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("OmniSR checkpoint: missing tensor residual_layer.3.residual_layer.0.layer.11."),
        "{e}"
    );
    let mut extra = shapes.clone();
    extra.insert(
        "residual_layer.1.esa.conv5.weight".into(),
        vec![64, 16, 1, 1],
    );
    let e = crate::nets::registry::infer(&extra)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unexpected tensor residual_layer.1.esa.conv5.weight"),
        "{e}"
    );
    let mut scalar = shapes.clone();
    let table = "residual_layer.0.residual_layer.0.layer.2.fn.rel_pos_bias.weight";
    scalar.insert(table.into(), vec![]);
    let e = crate::nets::registry::infer(&scalar)
        .unwrap_err()
        .to_string();
    assert!(e.contains(table), "{e}");
    let mut odd = shapes;
    odd.insert("input.weight".into(), vec![62, 3, 3, 3]);
    let e = crate::nets::registry::infer(&odd).unwrap_err().to_string();
    assert!(e.contains("input.weight"), "{e}");
}

/// The released shape (64 features, 5 groups of 1 block, window 8, position bias).
fn released(scale: usize) -> OmniSrConfig {
    OmniSrConfig {
        features: 64,
        groups: 5,
        blocks: 1,
        window: 8,
        position_bias: true,
        bias: true,
        scale,
        in_channels: 3,
        out_channels: 3,
    }
}

/// The released configuration and its variants, rebuilt as shape lists, are read back as
/// what they are; the parameter counts are the reference module's (784,604, 793,259 and
/// 805,376 at x2, x3 and x4, counted by spandrel's module: `sum(p.numel() for p in
/// OmniSR(num_feat=64, res_num=5, up_scale=s).parameters())`).
#[test]
fn released_omnisr_configurations_round_trip() {
    for scale in 1..=4 {
        for (window, position_bias, bias, blocks) in [
            (8, true, true, 1),
            (8, false, true, 2),
            (4, true, false, 1),
            (16, true, true, 3),
        ] {
            let c = OmniSrConfig {
                window,
                position_bias,
                bias,
                blocks,
                ..released(scale)
            };
            let shapes = c.expected_tensors().into_iter().collect();
            let back = crate::nets::registry::infer(&shapes).unwrap();
            assert_eq!(config_of::<OmniSrConfig>(&back), Some(&c));
        }
    }
    let counts = [2, 3, 4].map(|s| released(s).parameter_count());
    assert_eq!(counts, [784_604, 793_259, 805_376]);
}
