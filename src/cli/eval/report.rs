//! `upscale eval`: measure a model on a folder of ground-truth images the way SR papers do,
//! and gate changes against a stored baseline.
//!
//! For each HR image the LR input is either made from it ([`metrics::bicubic_lr`]: crop to
//! a multiple of the scale, MATLAB bicubic by 1/scale, 8 bits) or read from an LR folder.
//! The model runs through [`Upscaler::upscale_image`] with the caller's tile settings, so
//! what is measured is what the main command ships; its output is rounded to 8 bits, then
//! PSNR/SSIM are taken as BasicSR does (Y channel, `scale` pixels cropped per side). The
//! MATLAB bicubic upscaling of the same LR image is measured alongside, because the gain
//! over bicubic is how a model's quality is usually stated.
//!
//! A [`Report`] serialises to one JSON object; the same object is the baseline format, of
//! which [`Baseline`] reads back the scale, the per-image PSNR-Y and the mean PSNR-Y.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use upscale::io::{self, Decoded};
use upscale::metrics::{self, ImageMetrics};
use upscale::{Format, Planar, Upscaled, Upscaler};

use crate::cli::pipeline;
use crate::cli::walk::walk;

/// Why an evaluation could not start.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// A folder or its images, as named by a flag.
    #[error("{0}")]
    Input(String),
    #[error(transparent)]
    Io(#[from] crate::cli::path_error::PathError),
    /// The baseline file, and what is wrong with it.
    #[error("--baseline {}: {what}", path.display())]
    Baseline { path: PathBuf, what: String },
}

/// One ground-truth image and, when LR images are given, its LR partner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    /// The HR file name: the key images are matched by in baselines.
    pub name: String,
    pub hr: PathBuf,
    pub lr: Option<PathBuf>,
}

/// The images in `hr_dir` (not its sub-folders), sorted, each paired with its file in
/// `lr_dir` when one is given.
///
/// An LR file pairs with HR `NAME.ext` when its stem is `NAME`, `NAMEx{scale}` or
/// `NAME_x{scale}` (the common benchmark spellings; any image extension). Returns the LR
/// files that paired with nothing too, so the caller can warn about them. A missing
/// folder, an empty one, an HR image without an LR partner or with several are errors.
pub fn find_pairs(
    hr_dir: &Path,
    lr_dir: Option<&Path>,
    scale: usize,
) -> Result<(Vec<Pair>, Vec<PathBuf>), EvalError> {
    let hr_files = image_files(hr_dir, "--hr")?;
    let Some(lr_dir) = lr_dir else {
        let pairs = hr_files
            .into_iter()
            .map(|hr| Pair {
                name: file_name(&hr),
                hr,
                lr: None,
            })
            .collect();
        return Ok((pairs, Vec::new()));
    };
    let lr_files = image_files(lr_dir, "--lr")?;
    let mut by_stem: HashMap<String, Vec<&PathBuf>> = HashMap::new();
    for f in &lr_files {
        by_stem.entry(file_stem(f)).or_default().push(f);
    }
    let mut pairs = Vec::new();
    let mut used = HashSet::new();
    let mut missing = Vec::new();
    for hr in hr_files {
        let stem = file_stem(&hr);
        let candidates: Vec<&PathBuf> = [
            stem.clone(),
            format!("{stem}x{scale}"),
            format!("{stem}_x{scale}"),
        ]
        .iter()
        .filter_map(|s| by_stem.get(s))
        .flatten()
        .copied()
        .collect();
        match candidates.as_slice() {
            [] => missing.push(file_name(&hr)),
            [lr] => {
                used.insert((*lr).clone());
                pairs.push(Pair {
                    name: file_name(&hr),
                    lr: Some((*lr).clone()),
                    hr,
                });
            }
            many => {
                return Err(EvalError::Input(format!(
                    "{} matches several LR files: {}",
                    hr.display(),
                    many.iter()
                        .map(|p| file_name(p))
                        .collect::<Vec<_>>()
                        .join(", ")
                )))
            }
        }
    }
    if !missing.is_empty() {
        return Err(EvalError::Input(format!(
            "no LR image in {} for {} of the HR images: {} (expected NAME, NAMEx{scale} or NAME_x{scale})",
            lr_dir.display(),
            missing.len(),
            shorten(&missing)
        )));
    }
    let unused = lr_files.into_iter().filter(|f| !used.contains(f)).collect();
    Ok((pairs, unused))
}

