//! Fused shifted-window attention: one custom op per Swin block's attention, with a CUDA
//! kernel (kernels/window_attention.cu) and a scalar CPU twin that follows the same algorithm.
//!
//! The kernel rebuilds the shift mask from region labels instead of reading a stored
//! `(nW, N, N)` tensor, and never writes the `(windows, heads, N, N)` scores to device memory.
//! The CPU twin exists to check that logic (labels, window and head indexing, the order of the
//! additions) on any machine against the model's CPU attention and its stored mask; the CPU
//! fast path stays [`super::cpu::window_attention`].

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::ops::windows::MASK_VALUE;

/// How window attention runs on CUDA devices. The CPU always runs its own fused f32 kernel
/// (or candle's graph in other dtypes), whatever the choice. The default, `TensorCore`, is the
/// fastest for every device and precision: it runs `Fused` where it has no tensor-core
/// kernel (f32, builds for GPUs before compute capability 8.0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Attention {
    /// One kernel per block: scores stay on chip, the shift mask is computed, not stored.
    Fused,
    /// candle's op graph: matmul, bias, stored mask, softmax, matmul.
    Reference,
    /// The fused kernel with both products on tensor cores (bf16/fp16 inputs, f32 sums; the
    /// probabilities are rounded to the input type); f32, and builds for GPUs before compute
    /// capability 8.0, run `fused`.
    #[default]
    TensorCore,
}

impl Attention {
    /// Whether this choice runs one of the fused CUDA kernels.
    pub fn is_fused(self) -> bool {
        matches!(self, Attention::Fused | Attention::TensorCore)
    }
}

/// Largest head dim the CUDA kernel has a variant for.
pub const MAX_HEAD_DIM: usize = 128;

/// Attention over the windows of `(B, height, width)` feature maps, partitioned row-major into
/// `window x window` windows after a cyclic shift by half a window when `shifted`.
///
/// Inputs: `qkv` `(B*nW, N, 3C)` (q | k | v, each head-major, q already scaled by
/// `head_dim^-0.5`) and `bias` `(heads, N, N)`, both contiguous and of one float dtype. `bias`
/// is a relative-position bias, as the model gathers it from its table
/// ([`crate::ops::windows::relative_position_bias`]): the tensor-core kernel reads one value per
/// (dy, dx) offset, the other paths read all of it.
/// Output: `(B*nW, N, C)` with heads concatenated, in the input dtype; the arithmetic is f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedWindowAttention {
    pub heads: usize,
    pub window: usize,
    pub height: usize,
    pub width: usize,
    pub shifted: bool,
    /// Run bf16/f16 inputs through the tensor-core kernel.
    pub tensor_cores: bool,
}

/// Sizes of one call, checked against each other.
#[derive(Clone, Copy, Debug)]
struct Dims {
    /// Windows in the batch (B * nW).
    windows: usize,
    /// Tokens per window.
    n: usize,
    /// Channels (heads * head_dim).
    c: usize,
    head_dim: usize,
}

impl FusedWindowAttention {
    fn dims(&self, qkv: &Shape, bias: &Shape) -> Result<Dims> {
        let name = self.name();
        let (windows, n, c3) = qkv.dims3()?;
        let ws = self.window;
        if ws == 0 || self.heads == 0 {
            candle_core::bail!(
                "{name}: window {ws} and heads {} must be positive",
                self.heads
            );
        }
        if n != ws * ws {
            candle_core::bail!("{name}: qkv {qkv:?} has {n} tokens per window, not {ws}x{ws}");
        }
        if c3 % 3 != 0 || (c3 / 3) % self.heads != 0 || c3 == 0 {
            candle_core::bail!(
                "{name}: qkv {qkv:?}: last axis is not 3 x heads ({}) x head dim",
                self.heads
            );
        }
        if bias.dims() != [self.heads, n, n] {
            candle_core::bail!("{name}: bias {bias:?}, expected ({}, {n}, {n})", self.heads);
        }
        let (h, w) = (self.height, self.width);
        if h == 0 || w == 0 || h % ws != 0 || w % ws != 0 {
            candle_core::bail!("{name}: map {h}x{w} is not a positive multiple of window {ws}");
        }
        let per_image = (h / ws) * (w / ws);
        if windows % per_image != 0 {
            candle_core::bail!(
                "{name}: {windows} windows are not a whole batch of {h}x{w} maps ({per_image} each)"
            );
        }
        let c = c3 / 3;
        Ok(Dims {
            windows,
            n,
            c,
            head_dim: c / self.heads,
        })
    }

    /// Region label (0..9) of every token of window `win` (row-major within the batch): which
    /// of the 3x3 regions of the rolled map it lies in. Zero everywhere when not shifted.
    fn labels(&self, win: usize, out: &mut [u8]) {
        if self.shifted {
            crate::ops::windows::window_labels(self.height, self.width, self.window, win, out);
        } else {
            out.fill(0);
        }
    }
}

