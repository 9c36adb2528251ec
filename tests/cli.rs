//! The binary as a user runs it on single images: every flag family, and bad input of every
//! kind failing with the right exit code, one clear message and nothing left on disk.

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use common::*;
use image::{ColorType, GenericImageView, ImageFormat};

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn open(path: &Path) -> image::DynamicImage {
    image::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs `cmd` in a prepared `dir` and checks that it failed cleanly: exit `code`, exactly one
/// `error:` line that contains every one of `needles`, nothing else on stderr but warnings, the
/// run's tally and clap's pointer to --help, and no file added to or removed from `dir`.
fn assert_rejected(dir: &Path, cmd: &mut assert_cmd::Command, code: i32, needles: &[&str]) {
    let before = files_under(dir);
    let out = cmd.output().unwrap();
    assert_no_panic(&out);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(code), "stderr:\n{err}");
    let errors = error_lines(&out);
    assert_eq!(errors.len(), 1, "want one error line, got:\n{err}");
    for n in needles {
        assert!(errors[0].contains(n), "'{}' does not name {n:?}", errors[0]);
    }
    for line in err.lines().filter(|l| !l.trim().is_empty()) {
        let tally = line.contains(" upscaled, ") && line.contains(" failed in ");
        // clap lists the choices and names the closest one under its error line.
        let clap_hint = line.starts_with("  [possible values: ") || line.starts_with("  tip: ");
        assert!(
            line.starts_with("error:")
                || line.starts_with("warning:")
                || line.starts_with("For more information")
                || tally
                || clap_hint,
            "unexpected stderr line {line:?} in:\n{err}"
        );
    }
    assert_eq!(files_under(dir), before, "a failed run changed the folder");
}

fn with_input(dir: &Path) -> PathBuf {
    let p = dir.join("in.png");
    write_png(&p, 20, 16);
    p
}

// ---------------------------------------------------------------- outputs and flags

#[test]
fn output_file_folder_and_default_name() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);

    upscale(dir)
        .args(["in.png", "-o", "named.png"])
        .assert()
        .success();
    assert_eq!(open(&dir.join("named.png")).dimensions(), (40, 32));

    // A trailing separator makes -o a folder even before it exists.
    upscale(dir)
        .args(["in.png", "-o", "fresh/"])
        .assert()
        .success();
    assert_eq!(open(&dir.join("fresh/in.png")).dimensions(), (40, 32));

    fs::create_dir(dir.join("existing")).unwrap();
    upscale(dir)
        .args(["in.png", "-o", "existing"])
        .assert()
        .success();
    assert_eq!(open(&dir.join("existing/in.png")).dimensions(), (40, 32));

    upscale(dir).arg("in.png").assert().success();
    assert_eq!(open(&dir.join("in_x2.png")).dimensions(), (40, 32));
}

#[test]
fn output_size_is_scale_times_input() {
    let d = tempdir();
    let dir = d.path();
    // Sizes that are not multiples of the window, so padding and cropping are exercised.
    write_png(&dir.join("in.png"), 13, 10);
    for (model, scale) in [
        ("x2_w8_b2.safetensors", 2),
        ("x3_w4.safetensors", 3),
        ("x4_w8_g2.safetensors", 4),
    ] {
        let out = format!("out{scale}.png");
        let run = upscale_with(dir, model)
            .args(["in.png", "--tile", "0", "-o", &out])
            .output()
            .unwrap();
        assert_success(&run);
        assert_eq!(open(&dir.join(&out)).dimensions(), (13 * scale, 10 * scale));
    }
}

#[test]
fn tile_flags_in_both_spellings() {
    let d = tempdir();
    let dir = d.path();
    write_png(&dir.join("in.png"), 40, 40);
    let tiled = |out: &str, flags: &[&str]| -> (Vec<u8>, u64) {
        let run = upscale(dir)
            .args(["in.png", "--json", "-o", out])
            .args(flags)
            .output()
            .unwrap();
        assert_success(&run);
        let lines = json_lines(&run);
        let tiles = lines[0]["tiles"].as_u64().unwrap();
        (fs::read(dir.join(out)).unwrap(), tiles)
    };

    let (under, tiles) = tiled(
        "u.png",
        &[
            "--tile",
            "16",
            "--tile_overlap",
            "4",
            "--tile_batch_size",
            "2",
        ],
    );
    assert!(tiles > 1, "--tile 16 on 40x40 gave {tiles} tile(s)");
    let (dash, _) = tiled(
        "d.png",
        &[
            "--tile",
            "16",
            "--tile-overlap",
            "4",
            "--tile-batch-size",
            "2",
        ],
    );
    assert_eq!(under, dash, "dash and underscore spellings disagree");

    let base = ["--tile", "16", "--tile_overlap", "4"];
    let blend = |out: &str, extra: &[&str]| {
        let mut flags = base.to_vec();
        flags.extend_from_slice(extra);
        tiled(out, &flags).0
    };
    let hann = blend("h.png", &["--blend", "hann"]);
    assert_eq!(hann, blend("h2.png", &["--hann-blend"]));
    assert_eq!(hann, blend("h3.png", &["--hann_blend"]));
    let average = blend("a.png", &["--blend", "average"]);
    let none = blend("n.png", &["--blend", "none"]);
    assert_ne!(hann, none, "--blend none gave the same image as hann");
    for (img, name) in [(&average, "average"), (&none, "none")] {
        let dec = image::load_from_memory(img).unwrap();
        assert_eq!(dec.dimensions(), (80, 80), "--blend {name}");
    }

    for flag in ["--tile-auto", "--tile_auto"] {
        let run = upscale(dir)
            .args(["in.png", flag, "-o", "auto.png", "--overwrite"])
            .output()
            .unwrap();
        assert_success(&run);
        assert_eq!(open(&dir.join("auto.png")).dimensions(), (80, 80));
    }
}

#[test]
fn bit_depth_follows_input_unless_asked() {
    let d = tempdir();
    let dir = d.path();
    rgb16_image(12, 10).save(dir.join("deep.png")).unwrap();
    write_png(&dir.join("flat.png"), 12, 10);

    let depth = |args: &[&str], out: &str| {
        let run = upscale(dir).args(args).args(["-o", out]).output().unwrap();
        assert_success(&run);
        open(&dir.join(out)).color()
    };
    assert_eq!(
        depth(&["deep.png", "--bit-depth", "16"], "a.png"),
        ColorType::Rgb16
    );
    assert_eq!(depth(&["deep.png"], "b.png"), ColorType::Rgb16);
    assert_eq!(
        depth(&["deep.png", "--bit-depth", "8"], "c.png"),
        ColorType::Rgb8
    );
    assert_eq!(depth(&["flat.png"], "d.png"), ColorType::Rgb8);
    assert_eq!(
        depth(&["flat.png", "--bit_depth", "16"], "e.png"),
        ColorType::Rgb16
    );
    assert_eq!(depth(&["deep.png"], "f.tif"), ColorType::Rgb16);
    // JPEG holds 8 bits only: a 16-bit source drops to 8 there without being asked.
    assert_eq!(depth(&["deep.png"], "g.jpg"), ColorType::Rgb8);
}

#[test]
fn format_sets_extension_and_content() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    for (flag, name, want) in [
        ("jpg", "in_x2.jpg", ImageFormat::Jpeg),
        ("webp", "in_x2.webp", ImageFormat::WebP),
        ("tiff", "in_x2.tif", ImageFormat::Tiff),
        ("png", "in_x2.png", ImageFormat::Png),
    ] {
        upscale(dir)
            .args(["in.png", "--format", flag])
            .assert()
            .success();
        let path = dir.join(name);
        let bytes = fs::read(&path).unwrap_or_else(|_| panic!("--format {flag}: no {name}"));
        assert_eq!(
            image::guess_format(&bytes).unwrap(),
            want,
            "--format {flag}"
        );
        assert_eq!(open(&path).dimensions(), (40, 32));
    }
    // Into a folder, too, the format renames the file.
    upscale(dir)
        .args(["in.png", "--format", "jpg", "-o", "out/"])
        .assert()
        .success();
    assert!(dir.join("out/in.jpg").is_file());
}

#[test]
fn jpeg_quality_changes_the_file() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    let size = |q: &str| {
        let out = format!("q{q}.jpg");
        upscale(dir)
            .args(["in.png", "--quality", q, "-o", &out])
            .assert()
            .success();
        fs::metadata(dir.join(&out)).unwrap().len()
    };
    let (low, high) = (size("10"), size("100"));
    assert!(low < high, "quality 10 gave {low} bytes, 100 gave {high}");
}

#[test]
fn json_gives_one_line_per_image_and_a_summary() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    write_png(&dir.join("second.png"), 8, 8);
    let run = upscale(dir)
        .args(["in.png", "second.png", "--json", "-o", "out"])
        .output()
        .unwrap();
    assert_success(&run);
    let lines = json_lines(&run);
    assert_eq!(lines.len(), 3, "{}", stdout(&run));
    let mut images: Vec<&serde_json::Value> = lines[..2].iter().collect();
    images.sort_by_key(|v| v["input"].as_str().unwrap().to_string());
    assert_eq!(images[0]["input"], "in.png");
    assert_eq!(images[0]["status"], "ok");
    assert_eq!(images[0]["input_size"], serde_json::json!([20, 16]));
    assert_eq!(images[0]["output_size"], serde_json::json!([40, 32]));
    assert!(Path::new(images[0]["output"].as_str().unwrap()).ends_with("out/in.png"));
    assert_eq!(images[1]["output_size"], serde_json::json!([16, 16]));
    let s = summary(&lines);
    assert_eq!(
        (&s["done"], &s["failed"], &s["skipped"]),
        (
            &serde_json::json!(2),
            &serde_json::json!(0),
            &serde_json::json!(0)
        )
    );
}

