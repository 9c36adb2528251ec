//! `upscale eval` end to end: the real binary on small photo crops (tests/fixtures/metrics)
//! with the x2 golden model. Its weights are random, so the PSNR is low; what is tested is
//! pairing, the report's shape, the baseline round trip and the gate's exit codes.

use std::fs;
use std::path::{Path, PathBuf};

use assert_cmd::Command;
use serde_json::Value;
use tempfile::TempDir;

const NAMES: [&str; 3] = ["astronaut.png", "chelsea.png", "rocket.png"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A temporary folder with `hr/` holding three small photos of odd and even sizes.
fn setup() -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    let hr = dir.path().join("hr");
    fs::create_dir(&hr).unwrap();
    let sources = ["pair_x4_hr.png", "pair_x3_hr.png", "pair_shift_hr.png"];
    for (src, name) in sources.iter().zip(NAMES) {
        fs::copy(
            root().join("tests/fixtures/metrics").join(src),
            hr.join(name),
        )
        .unwrap();
    }
    dir
}

/// `upscale eval` on `dir/hr` with the x2 model on the CPU, plus `extra`.
fn eval_raw(dir: &Path, extra: &[&str]) -> assert_cmd::assert::Assert {
    let model = root().join("tests/golden/x2_w8_b2.safetensors");
    Command::cargo_bin("upscale")
        .unwrap()
        .arg("eval")
        .arg("--hr")
        .arg(dir.join("hr"))
        .args(["--device", "cpu", "-m"])
        .arg(model)
        .args(extra)
        .assert()
}

/// [`eval_raw`] at x2 on whole images.
fn eval(dir: &Path, extra: &[&str]) -> assert_cmd::assert::Assert {
    let mut args = vec!["--scale", "2", "--tile", "0"];
    args.extend_from_slice(extra);
    eval_raw(dir, &args)
}

fn stdout_json(a: &assert_cmd::assert::Assert) -> Value {
    let out = String::from_utf8(a.get_output().stdout.clone()).unwrap();
    assert_eq!(out.trim().lines().count(), 1, "one JSON line: {out}");
    serde_json::from_str(out.trim()).unwrap()
}