/// The values of a contiguous float storage as f32, borrowed when already f32.
fn f32_values<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [f32]>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("fused window attention: inputs must be contiguous")
    };
    Ok(match storage {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::BF16(v) => Cow::Owned(v[start..end].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F16(v) => Cow::Owned(v[start..end].iter().map(|x| x.to_f32()).collect()),
        other => candle_core::bail!(
            "fused window attention: dtype {:?} is not supported (f32, bf16, f16)",
            other.dtype()
        ),
    })
}

/// Values as f32, borrowed when they already are.
type F32s<'a> = Cow<'a, [f32]>;

/// A twin's `qkv` and `bias` as f32 values; they must share one dtype, as on the device.
fn twin_inputs<'a>(
    name: &str,
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
) -> Result<(F32s<'a>, F32s<'a>)> {
    if s1.dtype() != s2.dtype() {
        candle_core::bail!(
            "{name}: qkv is {:?} but bias is {:?}",
            s1.dtype(),
            s2.dtype()
        );
    }
    Ok((f32_values(s1, l1)?, f32_values(s2, l2)?))
}

impl CustomOp2 for FusedWindowAttention {
    fn name(&self) -> &'static str {
        "fused-window-attention"
    }

    /// A plain scalar version of the kernel's algorithm (f32 throughout, two-pass softmax);
    /// slow, and meant for checking rather than running.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims(l1.shape(), l2.shape())?;
        let (qkv, bias) = twin_inputs(self.name(), (s1, l1), (s2, l2))?;
        let Dims {
            windows,
            n,
            c,
            head_dim: d,
        } = dims;
        let mut out = vec![0f32; windows * n * c];
        out.par_chunks_mut(n * c)
            .enumerate()
            .for_each(|(win, out)| {
                let base = &qkv[win * n * 3 * c..(win + 1) * n * 3 * c];
                let mut labels = vec![0u8; n];
                self.labels(win, &mut labels);
                let mut scores = vec![0f32; n];
                for h in 0..self.heads {
                    let bias = &bias[h * n * n..(h + 1) * n * n];
                    for i in 0..n {
                        let q = &base[i * 3 * c + h * d..][..d];
                        let mut max = f32::NEG_INFINITY;
                        for (j, s) in scores.iter_mut().enumerate() {
                            let k = &base[j * 3 * c + c + h * d..][..d];
                            let dot: f32 = q.iter().zip(k).map(|(a, b)| a * b).sum();
                            // (q·k + bias) + mask, as the reference adds them.
                            *s = dot + bias[i * n + j];
                            if labels[i] != labels[j] {
                                *s += MASK_VALUE;
                            }
                            max = max.max(*s);
                        }
                        let mut sum = 0f32;
                        for s in scores.iter_mut() {
                            *s = (*s - max).exp();
                            sum += *s;
                        }
                        let row = &mut out[i * c + h * d..][..d];
                        row.fill(0.0);
                        for (j, &p) in scores.iter().enumerate() {
                            let v = &base[j * 3 * c + 2 * c + h * d..][..d];
                            row.iter_mut().zip(v).for_each(|(o, v)| *o += p * v);
                        }
                        row.iter_mut().for_each(|o| *o /= sum);
                    }
                }
            });
        let storage = match s1.dtype() {
            DType::F32 => CpuStorage::F32(out),
            DType::BF16 => CpuStorage::BF16(out.into_iter().map(half::bf16::from_f32).collect()),
            DType::F16 => CpuStorage::F16(out.into_iter().map(half::f16::from_f32).collect()),
            dt => candle_core::bail!("{}: dtype {dt:?} is not supported", self.name()),
        };
        Ok((storage, Shape::from((windows, n, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.dims(l1.shape(), l2.shape())?;
        let out = launch::forward(self, dims, s1, l1, s2, l2)?;
        Ok((out, Shape::from((dims.windows, dims.n, dims.c))))
    }
}

#[cfg(feature = "cuda")]
mod launch {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        sys, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, CudaStorageSlice, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, CustomOp2, Layout, Result};

    use super::{Dims, FusedOverlapAttention, FusedWindowAttention, OverlapDims, MAX_HEAD_DIM};

    /// Keys per shared-memory tile; `KEY_TILE` in the kernel.
    /// Whether kernels/window_attention.cu's tensor-core kernels are in the PTX: they need
    /// sm_80 (cp.async, 16-bit mma), and a build for an older GPU leaves them out.
    const TENSOR_CORE_KERNELS_BUILT: bool = crate::gpu::kernels::COMPUTE_CAP >= 800;

    const KEY_TILE: usize = 32;
    /// Head dims each thread of a query row's group holds; `COLS_PER_THREAD` in the kernel.
    const COLS_PER_THREAD: usize = 32;
    /// The kernel's `__launch_bounds__`.
    const MAX_THREADS: usize = 128;

    /// Launch shape for one call: the kernel variant's head-dim bound, threads per block,
    /// query rows per block and dynamic shared memory, laid out as the kernel expects.
    struct Plan {
        dmax: usize,
        threads: usize,
        rows: usize,
        shared_bytes: usize,
    }

    /// The head dim padded to the kernel variant that takes it.
    fn padded_head_dim(head_dim: usize) -> Result<usize> {
        Ok(match head_dim {
            0 => candle_core::bail!("fused window attention: head dim 0"),
            1..=32 => 32,
            33..=64 => 64,
            65..=MAX_HEAD_DIM => MAX_HEAD_DIM,
            _ => candle_core::bail!(
                "fused window attention supports head dims up to {MAX_HEAD_DIM}, this block has \
                 {head_dim} (the reference attention has no such limit)"
            ),
        })
    }

    fn plan(n: usize, head_dim: usize) -> Result<Plan> {
        let dmax = padded_head_dim(head_dim)?;
        let per_row = dmax / COLS_PER_THREAD;
        // Whole warps, and no more than the rows a window has.
        let threads = (n * per_row).next_multiple_of(32).min(MAX_THREADS);
        let rows = threads / per_row;
        // k and v tiles, the bias tile (rows x KEY_TILE+1), the key labels: 4 bytes each.
        let shared_bytes = (2 * KEY_TILE * dmax + rows * (KEY_TILE + 1) + KEY_TILE) * 4;
        Ok(Plan {
            dmax,
            threads,
            rows,
            shared_bytes,
        })
    }

    /// Warps per block of the tensor-core kernel for a padded head dim (`mma_warps`), each
    /// owning 16 query rows.
    fn mma_warps(dp: usize) -> usize {
        match dp {
            0..=32 => 16,
            33..=64 => 8,
            _ => 4,
        }
    }

    /// Keys per staged tile of the tensor-core kernel (`mma_keys`).
    fn mma_keys(dp: usize) -> usize {
        if dp <= 64 {
            64
        } else {
            32
        }
    }

    /// The tensor-core kernel's launch for windows of `window x window` tokens: the head dim
    /// padded to a multiple of 16; two buffers of k and v tiles (`mma_keys` rows of dp + 8
    /// 16-bit values each), the head's bias table (f32) and one int per token of the window.
    fn mma_plan(window: usize, head_dim: usize) -> Result<Plan> {
        padded_head_dim(head_dim)?;
        let dp = head_dim.next_multiple_of(16);
        let (n, side) = (window * window, 2 * window - 1);
        let shared_bytes = 4 * mma_keys(dp) * (dp + 8) * 2 + side * side * 4 + n * 4;
        let warps = mma_warps(dp);
        Ok(Plan {
            dmax: dp,
            threads: warps * 32,
            rows: warps * 16,
            shared_bytes,
        })
    }

    /// `qkv` and `bias` as one dtype's slices, the kernel launched for it as `$launch`
    /// says (`|q, b, dtype| ...`); other or mixed dtypes are an error.
    macro_rules! by_dtype {
        ($op:expr, $s1:expr, $s2:expr, |$q:ident, $b:ident, $dtype:ident| $launch:expr) => {
            match (&$s1.slice, &$s2.slice) {
                (CudaStorageSlice::F32($q), CudaStorageSlice::F32($b)) => {
                    let $dtype = "f32";
                    $launch
                }
                (CudaStorageSlice::BF16($q), CudaStorageSlice::BF16($b)) => {
                    let $dtype = "bf16";
                    $launch
                }
                (CudaStorageSlice::F16($q), CudaStorageSlice::F16($b)) => {
                    let $dtype = "f16";
                    $launch
                }
                _ => candle_core::bail!(
                    "{}: qkv and bias must share one of f32, bf16, f16 (got {:?} and {:?})",
                    $op.name(),
                    $s1.dtype(),
                    $s2.dtype()
                ),
            }
        };
    }

    /// The element ranges (start, end) of the contiguous `qkv` and `bias`.
    type Ranges = ((usize, usize), (usize, usize));

    /// The element ranges of the contiguous `qkv` and `bias`, and where `qkv` starts.
    fn contiguous(name: &str, l1: &Layout, l2: &Layout) -> Result<(Ranges, usize)> {
        match (l1.contiguous_offsets(), l2.contiguous_offsets()) {
            (Some(q), Some(b)) => Ok(((q, b), q.0)),
            _ => candle_core::bail!("{name}: inputs must be contiguous"),
        }
    }

    /// Whether a tensor-core kernel can take these inputs: it takes 16-bit inputs only,
    /// copies 32-bit words (so an even channel count and an even start), and is in the build
    /// only from sm_80 on; anything else runs the scalar kernel, which has none of these
    /// conditions.
    fn takes_tensor_cores(dtype: &str, channels: usize, q0: usize) -> bool {
        TENSOR_CORE_KERNELS_BUILT
            && dtype != "f32"
            && channels.is_multiple_of(2)
            && q0.is_multiple_of(2)
    }

    /// The tensor-core plan when `tensor_cores` and it fits the device's shared memory per
    /// block, else the scalar one (an error when that does not fit either); and whether the
    /// tensor-core one was taken.
    fn choose_plan(
        name: &str,
        dev: &CudaDevice,
        tensor_cores: bool,
        mma: impl FnOnce() -> Result<Plan>,
        scalar: impl FnOnce() -> Result<Plan>,
    ) -> Result<(Plan, bool)> {
        let limit = dev
            .cuda_stream()
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)
            .w()?
            .max(0) as usize;
        let tensor_core_plan = tensor_cores
            .then(mma)
            .transpose()?
            .filter(|p| p.shared_bytes <= limit);
        let mma = tensor_core_plan.is_some();
        let plan = match tensor_core_plan {
            Some(p) => p,
            None => scalar()?,
        };
        if plan.shared_bytes > limit {
            candle_core::bail!(
                "{name}: needs {} bytes of shared memory per block, the device allows {limit}",
                plan.shared_bytes
            );
        }
        Ok((plan, mma))
    }

    fn mma_prefix(mma: bool) -> &'static str {
        if mma {
            "mma_"
        } else {
            ""
        }
    }

    /// Launches `kernel` (of kernels/window_attention.cu) on `qkv` and `bias` (the element
    /// ranges `inputs` of each) into a new `out_len`-element output, with the kernel's
    /// integer arguments after those three.
    fn run<T: CudaDType + DeviceRepr>(
        dev: &CudaDevice,
        kernel: &str,
        (qkv, bias, ((q0, q1), (b0, b1))): (&CudaSlice<T>, &CudaSlice<T>, Ranges),
        out_len: usize,
        args: &[i32],
        cfg: LaunchConfig,
    ) -> Result<CudaStorage> {
        let func = crate::gpu::function(dev, &crate::gpu::kernels::WINDOW_ATTENTION, kernel)?;
        let qkv = qkv.slice(q0..q1);
        let bias = bias.slice(b0..b1);
        // SAFETY: both kernels write every output element before anything reads it.
        let out = unsafe { dev.alloc::<T>(out_len)? };
        let stream = dev.cuda_stream();
        let mut builder = stream.launch_builder(&func);
        builder.arg(&qkv);
        builder.arg(&bias);
        builder.arg(&out);
        for a in args {
            builder.arg(a);
        }
        // SAFETY: the argument list matches the kernel's signature; the sizes were checked
        // against the slices by the callers and the kernel stays inside them.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    fn launch<T: CudaDType + DeviceRepr>(
        op: &FusedWindowAttention,
        dims: Dims,
        dev: &CudaDevice,
        (qkv, l1): (&CudaSlice<T>, &Layout),
        (bias, l2): (&CudaSlice<T>, &Layout),
        dtype: &str,
    ) -> Result<CudaStorage> {
        let name = op.name();
        let (inputs, q0) = contiguous(name, l1, l2)?;
        let tensor_cores = op.tensor_cores && takes_tensor_cores(dtype, dims.c, q0);
        let (plan, mma) = choose_plan(
            name,
            dev,
            tensor_cores,
            || mma_plan(op.window, dims.head_dim),
            || plan(dims.n, dims.head_dim),
        )?;
        let blocks = dims.windows * op.heads;
        let row_blocks = dims.n.div_ceil(plan.rows);
        let to_i32 = |v: usize, what: &str| {
            i32::try_from(v)
                .map_err(|_| candle_core::Error::Msg(format!("{name}: {what} {v} is too large")))
        };
        let args = [
            to_i32(dims.n, "tokens per window")?,
            to_i32(op.heads, "heads")?,
            to_i32(dims.head_dim, "head dim")?,
            to_i32(op.window, "window")?,
            to_i32(op.height, "height")?,
            to_i32(op.width, "width")?,
            i32::from(op.shifted),
        ];
        let cfg = LaunchConfig {
            grid_dim: (
                to_i32(blocks, "windows x heads")? as u32,
                row_blocks as u32,
                1,
            ),
            block_dim: (plan.threads as u32, 1, 1),
            shared_mem_bytes: plan.shared_bytes as u32,
        };
        let kernel = format!("window_attention_{}{dtype}_d{}", mma_prefix(mma), plan.dmax);
        let out_len = dims.windows * dims.n * dims.c;
        run(dev, &kernel, (qkv, bias, inputs), out_len, &args, cfg)
    }

    pub(super) fn forward(
        op: &FusedWindowAttention,
        dims: Dims,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<CudaStorage> {
        by_dtype!(op, s1, s2, |q, b, dtype| launch(
            op,
            dims,
            &s1.device,
            (q, l1),
            (b, l2),
            dtype
        ))
    }

    /// The scalar overlap kernel's launch: the scalar window kernel's rows and tiles for the
    /// `window²` queries, without the key labels (the overlap has no mask).
    fn overlap_plan(n: usize, head_dim: usize) -> Result<Plan> {
        let mut p = plan(n, head_dim)?;
        p.shared_bytes = (2 * KEY_TILE * p.dmax + p.rows * (KEY_TILE + 1)) * 4;
        Ok(p)
    }

    /// The tensor-core overlap kernel's launch: `mma_plan`'s rows and tiles, with the head's
    /// bias by offset ((window + overlap - 1)² floats) and one int per key of the
    /// neighbourhood.
    fn overlap_mma_plan(window: usize, overlap: usize, head_dim: usize) -> Result<Plan> {
        let mut p = mma_plan(window, head_dim)?;
        let side = window + overlap - 1;
        p.shared_bytes =
            4 * mma_keys(p.dmax) * (p.dmax + 8) * 2 + side * side * 4 + overlap * overlap * 4;
        Ok(p)
    }

    fn launch_overlap<T: CudaDType + DeviceRepr>(
        op: &FusedOverlapAttention,
        dims: OverlapDims,
        dev: &CudaDevice,
        (qkv, l1): (&CudaSlice<T>, &Layout),
        (bias, l2): (&CudaSlice<T>, &Layout),
        dtype: &str,
    ) -> Result<CudaStorage> {
        let name = op.name();
        let (inputs, q0) = contiguous(name, l1, l2)?;
        let (ws, ows) = (op.window, op.overlap_window);
        let n = ws * ws;
        let tensor_cores = op.tensor_cores && takes_tensor_cores(dtype, dims.c, q0);
        let (plan, mma) = choose_plan(
            name,
            dev,
            tensor_cores,
            || overlap_mma_plan(ws, ows, dims.head_dim),
            || overlap_plan(n, dims.head_dim),
        )?;
        let windows = dims.batch * (dims.height / ws) * (dims.width / ws);
        let to_i32 = |v: usize, what: &str| {
            i32::try_from(v)
                .map_err(|_| candle_core::Error::Msg(format!("{name}: {what} {v} is too large")))
        };
        let args = [
            to_i32(op.heads, "heads")?,
            to_i32(dims.head_dim, "head dim")?,
            to_i32(ws, "window")?,
            to_i32(ows, "overlap window")?,
            to_i32(dims.height, "height")?,
            to_i32(dims.width, "width")?,
        ];
        let cfg = LaunchConfig {
            grid_dim: (
                to_i32(windows * op.heads, "windows x heads")? as u32,
                n.div_ceil(plan.rows) as u32,
                1,
            ),
            block_dim: (plan.threads as u32, 1, 1),
            shared_mem_bytes: plan.shared_bytes as u32,
        };
        let kernel = format!(
            "overlap_attention_{}{dtype}_d{}",
            mma_prefix(mma),
            plan.dmax
        );
        // Every output element is a query of exactly one window.
        let out_len = dims.batch * dims.height * dims.width * dims.c;
        run(dev, &kernel, (qkv, bias, inputs), out_len, &args, cfg)
    }

    pub(super) fn overlap_forward(
        op: &FusedOverlapAttention,
        dims: OverlapDims,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<CudaStorage> {
        by_dtype!(op, s1, s2, |q, b, dtype| launch_overlap(
            op,
            dims,
            &s1.device,
            (q, l1),
            (b, l2),
            dtype
        ))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn plans_fit_the_default_shared_memory_and_cover_every_row() {
            for n in [16, 64, 256] {
                for d in [1, 3, 30, 32, 33, 53, 64, 77, 122, 128] {
                    let p = plan(n, d).unwrap();
                    assert!(
                        p.shared_bytes <= 48 << 10,
                        "n {n} d {d}: {}",
                        p.shared_bytes
                    );
                    assert!(p.threads <= MAX_THREADS && p.threads.is_multiple_of(32));
                    assert!(p.dmax >= d && p.rows * (p.dmax / COLS_PER_THREAD) == p.threads);
                }
            }
            assert!(plan(256, 129).is_err());
            // Every window up to the released models' 16 fits, whatever the head dim.
            for window in [4, 5, 8, 16] {
                for d in [1, 7, 30, 46, 53, 77, 122, 128] {
                    let p = mma_plan(window, d).unwrap();
                    assert!(p.shared_bytes <= 48 << 10, "d {d}: {}", p.shared_bytes);
                    assert!(p.dmax >= d && p.dmax - d < 16 && p.dmax.is_multiple_of(16));
                    assert!(p.threads <= 512 && p.rows * 2 == p.threads);
                }
            }
            assert!(mma_plan(16, 129).is_err());
            // HAT's overlap (window 16 in 24) for every head dim the kernels take.
            for d in [1, 7, 24, 30, 33, 53, 64, 100, 122, 128] {
                let p = overlap_plan(256, d).unwrap();
                assert!(p.shared_bytes <= 48 << 10, "d {d}: {}", p.shared_bytes);
                assert!(p.dmax >= d && p.rows * (p.dmax / COLS_PER_THREAD) == p.threads);
                let p = overlap_mma_plan(16, 24, d).unwrap();
                assert!(p.shared_bytes <= 48 << 10, "d {d}: {}", p.shared_bytes);
                assert!(p.dmax >= d && p.dmax - d < 16 && p.dmax.is_multiple_of(16));
            }
        }
    }
}

/// Attention of every window of a batch of `(h, w)` maps in one fused op (see
/// [`FusedWindowAttention`]); `qkv` `(B*nW, N, 3C)`, `bias` `(heads, N, N)` in the same dtype.
#[cfg(test)]
pub(crate) fn fused_window_attention(
    qkv: &Tensor,
    bias: &Tensor,
    heads: usize,
    window: usize,
    (height, width): (usize, usize),
    shifted: bool,
) -> Result<Tensor> {
    FusedWindowAttention {
        heads,
        window,
        height,
        width,
        shifted,
        tensor_cores: false,
    }
    .apply(qkv, bias)
}

impl FusedWindowAttention {
    /// The op on `qkv` `(B*nW, N, 3C)` and `bias` `(heads, N, N)` (see the type).
    pub fn apply(&self, qkv: &Tensor, bias: &Tensor) -> Result<Tensor> {
        qkv.contiguous()?
            .apply_op2_no_bwd(&bias.contiguous()?, self)
    }
}

/// HAT's overlapping cross-attention (its OCAB) in one op: the queries of every `window x
/// window` window of `(B, H, W)` token maps attend to the `overlap_window x overlap_window`
/// tokens centred on that window, zero outside the map (as the official code's unfold with
/// zero padding gives: those keys stay in the softmax with the bias alone as their score).
///
/// Inputs: `qkv` `(B, H, W, 3C)`, channels last (q | k | v, each head-major, q already scaled
/// by `head_dim^-0.5`), and `bias` `(heads, window², overlap_window²)` as the model gathers it
/// from its table, both of one float dtype. H and W are multiples of the window.
/// Output: `(B, H, W, C)` with heads concatenated, in the input dtype; the arithmetic is f32.
/// The CUDA kernel reads each window's neighbourhood straight from the map: no padded copy,
/// no gathered keys and values, and the scores never reach device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedOverlapAttention {
    pub heads: usize,
    pub window: usize,
    pub overlap_window: usize,
    /// Run bf16/f16 inputs through the tensor-core kernel (both products as mma.m16n8k16,
    /// f32 sums, the probabilities rounded to the input type), under the window kernel's
    /// conditions; otherwise the scalar kernel runs.
    pub tensor_cores: bool,
}