#[test]
fn quiet_success_prints_nothing() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    for q in ["-q", "--quiet"] {
        let run = upscale(dir)
            .args(["in.png", q, "--overwrite"])
            .output()
            .unwrap();
        assert_success(&run);
        assert_eq!(stderr(&run), "", "{q}");
        assert_eq!(stdout(&run), "", "{q}");
    }
}

/// The product's main command on the CPU: `--precision bf16` computes in bf16 where the CPU
/// has bf16 arithmetic (no warning, pixels within a few levels of fp32) and falls back to
/// fp32 with a warning elsewhere; `--streams` only matters on a GPU.
#[test]
fn main_command_runs_on_the_cpu_in_bf16_or_says_it_falls_back() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    let main_command = |precision: &str, out: &str| {
        upscale(dir)
            .args([
                "in.png",
                "--precision",
                precision,
                "--streams",
                "2",
                "--tile_batch_size",
                "4",
                "--tile",
                "16",
                "--tile_overlap",
                "4",
                "-o",
                out,
            ])
            .output()
            .unwrap()
    };
    let run = main_command("bf16", "bf16.png");
    assert_success(&run);
    let warned = stderr(&run)
        .lines()
        .any(|l| l.starts_with("warning:") && l.contains("bf16"));
    assert_eq!(
        warned,
        !upscale::cpu_computes_bf16(),
        "bf16 warning:\n{}",
        stderr(&run)
    );
    assert_success(&main_command("fp32", "fp32.png"));
    let (a, b) = (
        open(&dir.join("bf16.png")).to_rgb8(),
        open(&dir.join("fp32.png")).to_rgb8(),
    );
    assert_eq!(a.dimensions(), (40, 32));
    assert_eq!(a.dimensions(), b.dimensions());
    let worst = a
        .as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap();
    assert!(worst <= 12, "bf16 is {worst} levels from fp32");
}

/// `--attention` picks the CUDA attention path; the CPU runs its own kernel either way, so
/// both choices give the same pixels there, and an unknown choice is a usage error.
#[test]
fn attention_choice_is_accepted_and_checked() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    for (choice, out) in [("fused", "fused.png"), ("reference", "reference.png")] {
        let run = upscale(dir)
            .args(["in.png", "--attention", choice, "-o", out])
            .output()
            .unwrap();
        assert_success(&run);
    }
    assert_eq!(
        open(&dir.join("fused.png")).to_rgb8().into_raw(),
        open(&dir.join("reference.png")).to_rgb8().into_raw()
    );
    // clap lists the accepted values on a line of its own after the error.
    let run = upscale(dir)
        .args(["in.png", "--attention", "flash"])
        .output()
        .unwrap();
    assert_no_panic(&run);
    assert_eq!(run.status.code(), Some(2));
    let errors = error_lines(&run);
    assert!(
        errors.len() == 1 && errors[0].contains("--attention") && errors[0].contains("flash"),
        "{}",
        stderr(&run)
    );
    assert!(
        stderr(&run).contains("fused, reference"),
        "{}",
        stderr(&run)
    );
}

/// Small images skip the probe that measures the cost per pixel, trusting the analytic bound
/// instead; that is only sound while the probe never reads more than the bound. Each model runs
/// in its own process, so no other test's memory shows in the reading.
#[test]
fn measured_tile_cost_stays_within_the_bound_that_skips_the_probe() {
    let d = tempdir();
    let dir = d.path();
    let models = [
        Some("x2_w8_b2.safetensors"),
        Some("x3_w4.safetensors"),
        Some("x4_w8_g2.safetensors"),
        Some("x2_w8_official.pth"),
        None,
    ];
    for model in models {
        let mut cmd = bare(dir);
        cmd.args([
            "bench",
            "--json",
            "--tile_cost",
            "--device",
            "cpu",
            "--size",
            "24x20",
            "--reps",
            "1",
        ]);
        if let Some(m) = model {
            cmd.arg("-m").arg(golden(m));
        }
        let run = cmd.output().unwrap();
        assert_success(&run);
        let v: serde_json::Value = serde_json::from_str(stdout(&run).trim()).unwrap();
        let cost = &v["tile_cost_bytes_per_pixel"];
        let (bound, measured) = (cost["bound"].as_f64(), cost["measured"].as_f64());
        let (Some(bound), Some(measured)) = (bound, measured) else {
            panic!("{model:?}: no cost reading in {v}");
        };
        assert!(measured > 0.0, "{model:?}: the probe read nothing");
        assert!(
            measured <= bound,
            "{model:?}: the probe read {measured} B/pixel, over the bound {bound}"
        );
    }
}

#[test]
fn info_describes_models() {
    let d = tempdir();
    let dir = d.path();
    let run = bare(dir)
        .arg("info")
        .arg(golden("x4_w8_g2.safetensors"))
        .output()
        .unwrap();
    assert_success(&run);
    let text = stdout(&run);
    assert!(
        text.lines()
            .any(|l| l.starts_with("scale") && l.trim_end().ends_with('4')),
        "{text}"
    );

    let v = info_json(dir, golden("x2_w8_official.pth"));
    assert_eq!(v["scale"], 2);
    assert_eq!(v["window"], 8);
    assert!(v["parameters"].as_u64().unwrap() > 0);
}

#[test]
fn convert_pth_gives_the_same_pixels() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    let pth = golden("x2_w8_official.pth");
    let run = bare(dir)
        .arg("convert")
        .arg(&pth)
        .arg("converted.safetensors")
        .output()
        .unwrap();
    assert_success(&run);
    assert_eq!(
        files_under(dir),
        ["converted.safetensors", "in.png"].map(String::from).into(),
        "convert left something else behind"
    );

    let info = |model: &Path| {
        let mut v = info_json(dir, model);
        for k in ["model", "name", "state_dict_key"] {
            v.as_object_mut().unwrap().remove(k);
        }
        v
    };
    assert_eq!(info(&pth), info(&dir.join("converted.safetensors")));

    let run = |model: &Path, out: &str| {
        run_on_cpu(dir, model, ("in.png", out));
        fs::read(dir.join(out)).unwrap()
    };
    let from_pth = run(&pth, "pth.png");
    let from_converted = run(&dir.join("converted.safetensors"), "st.png");
    assert!(from_pth == from_converted, "outputs differ");
}

#[cfg(unix)]
#[test]
fn converted_model_has_ordinary_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempdir();
    let dir = d.path();
    bare(dir)
        .arg("convert")
        .arg(golden(FAST_MODEL))
        .arg("c.safetensors")
        .assert()
        .success();
    // A file made the ordinary way in the same folder shows what the umask allows.
    fs::write(dir.join("probe"), b"").unwrap();
    let mode = |p: &str| fs::metadata(dir.join(p)).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode("c.safetensors"), mode("probe"));
}

#[test]
fn gray_stays_gray() {
    let d = tempdir();
    let dir = d.path();
    gray_image(14, 9).save(dir.join("g.png")).unwrap();
    gray_alpha_image(14, 9).save(dir.join("ga.png")).unwrap();
    upscale(dir)
        .args(["g.png", "ga.png", "-o", "out"])
        .assert()
        .success();
    let g = open(&dir.join("out/g.png"));
    assert_eq!((g.color(), g.dimensions()), (ColorType::L8, (28, 18)));
    let ga = open(&dir.join("out/ga.png"));
    assert_eq!((ga.color(), ga.dimensions()), (ColorType::La8, (28, 18)));
}

#[test]
fn rgba_keeps_alpha() {
    let d = tempdir();
    let dir = d.path();
    rgba_image(16, 12).save(dir.join("varying.png")).unwrap();
    let mut flat = rgba_image(16, 12);
    for p in flat.pixels_mut() {
        p.0[3] = 128;
    }
    flat.save(dir.join("flat.png")).unwrap();
    upscale(dir)
        .args(["varying.png", "flat.png", "-o", "out"])
        .assert()
        .success();

    let varying = open(&dir.join("out/varying.png"));
    assert_eq!(
        (varying.color(), varying.dimensions()),
        (ColorType::Rgba8, (32, 24))
    );
    // A constant alpha is not the network's to change.
    let flat = open(&dir.join("out/flat.png")).to_rgba8();
    assert_eq!(flat.dimensions(), (32, 24));
    assert!(flat.pixels().all(|p| p.0[3] == 128));
}

// ---------------------------------------------------------------- final size

/// `-s/--outscale` with the embedded x4 model: the result is round(input × F) on each side,
/// named by that factor.
#[test]
fn outscale_resizes_the_models_output() {
    let d = tempdir();
    let dir = d.path();
    write_png(&dir.join("in.png"), 16, 12);
    for (flag, f, name, size) in [
        ("-s", "2", "in_x2.png", (32, 24)),
        ("--outscale", "3.5", "in_x3.5.png", (56, 42)),
        ("-s", "4", "in_x4.png", (64, 48)),
    ] {
        let run = bare(dir)
            .args(["in.png", "--device", "cpu", flag, f, "--json"])
            .output()
            .unwrap();
        assert_success(&run);
        assert_eq!(open(&dir.join(name)).dimensions(), size, "{flag} {f}");
        let lines = json_lines(&run);
        assert_eq!(lines[0]["output_size"], serde_json::json!([size.0, size.1]));
    }
}

