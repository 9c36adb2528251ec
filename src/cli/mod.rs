//! The `upscale` command-line tool: its flags (clap), their mapping onto the library's
//! [`upscale::Upscaler`], and the machinery of a folder run (expanding INPUT arguments,
//! naming outputs, sharding, the reader/model/encoder threads). It reaches the library only
//! through its public API; no model or image logic lives here.
//!
//! Every multi-word flag is spelled with an underscore, as the official scripts do, and also
//! accepted with dashes.

pub(crate) mod alloc;
mod convert;
mod eval;
mod info;
mod naming;
mod path_error;
mod pipeline;
mod report;
mod run;
mod scheduler;
mod shard;
mod walk;

use std::path::PathBuf;

use clap::builder::{EnumValueParser, PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};

use upscale::{Attention, BlendMode, DeviceChoice, Format, OutputSize, Precision};

use shard::{parse_shard_spec, ShardSpec};

/// `upscale --version`: the version, what the binary was built to run on, and the credits the
/// embedded model's training images ask for.
macro_rules! long_version {
    ($build:expr) => {
        concat!(
            env!("CARGO_PKG_VERSION"),
            "\n",
            $build,
            "\nEmbedded default model: a small DRCT x4, weights under the MIT licence like the code,",
            "\ntrained only on CC0, public-domain and CC-BY photographs. CC-BY credits: Trevor",
            "\n\"Freespace\", Jakub Mede, Aitzol Berasategi (CC-BY-4.0, Debian lomiri-wallpapers);",
            "\ndanielbuechele and vultilion on Flickr (CC-BY-2.0, scikit-learn's sample images);",
            "\nNevit Dilmen (CC-BY-3.0, Debian sddm-theme-maldives).",
            "\nEvery image and its licence: models/README.md."
        )
    };
}

#[cfg(feature = "cuda")]
const LONG_VERSION: &str = long_version!(concat!(
    "Build: CPU and CUDA; our kernels compiled for GPUs of compute capability ",
    env!("UPSCALE_CUDA_CAP"),
    " and newer"
));
#[cfg(not(feature = "cuda"))]
const LONG_VERSION: &str =
    long_version!("Build: CPU only; for NVIDIA GPUs, build with --features cuda (README, CUDA)");

