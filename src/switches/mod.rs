//! The tuning switches: the `UPSCALE_*` environment variables that choose between
//! implementations of the same result, so that one binary can A/B them (on a GPU session
//! especially) and a user can step around one that fails. [`from_env`] is the only place
//! they are read, once per process, into one [`Switches`]. [`current`] (which tests override
//! per thread, to run both settings in one process) is asked only where a run is set up:
//! loading a model puts the switches into its [`crate::ops::LoadPlan`], and each layer
//! chooses its implementation from the plan when it is built; the [`crate::Upscaler`] keeps
//! the run's own (folder finishing, streamed writing); opening a CUDA device reads event
//! tracking and SASS, and a canvas download the staging choice.
//!
//! | variable | field | values |
//! |---|---|---|
//! | `UPSCALE_CUDA_OFF` | [`Switches::cuda_off`] | parts of our CUDA path to leave out ([`cuda_off`]) |
//! | `UPSCALE_PAD_CHANNELS` | [`Switches::pad_channels`] | `0`, `8`, `16`, `64`: DRCT's channels padded to that multiple (unset: 16 on a GPU in bf16 and fp16, none elsewhere) |
//! | `UPSCALE_CUDA_OCA` | [`Switches::overlap_kernel`] | `0`/`off`/`false`: HAT's cross-attention on candle's graph |
//! | `UPSCALE_CUDA_PINNED` | [`Switches::pinned_downloads`] | `1`: canvases come back through page-locked buffers |
//! | `UPSCALE_CUDA_EVENT_TRACKING` | [`Switches::event_tracking`] | `1`: keep cudarc's event tracking |
//! | `UPSCALE_CPU_GEMM` | [`Switches::gemm_crate`] | `crate`: f32 products on the `gemm` crate, not our panels |
//! | `UPSCALE_BF16_ISA` | [`Switches::bf16_vector`] | `avx512`: CPU bf16 on the vector kernel even where AMX is |
//! | `UPSCALE_CPU_ISA` | [`Switches::cpu_isa`] | `native`, `avx512`, `avx2`, `scalar`: the widest instructions our CPU kernels use |
//! | `UPSCALE_CPU_FUSED_MLP` | [`Switches::fused_mlp`] | `0`/`off`/`false`: transformer MLPs on the CPU as two products over all tokens, not a block of rows at a time |
//! | `UPSCALE_CPU_FUSED_WINDOWS` | [`Switches::fused_windows`] | `0`/`off`/`false`: Swin blocks on the CPU as a pass over all tokens per step, not the whole block a window at a time |
//! | `UPSCALE_CPU_WINOGRAD` | [`Switches::winograd`] | `auto`, `always`, `never`: f32 3x3 convolutions on the CPU by Winograd's F(4x4, 3x3) |
//! | `UPSCALE_DEFER_FINISH` | [`Switches::defer_finish`] | `auto`, `1`/`always`, `0`/`never`: folder runs finish each image off the model's thread (auto: on a GPU) |
//! | `UPSCALE_STREAM` | [`Switches::stream`] | `auto`, `always`, `never`: PNG and TIFF outputs written in bands of rows as tiles finish |

pub mod cuda_off;

use std::cell::Cell;
use std::sync::OnceLock;

use cuda_off::Off;

/// `UPSCALE_PAD_CHANNELS`.
pub const PAD_VAR: &str = "UPSCALE_PAD_CHANNELS";
/// The channel multiples [`PAD_VAR`] takes (besides 0, off).
pub const PAD_MULTIPLES: [usize; 3] = [8, 16, 64];

/// What a kernel may use, in order: a cap keeps the lesser of itself and what the CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuIsa {
    /// Code compiled for the target's baseline (SSE2 on x86-64); f32 products through the
    /// `gemm` crate.
    Scalar,
    /// AVX2 and FMA: 16 registers of 8 lanes.
    Avx2,
    /// AVX-512F: 32 registers of 16 lanes.
    Avx512,
}

impl CpuIsa {
    /// The name `UPSCALE_CPU_ISA` takes for it (and `upscale bench` reports).
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }

    /// `UPSCALE_CPU_ISA`'s values; `None` for `native` (no cap).
    fn parse(value: &str) -> Result<Option<Self>, EnvError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "native" => Ok(None),
            "avx512" => Ok(Some(Self::Avx512)),
            "avx2" => Ok(Some(Self::Avx2)),
            "scalar" => Ok(Some(Self::Scalar)),
            _ => Err(EnvError::UnknownPart {
                var: "UPSCALE_CPU_ISA",
                part: value.trim().to_string(),
                expected: "native, avx512, avx2 or scalar",
            }),
        }
    }
}