/// --width and/or --height: one keeps the aspect ratio, both give exactly that size; the
/// names say which. Alpha is resampled with the colour.
#[test]
fn width_and_height_fit_the_output() {
    let d = tempdir();
    let dir = d.path();
    write_png(&dir.join("in.png"), 16, 12);
    for (flags, name, size) in [
        (&["--width", "40"][..], "in_w40.png", (40, 30)),
        (&["--height", "6"][..], "in_h6.png", (8, 6)),
        (&["--width", "7", "--height", "5"][..], "in_7x5.png", (7, 5)),
    ] {
        let run = upscale(dir).arg("in.png").args(flags).output().unwrap();
        assert_success(&run);
        assert_eq!(open(&dir.join(name)).dimensions(), size, "{flags:?}");
    }

    rgba_image(16, 12).save(dir.join("alpha.png")).unwrap();
    let run = upscale(dir)
        .args(["alpha.png", "--width", "24", "-o", "a.png"])
        .output()
        .unwrap();
    assert_success(&run);
    let img = open(&dir.join("a.png"));
    assert_eq!(
        (img.dimensions(), img.color()),
        ((24, 18), ColorType::Rgba8)
    );

    // Through pipes too.
    let run = upscale(dir)
        .args(["-", "-o", "-", "--height", "3"])
        .write_stdin(fs::read(dir.join("in.png")).unwrap())
        .output()
        .unwrap();
    assert_success(&run);
    assert_eq!(
        image::load_from_memory(&run.stdout).unwrap().dimensions(),
        (4, 3)
    );
}

#[test]
fn outscale_excludes_width_and_height() {
    let d = tempdir();
    with_input(d.path());
    for other in ["--width", "--height"] {
        let run = upscale(d.path())
            .args(["in.png", "-s", "2", other, "10"])
            .output()
            .unwrap();
        assert_no_panic(&run);
        assert_eq!(run.status.code(), Some(2));
        let errors = error_lines(&run);
        assert_eq!(errors.len(), 1, "{}", stderr(&run));
        assert!(
            errors[0].contains("--outscale") && errors[0].contains(other),
            "{}",
            errors[0]
        );
    }
    assert_eq!(files_under(d.path()).len(), 1);
}

#[test]
fn outscale_not_a_positive_number() {
    flag_case(&["--outscale", "0"], &["'0'", "--outscale"]);
    flag_case(&["-s", "x2"], &["'x2'", "--outscale"]);
}

#[test]
fn zero_width() {
    flag_case(&["--width", "0"], &["'0'", "--width"]);
}

// ---------------------------------------------------------------- pipes

fn png_bytes(w: u32, h: u32) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    rgb_image(w, h)
        .write_to(&mut out, ImageFormat::Png)
        .unwrap();
    out.into_inner()
}

/// Decodes what a run wrote on stdout, which must be one whole image and nothing else.
fn stdout_image(run: &std::process::Output) -> (ImageFormat, image::DynamicImage) {
    let format = image::guess_format(&run.stdout).expect("stdout is not an image");
    let img = image::load_from_memory(&run.stdout).expect("stdout does not decode");
    (format, img)
}

/// `-` in, `-o -` out: the image goes through pipes, log lines (even with -v) stay on
/// stderr, and nothing is written to the folder.
#[test]
fn stdin_to_stdout_round_trip() {
    let d = tempdir();
    let dir = d.path();
    let run = upscale(dir)
        .args(["-", "-o", "-", "-v"])
        .write_stdin(png_bytes(16, 12))
        .output()
        .unwrap();
    assert_success(&run);
    let (format, img) = stdout_image(&run);
    assert_eq!(format, ImageFormat::Png);
    assert_eq!(img.dimensions(), (32, 24));
    assert!(stderr(&run).contains("1 upscaled"), "{}", stderr(&run));
    assert!(files_under(dir).is_empty(), "{:?}", files_under(dir));

    // The same pixels as the run over a file.
    fs::write(dir.join("in.png"), png_bytes(16, 12)).unwrap();
    upscale(dir)
        .args(["in.png", "-o", "file.png"])
        .assert()
        .success();
    assert_eq!(open(&dir.join("file.png")).to_rgb8(), img.to_rgb8());
}

/// `-o -` takes its format from --format, PNG without it (not the input's: stdout has no
/// name to say otherwise); an input file's format does not carry over.
#[test]
fn stdout_format_is_format_flag_or_png() {
    let d = tempdir();
    let dir = d.path();
    write_jpeg(&dir.join("in.jpg"), 16, 12);
    let run = upscale(dir).args(["in.jpg", "-o", "-"]).output().unwrap();
    assert_success(&run);
    assert_eq!(stdout_image(&run).0, ImageFormat::Png);
    let run = upscale(dir)
        .args(["in.jpg", "-o", "-", "--format", "webp"])
        .output()
        .unwrap();
    assert_success(&run);
    let (format, img) = stdout_image(&run);
    assert_eq!((format, img.dimensions()), (ImageFormat::WebP, (32, 24)));
    assert_eq!(files_under(dir).len(), 1);
}

/// Standard input to a file: the extension picks the format, else the input's content.
#[test]
fn stdin_to_a_file() {
    let d = tempdir();
    let dir = d.path();
    let run = upscale(dir)
        .args(["-", "-o", "out.tif", "--json"])
        .write_stdin(png_bytes(16, 12))
        .output()
        .unwrap();
    assert_success(&run);
    assert_eq!(open(&dir.join("out.tif")).dimensions(), (32, 24));
    let lines = json_lines(&run);
    assert_eq!(lines[0]["input"], "-");
    assert_eq!(lines[0]["output_size"], serde_json::json!([32, 24]));

    upscale(dir)
        .args(["-", "-o", "plain"])
        .write_stdin(png_bytes(16, 12))
        .assert()
        .success();
    assert_eq!(
        image::guess_format(&fs::read(dir.join("plain")).unwrap()).unwrap(),
        ImageFormat::Png
    );
}

#[test]
fn json_with_stdout_is_refused() {
    let d = tempdir();
    with_input(d.path());
    let mut cmd = upscale(d.path());
    cmd.args(["in.png", "--json", "-o", "-"]);
    assert_rejected(
        d.path(),
        &mut cmd,
        2,
        &["--json", "-o -", "standard output"],
    );
    let out = cmd.output().unwrap();
    assert!(out.stdout.is_empty(), "something reached stdout");
}

#[test]
fn stdin_without_output_is_refused() {
    let d = tempdir();
    let mut cmd = upscale(d.path());
    cmd.arg("-").write_stdin(png_bytes(8, 8));
    assert_rejected(d.path(), &mut cmd, 2, &["standard input", "-o"]);
}

#[test]
fn stdin_beside_other_inputs_is_refused() {
    let d = tempdir();
    with_input(d.path());
    let mut cmd = upscale(d.path());
    cmd.args(["-", "in.png", "-o", "out"])
        .write_stdin(png_bytes(8, 8));
    assert_rejected(d.path(), &mut cmd, 2, &["standard input", "only input"]);
}

#[test]
fn stdout_from_a_folder_is_refused() {
    let d = tempdir();
    write_png(&d.path().join("in/a.png"), 8, 8);
    let mut cmd = upscale(d.path());
    cmd.args(["in", "-o", "-"]);
    assert_rejected(d.path(), &mut cmd, 2, &["-o -", "one input file"]);
}

/// Bad bytes on standard input fail that image (exit 1), named as standard input.
#[test]
fn garbage_on_stdin() {
    let d = tempdir();
    let mut cmd = upscale(d.path());
    cmd.args(["-", "-o", "-"])
        .write_stdin(b"not an image at all".to_vec());
    assert_rejected(d.path(), &mut cmd, 1, &["standard input", "not an image"]);
    let mut cmd = upscale(d.path());
    cmd.args(["-", "-o", "-"]).write_stdin(Vec::new());
    assert_rejected(d.path(), &mut cmd, 1, &["standard input"]);
}

// ---------------------------------------------------------------- completions, man page

#[test]
fn completions_for_every_shell() {
    let d = tempdir();
    let run = bare(d.path())
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert_success(&run);
    let bash = stdout(&run);
    for sub in ["info", "convert", "bench", "eval", "completions", "man"] {
        assert!(
            bash.contains(&format!("upscale,{sub})")),
            "bash completion lacks the subcommand {sub}"
        );
    }
    assert!(bash.contains("--outscale") && bash.contains("--blend"));
    for shell in ["zsh", "fish", "powershell", "elvish"] {
        let run = bare(d.path())
            .args(["completions", shell])
            .output()
            .unwrap();
        assert_success(&run);
        assert!(stdout(&run).contains("outscale"), "{shell}");
    }
    let run = bare(d.path())
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    assert!(
        stderr(&run).contains("possible values: bash"),
        "{}",
        stderr(&run)
    );
}

#[test]
fn man_page() {
    let d = tempdir();
    let run = bare(d.path()).arg("man").output().unwrap();
    assert_success(&run);
    let page = stdout(&run);
    assert!(page.contains(".TH upscale 1"), "{page}");
    // roff escapes the dashes of flag names.
    for flag in [r"\-\-outscale", r"\-\-blend", r"\-\-json"] {
        assert!(page.contains(flag), "no {flag} in the man page");
    }

    let run = bare(d.path()).args(["man", "--dir", "."]).output().unwrap();
    assert_success(&run);
    let pages = files_under(d.path());
    for name in ["upscale.1", "upscale-info.1", "upscale-eval.1"] {
        assert!(pages.iter().any(|p| p.ends_with(name)), "{pages:?}");
    }
}

// ---------------------------------------------------------------- exit codes

