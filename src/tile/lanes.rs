//! The tile scheduler. A lane is a model with its own device (on a GPU: its own CUDA stream
//! and its own copy of the weights); every lane takes batches of tiles from one shared queue
//! on its own thread, so one lane's transfers and host work overlap another's compute. Each
//! lane blends into its own canvas, on the host or on its device ([`Canvas`]); the canvases
//! are summed on the host at the end. [`super::run_tiled`] is one lane on the host.
//!
//! Out of memory: the batch size halves and the failed batch goes back to the queue, unless
//! part of it already reached the lane's canvas: then the image starts over with the smaller
//! batches. A single tile that does not fit makes the image start over with smaller tiles.

use std::ops::Range;
use std::sync::Mutex;
use std::time::Instant;

use candle_core::{DType, DeviceLocation, Tensor};

use super::device::{weight_table, DeviceCanvas, DeviceInput};
use super::plan::{plan, Plan, Tile};
use super::stitch::{finish_canvases, Accumulator};
use super::{is_out_of_memory, TileError, TileModel, TileOptions, TileStats, MIN_CORE};
use crate::planar::Planar;

/// Where each lane cuts its tiles and blends their outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Canvas {
    /// On the host: each batch is cut from the host image and its output comes back (on the
    /// CPU this copies nothing twice; on a GPU it is the fallback when the output does not
    /// fit in device memory).
    Host,
    /// On the lane's device: the image is uploaded once, tiles are cut and blended there, and
    /// the canvas comes back once per image.
    Device,
}

/// The work one lane did for one image.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct LaneStats {
    /// The lane's number, from 0.
    pub lane: usize,
    /// "cpu" or "cuda:N".
    pub device: String,
    /// Forward passes the lane ran.
    pub batches: usize,
    /// Tiles in those passes.
    pub tiles: usize,
    /// Wall time spent on batches: cutting, forward, blending and waiting for the device.
    pub busy_seconds: f64,
    /// Wall time spent putting the image on the lane's device (with the blend weights and
    /// the canvas) and bringing the canvas back.
    pub transfer_seconds: f64,
    /// The part of `transfer_seconds` during which another lane was running a batch: the
    /// copies that compute hid.
    pub transfer_overlap_seconds: f64,
}

impl LaneStats {
    /// Adds per-lane stats of several images (or of an image and its alpha) into `total` by
    /// lane number, keeping it sorted by lane.
    pub fn merge(total: &mut Vec<LaneStats>, more: &[LaneStats]) {
        for s in more {
            match total.iter_mut().find(|t| t.lane == s.lane) {
                Some(t) => t.absorb(s),
                None => total.push(s.clone()),
            }
        }
        total.sort_by_key(|s| s.lane);
    }

    pub(crate) fn new(lane: usize, device: &candle_core::Device) -> Self {
        Self {
            lane,
            device: device_label(device),
            ..Self::default()
        }
    }

    /// Adds another image's work by the same lane.
    pub(crate) fn absorb(&mut self, other: &LaneStats) {
        self.batches += other.batches;
        self.tiles += other.tiles;
        self.busy_seconds += other.busy_seconds;
        self.transfer_seconds += other.transfer_seconds;
        self.transfer_overlap_seconds += other.transfer_overlap_seconds;
    }
}

/// A stretch of wall time, in seconds from the start of an image's run.
type Span = (f64, f64);

/// How much of `span` lies inside the union of `others` (which may overlap each other).
fn covered(span: Span, others: &[Span]) -> f64 {
    let mut clipped: Vec<Span> = others
        .iter()
        .map(|&(a, b)| (a.max(span.0), b.min(span.1)))
        .filter(|(a, b)| b > a)
        .collect();
    clipped.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut total = 0.0;
    let mut reach = f64::NEG_INFINITY;
    for (a, b) in clipped {
        let from = a.max(reach);
        if b > from {
            total += b - from;
        }
        reach = reach.max(b);
    }
    total
}