fn image_files(dir: &Path, flag: &str) -> Result<Vec<PathBuf>, EvalError> {
    if !dir.is_dir() {
        return Err(EvalError::Input(format!(
            "{flag} {}: not a folder",
            dir.display()
        )));
    }
    let files: Vec<PathBuf> = walk(&[dir.to_path_buf()], false)?
        .into_iter()
        .map(|f| f.path)
        .collect();
    if files.is_empty() {
        return Err(EvalError::Input(format!(
            "{flag} {}: no images found",
            dir.display()
        )));
    }
    Ok(files)
}

fn file_name(p: &Path) -> String {
    p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

fn file_stem(p: &Path) -> String {
    p.file_stem()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

/// Up to five names, then a count, so one error line stays readable.
fn shorten(names: &[String]) -> String {
    let mut s = names.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > 5 {
        s.push_str(&format!(" and {} more", names.len() - 5));
    }
    s
}

/// The HR image cropped to the size the model will produce, and the LR input.
pub fn load_pair(pair: &Pair, scale: usize) -> Result<(Planar, Planar), String> {
    let hr = io::decode(&pair.hr).map_err(|e| e.to_string())?.rgb;
    if hr.height < scale || hr.width < scale {
        return Err(format!(
            "{}: {}x{} (WxH) is smaller than the scale {scale}",
            pair.hr.display(),
            hr.width,
            hr.height
        ));
    }
    let (h, w) = (hr.height / scale * scale, hr.width / scale * scale);
    let lr = match &pair.lr {
        None => metrics::bicubic_lr(&hr, scale),
        Some(path) => {
            let lr = io::decode(path).map_err(|e| e.to_string())?.rgb;
            if lr.height * scale != h || lr.width * scale != w {
                return Err(format!(
                    "LR {} is {}x{} (WxH), so the output is {}x{}, but the HR image cropped to a multiple of {scale} is {w}x{h}",
                    path.display(),
                    lr.width,
                    lr.height,
                    lr.width * scale,
                    lr.height * scale
                ));
            }
            lr
        }
    };
    Ok((crop(&hr, h, w), lr))
}

/// The top-left `h x w` of `img` (BasicSR's `mod_crop` keeps that corner too).
fn crop(img: &Planar, h: usize, w: usize) -> Planar {
    if (img.height, img.width) == (h, w) {
        return img.clone();
    }
    let mut out = Planar::zeros(img.channels, h, w);
    for c in 0..img.channels {
        let (src, dst) = (img.plane(c), out.plane_mut(c));
        for y in 0..h {
            dst[y * w..(y + 1) * w].copy_from_slice(&src[y * img.width..y * img.width + w]);
        }
    }
    out
}

/// The metrics of one image: the model's output and the bicubic upscaling of the same LR.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageResult {
    pub name: String,
    pub sr: ImageMetrics,
    pub bicubic: ImageMetrics,
}

/// Measures the model output `sr` and MATLAB bicubic upscaling of `lr` against `hr`, both
/// rounded to 8 bits first, with `scale` pixels cropped per side.
pub fn measure(
    name: &str,
    hr: &Planar,
    lr: &Planar,
    sr: &Planar,
    scale: usize,
) -> Result<ImageResult, String> {
    let bicubic = metrics::quantize_u8(&metrics::imresize(lr, scale as f64));
    let sr = metrics::quantize_u8(sr);
    Ok(ImageResult {
        name: name.to_string(),
        sr: ImageMetrics::compute(&sr, hr, scale).map_err(|e| e.to_string())?,
        bicubic: ImageMetrics::compute(&bicubic, hr, scale).map_err(|e| e.to_string())?,
    })
}

/// `upscale eval` as [`pipeline::Stages`]: read a pair, upscale its LR image, measure
/// the result. Errors are one line, for the report.
pub struct EvalStages<'a> {
    /// The model, at its own scale.
    pub up: &'a Upscaler,
    pub scale: usize,
}