/// The exit codes of the README's table, each from a run that should give it: 0 for help,
/// version and a run whose only output existed already; 1 when one of two inputs fails,
/// the other still written; 2 for a usage error.
#[test]
fn exit_codes_as_documented() {
    let d = tempdir();
    let dir = d.path();
    for flag in ["--help", "-h", "--version", "-V"] {
        let run = bare(dir).arg(flag).output().unwrap();
        assert_eq!(run.status.code(), Some(0), "{flag}");
        assert!(!run.stdout.is_empty(), "{flag} printed nothing");
    }

    write_png(&dir.join("good.png"), 8, 8);
    fs::write(dir.join("bad.png"), b"\x89PNG\r\n\x1a\nbroken").unwrap();
    let run = upscale(dir)
        .args(["good.png", "bad.png", "-o", "out"])
        .output()
        .unwrap();
    assert_no_panic(&run);
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    let errors = error_lines(&run);
    assert!(
        errors.len() == 1 && errors[0].contains("bad.png"),
        "{errors:?}"
    );
    assert_eq!(open(&dir.join("out/good.png")).dimensions(), (16, 16));

    let run = upscale(dir)
        .args(["good.png", "-o", "out/good.png"])
        .output()
        .unwrap();
    assert_success(&run);
    assert!(stderr(&run).contains("skipped"), "{}", stderr(&run));

    let run = upscale(dir)
        .args(["good.png", "--no-such-flag"])
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
}

/// A reader that goes away (`upscale ... --json | head -1`) ends the run by SIGPIPE, as it
/// would `cat`, not with an error message about a failed write.
#[cfg(unix)]
#[test]
fn closed_stdout_ends_the_run_by_sigpipe() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let d = tempdir();
    let dir = d.path();
    for name in ["a.png", "b.png", "c.png"] {
        write_png(&dir.join(name), 8, 8);
    }
    let mut child = std::process::Command::new(bin())
        .current_dir(dir)
        .arg("-m")
        .arg(golden(FAST_MODEL))
        .args([
            "--device", "cpu", "a.png", "b.png", "c.png", "--json", "-o", "out",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Closed before the first line is written.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}\n{}",
        out.status,
        stderr(&out)
    );
    assert!(error_lines(&out).is_empty(), "{}", stderr(&out));
}

// ---------------------------------------------------------------- bad inputs

#[test]
fn missing_input() {
    let d = tempdir();
    assert_rejected(
        d.path(),
        upscale(d.path()).arg("nowhere.png"),
        1,
        &["nowhere.png"],
    );
}

#[test]
fn empty_png() {
    let d = tempdir();
    fs::write(d.path().join("empty.png"), b"").unwrap();
    assert_rejected(
        d.path(),
        upscale(d.path()).arg("empty.png"),
        1,
        &["empty.png"],
    );
}

#[test]
fn truncated_png() {
    let d = tempdir();
    let p = with_input(d.path());
    let bytes = fs::read(&p).unwrap();
    fs::write(d.path().join("cut.png"), &bytes[..bytes.len() / 2]).unwrap();
    fs::remove_file(p).unwrap();
    assert_rejected(d.path(), upscale(d.path()).arg("cut.png"), 1, &["cut.png"]);
}

#[test]
fn corrupt_png_data() {
    let d = tempdir();
    let p = with_input(d.path());
    let mut bytes = fs::read(&p).unwrap();
    let idat = bytes.windows(4).position(|w| w == b"IDAT").unwrap();
    for b in &mut bytes[idat + 8..idat + 40] {
        *b ^= 0x5a;
    }
    fs::write(d.path().join("bad.png"), &bytes).unwrap();
    fs::remove_file(p).unwrap();
    assert_rejected(d.path(), upscale(d.path()).arg("bad.png"), 1, &["bad.png"]);
}

#[test]
fn text_file_named_png() {
    let d = tempdir();
    fs::write(d.path().join("text.png"), b"just some words\n").unwrap();
    assert_rejected(
        d.path(),
        upscale(d.path()).arg("text.png"),
        1,
        &["text.png"],
    );
}

#[test]
fn unsupported_image_format() {
    let d = tempdir();
    // A GIF header is enough for the format to be recognised and refused.
    fs::write(
        d.path().join("anim.gif"),
        b"GIF89a\x01\x00\x01\x00\x00\x00\x00;",
    )
    .unwrap();
    assert_rejected(
        d.path(),
        upscale(d.path()).arg("anim.gif"),
        1,
        &["anim.gif", "GIF"],
    );
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// A well-formed PNG of a few dozen bytes that declares `w` x `h` RGB pixels: the IDAT is one
/// stored deflate block holding a single scanline, so only the header lies.
fn bomb_png(w: u32, h: u32) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    png_chunk(&mut png, b"IHDR", &ihdr);
    let raw = [0u8; 16];
    let mut zlib = vec![0x78, 0x01, 0x01];
    zlib.extend_from_slice(&(raw.len() as u16).to_le_bytes());
    zlib.extend_from_slice(&(!(raw.len() as u16)).to_le_bytes());
    zlib.extend_from_slice(&raw);
    // Adler-32 of sixteen zero bytes: a = 1, b = 16.
    zlib.extend_from_slice(&((16u32 << 16) | 1).to_be_bytes());
    png_chunk(&mut png, b"IDAT", &zlib);
    png_chunk(&mut png, b"IEND", &[]);
    png
}

#[test]
fn decompression_bomb() {
    let d = tempdir();
    let bytes = bomb_png(100_000, 100_000);
    assert!(bytes.len() < 100);
    fs::write(d.path().join("bomb.png"), bytes).unwrap();
    let started = std::time::Instant::now();
    assert_rejected(
        d.path(),
        upscale(d.path()).arg("bomb.png"),
        1,
        &["bomb.png", "100000x100000"],
    );
    assert!(started.elapsed().as_secs() < 30, "the bomb was decoded");
}

#[test]
fn missing_model() {
    let d = tempdir();
    with_input(d.path());
    let mut cmd = bare(d.path());
    cmd.args(["in.png", "--device", "cpu", "-m", "absent.safetensors"]);
    assert_rejected(d.path(), &mut cmd, 2, &["absent.safetensors"]);
}

/// `upscale in.png -m MODEL --device cpu` in `dir`, for a model written there.
fn with_model(dir: &Path, model: &str) -> assert_cmd::Command {
    let mut cmd = bare(dir);
    cmd.args(["in.png", "--device", "cpu", "-m", model]);
    cmd
}

fn model_case(model: &str, contents: &[u8], needles: &[&str]) {
    let d = tempdir();
    with_input(d.path());
    fs::write(d.path().join(model), contents).unwrap();
    assert_rejected(d.path(), &mut with_model(d.path(), model), 2, needles);
}

#[test]
fn truncated_model() {
    let bytes = fs::read(golden(FAST_MODEL)).unwrap();
    model_case(
        "half.safetensors",
        &bytes[..bytes.len() / 2],
        &["half.safetensors"],
    );
}

#[test]
fn zero_byte_model() {
    model_case("empty.safetensors", b"", &["empty.safetensors", "empty"]);
}

#[test]
fn bare_pickle_model() {
    // A protocol-2 pickle of an empty dict: no zip archive, and not torch.save's legacy
    // format either (that starts with its magic number).
    model_case(
        "old.pth",
        b"\x80\x02}q\x00.",
        &["old.pth", "no PyTorch checkpoint"],
    );
}

#[test]
fn truncated_legacy_model() {
    // torch.save's legacy magic number and format version, then nothing.
    let mut bytes = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19\x2e".to_vec();
    bytes.extend_from_slice(b"\x80\x02M\xe9\x03.");
    model_case("old.pth", &bytes, &["old.pth", "PyTorch"]);
}

#[test]
fn garbage_model() {
    model_case("junk.pth", b"this is not a checkpoint", &["junk.pth"]);
}

#[test]
fn model_path_is_a_folder() {
    let d = tempdir();
    with_input(d.path());
    fs::create_dir(d.path().join("weights")).unwrap();
    assert_rejected(
        d.path(),
        &mut with_model(d.path(), "weights"),
        2,
        &["weights"],
    );
}

/// Writes the fast fixture, edited, as `dir/name`.
fn edited_model(dir: &Path, name: &str, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let mut tensors = candle_core::safetensors::load(golden(FAST_MODEL), &Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, dir.join(name)).unwrap();
}

fn edited_model_case(
    name: &str,
    edit: impl FnOnce(&mut HashMap<String, Tensor>),
    needles: &[&str],
) {
    let d = tempdir();
    with_input(d.path());
    edited_model(d.path(), name, edit);
    assert_rejected(d.path(), &mut with_model(d.path(), name), 2, needles);
}

const SOME_WEIGHT: &str = "layers.0.swin2.mlp.fc1.weight";

#[test]
fn model_with_nan() {
    edited_model_case(
        "nan.safetensors",
        |t| {
            let w = &t[SOME_WEIGHT];
            let mut v = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v[7] = f32::NAN;
            let bad = Tensor::from_vec(v, w.dims(), &Device::Cpu).unwrap();
            t.insert(SOME_WEIGHT.into(), bad);
        },
        &["nan.safetensors", SOME_WEIGHT],
    );
}

#[test]
fn model_with_missing_tensor() {
    edited_model_case(
        "short.safetensors",
        |t| {
            t.remove("layers.0.swin3.attn.qkv.bias").unwrap();
        },
        &["short.safetensors", "layers.0.swin3.attn.qkv.bias"],
    );
}

#[test]
fn model_with_wrong_shape() {
    edited_model_case(
        "shape.safetensors",
        |t| {
            let (o, i) = t[SOME_WEIGHT].dims2().unwrap();
            let wrong = Tensor::zeros((o, i + 1), candle_core::DType::F32, &Device::Cpu).unwrap();
            t.insert(SOME_WEIGHT.into(), wrong);
        },
        &["shape.safetensors", SOME_WEIGHT],
    );
}

