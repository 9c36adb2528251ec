//! Device and precision choice, model loading and running images through the network.
//!
//! This is the only module that decides where and in what dtype the model runs; everything
//! above it hands in host images and gets host images back.

pub mod image;
pub mod lanes;
pub mod probe;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};

use crate::ops::attention::Attention;

use crate::checkpoint::{Bytes, Checkpoint, ModelError, Source};

use crate::model::Model;
use crate::planar::Planar;
use crate::switches::cuda_off;

/// How far the probe's measured cost per pixel may exceed the analytic one before
/// [`Engine::bytes_per_pixel_bound`] stops being a bound (measured on the test models:
/// 0.4 to 0.95 of it).
const PROBE_BOUND_FACTOR: f64 = 2.0;

/// Where the model runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The first GPU if this build has CUDA and one answers, else the CPU.
    Auto,
    /// The CPU.
    Cpu,
    /// One or more CUDA ordinals.
    Cuda(Vec<usize>),
}

/// The arithmetic the model runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// bf16 on a GPU from compute capability 8.0 (fp16 before it), fp32 on the CPU.
    Auto,
    /// fp32 everywhere.
    Fp32,
    /// fp16 on a GPU; on the CPU, fp32 with a warning.
    Fp16,
    /// bf16 on a GPU (fp16 before compute capability 8.0); on the CPU, bf16 products with f32
    /// activations where the CPU has AMX or AVX512-BF16, else fp32 with a warning.
    Bf16,
}

/// The message of a candle error without the backtrace candle appends when `RUST_BACKTRACE`
/// is set: a device that cannot be opened is one line for the user, not a stack dump.
pub(crate) fn first_line(e: &candle_core::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Why a device could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// A GPU was asked for and this binary has no CUDA.
    #[error(
        "--device cuda: this binary was built without CUDA support (build with --features cuda)"
    )]
    NoCuda,
    /// The driver could not open the GPU.
    #[error("cuda:{id}: {}", first_line(source))]
    Open {
        /// The CUDA ordinal.
        id: usize,
        /// What the driver (through candle) said.
        #[source]
        source: candle_core::Error,
    },
    /// The GPU is older than the generation this build's kernels were compiled for (each
    /// capability as 10 x major + minor).
    #[error(
        "cuda:{id}: this GPU has compute capability {}.{}, and this binary's CUDA kernels were \
         built for {}.{} and newer: rebuild it with CUDA_COMPUTE_CAP={gpu} (README, CUDA)",
        gpu / 10, gpu % 10, built / 10, built % 10
    )]
    TooOld {
        /// The CUDA ordinal.
        id: usize,
        /// The GPU's compute capability.
        gpu: u32,
        /// The capability the kernels were built for.
        built: u32,
    },
    /// A run was asked for with no lanes.
    #[error("at least one lane is needed")]
    NoLanes,
}

/// Why a model could not be placed on its device(s).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The device could not be opened, or this build lacks it.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The weights could not be read or built into a network on the device.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// `UPSCALE_CUDA_OFF` holds a value it does not take.
    #[error(transparent)]
    Env(#[from] crate::nets::EnvError),
}

impl From<EngineError> for crate::Error {
    fn from(e: EngineError) -> Self {
        let kind = match &e {
            EngineError::Model(m) => m.kind(),
            EngineError::Env(_) => crate::ErrorKind::InvalidOption,
            EngineError::Device(_) => crate::ErrorKind::Device,
        };
        crate::Error::new(kind, e)
    }
}

/// Open the requested device (the first one of a list: [`lanes::Lanes`] opens the rest).
/// `auto` takes the first GPU when this build has CUDA and one answers, else the CPU.
/// A GPU gets a stream of its own, as every lane does, rather than candle's default, the
/// per-thread default stream: on that one, weights uploaded by the thread that loads the
/// model and kernels launched by another thread that uses it would run unordered.
pub fn open_device(
    choice: &DeviceChoice,
    warn: &mut dyn FnMut(String),
) -> Result<Device, EngineError> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => {
            if candle_core::utils::cuda_is_available() {
                match Device::new_cuda_with_stream(0) {
                    Ok(d) => match gpu_runs_this_build(&d, 0) {
                        Ok(()) => return cuda_opened(d, warn),
                        Err(e) => warn(format!("{e}; running on the CPU")),
                    },
                    Err(e) => warn(format!(
                        "no usable CUDA device ({}); running on the CPU",
                        first_line(&e)
                    )),
                }
            }
            Ok(Device::Cpu)
        }
        DeviceChoice::Cuda(ids) => {
            if !candle_core::utils::cuda_is_available() {
                return Err(DeviceError::NoCuda.into());
            }
            let id = ids[0];
            let d = Device::new_cuda_with_stream(id)
                .map_err(|source| DeviceError::Open { id, source })?;
            gpu_runs_this_build(&d, id)?;
            cuda_opened(d, warn)
        }
    }
}

