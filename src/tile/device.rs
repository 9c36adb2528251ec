//! Tiling that stays on the model's device: the input image is uploaded once, tiles are cut
//! from it there, and each tile's output is blended into a device canvas, which comes back
//! to the host once per image. On a GPU this removes a host round trip per batch; on the CPU
//! it is the same arithmetic as [`super::Accumulator`] and serves as its cross-check.

use candle_core::{CpuStorage, DType, Device, InplaceOp3, Layout, Tensor};

use super::blend::{BlendMode, Weights};
use super::plan::{Plan, Tile};
use crate::planar::Planar;

/// The input image on the device, (C, H, W) f32.
pub struct DeviceInput {
    image: Tensor,
}

impl DeviceInput {
    pub fn upload(image: &Planar, device: &Device) -> candle_core::Result<Self> {
        let image = Tensor::from_slice(
            &image.data,
            (image.channels, image.height, image.width),
            device,
        )?;
        Ok(Self { image })
    }

    /// The tiles of `group` as one (B, C, tile_h, tile_w) batch, copied on the device.
    pub fn cut(&self, plan: &Plan, group: &[Tile]) -> candle_core::Result<Tensor> {
        let views = group
            .iter()
            .map(|t| {
                self.image
                    .narrow(1, t.y.start, plan.tile_h)?
                    .narrow(2, t.x.start, plan.tile_w)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Tensor::stack(&views, 0)
    }
}

/// Every tile's blend profiles as one (tiles, tile_h*s + tile_w*s) f32 table: row k holds
/// tile k's row weights, then its column weights. Built on the host from the same profiles
/// the host accumulator uses, and uploaded once per image.
pub fn weight_table(
    plan: &Plan,
    mode: BlendMode,
    scale: usize,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let mut weights = Weights::new(mode, scale);
    let row = (plan.tile_h + plan.tile_w) * scale;
    let mut table = Vec::with_capacity(plan.tiles.len() * row);
    for t in &plan.tiles {
        table.extend_from_slice(&weights.axis(&t.y));
        table.extend_from_slice(&weights.axis(&t.x));
    }
    Tensor::from_vec(table, (plan.tiles.len(), row), device)
}

/// Weighted sums and the weight sum of an upscaled image on one device: (C + 1, H*s, W*s)
/// f32, the last plane holding the weights.
pub struct DeviceCanvas {
    canvas: Tensor,
    channels: usize,
    height: usize,
    width: usize,
    scale: usize,
}

impl DeviceCanvas {
    /// A zeroed canvas for the `scale`-times upscaled output of a `height`x`width` input.
    pub fn new(
        channels: usize,
        height: usize,
        width: usize,
        scale: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let (h, w) = (height * scale, width * scale);
        let canvas = Tensor::zeros((channels + 1, h, w), DType::F32, device)?;
        Ok(Self {
            canvas,
            channels,
            height: h,
            width: w,
            scale,
        })
    }

    /// Adds tile `index` of `out` (B, C, th*s, tw*s, f32) with the weights of row `row` of
    /// `table` (see [`weight_table`]); `tile` places it in the image.
    pub fn add(
        &self,
        tile: &Tile,
        out: &Tensor,
        index: usize,
        table: &Tensor,
        row: usize,
    ) -> candle_core::Result<()> {
        let op = BlendAdd {
            index,
            row,
            channels: self.channels,
            tile_h: tile.y.len * self.scale,
            tile_w: tile.x.len * self.scale,
            out_h: self.height,
            out_w: self.width,
            oy: tile.y.start * self.scale,
            ox: tile.x.start * self.scale,
        };
        self.canvas.inplace_op3(out, table, &op)
    }

    /// The canvas on the host, (C + 1) planes of H*s x W*s. From a GPU with
    /// `UPSCALE_CUDA_PINNED=1` ([`pinned_downloads`]) it comes through page-locked staging
    /// buffers ([`staged::download`]); otherwise through the driver's copy to pageable memory.
    pub fn download(&self) -> candle_core::Result<Vec<f32>> {
        #[cfg(feature = "cuda")]
        if pinned_downloads() && self.canvas.device().is_cuda() {
            return staged::download(&self.canvas);
        }
        self.canvas.flatten_all()?.to_vec1::<f32>()
    }
}

/// Whether canvases come back from a GPU through page-locked staging buffers:
/// `UPSCALE_CUDA_PINNED=1` ([`crate::switches`]). A copy to pageable memory goes through the
/// driver's own staging, often several times slower than the bus (a 1080p x4 canvas is
/// 530 MB); off until a GPU run has timed both (`benches/matmul_peak.py` measures both rates).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn pinned_downloads() -> bool {
    crate::switches::current().pinned_downloads
}

/// A device tensor brought back through two page-locked buffers per thread: while the host
/// copies one chunk out of one buffer, the next chunk's copy from the device fills the other.
#[cfg(feature = "cuda")]
pub(crate) mod staged {
    use std::cell::RefCell;
    use std::sync::Arc;