impl pipeline::Stages for EvalStages<'_> {
    type Task = Pair;
    /// The HR image and the LR input.
    type Read = (Planar, Decoded);
    type Up = Upscaled;
    type Done = ImageResult;

    fn name<'t>(&self, pair: &'t Pair) -> &'t Path {
        &pair.hr
    }

    fn read(&self, pair: &Pair) -> Result<(Planar, Decoded), String> {
        let (hr, lr) = load_pair(pair, self.scale)?;
        // Alpha is not measured, so none is passed on for the engine to upscale.
        let input = Decoded {
            rgb: lr,
            alpha: None,
            gray: false,
            bit_depth: 8,
            format: Format::Png,
            metadata: Default::default(),
        };
        Ok((hr, input))
    }

    fn upscale(&self, _: &Pair, (_, lr): &(Planar, Decoded)) -> Result<Upscaled, String> {
        self.up.upscale_image(lr).map_err(|e| format!("{e:#}"))
    }

    fn finish(
        &self,
        pair: &Pair,
        (hr, lr): (Planar, Decoded),
        sr: Upscaled,
    ) -> Result<ImageResult, String> {
        measure(&pair.name, &hr, &lr.rgb, &sr.rgb, self.scale)
    }
}

/// The outcome of an evaluation run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub scale: usize,
    pub images: Vec<ImageResult>,
    /// Images that could not be measured: name and reason.
    pub failed: Vec<(String, String)>,
}

impl Report {
    /// Mean of one metric over the measured images; NaN when there are none.
    pub fn mean(&self, f: impl Fn(&ImageResult) -> f64) -> f64 {
        self.images.iter().map(f).sum::<f64>() / self.images.len() as f64
    }

    pub fn mean_psnr_y(&self) -> f64 {
        self.mean(|r| r.sr.psnr_y)
    }

    pub fn mean_bicubic_psnr_y(&self) -> f64 {
        self.mean(|r| r.bicubic.psnr_y)
    }

    /// The report as one JSON object; also the baseline file format. Infinite PSNRs
    /// (identical images) are written as the string "inf", as JSON has no infinity.
    pub fn to_json(&self) -> Value {
        let images: Vec<Value> = self
            .images
            .iter()
            .map(|r| {
                json!({
                    "name": r.name,
                    "psnr_y": number(r.sr.psnr_y),
                    "ssim_y": number(r.sr.ssim_y),
                    "psnr_rgb": number(r.sr.psnr_rgb),
                    "bicubic_psnr_y": number(r.bicubic.psnr_y),
                    "bicubic_ssim_y": number(r.bicubic.ssim_y),
                    "bicubic_psnr_rgb": number(r.bicubic.psnr_rgb),
                })
            })
            .collect();
        let failed: Vec<Value> = self
            .failed
            .iter()
            .map(|(name, error)| json!({"name": name, "error": error}))
            .collect();
        json!({
            "scale": self.scale,
            "images": images,
            "mean_psnr_y": number(self.mean_psnr_y()),
            "mean_ssim_y": number(self.mean(|r| r.sr.ssim_y)),
            "mean_psnr_rgb": number(self.mean(|r| r.sr.psnr_rgb)),
            "mean_bicubic_psnr_y": number(self.mean_bicubic_psnr_y()),
            "mean_bicubic_ssim_y": number(self.mean(|r| r.bicubic.ssim_y)),
            "mean_bicubic_psnr_rgb": number(self.mean(|r| r.bicubic.psnr_rgb)),
            "mean_gain_y": number(diff(self.mean_psnr_y(), self.mean_bicubic_psnr_y())),
            "failed": failed,
        })
    }

    /// What the gate compares.
    pub fn scores(&self) -> Scores {
        Scores {
            mean_psnr_y: self.mean_psnr_y(),
            images: self
                .images
                .iter()
                .map(|r| (r.name.clone(), r.sr.psnr_y))
                .collect(),
        }
    }

