//! Lanes: the engines an image is spread over. On CUDA a lane is a device handle with its
//! own stream and its own copy of the weights (candle will not mix tensors of two device
//! handles, even on one GPU), fed from a shared queue of tile batches by
//! [`crate::tile::run_lanes`]. `--streams N` opens N lanes on every listed GPU, so
//! `--device cuda:0,1 --streams 2` runs four lanes, two per GPU.
//!
//! One lane on the CPU keeps the host tiler (it is measured and fast, and rayon already
//! uses every core there). CUDA runs keep tiles and blending on the device, one upload and
//! one download per image and lane, unless the output canvases would crowd the model out of
//! device memory: then one lane blends on the host, as the CPU does.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Device};

use super::{DeviceChoice, DeviceError, Engine, EngineError};
use crate::checkpoint::Checkpoint;
use crate::ops::attention::Attention;
use crate::planar::Planar;
use crate::tile::auto::TileSettings;
use crate::tile::lanes::{device_label, run_lanes_unfinished, Unfinished};
use crate::tile::{Canvas, LaneStats, TileError, TileOptions, TileStats};

pub struct Lanes {
    /// Never empty; the first answers every question about the model (scale, config, cost).
    engines: Vec<Engine>,
    warned_canvas: AtomicBool,
}

impl Lanes {
    /// The first lane's engine, which answers every question about the model (scale,
    /// configuration, memory cost): every lane holds the same model.
    pub fn primary(&self) -> &Engine {
        &self.engines[0]
    }

    pub fn single(engine: Engine) -> Self {
        Self {
            engines: vec![engine],
            warned_canvas: AtomicBool::new(false),
        }
    }

    /// Lanes over engines the caller built, each on its own device handle.
    pub fn from_engines(engines: Vec<Engine>) -> Result<Self, EngineError> {
        if engines.is_empty() {
            return Err(DeviceError::NoLanes.into());
        }
        Ok(Self {
            engines,
            warned_canvas: AtomicBool::new(false),
        })
    }

    /// The lanes `choice` and `streams` ask for. `device` is the device already opened for
    /// `choice` (and `dtype` chosen for it); it becomes the only lane when one is asked for.
    pub fn open(
        ck: Checkpoint,
        device: Device,
        (dtype, attention): (DType, Attention),
        choice: &DeviceChoice,
        streams: usize,
        warn: &mut dyn FnMut(String),
    ) -> Result<Self, EngineError> {
        if device.is_cpu() {
            return Ok(Self::single(Engine::with_attention(
                ck, device, dtype, attention,
            )?));
        }
        let ids = match choice {
            DeviceChoice::Cuda(ids) => ids.clone(),
            _ => vec![match device.location() {
                candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
                _ => 0,
            }],
        };
        if ids.len() == 1 && streams <= 1 {
            keep_pool_memory(&device, warn);
            return Ok(Self::single(Engine::with_attention(
                ck, device, dtype, attention,
            )?));
        }
        let mut engines = Vec::with_capacity(ids.len() * streams);
        for &id in &ids {
            for _ in 0..streams.max(1) {
                let lane = Device::new_cuda_with_stream(id)
                    .map_err(|source| DeviceError::Open { id, source })?;
                super::gpu_runs_this_build(&lane, id)?;
                skip_event_tracking(&lane);
                keep_pool_memory(&lane, warn);
                engines.push(Engine::with_attention(ck.clone(), lane, dtype, attention)?);
            }
        }
        // `device` is dropped only on return, after the lanes hold the GPU's context, so
        // the context is not torn down and set up again in between.
        Self::from_engines(engines)
    }

    #[cfg(test)]
    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    pub fn count(&self) -> usize {
        self.engines.len()
    }

    /// The most lanes sharing one device, which share its memory.
    pub fn per_device(&self) -> usize {
        let labels: Vec<String> = self
            .engines
            .iter()
            .map(|e| device_label(&e.device))
            .collect();
        labels
            .iter()
            .map(|l| labels.iter().filter(|m| *m == l).count())
            .max()
            .unwrap_or(1)
    }

    /// Concrete tile options for an `h x w` image, with each lane's share of its device's
    /// memory.
    pub fn tile_options(&self, settings: &TileSettings, h: usize, w: usize) -> TileOptions {
        crate::tile::auto::tile_options(&self.engines[0], settings, h, w, self.per_device())
    }