/// Every switch, as the environment set it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switches {
    /// Parts of our CUDA path left out, each falling back to candle's ops.
    pub cuda_off: Off,
    /// The multiple DRCT's channel widths are padded to; 0 for none, `None` for the model's
    /// choice by device and precision ([`crate::ops::pad::Pad::choose`]).
    pub pad_channels: Option<usize>,
    /// HAT's overlapping cross-attention may take our CUDA kernel (on unless turned off).
    pub overlap_kernel: bool,
    /// Canvases come back from a GPU through page-locked staging buffers.
    pub pinned_downloads: bool,
    /// cudarc's per-buffer event tracking stays on.
    pub event_tracking: bool,
    /// f32 products on the CPU run on the `gemm` crate instead of our panel kernels.
    pub gemm_crate: bool,
    /// bf16 products on the CPU take the AVX512-BF16 kernel even where AMX is.
    pub bf16_vector: bool,
    /// The widest instructions our CPU kernels may use (`None`: what the CPU has).
    pub cpu_isa: Option<CpuIsa>,
    /// Transformer MLPs on the CPU in f32 take both layers a block of rows at a time (on
    /// unless turned off; see [`crate::ops::linear::cpu::mlp_packed`]).
    pub fused_mlp: bool,
    /// Swin blocks on the CPU in f32 run whole, a window at a time (on unless turned off;
    /// see [`crate::ops::block`]).
    pub fused_windows: bool,
    /// Whether f32 3x3 convolutions on the CPU run by Winograd's F(4x4, 3x3) (`None`: where
    /// both sides have enough channels for it to pay; see [`crate::ops::conv`]).
    pub winograd: Option<bool>,
    /// Whether folder runs finish each image off the model's thread (`None`: on a GPU; see
    /// [`crate::Upscaler::defers_finish`]).
    pub defer_finish: Option<bool>,
    /// Whether PNG and TIFF outputs are written in bands as tiles finish (`None`: when the
    /// whole image would take much memory; see [`crate::fit`]).
    pub stream: Option<bool>,
}

impl Default for Switches {
    /// What a run without any of the variables gets.
    fn default() -> Self {
        Self {
            cuda_off: Off::default(),
            pad_channels: None,
            overlap_kernel: true,
            pinned_downloads: false,
            event_tracking: false,
            gemm_crate: false,
            bf16_vector: false,
            cpu_isa: None,
            fused_mlp: true,
            fused_windows: true,
            winograd: None,
            defer_finish: None,
            stream: None,
        }
    }
}

impl Switches {
    /// The switches `var` gives (`var(name)` is the variable's value, `None` when unset).
    pub fn parse(
        var: impl Fn(&'static str) -> Option<Result<String, EnvError>>,
    ) -> Result<Self, EnvError> {
        let mut s = Self::default();
        let on = |v: &str| v.trim() == "1";
        if let Some(v) = var(cuda_off::VAR) {
            s.cuda_off = Off::parse(&v?)?;
        }
        if let Some(v) = var(PAD_VAR) {
            s.pad_channels = Some(parse_pad(&v?)?);
        }
        if let Some(v) = var("UPSCALE_CUDA_OCA") {
            let v = v?.trim().to_ascii_lowercase();
            s.overlap_kernel = !matches!(v.as_str(), "0" | "off" | "false");
        }
        if let Some(v) = var("UPSCALE_CUDA_PINNED") {
            s.pinned_downloads = on(&v?);
        }
        if let Some(v) = var("UPSCALE_CUDA_EVENT_TRACKING") {
            s.event_tracking = on(&v?);
        }
        if let Some(v) = var("UPSCALE_CPU_GEMM") {
            s.gemm_crate = v?.trim() == "crate";
        }
        if let Some(v) = var("UPSCALE_BF16_ISA") {
            s.bf16_vector = v?.trim() == "avx512";
        }
        if let Some(v) = var("UPSCALE_CPU_ISA") {
            s.cpu_isa = CpuIsa::parse(&v?)?;
        }
        if let Some(v) = var("UPSCALE_CPU_FUSED_MLP") {
            let v = v?.trim().to_ascii_lowercase();
            s.fused_mlp = !matches!(v.as_str(), "0" | "off" | "false");
        }
        if let Some(v) = var("UPSCALE_CPU_FUSED_WINDOWS") {
            let v = v?.trim().to_ascii_lowercase();
            s.fused_windows = !matches!(v.as_str(), "0" | "off" | "false");
        }
        if let Some(v) = var("UPSCALE_CPU_WINOGRAD") {
            s.winograd = auto_always_never("UPSCALE_CPU_WINOGRAD", &v?)?;
        }
        if let Some(v) = var("UPSCALE_DEFER_FINISH") {
            s.defer_finish = auto_always_never("UPSCALE_DEFER_FINISH", &v?)?;
        }
        if let Some(v) = var("UPSCALE_STREAM") {
            s.stream = auto_always_never("UPSCALE_STREAM", &v?)?;
        }
        Ok(s)
    }
}

/// A switch's `auto` (`None`), `always` or `never`.
fn auto_always_never(var: &'static str, value: &str) -> Result<Option<bool>, EnvError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(None),
        "always" | "1" => Ok(Some(true)),
        "never" | "0" => Ok(Some(false)),
        other => Err(EnvError::UnknownPart {
            var,
            part: other.to_string(),
            expected: "auto, always or never",
        }),
    }
}

