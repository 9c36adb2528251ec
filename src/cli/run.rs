//! `upscale INPUT...`: checks the flags, plans the outputs, runs the jobs through
//! [`super::pipeline`] and reports each outcome.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;

use upscale::io::{self, DecodeLimits};
use upscale::{Format, LaneStats, OutputSize};

use super::naming::{self, is_dash, Job};
use super::pipeline::{self, EncodeChoice, FileStages, Written};
use super::scheduler;
use super::shard::{Shard, ShardSpec};
use super::walk::{walk, InputFile};
use super::{Logger, RunArgs};

type Outcome = (Job, Result<Written, String>);

pub fn run(args: RunArgs, log: &Logger) -> Result<ExitCode> {
    let shard = resolve_shard(args.shard, log)?;
    let format = args.format;
    if let Some(f) = format {
        check_depth(args.bit_depth, f, &format!("--format {}", f.extension()))?;
    }
    let stream = plan_stream(&args)?;
    let files = match stream {
        Some(_) => Vec::new(),
        None => walk(&args.inputs, args.recursive)?,
    };
    if stream.is_none() && files.is_empty() {
        bail!("no images found in {}", display_list(&args.inputs));
    }

    let size = OutputSize::from_flags(args.outscale, args.width, args.height);
    let up = super::setup(&args.infer, size)?;
    let (jobs, stdin, skipped) =
        plan_jobs(&args, shard, stream, &files, size.tag(up.scale()), log)?;

    let warn = |m: String| log.warn(m);
    let detail = |m: String| log.verbose(m);
    let stages = FileStages {
        up: &up,
        encode: EncodeChoice {
            bit_depth: args.bit_depth,
            quality: args.quality,
            strip: args.strip,
        },
        stdin: Mutex::new(stdin),
        warn: &warn,
        detail: &detail,
        writer: None,
        defer_finish: up.defers_finish(),
    };
    let progress = progress_bar(jobs.len(), log, args.json);
    let start = Instant::now();
    let outcomes = if args.io_threads == 0 {
        pipeline::run_inline(&stages, jobs, &mut |o| report(o, &args, log, &progress))
    } else {
        pipeline::run_threaded(&stages, jobs, args.io_threads.into(), &|o| {
            report(o, &args, log, &progress)
        })
    };
    progress.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    Ok(summarize(
        &outcomes,
        skipped,
        secs,
        up.lane_count(),
        shard,
        args.json,
        log,
    ))
}

/// The shard to take: as given, or read from the job array's variables (`--shard auto`),
/// before anything else runs so that a refusal costs nothing.
fn resolve_shard(spec: Option<ShardSpec>, log: &Logger) -> Result<Option<Shard>> {
    match spec {
        None => Ok(None),
        Some(ShardSpec::Fixed(shard)) => Ok(Some(shard)),
        Some(ShardSpec::Auto { count }) => {
            let d = scheduler::detect(count, |var| std::env::var(var).ok())?;
            log.verbose(format!(
                "--shard auto: {} ({}): shard {}",
                d.scheduler.name(),
                d.from,
                d.shard
            ));
            Ok(Some(d.shard))
        }
    }
}

/// The jobs left to do (outputs named, the shard taken, finished ones dropped), standard
/// input's bytes when it is the input, and how many outputs exist already.
fn plan_jobs(
    args: &RunArgs,
    shard: Option<Shard>,
    stream: Option<Stream>,
    files: &[InputFile],
    tag: String,
    log: &Logger,
) -> Result<(Vec<Job>, Option<Vec<u8>>, usize)> {
    let (mut jobs, stdin) = match stream {
        Some(s) => (vec![s.job], s.stdin),
        None => {
            let naming = naming::NamingOptions {
                output: args.output.clone(),
                tag,
                format: args.format,
                overwrite: args.overwrite,
            };
            (naming::plan_outputs(files, &naming)?, None)
        }
    };
    if let [job] = jobs.as_slice() {
        if args.output.as_ref() == Some(&job.output) {
            let what = match is_dash(&job.output) {
                true => "-o -".to_string(),
                false => job.output.display().to_string(),
            };
            check_depth(args.bit_depth, job.format, &what)?;
        }
    }
    if let Some(shard) = shard {
        // Split before dropping finished jobs, so every shard sees the same partition.
        jobs = super::shard::select_shard(jobs, shard);
    }
    remove_leftovers(&jobs, log);
    let skipped = jobs.iter().filter(|j| j.skip).count();
    let jobs: Vec<Job> = jobs.into_iter().filter(|j| !j.skip).collect();
    if skipped > 0 {
        log.info(format!(
            "{skipped} output(s) exist already and are skipped (--overwrite to redo)"
        ));
    }
    Ok((jobs, stdin, skipped))
}

