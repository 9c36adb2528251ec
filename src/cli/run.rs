//! `upscale INPUT...`: files and folders through one loaded model, with decoding and
//! encoding on worker threads so the model never waits for the disk.

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;

use super::{Logger, RunArgs};
use crate::engine::image::{TileSettings, Upscaled};
use crate::engine::lanes::Lanes;
use crate::io::{self, Decoded, EncodeOptions, Format, InputFile, Job};
use crate::size::{self, OutputSize};
use crate::tile::lanes::merge_lane_stats;
use crate::tile::LaneStats;

/// Images waiting between stages: enough to hide a slow file, few enough to bound memory.
const QUEUE_DEPTH: usize = 2;

/// What happened to one input.
struct Outcome {
    input: PathBuf,
    output: PathBuf,
    result: Result<Done, String>,
}

struct Done {
    in_size: (usize, usize),
    out_size: (usize, usize),
    seconds: f64,
    tiles: usize,
    lanes: Vec<LaneStats>,
}

pub fn run(args: RunArgs, log: &Logger) -> Result<ExitCode> {
    let format = args.format;
    if let Some(f) = format {
        check_depth(args.bit_depth, f, &format!("--format {}", f.extension()))?;
    }
    let stream = plan_stream(&args)?;
    let files = match stream {
        Some(_) => Vec::new(),
        None => io::walk(&args.inputs, args.recursive)?,
    };
    if stream.is_none() && files.is_empty() {
        bail!("no images found in {}", display_list(&args.inputs));
    }

    let (engine, settings) = super::setup(&args.infer, log)?;
    let size = OutputSize::from_flags(args.outscale, args.width, args.height);
    let (mut jobs, stdin) = match stream {
        Some(s) => (vec![s.job], s.stdin),
        None => {
            let naming = io::NamingOptions {
                output: args.output.clone(),
                tag: size.tag(engine.scale()),
                format,
                overwrite: args.overwrite,
            };
            (io::plan_outputs(&files, &naming)?, None)
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
    if let Some(shard) = args.shard {
        // Split before dropping finished jobs, so every shard sees the same partition.
        jobs = io::select_shard(jobs, shard);
    }
    remove_leftovers(&jobs, log);
    let skipped = jobs.iter().filter(|j| j.skip).count();
    let jobs: Vec<Job> = jobs.into_iter().filter(|j| !j.skip).collect();
    if skipped > 0 {
        log.info(format!(
            "{skipped} output(s) exist already and are skipped (--overwrite to redo)"
        ));
    }

    let encode = EncodeChoice {
        bit_depth: args.bit_depth,
        quality: args.quality,
        quiet: log.quiet,
        verbose: log.verbose && !log.quiet,
        strip: args.strip,
    };
    let stdin = Mutex::new(stdin);
    let stages = Stages {
        engine: &engine,
        settings: &settings,
        choice: &encode,
        write: &write,
        stdin: &stdin,
        size,
    };
    let progress = progress_bar(jobs.len(), log, args.json);
    let start = Instant::now();
    let outcomes = if args.io_threads == 0 {
        run_inline(&stages, jobs, &mut |o| {
            report(&o, &args, log, &progress);
            o
        })
    } else {
        run_pipelined(&stages, jobs, &|o| report(o, &args, log, &progress))
    };
    progress.finish_and_clear();
    let failed = outcomes.iter().filter(|o| o.result.is_err()).count();
    let done = outcomes.len() - failed;
    let secs = start.elapsed().as_secs_f64();
    if args.json {
        let mut lanes = Vec::new();
        for o in &outcomes {
            if let Ok(d) = &o.result {
                merge_lane_stats(&mut lanes, &d.lanes);
            }
        }
        println!(
            "{}",
            json!({"summary": true, "done": done, "failed": failed, "skipped": skipped,
                   "seconds": secs, "images_per_s": if secs > 0.0 { done as f64 / secs } else { 0.0 },
                   "lanes": engine.count(), "lane_stats": lanes})
        );
    }
    log.info(format!(
        "{done} upscaled, {skipped} skipped, {failed} failed in {secs:.1} s"
    ));
    Ok(if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// `-` on the command line: standard input as an input, standard output as `-o`.
fn is_dash(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// What names standard input in messages.
const STDIN_NAME: &str = "standard input";

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
        match io::walk(&args.inputs, args.recursive)?.as_slice() {
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
        if io::is_folder_like(output) {
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
        io::file_output_format(output, args.format, || sniffed.unwrap_or(Format::Png))?
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
    let limit = io::DecodeLimits::default().max_alloc;
    let mut bytes = Vec::new();
    std::io::stdin()
        .lock()
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .context("reading standard input")?;
    Ok(bytes)
}

/// Decodes a job's input: its file, or the bytes read from standard input (taken, so they
/// are held once).
fn decode_input(path: &Path, stdin: &Mutex<Option<Vec<u8>>>) -> Result<Decoded, String> {
    if !is_dash(path) {
        return io::decode(path).map_err(|e| e.to_string());
    }
    let bytes = stdin
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .take()
        .unwrap_or_default();
    io::decode_bytes(Path::new(STDIN_NAME), &bytes, &io::DecodeLimits::default())
        .map_err(|e| e.to_string())
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

struct EncodeChoice {
    bit_depth: Option<u8>,
    quality: u8,
    /// `-q`: no warnings either.
    quiet: bool,
    /// `-v`: also say what metadata an output could not take.
    verbose: bool,
    /// `--strip`: no ICC profile or EXIF in the outputs.
    strip: bool,
}

/// Writes one upscaled image; the product's is [`write`], tests put in others.
type WriteFn<'a> =
    &'a (dyn Fn(&Job, &Decoded, &Upscaled, &EncodeChoice) -> Result<(), String> + Sync);

/// What every image goes through after decoding.
struct Stages<'a> {
    engine: &'a Lanes,
    settings: &'a TileSettings,
    choice: &'a EncodeChoice,
    write: WriteFn<'a>,
    /// Standard input's bytes, when the input is `-`.
    stdin: &'a Mutex<Option<Vec<u8>>>,
    /// The final size, when not the model's.
    size: OutputSize,
}

/// Runs one stage of one image, turning a panic (a bug, in our code or a library's) into an
/// error for that image alone: the other images go on, and the run's exit code and report
/// count it as failed instead of the outcome going missing.
fn guarded<T>(what: &std::path::Path, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("{}: internal error: {msg}", what.display()))
        }
    }
}

fn encode_options(job: &Job, dec_depth: u8, choice: &EncodeChoice) -> EncodeOptions {
    let mut opts = EncodeOptions::new(job.format);
    opts.bit_depth = choice
        .bit_depth
        .unwrap_or_else(|| job.format.default_bit_depth(dec_depth));
    opts.quality = choice.quality;
    opts
}

fn process(st: &Stages, dec: &Decoded) -> Result<Upscaled, String> {
    let mut up = st
        .engine
        .upscale_decoded(dec, st.settings)
        .map_err(|e| format!("{e:#}"))?;
    let (w, h) = st
        .size
        .dims(dec.rgb.width, dec.rgb.height, st.engine.scale());
    (up.rgb, up.alpha) = size::resize(up.rgb, up.alpha.take(), w, h)?;
    Ok(up)
}

fn write(job: &Job, dec: &Decoded, up: &Upscaled, choice: &EncodeChoice) -> Result<(), String> {
    let opts = encode_options(job, dec.bit_depth, choice);
    if up.alpha.is_some() && !job.format.supports_alpha() && !choice.quiet {
        eprintln!(
            "warning: {}: {} has no alpha channel; transparency is dropped",
            job.output.display(),
            job.format
        );
    }
    if opts.bit_depth == 16 && !job.format.supports_16bit() {
        return Err(format!(
            "{}: {} cannot hold 16-bit samples (use --bit-depth 8 or --format png|tiff)",
            job.output.display(),
            job.format
        ));
    }
    let none = io::Metadata::default();
    let meta = if choice.strip { &none } else { &dec.metadata };
    let left_out = if is_dash(&job.output) {
        let (bytes, left_out) =
            io::encode_to_vec(&up.rgb, up.alpha.as_ref(), dec.gray, meta, &opts)
                .map_err(|e| format!("standard output: {e}"))?;
        let mut out = std::io::stdout().lock();
        out.write_all(&bytes)
            .and_then(|()| out.flush())
            .map_err(|e| format!("standard output: {e}"))?;
        left_out
    } else {
        io::encode(
            &job.output,
            &up.rgb,
            up.alpha.as_ref(),
            dec.gray,
            meta,
            &opts,
        )
        .map_err(|e| e.to_string())?
    };
    if choice.verbose {
        let name = match is_dash(&job.output) {
            true => "standard output".to_string(),
            false => job.output.display().to_string(),
        };
        for note in left_out {
            eprintln!("{name}: {note}");
        }
    }
    Ok(())
}

fn outcome(dec: &Decoded, up: &Upscaled, seconds: f64) -> Done {
    Done {
        in_size: (dec.rgb.width, dec.rgb.height),
        out_size: (up.rgb.width, up.rgb.height),
        seconds,
        tiles: up.stats.tiles,
        lanes: up.lanes.clone(),
    }
}

/// Everything on this thread, one image after another (`--io_threads 0`).
fn run_inline(
    st: &Stages,
    jobs: Vec<Job>,
    sink: &mut dyn FnMut(Outcome) -> Outcome,
) -> Vec<Outcome> {
    jobs.into_iter()
        .map(|job| {
            let t = Instant::now();
            let input = &job.input.path;
            let result = guarded(input, || decode_input(input, st.stdin)).and_then(|dec| {
                let up = guarded(input, || process(st, &dec))
                    .map_err(|e| format!("{}: {e}", input.display()))?;
                guarded(&job.output, || (st.write)(&job, &dec, &up, st.choice))?;
                Ok(outcome(&dec, &up, t.elapsed().as_secs_f64()))
            });
            sink(Outcome {
                input: job.input.path.clone(),
                output: job.output.clone(),
                result,
            })
        })
        .collect()
}

type Decodedjob = (Job, Instant, Result<Decoded, String>);
type Upscaledjob = (Job, Instant, Decoded, Result<Upscaled, String>);

/// Decoder thread -> model (this thread) -> encoder thread, with bounded queues between.
/// Every job sent on gets exactly one outcome, even if a stage's thread dies.
fn run_pipelined(st: &Stages, jobs: Vec<Job>, report: &(dyn Fn(&Outcome) + Sync)) -> Vec<Outcome> {
    let (dec_tx, dec_rx): (SyncSender<Decodedjob>, Receiver<Decodedjob>) =
        sync_channel(QUEUE_DEPTH);
    let (enc_tx, enc_rx): (SyncSender<Upscaledjob>, Receiver<Upscaledjob>) =
        sync_channel(QUEUE_DEPTH);
    let all: Vec<(PathBuf, PathBuf)> = jobs
        .iter()
        .map(|j| (j.input.path.clone(), j.output.clone()))
        .collect();
    let mut outcomes = std::thread::scope(|scope| {
        scope.spawn(move || {
            for job in jobs {
                let t = Instant::now();
                let input = &job.input.path;
                let dec = guarded(input, || decode_input(input, st.stdin));
                if dec_tx.send((job, t, dec)).is_err() {
                    break;
                }
            }
        });
        let encoder = scope.spawn(move || {
            let mut outcomes = Vec::new();
            for (job, t, dec, up) in enc_rx {
                let result = up.and_then(|up| {
                    guarded(&job.output, || (st.write)(&job, &dec, &up, st.choice))?;
                    Ok(outcome(&dec, &up, t.elapsed().as_secs_f64()))
                });
                let o = Outcome {
                    input: job.input.path.clone(),
                    output: job.output.clone(),
                    result,
                };
                report(&o);
                outcomes.push(o);
            }
            outcomes
        });
        let mut early = Vec::new();
        for (job, t, dec) in dec_rx {
            match dec {
                Err(msg) => {
                    let o = Outcome {
                        input: job.input.path.clone(),
                        output: job.output.clone(),
                        result: Err(msg),
                    };
                    report(&o);
                    early.push(o);
                }
                Ok(dec) => {
                    let input = &job.input.path;
                    let up = guarded(input, || process(st, &dec))
                        .map_err(|e| format!("{}: {e}", input.display()));
                    if enc_tx.send((job, t, dec, up)).is_err() {
                        break;
                    }
                }
            }
        }
        drop(enc_tx);
        let mut outcomes = encoder.join().unwrap_or_default();
        outcomes.extend(early);
        outcomes
    });
    // A job without an outcome was lost with a thread that died outside the guarded stages:
    // it failed, and must be counted and reported so.
    let seen: std::collections::HashSet<PathBuf> =
        outcomes.iter().map(|o| o.output.clone()).collect();
    for (input, output) in all {
        if !seen.contains(&output) {
            let o = Outcome {
                result: Err(format!(
                    "{}: lost by a failed worker thread",
                    input.display()
                )),
                input,
                output,
            };
            report(&o);
            outcomes.push(o);
        }
    }
    outcomes
}

fn report(o: &Outcome, args: &RunArgs, log: &Logger, progress: &indicatif::ProgressBar) {
    progress.inc(1);
    match &o.result {
        Ok(d) => {
            if args.json {
                println!(
                    "{}",
                    json!({"input": o.input, "output": o.output, "status": "ok",
                           "input_size": [d.in_size.0, d.in_size.1],
                           "output_size": [d.out_size.0, d.out_size.1],
                           "seconds": d.seconds, "tiles": d.tiles, "lane_stats": d.lanes})
                );
            }
            progress.suspend(|| {
                log.verbose(format!(
                    "{} -> {} ({}x{} -> {}x{}, {} tiles, {:.2} s)",
                    o.input.display(),
                    o.output.display(),
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
                    json!({"input": o.input, "output": o.output, "status": "error", "error": msg})
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::image::TileChoice;
    use crate::engine::Engine;
    use crate::model::Checkpoint;
    use candle_core::{DType, Device};

    /// Three images through both pipelines with a writer that panics on the second: that
    /// image fails with the panic's message, the others are written, and every image has
    /// exactly one outcome.
    #[test]
    fn a_panicking_writer_fails_its_image_only() {
        let dir = tempfile::tempdir().unwrap();
        let inputs: Vec<PathBuf> = (0..3)
            .map(|i| dir.path().join(format!("{i}.png")))
            .collect();
        for p in &inputs {
            image::RgbImage::from_fn(12, 10, |x, y| image::Rgb([x as u8 * 20, y as u8 * 20, 7]))
                .save(p)
                .unwrap();
        }
        let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden/x2_w8_b2.safetensors");
        let engine =
            Engine::new(Checkpoint::load(&model).unwrap(), Device::Cpu, DType::F32).unwrap();
        let lanes = Lanes::single(engine);
        let settings = TileSettings {
            choice: TileChoice::Fixed(0),
            overlap: 0,
            batch: None,
            blend: crate::tile::BlendMode::Hann,
            quiet: true,
            tta: false,
        };
        let choice = EncodeChoice {
            bit_depth: None,
            quality: 90,
            quiet: true,
            verbose: false,
            strip: false,
        };
        let writer = |job: &Job, dec: &Decoded, up: &Upscaled, c: &EncodeChoice| {
            if job.input.path.ends_with("1.png") {
                panic!("encoder bug");
            }
            write(job, dec, up, c)
        };
        let stdin = Mutex::new(None);
        let stages = Stages {
            engine: &lanes,
            settings: &settings,
            choice: &choice,
            write: &writer,
            stdin: &stdin,
            size: OutputSize::Model,
        };
        for pipelined in [false, true] {
            let out = dir.path().join(format!("out-{pipelined}"));
            let naming = io::NamingOptions {
                output: Some(out.clone()),
                tag: "x2".into(),
                format: None,
                overwrite: true,
            };
            let jobs = io::plan_outputs(&io::walk(&inputs, false).unwrap(), &naming).unwrap();
            let reported = Mutex::new(0);
            let outcomes = if pipelined {
                run_pipelined(&stages, jobs, &|_| *reported.lock().unwrap() += 1)
            } else {
                run_inline(&stages, jobs, &mut |o| {
                    *reported.lock().unwrap() += 1;
                    o
                })
            };
            assert_eq!(outcomes.len(), 3, "pipelined {pipelined}");
            assert_eq!(*reported.lock().unwrap(), 3);
            for o in &outcomes {
                let second = o.input.ends_with("1.png");
                match &o.result {
                    Err(e) => assert!(second && e.contains("encoder bug"), "{e}"),
                    Ok(_) => assert!(!second && o.output.exists()),
                }
            }
        }
    }
}
