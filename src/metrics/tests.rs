//! Checks against fixtures computed by independent implementations (numpy/scipy,
//! scikit-image, BasicSR's `imresize`); see tests/fixtures/metrics/make_metrics_fixtures.py.

use super::*;
// The steps' own functions, whose typed errors these tests check.
use super::quality::{psnr, rgb_to_y, ssim};
use serde_json::Value;
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/metrics")
}

fn fixtures() -> Value {
    let text = std::fs::read_to_string(fixture_dir().join("metrics_fixtures.json"))
        .expect("metrics fixtures present");
    serde_json::from_str(&text).expect("fixture JSON")
}

/// An 8-bit RGB PNG as a planar image of levels `k / 255`.
fn load_png(name: &str) -> Planar {
    let img = image::open(fixture_dir().join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .to_rgb8();
    let (w, h) = (img.width() as usize, img.height() as usize);
    let mut out = Planar::zeros(3, h, w);
    for (x, y, px) in img.enumerate_pixels() {
        for c in 0..3 {
            out.plane_mut(c)[y as usize * w + x as usize] = f32::from(px[c]) / 255.0;
        }
    }
    out
}

/// A raw little-endian float32 HWC RGB array.
fn load_f32(name: &str) -> Vec<f32> {
    let bytes = std::fs::read(fixture_dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Largest difference between a planar image and an HWC array of the same shape.
fn hwc_max_diff(img: &Planar, hwc: &[f32]) -> f64 {
    assert_eq!(hwc.len(), img.data.len(), "reference size");
    let mut max = 0.0f64;
    for y in 0..img.height {
        for x in 0..img.width {
            for c in 0..img.channels {
                let r = hwc[(y * img.width + x) * img.channels + c];
                max = max.max(f64::from((img.get(c, y, x) - r).abs()));
            }
        }
    }
    max
}

fn top_left(img: &Planar, h: usize, w: usize) -> Planar {
    let mut out = Planar::zeros(img.channels, h, w);
    for c in 0..img.channels {
        for y in 0..h {
            for x in 0..w {
                out.plane_mut(c)[y * w + x] = img.get(c, y, x);
            }
        }
    }
    out
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("fixture field {key}"))
}

#[test]
fn psnr_and_ssim_match_reference() {
    let fx = fixtures();
    let pairs = fx["pairs"].as_array().unwrap();
    assert!(pairs.len() >= 4);
    let mut worst = [0.0f64; 4];
    for p in pairs {
        let name = p["name"].as_str().unwrap();
        let hr = load_png(p["hr"].as_str().unwrap());
        let sr = load_png(p["sr"].as_str().unwrap());
        let crop = p["crop"].as_u64().unwrap() as usize;
        let got = [
            psnr(&sr, &hr, crop, Measure::Y).unwrap(),
            psnr(&sr, &hr, crop, Measure::Rgb).unwrap(),
            ssim(&sr, &hr, crop, Measure::Y).unwrap(),
            ssim(&sr, &hr, crop, Measure::Rgb).unwrap(),
        ];
        let want = ["psnr_y", "psnr_rgb", "ssim_y", "ssim_rgb"].map(|k| num(p, k));
        for i in 0..4 {
            let d = (got[i] - want[i]).abs();
            worst[i] = worst[i].max(d);
            assert!(
                d < 1e-6,
                "{name}: metric {i} got {} want {}",
                got[i],
                want[i]
            );
        }
        let all = ImageMetrics::compute(&sr, &hr, crop).unwrap();
        assert_eq!(
            (all.psnr_y, all.ssim_y, all.psnr_rgb),
            (got[0], got[2], got[1])
        );
    }
    println!(
        "max |diff| psnr_y {:.2e} dB, psnr_rgb {:.2e} dB, ssim_y {:.2e}, ssim_rgb {:.2e}",
        worst[0], worst[1], worst[2], worst[3]
    );
}

#[test]
fn bicubic_matches_basicsr_imresize_within_one_level() {
    let fx = fixtures();
    for r in fx["resize"].as_array().unwrap() {
        let name = r["name"].as_str().unwrap();
        let input = load_png(r["input"].as_str().unwrap());
        let want = load_png(r["output"].as_str().unwrap());
        let got = match r["mode"].as_str().unwrap() {
            "lr" => bicubic_lr(&input, r["factor"].as_u64().unwrap() as usize),
            _ => quantize_u8(&imresize(&input, num(r, "scale"))),
        };
        assert_eq!(
            (got.height, got.width),
            (want.height, want.width),
            "{name} size"
        );
        let diffs: Vec<i32> = got
            .data
            .iter()
            .zip(&want.data)
            .map(|(&g, &w)| (i32::from(level_u8(g)) - i32::from(level_u8(w))).abs())
            .collect();
        let max = *diffs.iter().max().unwrap();
        let exact = diffs.iter().filter(|&&d| d == 0).count() as f64 / diffs.len() as f64;
        println!(
            "{name}: {}x{} -> {}x{}, max diff {max}, exact {:.2}%",
            input.height,
            input.width,
            got.height,
            got.width,
            exact * 100.0
        );
        // Before rounding: BasicSR works in float32, so agreement is to about 1e-6.
        let reference = load_f32(r["output_f32"].as_str().unwrap());
        let source = match r["mode"].as_str().unwrap() {
            "lr" => {
                let f = r["factor"].as_u64().unwrap() as usize;
                top_left(&input, want.height * f, want.width * f)
            }
            _ => input.clone(),
        };
        let float = imresize(&source, num(r, "scale"));
        let float_max = hwc_max_diff(&float, &reference);
        println!("{name}: unrounded max |diff| {float_max:.2e} (0..1 scale)");
        assert!(float_max < 1e-5, "{name}: unrounded difference {float_max}");
        assert!(max <= 1, "{name}: max 8-bit difference {max}");
        // The two differ only in float32-vs-float64 rounding: nearly all levels agree.
        assert!(exact > 0.99, "{name}: only {:.2}% exact", exact * 100.0);
    }
}

#[test]
fn identical_images_have_infinite_psnr_and_unit_ssim() {
    let img = load_png("pair_noise_hr.png");
    assert_eq!(psnr(&img, &img, 2, Measure::Y).unwrap(), f64::INFINITY);
    assert_eq!(psnr(&img, &img, 0, Measure::Rgb).unwrap(), f64::INFINITY);
    assert!((ssim(&img, &img, 2, Measure::Y).unwrap() - 1.0).abs() < 1e-12);
}

#[test]
fn y_uses_studio_swing_bt601() {
    // White is 235, black 16, pure red 16 + 65.481.
    let img = Planar::new(3, 1, 3, vec![1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
    let y = rgb_to_y(&img).unwrap();
    let want = [235.0, 16.0, 16.0 + 65.481];
    for (g, w) in y.iter().zip(want) {
        assert!((g - w).abs() < 1e-9, "{g} vs {w}");
    }
}

#[test]
fn quantize_gives_exact_levels() {
    let img = Planar::new(1, 1, 5, vec![-0.2, 0.5, 1.3, 0.25, 2.0 / 255.0]);
    let q = quantize_u8(&img);
    let levels: Vec<u8> = q.data.iter().map(|&x| level_u8(x)).collect();
    // 0.5 * 255 = 127.5 rounds half to even like numpy; 0.25 * 255 = 63.75.
    assert_eq!(levels, [0, 128, 255, 64, 2]);
    for (&x, &l) in q.data.iter().zip(&levels) {
        assert_eq!(to_255(x), f64::from(l));
    }
}

#[test]
fn errors_instead_of_panics_on_bad_input() {
    let a = Planar::zeros(3, 20, 20);
    let b = Planar::zeros(3, 20, 21);
    assert!(matches!(
        psnr(&a, &b, 0, Measure::Y),
        Err(MetricsError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        psnr(&a, &a, 10, Measure::Y),
        Err(MetricsError::CropTooLarge { .. })
    ));
    assert!(matches!(
        ssim(&a, &a, 5, Measure::Y),
        Err(MetricsError::TooSmallForSsim { .. })
    ));
    let four = Planar::zeros(4, 20, 20);
    assert_eq!(
        psnr(&four, &four, 0, Measure::Y),
        Err(MetricsError::NotRgb(4))
    );
}

#[test]
fn resize_keeps_constants_and_sizes() {
    // Weights are normalised, so a flat image stays flat, up or down, at any size.
    let img = Planar::new(1, 7, 5, vec![0.3; 35]);
    for scale in [0.5, 1.0 / 3.0, 0.25, 2.0, 3.0] {
        let out = imresize(&img, scale);
        assert_eq!(out.height, (7.0 * scale).ceil() as usize);
        assert!(out.data.iter().all(|&v| (v - 0.3).abs() < 1e-6), "{scale}");
    }
}
