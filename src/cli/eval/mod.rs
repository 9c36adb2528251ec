//! `upscale eval`: PSNR/SSIM on a folder of HR images, optionally gated against a baseline.
//!
//! Exit codes: 0 all measured (and the gate passed); 1 an image failed or the gate failed;
//! 2 bad arguments or inputs (returned as errors from here).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;

use upscale::Upscaler;

use super::{InferArgs, Logger};

mod report;

use report::{Baseline, Report};

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Folder of ground-truth (HR) images.
    #[arg(long)]
    pub hr: PathBuf,
    /// Folder of LR inputs paired by name (NAME, NAMExS or NAME_xS); made from the HR
    /// images with MATLAB bicubic when omitted.
    #[arg(long)]
    pub lr: Option<PathBuf>,
    /// The model's scale factor (checked against the model).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub scale: u32,
    #[command(flatten)]
    pub infer: InferArgs,
    /// One JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// A report written earlier with --write_baseline: exit 1 when the mean or any image's
    /// PSNR-Y drops by more than --max_drop, or an image is on only one side.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// Largest PSNR-Y drop in dB, per image and of the mean, that the gate accepts.
    #[arg(long = "max_drop", alias = "max-drop", default_value_t = 0.05)]
    pub max_drop: f64,
    /// Write the report (the --json object) to this file as the new baseline.
    #[arg(long = "write_baseline", alias = "write-baseline")]
    pub write_baseline: Option<PathBuf>,
}

pub fn run(args: EvalArgs, log: &Logger) -> Result<ExitCode> {
    if !(args.max_drop.is_finite() && args.max_drop >= 0.0) {
        bail!("--max_drop must be a number >= 0, not {}", args.max_drop);
    }
    let scale = args.scale as usize;
    // Read before the model runs, so a bad path costs nothing.
    let baseline = args.baseline.as_deref().map(Baseline::read).transpose()?;
    if let Some(s) = baseline.as_ref().and_then(|b| b.scale) {
        if s != scale {
            bail!("the baseline was measured at x{s}, this run is x{scale}");
        }
    }
    let (pairs, unused) = report::find_pairs(&args.hr, args.lr.as_deref(), scale)?;
    for f in &unused {
        log.warn(format!(
            "{}: no HR image of that name, ignored",
            f.display()
        ));
    }
    let up = super::setup(&args.infer, upscale::OutputSize::Model)?;
    if up.scale() != scale {
        bail!(
            "--scale {scale} does not match the model, which upscales x{}",
            up.scale()
        );
    }

    let report = measure_all(&up, pairs, scale, log);

    let mut out = report.to_json();
    let mut ok = report.failed.is_empty();
    if let Some(path) = &args.write_baseline {
        write_baseline(path, &report, &out, log)?;
    }
    if let (Some(b), Some(path)) = (&baseline, &args.baseline) {
        let problems = report::gate(&b.scores, &report.scores(), args.max_drop);
        for p in &problems {
            log.error(format!("gate: {p}"));
        }
        ok &= problems.is_empty();
        out["gate"] = serde_json::json!({
            "baseline": path,
            "max_drop": args.max_drop,
            "passed": problems.is_empty(),
            "problems": problems.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        });
    }

    if args.json {
        println!("{out}");
    } else {
        print!("{}", report.render_table());
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Stores the report `out` as the new baseline, unless an image failed: a baseline without
/// the failed images would stop gating them.
fn write_baseline(
    path: &Path,
    report: &Report,
    out: &serde_json::Value,
    log: &Logger,
) -> Result<()> {
    if !report.failed.is_empty() {
        log.error(format!(
            "{} image(s) failed; baseline {} not written",
            report.failed.len(),
            path.display()
        ));
        return Ok(());
    }
    let text = serde_json::to_string_pretty(out)? + "\n";
    upscale::io::write_atomic(path, |w| w.write_all(text.as_bytes()))
        .with_context(|| format!("--write_baseline {}", path.display()))
}

/// Every pair through the pipeline: the measured images and the failures, in folder order.
fn measure_all(up: &Upscaler, pairs: Vec<report::Pair>, scale: usize, log: &Logger) -> Report {
    let mut report = Report {
        scale,
        ..Report::default()
    };
    let stages = report::EvalStages { up, scale };
    let outcomes = super::pipeline::run_threaded(&stages, pairs, 1, &|(_, result)| {
        if let Err(msg) = result {
            log.error(msg);
        }
    });
    for (pair, result) in outcomes {
        match result {
            Ok(r) => report.images.push(r),
            Err(msg) => report.failed.push((pair.name, msg)),
        }
    }
    report
}
