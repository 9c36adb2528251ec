//! Tiled inference over several lanes at once. A lane is a model with its own device (on
//! a GPU: its own CUDA stream and its own copy of the weights); every lane takes batches of
//! tiles from one shared queue on its own thread, so one lane's transfers and host work
//! overlap another's compute. Each lane blends into its own device canvas
//! ([`super::device`]); the canvases are summed on the host at the end.
//!
//! Out of memory: the batch size halves and the failed batch goes back to the queue, as in
//! [`super::run_tiled`], unless part of it already reached the lane's canvas: then the image
//! starts over with the smaller batches. A single tile that does not fit makes the image
//! start over with smaller tiles.

use std::ops::Range;
use std::sync::Mutex;
use std::time::Instant;

use candle_core::{DType, DeviceLocation, Tensor};

use super::device::{finish_canvases, weight_table, DeviceCanvas, DeviceInput};
use super::plan::{plan, Plan};
use super::{is_out_of_memory, TileError, TileModel, TileOptions, TileStats, MIN_CORE};
use crate::planar::Planar;

/// The work one lane did for one image.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct LaneStats {
    pub lane: usize,
    /// "cpu" or "cuda:N".
    pub device: String,
    pub batches: usize,
    pub tiles: usize,
    /// Wall time spent on batches: cutting, forward, blending and waiting for the device.
    pub busy_seconds: f64,
}

impl LaneStats {
    pub fn new(lane: usize, device: &candle_core::Device) -> Self {
        Self {
            lane,
            device: device_label(device),
            ..Self::default()
        }
    }

    /// Adds another image's work by the same lane.
    pub fn absorb(&mut self, other: &LaneStats) {
        self.batches += other.batches;
        self.tiles += other.tiles;
        self.busy_seconds += other.busy_seconds;
    }
}