/// The closing line (and `--json` summary object), and the exit code: 1 if any image failed.
fn summarize(
    outcomes: &[Outcome],
    skipped: usize,
    secs: f64,
    lanes_count: usize,
    shard: Option<Shard>,
    json: bool,
    log: &Logger,
) -> ExitCode {
    let failed = outcomes.iter().filter(|(_, r)| r.is_err()).count();
    let done = outcomes.len() - failed;
    if json {
        let mut lanes = Vec::new();
        for (_, result) in outcomes {
            if let Ok(d) = result {
                LaneStats::merge(&mut lanes, &d.lanes);
            }
        }
        let mut line = json!({"summary": true, "done": done, "failed": failed, "skipped": skipped,
                   "seconds": secs, "images_per_s": if secs > 0.0 { done as f64 / secs } else { 0.0 },
                   "lanes": lanes_count, "lane_stats": lanes});
        // Which part of the list this was, so that `upscale report` can tell the shards that
        // never finished (a run without --shard keeps its summary as it was).
        if let Some(shard) = shard {
            line["shard"] = json!(shard.to_string());
        }
        println!("{line}");
    }
    log.info(format!(
        "{done} upscaled, {skipped} skipped, {failed} failed in {secs:.1} s"
    ));
    if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The one job of a run through standard input or output.
struct Stream {
    job: Job,
    /// All of standard input, when it is the input.
    stdin: Option<Vec<u8>>,
}

/// Checks a run that reads `-` or writes `-o -` and reads standard input; `None` for a run
/// over files only. Every refusal comes before the model is loaded.
fn plan_stream(args: &RunArgs) -> Result<Option<Stream>> {
    let from_stdin = args.inputs.iter().any(|p| is_dash(p));
    let to_stdout = args.output.as_deref().is_some_and(is_dash);
    if !from_stdin && !to_stdout {
        return Ok(None);
    }
    if to_stdout && args.json {
        bail!("--json and -o - would both write to standard output; write the image to a file to get the report");
    }
    if from_stdin && args.inputs.len() > 1 {
        bail!("- (standard input) must be the only input");
    }
    if to_stdout && std::io::stdout().is_terminal() {
        bail!("-o -: standard output is a terminal; redirect it to a file or a pipe");
    }
    let input = if from_stdin {
        InputFile {
            path: PathBuf::from("-"),
            root: None,
            rel: PathBuf::from("-"),
        }
    } else {
        match walk(&args.inputs, args.recursive)?.as_slice() {
            [one] if one.root.is_none() => one.clone(),
            _ => bail!("-o - (standard output) takes one input file, not a folder or a list"),
        }
    };
    let output = match args.output.as_deref() {
        None => bail!(
            "standard input has no file name to name the output after; give -o FILE, or -o - for standard output"
        ),
        Some(out) => out,
    };
    if !to_stdout {
        if naming::is_folder_like(output) {
            bail!(
                "-o {}: with standard input, -o must name a file (or - for standard output)",
                output.display()
            );
        }
        io::check_output_parent(output)?;
    }
    let stdin = from_stdin.then(read_stdin).transpose()?;
    let format = if to_stdout {
        args.format.unwrap_or(Format::Png)
    } else {
        let sniffed = stdin.as_deref().and_then(Format::sniff);
        naming::file_output_format(output, args.format, || sniffed.unwrap_or(Format::Png))?
    };
    let skip = !to_stdout && output.exists() && !args.overwrite;
    Ok(Some(Stream {
        job: Job {
            input,
            output: output.to_path_buf(),
            format,
            skip,
        },
        stdin,
    }))
}

/// All of standard input, up to one byte past what decoding accepts (so that decoding
/// reports an oversized image as too large instead of reading without end).
fn read_stdin() -> Result<Vec<u8>> {
    let limit = DecodeLimits::default().max_alloc;
    let mut bytes = Vec::new();
    std::io::stdin()
        .lock()
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .context("reading standard input")?;
    Ok(bytes)
}

/// An explicit 16-bit request for a format that cannot hold it is a usage error, caught
/// before any image is processed; `what` is the flag or file that chose the format.
fn check_depth(bit_depth: Option<u8>, format: Format, what: &str) -> Result<()> {
    if bit_depth == Some(16) && !format.supports_16bit() {
        anyhow::bail!(
            "--bit-depth 16 with {what}: {format} cannot hold 16-bit samples (use --bit-depth 8, or PNG or TIFF)"
        );
    }
    Ok(())
}

fn report(o: &Outcome, args: &RunArgs, log: &Logger, progress: &indicatif::ProgressBar) {
    progress.inc(1);
    let (job, result) = o;
    let (input, output) = (&job.input.path, &job.output);
    match result {
        Ok(d) => {
            if args.json {
                println!(
                    "{}",
                    json!({"input": input, "output": output, "status": "ok",
                           "input_size": [d.in_size.0, d.in_size.1],
                           "output_size": [d.out_size.0, d.out_size.1],
                           "seconds": d.seconds, "tiles": d.tiles, "lane_stats": d.lanes})
                );
            }
            progress.suspend(|| {
                log.verbose(format!(
                    "{} -> {} ({}x{} -> {}x{}, {} tiles, {:.2} s)",
                    input.display(),
                    output.display(),
                    d.in_size.0,
                    d.in_size.1,
                    d.out_size.0,
                    d.out_size.1,
                    d.tiles,
                    d.seconds
                ))
            });
        }
        Err(msg) => {
            if args.json {
                println!(
                    "{}",
                    json!({"input": input, "output": output, "status": "error", "error": msg})
                );
            }
            progress.suspend(|| log.error(msg));
        }
    }
}

fn progress_bar(len: usize, log: &Logger, json: bool) -> indicatif::ProgressBar {
    if log.quiet || json || len < 2 || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len as u64);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} images, {per_sec}, eta {eta}")
    {
        bar.set_style(style);
    }
    bar
}

/// A killed run can leave a temporary behind (never a final name). Temporaries untouched for
/// this long belong to no live writer, even one from another shard in the same folder.
const STALE_TEMPORARY: std::time::Duration = std::time::Duration::from_secs(600);

fn remove_leftovers(jobs: &[Job], log: &Logger) {
    let outputs: Vec<&std::path::Path> = jobs
        .iter()
        .map(|j| j.output.as_path())
        .filter(|p| !is_dash(p))
        .collect();
    match io::remove_stale_temporaries(&outputs, STALE_TEMPORARY) {
        Ok(removed) => {
            for path in removed {
                log.verbose(format!("removed stale temporary {}", path.display()));
            }
        }
        Err(e) => log.verbose(format!("looking for stale temporaries: {e}")),
    }
}

fn display_list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