    /// Upscales `image` over all lanes, returning per-lane work alongside. The CPU, and a
    /// GPU whose memory cannot hold the output once per lane, run one lane on the host canvas.
    pub fn run(
        &self,
        image: &Planar,
        opts: &TileOptions,
    ) -> Result<(Planar, TileStats, Vec<LaneStats>), TileError> {
        let (out, stats, lanes) = self.run_unfinished(image, opts, false)?;
        Ok((out.finish()?, stats, lanes))
    }

    /// [`Self::run`] up to the lanes' canvases ([`run_lanes_unfinished`]): with
    /// `defer_download`, a device canvas comes back only when the result is finished.
    pub fn run_unfinished(
        &self,
        image: &Planar,
        opts: &TileOptions,
        defer_download: bool,
    ) -> Result<(Unfinished, TileStats, Vec<LaneStats>), TileError> {
        let run_lanes = |lanes, image, opts, canvas| {
            run_lanes_unfinished(lanes, image, opts, canvas, defer_download)
        };
        let one = &self.engines[..1];
        if self.count() == 1 && self.engines[0].device.is_cpu() {
            return run_lanes(one, image, opts, Canvas::Host);
        }
        if !self.canvases_fit(image) {
            if !self.warned_canvas.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "the output of a {}x{} image does not fit in device memory once per \
                     lane; blending on the host with one lane",
                    image.width,
                    image.height
                );
            }
            return run_lanes(one, image, opts, Canvas::Host);
        }
        run_lanes(&self.engines, image, opts, Canvas::Device)
    }

    /// Upscales `image` on the first lane, blending on the host and handing the output to
    /// `emit` in bands of rows as the tiles finish ([`crate::tile::band::run_banded`]).
    pub fn run_banded<E: From<TileError>>(
        &self,
        image: &Planar,
        settings: &TileSettings,
        emit: impl FnMut(Planar) -> Result<(), E>,
    ) -> Result<(TileStats, Vec<LaneStats>), E> {
        let opts = self.tile_options(settings, image.height, image.width);
        let start = std::time::Instant::now();
        let engine = self.primary();
        let stats = crate::tile::band::run_banded(engine, image, &opts, emit)?;
        let mut lane = LaneStats::new(0, &engine.device);
        lane.batches = stats.batches;
        lane.tiles = stats.tiles;
        lane.busy_seconds = start.elapsed().as_secs_f64();
        Ok((stats, vec![lane]))
    }

    /// Whether every lane's output canvas fits in half of its device's free memory, leaving
    /// the rest for the model.
    fn canvases_fit(&self, image: &Planar) -> bool {
        let s = self.primary().scale() as u64;
        let canvas = (image.channels as u64 + 1) * (image.height * image.width) as u64 * s * s * 4;
        canvas.saturating_mul(self.per_device() as u64) <= self.primary().free_memory() / 2
    }

    /// The distinct devices under the lanes, one handle each.
    pub fn devices(&self) -> Vec<&Device> {
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for e in &self.engines {
            let label = device_label(&e.device);
            if !seen.contains(&label) {
                seen.push(label);
                out.push(&e.device);
            }
        }
        out
    }
}

/// Peak memory of a CUDA device's default pool, which serves every allocation candle makes
/// (weights, activations, canvases); cuBLAS workspaces and the context are outside it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PoolPeak {
    /// "cuda:N".
    pub device: String,
    /// Most bytes in use by allocations at once.
    pub used_high_bytes: u64,
    /// Most bytes the pool held from the device at once.
    pub reserved_high_bytes: u64,
}

/// Makes a CUDA device's default memory pool keep freed memory instead of returning it at
/// every synchronisation, so batch after batch reuses it without new allocations. Failure
/// costs only speed, so it is a warning.
pub fn keep_pool_memory(device: &Device, warn: &mut dyn FnMut(String)) {
    if let Err(e) = pool::set_release_threshold(device, u64::MAX) {
        warn(format!(
            "{}: could not keep freed memory in the pool ({e}); allocations may be slower",
            device_label(device)
        ));
    }
}