    /// A plain-text table: one row per image, then the means.
    pub fn render_table(&self) -> String {
        let width = self
            .images
            .iter()
            .map(|r| r.name.chars().count())
            .max()
            .unwrap_or(0)
            .max("mean".len());
        let mut s = format!(
            "{:<width$}  {:>8}  {:>7}  {:>8}  {:>11}  {:>7}\n",
            "image", "PSNR-Y", "SSIM-Y", "PSNR-RGB", "bicubic Y", "gain Y"
        );
        let mut row = |name: &str, m: &ImageMetrics, b: &ImageMetrics| {
            s.push_str(&format!(
                "{name:<width$}  {:>8.4}  {:>7.4}  {:>8.4}  {:>11.4}  {:>+7.4}\n",
                m.psnr_y,
                m.ssim_y,
                m.psnr_rgb,
                b.psnr_y,
                diff(m.psnr_y, b.psnr_y)
            ));
        };
        for r in &self.images {
            row(&r.name, &r.sr, &r.bicubic);
        }
        let mean_sr = ImageMetrics {
            psnr_y: self.mean_psnr_y(),
            ssim_y: self.mean(|r| r.sr.ssim_y),
            psnr_rgb: self.mean(|r| r.sr.psnr_rgb),
        };
        let mean_bicubic = ImageMetrics {
            psnr_y: self.mean_bicubic_psnr_y(),
            ssim_y: self.mean(|r| r.bicubic.ssim_y),
            psnr_rgb: self.mean(|r| r.bicubic.psnr_rgb),
        };
        row("mean", &mean_sr, &mean_bicubic);
        s
    }
}

/// `a - b` in dB, where two equal infinities are no change rather than NaN.
fn diff(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        a - b
    }
}

fn number(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else if x.is_nan() {
        Value::Null
    } else if x > 0.0 {
        json!("inf")
    } else {
        json!("-inf")
    }
}

fn read_number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) if s == "inf" => Some(f64::INFINITY),
        Value::String(s) if s == "-inf" => Some(f64::NEG_INFINITY),
        _ => None,
    }
}

/// PSNR-Y per image and its mean: what the gate compares.
#[derive(Clone, Debug, PartialEq)]
pub struct Scores {
    pub mean_psnr_y: f64,
    pub images: Vec<(String, f64)>,
}

/// A stored report, read back for the gate.
#[derive(Clone, Debug, PartialEq)]
pub struct Baseline {
    /// Absent in hand-written baselines; checked against the run's scale when present.
    pub scale: Option<usize>,
    pub scores: Scores,
}

impl Baseline {
    pub fn read(path: &Path) -> Result<Self, EvalError> {
        let failed = |what: String| EvalError::Baseline {
            path: path.to_path_buf(),
            what,
        };
        let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
        Self::parse(&text).map_err(failed)
    }

    /// Reads the fields the gate needs from a report's JSON; other fields are ignored.
    /// The error says what is missing or wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let mean_psnr_y = v
            .get("mean_psnr_y")
            .and_then(read_number)
            .ok_or("no numeric \"mean_psnr_y\"")?;
        let list = v
            .get("images")
            .and_then(Value::as_array)
            .ok_or("no \"images\" list")?;
        let mut images = Vec::new();
        let mut seen = HashSet::new();
        for (i, item) in list.iter().enumerate() {
            let name = item
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("images[{i}] has no \"name\""))?;
            let psnr = item
                .get("psnr_y")
                .and_then(read_number)
                .ok_or_else(|| format!("images[{i}] ({name}) has no numeric \"psnr_y\""))?;
            if !seen.insert(name.to_string()) {
                return Err(format!("image {name} is listed twice"));
            }
            images.push((name.to_string(), psnr));
        }
        let scale = match v.get("scale") {
            None | Some(Value::Null) => None,
            Some(s) => Some(
                s.as_u64()
                    .and_then(|s| usize::try_from(s).ok())
                    .ok_or("\"scale\" is not a positive integer")?,
            ),
        };
        Ok(Self {
            scale,
            scores: Scores {
                mean_psnr_y,
                images,
            },
        })
    }
}