/// `UPSCALE_PAD_CHANNELS`'s value as a multiple, 0 for off.
fn parse_pad(spec: &str) -> Result<usize, EnvError> {
    match spec.trim() {
        "" | "0" => Ok(0),
        s => match s.parse::<usize>() {
            Ok(m) if PAD_MULTIPLES.contains(&m) => Ok(m),
            Ok(m) => Err(EnvError::NotAMultiple {
                var: PAD_VAR,
                value: m,
            }),
            Err(_) => Err(EnvError::NotANumber {
                var: PAD_VAR,
                value: s.to_string(),
            }),
        },
    }
}

/// The process's switches, read from the environment once: the only place the crate reads
/// an `UPSCALE_*` variable. An error names the variable and what it does not take.
pub fn from_env() -> Result<Switches, EnvError> {
    static READ: OnceLock<Result<Switches, EnvError>> = OnceLock::new();
    READ.get_or_init(|| {
        Switches::parse(|name| match std::env::var(name) {
            Ok(v) => Some(Ok(v)),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => Some(Err(EnvError::NotUnicode { var: name })),
        })
    })
    .clone()
}

thread_local! {
    static OVERRIDE: Cell<Option<Switches>> = const { Cell::new(None) };
}

/// The switches the code on this thread runs with: a test's override, else the
/// environment's (the defaults where a value was refused: loading a model or opening a GPU
/// checks [`checked`] first, so a run with a refused value stops before any of this).
pub fn current() -> Switches {
    OVERRIDE
        .with(Cell::get)
        .unwrap_or_else(|| from_env().unwrap_or_default())
}

/// [`current`], or the environment's error.
pub fn checked() -> Result<Switches, EnvError> {
    match OVERRIDE.with(Cell::get) {
        Some(s) => Ok(s),
        None => from_env(),
    }
}

/// Runs `f` on this thread with the switches `change` makes of the current ones, then puts
/// back what was there, even if `f` panics. Setting a variable instead would race the other
/// tests of the process.
#[cfg(test)]
pub fn with<R>(change: impl FnOnce(&mut Switches), f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Switches>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let mut s = current();
    change(&mut s);
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(s))));
    f()
}