#[derive(Parser, Debug)]
#[command(
    name = "upscale",
    version,
    long_version = LONG_VERSION,
    about = "DRCT, SwinIR, Swin2SR, HAT, DAT, ESRGAN, Real-ESRGAN Compact, SPAN, PLKSR, RealPLKSR, OmniSR, Real-CUGAN, RCAN, MoSR, FDAT and SAFMN super-resolution and SwinIR restoration: official weights, seamless tiles, CPU and CUDA",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Show the configuration detected from a model's weights.
    Info {
        /// A .safetensors or .pth file; the embedded model when omitted.
        model: Option<PathBuf>,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write a clean .safetensors (buffers dropped, config in the metadata).
    Convert {
        input: PathBuf,
        output: PathBuf,
        /// Weight dtype of the output.
        #[arg(long, default_value = "f32", value_parser = convert::parse_dtype)]
        dtype: Precision,
    },
    /// Measure latency, throughput, memory and FLOP rate of one configuration.
    Bench(BenchArgs),
    /// PSNR/SSIM on HR images as SR papers report them; gate against a baseline.
    Eval(eval::EvalArgs),
    /// Combine the --json logs of many runs (a job array's shards, re-runs) into one account.
    ///
    /// Images done, skipped and failed (each named with its error and log), logs without a
    /// summary line (killed runs), and the shards of N with no finished run. Exit code 1
    /// when an image failed or a shard is missing.
    Report {
        /// Files of --json lines (`-` for standard input); other lines in them are passed over.
        #[arg(required = true)]
        logs: Vec<PathBuf>,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script (e.g. `upscale completions bash >
    /// ~/.local/share/bash-completion/completions/upscale`).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page in roff (e.g. `upscale man > ~/.local/share/man/man1/upscale.1`).
    Man {
        /// Write upscale.1 and a page for each subcommand (upscale-info.1, ...) into this
        /// existing folder instead.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub infer: InferArgs,
    /// Input size HxW of the synthetic test pattern.
    #[arg(long, default_value = "64x64", value_parser = parse_size)]
    pub size: (usize, usize),
    /// Untimed runs first (allocations, caches).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed runs.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub reps: u32,
    /// The device's peak rate in TFLOP/s, to report model FLOP utilisation.
    #[arg(long = "peak_tflops", alias = "peak-tflops")]
    pub peak_tflops: Option<f64>,
    /// Also measure the cost per input pixel that the automatic tile plans with: one probe
    /// forward pass on the CPU before the warm-up, whose memory then shows in the peak.
    #[arg(long = "tile_cost", alias = "tile-cost")]
    pub tile_cost: bool,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

fn parse_size(s: &str) -> Result<(usize, usize), String> {
    let (h, w) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("size '{s}' must look like 64x64"))?;
    let p = |v: &str| v.trim().parse::<usize>().ok().filter(|&n| n > 0);
    match (p(h), p(w)) {
        (Some(h), Some(w)) => Ok((h, w)),
        _ => Err(format!(
            "size '{s}' must be two positive integers like 64x64"
        )),
    }
}

/// Options that choose and run the model; shared by upscaling, eval and bench.
#[derive(Args, Debug, Clone)]
pub struct InferArgs {
    /// Model weights (.safetensors or official .pth); the embedded default model if omitted.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// auto, cpu, cuda, cuda:N or cuda:N,M,...
    #[arg(
        long,
        default_value = "auto",
        value_name = "auto|cpu|cuda[:N[,M...]]",
        value_parser = parse_device
    )]
    pub device: DeviceChoice,
    /// auto: bf16 on GPUs from compute capability 8.0 (Ampere) on, fp16 on older ones, fp32 on
    /// the CPU. bf16 on an older GPU falls back to fp16; on the CPU it needs AMX or
    /// AVX512-BF16 (activations stay f32) and falls back to fp32 without them, as fp16 does.
    #[arg(long, default_value = "auto", ignore_case = true, value_parser = precision_parser())]
    pub precision: Precision,
    /// Tile size in input pixels; 0 = the whole image at once. Automatic when omitted.
    #[arg(long)]
    pub tile: Option<usize>,
    /// Overlap between neighbouring tiles, in input pixels.
    #[arg(long = "tile_overlap", alias = "tile-overlap", default_value_t = upscale::Options::default().overlap)]
    pub tile_overlap: usize,
    /// Choose tile size and batch from free memory (the default when --tile is not given).
    #[arg(long = "tile_auto", alias = "tile-auto")]
    pub tile_auto: bool,
    /// Tiles per forward pass.
    #[arg(long = "tile_batch_size", alias = "tile-batch-size", value_parser = clap::value_parser!(u32).range(1..))]
    pub tile_batch_size: Option<u32>,
    /// Lanes per GPU: each has its own CUDA stream and copy of the weights, and they share
    /// the tiles of every image. Ignored on the CPU. A second lane costs a copy of the weights
    /// and its own activations, and so far has made one GPU slower (an H200 ran DRCT-L 1.2x
    /// slower with 2): keep 1 unless you measure a gain.
    #[arg(long, default_value_t = upscale::Options::default().streams as u32, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub streams: u32,
    /// How overlapping tiles are merged.
    #[arg(long, ignore_case = true, default_value = "hann",
          value_parser = EnumValueParser::<BlendChoice>::new().map(BlendMode::from))]
    pub blend: BlendMode,
    /// Same as --blend hann.
    #[arg(long = "hann_blend", alias = "hann-blend")]
    pub hann_blend: bool,
    /// Let fp32 matmuls on CUDA use TF32 tensor cores (faster, ~1e-3 relative error).
    #[arg(long)]
    pub tf32: bool,
    /// Window attention on CUDA: tensor-core (the fused kernel's two products on tensor cores,
    /// for bf16/fp16; 1.3x `fused` on an H100), fused (one kernel per block, no score tensors)
    /// or reference (candle's matmul/softmax graph). The CPU runs its own kernel either way.
    #[arg(long, ignore_case = true, default_value = "tensor-core",
          value_parser = EnumValueParser::<AttentionChoice>::new().map(Attention::from))]
    pub attention: Attention,
    /// Test-time self-ensemble: average the outputs for the eight flips and transpositions
    /// of the input (+0.04 dB PSNR-Y on the default model's held-out photos, at 8x the time).
    #[arg(long)]
    pub tta: bool,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Image files and/or folders.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// Output file (one input) or folder.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub infer: InferArgs,
    /// Final scale when it is not the model's (2 or 3.5 with a x4 model, say): the model's
    /// output is resampled (Lanczos3) to round(input × F).
    #[arg(short = 's', long, value_name = "F", value_parser = parse_factor,
          conflicts_with_all = ["width", "height"])]
    pub outscale: Option<f64>,
    /// Final width in pixels; the height keeps the aspect ratio unless --height is given.
    #[arg(long, value_name = "W", value_parser = clap::value_parser!(u32).range(1..))]
    pub width: Option<u32>,
    /// Final height in pixels; the width keeps the aspect ratio unless --width is given.
    #[arg(long, value_name = "H", value_parser = clap::value_parser!(u32).range(1..))]
    pub height: Option<u32>,
    /// Output bit depth: 8 or 16; the input's when omitted.
    #[arg(long = "bit-depth", alias = "bit_depth", value_parser = parse_bit_depth)]
    pub bit_depth: Option<u8>,
    /// Output format; the input's when omitted.
    #[arg(long, ignore_case = true,
          value_parser = EnumValueParser::<FormatChoice>::new().map(Format::from))]
    pub format: Option<Format>,
    /// JPEG quality, 1-100.
    #[arg(long, default_value_t = 95, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub quality: u8,
    /// Write no ICC colour profile and no EXIF (by default both are copied from the input
    /// where the output format can hold them, the EXIF orientation reset to upright).
    #[arg(long)]
    pub strip: bool,
    /// Descend into sub-folders.
    #[arg(short = 'r', long)]
    pub recursive: bool,
    /// Replace existing outputs (otherwise they are skipped, so a re-run resumes).
    #[arg(long)]
    pub overwrite: bool,
    /// Process only shard K of N (0 <= K < N) of the sorted input list. `auto` reads K and N
    /// from the job array that started the process (Slurm, Kubernetes Indexed Job, AWS
    /// Batch, Google Cloud Batch); `auto/N` takes the array index as K and N as given (also
    /// from UPSCALE_SHARD_COUNT), for Kubernetes or to re-run some tasks of an array alone.
    #[arg(long, value_name = "K/N|auto[/N]", value_parser = parse_shard_spec)]
    pub shard: Option<ShardSpec>,
    /// One JSON line per image and a summary line on stdout.
    #[arg(long)]
    pub json: bool,
    /// Threads that encode outputs while the model runs (one more decodes ahead of it);
    /// several encode several images at once, so a fast GPU does not wait on one encoder.
    /// 0 does everything inline on one thread.
    #[arg(long = "io_threads", alias = "io-threads", default_value_t = 2, value_parser = clap::value_parser!(u8).range(0..=16))]
    pub io_threads: u8,
    /// Only errors on stderr.
    #[arg(short = 'q', long, conflicts_with = "verbose")]
    pub quiet: bool,
    /// More detail on stderr.
    #[arg(short = 'v', long)]
    pub verbose: bool,
}