fn stderr(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8(a.get_output().stderr.clone()).unwrap()
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Writes the baseline with whole-image inference and returns its path and content.
fn write_baseline(dir: &Path) -> (PathBuf, Value) {
    let path = dir.join("base/baseline.json");
    let a = eval(dir, &["--write-baseline", path_str(&path)]).code(0);
    let table = String::from_utf8(a.get_output().stdout.clone()).unwrap();
    for name in NAMES {
        assert!(table.contains(name), "{table}");
    }
    assert!(table.lines().last().unwrap().starts_with("mean"), "{table}");
    let v: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    (path, v)
}

fn edited(dir: &Path, name: &str, base: &Value, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let mut v = base.clone();
    edit(&mut v);
    let path = dir.join(name);
    fs::write(&path, v.to_string()).unwrap();
    path
}

fn add(v: &mut Value, delta: f64) {
    *v = Value::from(v.as_f64().unwrap() + delta);
}

#[test]
fn report_shape_and_baseline_round_trip() {
    let dir = setup();
    let (path, base) = write_baseline(dir.path());

    assert_eq!(base["scale"], 2);
    let images = base["images"].as_array().unwrap();
    let names: Vec<&str> = images.iter().map(|i| i["name"].as_str().unwrap()).collect();
    assert_eq!(names, NAMES);
    for i in images {
        for key in [
            "psnr_y",
            "ssim_y",
            "psnr_rgb",
            "bicubic_psnr_y",
            "bicubic_ssim_y",
            "bicubic_psnr_rgb",
        ] {
            assert!(i[key].as_f64().unwrap().is_finite(), "{key}: {i}");
        }
        // Bicubic from an 8-bit LR of a real photo is far better than random weights.
        assert!(i["bicubic_psnr_y"].as_f64() > i["psnr_y"].as_f64(), "{i}");
        assert!(i["ssim_y"].as_f64().unwrap() < 1.0);
    }
    let mean = |key: &str| images.iter().map(|i| i[key].as_f64().unwrap()).sum::<f64>() / 3.0;
    for key in ["psnr_y", "ssim_y", "psnr_rgb", "bicubic_psnr_y"] {
        let got = base[format!("mean_{key}")].as_f64().unwrap();
        assert!((got - mean(key)).abs() < 1e-9, "{key}");
    }
    let gain = base["mean_gain_y"].as_f64().unwrap();
    assert!((gain - (mean("psnr_y") - mean("bicubic_psnr_y"))).abs() < 1e-9);
    assert_eq!(base["failed"], Value::Array(vec![]));

    let a = eval(dir.path(), &["--json", "--baseline", path_str(&path)]).code(0);
    let run = stdout_json(&a);
    assert_eq!(run["gate"]["passed"], true);
    assert_eq!(run["gate"]["problems"], Value::Array(vec![]));
    assert_eq!(run["images"], base["images"]);
    assert_eq!(run["mean_psnr_y"], base["mean_psnr_y"]);
}

#[test]
fn gate_trips_on_drops_and_passes_gains() {
    let dir = setup();
    let (_, base) = write_baseline(dir.path());
    let d = dir.path();

    // One image better in the baseline than now: that image is named, the mean is not.
    let one = edited(d, "one.json", &base, |v| {
        add(&mut v["images"][1]["psnr_y"], 1.0)
    });
    let a = eval(d, &["--json", "--baseline", path_str(&one)]).code(1);
    let err = stderr(&a);
    assert!(
        err.contains("chelsea.png: PSNR-Y dropped 1.0000 dB"),
        "{err}"
    );
    assert!(
        !err.contains("astronaut.png") && !err.contains("mean PSNR-Y"),
        "{err}"
    );
    let v = stdout_json(&a);
    assert_eq!(v["gate"]["passed"], false);
    assert_eq!(v["gate"]["problems"].as_array().unwrap().len(), 1);

    // The mean alone.
    let mean = edited(d, "mean.json", &base, |v| add(&mut v["mean_psnr_y"], 0.06));
    let err = stderr(&eval(d, &["--baseline", path_str(&mean)]).code(1));
    assert!(err.contains("mean PSNR-Y dropped 0.0600 dB"), "{err}");
    assert!(!NAMES.iter().any(|n| err.contains(n)), "{err}");

    // A drop within --max_drop passes (underscore and dash spellings).
    let _ = eval(d, &["--baseline", path_str(&one), "--max_drop", "1.5"]).code(0);
    let _ = eval(d, &["--baseline", path_str(&one), "--max-drop", "1.5"]).code(0);

    // Everything better now than in the baseline passes.
    let lower = edited(d, "lower.json", &base, |v| {
        for i in v["images"].as_array_mut().unwrap() {
            add(&mut i["psnr_y"], -1.0);
        }
        add(&mut v["mean_psnr_y"], -1.0);
    });
    let _ = eval(d, &["--baseline", path_str(&lower)]).code(0);
}

#[test]
fn gate_reports_images_missing_on_either_side() {
    let dir = setup();
    let (_, base) = write_baseline(dir.path());
    let d = dir.path();
    let fewer = edited(d, "fewer.json", &base, |v| {
        v["images"].as_array_mut().unwrap().remove(2);
    });
    let err = stderr(&eval(d, &["--baseline", path_str(&fewer)]).code(1));
    assert!(
        err.contains("rocket.png: measured but not in the baseline"),
        "{err}"
    );
    let more = edited(d, "more.json", &base, |v| {
        let mut extra = v["images"][0].clone();
        extra["name"] = "gone.png".into();
        v["images"].as_array_mut().unwrap().push(extra);
    });
    let err = stderr(&eval(d, &["--baseline", path_str(&more)]).code(1));
    assert!(
        err.contains("gone.png: in the baseline but not measured"),
        "{err}"
    );
}

#[test]
fn seams_from_small_unblended_tiles_trip_the_gate() {
    let dir = setup();
    let (path, _) = write_baseline(dir.path());
    let a = eval_raw(
        dir.path(),
        &[
            "--scale",
            "2",
            "--tile",
            "16",
            "--tile_overlap",
            "4",
            "--blend",
            "none",
            "--baseline",
            path_str(&path),
        ],
    );
    let err = stderr(&a);
    a.code(1);
    assert!(err.contains("PSNR-Y dropped"), "{err}");
}

#[test]
fn lr_folder_pairs_by_name_and_checks_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let (hr, lr) = (dir.path().join("hr"), dir.path().join("lr"));
    fs::create_dir(&hr).unwrap();
    fs::create_dir(&lr).unwrap();
    let fixtures = root().join("tests/fixtures/metrics");
    // A MATLAB-made x2 LR of a 90x64 crop: the same as the LR eval makes itself.
    fs::copy(fixtures.join("resize_half_in.png"), hr.join("half.png")).unwrap();
    fs::copy(fixtures.join("resize_half_out.png"), lr.join("halfx2.png")).unwrap();
    let made = stdout_json(&eval(dir.path(), &["--json"]).code(0));
    let lr_arg = ["--json", "--lr", path_str(&lr)];
    let read = stdout_json(&eval(dir.path(), &lr_arg).code(0));
    assert_eq!(made, read);

    fs::remove_file(lr.join("halfx2.png")).unwrap();
    fs::copy(fixtures.join("resize_third_out.png"), lr.join("half.png")).unwrap();
    let a = eval(dir.path(), &lr_arg).code(1);
    assert!(stderr(&a).contains("half.png"), "{}", stderr(&a));
    let v = stdout_json(&a);
    assert_eq!(v["failed"][0]["name"], "half.png");

    fs::remove_file(lr.join("half.png")).unwrap();
    fs::copy(fixtures.join("resize_half_out.png"), lr.join("other.png")).unwrap();
    let err = stderr(&eval(dir.path(), &lr_arg).code(2));
    assert!(
        err.contains("no LR image") && err.contains("half.png"),
        "{err}"
    );
}