/// Sizes of one overlap-attention call, checked against each other.
#[derive(Clone, Copy, Debug)]
struct OverlapDims {
    batch: usize,
    height: usize,
    width: usize,
    /// Channels (heads * head_dim).
    c: usize,
    head_dim: usize,
}

impl FusedOverlapAttention {
    fn dims(&self, qkv: &Shape, bias: &Shape) -> Result<OverlapDims> {
        let name = self.name();
        let (batch, height, width, c3) = qkv.dims4()?;
        let (ws, ows) = (self.window, self.overlap_window);
        if ws == 0 || self.heads == 0 || ows < ws || (ows - ws) % 2 != 0 {
            candle_core::bail!(
                "{name}: window {ws} in {ows} with {} heads: the window and the heads must be \
                 positive and the overlap window as large, with even margins",
                self.heads
            );
        }
        if c3 == 0 || c3 % 3 != 0 || (c3 / 3) % self.heads != 0 {
            candle_core::bail!(
                "{name}: qkv {qkv:?}: last axis is not 3 x heads ({}) x head dim",
                self.heads
            );
        }
        if height == 0 || width == 0 || height % ws != 0 || width % ws != 0 {
            candle_core::bail!(
                "{name}: map {height}x{width} is not a positive multiple of window {ws}"
            );
        }
        if bias.dims() != [self.heads, ws * ws, ows * ows] {
            candle_core::bail!(
                "{name}: bias {bias:?}, expected ({}, {}, {})",
                self.heads,
                ws * ws,
                ows * ows
            );
        }
        let c = c3 / 3;
        Ok(OverlapDims {
            batch,
            height,
            width,
            c,
            head_dim: c / self.heads,
        })
    }