#[test]
fn model_that_is_not_drct() {
    edited_model_case(
        "resnet.safetensors",
        |t| {
            t.clear();
            let z = |s: &[usize]| Tensor::zeros(s, candle_core::DType::F32, &Device::Cpu).unwrap();
            t.insert("fc.weight".into(), z(&[10, 512]));
            t.insert("fc.bias".into(), z(&[10]));
            t.insert("conv1.weight".into(), z(&[64, 3, 7, 7]));
        },
        &["resnet.safetensors"],
    );
}

/// A flag value that must be refused before anything runs.
fn flag_case(flags: &[&str], needles: &[&str]) {
    let d = tempdir();
    with_input(d.path());
    let mut cmd = upscale(d.path());
    cmd.arg("in.png").args(flags);
    assert_rejected(d.path(), &mut cmd, 2, needles);
}

#[test]
fn bad_tile_overlap() {
    flag_case(&["--tile_overlap", "abc"], &["abc", "--tile_overlap"]);
}

#[test]
fn bad_precision() {
    flag_case(&["--precision", "fp8"], &["fp8"]);
}

#[test]
fn bad_device() {
    let d = tempdir();
    with_input(d.path());
    let mut cmd = bare(d.path());
    cmd.arg("in.png")
        .arg("-m")
        .arg(golden(FAST_MODEL))
        .args(["--device", "tpu"]);
    assert_rejected(d.path(), &mut cmd, 2, &["tpu"]);
}

#[test]
fn bad_blend() {
    flag_case(&["--blend", "foo"], &["foo", "--blend"]);
}

/// A near miss is answered with clap's list of choices and the closest one.
#[test]
fn blend_typo_gets_a_suggestion() {
    let d = tempdir();
    with_input(d.path());
    let run = upscale(d.path())
        .args(["in.png", "--blend", "hanm"])
        .output()
        .unwrap();
    assert_no_panic(&run);
    assert_eq!(run.status.code(), Some(2));
    let err = stderr(&run);
    assert!(
        err.contains("possible values: hann, average, none"),
        "{err}"
    );
    assert!(err.contains("a similar value exists: 'hann'"), "{err}");
    assert_eq!(
        files_under(d.path()).len(),
        1,
        "a refused run wrote something"
    );
}

#[test]
fn help_lists_the_choices_of_typed_flags() {
    let d = tempdir();
    let run = bare(d.path()).arg("--help").output().unwrap();
    assert_success(&run);
    let help = stdout(&run);
    for choices in [
        "[possible values: auto, fp32, fp16, bf16]",
        "[possible values: png, jpg, webp, tiff]",
        "average",
        "<K/N|auto[/N]>",
        "<auto|cpu|cuda[:N[,M...]]>",
    ] {
        assert!(help.contains(choices), "--help lacks {choices:?}:\n{help}");
    }
}

/// The spellings accepted before the flags had fixed choices still work: other cases, the
/// short and long names of formats, the older names of precisions and blends.
#[test]
fn older_spellings_of_typed_flags_still_work() {
    let d = tempdir();
    let dir = d.path();
    write_png(&dir.join("in.png"), 12, 10);
    let run = bare(dir)
        .arg("-m")
        .arg(golden(FAST_MODEL))
        .args(["in.png", "--precision", "float32", "--blend", "AVG"])
        .args(["--format", "JPEG", "--shard", " 0/1 ", "--device", "CPU"])
        .args(["-o", "out.jpg"])
        .output()
        .unwrap();
    assert_success(&run);
    assert_eq!(
        image::ImageReader::open(dir.join("out.jpg"))
            .unwrap()
            .with_guessed_format()
            .unwrap()
            .format(),
        Some(ImageFormat::Jpeg)
    );
    let run = upscale(dir)
        .args(["in.png", "--precision", "F32", "--format", "tif", "-o", "t"])
        .output()
        .unwrap();
    assert_success(&run);
    let tiff = fs::read(dir.join("t")).unwrap();
    let img = image::load_from_memory_with_format(&tiff, ImageFormat::Tiff).unwrap();
    assert_eq!(img.dimensions(), (24, 20));
}

#[test]
fn bad_bit_depth() {
    flag_case(&["--bit-depth", "12"], &["12"]);
}

#[test]
fn shard_out_of_range() {
    flag_case(&["--shard", "3/2"], &["3/2"]);
}

#[test]
fn shard_not_a_fraction() {
    flag_case(&["--shard", "x"], &["'x'", "shard"]);
}

#[test]
fn quality_zero() {
    flag_case(&["--quality", "0"], &["'0'", "--quality"]);
}

#[test]
fn unknown_output_format() {
    flag_case(&["--format", "bmp"], &["bmp"]);
}

#[test]
fn zero_tile_batch() {
    flag_case(&["--tile_batch_size", "0"], &["--tile_batch_size"]);
}

#[test]
fn sixteen_bit_jpeg() {
    flag_case(&["--bit-depth", "16", "--format", "jpg"], &["16", "JPEG"]);
}

#[test]
fn sixteen_bit_jpeg_by_output_name() {
    flag_case(&["--bit-depth", "16", "-o", "out.jpg"], &["16", "JPEG"]);
}

#[test]
fn overlap_not_smaller_than_tile() {
    flag_case(
        &["--tile", "8", "--tile_overlap", "16"],
        &["--tile 8", "16"],
    );
}

#[test]
fn tile_and_tile_auto_together() {
    flag_case(&["--tile", "16", "--tile-auto"], &["--tile"]);
}

#[test]
fn format_disagrees_with_output_name() {
    flag_case(&["--format", "png", "-o", "out.jpg"], &["out.jpg", "PNG"]);
}

#[test]
fn output_would_replace_input() {
    flag_case(&["-o", "in.png"], &["in.png"]);
}

#[test]
fn output_under_a_regular_file() {
    let d = tempdir();
    with_input(d.path());
    fs::write(d.path().join("somefile.txt"), b"notes").unwrap();
    let mut cmd = upscale(d.path());
    cmd.args(["in.png", "-o", "somefile.txt/out.png"]);
    assert_rejected(d.path(), &mut cmd, 2, &["somefile.txt"]);
}

#[test]
fn several_inputs_into_a_file() {
    let d = tempdir();
    with_input(d.path());
    write_png(&d.path().join("two.png"), 8, 8);
    fs::write(d.path().join("somefile.txt"), b"notes").unwrap();
    let mut cmd = upscale(d.path());
    cmd.args(["in.png", "two.png", "-o", "somefile.txt"]);
    assert_rejected(d.path(), &mut cmd, 2, &["somefile.txt"]);
}

#[test]
fn folder_without_images() {
    let d = tempdir();
    fs::create_dir(d.path().join("photos")).unwrap();
    fs::write(d.path().join("photos/notes.txt"), b"no pictures here").unwrap();
    let mut cmd = upscale(d.path());
    cmd.args(["photos", "-r"]);
    assert_rejected(d.path(), &mut cmd, 2, &["photos"]);
}

#[test]
fn info_on_a_broken_model() {
    let d = tempdir();
    fs::write(
        d.path().join("junk.safetensors"),
        b"\x10\0\0\0\0\0\0\0{\"a\":",
    )
    .unwrap();
    let mut cmd = bare(d.path());
    cmd.args(["info", "junk.safetensors"]);
    assert_rejected(d.path(), &mut cmd, 2, &["junk.safetensors"]);
}

#[test]
fn convert_into_a_regular_file() {
    let d = tempdir();
    fs::write(d.path().join("somefile.txt"), b"notes").unwrap();
    let mut cmd = bare(d.path());
    cmd.arg("convert")
        .arg(golden(FAST_MODEL))
        .arg("somefile.txt/out.safetensors");
    assert_rejected(d.path(), &mut cmd, 2, &["somefile.txt"]);
}

// ------------------------------------------------------------ defects found in review

/// A stale temporary of this run's own output is removed, also for a bare relative `-o`;
/// temporaries of other names and in folders below are not this run's to touch.
#[test]
fn only_this_runs_stale_temporaries_are_removed() {
    use std::time::{Duration, SystemTime};
    let d = tempdir();
    let dir = d.path();
    rgb_image(12, 10).save(dir.join("in.png")).unwrap();
    let old = SystemTime::now() - Duration::from_secs(3600);
    let plant = |p: &std::path::Path| {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"partial").unwrap();
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(old)
            .unwrap();
    };
    let ours = dir.join(".out.png.upscale-tmp-1-0");
    let other = dir.join(".other.png.upscale-tmp-1-0");
    let below = dir.join("res/deep/.y.png.upscale-tmp-1-0");
    let ours_in_res = dir.join("res/.out.png.upscale-tmp-2-0");
    for p in [&ours, &other, &below, &ours_in_res] {
        plant(p);
    }
    upscale(dir)
        .args(["in.png", "-o", "out.png"])
        .assert()
        .success();
    assert!(!ours.exists(), "the bare relative output's temporary stays");
    upscale(dir)
        .args(["in.png", "-o", "res/out.png"])
        .assert()
        .success();
    assert!(!ours_in_res.exists());
    assert!(
        other.exists() && below.exists(),
        "removed what was not ours"
    );
}

/// The library's own warnings (here: lanes asked of the CPU) reach stderr through the logger
/// the tool installs, one `warning:` line each, and `-q` silences them too.
#[test]
fn library_warnings_reach_stderr_unless_quiet() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    let run = |extra: &[&str], out: &str| {
        upscale(dir)
            .args(["in.png", "--streams", "3", "-o", out])
            .args(extra)
            .output()
            .unwrap()
    };
    let loud = run(&[], "loud.png");
    assert_success(&loud);
    let lines: Vec<_> = stderr(&loud)
        .lines()
        .filter(|l| l.starts_with("warning:") && l.contains("3 streams"))
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 1, "{}", stderr(&loud));
    let quiet = run(&["-q"], "quiet.png");
    assert_success(&quiet);
    assert_eq!(stderr(&quiet), "");
}