pub fn device_label(device: &candle_core::Device) -> String {
    match device.location() {
        DeviceLocation::Cpu => "cpu".into(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Adds per-lane stats of several images (or of an image and its alpha) by lane id.
pub fn merge_lane_stats(total: &mut Vec<LaneStats>, more: &[LaneStats]) {
    for s in more {
        match total.iter_mut().find(|t| t.lane == s.lane) {
            Some(t) => t.absorb(s),
            None => total.push(s.clone()),
        }
    }
    total.sort_by_key(|s| s.lane);
}

/// Upscales `image` on all `lanes` together; see the module documentation. Every lane must
/// be the same network (same scale and weights) on its own device.
pub fn run_lanes<M: TileModel + Sync>(
    lanes: &[M],
    image: &Planar,
    opts: &TileOptions,
) -> Result<(Planar, TileStats, Vec<LaneStats>), TileError> {
    let first = lanes
        .first()
        .ok_or(TileError::Lanes("no lanes to run on"))?;
    let scale = first.scale();
    if scale == 0 {
        return Err(TileError::Lanes("model scale must be positive"));
    }
    if !lanes.iter().all(|m| m.scale() == scale) {
        return Err(TileError::Lanes("all lanes must run the same model"));
    }
    let mut tile = opts.tile;
    let mut batch = opts.batch.max(1);
    let mut oom_retries = 0;
    loop {
        let plan = plan(image.height, image.width, tile, opts.overlap)?;
        let queue = Mutex::new(Queue::new(plan.tiles.len(), batch));
        let work = |(id, model): (usize, &M)| run_lane(id, model, image, &plan, opts, &queue);
        let results: Vec<Lane> = if lanes.len() == 1 {
            vec![work((0, first))]
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = lanes
                    .iter()
                    .enumerate()
                    .map(|lane| scope.spawn(move || work(lane)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .map_err(|_| TileError::Lanes("a tiling lane panicked"))
                    })
                    .collect::<Result<_, _>>()
            })?
        };
        let q = queue.into_inner().unwrap_or_else(|e| e.into_inner());
        if q.oom_retries > 0 && oom_retries == 0 && !opts.quiet {
            eprintln!("warning: out of memory; retrying with smaller batches or tiles");
        }
        oom_retries += q.oom_retries;
        batch = q.batch;
        match q.stop {
            None => {}
            Some(Stop::Failed(err)) => return Err(err.into()),
            // The queue has halved the batch already.
            Some(Stop::Restart) => continue,
            Some(Stop::Shrink(err)) => {
                let current = plan.tile_h.max(plan.tile_w);
                let smaller = (current / 2).max(2 * opts.overlap + MIN_CORE);
                if smaller >= current {
                    return Err(TileError::OutOfMemory {
                        h: plan.tile_h,
                        w: plan.tile_w,
                        source: err,
                    });
                }
                tile = smaller;
                continue;
            }
        }
        let mut canvases = Vec::new();
        let mut stats = Vec::with_capacity(results.len());
        for lane in results {
            canvases.extend(lane.canvas);
            stats.push(lane.stats);
        }
        let out = finish_canvases(
            image.channels,
            image.height * scale,
            image.width * scale,
            canvases,
        )?;
        let tile_stats = TileStats {
            tiles: plan.tiles.len(),
            batches: stats.iter().map(|s| s.batches).sum(),
            tile_shape: (plan.tile_h, plan.tile_w),
            batch,
            oom_retries,
        };
        return Ok((out, tile_stats, stats));
    }
}

enum Stop {
    /// Not a memory problem: give up.
    Failed(candle_core::Error),
    /// Out of memory after a batch reached a canvas: start the image over, smaller batches.
    Restart,
    /// Out of memory with one tile: start the image over with smaller tiles.
    Shrink(candle_core::Error),
}

/// The shared queue of tiles, handed out as consecutive ranges of at most `batch` tiles.
struct Queue {
    len: usize,
    /// First tile never handed out.
    next: usize,
    /// Tiles handed back after an out-of-memory error, taken before new ones.
    returned: Vec<Range<usize>>,
    batch: usize,
    oom_retries: usize,
    stop: Option<Stop>,
}

impl Queue {
    fn new(len: usize, batch: usize) -> Self {
        Self {
            len,
            next: 0,
            returned: Vec::new(),
            batch,
            oom_retries: 0,
            stop: None,
        }
    }

    fn take(&mut self) -> Option<Range<usize>> {
        if self.stop.is_some() {
            return None;
        }
        if let Some(r) = self.returned.pop() {
            if r.len() > self.batch {
                self.returned.push(r.start + self.batch..r.end);
                return Some(r.start..r.start + self.batch);
            }
            return Some(r);
        }
        if self.next >= self.len {
            return None;
        }
        let start = self.next;
        self.next = (start + self.batch).min(self.len);
        Some(start..self.next)
    }

    /// A lane failed on `range`; `clean` when nothing of it reached the lane's canvas.
    fn fail(&mut self, range: Range<usize>, err: candle_core::Error, clean: bool) {
        if !is_out_of_memory(&err) {
            self.stop.get_or_insert(Stop::Failed(err));
            return;
        }
        self.oom_retries += 1;
        if range.len() == 1 {
            self.stop.get_or_insert(Stop::Shrink(err));
            return;
        }
        self.batch = self.batch.min(range.len() / 2).max(1);
        if !clean {
            self.stop.get_or_insert(Stop::Restart);
        } else if self.returned.is_empty() && range.end == self.next {
            // Rewinding when no one took tiles past these keeps one lane's order (and so its
            // sums, bit for bit) the same as without the failure.
            self.next = range.start;
        } else {
            self.returned.push(range);
        }
    }

    /// An error after the lane's last batch, downloading its canvas.
    fn abort(&mut self, err: candle_core::Error) {
        self.stop.get_or_insert(Stop::Failed(err));
    }
}

/// What one lane hands back: its stats and its downloaded canvas, if it did any work.
struct Lane {
    stats: LaneStats,
    canvas: Option<Vec<f32>>,
}

/// The per-image state of a lane, made when it takes its first batch.
struct LaneImage {
    input: DeviceInput,
    weights: Tensor,
    canvas: DeviceCanvas,
}

fn run_lane<M: TileModel>(
    id: usize,
    model: &M,
    image: &Planar,
    plan: &Plan,
    opts: &TileOptions,
    queue: &Mutex<Queue>,
) -> Lane {
    let lock = || queue.lock().unwrap_or_else(|e| e.into_inner());
    let device = model.device();
    let scale = model.scale();
    let mut stats = LaneStats::new(id, device);
    let mut state: Option<LaneImage> = None;
    loop {
        let Some(range) = lock().take() else { break };
        let start = Instant::now();
        let st = match &state {
            Some(st) => st,
            None => {
                let made = (|| {
                    Ok::<_, candle_core::Error>(LaneImage {
                        input: DeviceInput::upload(image, device)?,
                        weights: weight_table(plan, opts.blend, scale, device)?,
                        canvas: DeviceCanvas::new(
                            image.channels,
                            image.height,
                            image.width,
                            scale,
                            device,
                        )?,
                    })
                })();
                match made {
                    Ok(st) => state.insert(st),
                    Err(err) => {
                        lock().fail(range, err, false);
                        continue;
                    }
                }
            }
        };
        let mut touched = false;
        match run_batch(model, plan, st, range.clone(), &mut touched) {
            Ok(()) => {
                stats.batches += 1;
                stats.tiles += range.len();
                stats.busy_seconds += start.elapsed().as_secs_f64();
            }
            // The queue decides: retry the tiles smaller (this lane carries on) or stop.
            Err(err) => lock().fail(range, err, !touched),
        }
    }
    let canvas = match state.map(|st| st.canvas.download()).transpose() {
        Ok(c) => c,
        Err(err) => {
            lock().abort(err);
            None
        }
    };
    Lane { stats, canvas }
}

fn run_batch<M: TileModel>(
    model: &M,
    plan: &Plan,
    st: &LaneImage,
    range: Range<usize>,
    touched: &mut bool,
) -> candle_core::Result<()> {
    let group = &plan.tiles[range.clone()];
    let x = st.input.cut(plan, group)?;
    let y = model.forward_batch(&x)?;
    let s = model.scale();
    let expected = [group.len(), x.dim(1)?, plan.tile_h * s, plan.tile_w * s];
    if y.dims() != expected {
        candle_core::bail!(
            "model returned shape {:?} for input {:?}, expected {expected:?}",
            y.dims(),
            x.dims()
        );
    }
    let y = y.to_dtype(DType::F32)?.contiguous()?;
    *touched = true;
    for (i, (k, t)) in range.zip(group).enumerate() {
        st.canvas.add(t, &y, i, &st.weights, k)?;
    }
    // One batch in flight per lane: memory stays bounded, the busy time is real, and a lane
    // takes its next batch only when it can start it, which balances the lanes.
    model.device().synchronize()
}