/// Fills in each lane's `transfer_overlap_seconds` from the spans the lanes recorded.
fn account_overlap(lanes: &mut [Lane]) {
    for i in 0..lanes.len() {
        let others: Vec<Span> = lanes
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .flat_map(|(_, l)| l.batch_spans.iter().copied())
            .collect();
        let hidden = lanes[i]
            .transfer_spans
            .iter()
            .map(|&s| covered(s, &others))
            .sum();
        lanes[i].stats.transfer_overlap_seconds = hidden;
    }
}

pub fn device_label(device: &candle_core::Device) -> String {
    match device.location() {
        DeviceLocation::Cpu => "cpu".into(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Upscales `image` on all `lanes` together, each blending on a canvas of kind `canvas`; see
/// the module documentation. Every lane must be the same network (same scale and weights) on
/// its own device.
#[cfg(test)]
pub fn run_lanes<M: TileModel + Sync>(
    lanes: &[M],
    image: &Planar,
    opts: &TileOptions,
    canvas: Canvas,
) -> Result<(Planar, TileStats, Vec<LaneStats>), TileError> {
    let (out, stats, lanes) = run_lanes_unfinished(lanes, image, opts, canvas, false)?;
    Ok((out.finish()?, stats, lanes))
}

/// [`run_lanes`] up to the lanes' canvases, which [`Unfinished::finish`] sums and
/// normalises. With `defer_download`, device canvases stay on their devices until then, so
/// a caller can bring one image back and finish it on another thread while the lanes start
/// on the next; otherwise each lane brings its canvas back as it ends, as [`run_lanes`] does.
pub fn run_lanes_unfinished<M: TileModel + Sync>(
    lanes: &[M],
    image: &Planar,
    opts: &TileOptions,
    canvas: Canvas,
    defer_download: bool,
) -> Result<(Unfinished, TileStats, Vec<LaneStats>), TileError> {
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
        let t0 = Instant::now();
        let work = |(id, model): (usize, &M)| {
            run_lane(
                id,
                model,
                (image, &plan, opts, canvas),
                &queue,
                (t0, defer_download),
            )
        };
        let mut results: Vec<Lane> = if lanes.len() == 1 {
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
        if q.oom_retries > 0 && oom_retries == 0 {
            log::warn!("out of memory; retrying with smaller batches or tiles");
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
        account_overlap(&mut results);
        let mut canvases = Vec::new();
        let mut stats = Vec::with_capacity(results.len());
        for lane in results {
            canvases.extend(lane.canvas);
            stats.push(lane.stats);
        }
        let out = Unfinished {
            channels: image.channels,
            height: image.height * scale,
            width: image.width * scale,
            canvases,
        };
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

/// An upscaled image as the lanes left it: one canvas per lane that did any work, on the
/// host or still on its device.
pub struct Unfinished {
    channels: usize,
    height: usize,
    width: usize,
    canvases: Vec<LaneCanvas>,
}

impl Unfinished {
    /// Brings the canvases still on a device back, sums them and divides by the blend
    /// weights: the upscaled image.
    pub fn finish(self) -> candle_core::Result<Planar> {
        let (c, h, w) = (self.channels, self.height, self.width);
        let mut canvases = self.canvases;
        if let [LaneCanvas::Whole(data)] = canvases.as_mut_slice() {
            if data.len() != c * h * w {
                candle_core::bail!(
                    "the whole-image tile holds {} values, expected {}",
                    data.len(),
                    c * h * w
                );
            }
            return Ok(Planar::new(c, h, w, std::mem::take(data)));
        }
        let canvases = canvases
            .into_iter()
            .map(|canvas| match canvas {
                LaneCanvas::Host(data) => Ok(data),
                // As an accumulator would hold it: the sums, then weights of 1.
                LaneCanvas::Whole(mut data) => {
                    data.resize(data.len() + h * w, 1.0);
                    Ok(data)
                }
                LaneCanvas::Device(canvas) => canvas.download(),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        finish_canvases(self.channels, self.height, self.width, canvases)
    }
}

/// One lane's weighted sums for an image.
enum LaneCanvas {
    Host(Vec<f32>),
    /// The output of a plan of one whole-image tile ([`Plan::is_whole`]): the image itself.
    Whole(Vec<f32>),
    Device(DeviceCanvas),
}

/// What one lane hands back: its stats and its canvas, if it did any work.
struct Lane {
    stats: LaneStats,
    canvas: Option<LaneCanvas>,
    /// When the lane set up its image and brought its canvas back, and when it ran batches.
    transfer_spans: Vec<Span>,
    batch_spans: Vec<Span>,
}

/// The per-image state of a lane, made when it takes its first batch.
enum LaneImage {
    Host(Accumulator),
    /// A plan of one whole-image tile on the host: its output, once it has run. Accumulating
    /// it would zero a canvas and a weight plane, add into them and divide by ones.
    Whole(Option<Vec<f32>>),
    Device {
        input: DeviceInput,
        weights: Tensor,
        canvas: DeviceCanvas,
    },
}

impl LaneImage {
    fn new<M: TileModel>(model: &M, (image, plan, opts, canvas): Job) -> candle_core::Result<Self> {
        let (device, scale) = (model.device(), model.scale());
        let (c, h, w) = (image.channels, image.height, image.width);
        Ok(match canvas {
            Canvas::Host if plan.is_whole() => Self::Whole(None),
            Canvas::Host => Self::Host(Accumulator::new(c, h, w, scale, opts.blend)),
            Canvas::Device => {
                let st = Self::Device {
                    input: DeviceInput::upload(image, device)?,
                    weights: weight_table(plan, opts.blend, scale, device)?,
                    canvas: DeviceCanvas::new(c, h, w, scale, device)?,
                };
                device.synchronize()?;
                st
            }
        })
    }

    /// The lane's canvas, brought back to the host unless `defer_download`.
    fn into_canvas(self, defer_download: bool) -> candle_core::Result<LaneCanvas> {
        Ok(match self {
            Self::Host(acc) => LaneCanvas::Host(acc.into_canvas()),
            Self::Whole(Some(data)) => LaneCanvas::Whole(data),
            Self::Whole(None) => candle_core::bail!("the whole-image tile did not run"),
            Self::Device { canvas, .. } if defer_download => LaneCanvas::Device(canvas),
            Self::Device { canvas, .. } => LaneCanvas::Host(canvas.download()?),
        })
    }
}

/// What every lane works on: the image, its tile plan, the options and the canvas kind.
type Job<'a> = (&'a Planar, &'a Plan, &'a TileOptions, Canvas);

fn run_lane<M: TileModel>(
    id: usize,
    model: &M,
    job: Job,
    queue: &Mutex<Queue>,
    (t0, defer_download): (Instant, bool),
) -> Lane {
    let (image, plan, _, canvas_kind) = job;
    let lock = || queue.lock().unwrap_or_else(|e| e.into_inner());
    let mut stats = LaneStats::new(id, model.device());
    let (mut transfer_spans, mut batch_spans) = (Vec::new(), Vec::new());
    let since = |t: Instant| t.duration_since(t0).as_secs_f64();
    let mut state: Option<LaneImage> = None;
    loop {
        let Some(range) = lock().take() else { break };
        let st = match &mut state {
            Some(st) => st,
            None => {
                let start = Instant::now();
                let made = LaneImage::new(model, job);
                if canvas_kind == Canvas::Device {
                    transfer_spans.push((since(start), since(Instant::now())));
                }
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
        let start = Instant::now();
        let done = run_batch(model, (image, plan), st, range.clone(), &mut touched);
        batch_spans.push((since(start), since(Instant::now())));
        match done {
            Ok(()) => {
                stats.batches += 1;
                stats.tiles += range.len();
                stats.busy_seconds += start.elapsed().as_secs_f64();
            }
            // The queue decides: retry the tiles smaller (this lane carries on) or stop.
            Err(err) => lock().fail(range, err, !touched),
        }
    }
    let start = Instant::now();
    let canvas = match state.map(|st| st.into_canvas(defer_download)).transpose() {
        Ok(c) => c,
        Err(err) => {
            lock().abort(err);
            None
        }
    };
    if canvas.is_some() && canvas_kind == Canvas::Device && !defer_download {
        transfer_spans.push((since(start), since(Instant::now())));
    }
    stats.transfer_seconds = transfer_spans.iter().map(|(a, b)| b - a).sum();
    Lane {
        stats,
        canvas,
        transfer_spans,
        batch_spans,
    }
}

fn run_batch<M: TileModel>(
    model: &M,
    (image, plan): (&Planar, &Plan),
    st: &mut LaneImage,
    range: Range<usize>,
    touched: &mut bool,
) -> candle_core::Result<()> {
    let group = &plan.tiles[range.clone()];
    let x = match st {
        LaneImage::Host(_) | LaneImage::Whole(_) => {
            cut_on_host(image, plan, group, model.device())?
        }
        LaneImage::Device { input, .. } => input.cut(plan, group)?,
    };
    let y = forward_checked(model, &x, plan)?;
    match st {
        LaneImage::Whole(slot) => {
            *slot = Some(y.flatten_all()?.to_vec1::<f32>()?);
            *touched = true;
            Ok(())
        }
        LaneImage::Host(acc) => {
            let out = y.flatten_all()?.to_vec1::<f32>()?;
            *touched = true;
            for (t, data) in group.iter().zip(out.chunks(out.len() / group.len())) {
                acc.add(t, data);
            }
            Ok(())
        }
        LaneImage::Device {
            weights, canvas, ..
        } => {
            *touched = true;
            for (i, (k, t)) in range.zip(group).enumerate() {
                canvas.add(t, &y, i, weights, k)?;
            }
            // One batch in flight per lane: memory stays bounded, the busy time is real, and
            // a lane takes its next batch only when it can start it, which balances the lanes.
            model.device().synchronize()
        }
    }
}

/// The model's output for the batch `x` of `plan`'s tiles, checked for shape, as contiguous
/// f32.
pub(super) fn forward_checked<M: TileModel>(
    model: &M,
    x: &Tensor,
    plan: &Plan,
) -> candle_core::Result<Tensor> {
    let y = model.forward_batch(x)?;
    let s = model.scale();
    let expected = [x.dim(0)?, x.dim(1)?, plan.tile_h * s, plan.tile_w * s];
    if y.dims() != expected {
        candle_core::bail!(
            "model returned shape {:?} for input {:?}, expected {expected:?}",
            y.dims(),
            x.dims()
        );
    }
    y.to_dtype(DType::F32)?.contiguous()
}

/// The tiles of `group` cut from the host image as one (B, C, tile_h, tile_w) batch on
/// `device`.
pub(super) fn cut_on_host(
    image: &Planar,
    plan: &Plan,
    group: &[Tile],
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let (c, th, tw) = (image.channels, plan.tile_h, plan.tile_w);
    let mut input = Vec::with_capacity(group.len() * c * th * tw);
    for t in group {
        for ch in 0..c {
            let plane = image.plane(ch);
            for y in t.y.start..t.y.end() {
                input.extend_from_slice(&plane[y * image.width + t.x.start..][..tw]);
            }
        }
    }
    Tensor::from_vec(input, (group.len(), c, th, tw), device)
}

#[cfg(test)]
mod tests {
    use super::covered;

    #[test]
    fn covered_counts_the_union_of_overlapping_spans_inside_the_span() {
        assert_eq!(covered((1.0, 2.0), &[]), 0.0);
        // Outside on both sides, touching the ends: nothing.
        assert_eq!(covered((1.0, 2.0), &[(0.0, 1.0), (2.0, 3.0)]), 0.0);
        // Clipped to the span.
        assert_eq!(covered((1.0, 2.0), &[(0.5, 1.25)]), 0.25);
        // Overlapping others counted once, in any order.
        assert_eq!(
            covered((0.0, 4.0), &[(2.0, 3.0), (0.5, 1.5), (1.0, 2.5)]),
            2.5
        );
        // Nested and disjoint.
        assert_eq!(
            covered((0.0, 10.0), &[(1.0, 5.0), (2.0, 3.0), (6.0, 7.0)]),
            5.0
        );
        // Covering the whole span.
        assert_eq!(covered((1.0, 2.0), &[(0.0, 5.0), (1.5, 1.75)]), 1.0);
    }
}