/// A CUDA device just opened, made ready: cudarc's event tracking off, and `UPSCALE_CUDA_OFF`
/// checked (a misspelt part stops the run here) and, when it leaves anything out, said.
fn cuda_opened(d: Device, warn: &mut dyn FnMut(String)) -> Result<Device, EngineError> {
    lanes::skip_event_tracking(&d);
    let off = crate::switches::checked()?.cuda_off;
    if off != cuda_off::Off::default() {
        warn(format!(
            "{}={}: {}",
            cuda_off::VAR,
            off.names(),
            off.effect()
        ));
    }
    Ok(d)
}

/// A CUDA device's compute capability as 10 x major + minor (75 for a T4, 90 for an H100);
/// `None` for the CPU or when the driver does not say.
pub fn compute_capability(device: &Device) -> Option<u32> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let (major, minor) = d.cuda_stream().context().compute_capability().ok()?;
        return u32::try_from(10 * major + minor).ok();
    }
    let _ = device;
    None
}

/// Whether the GPU can load this build's kernels (ours and candle's, compiled to PTX for
/// `CUDA_COMPUTE_CAP`): the driver compiles PTX for that GPU generation or a later one only,
/// and otherwise every kernel launch would fail with a message that does not say why.
pub fn gpu_runs_this_build(device: &Device, id: usize) -> Result<(), DeviceError> {
    runs_on(id, built_for(), compute_capability(device))
}

/// [`gpu_runs_this_build`] for a build for compute capability `built` and GPU `id` of `gpu`;
/// either unknown passes.
fn runs_on(id: usize, built: Option<u32>, gpu: Option<u32>) -> Result<(), DeviceError> {
    match (built, gpu) {
        (Some(built), Some(gpu)) if gpu < built => Err(DeviceError::TooOld { id, gpu, built }),
        _ => Ok(()),
    }
}

/// The compute capability this build's kernels were compiled for (`CUDA_COMPUTE_CAP`).
fn built_for() -> Option<u32> {
    #[cfg(feature = "cuda")]
    return Some(crate::gpu::kernels::COMPUTE_CAP / 10);
    #[cfg(not(feature = "cuda"))]
    None
}

/// The dtype the model runs in. On the CPU, bf16 means f32 activations with bf16 weights and
/// products (AMX, or AVX512-BF16 on AMD cores, where it beats f32), and falls back to fp32
/// with a warning on CPUs without them;
/// fp16 always does: no x86 CPU multiplies fp16 with f32 sums, and converting to f32 first
/// would only be fp32 with rounded weights.
pub fn choose_dtype(p: Precision, device: &Device, warn: &mut dyn FnMut(String)) -> DType {
    match (p, device.is_cpu()) {
        (Precision::Fp32, _) | (Precision::Auto, true) => DType::F32,
        (Precision::Bf16, true) if crate::ops::cpu::bf16::supported() => DType::BF16,
        (Precision::Bf16, true) => {
            warn(
                "--precision bf16: this CPU has no fast bf16 arithmetic (AMX, or AVX512-BF16 \
                 on an AMD core); using fp32"
                    .into(),
            );
            DType::F32
        }
        (Precision::Fp16, true) => {
            warn("--precision fp16 is not available on the CPU; using fp32".into());
            DType::F32
        }
        (Precision::Auto | Precision::Bf16, false) => {
            // A build for an older GPU has no bf16 kernels (candle's need sm_80), whatever GPU
            // it runs on.
            let cc = compute_capability(device).map(|cc| built_for().map_or(cc, |b| cc.min(b)));
            gpu_half(p, cc, warn)
        }
        (Precision::Fp16, false) => DType::F16,
    }
}

/// bf16 on GPUs that compute in it (compute capability 8.0, Ampere, and later) with a build
/// for them; fp16 on older ones (a T4, a V100), whose tensor cores take fp16 and where candle
/// has no bf16 kernels. An unknown capability is taken as a current GPU.
fn gpu_half(p: Precision, capability: Option<u32>, warn: &mut dyn FnMut(String)) -> DType {
    match capability {
        Some(cc) if cc < 80 => {
            if p == Precision::Bf16 {
                warn(format!(
                    "--precision bf16: no bf16 arithmetic at compute capability {}.{} (the \
                     GPU's, or the build's CUDA_COMPUTE_CAP if lower); using fp16",
                    cc / 10,
                    cc % 10
                ));
            }
            DType::F16
        }
        _ => DType::BF16,
    }
}