    /// The op on `qkv` `(B, H, W, 3C)` and `bias` `(heads, window², overlap_window²)`.
    pub fn apply(&self, qkv: &Tensor, bias: &Tensor) -> Result<Tensor> {
        qkv.contiguous()?
            .apply_op2_no_bwd(&bias.contiguous()?, self)
    }
}

impl CustomOp2 for FusedOverlapAttention {
    fn name(&self) -> &'static str {
        "fused-overlap-attention"
    }

    /// A plain scalar version of the definition (f32, two-pass softmax), for checking the
    /// kernel against; the model's CPU path is [`super::cpu::overlap_attention`].
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims(l1.shape(), l2.shape())?;
        let (qkv, bias) = twin_inputs(self.name(), (s1, l1), (s2, l2))?;
        let OverlapDims {
            batch,
            height,
            width,
            c,
            head_dim: d,
        } = dims;
        let (ws, ows) = (self.window, self.overlap_window);
        let (n, nk, margin) = (ws * ws, ows * ows, (ows - ws) / 2);
        let (nwy, nwx) = (height / ws, width / ws);
        let pixel = |b: usize, y: usize, x: usize| (b * height + y) * width + x;
        // Each window's outputs (n x c), then placed on the map.
        let per_window: Vec<Vec<f32>> = (0..batch * nwy * nwx)
            .into_par_iter()
            .map(|win| {
                let (b, wy, wx) = (win / (nwy * nwx), (win / nwx) % nwy, win % nwx);
                // The map pixel of each key, None outside the map (a zero key and value).
                let keys: Vec<Option<usize>> = (0..nk)
                    .map(|j| {
                        let y = (wy * ws + j / ows).checked_sub(margin)?;
                        let x = (wx * ws + j % ows).checked_sub(margin)?;
                        (y < height && x < width).then(|| pixel(b, y, x))
                    })
                    .collect();
                let mut out = vec![0f32; n * c];
                let mut scores = vec![0f32; nk];
                for h in 0..self.heads {
                    for i in 0..n {
                        let qp = pixel(b, wy * ws + i / ws, wx * ws + i % ws);
                        let q = &qkv[qp * 3 * c + h * d..][..d];
                        let bias = &bias[(h * n + i) * nk..][..nk];
                        let mut max = f32::NEG_INFINITY;
                        for ((s, key), b) in scores.iter_mut().zip(&keys).zip(bias) {
                            let dot: f32 = match key {
                                Some(p) => {
                                    let k = &qkv[p * 3 * c + c + h * d..][..d];
                                    q.iter().zip(k).map(|(a, b)| a * b).sum()
                                }
                                None => 0.0,
                            };
                            *s = dot + b;
                            max = max.max(*s);
                        }
                        let mut sum = 0f32;
                        for s in scores.iter_mut() {
                            *s = (*s - max).exp();
                            sum += *s;
                        }
                        let row = &mut out[i * c + h * d..][..d];
                        for (&p, key) in scores.iter().zip(&keys) {
                            if let Some(kp) = key {
                                let v = &qkv[kp * 3 * c + 2 * c + h * d..][..d];
                                row.iter_mut().zip(v).for_each(|(o, v)| *o += p * v);
                            }
                        }
                        row.iter_mut().for_each(|o| *o /= sum);
                    }
                }
                out
            })
            .collect();
        let mut out = vec![0f32; batch * height * width * c];
        for (win, values) in per_window.iter().enumerate() {
            let (b, wy, wx) = (win / (nwy * nwx), (win / nwx) % nwy, win % nwx);
            for (i, row) in values.chunks_exact(c).enumerate() {
                let p = pixel(b, wy * ws + i / ws, wx * ws + i % ws);
                out[p * c..(p + 1) * c].copy_from_slice(row);
            }
        }
        let storage = match s1.dtype() {
            DType::F32 => CpuStorage::F32(out),
            DType::BF16 => CpuStorage::BF16(out.into_iter().map(half::bf16::from_f32).collect()),
            DType::F16 => CpuStorage::F16(out.into_iter().map(half::f16::from_f32).collect()),
            dt => candle_core::bail!("{}: dtype {dt:?} is not supported", self.name()),
        };
        Ok((storage, Shape::from((batch, height, width, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.dims(l1.shape(), l2.shape())?;
        let out = launch::overlap_forward(self, dims, s1, l1, s2, l2)?;
        Ok((
            out,
            Shape::from((dims.batch, dims.height, dims.width, dims.c)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::windows::{relative_position_bias, RelativeBias, WindowCache};
    use candle_core::Device;

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()
    }

    /// (batch, height, width, window, heads, head dim): non-square maps, odd head dims, one
    /// and several window rows and columns.
    const CASES: [(usize, usize, usize, usize, usize, usize); 6] = [
        (2, 8, 12, 4, 3, 5),
        (2, 16, 8, 4, 2, 3),
        (2, 16, 24, 8, 2, 5),
        (1, 24, 16, 8, 6, 30),
        (2, 8, 16, 8, 1, 7),
        (1, 4, 4, 4, 4, 2),
    ];

    /// Random `(qkv, bias)` for `windows` windows of `ws x ws` tokens, q scaled by `d^-0.5`
    /// as the model does, so scores are a few units: the bias and the mask's -100 both
    /// matter. The bias comes from a random table, gathered, and as the CPU kernel reads it.
    fn inputs(
        windows: usize,
        ws: usize,
        heads: usize,
        d: usize,
    ) -> Result<(Tensor, Tensor, RelativeBias)> {
        let dev = Device::Cpu;
        let (n, c, side) = (ws * ws, heads * d, 2 * ws - 1);
        let q = (Tensor::randn(0f32, 1.0, (windows, n, c), &dev)? * (d as f64).powf(-0.5))?;
        let kv = Tensor::randn(0f32, 1.0, (windows, n, 2 * c), &dev)?;
        let table = Tensor::randn(0f32, 1.0, (side * side, heads), &dev)?;
        Ok((
            Tensor::cat(&[q, kv], 2)?,
            relative_position_bias(&table, ws)?,
            RelativeBias::new(&table, ws)?,
        ))
    }

    /// The fused op against the model's CPU attention with the region labels `WindowCache`
    /// stores.
    fn check_against_the_cpu_kernel(
        (b, h, w, ws, heads, d): (usize, usize, usize, usize, usize, usize),
        shifted: bool,
    ) -> Result<f32> {
        let windows = b * (h / ws) * (w / ws);
        let (qkv, bias, table) = inputs(windows, ws, heads, d)?;
        let cache = WindowCache::new(ws, DType::F32, &Device::Cpu);
        let regions = shifted.then(|| cache.regions(h, w)).transpose()?;
        let want =
            crate::ops::attention::cpu::window_attention(&qkv, &table, regions.as_deref(), None)?
                .expect("the CPU f32 kernel applies");
        let ours = fused_window_attention(&qkv, &bias, heads, ws, (h, w), shifted)?;
        assert_eq!(ours.dims(), want.dims());
        max_abs_diff(&ours, &want)
    }

    #[test]
    fn cpu_twin_matches_the_cpu_kernel() -> Result<()> {
        for case in CASES {
            for shifted in [false, true] {
                let diff = check_against_the_cpu_kernel(case, shifted)?;
                assert!(
                    diff < 1e-5,
                    "{case:?} shifted {shifted}: max abs error {diff}"
                );
            }
        }
        Ok(())
    }

    /// A label rule that differs from the CPU kernel's anywhere must show: every window of the
    /// last row and column has tokens of several regions, and their outputs move by far more
    /// than the tolerance when the mask is wrong (checked here by dropping it altogether).
    #[test]
    fn a_wrong_mask_is_caught() -> Result<()> {
        let (b, h, w, ws, heads, d) = CASES[2];
        let windows = b * (h / ws) * (w / ws);
        let (qkv, bias, table) = inputs(windows, ws, heads, d)?;
        let regions = WindowCache::new(ws, DType::F32, &Device::Cpu).regions(h, w)?;
        let want =
            crate::ops::attention::cpu::window_attention(&qkv, &table, Some(&regions), None)?
                .expect("the CPU f32 kernel applies");
        let unmasked = fused_window_attention(&qkv, &bias, heads, ws, (h, w), false)?;
        assert!(max_abs_diff(&unmasked, &want)? > 1e-2);
        // Transposed map sizes give other region boundaries in a non-square map.
        let transposed = fused_window_attention(&qkv, &bias, heads, ws, (w, h), true)?;
        assert!(max_abs_diff(&transposed, &want)? > 1e-2);
        Ok(())
    }

    #[test]
    fn labels_match_the_stored_mask_everywhere() {
        // Equal labels exactly where the stored mask (what candle's graph adds) is zero, for
        // every window and pair.
        for (h, w, ws) in [
            (8, 12, 4),
            (24, 16, 8),
            (16, 16, 4),
            (4, 8, 4),
            (32, 48, 16),
        ] {
            let n = ws * ws;
            let mask = crate::ops::windows::shift_mask(h, w, ws);
            let op = FusedWindowAttention {
                heads: 1,
                window: ws,
                height: h,
                width: w,
                shifted: true,
                tensor_cores: false,
            };
            let mut labels = vec![0u8; n];
            // Two images' worth of windows: the label depends on the window within its image.
            let per_image = (h / ws) * (w / ws);
            for win in 0..2 * per_image {
                op.labels(win, &mut labels);
                let m = &mask[(win % per_image) * n * n..][..n * n];
                for i in 0..n {
                    for j in 0..n {
                        let same = labels[i] == labels[j];
                        assert_eq!(same, m[i * n + j] == 0.0, "{h}x{w}/{ws} win {win} {i},{j}");
                    }
                }
            }
        }
    }

    #[test]
    fn half_precision_inputs_follow_the_f32_result() -> Result<()> {
        let (b, h, w, ws, heads, d) = CASES[0];
        let windows = b * (h / ws) * (w / ws);
        let (qkv, bias, _) = inputs(windows, ws, heads, d)?;
        for dt in [DType::BF16, DType::F16] {
            let (q, bi) = (qkv.to_dtype(dt)?, bias.to_dtype(dt)?);
            let ours = fused_window_attention(&q, &bi, heads, ws, (h, w), true)?;
            assert_eq!(ours.dtype(), dt);
            // Same op on the rounded inputs in f32: only the output rounding differs.
            let want = fused_window_attention(
                &q.to_dtype(DType::F32)?,
                &bi.to_dtype(DType::F32)?,
                heads,
                ws,
                (h, w),
                true,
            )?;
            let diff = max_abs_diff(&ours, &want)?;
            let eps = if dt == DType::BF16 {
                1.0 / 128.0
            } else {
                1.0 / 1024.0
            };
            // Outputs are convex combinations of v, so |out| <= max |v| (~5 here).
            assert!(diff <= 8.0 * eps, "{dt:?}: {diff}");
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_are_errors() -> Result<()> {
        let dev = Device::Cpu;
        let qkv = Tensor::zeros((4, 16, 18), DType::F32, &dev)?;
        let bias = Tensor::zeros((2, 16, 16), DType::F32, &dev)?;
        // Fine as given: 4 windows of an 8x8 map, window 4, 2 heads of 3.
        fused_window_attention(&qkv, &bias, 2, 4, (8, 8), true)?;
        // Wrong window for 16 tokens, a map that is not a window multiple, windows that are
        // not a whole batch, a bias for another head count, mixed dtypes.
        assert!(fused_window_attention(&qkv, &bias, 2, 8, (8, 8), true).is_err());
        assert!(fused_window_attention(&qkv, &bias, 2, 4, (8, 6), true).is_err());
        assert!(fused_window_attention(&qkv, &bias, 2, 4, (8, 12), true).is_err());
        assert!(fused_window_attention(&qkv, &bias, 3, 4, (8, 8), true).is_err());
        let bias16 = bias.to_dtype(DType::F16)?;
        assert!(fused_window_attention(&qkv, &bias16, 2, 4, (8, 8), true).is_err());
        Ok(())
    }
}