/// `-q` silences every warning, the dropped-alpha one included.
#[test]
fn quiet_silences_the_alpha_warning() {
    let d = tempdir();
    let dir = d.path();
    rgba_image(16, 12).save(dir.join("a.png")).unwrap();
    let loud = upscale(dir)
        .args(["a.png", "-o", "loud.jpg"])
        .output()
        .unwrap();
    assert_success(&loud);
    assert!(
        stderr(&loud).contains("transparency is dropped"),
        "{}",
        stderr(&loud)
    );
    let quiet = upscale(dir)
        .args(["-q", "a.png", "-o", "quiet.jpg"])
        .output()
        .unwrap();
    assert_success(&quiet);
    assert_eq!(stderr(&quiet), "");
}

// ---------------------------------------------------------------- metadata

/// A stand-in ICC profile: a 128-byte header naming `space` (all a reader checks) and a
/// recognisable body.
fn fake_icc(space: &[u8; 4]) -> Vec<u8> {
    let mut icc: Vec<u8> = (0..200u32).map(|i| (i * 7 % 251) as u8).collect();
    icc[..4].copy_from_slice(&200u32.to_be_bytes());
    icc[16..20].copy_from_slice(space);
    icc[36..40].copy_from_slice(b"acsp");
    icc
}

/// Big-endian EXIF with a camera make, `orientation` and a software tag around it.
fn exif_with_orientation(orientation: u16) -> Vec<u8> {
    let mut b = b"MM\0\x2a\0\0\0\x08".to_vec();
    b.extend(3u16.to_be_bytes());
    for (tag, kind, value) in [
        (0x010fu16, 2u16, *b"Ab\0\0"),
        (0x0112, 3, [0; 4]),
        (0x0131, 2, *b"Cd\0\0"),
    ] {
        b.extend(tag.to_be_bytes());
        b.extend(kind.to_be_bytes());
        b.extend(if kind == 3 { 1u32 } else { 3 }.to_be_bytes());
        if kind == 3 {
            b.extend(orientation.to_be_bytes());
            b.extend([0, 0]);
        } else {
            b.extend(value);
        }
    }
    b.extend(0u32.to_be_bytes());
    b
}

/// Writes `img` as `format` with the given profile and EXIF.
fn with_metadata(
    img: &image::RgbImage,
    format: ImageFormat,
    icc: Option<Vec<u8>>,
    exif: Option<Vec<u8>>,
) -> Vec<u8> {
    use image::codecs::{jpeg::JpegEncoder, png::PngEncoder};
    use image::ImageEncoder;
    fn write<E: ImageEncoder>(
        mut e: E,
        img: &image::RgbImage,
        icc: Option<Vec<u8>>,
        exif: Option<Vec<u8>>,
    ) {
        if let Some(icc) = icc {
            e.set_icc_profile(icc).unwrap();
        }
        if let Some(exif) = exif {
            e.set_exif_metadata(exif).unwrap();
        }
        e.write_image(
            img.as_raw(),
            img.width(),
            img.height(),
            image::ExtendedColorType::Rgb8,
        )
        .unwrap();
    }
    let mut out = Vec::new();
    match format {
        ImageFormat::Jpeg => write(JpegEncoder::new_with_quality(&mut out, 95), img, icc, exif),
        ImageFormat::Png => write(PngEncoder::new(&mut out), img, icc, exif),
        other => panic!("no writer for {other:?}"),
    }
    out
}

/// The ICC profile and EXIF a file holds, as the image crate reads them back.
fn metadata_of(bytes: &[u8]) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
    use image::ImageDecoder;
    if image::guess_format(bytes).unwrap() == ImageFormat::Tiff {
        // Through ImageReader the profile of a small TIFF is cut by its limits.
        let mut dec = image::codecs::tiff::TiffDecoder::new(std::io::Cursor::new(bytes)).unwrap();
        return (dec.icc_profile().unwrap(), dec.exif_metadata().unwrap());
    }
    let mut dec = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .unwrap()
        .into_decoder()
        .unwrap();
    (dec.icc_profile().unwrap(), dec.exif_metadata().unwrap())
}

/// A JPEG whose EXIF says "rotate 90° clockwise" comes out upright as PNG: the sides are
/// swapped, the EXIF is kept with its orientation now 1 (and nothing else changed), and the
/// ICC profile is the same bytes.
#[test]
fn metadata_jpeg_orientation_applied_and_reset_icc_kept() {
    let d = tempdir();
    let dir = d.path();
    let icc = fake_icc(b"RGB ");
    let jpeg = with_metadata(
        &rgb_image(20, 12),
        ImageFormat::Jpeg,
        Some(icc.clone()),
        Some(exif_with_orientation(6)),
    );
    fs::write(dir.join("in.jpg"), &jpeg).unwrap();
    upscale(dir)
        .args(["in.jpg", "-o", "out.png"])
        .assert()
        .success();
    let out = fs::read(dir.join("out.png")).unwrap();
    assert_eq!(image::guess_format(&out).unwrap(), ImageFormat::Png);
    assert_eq!(
        image::load_from_memory(&out).unwrap().dimensions(),
        (2 * 12, 2 * 20)
    );
    let (got_icc, got_exif) = metadata_of(&out);
    assert_eq!(got_icc, Some(icc));
    assert_eq!(got_exif, Some(exif_with_orientation(1)));
}

/// A folder run carries each image's own metadata to its own output, on the worker threads
/// and inline alike: two JPEGs with different profiles and orientations, one PNG with none.
#[test]
fn metadata_folder_run_keeps_each_images_own() {
    let d = tempdir();
    let dir = d.path();
    fs::create_dir(dir.join("in")).unwrap();
    let icc_a = fake_icc(b"RGB ");
    let mut icc_b = icc_a.clone();
    icc_b[150] ^= 0xff;
    let a = with_metadata(
        &rgb_image(20, 12),
        ImageFormat::Jpeg,
        Some(icc_a.clone()),
        Some(exif_with_orientation(6)),
    );
    let b = with_metadata(
        &rgb_image(16, 10),
        ImageFormat::Jpeg,
        Some(icc_b.clone()),
        Some(exif_with_orientation(1)),
    );
    fs::write(dir.join("in/a.jpg"), a).unwrap();
    fs::write(dir.join("in/b.jpg"), b).unwrap();
    write_png(&dir.join("in/c.png"), 8, 8);
    for io_threads in ["0", "1", "3"] {
        let out = format!("out{io_threads}");
        upscale(dir)
            .args([
                "in",
                "-o",
                &out,
                "--format",
                "png",
                "--io_threads",
                io_threads,
            ])
            .assert()
            .success();
        let read = |name: &str| fs::read(dir.join(&out).join(name)).unwrap();
        let (got_a, got_b) = (read("a.png"), read("b.png"));
        assert_eq!(
            image::load_from_memory(&got_a).unwrap().dimensions(),
            (2 * 12, 2 * 20),
            "a is turned upright"
        );
        assert_eq!(
            metadata_of(&got_a),
            (Some(icc_a.clone()), Some(exif_with_orientation(1)))
        );
        assert_eq!(
            metadata_of(&got_b),
            (Some(icc_b.clone()), Some(exif_with_orientation(1)))
        );
        assert_eq!(metadata_of(&read("c.png")), (None, None));
    }
}

/// `--strip` writes neither the profile nor the EXIF, and the pixels are still upright.
#[test]
fn metadata_strip_drops_icc_and_exif() {
    let d = tempdir();
    let dir = d.path();
    let jpeg = with_metadata(
        &rgb_image(20, 12),
        ImageFormat::Jpeg,
        Some(fake_icc(b"RGB ")),
        Some(exif_with_orientation(6)),
    );
    fs::write(dir.join("in.jpg"), &jpeg).unwrap();
    for out in ["out.png", "out.jpg", "out.webp"] {
        upscale(dir)
            .args(["in.jpg", "--strip", "-o", out])
            .assert()
            .success();
        let bytes = fs::read(dir.join(out)).unwrap();
        assert_eq!(metadata_of(&bytes), (None, None), "{out}");
        assert_eq!(
            image::load_from_memory(&bytes).unwrap().dimensions(),
            (2 * 12, 2 * 20)
        );
    }
}

/// The profile survives PNG to PNG, and goes into JPEG, WebP and TIFF outputs too; EXIF goes
/// wherever the writer can store it, and `-v` names what was left out (TIFF's EXIF).
#[test]
fn metadata_icc_kept_in_every_output_format() {
    let d = tempdir();
    let dir = d.path();
    let icc = fake_icc(b"RGB ");
    let exif = exif_with_orientation(1);
    let png = with_metadata(
        &rgb_image(16, 12),
        ImageFormat::Png,
        Some(icc.clone()),
        Some(exif.clone()),
    );
    fs::write(dir.join("in.png"), &png).unwrap();
    for (out, format, keeps_exif) in [
        ("out.png", ImageFormat::Png, true),
        ("out.jpg", ImageFormat::Jpeg, true),
        ("out.webp", ImageFormat::WebP, true),
        ("out.tif", ImageFormat::Tiff, false),
    ] {
        let run = upscale(dir)
            .args(["in.png", "-v", "-o", out])
            .output()
            .unwrap();
        assert_success(&run);
        let bytes = fs::read(dir.join(out)).unwrap();
        assert_eq!(image::guess_format(&bytes).unwrap(), format);
        let (got_icc, got_exif) = metadata_of(&bytes);
        assert_eq!(got_icc.as_ref(), Some(&icc), "{out}");
        if keeps_exif {
            assert_eq!(got_exif.as_ref(), Some(&exif), "{out}");
        }
        assert_eq!(
            stderr(&run).contains("EXIF left out"),
            !keeps_exif,
            "{out}: {}",
            stderr(&run)
        );
    }
    // And back from TIFF, whose small images the image crate reads without their profile.
    upscale(dir)
        .args(["out.tif", "-o", "back.png"])
        .assert()
        .success();
    assert_eq!(
        metadata_of(&fs::read(dir.join("back.png")).unwrap()).0,
        Some(icc)
    );
}