/// The weights compiled into the binary, when built with the `embedded-model` feature.
pub fn embedded_model() -> Option<(&'static str, &'static [u8])> {
    #[cfg(feature = "embedded-model")]
    {
        Some((
            "upscale-default-x4",
            include_bytes!("../../models/default_x4.safetensors"),
        ))
    }
    #[cfg(not(feature = "embedded-model"))]
    {
        None
    }
}

/// Read a checkpoint from `path`, or the embedded model when no path is given.
pub fn read_checkpoint(path: Option<&Path>) -> Result<Checkpoint, ModelError> {
    match path {
        Some(p) => Checkpoint::load(p),
        None => match embedded_model() {
            Some((name, bytes)) => {
                Checkpoint::from_safetensors(Bytes::Static(bytes), Source::Embedded(name))
            }
            None => Err(ModelError::File {
                origin: "(no model)".into(),
                msg: "this build has no embedded model: pass one with -m MODEL",
            }),
        },
    }
}

pub struct Engine {
    pub model: Model,
    pub device: Device,
    /// The precision asked for: on the CPU, bf16 keeps f32 activations, so the network's own
    /// dtype says F32 (`upscale bench` reports both).
    pub dtype: DType,
    attention: Attention,
    cost: OnceLock<f64>,
    /// fp16 only: the f32 weights, kept to redo a tile whose fp16 output overflowed.
    fp32_weights: Option<Checkpoint>,
    /// Built on the first overflow; a failure is kept (shared) and returned to every later one.
    fp32_model: OnceLock<Result<Model, std::sync::Arc<ModelError>>>,
    fp16_overflows: AtomicUsize,
}

impl Engine {
    #[cfg(test)]
    pub fn new(ck: Checkpoint, device: Device, dtype: DType) -> Result<Self, ModelError> {
        Self::with_attention(ck, device, dtype, Attention::default())
    }

    /// [`Engine::new`] with a choice of window-attention implementation (CUDA only).
    pub fn with_attention(
        ck: Checkpoint,
        device: Device,
        dtype: DType,
        attention: Attention,
    ) -> Result<Self, ModelError> {
        // The SwinIR family is known to overflow in fp16 on some inputs; keep the weights
        // (in memory of their own, not in the mapped file) so such a tile can be redone in
        // fp32.
        let fp32_weights = (dtype == DType::F16).then(|| ck.detached());
        let model = Model::from_checkpoint_with(ck, dtype, &device, attention)?;
        Ok(Self {
            model,
            device,
            dtype,
            attention,
            cost: OnceLock::new(),
            fp32_weights,
            fp32_model: OnceLock::new(),
            fp16_overflows: AtomicUsize::new(0),
        })
    }

    #[cfg(test)]
    /// Tiles whose fp16 output was non-finite and were redone in fp32.
    pub fn fp16_overflows(&self) -> usize {
        self.fp16_overflows.load(Ordering::Relaxed)
    }