    use candle_core::cuda_backend::cudarc::driver::{
        result, CudaContext, CudaStream, CudaView, DevicePtr, HostSlice, PinnedHostSlice,
    };
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{Result, Tensor};

    use crate::ops::rowwise::cuda::held;

    /// f32 values per staging buffer (16 MiB).
    pub(crate) const CHUNK: usize = 4 << 20;

    /// Two staging buffers and the context they are pinned for (dropped after them).
    type Buffers = ([PinnedHostSlice<f32>; 2], Arc<CudaContext>);

    thread_local! {
        /// This thread's buffers, made on its first download.
        static BUFFERS: RefCell<Option<Buffers>> = const { RefCell::new(None) };
    }

    /// `t` (contiguous f32 on a CUDA device), flattened, on the host.
    pub(crate) fn download(t: &Tensor) -> Result<Vec<f32>> {
        let h = held(t, "canvas")?;
        let view = h.view::<f32>()?;
        let dev = h.device()?;
        let stream = dev.cuda_stream();
        let ctx = stream.context().clone();
        let n = view.len();
        let chunks: Vec<(usize, usize)> = (0..n)
            .step_by(CHUNK)
            .map(|start| (start, CHUNK.min(n - start)))
            .collect();
        let mut out = Vec::with_capacity(n);
        BUFFERS.with_borrow_mut(|slot| -> Result<()> {
            if slot.as_ref().is_none_or(|(_, c)| !Arc::ptr_eq(c, &ctx)) {
                // Cacheable page-locked memory (not write-combined: the host reads it).
                // SAFETY: each buffer is written by a copy below before it is read.
                let pin = || unsafe { ctx.alloc_pinned_with_flags::<f32>(CHUNK, 0) }.w();
                *slot = Some(([pin()?, pin()?], ctx.clone()));
            }
            let Some((bufs, _)) = slot.as_mut() else {
                unreachable!("filled above")
            };
            if let Some(&(start, len)) = chunks.first() {
                copy_chunk(&stream, &view.slice(start..start + len), &mut bufs[0])?;
            }
            for (i, &(_, len)) in chunks.iter().enumerate() {
                // The next chunk's copy goes into the buffer the host finished with last.
                if let Some(&(start, next)) = chunks.get(i + 1) {
                    copy_chunk(
                        &stream,
                        &view.slice(start..start + next),
                        &mut bufs[(i + 1) % 2],
                    )?;
                }
                // Waits for this buffer's copy only.
                out.extend_from_slice(&bufs[i % 2].as_slice().w()?[..len]);
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Queues the copy of `src` into the front of `buf` on `stream`. cudarc's `memcpy_dtoh`
    /// copies as many bytes as the whole destination holds, which reads past a chunk shorter
    /// than the buffer (the driver answers CUDA_ERROR_INVALID_VALUE), so the copy is sized
    /// here from the source.
    fn copy_chunk(
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, f32>,
        buf: &mut PinnedHostSlice<f32>,
    ) -> Result<()> {
        let (src_ptr, _read) = src.device_ptr(stream);
        // SAFETY: the slice is used by this copy on `stream` alone; `_write` records the
        // buffer's event on `stream` when dropped, after the copy is queued, so a later
        // `as_slice` waits for it. `src.len() <= CHUNK`, the buffer's length.
        let (dst, _write) = unsafe { buf.stream_synced_mut_slice(stream) };
        // SAFETY: `src_ptr` holds `src.len()` f32 values of the same context, alive while
        // `src` borrows them; the destination is exactly that long.
        unsafe { result::memcpy_dtoh_async(&mut dst[..src.len()], src_ptr, stream.cu_stream()) }.w()
    }
}

/// canvas += weight * tile for one tile of a batch output, in place. The arithmetic is the
/// host accumulator's, operation for operation, so one canvas matches it bit for bit.
struct BlendAdd {
    /// Which tile of the batch output, and which row of the weight table.
    index: usize,
    row: usize,
    channels: usize,
    /// The tile's output extent and its top-left corner in the canvas.
    tile_h: usize,
    tile_w: usize,
    out_h: usize,
    out_w: usize,
    oy: usize,
    ox: usize,
}

impl BlendAdd {
    /// Start offsets of the canvas, the tile's output and its weights, after checking that
    /// every access stays inside its tensor (the kernel trusts these numbers).
    fn offsets(
        &self,
        canvas: &Layout,
        out: &Layout,
        table: &Layout,
    ) -> candle_core::Result<(usize, usize, usize)> {
        let (c, th, tw) = (self.channels, self.tile_h, self.tile_w);
        for (name, l) in [("canvas", canvas), ("tile output", out), ("weights", table)] {
            if !l.is_contiguous() {
                candle_core::bail!("blend_add: {name} must be contiguous");
            }
        }
        if canvas.dims() != [c + 1, self.out_h, self.out_w] {
            candle_core::bail!("blend_add: canvas has shape {:?}", canvas.dims());
        }
        if self.oy + th > self.out_h || self.ox + tw > self.out_w {
            candle_core::bail!(
                "blend_add: a {th}x{tw} tile at ({}, {}) leaves the {}x{} canvas",
                self.oy,
                self.ox,
                self.out_h,
                self.out_w
            );
        }
        match out.dims() {
            &[b, oc, oh, ow] if self.index < b && (oc, oh, ow) == (c, th, tw) => {}
            d => candle_core::bail!(
                "blend_add: tile {} of an output of shape {d:?}, expected (_, {c}, {th}, {tw})",
                self.index
            ),
        }
        match table.dims() {
            &[n, len] if self.row < n && len == th + tw => {}
            d => candle_core::bail!("blend_add: weight row {} of a table {d:?}", self.row),
        }
        Ok((
            canvas.start_offset(),
            out.start_offset() + self.index * c * th * tw,
            table.start_offset() + self.row * (th + tw),
        ))
    }
}

impl InplaceOp3 for BlendAdd {
    fn name(&self) -> &'static str {
        "blend_add"
    }

    fn cpu_fwd(
        &self,
        canvas: &mut CpuStorage,
        canvas_l: &Layout,
        out: &CpuStorage,
        out_l: &Layout,
        table: &CpuStorage,
        table_l: &Layout,
    ) -> candle_core::Result<()> {
        let (co, to, wo) = self.offsets(canvas_l, out_l, table_l)?;
        let (CpuStorage::F32(canvas), CpuStorage::F32(out), CpuStorage::F32(table)) =
            (canvas, out, table)
        else {
            candle_core::bail!("blend_add: f32 tensors only");
        };
        let (c, th, tw) = (self.channels, self.tile_h, self.tile_w);
        let plane = self.out_h * self.out_w;
        let (wy, wx) = table[wo..wo + th + tw].split_at(th);
        let canvas = &mut canvas[co..];
        let out = &out[to..to + c * th * tw];
        for (r, &fy) in wy.iter().enumerate() {
            let row = (self.oy + r) * self.out_w + self.ox;
            for (j, &fx) in wx.iter().enumerate() {
                let w = fy * fx;
                if w == 0.0 {
                    continue;
                }
                for ch in 0..c {
                    canvas[ch * plane + row + j] += w * out[(ch * th + r) * tw + j];
                }
                canvas[c * plane + row + j] += w;
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        canvas: &mut candle_core::CudaStorage,
        canvas_l: &Layout,
        out: &candle_core::CudaStorage,
        out_l: &Layout,
        table: &candle_core::CudaStorage,
        table_l: &Layout,
    ) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;

        let (co, to, wo) = self.offsets(canvas_l, out_l, table_l)?;
        let dev = canvas.device().clone();
        let func = crate::gpu::function(&dev, &crate::gpu::kernels::BLEND, "blend_add_f32")?;
        let u32_arg = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| {
                candle_core::Error::Msg(format!("blend_add: {what} {v} exceeds 32 bits"))
            })
        };
        let channels = u32_arg(self.channels, "channels")?;
        let th = u32_arg(self.tile_h, "tile height")?;
        let tw = u32_arg(self.tile_w, "tile width")?;
        let out_h = u32_arg(self.out_h, "height")?;
        let out_w = u32_arg(self.out_w, "width")?;
        let oy = u32_arg(self.oy, "row")?;
        let ox = u32_arg(self.ox, "column")?;
        const THREADS: u32 = 256;
        // The grid's y extent is capped at 65,535; the kernel strides over further rows.
        let cfg = LaunchConfig {
            grid_dim: (tw.div_ceil(THREADS), th.clamp(1, 65_535), 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let out = out.as_cuda_slice::<f32>()?.slice(to..);
        let table = table.as_cuda_slice::<f32>()?.slice(wo..);
        let mut canvas = canvas.as_cuda_slice_mut::<f32>()?.slice_mut(co..);
        let stream = dev.cuda_stream();
        let mut builder = stream.launch_builder(&func);
        builder.arg(&mut canvas);
        builder.arg(&out);
        builder.arg(&table);
        for v in [&channels, &th, &tw, &out_h, &out_w, &oy, &ox] {
            builder.arg(v);
        }
        // SAFETY: `offsets` checked every index the kernel computes against the tensors'
        // shapes, and the slices come from those tensors' storage.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tile::plan::plan;
    use crate::tile::stitch::finish_canvases;
    use crate::tile::Accumulator;

    /// Deterministic values with NaN planted where a tile's weight is zero, so a leak shows.
    fn tile_outputs(plan: &Plan, c: usize, s: usize, mode: BlendMode) -> Vec<Vec<f32>> {
        let mut weights = Weights::new(mode, s);
        let (th, tw) = (plan.tile_h * s, plan.tile_w * s);
        plan.tiles
            .iter()
            .enumerate()
            .map(|(k, t)| {
                let (wy, wx) = (weights.axis(&t.y), weights.axis(&t.x));
                (0..c * th * tw)
                    .map(|i| {
                        let (r, j) = ((i / tw) % th, i % tw);
                        if wy[r] * wx[j] == 0.0 {
                            f32::NAN
                        } else {
                            ((i * 7919 + k * 104_729) % 1000) as f32 / 997.0
                        }
                    })
                    .collect()
            })
            .collect()
    }

    fn compare(h: usize, w: usize, tile: usize, overlap: usize, s: usize, mode: BlendMode) {
        let c = 3;
        let p = plan(h, w, tile, overlap).unwrap();
        let outputs = tile_outputs(&p, c, s, mode);
        let mut host = Accumulator::new(c, h, w, s, mode);
        for (t, data) in p.tiles.iter().zip(&outputs) {
            host.add(t, data);
        }
        let dev = Device::Cpu;
        let canvas = DeviceCanvas::new(c, h, w, s, &dev).unwrap();
        let table = weight_table(&p, mode, s, &dev).unwrap();
        // Batches of 3 tiles: the table row and the batch index differ.
        for (b, chunk) in outputs.chunks(3).enumerate() {
            let flat: Vec<f32> = chunk.concat();
            let out =
                Tensor::from_vec(flat, (chunk.len(), c, p.tile_h * s, p.tile_w * s), &dev).unwrap();
            for i in 0..chunk.len() {
                let k = 3 * b + i;
                canvas.add(&p.tiles[k], &out, i, &table, k).unwrap();
            }
        }
        let data = canvas.download().unwrap();
        let device = finish_canvases(c, h * s, w * s, vec![data]).unwrap();
        let host = host.finish();
        assert!(device.data.iter().all(|v| v.is_finite()));
        let same = host
            .data
            .iter()
            .zip(&device.data)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{h}x{w} tile {tile} overlap {overlap} x{s} {mode:?}");
    }

    #[test]
    fn canvas_matches_the_host_accumulator_bit_for_bit() {
        for mode in [BlendMode::Hann, BlendMode::Average, BlendMode::None] {
            for s in [1, 2, 3, 4] {
                compare(37, 53, 16, 6, s, mode);
                compare(13, 31, 8, 3, s, mode);
                compare(9, 9, 0, 4, s, mode);
            }
        }
    }

    #[test]
    fn rejects_tiles_outside_the_canvas() {
        let dev = Device::Cpu;
        let p = plan(8, 8, 4, 1).unwrap();
        let canvas = DeviceCanvas::new(1, 4, 4, 2, &dev).unwrap();
        let table = weight_table(&p, BlendMode::Hann, 2, &dev).unwrap();
        let out = Tensor::zeros((1, 1, 8, 8), DType::F32, &dev).unwrap();
        let last = p.tiles.len() - 1;
        let err = canvas.add(&p.tiles[last], &out, 0, &table, last);
        assert!(err.unwrap_err().to_string().contains("leaves"));
        // A batch index past the batch.
        let err = canvas.add(&p.tiles[0], &out, 1, &table, 0);
        assert!(err.unwrap_err().to_string().contains("tile 1"));
    }

    #[test]
    fn cuts_the_same_tiles_as_the_host() {
        let dev = Device::Cpu;
        let data: Vec<f32> = (0..2 * 11 * 13).map(|i| i as f32).collect();
        let image = Planar::new(2, 11, 13, data);
        let p = plan(11, 13, 6, 2).unwrap();
        let input = DeviceInput::upload(&image, &dev).unwrap();
        let batch = input.cut(&p, &p.tiles[1..3]).unwrap();
        assert_eq!(batch.dims(), [2, 2, 6, 6]);
        let t = p.tiles[2];
        let got = batch.get(1).unwrap().get(1).unwrap().get(0).unwrap();
        let want = &image.plane(1)[t.y.start * 13 + t.x.start..][..6];
        assert_eq!(got.to_vec1::<f32>().unwrap(), want);
    }
}