/// One reason the gate fails.
#[derive(Clone, Debug, PartialEq)]
pub enum GateProblem {
    ImageDrop {
        name: String,
        old: f64,
        new: f64,
    },
    MeanDrop {
        old: f64,
        new: f64,
    },
    /// In the baseline but not measured now (missing from the folder, or it failed).
    NotMeasured(String),
    /// Measured now but not in the baseline: the baseline no longer covers the set.
    NotInBaseline(String),
}

impl fmt::Display for GateProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GateProblem::ImageDrop { name, old, new } => write!(
                f,
                "{name}: PSNR-Y dropped {:.4} dB: {old:.4} -> {new:.4}",
                diff(*old, *new)
            ),
            GateProblem::MeanDrop { old, new } => write!(
                f,
                "mean PSNR-Y dropped {:.4} dB: {old:.4} -> {new:.4}",
                diff(*old, *new)
            ),
            GateProblem::NotMeasured(name) => {
                write!(f, "{name}: in the baseline but not measured in this run")
            }
            GateProblem::NotInBaseline(name) => write!(
                f,
                "{name}: measured but not in the baseline (write a new baseline to include it)"
            ),
        }
    }
}

/// Compares a run with a baseline: any image, or the mean, whose PSNR-Y fell by more than
/// `max_drop` dB fails, and so does any image present on only one side (a gate that
/// silently skipped images would pass a run that lost them). Gains never fail. Problems
/// come per image in baseline order, then images new to the run, then the mean.
pub fn gate(baseline: &Scores, run: &Scores, max_drop: f64) -> Vec<GateProblem> {
    // A NaN score (nothing measured) fails instead of slipping past the comparison.
    let dropped = |old: f64, new: f64| {
        let d = diff(old, new);
        d.is_nan() || d > max_drop
    };
    let now: HashMap<&str, f64> = run.images.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    let before: HashSet<&str> = baseline.images.iter().map(|(n, _)| n.as_str()).collect();
    let mut problems = Vec::new();
    for (name, old) in &baseline.images {
        match now.get(name.as_str()) {
            None => problems.push(GateProblem::NotMeasured(name.clone())),
            Some(&new) if dropped(*old, new) => problems.push(GateProblem::ImageDrop {
                name: name.clone(),
                old: *old,
                new,
            }),
            Some(_) => {}
        }
    }
    for (name, _) in &run.images {
        if !before.contains(name.as_str()) {
            problems.push(GateProblem::NotInBaseline(name.clone()));
        }
    }
    if dropped(baseline.mean_psnr_y, run.mean_psnr_y) {
        problems.push(GateProblem::MeanDrop {
            old: baseline.mean_psnr_y,
            new: run.mean_psnr_y,
        });
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores(mean: f64, images: &[(&str, f64)]) -> Scores {
        Scores {
            mean_psnr_y: mean,
            images: images.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
        }
    }

    #[test]
    fn same_scores_pass() {
        let s = scores(30.0, &[("a", 29.0), ("b", 31.0)]);
        assert!(gate(&s, &s, 0.05).is_empty());
    }

    #[test]
    fn drop_within_threshold_passes() {
        let old = scores(30.0, &[("a", 29.0), ("b", 31.0)]);
        let new = scores(29.96, &[("a", 28.96), ("b", 30.96)]);
        assert!(gate(&old, &new, 0.05).is_empty());
    }

    #[test]
    fn mean_drop_alone_fails() {
        // Each image within the threshold, the mean not: possible when the baseline mean
        // was written by hand or over another set; the mean is gated on its own.
        let old = scores(30.1, &[("a", 29.0), ("b", 31.0)]);
        let new = scores(30.0, &[("a", 29.0), ("b", 31.0)]);
        let p = gate(&old, &new, 0.05);
        assert_eq!(p.len(), 1);
        assert!(matches!(p[0], GateProblem::MeanDrop { old, new } if old == 30.1 && new == 30.0));
        assert!(p[0]
            .to_string()
            .starts_with("mean PSNR-Y dropped 0.1000 dB"));
    }

    #[test]
    fn one_image_drop_fails_naming_it() {
        let old = scores(30.0, &[("a", 29.0), ("b", 31.0), ("c", 30.0)]);
        let new = scores(29.97, &[("a", 29.0), ("b", 30.9), ("c", 30.0)]);
        let p = gate(&old, &new, 0.05);
        assert_eq!(
            p,
            vec![GateProblem::ImageDrop {
                name: "b".into(),
                old: 31.0,
                new: 30.9
            }]
        );
        assert_eq!(
            p[0].to_string(),
            "b: PSNR-Y dropped 0.1000 dB: 31.0000 -> 30.9000"
        );
    }

    #[test]
    fn improvement_passes() {
        let old = scores(30.0, &[("a", 29.0), ("b", 31.0)]);
        let new = scores(31.0, &[("a", 30.0), ("b", 32.0)]);
        assert!(gate(&old, &new, 0.05).is_empty());
        assert!(gate(&old, &new, 0.0).is_empty());
    }

    #[test]
    fn missing_images_fail_both_ways() {
        let old = scores(30.0, &[("a", 29.0), ("b", 31.0)]);
        let new = scores(30.0, &[("a", 29.0), ("c", 31.0)]);
        assert_eq!(
            gate(&old, &new, 0.05),
            vec![
                GateProblem::NotMeasured("b".into()),
                GateProblem::NotInBaseline("c".into())
            ]
        );
    }

    #[test]
    fn infinities_and_nan() {
        let inf = f64::INFINITY;
        let old = scores(inf, &[("a", inf)]);
        assert!(gate(&old, &old, 0.05).is_empty());
        let p = gate(&old, &scores(40.0, &[("a", 40.0)]), 0.05);
        assert_eq!(p.len(), 2);
        assert!(gate(&scores(40.0, &[("a", 40.0)]), &old, 0.05).is_empty());
        // No image measured: the mean is NaN, which must fail rather than pass.
        let p = gate(&scores(40.0, &[("a", 40.0)]), &scores(f64::NAN, &[]), 0.05);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0], GateProblem::NotMeasured("a".into()));
        assert!(matches!(p[1], GateProblem::MeanDrop { new, .. } if new.is_nan()));
    }

    fn metrics(psnr_y: f64) -> ImageMetrics {
        ImageMetrics {
            psnr_y,
            ssim_y: 0.9,
            psnr_rgb: psnr_y - 2.0,
        }
    }

    fn report() -> Report {
        Report {
            scale: 2,
            images: vec![
                ImageResult {
                    name: "a.png".into(),
                    sr: metrics(30.0),
                    bicubic: metrics(28.0),
                },
                ImageResult {
                    name: "b.png".into(),
                    sr: metrics(f64::INFINITY),
                    bicubic: metrics(33.0),
                },
            ],
            failed: vec![("c.png".into(), "bad file".into())],
        }
    }

    #[test]
    fn report_json_round_trips_through_baseline() {
        let r = report();
        let v = r.to_json();
        assert_eq!(v["scale"], 2);
        assert_eq!(v["images"][0]["name"], "a.png");
        assert_eq!(v["images"][0]["psnr_y"], 30.0);
        assert_eq!(v["images"][0]["bicubic_psnr_y"], 28.0);
        assert_eq!(v["images"][1]["psnr_y"], "inf");
        assert_eq!(v["mean_psnr_y"], "inf");
        assert_eq!(v["mean_bicubic_psnr_y"], 30.5);
        assert_eq!(v["mean_gain_y"], "inf");
        assert_eq!(v["failed"][0]["name"], "c.png");
        let b = Baseline::parse(&v.to_string()).unwrap();
        assert_eq!(b.scale, Some(2));
        assert_eq!(b.scores, r.scores());
    }

    #[test]
    fn mean_gain_is_mean_minus_bicubic() {
        let mut r = report();
        r.images[1].sr = metrics(35.0);
        let v = r.to_json();
        assert_eq!(v["mean_psnr_y"], 32.5);
        assert_eq!(v["mean_gain_y"], 2.0);
        let table = r.render_table();
        assert!(table.contains("a.png"));
        assert!(table.lines().last().unwrap().starts_with("mean "));
        assert!(table.contains("+2.0000"));
    }

    #[test]
    fn baseline_parse_errors() {
        assert!(Baseline::parse("not json").is_err());
        assert!(Baseline::parse(r#"{"images": []}"#).is_err());
        assert!(Baseline::parse(r#"{"mean_psnr_y": 30}"#).is_err());
        let e = Baseline::parse(r#"{"mean_psnr_y": 30, "images": [{"name": "a"}]}"#);
        assert!(format!("{:#}", e.unwrap_err()).contains("psnr_y"));
        let twice = r#"{"mean_psnr_y": 30, "images": [{"name": "a", "psnr_y": 1},
            {"name": "a", "psnr_y": 2}]}"#;
        assert!(Baseline::parse(twice).is_err());
        let ok = Baseline::parse(r#"{"mean_psnr_y": 30, "images": []}"#).unwrap();
        assert_eq!(ok.scale, None);
    }

    fn touch(dir: &Path, name: &str) {
        std::fs::write(dir.join(name), b"").unwrap();
    }

    #[test]
    fn pairs_by_stem_and_suffix() {
        let hr = tempfile::tempdir().unwrap();
        let lr = tempfile::tempdir().unwrap();
        for n in ["a.png", "b.png", "c.jpg"] {
            touch(hr.path(), n);
        }
        for n in ["a.png", "bx4.png", "c_x4.png", "extra.png", "notes.txt"] {
            touch(lr.path(), n);
        }
        let (pairs, unused) = find_pairs(hr.path(), Some(lr.path()), 4).unwrap();
        let got: Vec<(&str, String)> = pairs
            .iter()
            .map(|p| (p.name.as_str(), file_name(p.lr.as_ref().unwrap())))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a.png", "a.png".to_string()),
                ("b.png", "bx4.png".to_string()),
                ("c.jpg", "c_x4.png".to_string())
            ]
        );
        assert_eq!(unused, vec![lr.path().join("extra.png")]);
    }

    #[test]
    fn pairing_errors() {
        let hr = tempfile::tempdir().unwrap();
        let lr = tempfile::tempdir().unwrap();
        let e = find_pairs(hr.path(), None, 2).unwrap_err().to_string();
        assert!(e.contains("no images"), "{e}");
        let e = find_pairs(&hr.path().join("nope"), None, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a folder"), "{e}");
        touch(hr.path(), "a.png");
        touch(hr.path(), "b.png");
        touch(lr.path(), "a.png");
        touch(lr.path(), "ax2.png");
        touch(lr.path(), "q.png");
        let e = find_pairs(hr.path(), Some(lr.path()), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("several"), "{e}");
        std::fs::remove_file(lr.path().join("ax2.png")).unwrap();
        let e = find_pairs(hr.path(), Some(lr.path()), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("b.png") && !e.contains("a.png"), "{e}");
    }

    #[test]
    fn measure_identical_and_crop() {
        // Smooth waves, so that bicubic comes close but not exactly.
        let hr = Planar::new(
            3,
            40,
            36,
            (0..3 * 40 * 36)
                .map(|i| {
                    let (c, y, x) = (i / (40 * 36), i / 36 % 40, i % 36);
                    0.5 + 0.4 * ((x as f32 * 0.3 + c as f32).sin() * (y as f32 * 0.2).cos())
                })
                .collect(),
        );
        let hr = metrics::quantize_u8(&hr);
        let lr = metrics::bicubic_lr(&hr, 2);
        let r = measure("x", &hr, &lr, &hr, 2).unwrap();
        assert_eq!(r.sr.psnr_y, f64::INFINITY);
        assert!((r.sr.ssim_y - 1.0).abs() < 1e-12);
        assert!(r.bicubic.psnr_y.is_finite() && r.bicubic.psnr_y > 10.0);
        let c = crop(&hr, 3, 5);
        assert_eq!((c.height, c.width), (3, 5));
        assert_eq!(c.get(2, 2, 4), hr.get(2, 2, 4));
    }
}