/// `--blend`: the library's [`BlendMode`] as clap choices. The choice types are the tool's
/// own so that the library needs no clap; their doc comments are what `--help` prints beside
/// each value.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum BlendChoice {
    /// Raised-cosine crossfade over the middle half of each overlap; the outer quarter at a
    /// tile's inner edge gets no weight, since the model saw little context there.
    Hann,
    /// Uniform average of all tiles covering a pixel, as the official inference script does.
    #[value(alias = "avg")]
    Average,
    /// Crop and paste: every output pixel comes from one tile, seams mid-overlap.
    None,
}

impl From<BlendChoice> for BlendMode {
    fn from(c: BlendChoice) -> Self {
        match c {
            BlendChoice::Hann => BlendMode::Hann,
            BlendChoice::Average => BlendMode::Average,
            BlendChoice::None => BlendMode::None,
        }
    }
}

/// `--attention`: the library's [`Attention`] as clap choices.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum AttentionChoice {
    /// One kernel per block: scores stay on chip, the shift mask is computed, not stored.
    Fused,
    /// candle's op graph: matmul, bias, stored mask, softmax, matmul.
    Reference,
    /// The fused kernel with both products on tensor cores (bf16/fp16 inputs, f32 sums; the
    /// probabilities are rounded to the input type); f32, and builds for GPUs before compute
    /// capability 8.0, run `fused`.
    TensorCore,
}

impl From<AttentionChoice> for Attention {
    fn from(c: AttentionChoice) -> Self {
        match c {
            AttentionChoice::Fused => Attention::Fused,
            AttentionChoice::Reference => Attention::Reference,
            AttentionChoice::TensorCore => Attention::TensorCore,
        }
    }
}