    /// One forward pass; in fp16, a tile whose output is not finite is redone in fp32 (with
    /// one warning per run), so an overflow costs that tile's time, never a black tile. The
    /// result is in the engine's dtype, or f32 when a tile was redone.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self
            .model
            .net
            .forward(&x.to_dtype(self.model.net.dtype())?)?;
        let Some(weights) = &self.fp32_weights else {
            return Ok(y);
        };
        // A tile's sum of squares is non-finite exactly when one of its values is (or is
        // absurdly large), and costs one scalar per tile to read back.
        let energy = y
            .to_dtype(DType::F32)?
            .sqr()?
            .flatten_from(1)?
            .sum(1)?
            .to_vec1::<f32>()?;
        let bad: Vec<u32> = (0..energy.len() as u32)
            .filter(|&i| !energy[i as usize].is_finite())
            .collect();
        if bad.is_empty() {
            return Ok(y);
        }
        if self.fp16_overflows.fetch_add(bad.len(), Ordering::Relaxed) == 0 {
            log::warn!("fp16 output was not finite on a tile; redoing such tiles in fp32");
        }
        let model = self
            .fp32_model
            .get_or_init(|| {
                Model::from_checkpoint_with(
                    weights.clone(),
                    DType::F32,
                    &self.device,
                    self.attention,
                )
                .map_err(std::sync::Arc::new)
            })
            .as_ref()
            .map_err(|e| candle_core::Error::wrap(e.clone()))?;
        let idx = Tensor::new(bad.as_slice(), x.device())?;
        let redone = model
            .net
            .forward(&x.index_select(&idx, 0)?.to_dtype(DType::F32)?)?;
        let mut tiles = (0..energy.len())
            .map(|i| y.get(i)?.to_dtype(DType::F32))
            .collect::<candle_core::Result<Vec<_>>>()?;
        for (j, &i) in bad.iter().enumerate() {
            tiles[i as usize] = redone.get(j)?;
        }
        Tensor::stack(&tiles, 0)
    }

    /// The most padded input pixels one forward pass may hold. candle's CUDA kernels index
    /// with 32-bit integers, so on a GPU no intermediate may reach 2³¹ values; the CPU
    /// backend has no such limit.
    pub fn max_pass_pixels(&self) -> usize {
        if self.device.is_cpu() {
            crate::tile::auto::UNLIMITED
        } else {
            let values = self
                .model
                .config()
                .largest_tensor_per_pixel(self.scores_in_memory(), self.model.net.padding());
            crate::tile::auto::max_pass_pixels_i32(values)
        }
    }

    /// Whether a forward pass materialises the attention scores: everywhere but on a GPU
    /// with the fused kernel, which takes heads up to its maximum width.
    fn scores_in_memory(&self) -> bool {
        let widest_head = self.model.config().widest_head_dim();
        let fused = !self.device.is_cpu()
            && self.attention.is_fused()
            && widest_head <= crate::ops::attention::MAX_HEAD_DIM;
        !fused
    }

    /// Memory free for activations on the engine's device.
    pub fn free_memory(&self) -> u64 {
        // Without a reading, assume a modest 4 GiB rather than everything.
        const UNKNOWN: u64 = 4 << 30;
        if self.device.is_cpu() {
            crate::tile::auto::available_ram().unwrap_or(UNKNOWN)
        } else {
            cuda_free_memory(&self.device).unwrap_or(UNKNOWN)
        }
    }

    /// Peak activation bytes per input pixel of one forward pass, measured once on a probe
    /// input (activations grow linearly with pixels: attention is windowed). The measured value
    /// never goes below an analytic floor, so allocator reuse cannot make it look free.
    pub fn bytes_per_pixel(&self) -> f64 {
        *self.cost.get_or_init(|| {
            let floor = self.analytic_bytes_per_pixel();
            self.measure_bytes_per_pixel()
                .map_or(floor, |m| m.max(floor))
        })
    }

    #[cfg(test)]
    pub fn cost_was_measured(&self) -> bool {
        self.cost.get().is_some()
    }

    /// An upper bound on [`Engine::bytes_per_pixel`] known without running the model: the
    /// probe's measurement stays within twice the analytic cost on every model in the tests
    /// (which check it), so an image that fits at this cost needs no probe to run whole.
    pub fn bytes_per_pixel_bound(&self) -> f64 {
        PROBE_BOUND_FACTOR * self.analytic_bytes_per_pixel()
    }

    /// The activations at the peak of a forward pass per input pixel, from the network's
    /// shapes alone ([`crate::nets::NetConfig::activations_per_pixel`]), at the engine's dtype.
    fn analytic_bytes_per_pixel(&self) -> f64 {
        let values = self
            .model
            .config()
            .activations_per_pixel(self.scores_in_memory(), self.model.net.padding());
        values * self.model.net.dtype().size_in_bytes() as f64
    }

    pub(crate) fn measure_bytes_per_pixel(&self) -> Option<f64> {
        if !self.device.is_cpu() {
            return None;
        }
        let ws = self.model.config().window();
        let side = 4 * ws;
        // Two forwards at the smallest size first: what forwards allocate whatever their
        // size (the kernels' scratch, the convolutions' kernels in the Winograd domain, kept
        // from the second call on) is then in the baseline, not counted per pixel.
        for _ in 0..2 {
            self.upscale_whole(&probe::pattern(ws, ws)).ok()?;
        }
        // Reset the kernel's peak-RSS mark so the probe's own peak is what we read.
        probe::reset_peak_rss()?;
        let before = probe::peak_rss_bytes()?;
        let probe = probe::pattern(side, side);
        self.upscale_whole(&probe).ok()?;
        let after = probe::peak_rss_bytes()?;
        Some(after.saturating_sub(before) as f64 / (side * side) as f64)
    }

    pub fn scale(&self) -> usize {
        self.model.config().scale()
    }

    /// Run the whole image through the network at once.
    pub fn upscale_whole(&self, img: &Planar) -> candle_core::Result<Planar> {
        let x = Tensor::from_slice(
            &img.data,
            (1, img.channels, img.height, img.width),
            &self.device,
        )?;
        let y = self.forward(&x)?.to_dtype(DType::F32)?;
        let (_, c, h, w) = y.dims4()?;
        let data = y.flatten_all()?.to_vec1::<f32>()?;
        Ok(Planar::new(c, h, w, data))
    }
}