/// A value one of the variables does not take; the message names the variable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// The value is not UTF-8.
    #[error("{var} is not valid UTF-8")]
    NotUnicode {
        /// The variable.
        var: &'static str,
    },
    /// A part of the list that the variable does not know.
    #[error("{var}: unknown part '{part}' (expected {expected})")]
    UnknownPart {
        /// The variable.
        var: &'static str,
        /// The part, as written.
        part: String,
        /// The parts it knows.
        expected: &'static str,
    },
    /// A number that is not one of the channel multiples.
    #[error("{var}: {value} is not a channel multiple (expected 0, 8, 16 or 64)")]
    NotAMultiple {
        /// The variable.
        var: &'static str,
        /// The number.
        value: usize,
    },
    /// A value that is no number at all.
    #[error("{var}: '{value}' is not a channel multiple (expected 0, 8, 16 or 64)")]
    NotANumber {
        /// The variable.
        var: &'static str,
        /// The value, trimmed.
        value: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Result<Switches, EnvError> {
        Switches::parse(|name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| Ok(v.to_string()))
        })
    }

    #[test]
    fn every_variable_reaches_its_field() {
        assert_eq!(vars(&[]), Ok(Switches::default()));
        let all = vars(&[
            ("UPSCALE_CUDA_OFF", "rowwise"),
            ("UPSCALE_PAD_CHANNELS", "16"),
            ("UPSCALE_CUDA_OCA", "Off"),
            ("UPSCALE_CUDA_PINNED", "1"),
            ("UPSCALE_CUDA_EVENT_TRACKING", "1"),
            ("UPSCALE_CPU_GEMM", "crate"),
            ("UPSCALE_BF16_ISA", "avx512"),
            ("UPSCALE_CPU_ISA", "AVX2"),
            ("UPSCALE_CPU_WINOGRAD", "never"),
            ("UPSCALE_CPU_FUSED_MLP", "off"),
            ("UPSCALE_CPU_FUSED_WINDOWS", "0"),
            ("UPSCALE_STREAM", "Always"),
            ("UPSCALE_DEFER_FINISH", "0"),
        ])
        .unwrap();
        let d = Switches::default();
        assert!(all.cuda_off.rowwise && !d.cuda_off.rowwise);
        assert_eq!((all.pad_channels, d.pad_channels), (Some(16), None));
        assert!(!all.overlap_kernel && d.overlap_kernel);
        assert!(!all.fused_mlp && d.fused_mlp);
        assert!(!all.fused_windows && d.fused_windows);
        for (on, off) in [
            (all.pinned_downloads, d.pinned_downloads),
            (all.event_tracking, d.event_tracking),
            (all.gemm_crate, d.gemm_crate),
            (all.bf16_vector, d.bf16_vector),
        ] {
            assert!(on && !off, "{all:?}");
        }
        assert_eq!((all.cpu_isa, d.cpu_isa), (Some(CpuIsa::Avx2), None));
        assert_eq!((all.stream, d.stream), (Some(true), None));
        assert_eq!((all.defer_finish, d.defer_finish), (Some(false), None));
        assert_eq!((all.winograd, d.winograd), (Some(false), None));
        for (v, stream) in [("never", Some(false)), (" auto", None), ("0", Some(false))] {
            assert_eq!(vars(&[("UPSCALE_STREAM", v)]).unwrap().stream, stream);
        }
        assert!(vars(&[("UPSCALE_STREAM", "sometimes")]).is_err());
        assert!(vars(&[("UPSCALE_CUDA_PINNED", "0")]).unwrap() == d);
        for (v, isa) in [("native", None), (" avx512 ", Some(CpuIsa::Avx512))] {
            assert_eq!(vars(&[("UPSCALE_CPU_ISA", v)]).unwrap().cpu_isa, isa);
        }
        assert_eq!(
            vars(&[("UPSCALE_CPU_ISA", "scalar")]).unwrap().cpu_isa,
            Some(CpuIsa::Scalar)
        );
    }

    #[test]
    fn a_refused_value_names_its_variable() {
        let e = vars(&[("UPSCALE_PAD_CHANNELS", "12")]).unwrap_err();
        assert!(e.to_string().contains("UPSCALE_PAD_CHANNELS: 12"), "{e}");
        let e = vars(&[("UPSCALE_PAD_CHANNELS", "wide")]).unwrap_err();
        assert!(e.to_string().contains("'wide'"), "{e}");
        let e = vars(&[("UPSCALE_CPU_ISA", "sse4")]).unwrap_err();
        assert!(
            e.to_string()
                .contains("UPSCALE_CPU_ISA: unknown part 'sse4'"),
            "{e}"
        );
        let e = vars(&[("UPSCALE_CUDA_OFF", "attention")]).unwrap_err();
        assert!(e.to_string().contains("UPSCALE_CUDA_OFF"), "{e}");
    }

    #[test]
    fn an_override_holds_inside_and_is_undone_after() {
        let before = current();
        let inside = with(
            |s| s.pad_channels = Some(8),
            || {
                (
                    current().pad_channels,
                    with(|s| s.pinned_downloads = true, current),
                )
            },
        );
        assert_eq!(inside.0, Some(8));
        assert!(inside.1.pinned_downloads && inside.1.pad_channels == Some(8));
        assert_eq!(current(), before);
    }
}