/// `--format`, spelt as the extensions we write, the long extensions accepted as aliases.
/// The values go undocumented: clap would print a doc comment beside each and drop the
/// one-line list of choices from `--help`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum FormatChoice {
    #[value(name = "png")]
    Png,
    #[value(name = "jpg", alias = "jpeg")]
    Jpeg,
    #[value(name = "webp")]
    Webp,
    #[value(name = "tiff", alias = "tif")]
    Tiff,
}

impl From<FormatChoice> for Format {
    fn from(c: FormatChoice) -> Self {
        match c {
            FormatChoice::Png => Format::Png,
            FormatChoice::Jpeg => Format::Jpeg,
            FormatChoice::Webp => Format::Webp,
            FormatChoice::Tiff => Format::Tiff,
        }
    }
}

/// The precisions as clap choices, so that `--help` lists them and a typo gets a suggestion;
/// the older spellings stay accepted as aliases.
fn precision_parser() -> impl TypedValueParser<Value = Precision> {
    PossibleValuesParser::new([
        PossibleValue::new("auto"),
        PossibleValue::new("fp32").aliases(["f32", "float32"]),
        PossibleValue::new("fp16").aliases(["f16", "half"]),
        PossibleValue::new("bf16").alias("bfloat16"),
    ])
    .try_map(|s| parse_precision(&s))
}

fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    let s = s.trim().to_ascii_lowercase();
    match s.as_str() {
        "auto" => Ok(DeviceChoice::Auto),
        "cpu" => Ok(DeviceChoice::Cpu),
        "cuda" | "gpu" => Ok(DeviceChoice::Cuda(vec![0])),
        _ => {
            let list = s.strip_prefix("cuda:").ok_or_else(|| {
                format!("unknown device '{s}' (expected auto, cpu, cuda or cuda:N[,M...])")
            })?;
            let ids = list
                .split(',')
                .map(|p| p.trim().parse::<usize>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| {
                    format!("bad CUDA device list '{list}' (expected e.g. cuda:0 or cuda:0,1)")
                })?;
            if ids.is_empty() {
                return Err(format!("bad CUDA device list '{list}'"));
            }
            Ok(DeviceChoice::Cuda(ids))
        }
    }
}

fn parse_precision(s: &str) -> Result<Precision, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "auto" => Ok(Precision::Auto),
        "fp32" | "f32" | "float32" => Ok(Precision::Fp32),
        "fp16" | "f16" | "half" => Ok(Precision::Fp16),
        "bf16" | "bfloat16" => Ok(Precision::Bf16),
        _ => Err(format!(
            "unknown precision '{s}' (expected auto, fp32, fp16 or bf16)"
        )),
    }
}

/// A `--outscale` value: a finite number above 0.
fn parse_factor(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(f) if f.is_finite() && f > 0.0 => Ok(f),
        _ => Err(format!(
            "'{s}' is not a scale factor above 0 (e.g. 2 or 3.5)"
        )),
    }
}

fn parse_bit_depth(s: &str) -> Result<u8, String> {
    match s {
        "8" => Ok(8),
        "16" => Ok(16),
        _ => Err(format!("bit depth must be 8 or 16, not '{s}'")),
    }
}

/// Messages on stderr, one line each, filtered by -q / -v.
pub struct Logger {
    pub quiet: bool,
    pub verbose: bool,
}

impl Logger {
    pub fn new(quiet: bool, verbose: bool) -> Self {
        let log = Self { quiet, verbose };
        log.install();
        log
    }

    /// Routes the library's `log` records to stderr at this logger's level: warnings unless
    /// -q, details with -v. The first call in a process wins (there is one command per
    /// process; tests that build several loggers share the first).
    fn install(&self) {
        let level = match (self.quiet, self.verbose) {
            (true, _) => log::LevelFilter::Error,
            (false, false) => log::LevelFilter::Warn,
            (false, true) => log::LevelFilter::Debug,
        };
        if log::set_logger(&Stderr).is_ok() {
            log::set_max_level(level);
        }
    }

    pub fn warn(&self, msg: impl std::fmt::Display) {
        if !self.quiet {
            eprintln!("warning: {msg}");
        }
    }

    pub fn info(&self, msg: impl std::fmt::Display) {
        if !self.quiet {
            eprintln!("{msg}");
        }
    }