#[test]
fn undecodable_image_is_reported_and_blocks_the_baseline() {
    let dir = setup();
    fs::write(dir.path().join("hr/broken.png"), b"not a png").unwrap();
    let path = dir.path().join("baseline.json");
    let a = eval(dir.path(), &["--json", "--write_baseline", path_str(&path)]).code(1);
    let err = stderr(&a);
    assert!(
        err.contains("broken.png") && err.contains("not written"),
        "{err}"
    );
    let v = stdout_json(&a);
    assert_eq!(v["images"].as_array().unwrap().len(), 3);
    assert_eq!(v["failed"][0]["name"], "broken.png");
    assert!(!path.exists());
}

#[test]
fn bad_inputs_exit_2_with_one_line() {
    let dir = setup();
    let d = dir.path();
    let one_line = |a: assert_cmd::assert::Assert, what: &str| {
        let err = stderr(&a.code(2));
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(what), "{err}");
    };
    one_line(eval_raw(d, &["--scale", "4"]), "does not match the model");
    let missing = d.join("missing.json");
    one_line(eval(d, &["--baseline", path_str(&missing)]), "missing.json");
    fs::write(d.join("junk.json"), "{").unwrap();
    one_line(
        eval(d, &["--baseline", path_str(&d.join("junk.json"))]),
        "not valid JSON",
    );
    one_line(eval(d, &["--max_drop=-1"]), "--max_drop");
    fs::remove_dir_all(d.join("hr")).unwrap();
    one_line(eval(d, &[]), "not a folder");
    fs::create_dir(d.join("hr")).unwrap();
    one_line(eval(d, &[]), "no images");
}