/// A profile for other pixels than those written (a CMYK JPEG's, decoded to RGB) is not
/// copied: it would make viewers misread the colours.
#[test]
fn metadata_icc_for_other_pixels_is_left_out() {
    let d = tempdir();
    let dir = d.path();
    let png = with_metadata(
        &rgb_image(16, 12),
        ImageFormat::Png,
        Some(fake_icc(b"CMYK")),
        None,
    );
    fs::write(dir.join("in.png"), &png).unwrap();
    let run = upscale(dir)
        .args(["in.png", "-v", "-o", "out.png"])
        .output()
        .unwrap();
    assert_success(&run);
    assert_eq!(
        metadata_of(&fs::read(dir.join("out.png")).unwrap()),
        (None, None)
    );
    assert!(
        stderr(&run).contains("ICC profile left out"),
        "{}",
        stderr(&run)
    );
}

/// Through pipes the profile is kept as through files.
#[test]
fn metadata_stdin_to_stdout_keeps_icc() {
    let d = tempdir();
    let icc = fake_icc(b"RGB ");
    let png = with_metadata(
        &rgb_image(16, 12),
        ImageFormat::Png,
        Some(icc.clone()),
        None,
    );
    let run = upscale(d.path())
        .args(["-", "-o", "-"])
        .write_stdin(png)
        .output()
        .unwrap();
    assert_success(&run);
    assert_eq!(metadata_of(&run.stdout).0, Some(icc));
}

/// End to end through the binary: a 16-bit PNG in, `--tile 0 --bit-depth 16` out, against the
/// reference output clamped and quantised the same way. The fixture inputs are 8-bit photo
/// crops (k/255), which 16-bit PNG holds exactly (k*257/65535), so only the output rounding
/// differs: at most one level.
#[test]
fn cli_sixteen_bit_png_end_to_end() {
    // The x4 golden case: its weights, and its input with the float64 reference output.
    let weights = golden("x4_w8_g2.safetensors");
    let io = candle_core::safetensors::load(golden("x4_w8_g2.io.safetensors"), &Device::Cpu)
        .expect("io fixture");
    let (input, expected) = (&io["input"], &io["output"]);
    let (_, _, h, w) = input.dims4().unwrap();
    let x = input.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut img = image::ImageBuffer::<image::Rgb<u16>, Vec<u16>>::new(w as u32, h as u32);
    for (px, py, p) in img.enumerate_pixels_mut() {
        for c in 0..3 {
            let v = x[(c * h + py as usize) * w + px as usize];
            let level = (v * 65535.0).round();
            assert!(
                (level / 65535.0 - v).abs() < 1e-6,
                "fixture input is not 16-bit exact"
            );
            p.0[c] = level as u16;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("in.png");
    let dst = dir.path().join("out.png");
    img.save(&src).unwrap();
    let status = std::process::Command::new(bin())
        .args(["-m", weights.to_str().unwrap()])
        .args([
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--tile",
            "0",
            "--bit-depth",
            "16",
            "-q",
        ])
        .arg(&src)
        .arg("-o")
        .arg(&dst)
        .status()
        .unwrap();
    assert!(status.success());
    let out = image::open(&dst).unwrap();
    let out = out.as_rgb16().expect("a 16-bit RGB PNG");
    let s = 4;
    assert_eq!(
        (out.width() as usize, out.height() as usize),
        (w * s, h * s)
    );
    let reference = expected.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let (oh, ow) = (h * s, w * s);
    let mut worst = 0i64;
    for (px, py, p) in out.enumerate_pixels() {
        for c in 0..3 {
            let r = reference[(c * oh + py as usize) * ow + px as usize];
            let want = (r.clamp(0.0, 1.0) * 65535.0).round() as i64;
            worst = worst.max((p.0[c] as i64 - want).abs());
        }
    }
    assert!(worst <= 1, "16-bit output off by {worst} levels");
}

/// `--version` carries the credits the embedded model's CC-BY training images ask for.
#[test]
fn version_credits_the_models_training_images() {
    let d = tempdir();
    let out = bare(d.path()).arg("--version").output().unwrap();
    assert_success(&out);
    let text = stdout(&out);
    for needle in [
        "CC-BY",
        "Aitzol Berasategi",
        "Jakub Mede",
        "Nevit Dilmen",
        "models/README.md",
    ] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
}

/// `--version` says what the binary runs on, so a bug report names its build.
#[test]
fn version_names_the_build() {
    let d = tempdir();
    let out = bare(d.path()).arg("--version").output().unwrap();
    assert_success(&out);
    let text = stdout(&out);
    let want = if cfg!(feature = "cuda") {
        "Build: CPU and CUDA"
    } else {
        "Build: CPU only"
    };
    assert!(text.contains(want), "{want} missing from:\n{text}");
}

// ---------------------------------------------------------------- SwinIR

/// A SwinIR checkpoint (the official `.pth` layout with `params_ema`) upscales, describes
/// itself, and converts to safetensors that give the same pixels.
#[test]
fn swinir_model_runs_describes_itself_and_converts() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    let pth = golden("swinir/classical_x4_ema.pth");

    let v = info_json(dir, &pth);
    assert!(
        v["architecture"].as_str().unwrap().starts_with("SwinIR"),
        "{v}"
    );
    assert_eq!(v["upsampler"], "pixelshuffle");
    assert_eq!(v["resi_connection"], "1conv");
    assert_eq!(v["scale"], 4);
    assert_eq!(v["window"], 8);
    assert_eq!(v["state_dict_key"], "params_ema");

    let run = bare(dir)
        .arg("convert")
        .arg(&pth)
        .arg("converted.safetensors")
        .output()
        .unwrap();
    assert_success(&run);
    let up = |model: &Path, out: &str| {
        run_on_cpu(dir, model, ("in.png", out));
        open(&dir.join(out))
    };
    let a = up(&pth, "pth.png");
    assert_eq!(a.dimensions(), (80, 64), "x4 of 20x16");
    let b = up(&dir.join("converted.safetensors"), "st.png");
    assert!(a.as_bytes() == b.as_bytes(), "outputs differ");
}

/// A Swin2SR checkpoint (official `.pth` layout, buffers and all) describes itself and
/// upscales; a SwinIR file with a SwinV2 tensor added is read as Swin2SR and refused with
/// the first tensor it lacks, in one line.
#[test]
fn swin2sr_model_runs_and_a_crafted_one_is_refused() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    let pth = golden("swin2sr/classical_x2.pth");
    let v = info_json(dir, &pth);
    assert_eq!(v["architecture"], "Swin2SR");
    assert_eq!(v["scale"], 2);
    assert_eq!(v["window"], 8);
    assert_eq!(v["shifted"], true);
    run_on_cpu(dir, &pth, ("in.png", "out.png"));
    assert_eq!(open(&dir.join("out.png")).dimensions(), (40, 32));

    let mut tensors =
        candle_core::safetensors::load(golden("swinir/classical_x2.safetensors"), &Device::Cpu)
            .unwrap();
    tensors.insert(
        "layers.0.residual_group.blocks.0.attn.logit_scale".into(),
        Tensor::zeros((6, 1, 1), candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, dir.join("swin2sr.safetensors")).unwrap();
    assert_rejected(
        dir,
        &mut with_model(dir, "swin2sr.safetensors"),
        2,
        &[
            "swin2sr.safetensors",
            "Swin2SR checkpoint",
            "missing tensor",
        ],
    );
}

/// A checkpoint of an architecture this build does not run (ATD, told by its token
/// dictionary) gets one line naming it and what is supported.
#[test]
fn other_architecture_is_named_and_refused() {
    let d = tempdir();
    with_input(d.path());
    let zeros =
        |shape: &[usize]| Tensor::zeros(shape, candle_core::DType::F32, &Device::Cpu).unwrap();
    let tensors = std::collections::HashMap::from([
        ("conv_first.weight".to_string(), zeros(&[24, 3, 3, 3])),
        ("layers.0.residual_group.td".to_string(), zeros(&[64, 24])),
    ]);
    candle_core::safetensors::save(&tensors, d.path().join("atd.safetensors")).unwrap();
    assert_rejected(
        d.path(),
        &mut with_model(d.path(), "atd.safetensors"),
        2,
        &["atd.safetensors", "ATD", "SwinIR", "Swin2SR", "HAT"],
    );
}

/// A HAT checkpoint (official `.pth` layout) describes itself and upscales.
#[test]
fn hat_model_runs_and_describes_itself() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    let pth = golden("hat/hat_x4_ema.pth");
    let v = info_json(dir, &pth);
    assert_eq!(v["architecture"], "HAT");
    assert_eq!(v["scale"], 4);
    assert_eq!(v["overlap_ratio"], 0.5);
    assert_eq!(v["compress_ratio"], 2.0);
    run_on_cpu(dir, &pth, ("in.png", "out.png"));
    assert_eq!(open(&dir.join("out.png")).dimensions(), (80, 64));
}

// ---------------------------------------------------------------- large outputs

/// Decoded samples and the ICC profile and EXIF of an output file.
fn samples_and_metadata(path: &Path) -> (Vec<u8>, Option<Vec<u8>>, Option<Vec<u8>>) {
    let bytes = fs::read(path).unwrap();
    let (icc, exif) = metadata_of(&bytes);
    (open(path).into_bytes(), icc, exif)
}