    pub fn verbose(&self, msg: impl std::fmt::Display) {
        if self.verbose && !self.quiet {
            eprintln!("{msg}");
        }
    }

    pub fn error(&self, msg: impl std::fmt::Display) {
        eprintln!("error: {msg}");
    }
}

/// The `log` backend of the command-line tool: one line on stderr per record.
struct Stderr;

impl log::Log for Stderr {
    fn enabled(&self, meta: &log::Metadata) -> bool {
        meta.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        match record.level() {
            log::Level::Error => eprintln!("error: {}", record.args()),
            log::Level::Warn => eprintln!("warning: {}", record.args()),
            _ => eprintln!("{}", record.args()),
        }
    }

    fn flush(&self) {}
}

/// The library's options for the shared inference flags and the final `size`.
pub fn options(args: &InferArgs, size: OutputSize) -> anyhow::Result<upscale::Options> {
    if args.tile.is_some() && args.tile_auto {
        anyhow::bail!("--tile and --tile_auto exclude each other");
    }
    if let Some(t) = args.tile {
        if t != 0 && t <= args.tile_overlap {
            // The library refuses it too; this says it in the flags' words.
            anyhow::bail!(
                "--tile {t} must be larger than --tile_overlap {}",
                args.tile_overlap
            );
        }
    }
    Ok(upscale::Options {
        device: args.device.clone(),
        precision: args.precision,
        attention: args.attention,
        streams: args.streams as usize,
        tf32: args.tf32,
        tile: args.tile,
        overlap: args.tile_overlap,
        batch: args.tile_batch_size.map(|b| b as usize),
        blend: if args.hann_blend {
            BlendMode::Hann
        } else {
            args.blend
        },
        tta: args.tta,
        size,
    })
}

/// The model opened as the shared inference flags ask, through the library's one way in.
pub fn setup(args: &InferArgs, size: OutputSize) -> anyhow::Result<upscale::Upscaler> {
    Ok(upscale::Upscaler::open(
        args.model.as_deref(),
        &options(args, size)?,
    )?)
}

/// The `upscale` command: parses the process's arguments and runs them. Exit codes: 0 all
/// done, 1 some inputs failed, 2 usage or model error (clap uses 2 too).
pub fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            std::process::ExitCode::from(2)
        }
    }
}

/// The error and its causes on one line, as `{:#}` writes them, less each cause whose words
/// the line already holds: the library's errors quote their cause in their own message, so
/// that `to_string()` alone says everything, and also return it as their `source()`.
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let msg = cause.to_string();
        if line.is_empty() {
            line = msg;
        } else if !line.contains(&msg) {
            line.push_str(": ");
            line.push_str(&msg);
        }
    }
    line
}

fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    use std::process::ExitCode;
    match cli.command {
        Some(Command::Info { model, json }) => show_info(model.as_deref(), json)?,
        Some(Command::Convert {
            input,
            output,
            dtype,
        }) => convert::convert(&input, &output, dtype)?,
        Some(Command::Bench(b)) => run_bench(&b)?,
        Some(Command::Completions { shell }) => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "upscale",
                &mut std::io::stdout(),
            );
        }
        Some(Command::Man { dir }) => write_man(dir.as_deref())?,
        Some(Command::Report { logs, json }) => return report::run(&logs, json),
        Some(Command::Eval(e)) => {
            let log = Logger::new(false, false);
            return eval::run(e, &log);
        }
        None => {
            let log = Logger::new(cli.run.quiet, cli.run.verbose);
            return run::run(cli.run, &log);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `upscale info`: the configuration read from the weights, as text or one JSON line.
fn show_info(model: Option<&std::path::Path>, json: bool) -> anyhow::Result<()> {
    let v = upscale::ModelFile::open(model)?.describe();
    if json {
        println!("{v}");
    } else {
        print!("{}", info::render_text(&v));
    }
    Ok(())
}

/// `upscale bench`: one configuration on a synthetic image of the requested size.
fn run_bench(b: &BenchArgs) -> anyhow::Result<()> {
    Logger::new(b.json, false);
    let up = setup(&b.infer, OutputSize::Model)?;
    let r = up.bench(b.size, b.warmup, b.reps as usize, b.tile_cost)?;
    let mut json = serde_json::to_value(&r)?;
    // Model FLOP utilisation needs the device's peak rate, which only the user knows.
    json["flop_utilisation"] = serde_json::json!(b.peak_tflops.map(|p| r.achieved_tflops / p));
    if b.json {
        println!("{json}");
    } else {
        println!("{}", serde_json::to_string_pretty(&json)?);
    }
    Ok(())
}

/// `upscale man`: the man page on stdout, or one page per command into `dir`.
fn write_man(dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    match dir {
        Some(dir) => clap_mangen::generate_to(Cli::command(), dir)
            .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?,
        None => clap_mangen::Man::new(Cli::command()).render(&mut std::io::stdout())?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(args: &[&str]) -> Cli {
        Cli::try_parse_from(args).expect("valid flags")
    }

    #[test]
    fn factors_are_checked() {
        assert_eq!(parse_factor("3.5"), Ok(3.5));
        for bad in ["0", "-2", "nan", "inf", "x"] {
            assert!(parse_factor(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn device_strings() {
        assert_eq!(parse_device("auto"), Ok(DeviceChoice::Auto));
        assert_eq!(parse_device("CPU"), Ok(DeviceChoice::Cpu));
        assert_eq!(parse_device("cuda"), Ok(DeviceChoice::Cuda(vec![0])));
        assert_eq!(parse_device("cuda:1,3"), Ok(DeviceChoice::Cuda(vec![1, 3])));
        assert!(parse_device("cuda:x").unwrap_err().contains("'x'"));
        assert!(parse_device("tpu").unwrap_err().contains("tpu"));
    }

    /// The command line without flags and the library's `Options::default()` must be the
    /// same run: a library user gets what the tool does (they once differed in the attention
    /// kernel, which gave library users on a GPU the slower one).
    #[test]
    fn the_command_lines_defaults_are_the_librarys() {
        let cli = parsed(&["upscale", "in.png"]);
        assert_eq!(
            options(&cli.run.infer, OutputSize::Model).unwrap(),
            upscale::Options::default()
        );
        let Some(Command::Bench(b)) = parsed(&["upscale", "bench"]).command else {
            panic!("bench parses as bench");
        };
        assert_eq!(
            options(&b.infer, OutputSize::Model).unwrap(),
            upscale::Options::default()
        );
    }

    #[test]
    fn every_inference_flag_reaches_the_options() {
        let cli = parsed(&[
            "upscale",
            "in.png",
            "--device",
            "cpu",
            "--precision",
            "bf16",
            "--attention",
            "fused",
            "--streams",
            "3",
            "--tf32",
            "--tile",
            "96",
            "--tile_overlap",
            "8",
            "--tile_batch_size",
            "2",
            "--blend",
            "average",
            "--tta",
        ]);
        let want = upscale::Options {
            device: DeviceChoice::Cpu,
            precision: Precision::Bf16,
            attention: Attention::Fused,
            streams: 3,
            tf32: true,
            tile: Some(96),
            overlap: 8,
            batch: Some(2),
            blend: BlendMode::Average,
            tta: true,
            size: OutputSize::Factor(2.0),
        };
        assert_eq!(
            options(&cli.run.infer, OutputSize::Factor(2.0)).unwrap(),
            want
        );
        // --hann_blend wins over --blend, as its help says.
        let cli = parsed(&["upscale", "in.png", "--blend", "none", "--hann_blend"]);
        let opts = options(&cli.run.infer, OutputSize::Model).unwrap();
        assert_eq!(opts.blend, BlendMode::Hann);
    }

    /// The default attention is the fastest kernel wherever it runs: tensor cores for
    /// bf16/fp16 (1.3x `fused` on an H100), and it runs `fused` itself where it has none.
    #[test]
    fn the_default_attention_is_the_tensor_core_kernel() {
        assert_eq!(upscale::Options::default().attention, Attention::TensorCore);
    }

    #[test]
    fn an_error_line_quotes_each_cause_once() {
        // A library error that quotes its cause and returns it as its source: a folder
        // where an image file was expected.
        let dir = tempfile::tempdir().unwrap();
        let e = upscale::io::decode(dir.path()).unwrap_err();
        assert!(std::error::Error::source(&e).is_some(), "{e:?}");
        let e = anyhow::Error::new(e);
        let line = error_line(&e);
        assert_eq!(
            line,
            format!("{}: is a folder, not a file", dir.path().display())
        );
        // Context that the cause does not repeat is kept, as `{:#}` keeps it.
        let e = e.context("opening the model");
        assert_eq!(error_line(&e), format!("opening the model: {line}"));
    }
}