/// Stops cudarc from pairing every allocation on `device` with two CUDA events and every
/// kernel argument with an event wait and record. That bookkeeping orders a buffer's uses
/// across streams; a lane's buffers are only ever used on its own stream, so here it is only
/// driver calls (a DRCT-L forward is some 3,000 launches and as many allocations), made
/// under the context's locks that every lane shares. Must run before the device allocates
/// (buffers made earlier keep their events). `UPSCALE_CUDA_EVENT_TRACKING=1` keeps cudarc's
/// default, for a before/after on a GPU.
pub fn skip_event_tracking(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        if crate::switches::current().event_tracking {
            return;
        }
        // SAFETY: nothing allocated on this device so far, and no buffer of it is used on
        // another stream: each device has its own stream (open_device, Lanes::open) and its
        // own weights, input and canvas.
        unsafe { dev.cuda_stream().context().disable_event_tracking() };
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
}

/// Starts the pool's peak counters afresh.
pub fn reset_pool_peaks(device: &Device) {
    let _ = pool::reset_peaks(device);
}

/// The pool's peaks since the last reset; None off CUDA or when the driver does not say.
pub fn pool_peak(device: &Device) -> Option<PoolPeak> {
    let (used_high_bytes, reserved_high_bytes) = pool::peaks(device).ok()?;
    Some(PoolPeak {
        device: device_label(device),
        used_high_bytes,
        reserved_high_bytes,
    })
}

#[cfg(feature = "cuda")]
/// Bytes the pool holds but no allocation uses: free for the next batch, though the
/// driver's free-memory count no longer shows them.
pub fn pool_idle_bytes(device: &Device) -> u64 {
    pool::idle(device).unwrap_or(0)
}

/// Why the memory pool of a device could not be read or set.
#[derive(Debug, thiserror::Error)]
enum PoolError {
    #[error("not a CUDA device")]
    NotCuda,
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Driver(#[from] cudarc::driver::DriverError),
}

#[cfg(feature = "cuda")]
mod pool {
    use std::ffi::c_void;

    use candle_core::Device;
    use cudarc::driver::result::{device::get_default_mem_pool, mem_pool};
    use cudarc::driver::sys::{CUmemPool_attribute, CUmemoryPool};

    use super::PoolError;

    fn default_pool(device: &Device) -> Result<CUmemoryPool, PoolError> {
        let Device::Cuda(dev) = device else {
            return Err(PoolError::NotCuda);
        };
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread()?;
        // SAFETY: the device handle comes from a live context.
        Ok(unsafe { get_default_mem_pool(ctx.cu_device()) }?)
    }

    fn get(pool: CUmemoryPool, attr: CUmemPool_attribute) -> Result<u64, PoolError> {
        let mut v: u64 = 0;
        // SAFETY: the pool is live and these attributes are 64-bit values.
        unsafe { mem_pool::get_attribute(pool, attr, &mut v as *mut u64 as *mut c_void) }?;
        Ok(v)
    }

    fn set(pool: CUmemoryPool, attr: CUmemPool_attribute, value: u64) -> Result<(), PoolError> {
        let mut v = value;
        // SAFETY: as in `get`.
        Ok(unsafe { mem_pool::set_attribute(pool, attr, &mut v as *mut u64 as *mut c_void) }?)
    }

    pub fn set_release_threshold(device: &Device, bytes: u64) -> Result<(), PoolError> {
        if device.is_cpu() {
            return Ok(());
        }
        let pool = default_pool(device)?;
        set(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            bytes,
        )
    }

    pub fn reset_peaks(device: &Device) -> Result<(), PoolError> {
        let pool = default_pool(device)?;
        // The driver accepts only zero for these: it restarts the high-water marks.
        set(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
        set(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            0,
        )
    }

    pub fn peaks(device: &Device) -> Result<(u64, u64), PoolError> {
        let pool = default_pool(device)?;
        Ok((
            get(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            get(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        ))
    }

    pub fn idle(device: &Device) -> Result<u64, PoolError> {
        let pool = default_pool(device)?;
        let reserved = get(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        )?;
        let used = get(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        Ok(reserved.saturating_sub(used))
    }
}

#[cfg(not(feature = "cuda"))]
mod pool {
    use candle_core::Device;

    use super::PoolError;

    pub fn set_release_threshold(_: &Device, _: u64) -> Result<(), std::convert::Infallible> {
        Ok(())
    }

    pub fn reset_peaks(_: &Device) -> Result<(), PoolError> {
        Err(PoolError::NotCuda)
    }

    pub fn peaks(_: &Device) -> Result<(u64, u64), PoolError> {
        Err(PoolError::NotCuda)
    }
}