/// The same image written in bands of rows as its tiles finish (`UPSCALE_STREAM=always`)
/// and whole (`never`): a TIFF byte for byte, a PNG sample for sample with the same metadata
/// (its compressed data is cut into chunks differently), 8- and 16-bit, odd sizes, several
/// tile rows and columns.
#[test]
fn outputs_written_in_bands_equal_the_whole_image() {
    let d = tempdir();
    let dir = d.path();
    let img = rgb_image(45, 37);
    let bytes = with_metadata(
        &img,
        ImageFormat::Png,
        Some(fake_icc(b"RGB ")),
        Some(exif_with_orientation(1)),
    );
    fs::write(dir.join("in8.png"), bytes).unwrap();
    let sixteen = image::DynamicImage::ImageRgb8(rgb_image(31, 19)).into_rgb16();
    sixteen.save(dir.join("in16.png")).unwrap();
    for input in ["in8.png", "in16.png"] {
        for ext in ["png", "tif"] {
            let mut outs = Vec::new();
            for mode in ["always", "never"] {
                let out = dir.join(format!("{mode}-{input}.{ext}"));
                upscale(dir)
                    .env("UPSCALE_STREAM", mode)
                    .args([input, "--tile", "12", "--tile_overlap", "4", "-o"])
                    .arg(&out)
                    .assert()
                    .success();
                outs.push(out);
            }
            let case = format!("{input} as {ext}");
            if ext == "tif" {
                assert!(
                    fs::read(&outs[0]).unwrap() == fs::read(&outs[1]).unwrap(),
                    "{case}: files differ"
                );
            }
            let (a, b) = (
                samples_and_metadata(&outs[0]),
                samples_and_metadata(&outs[1]),
            );
            assert!(a.0 == b.0, "{case}: samples differ");
            assert_eq!((&a.1, &a.2), (&b.1, &b.2), "{case}: metadata differs");
            if input == "in8.png" {
                assert_eq!(a.1, Some(fake_icc(b"RGB ")), "{case}: ICC profile");
            }
        }
    }
    let temporaries: Vec<_> = files_under(dir)
        .into_iter()
        .filter(|f| f.contains(".upscale-tmp-"))
        .collect();
    assert!(temporaries.is_empty(), "{temporaries:?}");
}

/// An output larger than its format allows is refused before the model runs, naming the
/// limit and the formats that would do; nothing is written.
#[test]
fn output_too_large_for_its_format_is_refused() {
    let d = tempdir();
    let dir = d.path();
    // x2: 8200 pixels wide in, 16400 out, over WebP's 16383.
    write_png(&dir.join("wide.png"), 8200, 2);
    assert_rejected(
        dir,
        upscale(dir).args(["wide.png", "-o", "out.webp"]),
        1,
        &["wide.png", "16400x4", "WebP", "16383", ".png or .tif"],
    );
}

/// A Real-CUGAN x4 pro model, built from the fixture's list of tensors (the reference
/// module's state dict) with small values of every sign, is described by `info` and runs
/// at four times the size; without one of its gates' tensors it is refused by name.
#[test]
fn realcugan_model_runs_and_a_broken_one_is_named() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    let text = fs::read_to_string(golden("realcugan/manifest.json")).unwrap();
    let cases: serde_json::Value = serde_json::from_str(&text).unwrap();
    let case = cases
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "realcugan_x4_pro")
        .unwrap();
    let mut tensors = HashMap::new();
    for t in case["tensors"].as_array().unwrap() {
        let shape: Vec<usize> = t[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 1e-3).collect();
        let name = t[0].as_str().unwrap().to_string();
        tensors.insert(name, Tensor::from_vec(values, shape, &Device::Cpu).unwrap());
    }
    candle_core::safetensors::save(&tensors, dir.join("cugan.safetensors")).unwrap();
    let v = info_json(dir, "cugan.safetensors");
    assert_eq!(v["architecture"], "Real-CUGAN pro x4");
    assert_eq!(v["scale"], 4);
    assert_eq!(v["pro"], true);
    run_on_cpu(dir, "cugan.safetensors", ("in.png", "out.png"));
    assert_eq!(open(&dir.join("out.png")).dimensions(), (80, 64));

    tensors.remove("unet2.conv4.seblock.conv1.bias");
    candle_core::safetensors::save(&tensors, dir.join("broken.safetensors")).unwrap();
    assert_rejected(
        dir,
        &mut with_model(dir, "broken.safetensors"),
        2,
        &[
            "broken.safetensors",
            "Real-CUGAN checkpoint",
            "missing tensor unet2.conv4.seblock.conv1.bias",
        ],
    );
}

/// An RCAN `{'params': ...}` `.pth` whose input is unshuffled: `info` names it, a run writes
/// twice the input's size, and a file missing a channel attention's bias is refused by name.
#[test]
fn rcan_model_runs_and_a_broken_one_is_named() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    fs::copy(golden("rcan/rcan_x2_unshuffle.pth"), dir.join("rcan.pth")).unwrap();
    let v = info_json(dir, "rcan.pth");
    assert_eq!(v["architecture"], "RCAN (pixel-unshuffled input)");
    assert_eq!(v["scale"], 2);
    assert_eq!(v["unshuffle"], 2);
    run_on_cpu(dir, "rcan.pth", ("in.png", "out.png"));
    assert_eq!(open(&dir.join("out.png")).dimensions(), (40, 32));

    let mut tensors =
        candle_core::safetensors::load(golden("rcan/rcan_x1_unshuffle.safetensors"), &Device::Cpu)
            .unwrap();
    tensors.remove("body.0.body.1.body.3.conv_du.2.bias");
    candle_core::safetensors::save(&tensors, dir.join("broken.safetensors")).unwrap();
    assert_rejected(
        dir,
        &mut with_model(dir, "broken.safetensors"),
        2,
        &[
            "broken.safetensors",
            "RCAN checkpoint",
            "missing tensor body.0.body.1.body.3.conv_du.2.bias",
        ],
    );
}

/// An FDAT `{'params_ema': ...}` `.pth` with transposed convolutions: `info` names it, a run
/// writes twice the input's size; a file whose description names the LDA upsampler is refused
/// by name.
#[test]
fn fdat_model_runs_and_an_lda_one_is_named() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    fs::copy(golden("fdat/fdat_x2_tc.pth"), dir.join("fdat.pth")).unwrap();
    let v = info_json(dir, "fdat.pth");
    assert_eq!(v["architecture"], "FDAT");
    assert_eq!(v["scale"], 2);
    assert_eq!(v["upsampler"], "transpose+conv");
    run_on_cpu(dir, "fdat.pth", ("in.png", "out.png"));
    assert_eq!(open(&dir.join("out.png")).dimensions(), (40, 32));
    // Converted, the upsampler's description stays uint8 (other loaders index with it) and
    // the file reads as the same model.
    let run = bare(dir)
        .args(["convert", "fdat.pth", "fdat.safetensors"])
        .output()
        .unwrap();
    assert_success(&run);
    let converted =
        candle_core::safetensors::load(dir.join("fdat.safetensors"), &Device::Cpu).unwrap();
    let meta = &converted["upsampler.MetaUpsample"];
    assert_eq!(meta.dtype(), candle_core::DType::U8);
    assert_eq!(meta.to_vec1::<u8>().unwrap(), [3, 5, 2, 16, 3, 16, 4]);
    assert_eq!(
        converted["conv_after.weight"].dtype(),
        candle_core::DType::F32
    );
    let again = info_json(dir, "fdat.safetensors");
    assert_eq!(again["upsampler"], "transpose+conv");
    assert_eq!(again["parameters"], v["parameters"]);

    let mut tensors =
        candle_core::safetensors::load(golden("fdat/fdat_x4_ps.safetensors"), &Device::Cpu)
            .unwrap();
    let lda = Tensor::from_vec(vec![3u8, 6, 4, 16, 3, 12, 4], 7, &Device::Cpu).unwrap();
    tensors.insert("upsampler.MetaUpsample".into(), lda);
    candle_core::safetensors::save(&tensors, dir.join("lda.safetensors")).unwrap();
    assert_rejected(
        dir,
        &mut with_model(dir, "lda.safetensors"),
        2,
        &["lda.safetensors", "FDAT checkpoint", "LDA upsampler"],
    );
}

/// A greyscale ESRGAN (one channel in and out) runs on a colour image's luma and writes equal
/// channels; on a grey PNG it writes a grey PNG.
#[test]
fn greyscale_model_runs_on_colour_and_grey_images() {
    let d = tempdir();
    let dir = d.path();
    with_input(dir);
    fs::copy(
        golden("grey/esrgan_x4_grey.safetensors"),
        dir.join("grey.safetensors"),
    )
    .unwrap();
    run_on_cpu(dir, "grey.safetensors", ("in.png", "out.png"));
    let out = open(&dir.join("out.png")).to_rgb8();
    assert_eq!(out.dimensions(), (80, 64));
    assert!(
        out.pixels().all(|p| p[0] == p[1] && p[1] == p[2]),
        "channels differ"
    );

    image::GrayImage::from_fn(12, 10, |x, y| image::Luma([(x * 20 + y * 3) as u8]))
        .save(dir.join("g.png"))
        .unwrap();
    run_on_cpu(dir, "grey.safetensors", ("g.png", "g_out.png"));
    let out = open(&dir.join("g_out.png"));
    assert_eq!(
        out.color(),
        image::ColorType::L8,
        "a grey source is written grey"
    );
    assert_eq!((out.width(), out.height()), (48, 40));
}