#[cfg(feature = "cuda")]
fn cuda_free_memory(device: &Device) -> Option<u64> {
    let Device::Cuda(dev) = device else {
        return None;
    };
    dev.cuda_stream().context().bind_to_thread().ok()?;
    let (free, _total) = cudarc::driver::result::mem_get_info().ok()?;
    // The memory pool keeps what earlier batches freed; it is free for the next ones.
    Some(free as u64 + lanes::pool_idle_bytes(device))
}

#[cfg(not(feature = "cuda"))]
fn cuda_free_memory(_device: &Device) -> Option<u64> {
    None
}

impl crate::tile::auto::MemoryModel for Engine {
    fn scale(&self) -> usize {
        self.scale()
    }

    fn window(&self) -> usize {
        self.model.config().window()
    }

    fn on_cpu(&self) -> bool {
        self.device.is_cpu()
    }

    fn max_pass_pixels(&self) -> usize {
        self.max_pass_pixels()
    }

    fn free_memory(&self) -> u64 {
        self.free_memory()
    }

    fn bytes_per_pixel_bound(&self) -> f64 {
        self.bytes_per_pixel_bound()
    }

    fn bytes_per_pixel(&self) -> f64 {
        self.bytes_per_pixel()
    }

    fn whole_input_matters(&self) -> bool {
        self.model.config().whole_input_matters()
    }
}

impl Engine {
    #[cfg(test)]
    /// Concrete tile options for an `h x w` image on this engine alone.
    pub fn tile_options(
        &self,
        settings: &crate::tile::auto::TileSettings,
        h: usize,
        w: usize,
    ) -> crate::tile::TileOptions {
        crate::tile::auto::tile_options(self, settings, h, w, 1)
    }
}

impl crate::tile::TileModel for Engine {
    fn scale(&self) -> usize {
        self.scale()
    }

    fn forward_batch(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward(x)
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_half_precision_is_bf16_where_the_cpu_has_it_else_fp32_with_a_warning() {
        let mut warnings = Vec::new();
        let d = choose_dtype(Precision::Bf16, &Device::Cpu, &mut |w| warnings.push(w));
        if crate::ops::cpu::bf16::supported() {
            assert_eq!(d, DType::BF16);
            assert!(warnings.is_empty());
        } else {
            assert_eq!(d, DType::F32);
            assert_eq!(warnings.len(), 1);
            assert!(warnings[0].contains("bf16"));
        }
        warnings.clear();
        let d = choose_dtype(Precision::Fp16, &Device::Cpu, &mut |w| warnings.push(w));
        assert_eq!(d, DType::F32);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("fp16"));
        let d = choose_dtype(Precision::Auto, &Device::Cpu, &mut |w| warnings.push(w));
        assert_eq!(d, DType::F32);
        assert_eq!(warnings.len(), 1);
    }

    #[test]
    fn gpu_half_precision_is_bf16_from_ampere_on_and_fp16_before() {
        let mut warnings = Vec::new();
        let mut half = |p, cc| gpu_half(p, cc, &mut |w| warnings.push(w));
        assert_eq!(half(Precision::Auto, Some(90)), DType::BF16);
        assert_eq!(half(Precision::Bf16, Some(80)), DType::BF16);
        assert_eq!(half(Precision::Auto, None), DType::BF16);
        assert_eq!(half(Precision::Auto, Some(75)), DType::F16);
        assert_eq!(half(Precision::Bf16, Some(70)), DType::F16);
        // Only the explicit request is warned about.
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("7.0") && warnings[0].contains("fp16"));
    }

    #[test]
    fn a_build_runs_on_its_gpu_generation_and_later_only() {
        assert!(runs_on(0, Some(90), Some(90)).is_ok());
        assert!(runs_on(0, Some(75), Some(120)).is_ok());
        assert!(runs_on(0, None, Some(75)).is_ok());
        let e = runs_on(1, Some(90), Some(75)).unwrap_err().to_string();
        assert!(e.starts_with("cuda:1: "), "{e}");
        assert!(e.contains("7.5") && e.contains("9.0"), "{e}");
        assert!(e.contains("CUDA_COMPUTE_CAP=75"), "{e}");
    }
}
